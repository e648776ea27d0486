"""
Fused attention backward (FlashAttention-2 algorithm) in Triton
===============================================================

The forward saved the output O and the log-sum-exp L of every query row, so the backward never
stores the L x S probability matrix: it recomputes each tile of it from Q, K and L,

    P = exp2(Q K^T * scale * log2(e) - L * log2(e))     (the softmax, exactly, in fp32)

and with dO the gradient of the output and Delta_i = sum_d dO_id O_id (= rowsum(P * dP)):

    dV = P^T dO        dP = dO V^T        dS = P * (dP - Delta)        dQ = dS K * scale
                                                                       dK = dS^T Q * scale

Three launches, no atomics, so every gradient is bitwise reproducible:
- `_attn_bwd_preprocess`: Delta, one fp32 per query row.
- `_attn_bwd_dkdv`: one program per (batch, K/V head, key block) keeps its K and V tiles and the
  dK/dV accumulators on chip and streams the query blocks that see those keys. Under GQA/MQA the
  program loops over the GROUP query heads that share its K/V head, so the sum over them happens
  in registers: no atomics, no repeated K/V, no per-query-head dK/dV to reduce afterwards.
- `_attn_bwd_dq`: one program per (batch, query head, query block) keeps Q, dO and the dQ
  accumulator on chip and streams the key blocks its rows see, as the forward does.
Splitting dQ from dK/dV recomputes S and dP (7 matmuls per tile pair instead of 5) but each
program owns what it writes; the single-kernel alternative adds dQ with fp32 atomics, which is
non-deterministic and needs a zeroed fp32 buffer plus a cast.

Conventions shared with attention_fwd.py (same names, same masks, common.py's helpers):
- Query i sees key j when j <= i + CAUSAL_OFFSET (0: top-left as SDPA; S - L: bottom-right).
- The causal loops split as in the forward: blocks every row/key of the tile fully sees run
  without mask arithmetic, the diagonal band and the ragged ends of Q and K run masked.
- A row that sees no key has L = -inf; it is loaded as +inf in log2 units so P = exp2(-inf) = 0
  on it (never exp2(-inf - -inf) = NaN), and its dQ, and what it adds to dK/dV, are exactly 0.
- Any head_dim (BLOCK_D padding loads zeros), any length (masks), any strides of q/k/v/o/dO.
- fp32 inputs use IEEE fp32 dots; P and dS are cast to the input dtype before their matmuls, as
  in the forward's P @ V.
- Window, softcap and packed sequences as in the forward (same constexprs). Under a softcap, P
  is recomputed from the capped logits and dS is multiplied by the cap's derivative 1 - tanh^2.
  Under a window the dK/dV program visits only the query blocks whose rows see its keys (the
  window's left edge ends them), the dQ program only the key blocks its rows see.

On sm_90, eager head_dim-128 calls (80, 96 and 112 on 128's tiles; 64 from 2049 queries on) whose
q/k/v/dO the copy engine can read (contiguous or bshd views), windowed and softcapped ones too but
not packed batches, take the Gluon dK/dV and dQ kernels of attention_bwd_hopper.py after the
preprocess (the same split and math, warp-specialized with TMA and wgmma; notes/backward.md, lever
1). With deterministic=False those of them at head_dim 128 without GQA take its dK/dV kernel that
adds dQ as well, in any order (`fused_dq`; notes/backward.md, lever 3): the one exception to the
bitwise rule above.

Limits: head_dim <= 256; the gradient of the LSE output is not computed (the op marks it
non-differentiable); no double backward. Same devices as the forward.
"""

import functools

import torch

import triton
import triton.language as tl

from attnscope.kernels.common import (LOG2E_C, _head_base, _load, _logits, _query_block, _sees,
                                      _sees_window, _sequence, _window_key_ranges, aligned,
                                      check_row_offsets, head_group, is_interpreted,
                                      score_scales, tile_constants, visibility)
from attnscope.kernels.launch import FastLaunch


@triton.jit
def _load_tile(base, offs, offs_d, stride_s, stride_d, n_ctx, CHECK_ROWS: tl.constexpr,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, TRANSPOSED: tl.constexpr):
    # Rows `offs` of a [seq, head_dim] matrix as a [rows, BLOCK_D] tile, or [BLOCK_D, rows] when
    # TRANSPOSED; rows past n_ctx (when checked) and padding columns load as zeros.
    rows_ok = offs < n_ctx
    d_ok = offs_d < HEAD_DIM
    if TRANSPOSED:
        return _load(base + offs[None, :] * stride_s + offs_d[:, None] * stride_d,
                     rows_ok[None, :], d_ok[:, None], CHECK_ROWS, HEAD_DIM != BLOCK_D)
    else:
        return _load(base + offs[:, None] * stride_s + offs_d[None, :] * stride_d,
                     rows_ok[:, None], d_ok[None, :], CHECK_ROWS, HEAD_DIM != BLOCK_D)


