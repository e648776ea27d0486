"""The shapes `bench` sweeps: named sweeps of cases (batch, heads, seq, head_dim, K/V heads)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Case:
    batch: int
    heads: int
    seq: int
    head_dim: int
    kv_heads: int  # equal to heads unless GQA/MQA

    @property
    def shape(self) -> list[int]:
        return [self.batch, self.heads, self.seq, self.head_dim]


def case(batch, heads, seq, head_dim, kv_heads=None) -> Case:
    return Case(batch, heads, seq, head_dim, heads if kv_heads is None else kv_heads)


SWEEPS: dict[str, tuple[Case, ...]] = {
    # Issue 5's sweep: the peers' table in ../shared/data/h200_peers.md, head_dim 128 at the seed
    # length, and GQA at 4 query heads per K/V head (Llama-style).
    "default": (
        case(16, 16, 512, 64),
        case(8, 16, 1024, 64),
        case(4, 32, 4096, 64),
        case(4, 32, 4096, 128),
        case(2, 16, 16384, 128),
        case(8, 16, 1024, 128),
        case(4, 32, 4096, 128, kv_heads=8),
    ),
    # The blog's shape (04_*.py defaults).
    "seed": (case(8, 16, 1024, 64),),
    # Seconds on a CPU, the fused op included (Triton interpreter); 96 is no power of two on
    # purpose, and one GQA shape keeps that path in the smoke run.
    "cpu": (
        case(1, 2, 128, 64),
        case(1, 4, 96, 32, kv_heads=2),
    ),
}


def resolve_sweep(name: str, kv_heads: int | None) -> tuple[Case, ...]:
    """The named sweep, with every shape's K/V heads replaced when `kv_heads` is given."""
    if name not in SWEEPS:
        raise ValueError(f"unknown sweep {name!r}; valid names: {', '.join(SWEEPS)}")
    cases = SWEEPS[name]
    if kv_heads is None:
        return cases
    bad = [c.heads for c in cases if kv_heads < 1 or c.heads % kv_heads]
    if bad:
        raise ValueError(f"--kv-heads {kv_heads} must divide the query heads of every shape in "
                         f"sweep {name!r}; got query heads {sorted(set(bad))}")
    return tuple(dict.fromkeys(dataclasses.replace(c, kv_heads=kv_heads) for c in cases))
