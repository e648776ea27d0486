"""Serving scenarios: what one compared forward computes, and how each implementation is asked.

`compare` and `bench` compare every implementation on one of:

- prefill: causal self-attention, q_len == kv_len (the blog's case).
- decode: 1 to 8 new queries per sequence against a long KV cache, GQA heads; causal aligned
  bottom-right (flash-attn's KV-cache convention), which for one query is no mask at all.
- chunked: a chunk of new queries (512) against the cache plus themselves (4096 keys),
  bottom-right causal.
- varlen: a packed batch of sequences of different lengths (sweeps.VARLEN_LENGTHS, drawn once
  from a seeded generator), causal within each sequence.
- paged: decode against a paged KV cache, as serving engines hold it: pages of `page_size` keys
  in a [num_blocks, page_size, kv_heads, head_dim] pool, each sequence's pages named by a block
  table in a seeded random order, bottom-right causal.

Any of them may add a sliding window (`--window LEFT,RIGHT`, flash-attn's window_size aligned as
causal is) and a softcap (`--softcap C`, Gemma 2's logit cap): `with_options`.

What an entry can express is read off its registry fields (`q_len_differs`, `prepare_varlen`,
`prepare_paged`, `gqa`, `explicit_mask`, `sliding_window`, `softcap`, `backward_variant_of`), never
its name; one that cannot is a row with status 'unsupported' and the reason. The float64 reference
and the FLOP count follow the scenario, its window and its softcap.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

import torch

from attnscope.attention import fused
from attnscope.attention.reference import attention_reference_varlen
from attnscope.profile.flops import attention_flops, varlen_flops
from attnscope.profile.inputs import SHAPES, make_inputs
from attnscope.profile.metrics import max_abs_error, reference_output
from attnscope.profile.sweeps import (MAX_DECODE_Q_LEN, VARLEN_LENGTHS, Case, case,
                                      varlen_case)

SCENARIOS = ("prefill", "decode", "chunked", "varlen", "paged")


# Each scenario's shape per device. CUDA: the measurements (32 query heads on 8 K/V heads,
# head_dim 128, bf16); CPU: small enough for the Triton interpreter, keeping GQA and lengths that
# are no multiple of a tile.
PRESETS: dict[str, dict[str, Case]] = {
    "prefill": {dev: case(*shape) for dev, shape in SHAPES.items()},
    "decode": {"cuda": case(64, 32, 1, 128, kv_heads=8, kv_len=8192),
               "cpu": case(2, 4, 1, 32, kv_heads=2, kv_len=200)},
    "chunked": {"cuda": case(1, 32, 512, 128, kv_heads=8, kv_len=4096),
                "cpu": case(1, 4, 24, 32, kv_heads=2, kv_len=100)},
    "varlen": {"cuda": varlen_case(VARLEN_LENGTHS["cuda"], 32, 128, kv_heads=8),
               "cpu": varlen_case(VARLEN_LENGTHS["cpu"], 2, 32)},
    # decode's shape on 128-key pages (FA4's key tile on Hopper at head_dim 128, where its pages
    # load by TMA; --page-size changes it); the CPU's 200 keys end in a partly filled page
    "paged": {"cuda": case(64, 32, 1, 128, kv_heads=8, kv_len=8192, page_size=128),
              "cpu": case(2, 4, 1, 32, kv_heads=2, kv_len=200, page_size=16)},
}


def scenario_case(name: str | None, device: str, *, batch=None, heads=None, q_len=None,
                  kv_len=None, head_dim=None, kv_heads=None, page_size=None) -> Case:
    """The scenario's preset on `device`, with the values given replacing its own. No scenario:
    prefill's shape, or with --q-len/--kv-len that differ the scenario those lengths name."""
    asked, name = name, name or "prefill"
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; valid: {', '.join(SCENARIOS)}")
    if page_size is not None:
        if name != "paged":
            raise ValueError(f"--page-size applies to --scenario paged only (add --scenario "
                             f"paged), got scenario {name}")
        if page_size < 1:
            raise ValueError(f"--page-size must be >= 1, got {page_size}")
    preset = PRESETS[name][device]
    if page_size is not None:
        preset = dataclasses.replace(preset, page_size=page_size)
    given = {"batch": batch, "heads": heads, "seq": q_len, "head_dim": head_dim}
    for flag, value in zip(("--batch", "--heads", "--q-len", "--head-dim"), given.values()):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if name == "varlen":
        if q_len is not None or kv_len is not None or batch is not None:
            raise ValueError("--scenario varlen takes its packed lengths from VARLEN_LENGTHS; "
                             f"--batch, --q-len and --kv-len do not apply (got batch {batch}, "
                             f"q_len {q_len}, kv_len {kv_len})")
        heads = preset.heads if heads is None else heads
        return varlen_case(preset.seqlens, heads,
                           preset.head_dim if head_dim is None else head_dim,
                           kv_heads=_kv_heads(kv_heads, preset, heads))
    out = dataclasses.replace(preset, **{k: v for k, v in given.items() if v is not None})
    if name == "prefill":
        kv_len = out.seq if kv_len is None else kv_len
    else:
        kv_len = preset.keys if kv_len is None else kv_len
    if kv_len < out.seq:
        raise ValueError(f"--kv-len must be >= --q-len (new queries attend to the cache and to "
                         f"themselves), got q_len {out.seq} and kv_len {kv_len}")
    if name == "decode" and out.seq > MAX_DECODE_Q_LEN:
        raise ValueError(f"--scenario decode takes q_len 1 to {MAX_DECODE_Q_LEN}, got {out.seq}; "
                         f"use --scenario chunked for longer chunks")
    case = dataclasses.replace(out, kv_len=None if kv_len == out.seq else kv_len,
                               kv_heads=_kv_heads(kv_heads, preset, out.heads))
    if asked is not None and case.scenario != asked:  # the lengths name another scenario
        raise ValueError(f"--scenario {asked} with q_len {case.seq} and kv_len {case.keys} is a "
                         f"{case.scenario} call (prefill: q_len == kv_len; decode: q_len 1 to "
                         f"{MAX_DECODE_Q_LEN} < kv_len; chunked: longer q_len < kv_len): give "
                         f"lengths that fit {asked}, or no --scenario")
    return case