@triton.jit
def _lse_log2(lse):
    # Natural-log LSE -> log2 units for exp2. A row that sees no key (LSE -inf) becomes +inf, so
    # qk - lse is -inf and its probabilities exactly 0, whether its scores are masked or not.
    return tl.where(lse == float("-inf"), float("inf"), lse * LOG2E_C)


@triton.jit
def _attn_bwd_preprocess(O, DO, Delta,  #
                         stride_oz, stride_oh, stride_om, stride_ok,  #
                         stride_doz, stride_doh, stride_dom, stride_dok,  #
                         H, N_CTX_Q,  #
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    off_hz = tl.program_id(0)
    start_m = tl.program_id(1)
    off_z = (off_hz // H).to(tl.int64)
    off_h = (off_hz % H).to(tl.int64)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    o = _load_tile(O + off_z * stride_oz + off_h * stride_oh, offs_m, offs_d, stride_om,
                   stride_ok, N_CTX_Q, True, HEAD_DIM, BLOCK_D, False)
    do = _load_tile(DO + off_z * stride_doz + off_h * stride_doh, offs_m, offs_d, stride_dom,
                    stride_dok, N_CTX_Q, True, HEAD_DIM, BLOCK_D, False)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(Delta + off_hz.to(tl.int64) * N_CTX_Q + offs_m, delta, mask=offs_m < N_CTX_Q)


@triton.jit
def _attn_bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base,  #
                         stride_qm, stride_qk, stride_dom, stride_dok,  #
                         offs_n, offs_d, lo, hi, N_CTX_Q, CAUSAL_OFFSET, LEFT_OFFSET, qk_scale,
                         softcap_log2,  #
                         MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                         SOFTCAP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_M: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    # Works on transposed tiles (keys along rows) so that dK and dV accumulate as
    # [BLOCK_N, BLOCK_D] without transposing the accumulators.
    for start_m in tl.range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        m_ok = offs_m < N_CTX_Q
        # -- P^T = exp2(K Q^T * scale*log2e - L*log2e); Q loaded transposed [BLOCK_D, BLOCK_M] --
        qT = _load_tile(q_base, offs_m, offs_d, stride_qm, stride_qk, N_CTX_Q, MASKED,
                        HEAD_DIM, BLOCK_D, True)
        qkT = tl.dot(k, qT, input_precision=INPUT_PRECISION)
        if MASKED:
            lse = _lse_log2(tl.load(lse_base + offs_m, mask=m_ok, other=float("-inf")))
            delta = tl.load(delta_base + offs_m, mask=m_ok, other=0.0)
            visible = m_ok[None, :]
            if CAUSAL:
                visible = visible & _sees(offs_m[None, :], offs_n[:, None], CAUSAL_OFFSET)
            if HAS_WINDOW:
                visible = visible & _sees_window(offs_m[None, :], offs_n[:, None], LEFT_OFFSET)
            logits, tanh_s = _logits(qkT, qk_scale, softcap_log2, SOFTCAP)
            qkT = tl.where(visible, logits, float("-inf"))
            pT = tl.math.exp2(qkT - lse[None, :])
        else:
            # every row here sees every key of the block, so its LSE is finite
            lse = tl.load(lse_base + offs_m) * LOG2E_C
            delta = tl.load(delta_base + offs_m)
            logits, tanh_s = _logits(qkT, qk_scale, softcap_log2, SOFTCAP)
            pT = tl.math.exp2(logits - lse[None, :])
        do = _load_tile(do_base, offs_m, offs_d, stride_dom, stride_dok, N_CTX_Q, MASKED,
                        HEAD_DIM, BLOCK_D, False)
        # -- dV += P^T dO --
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=INPUT_PRECISION)
        # -- dS^T = P^T * (dP^T - Delta), dP^T = V dO^T; dK += dS^T Q --
        dpT = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)
        dsT = pT * (dpT - delta[None, :])
        if SOFTCAP:  # through the cap: d(c * tanh(s / c)) / ds = 1 - tanh^2
            dsT = dsT * (1.0 - tanh_s * tanh_s)
        dk = tl.dot(dsT.to(qT.dtype), tl.trans(qT), dk, input_precision=INPUT_PRECISION)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(Q, K, V, DO, DK, DV, Lse, Delta, CU_SEQLENS_Q, CU_SEQLENS_K,  #
                   stride_qz, stride_qh, stride_qm, stride_qk,  #
                   stride_kz, stride_kh, stride_kn, stride_kk,  #
                   stride_vz, stride_vh, stride_vn, stride_vk,  #
                   stride_doz, stride_doh, stride_dom, stride_dok,  #
                   stride_dkz, stride_dkh, stride_dkn, stride_dkk,  #
                   stride_dvz, stride_dvh, stride_dvn, stride_dvk,  #
                   H_KV, GROUP, N_CTX_Q, N_CTX_K, CAUSAL_OFFSET, LEFT_OFFSET, qk_scale,
                   softcap_log2, sm_scale,  #
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,  #
                   HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, VARLEN: tl.constexpr,  #
                   INPUT_PRECISION: tl.constexpr,  #
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # K/V heads along grid axis 0, key blocks along axis 1 in order: under a causal mask the
    # first key blocks are seen by the most queries, so the longest programs start first.
    # CAUSAL, HAS_WINDOW, VARLEN and the offsets as in the forward (_attn_fwd).
    qk_scale = tl.cast(qk_scale, tl.float32)  # torch.compile passes Python floats as fp64
    softcap_log2 = tl.cast(softcap_log2, tl.float32)
    sm_scale = tl.cast(sm_scale, tl.float32)
    off_hkvz = tl.program_id(0)
    start_n = tl.program_id(1) * BLOCK_N
    off_z = (off_hkvz // H_KV).to(tl.int64)
    off_hkv = (off_hkvz % H_KV).to(tl.int64)
    H = H_KV * GROUP
    q_start, seq_q = _sequence(CU_SEQLENS_Q, off_z, N_CTX_Q, VARLEN)
    k_start, seq_k = _sequence(CU_SEQLENS_K, off_z, N_CTX_K, VARLEN)
    if VARLEN:
        if start_n >= seq_k:  # the grid covers the longest sequence
            return
        CAUSAL_OFFSET += seq_k - seq_q
        LEFT_OFFSET += seq_k - seq_q

    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < seq_k
    d_ok = offs_d < HEAD_DIM
    # K and V stay on chip for the whole program; keys past seq_k load as zeros and only ever
    # touch their own (unstored) rows of dK and dV, so the loops below need no key mask.
    k_base = _head_base(K, off_z, off_hkv, stride_kz, stride_kh, k_start, stride_kn, VARLEN)
    k = _load_tile(k_base, offs_n, offs_d, stride_kn, stride_kk, seq_k, True, HEAD_DIM, BLOCK_D,
                   False)
    v_base = _head_base(V, off_z, off_hkv, stride_vz, stride_vh, k_start, stride_vn, VARLEN)
    v = _load_tile(v_base, offs_n, offs_d, stride_vn, stride_vk, seq_k, True, HEAD_DIM, BLOCK_D,
                   False)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # Query ranges, in BLOCK_M steps. Rows from start_n + BLOCK_N - 1 - CAUSAL_OFFSET on see every
    # key of this block: whole query blocks there need no mask. Above them, from the first row
    # that sees key start_n, is the masked diagonal band; the ragged end of Q is masked too.
    full_hi = seq_q // BLOCK_M * BLOCK_M
    if CAUSAL:
        first_row = tl.minimum(tl.maximum(start_n - CAUSAL_OFFSET, 0), seq_q)
        band_lo = first_row // BLOCK_M * BLOCK_M
        full_lo = tl.maximum(start_n + BLOCK_N - 1 - CAUSAL_OFFSET, 0)
        full_lo = tl.minimum(tl.cdiv(full_lo, BLOCK_M) * BLOCK_M, full_hi)
        # no query sees this block (top-left with more keys than queries): nothing to add
        tail_lo = tl.where(first_row == seq_q, seq_q, full_hi)
    else:
        band_lo = 0
        full_lo = 0
        tail_lo = full_hi
    tail_hi = seq_q
    if HAS_WINDOW:
        # The window's left edge ends the rows that see this block: row i sees key j only when
        # i <= j - LEFT_OFFSET. Rows up to start_n - LEFT_OFFSET see all of its keys (unmasked
        # if the diagonal lets them), rows to start_n + BLOCK_N - 1 - LEFT_OFFSET some (masked),
        # and no query block past that is visited.
        tail_hi = tl.minimum(tl.maximum(start_n + BLOCK_N - LEFT_OFFSET, 0), seq_q)
        full_hi = tl.minimum(tl.maximum(start_n + 1 - LEFT_OFFSET, 0) // BLOCK_M * BLOCK_M,
                             full_hi)
        no_full = full_lo >= full_hi  # a window narrower than a block: all masked
        full_lo = tl.where(no_full, band_lo, full_lo)
        full_hi = tl.where(no_full, band_lo, full_hi)
        tail_lo = full_hi

    for g in range(0, GROUP):
        # the query heads sharing this K/V head add their contributions in registers
        off_h = off_hkv * GROUP + g
        q_base = _head_base(Q, off_z, off_h, stride_qz, stride_qh, q_start, stride_qm, VARLEN)
        do_base = _head_base(DO, off_z, off_h, stride_doz, stride_doh, q_start, stride_dom,
                             VARLEN)
        if VARLEN:  # LSE and Delta are [heads, total_q]
            lse_base = Lse + off_h * N_CTX_Q + q_start
            delta_base = Delta + off_h * N_CTX_Q + q_start
        else:
            lse_base = Lse + (off_z * H + off_h) * N_CTX_Q
            delta_base = Delta + (off_z * H + off_h) * N_CTX_Q
        # stage 1: the diagonal band, masked
        dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base,  #
                                      stride_qm, stride_qk, stride_dom, stride_dok,  #
                                      offs_n, offs_d, band_lo, full_lo, seq_q, CAUSAL_OFFSET,
                                      LEFT_OFFSET, qk_scale, softcap_log2,  #
                                      True, CAUSAL, HAS_WINDOW, SOFTCAP, HEAD_DIM, BLOCK_D,
                                      BLOCK_M, INPUT_PRECISION)
        # stage 2: query blocks below the band that see the whole key block, no masking
        dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base,  #
                                      stride_qm, stride_qk, stride_dom, stride_dok,  #
                                      offs_n, offs_d, full_lo, full_hi, seq_q, CAUSAL_OFFSET,
                                      LEFT_OFFSET, qk_scale, softcap_log2,  #
                                      False, CAUSAL, HAS_WINDOW, SOFTCAP, HEAD_DIM, BLOCK_D,
                                      BLOCK_M, INPUT_PRECISION)
        # stage 3: the ragged last query block (or the window's left edge), masked
        dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base,  #
                                      stride_qm, stride_qk, stride_dom, stride_dok,  #
                                      offs_n, offs_d, tail_lo, tail_hi, seq_q, CAUSAL_OFFSET,
                                      LEFT_OFFSET, qk_scale, softcap_log2,  #
                                      True, CAUSAL, HAS_WINDOW, SOFTCAP, HEAD_DIM, BLOCK_D,
                                      BLOCK_M, INPUT_PRECISION)

    # epilogue: dS was taken w.r.t. the scaled scores; the chain rule puts the scale on dK
    dk = dk * sm_scale
    nd_ok = n_ok[:, None] & d_ok[None, :]
    tl.store(_head_base(DK, off_z, off_hkv, stride_dkz, stride_dkh, k_start, stride_dkn, VARLEN)
             + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkk,
             dk.to(DK.dtype.element_ty), mask=nd_ok)
    tl.store(_head_base(DV, off_z, off_hkv, stride_dvz, stride_dvh, k_start, stride_dvn, VARLEN)
             + offs_n[:, None] * stride_dvn + offs_d[None, :] * stride_dvk,
             dv.to(DV.dtype.element_ty), mask=nd_ok)


