"""
Split-KV decode attention (flash-decoding) in Triton, over a contiguous or a paged KV cache
============================================================================================

At decode time each sequence brings a handful of new queries (q_len 1-8) against thousands of
cached keys. The prefill kernel (attention_fwd.py) runs one program per (batch, q head, query
block): at q_len 1 that is a few hundred programs each doing a long serial walk over K/V, most
SMs idle, and every q head of a GQA group streams the same K/V head again. Decode is bound by
reading K and V from HBM once, so this kernel is organised around that read:

1. GQA packing. One program takes ALL q heads of one KV head: its tile rows are the q_len * GROUP
   (query, q head) pairs, row r = query (r // GROUP), q head (kv_head * GROUP + r % GROUP),
   padded to BLOCK_M >= 16 (the smallest tl.dot tile). Each K/V tile loaded feeds every q head
   that reads it, so K/V cross HBM once per KV head, not once per q head. More rows than BLOCK_M
   take several row blocks (grid axis 2); each reads K/V again, so the launch keeps that rare.

2. Split the keys. The keys of each (batch, kv head) are cut into NUM_SPLITS chunks of CHUNK keys
   (a multiple of BLOCK_N), one program per chunk (grid axis 0). A program runs the usual online
   softmax over its chunk (running max m_i, sum l_i, fp32 accumulator, exp2 with the scale folded
   into log2(e)) and writes a PARTIAL result: its normalised output O_s = acc / l_i and its
   log-sum-exp L_s = m_i + log2(l_i) (log2 domain), both fp32. How many splits
   (`num_splits_for`): programs of equal length run in waves of `slots` (SMs x programs one SM
   holds at once, bounded by the shared memory of the K/V pipeline), so the launch takes
   ceil(programs / slots) waves of (tiles per program + a fixed cost per program); the rule
   picks the split count with the least such time. Splitting more than the GPU holds at once
   only adds programs; too few leaves SMs idle or a ragged last wave. The key tile goes with it
   (`split_rule`): where 128-key tiles (`long_config_for` says where), their splits counted for
   their own occupancy, leave each split LONG_CHUNK keys or more, the call runs them; shorter
   chunks keep 64-key tiles.

3. Merge, in the same launch. Each split writes its partial, then counts its arrival in an
   int32 per (batch, kv head, row block) (`_arrivals`: one zeroed buffer per stream, which the
   merging split zeroes again); the split whose arrival completes the count combines the
   block's partials exactly (`_merge_row_block`, online over the splits, in column parts):
   with M = max_s L_s and w_s = 2^(L_s - M), out = sum_s w_s O_s / sum_s w_s and
   LSE = (M + log2(sum_s w_s)) * ln 2. A split that saw no key has L_s = -inf, so w_s = 0.
   With one split the kernel writes the output and LSE itself (no partials, no merge). A
   second merge kernel (the design before) cost a launch and, on the H200, 0.7-3.6 % at 8 x
   8192 keys and 1.0 % at 8 x 32768 (2 splits each), even at 16 splits, against the first
   form of this merge (notes/serving.md, "The merge in the split kernel").

Masking. Causal decode is aligned bottom-right (flash-attn, KV caches): query i of q_len sees
keys j <= kv_len - q_len + i, so only the last q_len keys need a mask. Within a chunk, the K
tiles every row of the row block sees whole run without mask arithmetic; the rest (the diagonal
and the ragged end of the cache) run masked. Rows that see no key (q_len > kv_len, or an empty
cache) end with l_i == 0 and are written as zeros with LSE -inf, never 0/0.

Two K/V sources, one kernel (constexpr PAGED):
- contiguous [batch, kv_heads, kv_len, head_dim], any strides;
- paged [num_blocks, PAGE_SIZE, kv_heads, head_dim] (any strides) with block_table
  [batch, max_blocks] int32: key n of sequence b lives in cache block block_table[b, n // PAGE_SIZE],
  row n % PAGE_SIZE. A page that holds whole K/V tiles (PAGE_SIZE a multiple of BLOCK_N) costs
  one table entry a tile; smaller pages, any size, one entry per key row. Either is loaded one
  trip ahead (_page_of): a table load in the K load's own trip gets a pipeline stage of its own
  and leaves one K/V tile pair fewer in flight; on the H200 that made decode on 128-key pages
  12-33 % slower at 8192-131072 keys, and left 1024 keys and a full grid of 4-query rows about
  even (notes/lab/decode_paged_h200.txt). head_dim is the contiguous axis either way, so K/V
  loads stay 16-byte cp.async vectors.
Sequences may have their own lengths (`seqlens`, int32 [batch]); splits past a sequence's end run
no tile and write L_s = -inf.

Any head_dim 16..256 (tiles BLOCK_D = next power of two wide, extra columns masked to zero);
fp16/bf16/fp32 (fp32 dots in IEEE, not tf32). Forward only: decode is inference.

Sliding window and softcap (constexprs WINDOW, SOFTCAP: without them the code is the plain
path's). A window (left, right) in flash-attn's convention, bottom-right: query i sees key j when
i + off - left <= j <= i + off + right, off = kv_len - q_len (causal: right = 0). Its right edge
is the causal bound moved right by `right` (a non-causal window with right >= 0 runs the CAUSAL
code); its left edge starts the key range: each row block splits only the keys from its first
query's first visible key (rounded down to a tile), so keys left of the window are never loaded
and the split rule counts only the window's keys. Tiles that cut the left edge run masked. The
softcap caps the scaled scores, softcap * tanh(s / softcap), before the softmax (common._logits).

Eager launches go through launch.FastLaunch under a key that leaves out the key length, so a
decode loop launches directly at almost every step (`_Plan`; a new split count, key tile or
Triton specialization of the key length compiles once). This module imports only torch, triton,
attnscope.kernels.common (shared jit helpers) and attnscope.kernels.launch.
"""

