"""The profiler driver, `python -m attnscope.profile` (cli.py): compare, bench, analyze, ncu,
report and list, one module each; it reaches the kernels only through the registry
(attnscope.attention), never attnscope.kernels."""
