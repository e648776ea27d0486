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
- Query i sees key j when j <= i + CAUSAL_OFFSET: 0 is SDPA's top-left alignment, S - L the
  bottom-right alignment of flash-attn. A row that sees no key (bottom-right with L > S) ends with
  l_i == 0 and is written as zeros with LSE -inf instead of 0/0.
- Any head_dim: tiles are BLOCK_D = next power of two wide and the extra columns load as zeros.
- Any sequence length: rows and keys past the end are masked, so no multiple-of-block rule.
- GQA/MQA: query head h reads K/V head h // GROUP; nothing is repeated in memory.
- fp32 inputs use IEEE fp32 dots (Triton's default would be tf32, ~1e-3 relative error).

Two loop schedules (config field `pipeline`): the plain one computes q @ k^T, softmax and p @ V of
each K block in turn; the software-pipelined one issues the next block's q @ k^T before this
block's p @ V so the softmax overlaps an in-flight wgmma, and peels the last block off the loop.
The H200 table uses the pipelined loop for head_dim 256 only (notes/kernel.md, v5).

Limits: head_dim <= 256 (registers); inputs must live on one CUDA device, or on the CPU with
TRITON_INTERPRET=1 set before triton is imported (fp16/fp32 there: the interpreter's bf16 dot is
wrong). The backward is attention_bwd.py.

On an H200/H100 (sm_90) with a Triton whose Gluon has what the Hopper kernel uses (3.6, 3.7 and
3.9 do: gluon_compat), fp16/bf16 calls launched eagerly (not traced by torch.compile; autograd's
eager forward counts as eager), with head_dim 128, contiguous inputs and a key length that is a
multiple of 128 run attention_fwd_hopper.py instead: the same
algorithm written in Gluon with a warp-specialized, FlashAttention-3 style schedule
(`uses_hopper_kernel` decides; notes/kernel.md, v8).

Launches (notes/kernel.md, v9): programs walk tiles in `_grouped_tile`'s order (heads in groups
whose K/V share L2); eager launches go through FastLaunch, which does Triton's per-call dispatch
once per argument signature.
"""

import contextlib
import functools
import inspect
import warnings

import torch

import triton
import triton.language as tl

LOG2E = 1.44269504  # 1/ln(2): exp(x) == exp2(x * LOG2E)
LN2 = tl.constexpr(0.6931471805599453)  # ln(2): converts the log2-domain LSE back to natural log


@triton.jit
def _load(ptrs, rows_ok, cols_ok, CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
    # Masks cost instructions in the hot loop, so only the checks a tile needs are emitted.
    if CHECK_ROWS and CHECK_COLS:
        return tl.load(ptrs, mask=rows_ok & cols_ok, other=0.0)
    elif CHECK_ROWS:
        return tl.load(ptrs, mask=rows_ok, other=0.0)
    elif CHECK_COLS:
        return tl.load(ptrs, mask=cols_ok, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _grouped_tile(t, n_hz, num_m, head_group):
    # Tile t of a launch's tile order: (batch * head, query block). Heads go in groups of
    # head_group whose K/V fit in L2 together (`head_group`), so the programs running at once
    # read the same K/V from L2 instead of each streaming its own head's from DRAM; within a
    # group, last query block first: under a causal mask those have the most keys, and the
    # hardware starts programs in order, so the longest start first instead of being the tail.
    # (The Gluon kernel's persistent loop walks the same order.)
    group_tiles = head_group * num_m
    first_hz = t // group_tiles * head_group
    heads = tl.minimum(head_group, n_hz - first_hz)  # the last group may be smaller
    r = t % group_tiles
    return first_hz + r % heads, num_m - 1 - r // heads


@triton.jit
def _query_block(H, GROUP, NUM_M, HEAD_GROUP):
    # Which (batch, query head, query block) this program computes, and its K/V head: program
    # t of a 1-D grid of batch * H * NUM_M takes tile t of _grouped_tile's order. (The
    # backward's dQ kernel uses the same grid.)
    n_hz = tl.num_programs(0) // NUM_M
    off_hz, start_m = _grouped_tile(tl.program_id(0), n_hz, NUM_M, HEAD_GROUP)
    off_z = (off_hz // H).to(tl.int64)
    off_h = (off_hz % H).to(tl.int64)
    return off_hz, start_m, off_z, off_h, off_h // GROUP


@triton.jit
def _key_ranges(start_m, N_CTX_K, CAUSAL_OFFSET, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    # Key ranges of query block start_m (the forward's and the dQ kernel's). Every row of the
    # tile sees keys j <= first_row + CAUSAL_OFFSET; those whole blocks, [0, full_hi), need no
    # mask. The rest, up to what the last row sees, [full_hi, masked_hi), is the masked diagonal
    # band (it also holds the ragged end of K when N_CTX_K is not a multiple of BLOCK_N).
    first_row = start_m * BLOCK_M
    if CAUSAL:
        full_hi = tl.maximum(tl.minimum(first_row + CAUSAL_OFFSET + 1, N_CTX_K), 0)
        masked_hi = tl.minimum(first_row + BLOCK_M + CAUSAL_OFFSET, N_CTX_K)
    else:
        full_hi = N_CTX_K
        masked_hi = N_CTX_K
    return full_hi // BLOCK_N * BLOCK_N, masked_hi


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
def _online_softmax(qk, l_i, m_i, offs_m, start_n, N_CTX_K, CAUSAL_OFFSET, qk_scale,
                    MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
                    EVEN_N: tl.constexpr, EMPTY_ROWS: tl.constexpr):
    # Raw scores of one K block -> probabilities p (relative to the new running max), the factor
    # alpha that rescales what was accumulated under the old max, and the new running sum / max.
    # EVEN_N: the key length is a multiple of BLOCK_N (no ragged block to mask); EMPTY_ROWS:
    # some row may have seen no key yet (only a negative causal offset allows that).
    if MASKED:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if CAUSAL:
            visible = offs_n[None, :] <= offs_m[:, None] + CAUSAL_OFFSET
            if not EVEN_N:
                visible = visible & (offs_n < N_CTX_K)[None, :]
        else:
            visible = (offs_n < N_CTX_K)[None, :]
        qk = tl.where(visible, qk * qk_scale, float("-inf"))
        m_ij = tl.maximum(m_i, tl.max(qk, 1))
        if EMPTY_ROWS:
            # A row with no visible key so far keeps m == -inf; subtracting 0 instead keeps
            # exp2(-inf - -inf) = NaN out of p and alpha (both become exactly 0).
            m_sub = tl.where(m_ij == float("-inf"), 0.0, m_ij)
        else:
            m_sub = m_ij
        qk = qk - m_sub[:, None]
    else:
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
                    offs_m, offs_d, lo, hi, N_CTX_K, CAUSAL_OFFSET, qk_scale,  #
                    MASKED: tl.constexpr, CAUSAL: tl.constexpr,  #
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,  #
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
                                             CAUSAL_OFFSET, qk_scale, MASKED, CAUSAL, BLOCK_N,
                                             EVEN_N, EMPTY_ROWS)
        if PIPELINE:
            qk = _scores(q, k_src, start_n + BLOCK_N, stride_kn, stride_kk, offs_d, N_CTX_K, True,
                         HEAD_DIM, BLOCK_D, BLOCK_N, INPUT_PRECISION, USE_TMA)
        acc = _accumulate(acc, p, alpha, v_src, start_n, stride_vn, stride_vk, offs_d, N_CTX_K,
                          RAGGED, HEAD_DIM, BLOCK_D, BLOCK_N, INPUT_PRECISION, USE_TMA)
    return acc, l_i, m_i, qk


@triton.jit
def _attn_fwd(Q, K, V, Out, Lse,  #
              stride_qz, stride_qh, stride_qm, stride_qk,  #
              stride_kz, stride_kh, stride_kn, stride_kk,  #
              stride_vz, stride_vh, stride_vn, stride_vk,  #
              stride_oz, stride_oh, stride_om, stride_ok,  #
              H, GROUP, N_CTX_Q, N_CTX_K, CAUSAL_OFFSET, qk_scale, NUM_M, HEAD_GROUP,  #
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,  #
              INPUT_PRECISION: tl.constexpr,  #
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PIPELINE: tl.constexpr,  #
              USE_TMA: tl.constexpr, EVEN_N: tl.constexpr, EMPTY_ROWS: tl.constexpr):
    # torch.compile passes Python floats as fp64; one fp32 scale keeps every score op in fp32.
    qk_scale = tl.cast(qk_scale, tl.float32)
    off_hz, start_m, off_z, off_h, off_hkv = _query_block(H, GROUP, NUM_M, HEAD_GROUP)

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < N_CTX_Q
    d_ok = offs_d < HEAD_DIM

    q_ptrs = (Q + off_z * stride_qz + off_h * stride_qh
              + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qk)
    q = _load(q_ptrs, m_ok[:, None], d_ok[None, :], True, HEAD_DIM != BLOCK_D)
    k_src = K + off_z * stride_kz + off_hkv * stride_kh
    v_src = V + off_z * stride_vz + off_hkv * stride_vh
    if USE_TMA:
        # One [N_CTX_K, HEAD_DIM] descriptor per (batch, kv head): K/V tiles then arrive through
        # the bulk tensor copy engine instead of per-thread cp.async address arithmetic.
        k_src = tl.make_tensor_descriptor(k_src, shape=[N_CTX_K, HEAD_DIM], strides=[stride_kn, 1],
                                          block_shape=[BLOCK_N, BLOCK_D])
        v_src = tl.make_tensor_descriptor(v_src, shape=[N_CTX_K, HEAD_DIM], strides=[stride_vn, 1],
                                          block_shape=[BLOCK_N, BLOCK_D])

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    full_hi, masked_hi = _key_ranges(start_m, N_CTX_K, CAUSAL_OFFSET, CAUSAL, BLOCK_M, BLOCK_N)

    if PIPELINE:
        # The last block (start `last`) is peeled off the loops: it has no next block to
        # prefetch. A tile that sees no key at all (masked_hi <= 0) runs no block.
        last = (tl.cdiv(masked_hi, BLOCK_N) - 1) * BLOCK_N
        split = tl.minimum(full_hi, last)
        end = last
        qk = _scores(q, k_src, 0, stride_kn, stride_kk, offs_d, N_CTX_K, True, HEAD_DIM, BLOCK_D,
                     BLOCK_N, INPUT_PRECISION, USE_TMA)
    else:
        split = full_hi
        end = masked_hi
        qk = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # unused without PIPELINE
    # stage 1: blocks left of the diagonal, no masking
    acc, l_i, m_i, qk = _attn_fwd_inner(acc, l_i, m_i, qk, q, k_src, v_src,  #
                                        stride_kn, stride_kk, stride_vn, stride_vk,  #
                                        offs_m, offs_d, 0, split, N_CTX_K, CAUSAL_OFFSET,
                                        qk_scale,  #
                                        False, CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_N, INPUT_PRECISION,
                                        PIPELINE, USE_TMA, EVEN_N, EMPTY_ROWS)
    # stage 2: the diagonal band and the ragged end of K, masked
    acc, l_i, m_i, qk = _attn_fwd_inner(acc, l_i, m_i, qk, q, k_src, v_src,  #
                                        stride_kn, stride_kk, stride_vn, stride_vk,  #
                                        offs_m, offs_d, split, end, N_CTX_K, CAUSAL_OFFSET,
                                        qk_scale,  #
                                        True, CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_N, INPUT_PRECISION,
                                        PIPELINE, USE_TMA, EVEN_N, EMPTY_ROWS)
    if PIPELINE:
        if masked_hi > 0:  # the peeled last block, masked
            p, alpha, l_i, m_i = _online_softmax(qk, l_i, m_i, offs_m, last, N_CTX_K,
                                                 CAUSAL_OFFSET, qk_scale, True, CAUSAL, BLOCK_N,
                                                 False, EMPTY_ROWS)
            acc = _accumulate(acc, p, alpha, v_src, last, stride_vn, stride_vk, offs_d, N_CTX_K,
                              True, HEAD_DIM, BLOCK_D, BLOCK_N, INPUT_PRECISION, USE_TMA)

    # epilogue: normalise; rows that saw no key have l_i == 0 and are written as zeros
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    acc = acc / l_safe[:, None]
    lse = (m_i + tl.math.log2(l_i)) * LN2  # log2 domain -> natural log
    tl.store(Lse + off_hz * N_CTX_Q + offs_m, lse, mask=m_ok)
    o_ptrs = (Out + off_z * stride_oz + off_h * stride_oh
              + offs_m[:, None] * stride_om + offs_d[None, :] * stride_ok)
    tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


# Launch configs: (BLOCK_M, BLOCK_N, num_warps, num_stages, pipeline, use_tma, maxnreg) per head-dim
# class, chosen offline by benchmarks/fused_lab.py on the H200 (notes/kernel.md has the sweeps).
# A fixed table instead of triton.autotune: a first call compiles one kernel instead of timing
# several, and each launch skips the autotuner's per-call bookkeeping (~40 us measured at the seed
# shape, more than half the kernel's own time there). Wider heads need smaller tiles: the fp32
# accumulator is BLOCK_M x BLOCK_D registers spread over the program's threads.
CONFIG_FIELDS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "pipeline", "use_tma", "maxnreg")
CONFIGS = {
    64: (128, 64, 8, 3, False, False, None),
    128: (128, 64, 8, 3, False, False, None),
    256: (64, 32, 4, 2, True, True, None),  # TMA: +3.7 % here, slower at D <= 128 (notes, v3)
}
# Causal calls with at most SHORT_SEQ queries take these instead: 64-row tiles of one warpgroup,
# three programs per SM, finer causal tiles (notes, v11: 4-7 % faster than (128, 64, 8, 3) at
# 512-2048 queries, not faster at 4096).
SHORT_SEQ = 2048
SHORT_CONFIGS = {64: (64, 64, 4, 3, False, False, None)}
# The interpreter runs one config; small tiles with BLOCK_M != BLOCK_N make CPU tests cross
# several blocks and a diagonal band that spans two K blocks.
INTERPRETER_CONFIG = (32, 16, 4, 1, True, False, None)
_pinned = None


@contextlib.contextmanager
def pinned_config(block_m, block_n, num_warps=4, num_stages=2, pipeline=False,
                  use_tma=False, maxnreg=None):
    """Launch every forward with this config instead of the table's (tests, the lab)."""
    global _pinned
    previous = _pinned
    _pinned = (block_m, block_n, num_warps, num_stages, pipeline, use_tma, maxnreg)
    try:
        yield
    finally:
        _pinned = previous