import functools

import torch

import triton
import triton.language as tl

from attnscope.kernels import common
from attnscope.kernels.common import _logits, aligned, block_width, score_scales, visibility
from attnscope.kernels.launch import FastLaunch, int_specializations, launch_table

LN2 = tl.constexpr(0.6931471805599453)  # ln(2): converts log2-domain LSEs back to natural log

# Calls of the fused op with at most this many queries take this kernel (attention/fused.py).
MAX_Q_LEN = 8
# (batch, K/V head) pairs a launch takes at most: its grid's second axis (CUDA's bound). The
# fused op sends larger calls to the prefill kernel; fused_attention_with_kvcache refuses them.
MAX_GROUPS = 65535

# Split rule (num_splits_for). PROGRAM_COST_TILES: what a program costs besides its K/V walk (its
# Q load, prologue, partial row and share of the merge), in K/V tiles: an estimate for the lab's
# --splits sweeps to check. MIN_SPLIT_BLOCKS: the shortest chunk, in K/V tiles, worth a program.
# MAX_SPLITS bounds the partial buffers and the merge's walk. MAX_RESIDENT: programs an SM holds
# at once at most (4 warps each; ~128 registers a thread leave room for 4 in 64K registers).
PROGRAM_COST_TILES = 2
MIN_SPLIT_BLOCKS = 4
MAX_SPLITS = 256
MAX_RESIDENT = 4
# The merge's step (_merge_row_block): the partials' column parts it loads at once hold at most
# this many fp32 values (64 a thread at 4 warps).
MERGE_VALUES = 8192
# Key tiles by chunk length (split_rule). Where LONG_BLOCK_N-key tiles (long_config_for), their
# split count worked out for their own occupancy, leave each split a chunk of LONG_CHUNK keys or
# more, the call walks them; otherwise config_for's 64-key tiles. A long walk is streaming-bound:
# a longer tile halves the loop trips and rescales per key. A short one (few keys a program) is
# latency-bound, where 64-key tiles let three programs share an SM (128-key ones: one) and end
# sooner. H200, bf16, head_dim 128, 32/8 heads, 16-row blocks, both tiles pinned
# (notes/lab/decode_tiles_h200.txt, decode_configs_h200.txt): 128-key tiles won where their
# chunks were 2048-16384 keys, by 1.3-7 % (64 x 8192 keys: 0.4916 against 0.5078 ms; 16 x 4096:
# 0.0777 against 0.0832; 1 x 131072, 16 chunks of 8192: 0.1398 against 0.1446; 4 x 4 queries x
# 8192, chunks of 2048: 0.0522 against 0.0531), and lost where they were 512-1024 (1 x 2048: 4
# chunks of 512, 0.0452 against 0.0369; 128 x 1024, one chunk of 1024: 0.1462 against 0.1415).
LONG_CHUNK = 2048
LONG_BLOCK_N = 128
# A window unbounded on the left: a left offset no row's key index reaches (int32 arithmetic).
NO_LEFT_EDGE = -(1 << 30)


@triton.jit
def _page_of(BlockTable, start_n, kv_len, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
             BLOCK_N: tl.constexpr):
    # The cache block of the tile at key start_n (pages of whole tiles: one table entry), or of
    # each of its key rows (smaller pages); 0 past kv_len, where the table may end, and when not
    # PAGED. The block loop loads it a trip ahead (_decode_inner).
    if PAGED and PAGE_SIZE % BLOCK_N == 0:
        return tl.load(BlockTable + start_n // PAGE_SIZE, mask=start_n < kv_len,
                       other=0).to(tl.int64)
    elif PAGED:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        return tl.load(BlockTable + offs_n // PAGE_SIZE, mask=offs_n < kv_len,
                       other=0).to(tl.int64)
    else:
        return 0