@triton.jit
def _attn_bwd_dq_inner(dq, q, do, lse, delta, k_base, v_base,  #
                       stride_kn, stride_kk, stride_vn, stride_vk,  #
                       offs_m, offs_d, lo, hi, N_CTX_K, CAUSAL_OFFSET, LEFT_OFFSET, qk_scale,
                       softcap_log2,  #
                       MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                       SOFTCAP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_N: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    for start_n in tl.range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N_CTX_K
        # K and V loaded transposed, [BLOCK_D, BLOCK_N], as in the forward
        kT = _load_tile(k_base, offs_n, offs_d, stride_kn, stride_kk, N_CTX_K, MASKED,
                        HEAD_DIM, BLOCK_D, True)
        vT = _load_tile(v_base, offs_n, offs_d, stride_vn, stride_vk, N_CTX_K, MASKED,
                        HEAD_DIM, BLOCK_D, True)
        qk = tl.dot(q, kT, input_precision=INPUT_PRECISION)
        if MASKED:
            visible = n_ok[None, :]
            if CAUSAL:
                visible = visible & _sees(offs_m[:, None], offs_n[None, :], CAUSAL_OFFSET)
            if HAS_WINDOW:
                visible = visible & _sees_window(offs_m[:, None], offs_n[None, :], LEFT_OFFSET)
            logits, tanh_s = _logits(qk, qk_scale, softcap_log2, SOFTCAP)
            qk = tl.where(visible, logits, float("-inf"))
            p = tl.math.exp2(qk - lse[:, None])
        else:
            logits, tanh_s = _logits(qk, qk_scale, softcap_log2, SOFTCAP)
            p = tl.math.exp2(logits - lse[:, None])
        # -- dS = P * (dO V^T - Delta); dQ += dS K --
        dp = tl.dot(do, vT, input_precision=INPUT_PRECISION)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - tanh_s * tanh_s)
        dq = tl.dot(ds.to(kT.dtype), tl.trans(kT), dq, input_precision=INPUT_PRECISION)
    return dq


