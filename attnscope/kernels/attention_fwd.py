"""
Fused attention forward (FlashAttention-2 algorithm) in Triton
==============================================================

One program computes a BLOCK_M x HEAD_DIM tile of the output for one (batch, query head): it
keeps the Q tile in registers, streams K and V through in BLOCK_N-row tiles, and keeps the
softmax online (running max `m_i`, running sum `l_i`, unnormalised accumulator `acc`, all fp32),
so the L x S score matrix never reaches device memory.

Details that matter for exactness:
- Scores are scaled by `scale * log2(e)` once, so every exponential is an `exp2`.
- Causal attention splits the K/V loop: blocks every query row of the tile fully sees run without
  any mask arithmetic; the blocks on the diagonal (and the ragged last block) run with masks.
  Nothing right of the diagonal is loaded.
- Query i sees key j when j <= i + CAUSAL_OFFSET (common._sees): 0 is SDPA's top-left
  alignment, S - L the bottom-right alignment of flash-attn. A row that sees no key
  (bottom-right with L > S) ends with l_i == 0 and is written as zeros with LSE -inf instead
  of 0/0.
- Any head_dim: tiles are BLOCK_D = next power of two wide and the extra columns load as zeros.
- Any sequence length: rows and keys past the end are masked, so no multiple-of-block rule.
- GQA/MQA: query head h reads K/V head h // GROUP; nothing is repeated in memory.
- fp32 inputs use IEEE fp32 dots (Triton's default would be tf32, ~1e-3 relative error).
- Sliding window (HAS_WINDOW, the left edge: j >= i + LEFT_OFFSET; the right edge is the causal
  bound with a larger offset) and softcap (SOFTCAP: logits softcap * tanh(s / softcap)) are
  constexprs, so the default kernel compiles to the code it had without them. A window adds a
  masked stage for its left edge before the unmasked blocks; blocks left of it are not visited.
- Packed sequences (VARLEN): the program's sequence is its batch index, its rows start at
  CU_SEQLENS_Q/K[b] in tensors seen with batch stride 0; programs past its end exit at once.

Two loop schedules (config field `pipeline`): the plain one computes q @ k^T, softmax and p @ V of
each K block in turn; the software-pipelined one issues the next block's q @ k^T before this
block's p @ V so the softmax overlaps an in-flight wgmma, and peels the last block off the loop.
The H200 table uses the pipelined loop for head_dim 256 only: 0.3320 against 0.3604 ms at
(1,16,4096,256), but 0.0953 against 0.0652 ms at (8,16,1024,64) and 1.5130 against 1.3333 ms
at (4,32,4096,128) (notes/forward.md, "The pipelined loop").

Limits: head_dim <= 256 (registers); inputs must live on one CUDA device, or on the CPU with
TRITON_INTERPRET=1 set before triton is imported (fp16/fp32 there: the interpreter's bf16 dot is
wrong). dispatch.py decides when the Gluon kernel (attention_fwd_hopper.py) runs instead; the
backward is attention_bwd.py. Programs walk tiles in common._grouped_tile's order; eager
launches go through launch.FastLaunch.
"""

import triton
import triton.language as tl

from attnscope.kernels.common import (LN2, _head_base, _load, _logits, _query_block, _sees,
                                      _sees_window, _sequence, _window_key_ranges, aligned,
                                      check_row_offsets, head_group, is_interpreted,
                                      score_scales, tile_constants, visibility)
from attnscope.kernels.launch import FORWARD_LAUNCHES, FastLaunch, ensure_scratch_allocator

@triton.jit
def _scores(q, k_src, start_n, stride_kn, stride_kk, offs_d, N_CTX_K, CHECK_ROWS: tl.constexpr,
            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
            INPUT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr):
    # q @ k^T for keys [start_n, start_n + BLOCK_N), K as a [BLOCK_D, BLOCK_N] tile. k_src is a
    # tensor descriptor when USE_TMA (the copy engine zero-fills rows past N_CTX_K and columns
    # past HEAD_DIM), else the base pointer of this (batch, kv head).
    if USE_TMA:
        k = tl.trans(k_src.load([start_n, 0]))
    else:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_ptrs = k_src + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kk
        k = _load(k_ptrs, (offs_n < N_CTX_K)[None, :], (offs_d < HEAD_DIM)[:, None], CHECK_ROWS,
                  HEAD_DIM != BLOCK_D)
    return tl.dot(q, k, input_precision=INPUT_PRECISION)


