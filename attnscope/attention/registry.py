"""The registry of attention implementations the driver compares.

Each entry knows how to check whether it can run here and how to build a zero-argument
forward from `q, k, v` given as `[batch, heads, seq, head_dim]`. Setup (masks, layout
changes, compilation) happens in `prepare`, outside the call that gets timed, so a trace
of the forward shows only the forward.
"""

from __future__ import annotations

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