def is_interpreted():
    """True when the kernels were defined under TRITON_INTERPRET=1 and so run on CPU tensors."""
    return not isinstance(_attn_fwd, triton.runtime.JITFunction)


def interpreter_ready():
    """True when CPU tensors can run: our kernels and Triton's own library functions (tl.max,
    tl.sum, ... are jit functions too) were all defined under the interpreter. Setting
    TRITON_INTERPRET after triton was imported interprets ours but not Triton's."""
    return is_interpreted() and not isinstance(tl.standard.max, triton.runtime.JITFunction)


def config_for(head_dim, q_len=None, causal=False):
    """The launch config, a tuple named by CONFIG_FIELDS, for a call with this head_dim, query
    length and causal flag (q_len None: the long-sequence table's)."""
    if _pinned is not None:
        return _pinned
    if is_interpreted():
        return INTERPRETER_CONFIG
    cls = 64 if head_dim <= 64 else 128 if head_dim <= 128 else 256
    if causal and q_len is not None and q_len <= SHORT_SEQ and cls in SHORT_CONFIGS:
        return SHORT_CONFIGS[cls]
    return CONFIGS[cls]


def _tma_ok(t):
    # The copy engine needs a unit last stride and 16-byte aligned rows and base addresses.
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1]))


@functools.cache
def device_properties(device):
    """torch.cuda.get_device_properties, read once per device (the launch is on the host's
    critical path at small shapes)."""
    return torch.cuda.get_device_properties(device)


