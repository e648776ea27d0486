"""Lab variant of the backward (bwd_lab.py --tma-dq): dQ added by the copy engine's reduce-add.

One kernel per (batch, K/V head, key block), as attention_bwd's dK/dV kernel, that also computes
each tile's dS K (the dQ kernel's work) and hands it to TMA as an asynchronous fp32 reduce-add
(`tensor_descriptor.atomic_add`, cp.reduce.async.bulk on sm_90) into a zeroed [rows, head_dim]
accumulator; a small kernel scales and casts it into dq. 5 matmuls per tile pair instead of the
split's 7, non-deterministic dq (the adds land in any order). The question it answers: does an
asynchronous bulk reduce beat the split where elementwise fp32 atomics lost 18-22 %
(notes/backward.md)? Dense causal inputs only (no window, softcap or packed sequences),
contiguous [batch, heads, seq, head_dim], head_dim a power of two; GPU only (the interpreter
cannot run TMA reduce).
"""

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from attnscope.kernels import attention_bwd as bwd
from attnscope.kernels.attention_bwd import _load_tile, _lse_log2
from attnscope.kernels.common import LOG2E, LOG2E_C, _sees


@triton.jit
def _inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_desc, dq_row0,
           offs_n, offs_d, lo, hi, N_CTX, qk_scale,
           MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    for start_m in tl.range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        m_ok = offs_m < N_CTX
        qT = _load_tile(q_base, offs_m, offs_d, HEAD_DIM, 1, N_CTX, MASKED, HEAD_DIM, HEAD_DIM,
                        True)
        qkT = tl.dot(k, qT)
        if MASKED:
            lse = _lse_log2(tl.load(lse_base + offs_m, mask=m_ok, other=float("-inf")))
            delta = tl.load(delta_base + offs_m, mask=m_ok, other=0.0)
            visible = m_ok[None, :] & _sees(offs_m[None, :], offs_n[:, None], 0)
            pT = tl.math.exp2(tl.where(visible, qkT * qk_scale, float("-inf")) - lse[None, :])
        else:
            lse = tl.load(lse_base + offs_m) * LOG2E_C
            delta = tl.load(delta_base + offs_m)
            pT = tl.math.exp2(qkT * qk_scale - lse[None, :])
        do = _load_tile(do_base, offs_m, offs_d, HEAD_DIM, 1, N_CTX, MASKED, HEAD_DIM, HEAD_DIM,
                        False)
        dv = tl.dot(pT.to(do.dtype), do, dv)
        dpT = tl.dot(v, tl.trans(do))
        dsT = (pT * (dpT - delta[None, :])).to(qT.dtype)
        dk = tl.dot(dsT, tl.trans(qT), dk)
        # rows past N_CTX have dS exactly 0 (P is): they add zeros to the next head's rows, and
        # past the last head the copy engine drops them (the descriptor's bounds)
        dq_desc.atomic_add([dq_row0 + start_m, 0], tl.dot(tl.trans(dsT), k))
    return dk, dv


@triton.jit
def _bwd_tma_dq(Q, K, V, DO, DK, DV, Lse, Delta, dq_desc, H_KV, GROUP, N_CTX, qk_scale,
                sm_scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    off_hkvz = tl.program_id(0)
    start_n = tl.program_id(1) * BLOCK_N
    off_z = (off_hkvz // H_KV).to(tl.int64)
    off_hkv = (off_hkvz % H_KV).to(tl.int64)
    H = H_KV * GROUP
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    kv_off = (off_z * H_KV + off_hkv) * N_CTX * HEAD_DIM
    k = _load_tile(K + kv_off, offs_n, offs_d, HEAD_DIM, 1, N_CTX, True, HEAD_DIM, HEAD_DIM, False)
    v = _load_tile(V + kv_off, offs_n, offs_d, HEAD_DIM, 1, N_CTX, True, HEAD_DIM, HEAD_DIM, False)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    full_hi = N_CTX // BLOCK_M * BLOCK_M
    band_lo = tl.minimum(start_n, N_CTX) // BLOCK_M * BLOCK_M
    full_lo = tl.minimum(tl.cdiv(start_n + BLOCK_N - 1, BLOCK_M) * BLOCK_M, full_hi)
    tail_lo = tl.where(start_n >= N_CTX, N_CTX, full_hi)
    for g in range(0, GROUP):
        row0 = (off_z * H + off_hkv * GROUP + g) * N_CTX
        q_base = Q + row0 * HEAD_DIM
        do_base = DO + row0 * HEAD_DIM
        dk, dv = _inner(dk, dv, k, v, q_base, do_base, Lse + row0, Delta + row0, dq_desc,
                        row0.to(tl.int32), offs_n, offs_d, band_lo, full_lo, N_CTX, qk_scale,
                        True, HEAD_DIM, BLOCK_M)
        dk, dv = _inner(dk, dv, k, v, q_base, do_base, Lse + row0, Delta + row0, dq_desc,
                        row0.to(tl.int32), offs_n, offs_d, full_lo, full_hi, N_CTX, qk_scale,
                        False, HEAD_DIM, BLOCK_M)
        dk, dv = _inner(dk, dv, k, v, q_base, do_base, Lse + row0, Delta + row0, dq_desc,
                        row0.to(tl.int32), offs_n, offs_d, tail_lo, N_CTX, N_CTX, qk_scale,
                        True, HEAD_DIM, BLOCK_M)
    n_ok = (offs_n < N_CTX)[:, None]
    ptrs = offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(DK + kv_off + ptrs, (dk * sm_scale).to(DK.dtype.element_ty), mask=n_ok)
    tl.store(DV + kv_off + ptrs, dv.to(DV.dtype.element_ty), mask=n_ok)


@triton.jit
def _scale_cast(ACC, DQ, n, sm_scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    tl.store(DQ + offs, (tl.load(ACC + offs, mask=ok) * sm_scale).to(DQ.dtype.element_ty),
             mask=ok)


def backward(do, q, k, v, out, lse, dq, dk, dv, delta, dq_acc, *, block_m, block_n, warps,
             stages):
    """dq, dk, dv of causal attention (top-left) for contiguous bf16/fp16 inputs; delta
    [batch, heads, seq] and dq_acc [batch * heads * seq, head_dim] fp32 are scratch. Returns
    the fused kernel's compiled handle (registers, spills)."""
    batch, heads, seq, d = q.shape
    kv_heads = k.shape[1]
    scale = d ** -0.5
    pre_m = 64
    bwd._attn_bwd_preprocess[(batch * heads, triton.cdiv(seq, pre_m))](
        out, do, delta, *out.stride(), *do.stride(), heads, seq,
        HEAD_DIM=d, BLOCK_D=d, BLOCK_M=pre_m)
    dq_acc.zero_()
    desc = TensorDescriptor.from_tensor(dq_acc, [block_m, d])
    compiled = _bwd_tma_dq[(batch * kv_heads, triton.cdiv(seq, block_n))](
        q, k, v, do, dk, dv, lse, delta, desc, kv_heads, heads // kv_heads, seq,
        scale * LOG2E, scale, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
        num_stages=stages)
    n = dq.numel()
    _scale_cast[(triton.cdiv(n, 4096),)](dq_acc, dq, n, scale, BLOCK=4096)
    return compiled


def scratch(q):
    """The fp32 accumulator `backward` adds dQ into, one row per query row."""
    return torch.empty(q.numel() // q.shape[-1], q.shape[-1], device=q.device,
                       dtype=torch.float32)
