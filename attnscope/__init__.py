"""attnscope: fused causal-attention kernels (Triton, Gluon on Hopper, a split-KV decode kernel)
behind `fused_attention`, `fused_attention_varlen` and `fused_attention_with_kvcache`, and a
driver (`python -m attnscope.profile`) that profiles them against PyTorch's attention
implementations, FlexAttention, FlashAttention and the kernel hub's."""

import os as _os
import sys as _sys


def _started_as_cli():
    # `python -m attnscope.profile ...` or the `attnscope` console script: the process whose
    # Ctrl-C during start-up (importing torch takes seconds) should end in one line, not a
    # traceback through the import machinery. sys.orig_argv holds the interpreter's own command
    # line (Python >= 3.10).
    argv = getattr(_sys, "orig_argv", [])
    if "-m" in argv and argv[argv.index("-m") + 1:argv.index("-m") + 2] == ["attnscope.profile"]:
        return True
    return bool(_sys.argv) and _os.path.basename(_sys.argv[0]) == "attnscope"


try:
    import torch as _torch

    # Without a CUDA device Triton kernels run only in Triton's interpreter, and Triton reads
    # TRITON_INTERPRET as it is first imported (its own library functions are jit functions
    # too), so it is set here, before anything below imports triton. An explicit
    # TRITON_INTERPRET=0 stays.
    if not _torch.cuda.is_available():
        _os.environ.setdefault("TRITON_INTERPRET", "1")

    from attnscope._version import __version__  # noqa: E402
    from attnscope.attention import IMPLEMENTATIONS  # noqa: E402
    from attnscope.attention.fused import fused_attention  # noqa: E402
    from attnscope.attention.decode import fused_attention_with_kvcache  # noqa: E402
    from attnscope.attention.varlen import fused_attention_varlen  # noqa: E402
except KeyboardInterrupt:
    if not _started_as_cli():  # a library import: the caller's Ctrl-C handling applies
        raise
    print("interrupted", file=_sys.stderr)
    raise SystemExit(130) from None

__all__ = ["IMPLEMENTATIONS", "__version__", "fused_attention", "fused_attention_varlen",
           "fused_attention_with_kvcache"]