@triton.jit
def _online_softmax(qk, l_i, m_i, offs_m, start_n, N_CTX_K, CAUSAL_OFFSET, LEFT_OFFSET, qk_scale,
                    softcap_log2, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                    HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr,
                    EVEN_N: tl.constexpr, EMPTY_ROWS: tl.constexpr):
    # Raw scores of one K block -> probabilities p (relative to the new running max), the factor
    # alpha that rescales what was accumulated under the old max, and the new running sum / max.
    # EVEN_N: the key length is a multiple of BLOCK_N (no ragged block to mask); EMPTY_ROWS:
    # some row may have seen no key yet (a negative causal offset or a window allows that).
    # Masked blocks apply every bound the call has: a block near both edges of a narrow window
    # needs both.
    if MASKED:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if CAUSAL:
            visible = _sees(offs_m[:, None], offs_n[None, :], CAUSAL_OFFSET)
            if not EVEN_N:
                visible = visible & (offs_n < N_CTX_K)[None, :]
        else:
            visible = (offs_n < N_CTX_K)[None, :]
        if HAS_WINDOW:
            visible = visible & _sees_window(offs_m[:, None], offs_n[None, :], LEFT_OFFSET)
        logits, _ = _logits(qk, qk_scale, softcap_log2, SOFTCAP)
        qk = tl.where(visible, logits, float("-inf"))
        m_ij = tl.maximum(m_i, tl.max(qk, 1))
        if EMPTY_ROWS:
            # A row with no visible key so far keeps m == -inf; subtracting 0 instead keeps
            # exp2(-inf - -inf) = NaN out of p and alpha (both become exactly 0).
            m_sub = tl.where(m_ij == float("-inf"), 0.0, m_ij)
        else:
            m_sub = m_ij
        qk = qk - m_sub[:, None]
    elif SOFTCAP:
        qk, _ = _logits(qk, qk_scale, softcap_log2, SOFTCAP)
        m_ij = tl.maximum(m_i, tl.max(qk, 1))
        m_sub = m_ij
        qk = qk - m_sub[:, None]
    else:
        # the scale goes on the row max, not on the whole block (a positive scale commutes)
        m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        m_sub = m_ij
        qk = qk * qk_scale - m_sub[:, None]
    p = tl.math.exp2(qk)
    alpha = tl.math.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, l_i, m_ij


@triton.jit
def _accumulate(acc, p, alpha, v_src, start_n, stride_vn, stride_vk, offs_d, N_CTX_K,
                CHECK_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_N: tl.constexpr, INPUT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr):
    # acc <- acc * alpha + p @ V for keys [start_n, start_n + BLOCK_N).
    if USE_TMA:
        v = v_src.load([start_n, 0])
    else:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        v_ptrs = v_src + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vk
        v = _load(v_ptrs, (offs_n < N_CTX_K)[:, None], (offs_d < HEAD_DIM)[None, :], CHECK_ROWS,
                  HEAD_DIM != BLOCK_D)
    acc = acc * alpha[:, None]
    return tl.dot(p.to(v.dtype), v, acc, input_precision=INPUT_PRECISION)