def window_arg(text: str) -> tuple[int, int]:
    """argparse type of --window: LEFT,RIGHT, two integers."""
    try:
        left, right = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LEFT,RIGHT, two integers (-1: unbounded), "
                                         f"e.g. 4095,0; got {text!r}") from None
    return left, right


def add_option_arguments(parser) -> None:
    """compare's and bench's --window and --softcap."""
    parser.add_argument("--window", type=window_arg, default=None, metavar="LEFT,RIGHT",
                        help="sliding window for every implementation, flash-attn's window_size: "
                        "query i sees key j when i + offset - LEFT <= j <= i + offset + RIGHT "
                        "(offset kv_len - q_len, bottom-right as causal), -1 unbounded, RIGHT 0 "
                        "or -1 when causal (e.g. 4095,0 for Mistral; a LEFT of -1 needs "
                        "--window=-1,RIGHT) (default: none)")
    parser.add_argument("--softcap", type=float, default=None, metavar="C",
                        help="logit softcap for every implementation: each scaled score s "
                        "becomes C * tanh(s / C) (Gemma 2: 50); 0: off (default: off)")


def with_options(c: Case, window, softcap, causal: bool) -> Case:
    """`c` with a sliding window and a softcap, checked as the op checks them (`--window`,
    `--softcap`: ValueError naming the flag). Normalized so that a row records what runs: with
    causal the right side is 0; a window that hides nothing more than causal does (left -1, or a
    side as long as the case's queries and keys together, as the op takes it) and a softcap of
    0 are none."""
    if softcap is not None:
        try:
            fused._validate_window_softcap(causal, (-1, -1), softcap, c.seq + c.keys)
        except ValueError as exc:
            raise ValueError(f"--softcap: {exc}") from None
    if window is not None:
        try:
            left, right = fused._validate_window_softcap(causal, window, 0.0, c.seq + c.keys)
        except ValueError as exc:
            raise ValueError(f"--window {window[0]},{window[1]}: {exc}") from None
        right = 0 if causal else right
        window = None if left == -1 and (causal or right == -1) else (left, right)
    return dataclasses.replace(c, window=window, softcap=float(softcap) if softcap else None)


def options(c: Case) -> dict:
    """The keywords of a case's window and softcap, only those it has: what prepare(),
    prepare_varlen() and prepare_paged() of an entry that takes them, and the reference, get."""
    return {k: v for k, v in (("window", c.window), ("softcap", c.softcap)) if v is not None}


def describe_options(c: Case) -> str:
    """', window (l, r), softcap C' for the progress lines; '' without them."""
    return "".join(f", {k} {tuple(v) if k == 'window' else format(v, 'g')}"
                   for k, v in options(c).items())