@triton.jit
def _kv_tile(base, page, start_n, offs_d, kv_len, stride_n, stride_page, stride_d,
             MASKED: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
             HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    # The [BLOCK_N, BLOCK_D] tile of K or V at key start_n: rows from this (batch, kv head)'s
    # base (contiguous), or from this kv head's base in the block pool (paged: `page`, _page_of's,
    # says which cache block holds the tile or each row). Masks only where the tile needs them
    # (they cost instructions in the hot loop): key rows past kv_len in MASKED tiles, columns
    # past HEAD_DIM.
    offs_n = start_n + tl.arange(0, BLOCK_N)
    n_ok = offs_n < kv_len
    if PAGED:
        rows = page * stride_page + (offs_n % PAGE_SIZE) * stride_n
    else:
        rows = offs_n * stride_n
    ptrs = base + rows[:, None] + offs_d[None, :] * stride_d
    if MASKED and HEAD_DIM != BLOCK_D:
        return tl.load(ptrs, mask=n_ok[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    elif MASKED:
        return tl.load(ptrs, mask=n_ok[:, None], other=0.0)
    elif HEAD_DIM != BLOCK_D:
        return tl.load(ptrs, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _decode_inner(acc, l_i, m_i, q, k_base, v_base, BlockTable, offs_d, query, lo, hi, kv_len,
                  causal_offset, left_offset, qk_scale, softcap_log2,  #
                  stride_kn, stride_kp, stride_kd, stride_vn, stride_vp, stride_vd,  #
                  MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                  SOFTCAP: tl.constexpr, PAGED: tl.constexpr,
                  PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_N: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    # K/V tiles [lo, hi) of this program's chunk. MASKED tiles hide keys past kv_len, when
    # CAUSAL keys right of a row's diagonal (plus a window's right size), and with a WINDOW keys
    # left of a row's window; a row may then see no key of a tile yet.
    # Paged: each trip loads the next tile's table entries for the next trip (K and V share
    # them), so the K/V loads' addresses do not wait on a load of their own trip: Triton's
    # pipeliner would give that load a stage, one K/V tile pair fewer in flight.
    page = _page_of(BlockTable, lo, kv_len, PAGED, PAGE_SIZE, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _kv_tile(k_base, page, start_n, offs_d, kv_len, stride_kn, stride_kp, stride_kd,
                     MASKED, PAGED, PAGE_SIZE, HEAD_DIM, BLOCK_D, BLOCK_N)
        next_page = _page_of(BlockTable, start_n + BLOCK_N, kv_len, PAGED, PAGE_SIZE, BLOCK_N)
        qk, _ = _logits(tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION), qk_scale,
                        softcap_log2, SOFTCAP)
        if MASKED:
            visible = (offs_n < kv_len)[None, :]
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= query[:, None] + causal_offset)
            if WINDOW:
                visible = visible & (offs_n[None, :] >= query[:, None] + left_offset)
            qk = tl.where(visible, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            # A row with no visible key so far keeps m == -inf; subtracting 0 instead keeps
            # exp2(-inf - -inf) = NaN out of p and alpha (both become exactly 0).
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_sub = m_new
        p = tl.math.exp2(qk - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _kv_tile(v_base, page, start_n, offs_d, kv_len, stride_vn, stride_vp, stride_vd,
                     MASKED, PAGED, PAGE_SIZE, HEAD_DIM, BLOCK_D, BLOCK_N)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=INPUT_PRECISION)
        m_i = m_new
        page = next_page
    return acc, l_i, m_i


@triton.jit
def _last_query(row_start, GROUP, Q_LEN, BLOCK_M: tl.constexpr):
    # The last query with a row in the row block that starts at row_start.
    return tl.minimum((row_start + BLOCK_M - 1) // GROUP, Q_LEN - 1)


@triton.jit
def _decode_split(Q, K, V, Out, Lse, Part, Arrivals, SeqLens, BlockTable,  #
                  stride_kz, stride_kh, stride_kn, stride_kd,  #
                  stride_vz, stride_vh, stride_vn, stride_vd,  #
                  stride_btz, KV_LEN, CHUNK, qk_scale, softcap_log2,  #
                  stride_qz, stride_qh, stride_qm, stride_qd,  #
                  stride_oz, stride_oh, stride_om, stride_od,  #
                  KV_HEADS, GROUP, Q_LEN, NUM_SPLITS, right_shift, left_shift,  #
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                  SOFTCAP: tl.constexpr, PAGED: tl.constexpr,
                  PAGE_SIZE: tl.constexpr, VARLEN: tl.constexpr, FINAL: tl.constexpr,
                  INPUT_PRECISION: tl.constexpr, MERGE_COLS: tl.constexpr,
                  MERGE_SPLITS: tl.constexpr):
    # Grid: (split, batch * kv head, row block). stride_kz/stride_vz step a batch entry, or a
    # cache block when PAGED. FINAL (one split): write the output and LSE, not partials;
    # otherwise the row block's last split to finish merges them (_merge_row_block).
    # The arguments up to softcap_log2 are the ones a kept launch takes per call (the tensors,
    # what depends on the cache's length and layout, the scale); the rest its key fixes.
    # WINDOW: the diagonal moves right by right_shift and keys j < i + off + left_shift are hidden.
    qk_scale = tl.cast(qk_scale, tl.float32)  # torch.compile passes Python floats as fp64
    split = tl.program_id(0)
    off_zh = tl.program_id(1)
    row_start = tl.program_id(2) * BLOCK_M
    off_z = (off_zh // KV_HEADS).to(tl.int64)
    off_hkv = (off_zh % KV_HEADS).to(tl.int64)
    if VARLEN:
        kv_len = tl.load(SeqLens + off_z)
    else:
        kv_len = KV_LEN

    # Rows: (query, q head) pairs of this KV head's group.
    offs_m = row_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < Q_LEN * GROUP
    d_ok = offs_d < HEAD_DIM
    query = offs_m // GROUP
    off_h = off_hkv * GROUP + offs_m % GROUP
    q_ptrs = (Q + off_z * stride_qz + off_h[:, None] * stride_qh + query[:, None] * stride_qm
              + offs_d[None, :] * stride_qd)
    q = tl.load(q_ptrs, mask=m_ok[:, None] & d_ok[None, :], other=0.0)

    if PAGED:
        k_base = K + off_hkv * stride_kh
        v_base = V + off_hkv * stride_vh
        BlockTable += off_z * stride_btz
    else:
        k_base = K + off_z * stride_kz + off_hkv * stride_kh
        v_base = V + off_z * stride_vz + off_hkv * stride_vh

    # Key range: this split's chunk, cut at the cache's end and, when causal, at what the block's
    # last query sees. Keys [full_lo, mid) are seen whole by every row of the block: no masks
    # there. With a WINDOW the chunks start at the block's first visible key (rounded down to a
    # tile), and keys [lo, full_lo), left of the last query's window edge, run masked.
    # (Statements in the plain path's order: its code stays what it was before windows.)
    lo = split * CHUNK
    if WINDOW:
        left_offset = kv_len - Q_LEN + left_shift  # query i sees keys j >= i + left_offset
        lo += tl.maximum(row_start // GROUP + left_offset, 0) // BLOCK_N * BLOCK_N
    else:
        left_offset = 0  # unused
    hi = tl.minimum(lo + CHUNK, kv_len)
    causal_offset = kv_len - Q_LEN  # bottom-right: query i sees keys j <= i + causal_offset
    if WINDOW:
        causal_offset += right_shift
    if CAUSAL:
        hi = tl.minimum(hi, _last_query(row_start, GROUP, Q_LEN, BLOCK_M) + causal_offset + 1)
        seen_by_all = row_start // GROUP + causal_offset + 1
    else:
        seen_by_all = kv_len
    full_lo = lo
    if WINDOW:
        seen_from = tl.maximum(_last_query(row_start, GROUP, Q_LEN, BLOCK_M) + left_offset, lo)
        full_lo = tl.maximum(tl.minimum((seen_from + BLOCK_N - 1) // BLOCK_N * BLOCK_N, hi), lo)
    mid = full_lo + tl.maximum(tl.minimum(seen_by_all, hi) - full_lo, 0) // BLOCK_N * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if WINDOW:  # stage 0: tiles that cut the window's left edge, masked
        acc, l_i, m_i = _decode_inner(acc, l_i, m_i, q, k_base, v_base, BlockTable, offs_d, query,
                                      lo, full_lo, kv_len, causal_offset, left_offset, qk_scale,
                                      softcap_log2,  #
                                      stride_kn, stride_kz, stride_kd, stride_vn, stride_vz,
                                      stride_vd, True, CAUSAL, WINDOW, SOFTCAP, PAGED, PAGE_SIZE,
                                      HEAD_DIM, BLOCK_D, BLOCK_N, INPUT_PRECISION)
    # stage 1: tiles every row sees whole, no masking
    acc, l_i, m_i = _decode_inner(acc, l_i, m_i, q, k_base, v_base, BlockTable, offs_d, query,
                                  full_lo, mid, kv_len, causal_offset, left_offset, qk_scale,
                                  softcap_log2,  #
                                  stride_kn, stride_kz, stride_kd, stride_vn, stride_vz, stride_vd,
                                  False, CAUSAL, WINDOW, SOFTCAP, PAGED, PAGE_SIZE, HEAD_DIM,
                                  BLOCK_D, BLOCK_N, INPUT_PRECISION)
    # stage 2: the diagonal and the ragged end of the cache, masked
    acc, l_i, m_i = _decode_inner(acc, l_i, m_i, q, k_base, v_base, BlockTable, offs_d, query,
                                  mid, hi, kv_len, causal_offset, left_offset, qk_scale,
                                  softcap_log2,  #
                                  stride_kn, stride_kz, stride_kd, stride_vn, stride_vz, stride_vd,
                                  True, CAUSAL, WINDOW, SOFTCAP, PAGED, PAGE_SIZE, HEAD_DIM,
                                  BLOCK_D, BLOCK_N, INPUT_PRECISION)

    # epilogue: rows that saw no key have l_i == 0: output 0, LSE -inf (log2(0))
    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    lse2 = m_i + tl.math.log2(l_i)
    row = (off_z * (KV_HEADS * GROUP) + off_h) * Q_LEN + query  # index of (z, h, query) in Lse
    if FINAL:
        tl.store(Lse + row, lse2 * LN2, mask=m_ok)
        o_ptrs = (Out + off_z * stride_oz + off_h[:, None] * stride_oh
                  + query[:, None] * stride_om + offs_d[None, :] * stride_od)
        tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
    else:
        part = row * NUM_SPLITS + split
        # Part: the output partials [batch, heads, q_len, NUM_SPLITS, HEAD_DIM], then the LSEs
        # [batch, heads, q_len, NUM_SPLITS] (one buffer: one allocation a call)
        rows = tl.num_programs(1).to(tl.int64) * (GROUP * Q_LEN)  # batch * heads * q_len
        tl.store(Part + rows * NUM_SPLITS * HEAD_DIM + part, lse2, mask=m_ok)
        tl.store(Part + part[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=m_ok[:, None] & d_ok[None, :])
        # Arrive: every thread's partial stores come before the count (the barrier), and the
        # count releases them to the GPU; the split that brings it to NUM_SPLITS acquires the
        # others' and merges, then zeroes the count for the next launch on this stream.
        tl.debug_barrier()
        arrival = Arrivals + off_zh * tl.num_programs(2) + tl.program_id(2)
        if tl.atomic_add(arrival, 1, sem="acq_rel", scope="gpu") == NUM_SPLITS - 1:
            tl.store(arrival, 0)
            tl.debug_barrier()  # the acquire reaches every thread (not left to the lowering)
            _merge_row_block(Part, Out, Lse, row, rows, m_ok, off_z, off_h, query,
                             stride_oz, stride_oh, stride_om, stride_od, NUM_SPLITS, HEAD_DIM,
                             BLOCK_M, BLOCK_D, MERGE_COLS, MERGE_SPLITS)


@triton.jit
def _merge_row_block(Part, Out, Lse, row, rows, m_ok, off_z, off_h, query,
                     stride_oz, stride_oh, stride_om, stride_od, NUM_SPLITS,
                     HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                     MERGE_COLS: tl.constexpr, MERGE_SPLITS: tl.constexpr):
    # The row block's output and LSE from its NUM_SPLITS partials (row: each row's index in
    # Lse; Part as _decode_split writes it): with M = max_s L_s and w_s = 2^(L_s - M),
    # out = sum_s w_s O_s / sum_s w_s and LSE = (M + log2(sum_s w_s)) * ln 2, taken online (the
    # running max m, the sum and the output rescaled as it grows), so no [rows, splits] tile is
    # held. A split that saw no key has L_s = -inf (w_s = 0); a row no split saw gets 0 and
    # -inf. The partials are read past L1 (.cg): other SMs wrote them during this launch.
    # MERGE_COLS columns at a time and MERGE_SPLITS partials a step (unrolled, so their loads
    # are in flight together): a [64, 256] tile and its addresses would spill.
    LsePart = Part + rows * NUM_SPLITS * HEAD_DIM  # after O's
    for c0 in tl.static_range(0, BLOCK_D, MERGE_COLS):
        cols = c0 + tl.arange(0, MERGE_COLS)
        c_ok = cols < HEAD_DIM
        m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        total = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, MERGE_COLS], dtype=tl.float32)
        for s0 in tl.range(0, NUM_SPLITS, MERGE_SPLITS):
            for t in tl.static_range(MERGE_SPLITS):
                split = row * 0 + s0 + t  # a vector: the interpreter takes no scalar in a mask
                part = row * NUM_SPLITS + split
                t_ok = m_ok & (split < NUM_SPLITS)
                lse_s = tl.load(LsePart + part, mask=t_ok, other=float("-inf"),
                                cache_modifier=".cg")
                o = tl.load(Part + part[:, None] * HEAD_DIM + cols[None, :],
                            mask=t_ok[:, None] & c_ok[None, :], other=0.0, cache_modifier=".cg")
                m_new = tl.maximum(m, lse_s)
                m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)  # no split yet: weights 0
                alpha = tl.math.exp2(m - m_sub)
                w = tl.math.exp2(lse_s - m_sub)
                total = total * alpha + w
                acc = acc * alpha[:, None] + o * w[:, None]
                m = m_new
        acc = acc / tl.where(total == 0.0, 1.0, total)[:, None]
        o_ptrs = (Out + off_z * stride_oz + off_h[:, None] * stride_oh
                  + query[:, None] * stride_om + cols[None, :] * stride_od)
        tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=m_ok[:, None] & c_ok[None, :])
    tl.store(Lse + row, (m + tl.math.log2(total)) * LN2, mask=m_ok)  # every column part's


def is_interpreted():
    """True when these kernels were defined under TRITON_INTERPRET=1 (they run on CPU tensors)."""
    return not isinstance(_decode_split, triton.runtime.JITFunction)


def config_for(head_dim, rows, dtype):
    """(BLOCK_M, BLOCK_N, BLOCK_D, num_warps, num_stages) for head_dim, q_len * GROUP rows and
    dtype. 16-bit inputs: BLOCK_M the rows padded to the 16-row minimum of tl.dot, at most 64
    (more rows take more row blocks); 64-key K/V tiles (32 at head_dim 256), num_stages 3 so two
    tile pairs load while one is used; 8 warps for a 64 x 256 accumulator (at 4, 255 registers
    and a spill on sm_90). fp32 (IEEE dots on CUDA cores, register-hungry): 16-row blocks,
    16-key tiles at head_dim 256, 8 warps, 2 stages; the largest that compile without spills for
    sm_90 with Triton 3.6 (benchmarks/sass_offline.py-style compiles). In the interpreter, small
    tiles so CPU tests cross several tiles, row blocks and a masked diagonal."""
    block_d = block_width(head_dim)
    if is_interpreted():
        return 16, 16, block_d, 4, 1
    if dtype.itemsize == 4:
        return 16, 64 if block_d <= 128 else 16, block_d, 8, 2
    block_m = min(64, max(16, 1 << (rows - 1).bit_length()))
    block_n = 64 if block_d <= 128 else 32
    return block_m, block_n, block_d, 8 if block_m * block_d > 64 * 128 else 4, 3


def long_config_for(head_dim, rows, dtype):
    """config_for's config with LONG_BLOCK_N-key tiles, for calls whose splits walk LONG_CHUNK
    keys or more in them (split_rule); None where config_for's tile stays: fp32 inputs
    (config_for's tiles are the largest without spills) and head_dim > 128 (its 32-key tiles
    already fill the shared memory a program may take). A 64-row block takes 8 warps: at 4,
    its 64 x 128 score tile takes 255 registers with Triton 3.6 and spills with 3.9; at 8, 254
    and no spill (sm_90 offline compiles; 16 rows: 168 registers at 4 warps). In the
    interpreter, tiles twice config_for's, so CPU tests cross several tiles of either."""
    block_m, block_n, block_d, num_warps, num_stages = config_for(head_dim, rows, dtype)
    if is_interpreted():
        return block_m, 2 * block_n, block_d, num_warps, num_stages
    if dtype.itemsize == 4 or block_d > 128:
        return None
    return block_m, LONG_BLOCK_N, block_d, 8 if block_m == 64 else num_warps, num_stages


def slots(device, block_m, block_n, block_d, dtype, num_stages):
    """Programs the GPU runs at once: SMs x programs per SM, the latter bounded by the shared
    memory a program takes (and MAX_RESIDENT): num_stages - 1 K/V tile pairs in flight (the
    pipeliner's buffers) and room for the Q tile twice; an upper bound of what Triton 3.6
    allocates for sm_90 (70 KB at head_dim 128 bf16: 3 programs an SM). The interpreter has no
    SMs: 4 makes the rule split CPU tests' short caches too."""
    if device.type != "cuda":
        return 4
    props = torch.cuda.get_device_properties(device)
    smem = ((num_stages - 1) * 2 * block_n + 2 * block_m) * block_d * dtype.itemsize
    per_sm = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)  # sm_90's if unknown
    return props.multi_processor_count * max(1, min(MAX_RESIDENT, per_sm // smem))


@functools.lru_cache(maxsize=1024)
def num_splits_for(groups, kv_len, block_n, slots):
    """Splits of each of `groups` (batch, kv head, row block)'s kv_len keys that minimise the
    launch's time in tiles, ceil(groups * splits / slots) waves x (tiles a split +
    PROGRAM_COST_TILES), the fewest splits on a tie; chunks of at least MIN_SPLIT_BLOCKS tiles of
    block_n keys, at most MAX_SPLITS. E.g. on 132 SMs x 3 (head_dim 128, bf16, 3 stages):
    64 seqs x 8 kv heads, 8192 keys -> 3 (1536 programs, 3.9 waves); 8 x 8, 32768 keys -> 6
    (384 programs, one wave); 1 x 8, 131072 keys -> 49."""
    tiles = -(-kv_len // block_n)
    most = max(1, min(tiles // MIN_SPLIT_BLOCKS, MAX_SPLITS))

    def cost(splits):
        return -(-groups * splits // slots) * (-(-tiles // splits) + PROGRAM_COST_TILES)
    return min(range(1, most + 1), key=cost)  # min keeps the first (fewest splits) of ties


def split_rule(kv_len, window_keys, groups, tiles, forced_splits, long_chunk):
    """(block_n, num_splits, chunk) of a call over kv_len keys: the key tile it walks, its split
    count and the keys a split takes (whole tiles). tiles: (block_n, slots) of the short tile,
    then of the long one where the call may take it. The long tile is taken when its own split
    count (forced_splits, else num_splits_for for its slots: fewer programs fit an SM) leaves
    each split a chunk of at least long_chunk keys; otherwise the short tile, its split count
    worked out for its own slots. With a window bounded both ways a row block splits only the
    window_keys + block_n keys its chunks cover (its first query's window edge rounded down to a
    tile, to its last query's diagonal). E.g. on the H200, bf16, head_dim 128 (tiles (64, 396),
    (128, 132)): 64 seqs x 8 kv heads of 8192 keys take 128-key tiles, 1 split of 8192; 128
    seqs of 1024 keys (one 1024-key chunk either way) and 1 seq of 2048 (4 splits of 512 in
    128-key tiles) keep 64-key tiles."""
    if len(tiles) > 1:
        long = _chunks(kv_len, window_keys, groups, *tiles[1], forced_splits)
        if long[2] >= long_chunk:
            return long
    return _chunks(kv_len, window_keys, groups, *tiles[0], forced_splits)


def _chunks(kv_len, window_keys, groups, block_n, slots, forced_splits):
    # split_rule for one tile: (block_n, num_splits, chunk)
    span = kv_len if window_keys is None else min(kv_len, window_keys + block_n)
    tiles = max(1, -(-span // block_n))
    num_splits = forced_splits
    if num_splits is None:
        num_splits = num_splits_for(groups, span, block_n, slots)
    num_splits = max(1, min(num_splits, MAX_SPLITS, tiles))
    chunk = -(-tiles // num_splits) * block_n
    return block_n, -(-max(span, 1) // chunk), chunk  # no split left without keys by rounding


def _empty(like, shape, dtype):
    # Scratch for the partials, on like's device: tests replace it with a NaN fill to prove every
    # partial is written. (Tensor.new_empty parses fewer arguments than torch.empty; a subclass
    # such as a Parameter gets torch.empty's plain tensor.)
    if type(like) is not torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=like.device)
    return like.new_empty(shape, dtype=dtype)


# Eager launches (launch.FastLaunch): Triton's dispatch once per key, a direct launch after.
_split_launch = FastLaunch(_decode_split)
# Per-call arguments of the split kernel: the nine tensors, then the ints and floats a kept
# launch takes anew each call (K/V and block-table strides, KV_LEN, CHUNK, qk_scale,
# softcap_log2).
SPLIT_PER_CALL = 22


class _Plan:
    """What a decode call's key fixes, worked out once: the config of each key tile the call may
    take (config_for's, and long_config_for's for long chunks: split_rule), the grid but its
    split axis, the visibility arguments and the split rule's inputs; and, per key length met,
    the tile, split count, chunk and the split kernel's launch key.

    The key leaves out what a decode loop changes every step, which the kernel takes per call:
    the key length, the chunk (both in K/V tiles, so within one tile and split count a call's
    grid and constexprs do not depend on them), the K/V strides (a cache grown by torch.cat has
    new ones each step) and the scale. Of those ints the launch keys hold only what Triton
    specializes on (launch.int_specializations). A loop whose cache grows into long chunks
    keeps its plan and switches tiles: the tile is in the split kernel's key."""

    MAX_LENGTHS = 4096  # key lengths remembered per plan

    def __init__(self, q, out, kv_heads, page_size, causal, window, softcap, config, num_splits):
        batch, heads, q_len, head_dim = q.shape
        self.group = heads // kv_heads
        rows = q_len * self.group
        configs = [config_for(head_dim, rows, q.dtype)]
        if config is not None:  # pinned: one tile
            block_m, block_n, num_warps, num_stages = config
            configs = [(block_m, block_n, configs[0][2], num_warps, num_stages)]
        else:
            long = long_config_for(head_dim, rows, q.dtype)
            # Only pages of whole long tiles take them. On smaller pages a long tile reads one
            # table entry a key row (twice the short tile's a tile, or instead of its one a tile
            # where pages hold whole short tiles) in a program that has an SM to itself; on
            # 16- and 32-key pages the short tile read up to 14 % faster on the H200 and at
            # most 3 % slower (notes/lab/decode_paged_h200.txt).
            if long is not None and (page_size is None or page_size % long[1] == 0):
                configs.append(long)
        block_m, _, block_d, _, _ = configs[0]  # the tiles differ in BLOCK_N and warps only
        self.forced_splits = num_splits
        self.row_blocks = -(-rows // block_m)
        self.programs = batch * kv_heads * self.row_blocks
        self.tiles = tuple((c[1], slots(q.device, block_m, c[1], block_d, q.dtype, c[4]))
                           for c in configs)
        causal, right_shift, has_left, left_shift = visibility(causal, 0, window)
        if not has_left:
            left_shift = NO_LEFT_EDGE
        # Keys a row block's chunks cover, less one tile (split_rule), when bounded both ways.
        self.window_keys = q_len + window[0] + right_shift - 1 if has_left and causal else None
        self.out_strides = out.stride()
        self.fixed = (*q.stride(), *self.out_strides, kv_heads, self.group, q_len)
        self.shifts = (right_shift, left_shift)
        constexprs = dict(
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m, CAUSAL=causal,
            WINDOW=window != (-1, -1), SOFTCAP=softcap > 0, PAGED=page_size is not None,
            PAGE_SIZE=page_size or 1, INPUT_PRECISION="ieee" if q.dtype == torch.float32
            else "tf32")  # tf32 unused on 16-bit inputs
        # By BLOCK_N: the split kernel's constexprs and options, and its config (launch records)
        self.launches = {
            block_n: (dict(constexprs, BLOCK_N=block_n, num_warps=num_warps,
                           num_stages=num_stages),
                      dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
                           num_stages=num_stages))
            for _, block_n, _, num_warps, num_stages in configs}
        self.rows = batch * heads * q_len  # output rows, each a partial per split
        self.head_dim = head_dim
        # the merge's column part and partials a step: at most MERGE_VALUES fp32 values a step
        self.merge_cols = min(block_d, max(16, MERGE_VALUES // block_m))
        self.merge_splits = max(1, MERGE_VALUES // (block_m * self.merge_cols))
        self.lengths = {}

    def partials(self, q, num_splits):
        """A split launch's scratch: the partial outputs, then their LSEs (a fresh allocation:
        16-byte aligned), on q's device."""
        return _empty(q, (self.rows * num_splits * (self.head_dim + 1),), torch.float32)

    def for_length(self, kv_len):
        """(num_splits, chunk, block_n, split kernel's key) for kv_len keys a sequence may
        hold."""
        got = self.lengths.get(kv_len)
        if got is None:
            if len(self.lengths) >= self.MAX_LENGTHS:
                self.lengths.clear()
            got = self.lengths[kv_len] = self._split(kv_len)
        return got

    def _split(self, kv_len):
        block_n, num_splits, chunk = split_rule(kv_len, self.window_keys, self.programs,
                                                self.tiles, self.forced_splits, LONG_CHUNK)
        return (num_splits, chunk, block_n,
                (self, block_n, num_splits, int_specializations(kv_len, chunk)))


_plans = launch_table()  # _Plan by decode key; forget_launches clears it
_arrival_counts = {}  # (device, stream): zeroed int32 counts, _arrivals'
_retired_counts = []  # outgrown ones, kept alive (_arrivals)
MIN_ARRIVALS = 4096  # counts a buffer holds at least (16 KB; e.g. 512 sequences x 8 kv heads)
MAX_PLANS = 256


def _arrivals(device, programs):
    """Zeroed int32 counts, one per program of a split launch's grid but its split axis, that
    the row blocks' splits count their arrivals in (the last one merges) on the current stream
    of `device`. Each launch leaves them zero (the merging split zeroes its count), so one
    buffer serves every launch on one stream; another stream, whose launches may overlap, gets
    its own. A buffer outgrown is kept, never freed: a captured CUDA graph, or a launch still
    running, holds its address. Graphs captured on one stream share its buffer, so they must not
    replay at the same time. The first split call of a stream, or one with more programs than
    its buffer holds, may not happen during CUDA-graph capture: warm up outside it."""
    stream = torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else 0
    counts = _arrival_counts.get((device, stream))
    if counts is None or counts.numel() < programs:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "attnscope's decode kernel needs a new buffer of arrival counts during CUDA-graph "
                "capture (the first call on this stream that splits its keys, or one with more "
                "programs than before). Call the op once with these shapes on this stream before "
                "capturing (a warm-up run).")
        if counts is not None:
            _retired_counts.append(counts)
        counts = torch.zeros(max(programs, MIN_ARRIVALS), dtype=torch.int32, device=device)
        _arrival_counts[(device, stream)] = counts
    return counts


def attention_decode(q, k, v, out, lse, *, causal, scale, seqlens=None, block_table=None,
                     window=(-1, -1), softcap=0.0, num_splits=None, config=None, kept=False):
    """Launch split-KV decode attention.

    q, out: [batch, heads, q_len, head_dim] views with any strides; lse: contiguous fp32
    [batch, heads, q_len] (natural log). K/V, any strides, either
      contiguous (block_table None): [batch, kv_heads, kv_len, head_dim], or
      paged: [num_blocks, page_size, kv_heads, head_dim] with block_table int32 [batch, max_blocks].
    seqlens: int32 [batch], each sequence's key count (None: every sequence has kv_len keys; a
    paged cache then holds max_blocks * page_size). causal: bottom-right aligned. window:
    (left, right), flash-attn's, bottom-right, -1 unbounded (causal makes right 0); softcap: 0
    off, else scores become softcap * tanh(s / softcap). num_splits:
    None for `num_splits_for`'s rule, else that many (clamped to 1..MAX_SPLITS and to one tile a
    split). config: (BLOCK_M, BLOCK_N, num_warps, num_stages) instead of `config_for`'s and
    `long_config_for`'s (the lab's sweeps; BLOCK_M, BLOCK_N powers of two >= 16). Call with q's
    device current. Returns the number of splits launched and the key tile (BLOCK_N) they walked
    (split_rule's choice); with kept=True also, third, the call's launch kept for its repeats
    (`_repeat_launch`), or None where none was kept (the interpreter).

    An eager call is looked up by what fixes its kernels and their fixed arguments (_Plan says
    what is left out); a repeat launches the kernel directly (launch._Bound). Module state the
    key does not hold (num_splits_for, config_for, long_config_for: what tests replace) is
    forgotten by launch.forget_launches().
    """
    paged = block_table is not None
    if paged:  # [num_blocks, page_size, kv_heads, d]: block, head, row, column strides
        page_size, kv_heads = k.shape[1], k.shape[2]
        kv_len = block_table.shape[1] * page_size  # keys a sequence may hold
        k_strides = (k.stride(0), k.stride(2), k.stride(1), k.stride(3))
        v_strides = (v.stride(0), v.stride(2), v.stride(1), v.stride(3))
        table_stride = block_table.stride(0)
        table_arg = block_table
    else:
        page_size, kv_heads, kv_len = None, k.shape[1], k.shape[2]
        k_strides, v_strides, table_stride = k.stride(), v.stride(), 0
        table_arg = lse  # unused when not PAGED
        # A contiguous cache's rows are 32-bit offsets from its head's first (a page's are
        # int64). Worked out inline (this runs on every call not remembered), with the error's
        # wording from check_row_offsets.
        if ((kv_len - 1) * max(abs(k_strides[2]), abs(v_strides[2]))
                + (k.shape[3] - 1) * max(abs(k_strides[3]), abs(v_strides[3]))
                > common.MAX_ROW_OFFSET):
            common.check_row_offsets(kv_len, (k, v), ("k_cache", "v_cache"))
    seqlens_arg = seqlens if seqlens is not None else lse  # unused when not VARLEN
    window = tuple(window)
    key = (q.device, q.dtype, k.dtype, v.dtype, out.dtype, q.shape, kv_heads, page_size,
           q.stride(), out.stride(), aligned(q, k, v, out, lse, seqlens_arg, table_arg),
           int_specializations(*k_strides, *v_strides, table_stride), seqlens is not None,
           causal, window, softcap > 0, config, num_splits)
    plan = _plans.get(key)
    if plan is None:
        if len(_plans) >= MAX_PLANS:
            _plans.clear()
        plan = _plans[key] = _Plan(q, out, kv_heads, page_size, causal, window, softcap, config,
                                   num_splits)
    num_splits, chunk, block_n, split_key = plan.for_length(kv_len)
    final = num_splits == 1
    if final:
        part = arrivals = out  # unused: the split kernel writes out and lse itself
    else:
        part, arrivals = plan.partials(q, num_splits), _arrivals(q.device, plan.programs)
    qk_scale, softcap_log2, _ = score_scales(scale, softcap)
    per_call = (q, k, v, out, lse, part, arrivals, seqlens_arg, table_arg,  #
                *k_strides, *v_strides, table_stride, kv_len, chunk, qk_scale, softcap_log2)
    bound = _split_launch.bound.get(split_key)
    if bound is not None:
        bound(per_call)
    else:
        grid = (num_splits, plan.programs // plan.row_blocks, plan.row_blocks)
        args = (*per_call, *plan.fixed, num_splits, *plan.shifts)
        constexprs, config = plan.launches[block_n]
        _split_launch(split_key, grid, args,
                      dict(constexprs, VARLEN=seqlens is not None, FINAL=final,
                           MERGE_COLS=plan.merge_cols, MERGE_SPLITS=plan.merge_splits),
                      per_call=SPLIT_PER_CALL, config=config)
    if kept:
        return num_splits, block_n, _repeat_launch(plan, num_splits, split_key, per_call[9:])
    return num_splits, block_n


def _repeat_launch(plan, num_splits, split_key, scalars):
    """The launch of a call again, for one with the same key, K/V (or cache and block table)
    shapes and strides and scale (the remembered calls of fused.py and decode.py hold them), or
    None where the call kept no launch. It takes (q, k, v, out, lse[, seqlens, block_table]),
    the last two as the first call had them (a tensor or None), and passes the call's scalars
    (strides, key length, chunk, scales) as they were: no key, plan or split rule to work out
    again, only the partials and the stream's arrival counts (a repeat may run on another
    stream)."""
    bound = _split_launch.bound.get(split_key)
    if bound is None:
        return None
    if num_splits == 1:
        def final(q, k, v, out, lse, seqlens=None, table=None):
            bound((q, k, v, out, lse, out, out, lse if seqlens is None else seqlens,
                   lse if table is None else table, *scalars))
        return final

    def split(q, k, v, out, lse, seqlens=None, table=None):
        bound((q, k, v, out, lse, plan.partials(q, num_splits),
               _arrivals(q.device, plan.programs), lse if seqlens is None else seqlens,
               lse if table is None else table, *scalars))
    return split