@triton.jit
def _attn_fwd_inner(acc, l_i, m_i, qk, q, k_src, v_src,  #
                    stride_kn, stride_kk, stride_vn, stride_vk,  #
                    offs_m, offs_d, lo, hi, N_CTX_K, CAUSAL_OFFSET, LEFT_OFFSET, qk_scale,
                    softcap_log2,  #
                    MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                    SOFTCAP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,  #
                    INPUT_PRECISION: tl.constexpr, PIPELINE: tl.constexpr,
                    USE_TMA: tl.constexpr, EVEN_N: tl.constexpr, EMPTY_ROWS: tl.constexpr):
    # K/V blocks [lo, hi). Without PIPELINE each block runs q @ k^T, softmax, p @ V in turn.
    # With PIPELINE, `qk` holds block lo's scores on entry and block hi's on return (the caller
    # guarantees block hi exists), and each step orders the work so that the tensor cores are
    # busy during the exponentials: the softmax of block j runs while the wgmma p @ V of block
    # j-1, issued asynchronously at the end of the previous step, is still in flight; then
    # q @ k^T of block j+1 is issued (Triton waits for it at once, which also retires p @ V of
    # block j-1), and p @ V of block j is issued and left in flight.
    RAGGED: tl.constexpr = MASKED and not EVEN_N  # K/V rows past N_CTX_K to load as zeros
    for start_n in tl.range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        if not PIPELINE:
            qk = _scores(q, k_src, start_n, stride_kn, stride_kk, offs_d, N_CTX_K, RAGGED,
                         HEAD_DIM, BLOCK_D, BLOCK_N, INPUT_PRECISION, USE_TMA)
        p, alpha, l_i, m_i = _online_softmax(qk, l_i, m_i, offs_m, start_n, N_CTX_K,
                                             CAUSAL_OFFSET, LEFT_OFFSET, qk_scale, softcap_log2,
                                             MASKED, CAUSAL, HAS_WINDOW, SOFTCAP, BLOCK_N,
                                             EVEN_N, EMPTY_ROWS)
        if PIPELINE:
            qk = _scores(q, k_src, start_n + BLOCK_N, stride_kn, stride_kk, offs_d, N_CTX_K, True,
                         HEAD_DIM, BLOCK_D, BLOCK_N, INPUT_PRECISION, USE_TMA)
        acc = _accumulate(acc, p, alpha, v_src, start_n, stride_vn, stride_vk, offs_d, N_CTX_K,
                          RAGGED, HEAD_DIM, BLOCK_D, BLOCK_N, INPUT_PRECISION, USE_TMA)
    return acc, l_i, m_i, qk


