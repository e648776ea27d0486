"""The registry of attention implementations the driver compares.

Each entry knows how to check whether it can run here and how to build a zero-argument
forward from `q, k, v` given as `[batch, heads, seq, head_dim]`. Setup (masks, layout
changes, compilation) happens in `prepare`, outside the call that gets timed, so a trace
of the forward shows only the forward.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Callable

import torch

Forward = Callable[[], torch.Tensor]


@dataclass(frozen=True)
class Implementation:
    name: str
    description: str
    seed_script: str  # the blog script this entry mirrors ("" for entries the blog lacks)
    # available(device) -> (ok, reason); reason says why not, or what will run.
    available: Callable[[torch.device], tuple[bool, str]]
    # prepare(q, k, v) -> forward; q/k/v are [batch, heads, seq, head_dim], causal attention.
    # Entries that can also do full attention accept prepare(q, k, v, causal=False).
    # The forward returns the output as a [batch, heads, seq, head_dim] tensor (a view is fine).
    prepare: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Forward]


IMPLEMENTATIONS: dict[str, Implementation] = {}


def inductor_available(device, what: str, cpu_ok: str) -> tuple[bool, str]:
    """Whether torch.compile (inductor) can build `what` on `device`: Triton on CUDA, a C++
    compiler on the CPU (without one the first call fails). `cpu_ok` is the reason when it can."""
    device = torch.device(device)
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        return (True, "inductor-generated Triton") if has_triton() else (
            False, f"{what} on CUDA needs Triton")
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        return False, f"{what} on CPU needs a C++ compiler ({cxx} not found)"
    return True, cpu_ok


def register(impl: Implementation) -> Implementation:
    if impl.name in IMPLEMENTATIONS:
        raise ValueError(f"implementation {impl.name!r} is registered twice")
    IMPLEMENTATIONS[impl.name] = impl
    return impl


def get(name: str) -> Implementation:
    try:
        return IMPLEMENTATIONS[name]
    except KeyError:
        valid = ", ".join(IMPLEMENTATIONS)
        raise ValueError(f"unknown implementation {name!r}; valid names: {valid}") from None
