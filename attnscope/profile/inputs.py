"""What every command starts from: the device, the seed shape and dtype, and the inputs.

One home for the defaults (the blog's shape and warm-ups) and the input maker, so that `compare`,
`ncu` and `bench` profile the very same data: `ncu`'s counters then describe the kernels of
`compare`'s traces, and every implementation at one bench shape sees one set of q/k/v.
"""

from __future__ import annotations

import torch

from attnscope.attention import registry

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# The blog's 04_* defaults on CUDA [batch, heads, seq, head_dim]; small enough for the CPU there.
SHAPES = {"cuda": (8, 16, 1024, 64), "cpu": (1, 2, 128, 64)}
# bf16 as in the blog; fp32 on the CPU, where the Triton interpreter's bf16 tl.dot is wrong.
DEFAULT_DTYPE = {"cuda": "bf16", "cpu": "fp32"}
# Calls before anything is recorded: compilation, autotuning and cuDNN plan selection happen here
# (the seed scripts' 3).
WARMUP_CALLS = 3


def resolve_device(requested: str | None) -> str:
    """"cuda" or "cpu": the one requested, else cuda when a GPU is present."""
    # On the CPU the fused kernel needs Triton's interpreter, which importing attnscope turns on
    # for machines without CUDA; elsewhere the `fused` row says how to get it.
    device = requested or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda, but torch sees no CUDA device")
    return device


def make_inputs(batch, heads, seq, head_dim, dtype, device, seed=0, kv_heads=None,
                draw_on="cpu", kv_len=None):
    """q [batch, heads, seq, head_dim] and k, v [batch, kv_heads (default heads), kv_len (default
    seq), head_dim], standard normal from a generator seeded with `seed`: never zeros or
    constants.

    Drawn on the CPU by default, so a seed gives the same numbers on every machine; bench draws
    on the device (`draw_on=device`) because it makes up to 16 sets of long sequences per shape.
    """
    gen = torch.Generator(device=draw_on).manual_seed(seed)
    kv_heads = heads if kv_heads is None else kv_heads
    kv_len = seq if kv_len is None else kv_len
    shapes = ((batch, heads, seq, head_dim), *((batch, kv_heads, kv_len, head_dim),) * 2)
    return tuple(torch.randn(s, generator=gen, device=draw_on, dtype=torch.float32)
                 .to(device=device, dtype=dtype) for s in shapes)


def resolve_impls(names) -> tuple[list, list[str]]:
    """The registry entries named (all when none), each once, in order; and a note per name
    given more than once."""
    names = list(names or registry.IMPLEMENTATIONS)
    repeated = sorted({n for n in names if names.count(n) > 1})
    impls = [registry.get(name) for name in dict.fromkeys(names)]
    notes = [f"note: --impl names {n} {names.count(n)} times; it runs once" for n in repeated]
    return impls, notes