@triton.jit
def _attn_fwd(Q, K, V, Out, Lse, CU_SEQLENS_Q, CU_SEQLENS_K,  #
              stride_qz, stride_qh, stride_qm, stride_qk,  #
              stride_kz, stride_kh, stride_kn, stride_kk,  #
              stride_vz, stride_vh, stride_vn, stride_vk,  #
              stride_oz, stride_oh, stride_om, stride_ok,  #
              H, GROUP, N_CTX_Q, N_CTX_K, CAUSAL_OFFSET, LEFT_OFFSET, qk_scale, softcap_log2,
              NUM_M, HEAD_GROUP,  #
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,  #
              HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, VARLEN: tl.constexpr,  #
              INPUT_PRECISION: tl.constexpr,  #
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PIPELINE: tl.constexpr,  #
              USE_TMA: tl.constexpr, EVEN_N: tl.constexpr, EMPTY_ROWS: tl.constexpr,
              STORE_LSE: tl.constexpr):
    # CAUSAL: keys right of row i + CAUSAL_OFFSET are hidden (a causal mask, or a window's right
    # edge); HAS_WINDOW: keys left of row i + LEFT_OFFSET too (a window's left edge). VARLEN: a
    # packed batch, sequence off_z's rows start at CU_SEQLENS_Q[off_z] (CU_SEQLENS_K[off_z] for
    # K/V), N_CTX_Q is the packed length (the LSE's row stride) and the offsets are relative to
    # each sequence's bottom-right alignment.
    # torch.compile passes Python floats as fp64; one fp32 scale keeps every score op in fp32.
    qk_scale = tl.cast(qk_scale, tl.float32)
    softcap_log2 = tl.cast(softcap_log2, tl.float32)
    off_hz, start_m, off_z, off_h, off_hkv = _query_block(H, GROUP, NUM_M, HEAD_GROUP)
    q_start, seq_q = _sequence(CU_SEQLENS_Q, off_z, N_CTX_Q, VARLEN)
    k_start, seq_k = _sequence(CU_SEQLENS_K, off_z, N_CTX_K, VARLEN)
    if VARLEN:
        if start_m * BLOCK_M >= seq_q:  # the grid covers the longest sequence
            return
        CAUSAL_OFFSET += seq_k - seq_q
        LEFT_OFFSET += seq_k - seq_q

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < seq_q
    d_ok = offs_d < HEAD_DIM

    q_ptrs = (_head_base(Q, off_z, off_h, stride_qz, stride_qh, q_start, stride_qm, VARLEN)
              + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qk)
    q = _load(q_ptrs, m_ok[:, None], d_ok[None, :], True, HEAD_DIM != BLOCK_D)
    k_src = _head_base(K, off_z, off_hkv, stride_kz, stride_kh, k_start, stride_kn, VARLEN)
    v_src = _head_base(V, off_z, off_hkv, stride_vz, stride_vh, k_start, stride_vn, VARLEN)
    if USE_TMA:
        # One [N_CTX_K, HEAD_DIM] descriptor per (batch, kv head): K/V tiles then arrive through
        # the bulk tensor copy engine instead of per-thread cp.async address arithmetic.
        k_src = tl.make_tensor_descriptor(k_src, shape=[seq_k, HEAD_DIM], strides=[stride_kn, 1],
                                          block_shape=[BLOCK_N, BLOCK_D])
        v_src = tl.make_tensor_descriptor(v_src, shape=[seq_k, HEAD_DIM], strides=[stride_vn, 1],
                                          block_shape=[BLOCK_N, BLOCK_D])

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    lo, full_lo, full_hi, masked_hi = _window_key_ranges(start_m, seq_k, CAUSAL_OFFSET,
                                                         LEFT_OFFSET, CAUSAL, HAS_WINDOW,
                                                         BLOCK_M, BLOCK_N)

    if PIPELINE:
        # The last block (start `last`) is peeled off the loops: it has no next block to
        # prefetch. A tile that sees no key at all (masked_hi <= lo) runs no block.
        last = (tl.cdiv(masked_hi, BLOCK_N) - 1) * BLOCK_N
        if HAS_WINDOW:
            full_lo = tl.minimum(full_lo, last)
        split = tl.minimum(full_hi, last)
        end = last
        qk = _scores(q, k_src, lo, stride_kn, stride_kk, offs_d, seq_k, True, HEAD_DIM, BLOCK_D,
                     BLOCK_N, INPUT_PRECISION, USE_TMA)
    else:
        split = full_hi
        end = masked_hi
        qk = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # unused without PIPELINE
    if HAS_WINDOW:
        # stage 0: the window's left edge, masked (blocks left of it are skipped)
        acc, l_i, m_i, qk = _attn_fwd_inner(acc, l_i, m_i, qk, q, k_src, v_src,  #
                                            stride_kn, stride_kk, stride_vn, stride_vk,  #
                                            offs_m, offs_d, lo, full_lo, seq_k, CAUSAL_OFFSET,
                                            LEFT_OFFSET, qk_scale, softcap_log2,  #
                                            True, CAUSAL, HAS_WINDOW, SOFTCAP, HEAD_DIM, BLOCK_D,
                                            BLOCK_N, INPUT_PRECISION, PIPELINE, USE_TMA, EVEN_N,
                                            EMPTY_ROWS)
    # stage 1: blocks every row sees whole (left of the diagonal), no masking
    acc, l_i, m_i, qk = _attn_fwd_inner(acc, l_i, m_i, qk, q, k_src, v_src,  #
                                        stride_kn, stride_kk, stride_vn, stride_vk,  #
                                        offs_m, offs_d, full_lo, split, seq_k, CAUSAL_OFFSET,
                                        LEFT_OFFSET, qk_scale, softcap_log2,  #
                                        False, CAUSAL, HAS_WINDOW, SOFTCAP, HEAD_DIM, BLOCK_D,
                                        BLOCK_N, INPUT_PRECISION, PIPELINE, USE_TMA, EVEN_N,
                                        EMPTY_ROWS)
    # stage 2: the diagonal band (or the window's right edge) and the ragged end of K, masked
    acc, l_i, m_i, qk = _attn_fwd_inner(acc, l_i, m_i, qk, q, k_src, v_src,  #
                                        stride_kn, stride_kk, stride_vn, stride_vk,  #
                                        offs_m, offs_d, split, end, seq_k, CAUSAL_OFFSET,
                                        LEFT_OFFSET, qk_scale, softcap_log2,  #
                                        True, CAUSAL, HAS_WINDOW, SOFTCAP, HEAD_DIM, BLOCK_D,
                                        BLOCK_N, INPUT_PRECISION, PIPELINE, USE_TMA, EVEN_N,
                                        EMPTY_ROWS)
    if PIPELINE:
        if masked_hi > lo:  # the peeled last block, masked
            p, alpha, l_i, m_i = _online_softmax(qk, l_i, m_i, offs_m, last, seq_k,
                                                 CAUSAL_OFFSET, LEFT_OFFSET, qk_scale,
                                                 softcap_log2, True, CAUSAL, HAS_WINDOW, SOFTCAP,
                                                 BLOCK_N, False, EMPTY_ROWS)
            acc = _accumulate(acc, p, alpha, v_src, last, stride_vn, stride_vk, offs_d, seq_k,
                              True, HEAD_DIM, BLOCK_D, BLOCK_N, INPUT_PRECISION, USE_TMA)

    # epilogue: normalise; rows that saw no key have l_i == 0 and are written as zeros, with
    # m_i still -inf, so their LSE is -inf from l_safe too (and no log2(0) is evaluated)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    acc = acc / l_safe[:, None]
    lse = (m_i + tl.math.log2(l_safe)) * LN2  # log2 domain -> natural log
    if STORE_LSE:  # (not where an inference call wants none: Lse is then Out)
        if VARLEN:  # [heads, total_q]
            tl.store(Lse + off_h * N_CTX_Q + q_start + offs_m, lse, mask=m_ok)
        else:
            tl.store(Lse + off_hz * N_CTX_Q + offs_m, lse, mask=m_ok)
    o_ptrs = (_head_base(Out, off_z, off_h, stride_oz, stride_oh, q_start, stride_om, VARLEN)
              + offs_m[:, None] * stride_om + offs_d[None, :] * stride_ok)
    tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