@triton.jit
def _attn_bwd_dq(Q, K, V, DO, DQ, Lse, Delta, CU_SEQLENS_Q, CU_SEQLENS_K,  #
                 stride_qz, stride_qh, stride_qm, stride_qk,  #
                 stride_kz, stride_kh, stride_kn, stride_kk,  #
                 stride_vz, stride_vh, stride_vn, stride_vk,  #
                 stride_doz, stride_doh, stride_dom, stride_dok,  #
                 stride_dqz, stride_dqh, stride_dqm, stride_dqk,  #
                 H, GROUP, N_CTX_Q, N_CTX_K, CAUSAL_OFFSET, LEFT_OFFSET, qk_scale, softcap_log2,
                 sm_scale, NUM_M, HEAD_GROUP,  #
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,  #
                 HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, VARLEN: tl.constexpr,  #
                 INPUT_PRECISION: tl.constexpr,  #
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    qk_scale = tl.cast(qk_scale, tl.float32)
    softcap_log2 = tl.cast(softcap_log2, tl.float32)
    sm_scale = tl.cast(sm_scale, tl.float32)
    # the forward's grid and tile order
    off_hz, start_m, off_z, off_h, off_hkv = _query_block(H, GROUP, NUM_M, HEAD_GROUP)
    q_start, seq_q = _sequence(CU_SEQLENS_Q, off_z, N_CTX_Q, VARLEN)
    k_start, seq_k = _sequence(CU_SEQLENS_K, off_z, N_CTX_K, VARLEN)
    if VARLEN:
        if start_m * BLOCK_M >= seq_q:
            return
        CAUSAL_OFFSET += seq_k - seq_q
        LEFT_OFFSET += seq_k - seq_q

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < seq_q
    d_ok = offs_d < HEAD_DIM
    md_ok = m_ok[:, None] & d_ok[None, :]
    q_base = _head_base(Q, off_z, off_h, stride_qz, stride_qh, q_start, stride_qm, VARLEN)
    q = _load_tile(q_base, offs_m, offs_d, stride_qm, stride_qk, seq_q, True, HEAD_DIM, BLOCK_D,
                   False)
    do_base = _head_base(DO, off_z, off_h, stride_doz, stride_doh, q_start, stride_dom, VARLEN)
    do = _load_tile(do_base, offs_m, offs_d, stride_dom, stride_dok, seq_q, True, HEAD_DIM,
                    BLOCK_D, False)
    # rows past seq_q load LSE -inf like rows that see no key: P is 0 on them
    if VARLEN:
        row = off_h * N_CTX_Q + q_start + offs_m  # LSE and Delta are [heads, total_q]
    else:
        row = off_hz.to(tl.int64) * N_CTX_Q + offs_m
    lse = _lse_log2(tl.load(Lse + row, mask=m_ok, other=float("-inf")))
    delta = tl.load(Delta + row, mask=m_ok, other=0.0)
    k_base = _head_base(K, off_z, off_hkv, stride_kz, stride_kh, k_start, stride_kn, VARLEN)
    v_base = _head_base(V, off_z, off_hkv, stride_vz, stride_vh, k_start, stride_vn, VARLEN)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    lo, full_lo, full_hi, masked_hi = _window_key_ranges(start_m, seq_k, CAUSAL_OFFSET,
                                                         LEFT_OFFSET, CAUSAL, HAS_WINDOW,
                                                         BLOCK_M, BLOCK_N)

    if HAS_WINDOW:
        # stage 0: the window's left edge, masked (blocks left of it are skipped)
        dq = _attn_bwd_dq_inner(dq, q, do, lse, delta, k_base, v_base,  #
                                stride_kn, stride_kk, stride_vn, stride_vk,  #
                                offs_m, offs_d, lo, full_lo, seq_k, CAUSAL_OFFSET, LEFT_OFFSET,
                                qk_scale, softcap_log2,  #
                                True, CAUSAL, HAS_WINDOW, SOFTCAP, HEAD_DIM, BLOCK_D, BLOCK_N,
                                INPUT_PRECISION)
    # stage 1: blocks every row sees whole, no masking
    dq = _attn_bwd_dq_inner(dq, q, do, lse, delta, k_base, v_base,  #
                            stride_kn, stride_kk, stride_vn, stride_vk,  #
                            offs_m, offs_d, full_lo, full_hi, seq_k, CAUSAL_OFFSET, LEFT_OFFSET,
                            qk_scale, softcap_log2,  #
                            False, CAUSAL, HAS_WINDOW, SOFTCAP, HEAD_DIM, BLOCK_D, BLOCK_N,
                            INPUT_PRECISION)
    # stage 2: the diagonal band (or the window's right edge) and the ragged end of K, masked
    dq = _attn_bwd_dq_inner(dq, q, do, lse, delta, k_base, v_base,  #
                            stride_kn, stride_kk, stride_vn, stride_vk,  #
                            offs_m, offs_d, full_hi, masked_hi, seq_k, CAUSAL_OFFSET, LEFT_OFFSET,
                            qk_scale, softcap_log2,  #
                            True, CAUSAL, HAS_WINDOW, SOFTCAP, HEAD_DIM, BLOCK_D, BLOCK_N,
                            INPUT_PRECISION)

    dq = dq * sm_scale
    tl.store(_head_base(DQ, off_z, off_h, stride_dqz, stride_dqh, q_start, stride_dqm, VARLEN)
             + offs_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqk,
             dq.to(DQ.dtype.element_ty), mask=md_ok)


# Launch configs per head-dim class: (BLOCK_M1, BLOCK_N1, warps1, stages1) tile and launch the
# dK/dV kernel (few query rows streamed past many resident keys), (BLOCK_M2, BLOCK_N2, warps2,
# stages2) the dQ kernel (many resident query rows, few streamed keys), as in Triton's tutorial;
# the preprocess takes the dQ kernel's row blocks and Triton's default warps. Resident tiles
# hold two fp32 accumulators (dK, dV or dQ) plus two input tiles, so wider heads get fewer
# resident rows or more warps to keep them in registers. A fixed table for the forward's reason: no autotuner cost per call.
CONFIG_FIELDS = ("BLOCK_M1", "BLOCK_N1", "warps1", "stages1",
                 "BLOCK_M2", "BLOCK_N2", "warps2", "stages2")
CONFIGS = {
    64: (32, 64, 4, 3, 64, 64, 4, 3),
    128: (64, 128, 8, 3, 128, 64, 8, 3),
    256: (32, 64, 8, 1, 64, 32, 8, 1),
}
# The interpreter runs one config; BLOCK_M != BLOCK_N both ways so that CPU tests cross a diagonal
# band spanning several query blocks (dK/dV) and several key blocks (dQ).
INTERPRETER_CONFIG = (16, 32, 4, 1, 32, 16, 4, 1)


def config_for(head_dim):
    """The config, a tuple named by CONFIG_FIELDS, a launch with this head_dim uses."""
    if is_interpreted():
        return INTERPRETER_CONFIG
    return CONFIGS[64 if head_dim <= 64 else 128 if head_dim <= 128 else 256]


def attention_bwd(do, q, k, v, out, lse, dq, dk, dv, delta, *, causal, scale, causal_offset,
                  window=(-1, -1), softcap=0.0, varlen=None, wrap=None, config=None,
                  deterministic=True, kept=False):
    """Launch the backward. q, out, do, dq: [batch, heads, q_len, head_dim] views with any
    strides; k, v, dk, dv: [batch, kv_heads, kv_len, head_dim]; lse (the forward's, natural log)
    and delta (scratch, written here): contiguous fp32 [batch, heads, q_len]. Writes dq, dk, dv.
    `window`, `softcap` and `varlen` (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    as the forward's (attention_fwd.attention_fwd_triton); with varlen, lse and delta are
    [heads, total_q]. `wrap` lets the custom op pass torch.library.wrap_triton so torch.compile
    sees the launches; without it the launches skip Triton's dispatch on repeats (FastLaunch).
    `config`: a tuple named by CONFIG_FIELDS instead of the table's (tests, labs).
    deterministic=False lets the calls the Gluon kernels take without GQA add dQ from the dK/dV
    kernel in any order (fused_dq); every other call computes as with True.
    kept=True (an eager call) returns the call's launches kept for its repeats instead
    (`_kept_backward`, `_kept_gluon_backward`), or None where they are not kept (a packed batch,
    the interpreter, a Triton without the direct launcher or a launch a cache hook stopped)."""
    batch, heads, q_len, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    if config is None:
        config = config_for(head_dim)
    elif len(config) != len(CONFIG_FIELDS):
        raise ValueError(f"config must be a tuple of {CONFIG_FIELDS}, got {config!r}")
    block_m1, block_n1, warps1, stages1, block_m2, block_n2, warps2, stages2 = config
    block_d, precision = tile_constants(head_dim, q.dtype)
    bounded, offset, has_window, left_offset = visibility(causal, causal_offset, window)
    qk_scale, softcap_log2, has_softcap = score_scales(scale, softcap)
    common = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, CAUSAL=bounded, HAS_WINDOW=has_window,
                  SOFTCAP=has_softcap, VARLEN=varlen is not None, INPUT_PRECISION=precision)
    if varlen is None:
        cu_q = cu_k = None
        max_q, max_k = q_len, kv_len
        # Delta, one row per query row: [batch, heads] programs over query blocks
        pre_grid = (batch * heads, -(-q_len // block_m2))
    else:
        cu_q, cu_k, max_q, max_k = varlen
        # The packed rows are one sequence to Delta: [heads, total_q] (batch stride 0)
        pre_grid = (heads, -(-q_len // block_m2))
    num_m = -(-max_q // block_m2)
    # (Delta's Triton kernel walks a packed batch's rows as one sequence: all q_len of them)
    check_row_offsets(q_len, (out, do), ("out", "dout"))
    tensors = (q, k, v, out, do, dq, dk, dv, lse, delta)
    strides = tuple(t.stride() for t in tensors)  # read once: the launches and the key share them
    sq, sk, sv, so, sdo, sdq, sdk, sdv = strides[:8]
    # dK/dV and dQ by the Gluon kernels on sm_90 where they take the call
    # (attention_bwd_hopper.py)
    hopper = (wrap is None and q.is_cuda and _hopper() is not None
              and _hopper().supports(q, k, v, do, dq, dk, dv, window, softcap, varlen))
    if not hopper:  # (the Gluon kernels' copy engine takes 64-bit strides)
        check_row_offsets(max_q, (q, dq), ("q", "dq"))
        check_row_offsets(max_k, (k, v, dk, dv), ("k", "v", "dk", "dv"))
    launches = [
        (_launch_preprocess, pre_grid,
         (out, do, delta, *so, *sdo, heads, q_len),
         dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m2)),
        (_launch_dkdv, (batch * kv_heads, -(-max_k // block_n1)),
         (q, k, v, do, dk, dv, lse, delta, cu_q, cu_k,  #
          *sq, *sk, *sv, *sdo, *sdk, *sdv,  #
          kv_heads, heads // kv_heads, q_len, kv_len, offset, left_offset, qk_scale,
          softcap_log2, scale),
         dict(BLOCK_M=block_m1, BLOCK_N=block_n1, num_warps=warps1, num_stages=stages1,
              **common)),
        (_launch_dq, (batch * heads * num_m,),
         (q, k, v, do, dq, lse, delta, cu_q, cu_k,  #
          *sq, *sk, *sv, *sdo, *sdq,  #
          heads, heads // kv_heads, q_len, kv_len, offset, left_offset, qk_scale, softcap_log2,
          scale, num_m, head_group(q, k)),
         dict(BLOCK_M=block_m2, BLOCK_N=block_n2, num_warps=warps2, num_stages=stages2,
              **common)),
    ]
    if wrap is not None:
        for launch, grid, args, kwargs in launches:
            result = wrap(launch.kernel)[grid](*args, **kwargs)
        return None if kept else result
    # one key for the three launches: shapes, strides, alignment and the config fix them all
    key = (q.device, tuple(t.dtype for t in tensors), q.shape, k.shape, strides,
           aligned(*tensors), causal, causal_offset, window, softcap, config, hopper)
    if varlen is not None:  # the cumulative lengths are arguments too: the key fixes none
        key += ("varlen", max_q, max_k, aligned(cu_q, cu_k))
    if hopper:
        launch, grid, args, kwargs = launches[0]
        launch(key, grid, args, kwargs)  # Delta
        gluon = _hopper()
        fused = not deterministic and fused_dq(gluon, heads, kv_heads, q.shape[-1])
        shared = dict(causal=bounded, scale=scale, causal_offset=offset, softcap=softcap,
                      left_offset=left_offset if has_window else None, key=key)
        if fused:
            # dS K added into a zeroed fp32 buffer by the dK/dV kernel, then scaled into dq
            dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
            gluon.attention_bwd_dkdv_hopper(q, k, v, do, dk, dv, lse, delta, dq_acc=dq_acc,
                                            **shared)
            result = torch.mul(dq_acc, scale, out=dq)
        else:
            gluon.attention_bwd_dkdv_hopper(q, k, v, do, dk, dv, lse, delta, **shared)
            result = gluon.attention_bwd_dq_hopper(q, k, v, do, dq, lse, delta, **shared)
        if kept:
            return _kept_gluon_backward(gluon, key, launches[0], scale, fused)
        return result
    for launch, grid, args, kwargs in launches:
        result = launch(key, grid, args, kwargs)
    if kept:
        return _kept_backward(key, launches) if varlen is None else None
    return result


# How many tensors lead each Triton launch's arguments (the rest the launch key fixes): Delta's
# (out, do, delta), dK/dV's (q, k, v, do, dk, dv, lse, delta) and dQ's (q, k, v, do, dq, lse,
# delta); a packed batch's cumulative lengths follow them, so its launches are never kept here.
_LEADING_TENSORS = (3, 8, 7)


def _kept_backward(key, launches):
    """The three Triton launches of a call again, for calls with the same key and the same
    scale (every argument but the leading tensors is the first call's: strides, lengths, the
    causal offset, the scales), or None where a launch was not kept (the interpreter, a cache
    hook). It takes the ten tensors attention_bwd takes, in its order."""
    bounds = [launch.bound.get(key) for launch, *_ in launches]
    if None in bounds:
        return None
    (pre, dkdv, dq_launch), rests = bounds, [args[n:] for (_, _, args, _), n in
                                             zip(launches, _LEADING_TENSORS)]
    pre_rest, dkdv_rest, dq_rest = rests

    def launch(do, q, k, v, out, lse, dq, dk, dv, delta):
        pre((out, do, delta, *pre_rest))
        dkdv((q, k, v, do, dk, dv, lse, delta, *dkdv_rest))
        dq_launch((q, k, v, do, dq, lse, delta, *dq_rest))
    return launch


def _kept_gluon_backward(gluon, key, delta_launch, scale, fused):
    """_kept_backward's counterpart for the Gluon dK/dV and dQ kernels (attention_bwd_hopper):
    Delta's Triton launch, then theirs; with `fused` dQ is added into a zeroed fp32 buffer by
    the dK/dV kernel and scaled into dq, as attention_bwd does."""
    launch, _, args, _ = delta_launch
    pre = launch.bound.get(key)
    dkdv, dq_launch = gluon.kept_launches(key, scale, fused)
    if pre is None or dkdv is None or (dq_launch is None and not fused):
        return None
    pre_rest = args[_LEADING_TENSORS[0]:]

    def run(do, q, k, v, out, lse, dq, dk, dv, delta):
        # The kept launches read data pointers only; the fused path's dQ buffer and its scaling
        # are tensor ops, so dq must be the [batch, heads, seq, head_dim] view (a remembered bshd
        # call passes its other tensors as they are: fused._backward_repeat).
        pre((out, do, delta, *pre_rest))
        if fused:
            dq_acc = torch.zeros(dq.shape, dtype=torch.float32, device=dq.device)
            dkdv((q, k, v, do, dk, dv, lse, delta, dq_acc))
            torch.mul(dq_acc, scale, out=dq)
        else:
            dkdv((q, k, v, do, dk, dv, lse, delta, lse))
            dq_launch((q, k, v, do, dq, lse, delta))
    return run


def fused_dq(gluon, heads, kv_heads, head_dim):
    """Whether deterministic=False fuses dQ into the Gluon dK/dV kernel (a call the Gluon
    kernels take): at head_dim 128 (`gluon.fuses_dq`: each consumer adds 64 of its columns, in
    64-row query blocks), without GQA, where the copy engine can add into global memory, and not
    while torch.use_deterministic_algorithms(True) is on (that setting wins). One kernel
    instead of two: at head_dim 128, bf16, on the H200, 3.151 against 3.337 ms at
    (4,32,4096,128) and 10.64 against 11.57 at (2,16,16384,128) in the backward record
    (results/h200/bench_bwd.json, e893ca2); under GQA its consumers spill and it lost when built
    (4.35 against 3.63 ms with 8 K/V heads; notes/backward.md, lever 3, "The fused-dQ
    kernel")."""
    return (heads == kv_heads and gluon.tma_add is not None and gluon.fuses_dq(head_dim)
            and not torch.are_deterministic_algorithms_enabled())


@functools.cache
def _hopper():
    """attention_bwd_hopper, or None where this Triton's Gluon lacks what it uses
    (gluon_compat.missing; the forward's dispatch says so once) or it fails to import: then the
    Triton dK/dV and dQ kernels run."""
    from attnscope.kernels import gluon_compat
    if gluon_compat.missing():
        return None
    try:
        from attnscope.kernels import attention_bwd_hopper
    except Exception:  # noqa: BLE001 (any failure: keep the Triton kernel)
        return None
    return attention_bwd_hopper


_launch_preprocess = FastLaunch(_attn_bwd_preprocess)
_launch_dkdv = FastLaunch(_attn_bwd_dkdv)
_launch_dq = FastLaunch(_attn_bwd_dq)
