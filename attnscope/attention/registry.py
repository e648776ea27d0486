"""The registry of attention implementations the driver compares.

Each entry knows how to check whether it can run here and how to build a zero-argument
forward from `q, k, v` given as `[batch, heads, seq, head_dim]`. Setup (masks, layout
changes, compilation) happens in `prepare`, outside the call that gets timed, so a trace
of the forward shows only the forward.

Adding a peer: a module under attnscope/attention/ that calls `register(Implementation(...))`
when imported (flash_attn.py is an example: `available` says why not where it cannot run,
`prepare` returns the forward, the scenario fields say what it takes), and its import in
attention/__init__.py (the order there is the driver's; a `backward_variant_of` entry after its
base). tests/test_implementations.py then checks it against the float64 reference on CPU where
it runs; a `NameFamily` in profile/tensor_cores.py lets its kernels' names give a verdict where
no stronger evidence does.
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
    # With fewer queries than keys (q_len_differs) causal is aligned bottom-right, flash-attn's
    # KV-cache convention: the last query sees every key (at equal lengths both alignments agree).
    prepare: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Forward]
    # What the driver must know about an entry, as fields, so it never special-cases a name:
    ours: bool = False  # attnscope's own op; every other entry is a peer for ratios
    # The name of the entry whose forward this one's is: it differs only in the backward (an
    # option of the same op that the forward ignores), so timing its forward would time that
    # entry again; the driver times it in the backward modes only. Registered after that entry.
    backward_variant_of: str | None = None
    # Builds the [batch, heads, q_len, kv_len] scores in device memory (its memory grows with
    # the square of the length; bench skips it where that would not fit).
    materializes_scores: bool = False
    # Takes k/v with fewer heads than q (GQA/MQA) without repeating them in memory.
    gqa: bool = False
    # prepare() takes q_len < kv_len (decode, chunked prefill), causal aligned bottom-right.
    q_len_differs: bool = False
    # Expresses bottom-right causal (1 < q_len < kv_len) and packed-sequence masks as an explicit
    # dense boolean mask, since its own causal flag aligns top-left; backends that take no mask
    # then refuse the call.
    explicit_mask: bool = False
    # Packed variable-length sequences: prepare_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k,
    # max_seqlen_q, max_seqlen_k, causal=True) -> forward, q [total_q, heads, head_dim] and k/v
    # [total_k, kv_heads, head_dim] as flash-attn's varlen API, causal aligned bottom-right per
    # sequence; the forward returns [total_q, heads, head_dim]. None: the entry cannot.
    prepare_varlen: Callable[..., Forward] | None = None
    # A paged KV cache, as serving engines hold it: prepare_paged(q, k_cache, v_cache,
    # block_table, cache_seqlens, causal=True) -> forward, q [batch, heads, q_len, head_dim],
    # k_cache/v_cache [num_blocks, page_size, kv_heads, head_dim], block_table int32 [batch,
    # pages] naming each sequence's pages in order, cache_seqlens int32 [batch] its keys; causal
    # aligned bottom-right; the forward returns [batch, heads, q_len, head_dim]. None: it cannot.
    prepare_paged: Callable[..., Forward] | None = None
    # prepare() (and prepare_varlen/prepare_paged where the entry has them) takes
    # window=(left, right), a sliding window in flash-attn's window_size convention (-1
    # unbounded; causal: right 0), aligned bottom-right as causal is. Given only when set.
    sliding_window: bool = False
    # ... takes softcap=C > 0: each scaled score s becomes C * tanh(s / C) before the softmax
    # (Gemma 2). Given only when set.
    softcap: bool = False
    # Ours only: the compiled kernels this entry's forwards launched in this process (see
    # CompiledKernel), so the driver can show source and compiled code without importing them.
    compiled_kernels: Callable[[], list["CompiledKernel"]] | None = None


@dataclass(frozen=True)
class CompiledKernel:
    """One compiled GPU kernel an entry launched, as the driver shows it next to its trace."""
    name: str  # the kernel's name as traces show it ("_attn_fwd", "_attn_fwd_hopper")
    source_path: str  # the repository path of the file holding its source
    source: str  # that file's text, as it was compiled
    config: dict  # the launch config (tile sizes, num_warps, num_stages, ...)
    asm: dict  # the compiler's stages as Triton keeps them: "ttir", "ttgir", "llir", "ptx", "cubin"
    metadata: dict  # registers ("n_regs"), spills ("n_spills"), shared memory ("shared"), ...


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
    if impl.backward_variant_of is not None and impl.backward_variant_of not in IMPLEMENTATIONS:
        raise ValueError(f"implementation {impl.name!r} is a backward variant of "
                         f"{impl.backward_variant_of!r}, which is not registered (register it "
                         f"first)")
    IMPLEMENTATIONS[impl.name] = impl
    return impl


def get(name: str) -> Implementation:
    try:
        return IMPLEMENTATIONS[name]
    except KeyError:
        valid = ", ".join(IMPLEMENTATIONS)
        raise ValueError(f"unknown implementation {name!r}; valid names: {valid}") from None