# Launch configs: (BLOCK_M, BLOCK_N, num_warps, num_stages, pipeline, use_tma) per head-dim
# class, chosen offline by benchmarks/labs/fused_lab.py on the H200 (notes/forward.md has the
# sweeps). A fixed table instead of triton.autotune: a first call compiles one kernel instead of
# timing several, and each launch skips the autotuner's per-call bookkeeping (~40 us measured at
# the seed shape, more than half the kernel's own time there). Wider heads need smaller tiles:
# the fp32 accumulator is BLOCK_M x BLOCK_D registers spread over the program's threads.
CONFIG_FIELDS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "pipeline", "use_tma")
CONFIGS = {
    64: (128, 64, 8, 3, False, False),
    128: (128, 64, 8, 3, False, False),
    # TMA: 0.3547 against 0.3689 ms at (1,16,4096,256); slower at head_dim <= 128, e.g. 1.4829
    # against 1.4355 ms at (4,32,4096,128) (notes/forward.md, "TMA loads")
    256: (64, 32, 4, 2, True, True),
}
# Causal calls with at most SHORT_SEQ queries take these instead: 64-row tiles of one warpgroup,
# three programs per SM, finer causal tiles: 0.0604 against 0.0647 ms at (8,16,1024,64) and
# 0.0972 against 0.1016 ms at (4,16,2048,64); 0.7118 against 0.7168 ms at (4,32,4096,64), within
# the rounds' spread, so longer calls keep the table's (notes/forward.md, "The short-sequence
# rule").
SHORT_SEQ = 2048
SHORT_CONFIGS = {64: (64, 64, 4, 3, False, False)}
# Causal dense calls of at most FEW_KEYS queries and keys at head_dim 65-128 take the same
# 64-row tiles. On sm_90 these are the short calls in few tiles the Hopper kernel leaves to this
# one (attention_fwd_hopper.SHORT_WORK), whose 128-row tiles would leave most SMs idle; other
# calls of that size (other GPUs, torch.compile, head dims the Hopper kernel lacks)
# follow the same rule, measured only as below. H200, Triton 3.6 (benchmarks/labs/fused_lab.py,
# notes/lab/triton_short_tiles_h200.txt): 0.0116 against 0.0154 ms at (2,16,256,128), 0.0108
# against 0.0132 at (1,8,256,80), 0.0088 against 0.0131 at (1,8,128,96) (do_bench medians of
# calls of ~10 us, so the host's noise is in them: at (1,8,256,128) 0.0156 against 0.0147, with
# minima of 0.0110 and 0.0140); 167-168 registers, no spills, where the table's 128 x 64 takes
# 180-182.
FEW_KEYS = 256
# Those calls at head_dim <= 64 take 32-key blocks on the same 64-row tiles, a tile there holding
# one to four 64-key blocks. H200, Triton 3.6, fused_lab.py against SHORT_CONFIGS[64], three jobs
# (notes/lab/triton_few_keys_d64_h200.txt): 0.7115 against 0.7601, 0.7253 against 0.7693 and
# 0.7305 against 0.7533 ms at (2048,16,128,64); 0.4437 against 0.4707, 0.4571 against 0.4800 and
# 0.4506 against 0.4666 at (512,16,256,64); 0.1174 against 0.1270 at (128,16,256,64); 0.0115
# against 0.0107 and 0.0120 against 0.0115 at (4,16,256,64) (256 programs: under a microsecond).
# Past the bound they are level at 384-512 keys and 6-11 % slower from 1024 keys.
FEW_KEYS_CONFIGS = {64: (64, 32, 4, 3, False, False)}
# The interpreter runs one config; small tiles with BLOCK_M != BLOCK_N make CPU tests cross
# several blocks and a diagonal band that spans two K blocks.
INTERPRETER_CONFIG = (32, 16, 4, 1, True, False)


