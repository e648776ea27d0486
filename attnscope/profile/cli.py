"""`python -m attnscope.profile` / `attnscope`: one parser, one module per subcommand.

Each subcommand module exposes HELP (one line), add_arguments(parser) and run(args) -> exit code.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# subcommand -> module under attnscope.profile; `compare` runs when none is named.
SUBCOMMANDS = {
    "compare": "compare",
    "analyze": "analyze",
    "bench": "bench",
    "ncu": "ncu",
    "report": "report",
    "list": "listing",
}
DEFAULT = "compare"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnscope",
        description="Profile causal-attention implementations side by side: kernels per forward, "
        "Tensor Core use with evidence, CUDA/CPU time, TFLOP/s, memory and error.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(f"attnscope.profile.{module_name}")
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and not argv[0].startswith("-") and argv[0] not in SUBCOMMANDS:
        # a word where a command goes: a mistyped command, not compare's arguments
        print(f"attnscope: error: unknown command {argv[0]!r}; the commands: "
              f"{', '.join(SUBCOMMANDS)} (none: {DEFAULT})", file=sys.stderr)
        return 2
    if not argv or (argv[0] not in SUBCOMMANDS and argv[0] not in ("-h", "--help")):
        argv = [DEFAULT, *argv]
    # Ctrl-C at any moment, start-up (importing the subcommands pulls in torch) included: one
    # line and the shell's exit status for SIGINT, no traceback.
    try:
        args = build_parser().parse_args(argv)
        return args._run(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # stdout piped into a reader that stopped (`| head`): no traceback, and the exit status
        # of a process SIGPIPE ended. Python's flush at exit would raise again: stdout now
        # writes to the null device.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13