def describe(c: Case) -> str:
    """The case as the progress lines name it: scenario, shape, keys, K/V heads, the packed
    lengths, the page size, the window and the softcap (those it has)."""
    return (f"{c.scenario} shape {tuple(c.shape)} [batch, heads, q_len, head_dim], {c.keys} keys, "
            f"{c.kv_heads} K/V heads"
            f"{', packed lengths ' + str(list(c.seqlens)) if c.seqlens else ''}"
            f"{f', pages of {c.page_size} keys' if c.page_size is not None else ''}"
            f"{describe_options(c)}")


def _kv_heads(kv_heads, preset: Case, heads: int) -> int:
    if kv_heads is None:
        # The preset's grouping (query heads per K/V head: 1 for prefill) where it divides the
        # heads asked for, else one K/V head each.
        group = preset.heads // preset.kv_heads
        kv_heads = heads // group if heads % group == 0 else heads
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"--kv-heads must divide the query heads ({heads}), got {kv_heads}")
    return kv_heads


# --- one case's inputs, preparation, reference and FLOPs -----------------------------------

@dataclass
class Inputs:
    """One set of inputs: q/k/v ([batch, heads, seq, head_dim]; packed [total, heads, head_dim]
    for varlen) and, for varlen, (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k); for
    paged, k and v also as a paged cache: (k_cache, v_cache, block_table, cache_seqlens)
    (paged_cache). The reference reads the contiguous k and v."""
    qkv: tuple
    packing: tuple | None = None
    paging: tuple | None = None


def case_inputs(c: Case, dtype, device, seed: int, draw_on="cpu") -> Inputs:
    """Standard normal inputs for `c`, seeded (make_inputs'); varlen: packed, with int32
    cumulative lengths on the device."""
    if c.seqlens is None:
        qkv = make_inputs(*c.shape, dtype, device, seed=seed, kv_heads=c.kv_heads,
                          draw_on=draw_on, kv_len=c.keys)
        if c.page_size is None:
            return Inputs(qkv)
        return Inputs(qkv, paging=paged_cache(qkv[1], qkv[2], c.page_size, seed=seed))
    total = sum(c.seqlens)
    q, k, v = make_inputs(1, c.heads, total, c.head_dim, dtype, device, seed=seed,
                          kv_heads=c.kv_heads, draw_on=draw_on)
    cu = torch.tensor([0, *torch.tensor(c.seqlens).cumsum(0).tolist()], dtype=torch.int32,
                      device=device)
    packed = tuple(t[0].transpose(0, 1).contiguous() for t in (q, k, v))  # [total, heads, dim]
    return Inputs(packed, (cu, cu, c.seq, c.seq))