def config_for(head_dim, q_len=None, causal=False, kv_len=None):
    """The launch config, a tuple named by CONFIG_FIELDS, for a call with this head_dim, query
    length, causal flag and key length (q_len None: the long-sequence table's; kv_len None: a
    packed batch's, whose key lengths vary)."""
    if is_interpreted():
        return INTERPRETER_CONFIG
    cls = 64 if head_dim <= 64 else 128 if head_dim <= 128 else 256
    few = (causal and q_len is not None and kv_len is not None
           and max(q_len, kv_len) <= FEW_KEYS)
    if few and cls in FEW_KEYS_CONFIGS:
        return FEW_KEYS_CONFIGS[cls]
    if causal and q_len is not None and q_len <= SHORT_SEQ and cls in SHORT_CONFIGS:
        return SHORT_CONFIGS[cls]
    if few and cls == 128:
        return SHORT_CONFIGS[64]
    return CONFIGS[cls]


def tma_ok(t):
    """Whether the copy engine can read t: a unit last stride and 16-byte aligned rows and base
    address."""
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1]))


def attention_fwd_triton(q, k, v, out, lse, *, causal, scale, causal_offset, window=(-1, -1),
                         softcap=0.0, varlen=None, wrap=None, config=None, key=None):
    """Launch the Triton forward. q, out: [batch, heads, q_len, head_dim] views with any
    strides; k, v: [batch, kv_heads, kv_len, head_dim]; lse: contiguous fp32 [batch, heads,
    q_len], or None where the call wants no LSE (an eager inference call: the kernel then
    stores none). `window` (left, right) and `softcap` as fused_attention's (common.visibility,
    common.score_scales). `varlen`: (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    for a packed batch: q/out/k/v are then the packed tensors as [batch, heads, total,
    head_dim] views with batch stride 0, lse is [heads, total_q] and causal_offset is relative
    to each sequence's bottom-right alignment. `config`: a tuple named by CONFIG_FIELDS instead
    of the table's (tests, labs). `wrap` lets the custom op pass torch.library.wrap_triton so
    torch.compile sees the launch. `key`: the dispatch's launch key for this call (built here
    when None).
    Returns what the launch returns (the compiled kernel, when called eagerly)."""
    batch, heads, q_len, head_dim = q.shape
    max_q = q_len if varlen is None else varlen[2]
    check_row_offsets(max_q, (q, out), ("q", "out"))
    check_row_offsets(k.shape[2] if varlen is None else varlen[3], (k, v), ("k", "v"))
    if config is None:
        config = config_for(head_dim, max_q, causal, None if varlen else k.shape[2])
    elif len(config) != len(CONFIG_FIELDS):
        raise ValueError(f"config must be a tuple of {CONFIG_FIELDS}, got {config!r}")
    block_m, block_n, num_warps, num_stages, pipeline, use_tma = config
    # Tensor descriptors only on eager launches: under torch.compile the inputs are fake (no
    # address to check) and inductor's launch provides no scratch for device-side descriptors.
    # Not for packed sequences: a sequence's first row need not be 16-byte aligned.
    use_tma = use_tma and wrap is None and varlen is None and tma_ok(k) and tma_ok(v)
    if use_tma:
        ensure_scratch_allocator()
    bounded, offset, has_window, left_offset = visibility(causal, causal_offset, window)
    qk_scale, softcap_log2, has_softcap = score_scales(scale, softcap)
    cu_q, cu_k = (None, None) if varlen is None else varlen[:2]
    num_m = -(-max_q // block_m)
    args = (q, k, v, out, out if lse is None else lse, cu_q, cu_k, *q.stride(), *k.stride(),
            *v.stride(), *out.stride(),  #
            heads, heads // k.shape[1], q_len, k.shape[2], offset, left_offset, qk_scale,
            softcap_log2, num_m, head_group(q, k))
    block_d, precision = tile_constants(head_dim, q.dtype)
    # A row may see no key of a block it visits when the causal offset is negative, in a packed
    # batch (each sequence has its own offset), or under a window: a left edge alone too (the
    # masked blocks at a tile's start hold keys left of some rows' windows).
    empty_rows = has_window or bounded and (offset < 0 or varlen is not None)
    kwargs = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, CAUSAL=bounded, HAS_WINDOW=has_window,
                  SOFTCAP=has_softcap, VARLEN=varlen is not None, INPUT_PRECISION=precision,
                  BLOCK_M=block_m, BLOCK_N=block_n, PIPELINE=pipeline, USE_TMA=use_tma,
                  EVEN_N=varlen is None and k.shape[2] % block_n == 0, EMPTY_ROWS=empty_rows,
                  STORE_LSE=lse is not None, num_warps=num_warps, num_stages=num_stages)
    grid = (batch * heads * num_m,)
    if wrap is not None:
        return wrap(_attn_fwd)[grid](*args, **kwargs)
    if key is None:
        key = launch_key(q, k, v, out, lse, causal, causal_offset, scale, window, softcap,
                         varlen) + (config,)
    return _launch(key, grid, args, kwargs, per_call=5 if varlen is None else 7,
                   config=dict(zip(CONFIG_FIELDS, (block_m, block_n, num_warps, num_stages,
                                                   pipeline, use_tma))))


def launch_key(q, k, v, out, lse, causal, causal_offset, scale, window, softcap, varlen=None):
    """What fixes a forward's kernel, its table config and every argument but the five
    tensors (seven with a packed batch's cumulative lengths: FastLaunch's key): the dispatch
    looks an eager call up by it. (An lse of None, no LSE stored, has keys of its own.)"""
    key = (q.device, q.dtype, k.dtype, v.dtype, out.dtype, lse is None or lse.dtype, q.shape,
           k.shape, q.stride(), k.stride(), v.stride(), out.stride(),
           aligned(q, k, v, out, out if lse is None else lse),
           causal, causal_offset, scale, window, softcap)
    if varlen is not None:  # the longest sequences fix the grid and the Gluon kernel's L2 groups
        key += ("varlen", varlen[2], varlen[3], aligned(*varlen[:2]))
    return key


_launch = FastLaunch(_attn_fwd, FORWARD_LAUNCHES)
