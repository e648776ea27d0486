"""The shapes `bench` sweeps: named sweeps of cases (batch, heads, seq, head_dim, K/V heads, and
for the wide sweep a dtype of their own; for the serving sweep keys that outnumber the queries,
or packed sequences of different lengths)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from attnscope.profile.inputs import SHAPES


@dataclass(frozen=True)
class Case:
    batch: int
    heads: int
    seq: int
    head_dim: int
    kv_heads: int  # equal to heads unless GQA/MQA
    dtype: str | None = None  # "bf16"/"fp16"/"fp32"; None: bench's --dtype
    # Keys per sequence when they outnumber the queries (`seq`): decode, chunked prefill; causal
    # is then aligned bottom-right. None: self-attention, kv_len == seq.
    kv_len: int | None = None
    # Packed sequences of these lengths (queries = keys per sequence, causal within each); batch
    # is their count and seq the longest. None: a padded-free rectangular batch.
    seqlens: tuple[int, ...] | None = None
    # Keys per page of a paged KV cache (serving engines' [num_blocks, page_size, kv_heads,
    # head_dim] with a block table), for the entries that read one. None: a contiguous cache.
    page_size: int | None = None
    # A sliding window (left, right), flash-attn's window_size aligned as causal is (-1:
    # unbounded; causal: right 0), and a softcap C (logits C * tanh(s / C)), applied alike to
    # every implementation. None: off (scenarios.with_options sets them).
    window: tuple[int, int] | None = None
    softcap: float | None = None

    @property
    def shape(self) -> list[int]:
        return [self.batch, self.heads, self.seq, self.head_dim]

    @property
    def keys(self) -> int:
        return self.seq if self.kv_len is None else self.kv_len

    @property
    def scenario(self) -> str:
        """prefill (q_len == kv_len), decode (q_len <= 8 < kv_len), chunked (other q_len <
        kv_len), varlen, or paged (any q_len on a paged KV cache)."""
        if self.seqlens is not None:
            return "varlen"
        if self.page_size is not None:
            return "paged"
        if self.keys == self.seq:
            return "prefill"
        return "decode" if self.seq <= MAX_DECODE_Q_LEN else "chunked"

    @property
    def score_elements(self) -> int:
        """Scores an implementation that materializes them holds: per head q_len x kv_len, or
        total x total for packed sequences under one mask."""
        if self.seqlens is not None:
            return self.heads * sum(self.seqlens) ** 2
        return self.batch * self.heads * self.seq * self.keys


# Decode: one to this many new queries per sequence (speculative decoding's drafts).
MAX_DECODE_Q_LEN = 8


def case(batch, heads, seq, head_dim, kv_heads=None, dtype=None, kv_len=None,
         page_size=None) -> Case:
    return Case(batch, heads, seq, head_dim, heads if kv_heads is None else kv_heads, dtype,
                kv_len, None, page_size)


def varlen_case(seqlens, heads, head_dim, kv_heads=None, dtype=None) -> Case:
    seqlens = tuple(int(n) for n in seqlens)
    return Case(len(seqlens), heads, max(seqlens), head_dim,
                heads if kv_heads is None else kv_heads, dtype, None, seqlens)


# The wide sweep (README, "Wide forward sweep"): every head_dim x every length once, 60 cases,
# with the other axes (GQA ratio, dtype, SM fill) dealt out by rule rather than crossed, which
# would be 1,440 cases and hours of GPU time with every peer. For head_dim number d and length
# number n (i = 10d + n):
#   GQA ratio  WIDE_GQA[i % 3]
#   fill       under when n + d is even: batch*heads 8, so up to 2k keys fewer query tiles of
#              128 than the H200's 132 SMs (longer lengths fill the GPU even then); else over:
#              batch*heads*seq = WIDE_TOKENS, many waves
#   dtype      WIDE_DTYPES[(n // 2 + d) % 2]
# so that every head_dim meets every GQA ratio, both fills and both dtypes, every length both
# fills and both dtypes, and every ratio both fills and both dtypes (tests/test_bench.py checks).
# Query heads are 8 (under) or 16 (over): multiples of every GQA ratio.
WIDE_HEAD_DIMS = (64, 80, 96, 128, 192, 256)
# 500, 2000, 3000 and 6000 are not multiples of 128: their last tiles are masked.
WIDE_LENGTHS = (128, 256, 500, 1024, 2000, 3000, 4096, 6000, 8192, 16384)
WIDE_GQA = (1, 4, 8)
WIDE_DTYPES = ("bf16", "fp16")
WIDE_TOKENS = 2**21  # batch*heads*seq of an "over" case: (8, 16, 16384) at the longest length


def wide_sweep() -> tuple[Case, ...]:
    cases = []
    for d, head_dim in enumerate(WIDE_HEAD_DIMS):
        for n, seq in enumerate(WIDE_LENGTHS):
            ratio = WIDE_GQA[(len(WIDE_LENGTHS) * d + n) % 3]
            heads = 8 if (n + d) % 2 == 0 else 16
            batch = 1 if heads == 8 else max(1, WIDE_TOKENS // (heads * seq))
            cases.append(case(batch, heads, seq, head_dim, heads // ratio,
                              WIDE_DTYPES[(n // 2 + d) % 2]))
    return tuple(cases)


def varlen_lengths(count: int, longest: int, seed: int) -> tuple[int, ...]:
    """`count` sequence lengths, uniform in [1, longest], from a generator seeded with `seed`:
    the same list on every machine. Most are no multiple of a tile, on purpose."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(1, longest + 1, (count,), generator=gen).tolist())