def head_group(q, k, l2_share=0.5):
    """How many (batch, head) pairs a launch runs together (`_grouped_tile`): about as many as
    keep their K and V within `l2_share` of L2 (the rest for Q, the output and other streams),
    with the heads split into groups of equal size. A group of query heads shares one K/V head
    under GQA. Measured (notes/kernel.md, v8-v9): all heads in one group at (4,32,4096,128)
    made each running program stream its own head's K/V from DRAM (10 % L2 hits); and a small
    last group puts its longest tiles at the very end of the launch, where nothing overlaps
    them. In the interpreter, groups of two, so that CPU tests cross group edges (and a
    smaller last group)."""
    n_hz = q.shape[0] * q.shape[1]
    if not q.is_cuda:
        return min(n_hz, 2)
    kv_bytes = 2 * k.shape[2] * k.shape[3] * k.element_size()  # per K/V head
    budget = int(device_properties(q.device).L2_cache_size * l2_share)
    cap = max(1, budget * (q.shape[1] // k.shape[1]) // kv_bytes)
    groups = -(-n_hz // cap)
    return -(-n_hz // groups)


def _scratch(size, alignment, stream):
    # Device-side tensor descriptors are written to global scratch memory Triton asks for here,
    # on the current device (the op makes the inputs' device current before it launches).
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_scratch_allocator():
    """Give Triton the allocator that kernels making tensor descriptors on the device need.
    Triton keeps it per thread (a ContextVar), so this checks the calling thread's own: a launch
    from autograd's device thread (activation checkpointing), a DataParallel replica or a thread
    pool needs one too. An allocator the user set is kept."""
    if _thread_allocator is None or _thread_allocator.get() is _NULL_ALLOCATOR:
        triton.set_allocator(_scratch)


try:  # where Triton keeps the calling thread's allocator (3.6 and 3.9 checked)
    from triton.runtime._allocation import _NULL_ALLOCATOR, _allocator as _thread_allocator
except ImportError:  # another layout: set ours before every launch that needs one
    _NULL_ALLOCATOR = _thread_allocator = None


@functools.cache
def _hopper():
    # The Gluon kernel module, or None where this Triton's Gluon lacks what it uses (Gluon is
    # experimental and its API changes between releases; gluon_compat maps the renames known):
    # then the Triton kernel runs, and the first sm_90 call says once what was lost.
    from attnscope.kernels import gluon_compat
    lacking = gluon_compat.missing()
    if not lacking:
        try:
            from attnscope.kernels import attention_fwd_hopper
            return attention_fwd_hopper
        except Exception as e:  # noqa: BLE001 (any failure: keep the Triton kernel)
            lacking = [f"{type(e).__name__}: {e}"]
    warnings.warn(f"attnscope: Triton {triton.__version__}'s Gluon lacks {', '.join(lacking)}; "
                  "the Hopper (sm_90) attention forward falls back to the Triton kernel (~30 % "
                  "slower at head_dim 128 on the H200)", RuntimeWarning)
    return None


def uses_hopper_kernel(q, k, v, out, scale):
    """True when an eager forward of these tensors runs the Gluon Hopper kernel
    (attention_fwd_hopper.py) instead of this file's: an sm_90 GPU, a Triton whose Gluon has
    what that kernel uses (gluon_compat), no pinned config, a positive scale (that kernel masks
    before scaling) and the inputs it takes (its `supports`)."""
    if (_pinned is not None or not q.is_cuda or is_interpreted() or not scale > 0
            or device_properties(q.device).major != 9):
        return False
    hopper = _hopper()
    return hopper is not None and hopper.supports(q, k, v, out)


# How Triton's CudaLauncher (a CompiledKernel's runner) calls its launcher, known by the runner's
# own parameters: "flat" (3.6: a C launcher generated per signature takes grid, stream, function,
# cooperative, pdl, global scratch, profile scratch, packed metadata, launch metadata, enter and
# exit hooks, then every kernel argument spread) or "packed" (3.7 to 3.9: one generic launcher
# takes grid, stream, function, cooperative, pdl, packed metadata, launch metadata, the hooks,
# global scratch, profile scratch, the runner's arg_annotations and kernel_signature, then the
# kernel arguments as one tuple). Constexprs are passed in both and skipped by the launcher.
_RUNNER_PARAMS = ("gridX", "gridY", "gridZ", "stream", "function")
_LAUNCHER_LAYOUTS = {
    (*_RUNNER_PARAMS, "args"): "flat",
    (*_RUNNER_PARAMS, "kernel_metadata", "launch_metadata", "launch_enter_hook",
     "launch_exit_hook", "args"): "packed",
}


@functools.cache
def launcher_layout():
    """The installed Triton's launcher layout ("flat", "packed"), or None for one that _Bound
    does not know (its launches then go through Triton's own runner)."""
    try:
        from triton.backends.nvidia.driver import CudaLauncher
        params = tuple(inspect.signature(CudaLauncher.__call__).parameters)[1:]
    except (ImportError, AttributeError, TypeError, ValueError):
        return None
    return _LAUNCHER_LAYOUTS.get(params)


class FastLaunch:
    """`kernel[grid](*args, **kwargs)` with Triton's per-call dispatch done once per key.

    Triton's launch binds the arguments, works out their specialization (dtypes, which integers
    are 1 or multiples of 16, pointer alignment) and looks the compiled kernel up on every call:
    ~40 of the ~60 us a launch took on the H200's host (notes/kernel.md, v9), more than the
    seed-shape kernel itself. The first launch under a key goes through it; later ones are
    `_Bound` launches of the compiled kernel. So `key` must determine everything Triton
    specializes on, and every argument from `per_call` on: callers build it from the device,
    dtype, shapes, strides, pointer alignment, constexprs, options and those arguments. Used where
    the launcher's layout is known (`launcher_layout`: Triton 3.6 to 3.9); elsewhere, and in the
    interpreter, every call takes the ordinary launch. `bound` may be a dict shared by several
    kernels whose callers' keys never coincide (the forward's two kernels: `attention_fwd` looks
    a call up before it knows which kernel runs it)."""

    MAX_KEYS = 256  # a process that launches ever new shapes keeps at most this many

    def __init__(self, kernel, bound=None):
        self.kernel = kernel
        self.bound = {} if bound is None else bound
        self.enabled = (isinstance(kernel, triton.runtime.JITFunction)
                        and launcher_layout() is not None)

    def __call__(self, key, grid, args, kwargs, per_call=None):
        bound = self.bound.get(key)
        if bound is not None:
            return bound(args[:per_call])
        compiled = self.kernel[grid](*args, **kwargs)
        if self.enabled and compiled is not None:  # None: Triton did not launch (a cache hook)
            if len(self.bound) >= self.MAX_KEYS:
                self.bound.clear()
            # The compiled kernel takes every parameter in order, constexprs included (its
            # launcher skips them).
            constexprs = [kwargs[name] for name in self.kernel.arg_names[len(args):]]
            fixed = args[per_call:] if per_call is not None else ()
            self.bound[key] = _Bound(compiled, grid, (*fixed, *constexprs))
        return compiled


def _hooked(hook):
    # Triton 3.6 keeps launch hooks in a HookChain (empty: none); older code assigns a function.
    return hook is not None and bool(getattr(hook, "calls", True))


class _Bound:
    """One compiled kernel, its grid and its trailing arguments fixed: a call passes the rest.

    It calls Triton's C launcher itself (in `launcher_layout`'s argument order), with the
    current stream and global scratch as Triton's `CompiledKernel[grid]` runner would find
    them, minus that runner's per-call work (a closure, the device lookup, launch metadata and
    calls of empty hook chains). A launch with Triton's launch hooks set (a profiler such as
    proton), profile scratch or the global sanitizer takes Triton's own runner, as does
    anything that is not a CompiledKernel of a known layout (tests' stand-ins)."""

    def __init__(self, compiled, grid, suffix):
        self.compiled, self.grid, self.suffix = compiled, (*grid, 1, 1)[:3], suffix
        run = getattr(compiled, "_run", None)  # the CudaLauncher, made by the first launch
        layout = launcher_layout()
        self.packed = layout == "packed"
        self.direct = (layout is not None and getattr(run, "profile_scratch_size", 1) == 0
                       and not getattr(run, "gsan_enabled", False)
                       and hasattr(compiled, "packed_metadata") and hasattr(run, "launch")
                       and (not self.packed or hasattr(run, "arg_annotations")))
        if self.direct:
            gx, gy, gz = self.grid
            self.scratch = gx * gy * gz * run.num_ctas * run.global_scratch_size
            self.scratch_align = run.global_scratch_align
            self.head = (run.launch, compiled.function, run.launch_cooperative_grid,
                         run.launch_pdl, compiled.packed_metadata)
            if self.packed:
                self.signature = (run.arg_annotations, run.kernel_signature)

    def __call__(self, args):
        runtime = triton.knobs.runtime
        if (not self.direct or _hooked(runtime.launch_enter_hook)
                or _hooked(runtime.launch_exit_hook)):
            self.compiled[self.grid](*args, *self.suffix)
            return self.compiled
        launch, function, cooperative, pdl, metadata = self.head
        stream = torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())
        scratch = None
        if self.scratch:
            ensure_scratch_allocator()
            scratch = _thread_allocator.get()(self.scratch, self.scratch_align, stream)
        if self.packed:
            launch(*self.grid, stream, function, cooperative, pdl, metadata, None, None, None,
                   scratch, None, *self.signature, (*args, *self.suffix))
        else:
            launch(*self.grid, stream, function, cooperative, pdl, scratch, None, metadata, None,
                   None, None, *args, *self.suffix)
        return self.compiled


def tile_constants(head_dim, dtype):
    """The BLOCK_D and INPUT_PRECISION constexprs of a launch (forward and backward): tiles
    are the next power of two >= 16 wide over head_dim (extra columns load as zeros), and fp32
    inputs use IEEE fp32 dots (tf32 is unused for 16-bit inputs)."""
    return max(16, 1 << (head_dim - 1).bit_length()), "ieee" if dtype.itemsize == 4 else "tf32"


def _aligned(*tensors):
    # Triton specializes pointer arguments on 16-byte alignment.
    return tuple(t.data_ptr() % 16 == 0 for t in tensors)


def attention_fwd(q, k, v, out, lse, *, causal, scale, causal_offset, wrap=None):
    """Launch the forward (the Gluon kernel where uses_hopper_kernel says so, else this file's
    Triton kernel). q, out: [batch, heads, q_len, head_dim] views with any strides;
    k, v: [batch, kv_heads, kv_len, head_dim]; lse: contiguous fp32 [batch, heads, q_len].
    `wrap` lets the custom op pass torch.library.wrap_triton so torch.compile sees the launch.
    Returns what the launch returns (the compiled kernel, when called eagerly).

    An eager call is looked up first by what fixes the kernel, its config and every argument
    but the five tensors: a repeat launches at once (`_Bound`), skipping the work below. Call it
    with q's device current (the op makes it so): a kept launch belongs to the device that was
    current at its first call."""
    key = None
    if wrap is None:
        key = (q.device, q.dtype, k.dtype, v.dtype, out.dtype, lse.dtype, q.shape, k.shape,
               q.stride(), k.stride(), v.stride(), out.stride(), _aligned(q, k, v, out, lse),
               causal, causal_offset, scale, _pinned)
        bound = _eager.get(key)
        if bound is not None:
            return bound((q, k, v, out, lse))
        if uses_hopper_kernel(q, k, v, out, scale):
            return _hopper().attention_fwd_hopper(q, k, v, out, lse, causal=causal, scale=scale,
                                                   causal_offset=causal_offset, key=key)
    batch, heads, q_len, head_dim = q.shape
    config = config_for(head_dim, q_len, causal)
    block_m, block_n, num_warps, num_stages, pipeline, use_tma, maxnreg = config
    # Tensor descriptors only on eager launches: under torch.compile the inputs are fake (no
    # address to check) and inductor's launch provides no scratch for device-side descriptors.
    use_tma = use_tma and wrap is None and _tma_ok(k) and _tma_ok(v)
    if use_tma:
        ensure_scratch_allocator()
    num_m = -(-q_len // block_m)
    args = (q, k, v, out, lse, *q.stride(), *k.stride(), *v.stride(), *out.stride(),  #
            heads, heads // k.shape[1], q_len, k.shape[2], causal_offset, scale * LOG2E,  #
            num_m, head_group(q, k))
    block_d, precision = tile_constants(head_dim, q.dtype)
    kwargs = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, CAUSAL=causal, INPUT_PRECISION=precision,
                  BLOCK_M=block_m, BLOCK_N=block_n, PIPELINE=pipeline, USE_TMA=use_tma,
                  EVEN_N=k.shape[2] % block_n == 0, EMPTY_ROWS=causal and causal_offset < 0,
                  num_warps=num_warps, num_stages=num_stages)
    if maxnreg is not None:  # a register cap (ptxas .maxnreg), e.g. to fit two programs per SM
        kwargs["maxnreg"] = maxnreg
    grid = (batch * heads * num_m,)
    if wrap is not None:
        return wrap(_attn_fwd)[grid](*args, **kwargs)
    return _launch_fwd(key, grid, args, kwargs, per_call=5)


# Eager forward launches by attention_fwd's key, of either kernel. The key holds the inputs'
# properties and a pinned config, not module state: after changing CONFIGS, SHORT_CONFIGS,
# SHORT_SEQ, a head_group rule, or the Gluon module's CONFIGS, TILE_OVERHEAD,
# SCHEDULE_MAX_TILES or lab switches, call forget_launches() (the labs do).
_eager = {}
_launch_fwd = FastLaunch(_attn_fwd, _eager)


def forget_launches():
    """Drop every kept eager launch (forward and backward): labs call it after changing module
    state that launches read."""
    from attnscope.kernels import attention_bwd
    _eager.clear()
    for launch in (attention_bwd._launch_preprocess, attention_bwd._launch_dkdv,
                   attention_bwd._launch_dq):
        launch.bound.clear()
