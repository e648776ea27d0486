"""`list`: every implementation, whether it can run here, and why or why not."""

from __future__ import annotations

import sys

import torch

from attnscope.attention import IMPLEMENTATIONS
from attnscope.profile.inputs import resolve_device

HELP = "list the implementations and whether each is available on this machine, with the reason"


def add_arguments(p):
    p.add_argument("--device", choices=("cuda", "cpu"),
                   help="check availability for this device (default cuda when present, else cpu)")


def run(args) -> int:
    try:
        device = torch.device(resolve_device(args.device))
    except ValueError as e:
        print(f"attnscope list: error: {e}", file=sys.stderr, flush=True)
        return 2
    width = max(map(len, IMPLEMENTATIONS))
    print(f"implementations on {device.type}:")
    for name, impl in IMPLEMENTATIONS.items():
        ok, reason = impl.available(device)
        seed = f" [{impl.seed_script}]" if impl.seed_script else ""
        print(f"  {name:<{width}}  {'yes' if ok else 'no ':<3}  {reason}")
        print(f"  {'':<{width}}       {impl.description}{seed}")
    return 0