# The packed batches: 16 sequences of up to 4096 tokens on CUDA (a serving engine's prefill batch),
# 4 of up to 64 on the CPU, where the Triton interpreter and the dense-mask peers are slow.
VARLEN_LENGTHS = {"cuda": varlen_lengths(16, 4096, seed=20), "cpu": varlen_lengths(4, 64, seed=20)}


def serving_sweep() -> tuple[Case, ...]:
    """Issue 20's serving shapes, 32 query heads on 8 K/V heads at head_dim 128 (Llama-style):
    decode (q_len 1 and 8; 4 at the issue's first measurement) at 1k-128k keys and batch 1-128,
    two (keys, batch) pairs per length, one small and one filling the GPU, the K/V cache up to
    4.3 GB; chunked prefill (512 and 2048 new queries on 4096 and 16384 keys); a packed batch;
    two decode rows on a paged KV cache (128-key pages, and vLLM's default of 16)."""
    cases = []
    for kv_len, batches in ((1024, (1, 128)), (8192, (8, 64)), (32768, (8, 32)),
                            (131072, (1, 8))):
        for batch in batches:
            for q_len in (1, MAX_DECODE_Q_LEN):
                cases.append(case(batch, 32, q_len, 128, kv_heads=8, kv_len=kv_len))
    cases.append(case(64, 32, 4, 128, kv_heads=8, kv_len=8192))
    cases += [case(1, 32, 512, 128, kv_heads=8, kv_len=4096),
              case(4, 32, 512, 128, kv_heads=8, kv_len=4096),
              case(1, 32, 2048, 128, kv_heads=8, kv_len=16384)]
    cases.append(varlen_case(VARLEN_LENGTHS["cuda"], 32, 128, kv_heads=8))
    # decode rows again on paged caches: 128-key pages (whole K/V tiles), and 16-key ones
    # (vLLM's default; a table entry per key row)
    cases.append(case(64, 32, 1, 128, kv_heads=8, kv_len=8192, page_size=128))
    cases.append(case(8, 32, 1, 128, kv_heads=8, kv_len=32768, page_size=16))
    return tuple(cases)


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
    "seed": (case(*SHAPES["cuda"]),),
    # Seconds on a CPU, the fused op included (Triton interpreter); 96 is no power of two on
    # purpose, and one GQA shape keeps that path in the smoke run.
    "cpu": (
        case(1, 2, 128, 64),
        case(1, 4, 96, 32, kv_heads=2),
    ),
    "wide": wide_sweep(),
    "serving": serving_sweep(),
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
