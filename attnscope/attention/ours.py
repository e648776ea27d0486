"""The registry entries of attnscope's own kernels: "fused", the public op and its
packed-sequence and paged forms as the driver calls them, and the compiled kernels the op launched
(CompiledKernel records, so profile/ never imports the kernels); "fused_nondeterministic", the
same op with deterministic=False, whose forward is fused's and whose backward the driver times
next to the default. Apart from fused.py because varlen.py is built on that module and these
entries need both."""

from __future__ import annotations

import torch

from attnscope.attention import fused
from attnscope.attention.decode import fused_attention_with_kvcache
from attnscope.attention.fused import fused_attention
from attnscope.attention.registry import CompiledKernel, Implementation, register
from attnscope.attention.varlen import fused_attention_varlen


def _available(device):
    device = torch.device(device)
    if device.type == "cuda":
        ok = torch.cuda.is_available()
        return ok, "Triton kernel on CUDA" if ok else "no CUDA device"
    if device.type == "cpu":
        ok = fused._kernels().interpreter_ready()
        return ok, ("Triton interpreter (TRITON_INTERPRET=1): correct but slow; fp16/fp32 only"
                    if ok else "CPU needs Python started with TRITON_INTERPRET=1 (Triton reads it "
                    "when first imported)")
    return False, f"unsupported device {device}"


def _prepare(q, k, v, causal=True, window=(-1, -1), softcap=0.0):
    # bottom_right: the registry's alignment for q_len < kv_len (top-left's at equal lengths).
    return lambda: fused_attention(q, k, v, causal=causal, causal_alignment="bottom_right",
                                   window=window, softcap=softcap)


def _prepare_nondeterministic(q, k, v, causal=True, window=(-1, -1), softcap=0.0):
    # fused's call with the backward's option: the forward ignores it
    return lambda: fused_attention(q, k, v, causal=causal, causal_alignment="bottom_right",
                                   window=window, softcap=softcap, deterministic=False)


def _prepare_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    causal=True, window=(-1, -1), softcap=0.0):
    return lambda: fused_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                          max_seqlen_k, causal=causal, window=window,
                                          softcap=softcap)


def _prepare_paged(q, k_cache, v_cache, block_table, cache_seqlens, causal=True,
                   window=(-1, -1), softcap=0.0):
    # The registry's [batch, heads, q_len, head_dim] as the function's [batch, q_len, heads,
    # head_dim] view, and its output back (views, no copies)
    q_bshd = q.transpose(1, 2)
    return lambda: fused_attention_with_kvcache(
        q_bshd, k_cache, v_cache, cache_seqlens, block_table=block_table,
        causal=causal, window=window, softcap=softcap).transpose(1, 2)


def _compiled_kernels():
    """The forward kernels the op launched eagerly in this process, most recently used first,
    as the registry's CompiledKernel records ([] in the interpreter: it compiles nothing)."""
    kernels = fused._kernel_module
    if kernels is None:  # the op never ran: nothing launched
        return []
    return [compiled_kernel_record(**r) for r in kernels.launched_forward_kernels()]


def compiled_kernel_record(name, source_path, source, config, compiled):
    """A CompiledKernel from Triton's compiled kernel object: its compiler stages (`.asm`), and
    its metadata with the registers and spills Triton read from the loaded cubin."""
    asm = {stage: text for stage, text in getattr(compiled, "asm", {}).items()
           if stage in ("ttir", "ttgir", "llir", "ptx", "cubin")}
    metadata = getattr(compiled, "metadata", None)
    metadata = dict(metadata._asdict()) if hasattr(metadata, "_asdict") else dict(metadata or {})
    for field in ("n_regs", "n_spills"):
        metadata[field] = getattr(compiled, field, None)
    return CompiledKernel(name=name, source_path=source_path, source=source, config=config,
                          asm=asm, metadata=metadata)


register(Implementation(
    name="fused",
    description="attnscope's fused kernel, one launch: Triton (online softmax, causal split); "
                "Gluon FA3-style on sm_90 (head_dim 72-256 in multiples of 8, and 64 past 2048 "
                "queries; short calls in few tiles stay on Triton)",
    seed_script="",
    available=_available,
    prepare=_prepare,
    ours=True,
    gqa=True,
    q_len_differs=True,
    prepare_varlen=_prepare_varlen,
    prepare_paged=_prepare_paged,
    sliding_window=True,
    softcap=True,
    compiled_kernels=_compiled_kernels,
))

# deterministic=False changes what attention_bwd.fused_dq routes, nothing else: the forward is
# fused's (backward_variant_of, so the driver refuses to time it alone), and so is every backward
# that route does not take (it also needs a Triton whose Gluon has the copy engine's reduce-add,
# gluon_compat.tma_add). fused_attention_varlen and fused_attention_with_kvcache take no
# deterministic argument, so this entry has no packed or paged form.
register(Implementation(
    name="fused_nondeterministic",
    description="fused with deterministic=False: the same forward; in the backward, the calls "
                "that take the Gluon kernels (eager bf16/fp16 head_dim 128 on sm_90, contiguous "
                "or bshd views, windows and softcaps included, not packed batches) without GQA "
                "add dQ in any order from the dK/dV kernel "
                "instead of running the dQ kernel (attention_bwd.fused_dq); every other call "
                "computes as fused, bit for bit, as does every call under "
                "torch.use_deterministic_algorithms(True)",
    seed_script="",
    available=_available,
    prepare=_prepare_nondeterministic,
    ours=True,
    backward_variant_of="fused",
    gqa=True,
    q_len_differs=True,
    sliding_window=True,
    softcap=True,
    compiled_kernels=_compiled_kernels,  # fused's forward kernels: the same forward
))