def paged_cache(k, v, page_size: int, seed: int) -> tuple:
    """k and v ([batch, kv_heads, kv_len, head_dim]) as a paged KV cache: (k_cache, v_cache,
    block_table, cache_seqlens) with the caches [batch * pages, page_size, kv_heads, head_dim],
    each sequence's pages at places drawn by a generator seeded with `seed` (a block table that
    is not the identity), zeros past a sequence's end in its last page (finite, as FA4 asks),
    the table int32 [batch, pages] and the lengths int32 [batch]."""
    batch, kv_heads, kv_len, head_dim = k.shape
    pages = -(-kv_len // page_size)
    order = torch.randperm(batch * pages, generator=torch.Generator().manual_seed(seed))
    place = order.to(k.device)

    def pack(t):
        rows = t.new_zeros(batch, pages * page_size, kv_heads, head_dim)
        rows[:, :kv_len] = t.transpose(1, 2)
        cache = torch.empty_like(rows).view(batch * pages, page_size, kv_heads, head_dim)
        cache[place] = rows.view(batch * pages, page_size, kv_heads, head_dim)
        return cache
    table = place.view(batch, pages).to(torch.int32)
    seqlens = torch.full((batch,), kv_len, dtype=torch.int32, device=k.device)
    return pack(k), pack(v), table, seqlens


def forward_elsewhere(impl) -> str | None:
    """Why timing or profiling `impl`'s forward alone would measure another entry (its forward is
    that entry's, the registry's backward_variant_of), or None."""
    if impl.backward_variant_of is None:
        return None
    return (f"its forward is {impl.backward_variant_of}'s; it differs only in the backward (the "
            f"registry's backward_variant_of): time it with a backward, bench --mode bwd or "
            f"fwd_bwd, compare --mode fwd_bwd")


# Messages PyTorch and the libraries raise when an implementation cannot take the dtype or
# shape (a library's AssertionError among them, e.g. FA4's "paged KV not supported on SM 9.0").
REFUSAL_HINTS = ("No available kernel", "No viable backend", "not supported", "only supports",
                 "Unsupported", "not implemented")


def refuses(exc: BaseException) -> bool:
    """Whether an entry's exception refuses its input (an `unsupported` row in bench and compare
    alike) rather than failing on it: the registry's NotImplementedError, ValueError and
    TypeError, or a library's refusal message (REFUSAL_HINTS), but never a CUDA error (e.g.
    "CUDA error: operation not supported" is a fault, not a refusal)."""
    if str(exc).startswith("CUDA error") or type(exc).__name__ == "AcceleratorError":
        return False
    return (isinstance(exc, (NotImplementedError, ValueError, TypeError))
            or any(hint in str(exc) for hint in REFUSAL_HINTS))


def unsupported(impl, c: Case, mode: str = "fwd") -> str | None:
    """Why `impl` cannot express case `c` (its registry fields) in `mode` (fwd, bwd, fwd_bwd),
    or None."""
    if mode == "fwd" and impl.backward_variant_of is not None:
        return forward_elsewhere(impl)
    if c.kv_heads != c.heads and not impl.gqa:
        return "takes no K/V with fewer heads than q (the registry's gqa field)"
    if c.page_size is not None and impl.prepare_paged is None:
        return "reads no paged KV cache (the registry's prepare_paged)"
    if c.page_size is not None and mode != "fwd":
        return "a paged KV cache is read forward only (decoding): no backward"
    if c.seqlens is not None and impl.prepare_varlen is None:
        return "has no packed variable-length sequence API (the registry's prepare_varlen)"
    if c.seqlens is None and c.keys != c.seq and not impl.q_len_differs:
        return (f"takes no q_len ({c.seq}) shorter than kv_len ({c.keys}) (the registry's "
                f"q_len_differs field)")
    if c.window is not None and not impl.sliding_window:
        return "takes no sliding window (the registry's sliding_window field)"
    if c.softcap is not None and not impl.softcap:
        return "cannot cap its logits: takes no softcap (the registry's softcap field)"
    return None


def note(impl, c: Case, causal: bool) -> str:
    """What the row's figures include that a reader should know: an explicit mask."""
    if not impl.explicit_mask:
        return ""
    window = " and the sliding window" if c.window is not None else ""
    if c.seqlens is not None and (causal or window):
        return f"packed sequences{window} under an explicit dense [total, total] boolean mask"
    if window:
        return "the sliding window as an explicit boolean mask"
    if causal and 1 < c.seq < c.keys:
        return "bottom-right causal as an explicit boolean mask (is_causal aligns top-left)"
    return ""


def prepare(impl, inputs: Inputs, causal: bool, **options):
    """The entry's zero-argument forward on these inputs; `options`: a case's window and
    softcap keywords (`options(case)`), given only when set."""
    if inputs.packing is not None:
        return impl.prepare_varlen(*inputs.qkv, *inputs.packing, causal=causal, **options)
    if inputs.paging is not None:
        return impl.prepare_paged(inputs.qkv[0], *inputs.paging, causal=causal, **options)
    if causal:
        return impl.prepare(*inputs.qkv, **options)
    return impl.prepare(*inputs.qkv, causal=False, **options)


def flops(c: Case, causal: bool, mode: str = "fwd") -> float:
    if c.seqlens is not None:
        return varlen_flops(c.seqlens, c.heads, c.head_dim, causal=causal, mode=mode,
                            window=c.window)
    return attention_flops(c.batch, c.heads, c.seq, c.keys, c.head_dim, causal=causal, mode=mode,
                           window=c.window)


def reference(inputs: Inputs, causal: bool, budget_bytes: float, **options):
    """(float64 reference, region): what `error` compares an output with; `options` as
    prepare's."""
    if inputs.packing is None:
        return reference_output(*inputs.qkv, causal=causal, budget_bytes=budget_bytes, **options)
    cu_q, cu_k = inputs.packing[:2]
    ref = attention_reference_varlen(*inputs.qkv, cu_q, cu_k, causal=causal, **options)
    return ref, {"packed_rows": [0, ref.shape[0]]}


def error(out: torch.Tensor, ref: torch.Tensor, region: dict) -> float:
    if "packed_rows" in region:
        return max_abs_error(out, ref)
    start, stop = region["query_rows"]
    return max_abs_error(out[:, :, start:stop], ref)
