"""
The attention backward's dK/dV and dQ kernels for Hopper (sm_90) in Gluon
=========================================================================

The backward's math and conventions are attention_bwd.py's (P recomputed from Q, K and the
forward's LSE; Delta = rowsum(dO * O) from its preprocess kernel, which still runs; dS = P * (dP -
Delta); dK = dS^T Q * scale, dV = P^T dO, dQ = dS K * scale). These two kernels replace its dK/dV
and dQ kernels (four and three of the split backward's seven matmuls per tile pair) with the
forward Gluon kernel's structure: a 1-warp loader feeding two 4-warp consumer warpgroups
through shared memory with TMA, mbarriers between them ("ready" counts the copy engine's bytes,
"empty" both consumers' arrivals), products as asynchronous wgmma.

dK/dV (`_attn_bwd_dkdv_hopper`):
- One program per (batch, K/V head, 128-key block), every head's key block 0 first (heads on
  grid axis 0: under a causal mask the first key blocks are seen by the most queries, so the
  longest programs start first).
- The loader brings the program's K and V tiles in once, then streams the (Q, dO) blocks of
  BLOCK_M query rows (`dkdv_config`) that see those keys, each with its rows' LSE (times log2 e) and
  Delta, which it loads and stores into shared memory itself, for every query head that
  shares the K/V head (GQA sums them on chip), through a STAGES-deep ring.
- Each consumer owns 64 of the block's keys and works on transposed tiles, keys along rows, so
  its dK and dV accumulators ([64 keys, head_dim] fp32) take every product without a transpose:
  S^T = K Q^T and dP^T = V dO^T from shared memory, then P^T = exp2(S^T * scale * log2e - LSE *
  log2e) and dS^T = P^T * (dP^T - Delta) in registers, and dV += P^T dO, dK += dS^T Q with P^T
  and dS^T as the wgmma's register operand. dK and dV are staged in the warpgroup's own K and V
  buffers once its loop is done and stored by the copy engine, which drops rows past the end;
  the loader issues those stores once both warpgroups have staged (the "staged" mbarrier),
  having made their descriptors while the consumers finished (FUSED: each warpgroup stores its
  own).

With FUSED (attention_bwd's deterministic=False, attention_bwd.fused_dq's calls) the dK/dV
kernel computes dQ too, and no dQ kernel runs: each consumer stages its dS^T in shared memory,
both meet there, and each multiplies the pair by its 64 columns of K (dQ = dS K, a 64 x 64 fp32
tile); a fourth partition, one warp (`_dq_writer`), adds the two halves into a zeroed fp32
buffer with the copy engine's reduce-add (`gluon_compat.tma_add`), which the host scales into
dQ. Key blocks add in whatever order their programs run: dQ's fp32 sums differ between runs in
their last bits.

dQ (`_attn_bwd_dq_hopper`): the same with queries and keys exchanged. One program per (batch,
query head, 128-row query tile), last tile first; Q and dO stay, (K, V) blocks of BLOCK_N keys
(DQ_CONFIGS: 64 at head_dim 128, 128 at 64) stream; each consumer owns 64 rows: S = Q K^T,
dP = dO V^T, dS = P * (dP - Delta), dQ += dS K.

Rows that see no key (LSE -inf) read as +inf, so their P is exactly 0; query rows past the end
are the copy engine's zeros with LSE -inf; keys past the end are zeros, masked in dQ (and in
the fused dK/dV kernel's dS^T, which dQ's product reads) and otherwise only in their own
(dropped) rows of dK/dV. Under a causal mask key j counts for query i when j <= i +
CAUSAL_OFFSET; only blocks some row or key of a warpgroup sees in part take the mask (a
run-time branch per block, as the forward's).

Sliding windows and softcaps as the Triton backward takes them (HAS_WINDOW, SOFTCAP; without
them the kernels compile as before). The window's right edge is the causal bound moved right
(common.visibility); its left edge (key j counts for query i when j >= i + LEFT_OFFSET) ends a
dK/dV program's query blocks at the last row that sees its last key and starts a dQ program's
key blocks at the one holding its first row's first key, so blocks wholly outside the window
are never loaded; blocks the edge cuts take the mask. A softcap's logits are softcap *
tanh(scale * s / softcap), as the forward computed the LSE from them (common._tanh_exp2's form),
and dS takes the cap's derivative 1 - tanh^2; the dK/dV kernel then streams query blocks of at
most 64 rows (`dkdv_config`).

What they take (`supports`): sm_90, fp16/bf16, head_dim 128 (64 from MIN_QUERIES queries on,
in 128-row query blocks, 64-row ones under a softcap, and 128-key dQ blocks; 80, 96 and 112 on
head_dim 128's tiles, `TILE`, the copy engine reading zeros past a head's columns and dropping
those columns of the gradients' stores; the products skip those columns: S and dP chained over
the head's (_over_columns), dK, dV and dQ at 80 and 96 as two accumulators of 64 and 16 or 32
columns),
q/k/v/dO/dQ/dK/dV [batch, heads, seq, head_dim] contiguous or at strides the copy engine takes
(bshd views, e.g.: STRIDED, 4-D descriptors at each tensor's strides) at 16-byte aligned
addresses, windows and softcaps; not a packed batch.
"""

import functools

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

from attnscope.kernels.attention_fwd_hopper import _tanh_exp2
from attnscope.kernels.common import (LOG2E, _grouped_tile, aligned, device_properties, l2_group,
                                      score_scales, tma_strided_ok, tma_view_strides)
from attnscope.kernels.gluon_compat import partition_barrier, tma_add, tma_load, tma_store
from attnscope.kernels.launch import FastLaunch, ensure_scratch_allocator

ROWS = gl.constexpr(64)  # keys per consumer warpgroup; the dQ kernel's query rows per warpgroup
LOG2E_G = gl.constexpr(LOG2E)


@gluon.jit
def _descriptor(ptr, n_hz, n_ctx, COLS: gl.constexpr, smem, view, STRIDED: gl.constexpr):
    # The copy engine's view of a [batch * heads, seq, COLS] tensor in blocks of one buffer of
    # the ring `smem`: contiguous, [batch * heads, seq, COLS]; STRIDED (a call with a tensor that
    # is not contiguous, e.g. bshd views; every tensor of it is seen so), [batch, heads, seq,
    # COLS] at `view`'s (heads, batch stride, head stride, row stride). A block past a head's end
    # reads zeros, and a store drops its rows there, either way; so do a box's columns past COLS
    # where the buffer is wider (a head_dim padded to its tile, HEAD_DIM).
    rows: gl.constexpr = smem.shape[1]
    width: gl.constexpr = smem.shape[2]
    if STRIDED:
        heads, stride_z, stride_h, stride_m = view
        desc = tma.make_tensor_descriptor(ptr, [n_hz // heads, heads, n_ctx, COLS],
                                          [stride_z, stride_h, stride_m, 1],
                                          [1, 1, rows, width],
                                          smem.index(0).reshape([1, 1, rows, width]).layout)
    else:
        desc = tma.make_tensor_descriptor(ptr, [n_hz, n_ctx, COLS],
                                          [n_ctx * COLS, COLS, 1], [1, rows, width],
                                          smem.index(0).reshape([1, rows, width]).layout)
    return desc


@gluon.jit
def _box(hz, row, buf, view, STRIDED: gl.constexpr):
    # _descriptor's coordinates of the rows from `row` of head hz (in [batch * heads]), and buf
    # shaped as its box
    if STRIDED:
        heads = view[0]
        coords = [hz // heads, hz % heads, row, 0]
        box = buf.reshape([1, 1, buf.shape[0], buf.shape[1]])
    else:
        coords = [hz, row, 0]
        box = buf.reshape([1, buf.shape[0], buf.shape[1]])
    return coords, box


@gluon.jit
def _load(desc, hz, row, bar, buf, view, STRIDED: gl.constexpr):
    # Rows from `row` of head hz (in [batch * heads]) of _descriptor's view into buf.
    coords, box = _box(hz, row, buf, view, STRIDED)
    tma_load(desc, coords, bar, box)


@gluon.jit
def _program_tile(n_pairs, NUM_TILES, HEAD_GROUP, LONGEST_LAST: gl.constexpr):
    # This program's (head, tile) of a 1-D grid in _grouped_tile's order: heads in groups of
    # HEAD_GROUP whose streamed tensors fit in L2 together, so the programs running at once read
    # them from L2 instead of each streaming its own head's from memory; within a group the
    # longest tiles first (the last query tiles for dQ, LONGEST_LAST; the first key blocks for
    # dK/dV under a causal mask).
    hz, m = _grouped_tile(gl.program_id(0), n_pairs, NUM_TILES, HEAD_GROUP)
    if not LONGEST_LAST:
        m = NUM_TILES - 1 - m
    return hz, m


@gluon.jit
def _store(desc, hz, row, buf, view, STRIDED: gl.constexpr):
    # buf into rows from `row` of head hz of _descriptor's view (rows past the end dropped).
    coords, box = _box(hz, row, buf, view, STRIDED)
    tma_store(desc, coords, box)


@gluon.jit
def _query_blocks(n0, N_CTX_Q, vis, CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr,
                  BLOCK_M: gl.constexpr):
    # The query blocks that see any key of the program's [n0, n0 + 2 * ROWS): [lo, hi) in blocks
    # of BLOCK_M rows. Under a causal bound the first is the row that sees key n0; under a
    # window the last is the row that still sees the last key (key j counts for query i when
    # j >= i + LEFT_OFFSET), so the query blocks left of the window are never streamed.
    CAUSAL_OFFSET, LEFT_OFFSET = vis
    if CAUSAL:
        first = gl.maximum(n0 - CAUSAL_OFFSET, 0)
        lo = gl.minimum(first, N_CTX_Q) // BLOCK_M
    else:
        lo = 0
    if HAS_WINDOW:
        last = gl.minimum(gl.maximum(n0 + 2 * ROWS - LEFT_OFFSET, 0), N_CTX_Q)
        hi = gl.cdiv(last, BLOCK_M)
    else:
        hi = gl.cdiv(N_CTX_Q, BLOCK_M)
    return lo, hi


@gluon.constexpr_function
def _chunks(COLS, HEAD_DIM):
    # how many wgmma groups _over_columns issues: one over the whole tile, or over 64 + 16,
    # 64 + 32 and 64 + 32 + 16 of a 128-column tile's columns (the only split it knows)
    if COLS == HEAD_DIM:
        return 1
    if HEAD_DIM != 128 or COLS not in (80, 96, 112):
        raise ValueError(f"_over_columns takes 80, 96 or 112 of 128 columns, not {COLS} of "
                         f"{HEAD_DIM}")
    return 1 + (COLS - 64) // 32 + (COLS - 64) % 32 // 16


@gluon.constexpr_function
def _first_width(COLS, HEAD_DIM):
    # the columns of the first accumulator of dK, dV or dQ: the tile's, or 64 where the head's
    # rest fits a second one of at most 32 columns (80 = 64 + 16, 96 = 64 + 32)
    if COLS == HEAD_DIM or COLS - 64 > 32:
        return HEAD_DIM
    return 64


@gluon.constexpr_function
def _rest_width(COLS, HEAD_DIM):
    # the second accumulator's columns (0: none)
    if COLS == HEAD_DIM or COLS - 64 > 32:
        return 0
    return 16 if COLS - 64 <= 16 else 32


@gluon.constexpr_function
def _mma_layout(width):
    # a consumer warpgroup's wgmma result of `width` columns (4 warps, 64 rows)
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                     instr_shape=[16, width, 16])


@gluon.constexpr_function
def _a_layout(width):
    # the register operand of a wgmma whose result is _mma_layout(width)
    return gl.DotOperandLayout(operand_index=0, parent=_mma_layout(width), k_width=2)


@gluon.jit
def _mma_parts(a, b, acc, acc1, W0: gl.constexpr, REST: gl.constexpr):
    # acc += a b[:, :W0] and acc1 += a b[:, W0:W0 + REST] (a in registers, b in shared memory):
    # a gradient as its two accumulators at 80 and 96 (_first_width, _rest_width). Issued, not
    # waited for.
    acc = warpgroup_mma(gl.convert_layout(a, _a_layout(W0)), b.slice(0, W0, dim=1), acc,
                        is_async=True)
    acc1 = warpgroup_mma(gl.convert_layout(a, _a_layout(REST)), b.slice(W0, REST, dim=1), acc1,
                         is_async=True)
    return acc, acc1


@gluon.jit
def _stage_parts(buf, acc, acc1, W0: gl.constexpr, REST: gl.constexpr):
    # a gradient's two accumulators into their columns of the tile buf (the tile's columns past
    # the head's are the copy engine's to drop)
    buf.slice(0, W0, dim=1).store(acc.to(buf.dtype))
    buf.slice(W0, REST, dim=1).store(acc1.to(buf.dtype))


@gluon.jit
def _over_columns(a, b, acc, COLS: gl.constexpr, HEAD_DIM: gl.constexpr):
    # a b^T for a [rows, HEAD_DIM] and b [n, HEAD_DIM] in shared memory (the head's columns
    # along both rows), over their first COLS columns only: past them the copy engine read zeros
    # (a head_dim padded to its TILE), so at 80, 96 and 112 the product is chained over 64 + 16,
    # 64 + 32 and 64 + 32 + 16 columns instead of 128. Issued, not waited for: _chunks groups.
    if COLS == HEAD_DIM:
        out = warpgroup_mma(a, b.permute((1, 0)), acc, use_acc=False, is_async=True)
    else:
        out = warpgroup_mma(a.slice(0, 64, dim=1), b.slice(0, 64, dim=1).permute((1, 0)), acc,
                            use_acc=False, is_async=True)
        if COLS - 64 >= 32:
            out = warpgroup_mma(a.slice(64, 32, dim=1), b.slice(64, 32, dim=1).permute((1, 0)),
                                out, is_async=True)
        if (COLS - 64) % 32 == 16:
            out = warpgroup_mma(a.slice(COLS - 16, 16, dim=1),
                                b.slice(COLS - 16, 16, dim=1).permute((1, 0)), out,
                                is_async=True)
    return out


@gluon.jit
def _seen(keys, queries, vis, CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr):
    # Whether key j counts for query i, keys and queries broadcast against each other: j <= i +
    # CAUSAL_OFFSET under a causal bound, j >= i + LEFT_OFFSET under a window.
    CAUSAL_OFFSET, LEFT_OFFSET = vis
    if CAUSAL:
        seen = keys <= queries + CAUSAL_OFFSET
        if HAS_WINDOW:
            seen = seen & (keys >= queries + LEFT_OFFSET)
    else:
        seen = keys >= queries + LEFT_OFFSET
    return seen


@gluon.jit
def _probabilities(s, lse, qk_scale, softcap_log2, SOFTCAP: gl.constexpr):
    # P = exp2(logits - LSE) from the raw scores, LSE broadcast along them (log2 units), and the
    # softcap's derivative: with SOFTCAP the logits are softcap * tanh(scale * s / softcap) as
    # the Gluon forward computes them (its _tanh_exp2, qk_scale the argument's factor), and
    # dS takes 1 - tanh^2 (the chain rule through the cap); without, 1 (a constant).
    if SOFTCAP:
        t = _tanh_exp2(s * qk_scale)
        return gl.exp2(t * softcap_log2 - lse), 1.0 - t * t
    else:
        return gl.exp2(s * qk_scale - lse), 1.0


@gluon.jit
def _key_block(GROUP, n_hz, NUM_TILES, HEAD_GROUP):
    # A dK/dV program's (batch * K/V head) index and its first key.
    off_hkvz, n = _program_tile(n_hz // GROUP, NUM_TILES, HEAD_GROUP, False)
    return off_hkvz, n * (2 * ROWS)


@gluon.jit
def _query_head(off_hkvz, H, GROUP, g):
    # The index in [batch * H] of query head g of those that share K/V head off_hkvz.
    h_kv = H // GROUP
    return (off_hkvz // h_kv) * H + (off_hkvz % h_kv) * GROUP + g


@gluon.jit
def _loader(args, HEAD_DIM: gl.constexpr, COLS: gl.constexpr, STAGES: gl.constexpr,
            CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr, FUSED: gl.constexpr,
            BLOCK_M: gl.constexpr, STRIDED: gl.constexpr):
    (Q, K, V, DO, k_smem, v_smem, q_smem, do_smem, kv_ready, ready, empty, H, GROUP, N_CTX_Q,
     N_CTX_K, vis, n_hz, NUM_TILES, HEAD_GROUP, Lse, Delta, lse_smem, delta_smem,
     views, DK, DV, staged) = args
    q_view, k_view, v_view, do_view, dk_view, dv_view = views
    hz_kv, n0 = _key_block(GROUP, n_hz, NUM_TILES, HEAD_GROUP)
    q_desc = _descriptor(Q, n_hz, N_CTX_Q, COLS, q_smem, q_view, STRIDED)
    do_desc = _descriptor(DO, n_hz, N_CTX_Q, COLS, do_smem, do_view, STRIDED)
    k_desc = _descriptor(K, n_hz // GROUP, N_CTX_K, COLS, k_smem, k_view, STRIDED)
    v_desc = _descriptor(V, n_hz // GROUP, N_CTX_K, COLS, v_smem, v_view, STRIDED)
    elem: gl.constexpr = Q.dtype.element_ty.primitive_bitwidth // 8
    block_bytes: gl.constexpr = ROWS * HEAD_DIM * elem
    q_bytes: gl.constexpr = BLOCK_M * HEAD_DIM * elem
    # the program's keys, once: each consumer's 64 rows of K and of V
    mbarrier.expect(kv_ready, 4 * block_bytes)
    for wg in gl.static_range(2):
        _load(k_desc, hz_kv, n0 + wg * ROWS, kv_ready, k_smem.index(wg), k_view, STRIDED)
        _load(v_desc, hz_kv, n0 + wg * ROWS, kv_ready, v_smem.index(wg), v_view, STRIDED)
    lo, hi = _query_blocks(n0, N_CTX_Q, vis, CAUSAL, HAS_WINDOW, BLOCK_M)
    it = 0
    for g in range(GROUP):
        hz = _query_head(hz_kv, H, GROUP, g)
        for m in range(lo, hi):
            slot = it % STAGES
            # a fresh mbarrier is in phase 0: the first wait for parity 1 passes at once
            mbarrier.wait(empty.index(slot), ((it // STAGES) & 1) ^ 1)
            # Q and dO by the copy engine first, then the block's LSE (log2 units; +inf for a
            # row that sees no key or past the end, so its P is 0) and Delta (0 past the end)
            # through this warp's loads and stores, which the arrival of `expect` releases to
            # the consumers. (The copies may land before `expect` adds their bytes: the
            # barrier's byte count goes below zero meanwhile, and its phase cannot complete
            # before the arrival.)
            _load(q_desc, hz, m * BLOCK_M, ready.index(slot), q_smem.index(slot), q_view,
                  STRIDED)
            _load(do_desc, hz, m * BLOCK_M, ready.index(slot), do_smem.index(slot), do_view,
                  STRIDED)
            _stage_stats(Lse, Delta, lse_smem.index(slot), delta_smem.index(slot), hz,
                         m * BLOCK_M, N_CTX_Q, BLOCK_M)
            mbarrier.expect(ready.index(slot), 2 * q_bytes)
            it += 1
    if not FUSED:
        n_kv = n_hz // GROUP
        _store_staged(DK, DV, k_smem, v_smem, n_kv, N_CTX_K, hz_kv, n0, staged, dk_view, dv_view,
                      COLS, STRIDED)


@gluon.jit
def _store_staged(A, B, a_smem, b_smem, n_hz, n_ctx, hz, row0, staged, a_view, b_view,
                  COLS: gl.constexpr, STRIDED: gl.constexpr):
    # The loader, done loading: both consumers' gradient tiles (each warpgroup's rows of A in
    # a_smem.index(wg), of B in b_smem.index(wg); B None for one tensor), staged once
    # `staged` completes, stored by the copy engine from row row0 of head hz (rows past the end
    # dropped). Its descriptors are made while the consumers finish (each is written to global
    # memory and fenced: made by the consumers, they delayed the program's end).
    a_desc = _descriptor(A, n_hz, n_ctx, COLS, a_smem, a_view, STRIDED)
    if B is not None:
        b_desc = _descriptor(B, n_hz, n_ctx, COLS, b_smem, b_view, STRIDED)
    mbarrier.wait(staged, 0)
    for wg in gl.static_range(2):
        _store(a_desc, hz, row0 + wg * ROWS, a_smem.index(wg), a_view, STRIDED)
        if B is not None:
            _store(b_desc, hz, row0 + wg * ROWS, b_smem.index(wg), b_view, STRIDED)
    tma.store_wait(0)


@gluon.jit
def _stage_stats(Lse, Delta, lse_buf, delta_buf, hz, row0, N_CTX_Q, BLOCK_M: gl.constexpr):
    # One warp: LSE and Delta of query rows [row0, row0 + BLOCK_M) of head hz into shared memory.
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    rows = row0 + gl.arange(0, BLOCK_M, layout=layout)
    ok = rows < N_CTX_Q
    at = hz.to(gl.int64) * N_CTX_Q + rows
    lse = gl.load(Lse + at, mask=ok, other=float("-inf"))
    lse_buf.store(gl.where(lse == float("-inf"), float("inf"), lse * LOG2E_G))
    delta_buf.store(gl.load(Delta + at, mask=ok, other=0.0))
    partition_barrier()  # every lane's stores before the one thread's arrival that releases them


@gluon.jit
def _consumer(args, fused, WG: gl.constexpr, HEAD_DIM: gl.constexpr, COLS: gl.constexpr,
              STAGES: gl.constexpr, CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr,
              SOFTCAP: gl.constexpr, FUSED: gl.constexpr, BLOCK_M: gl.constexpr,
              STRIDED: gl.constexpr):
    (k_smem, v_smem, q_smem, do_smem, kv_ready, ready, empty, staged, DK, DV, lse_smem,
     delta_smem, H, GROUP, N_CTX_Q, N_CTX_K, vis, qk_scale, softcap_log2, sm_scale, n_hz,
     NUM_TILES, HEAD_GROUP, views) = args
    CAUSAL_OFFSET, LEFT_OFFSET = vis
    if FUSED:
        ds_smem, dq_smem, ds_ready, dq_full, dq_empty, kv_done = fused
    hz_kv, n0 = _key_block(GROUP, n_hz, NUM_TILES, HEAD_GROUP)
    k0 = n0 + WG * ROWS  # this warpgroup's first key
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = _mma_layout(BLOCK_M)
    # dK and dV as one accumulator of the tile's columns, or at 80 and 96 two: the head's first
    # 64 columns and its rest (REST, 16 or 32), so the products skip the tile's padding
    W0: gl.constexpr = _first_width(COLS, HEAD_DIM)
    REST: gl.constexpr = _rest_width(COLS, HEAD_DIM)
    acc_layout: gl.constexpr = _mma_layout(W0)
    a_layout: gl.constexpr = _a_layout(W0)
    keys = k0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    k_tile = k_smem.index(WG)
    v_tile = v_smem.index(WG)
    s_zero = gl.zeros([ROWS, BLOCK_M], gl.float32, s_layout)
    dk = gl.zeros([ROWS, W0], gl.float32, acc_layout)
    dv = gl.zeros([ROWS, W0], gl.float32, acc_layout)
    if REST > 0:
        dk1 = gl.zeros([ROWS, REST], gl.float32, _mma_layout(REST))
        dv1 = gl.zeros([ROWS, REST], gl.float32, _mma_layout(REST))
    mbarrier.wait(kv_ready, 0)
    lo, hi = _query_blocks(n0, N_CTX_Q, vis, CAUSAL, HAS_WINDOW, BLOCK_M)
    it = 0
    for g in range(GROUP):  # the query heads that share this K/V head (their LSE and Delta
        # come staged by the loader, which knows the head)
        for m in range(lo, hi):
            slot = it % STAGES
            mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
            q = q_smem.index(slot)
            do = do_smem.index(slot)
            # S^T = K Q^T and dP^T = V dO^T, [keys, queries]
            s_tok = _over_columns(k_tile, q, s_zero, COLS, HEAD_DIM)
            dp_tok = _over_columns(v_tile, do, s_zero, COLS, HEAD_DIM)
            # Each query's LSE and Delta come from shared memory (the loader's, _stage_stats)
            # along the columns. Read after S^T's wait, the LSE load queues behind the products'
            # operand reads and P's first FFMA waits on it: FUSED reads it before (-1.9 % and
            # -2.4 % at head_dim 128, notes/lab/bwd_lse_early_h200.txt). The split kernel reads
            # it after the wait: read early, it took 0.5 % and 1.2 % more. Delta is read where
            # it is used, so it is not held through the products.
            if FUSED:
                lse = lse_smem.index(slot).load(gl.SliceLayout(0, s_layout))
            cols = m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
            # S^T alone: P's exponentials run while dP^T's product does. (dP^T's chain has as
            # many groups as S^T's: waiting until that many are left in flight waits for S^T.)
            s_t = warpgroup_mma_wait(_chunks(COLS, HEAD_DIM), deps=[s_tok])
            if not FUSED:
                lse = lse_smem.index(slot).load(gl.SliceLayout(0, s_layout))
            p_t, d_cap = _probabilities(s_t, gl.expand_dims(lse, 0), qk_scale, softcap_log2,
                                        SOFTCAP)
            # Every query of the block sees every key of this warpgroup (_seen) when its first
            # row sees the last key (m * BLOCK_M + CAUSAL_OFFSET >= k0 + ROWS - 1) and its last
            # row the first (m * BLOCK_M + BLOCK_M - 1 + LEFT_OFFSET <= k0); the rest is masked.
            # FUSED masks the keys past the end too: their P is 2^-LSE (K's zero rows), which
            # can overflow in the inputs' dtype (fp16 from LSE < ~-11), and dS^T meets those
            # zero rows in dQ's product, where inf x 0 is NaN.
            MASKS: gl.constexpr = CAUSAL or HAS_WINDOW
            if CAUSAL:
                partial = m * BLOCK_M + CAUSAL_OFFSET < k0 + ROWS - 1
                if HAS_WINDOW:
                    partial = partial | (m * BLOCK_M + BLOCK_M - 1 + LEFT_OFFSET > k0)
            elif HAS_WINDOW:
                partial = m * BLOCK_M + BLOCK_M - 1 + LEFT_OFFSET > k0
            if FUSED:
                ragged = k0 + ROWS > N_CTX_K
                partial = (partial | ragged) if MASKS else ragged
            if MASKS or FUSED:
                if partial:
                    if MASKS:
                        seen = _seen(gl.expand_dims(keys, 1), gl.expand_dims(cols, 0), vis,
                                     CAUSAL, HAS_WINDOW)
                        if FUSED:
                            seen = seen & gl.expand_dims(keys < N_CTX_K, 1)
                    else:
                        seen = gl.expand_dims(keys < N_CTX_K, 1)
                    p_t = gl.where(seen, p_t, 0.0)
            # P^T in the inputs' dtype, dV's operand, made before dP^T's wait; with SOFTCAP
            # p_t then becomes P^T * (1 - tanh^2), dS^T's factor, so that the derivative's tile
            # is not held through the wait (offline, Triton 3.6, head_dim 128: 144 bytes of
            # stack a thread, 160 with both tiles held)
            p_op = p_t.to(dtype)
            if SOFTCAP:
                p_t = p_t * d_cap
            dp_t = warpgroup_mma_wait(0, deps=[dp_tok])
            delta = delta_smem.index(slot).load(gl.SliceLayout(0, s_layout))
            ds_t = p_t * (dp_t - gl.expand_dims(delta, 0))
            # dV += P^T dO, dK += dS^T Q
            if FUSED:  # dS^T through shared memory, where dQ needs both warpgroups'
                buf = it % 2
                ds_own = ds_smem.index(2 * buf + WG)
                ds_own.store(ds_t.to(dtype))
                fence_async_shared()
                dv = warpgroup_mma(gl.convert_layout(p_op, a_layout), do, dv,
                                   is_async=True)
                dk = warpgroup_mma(gl.convert_layout(ds_t.to(dtype), a_layout), q, dk,
                                   is_async=True)
                # dQ[queries, this warpgroup's 64 columns] = dS K[:, columns], from both
                # warpgroups' dS^T (keys along rows) read transposed; two steps deep, so a
                # warpgroup writes a buffer again only after the other's product read it
                mbarrier.arrive(ds_ready.index(buf))
                mbarrier.wait(ds_ready.index(buf), (it // 2) & 1)
                dq = warpgroup_mma(ds_smem.index(2 * buf).permute((1, 0)),
                                   k_smem.index(0).slice(WG * ROWS, ROWS, dim=1), s_zero,
                                   use_acc=False, is_async=True)
                dq = warpgroup_mma(ds_smem.index(2 * buf + 1).permute((1, 0)),
                                   k_smem.index(1).slice(WG * ROWS, ROWS, dim=1), dq,
                                   is_async=True)
                dv, dk, dq = warpgroup_mma_wait(0, deps=[dv, dk, dq])
                mbarrier.arrive(empty.index(slot))
                # to the dQ writer (_dq_writer) through this warpgroup's half of its tile
                mbarrier.wait(dq_empty, (it & 1) ^ 1)
                dq_smem.index(WG).store(dq)
                fence_async_shared()
                mbarrier.arrive(dq_full)
            elif REST > 0:
                dv, dv1 = _mma_parts(p_op, do, dv, dv1, W0, REST)
                dk, dk1 = _mma_parts(ds_t.to(dtype), q, dk, dk1, W0, REST)
                dv, dv1, dk, dk1 = warpgroup_mma_wait(0, deps=[dv, dv1, dk, dk1])
                mbarrier.arrive(empty.index(slot))
            else:
                dv = warpgroup_mma(gl.convert_layout(p_op, a_layout), do, dv,
                                   is_async=True)
                dk = warpgroup_mma(gl.convert_layout(ds_t.to(dtype), a_layout), q, dk,
                                   is_async=True)
                dv, dk = warpgroup_mma_wait(0, deps=[dv, dk])
                mbarrier.arrive(empty.index(slot))
            it += 1
    if FUSED:  # the other warpgroup's last dQ product reads this one's K tile, which stages dK
        mbarrier.arrive(kv_done)
        mbarrier.wait(kv_done, 0)
    # dS was taken w.r.t. the scaled scores: the chain rule puts the scale on dK. This warpgroup's
    # K and V tiles are no longer read (its last wgmma has retired): they stage dK and dV for
    # the copy engine, which drops the rows past the keys' end: stored by the loader in the split
    # kernel (_store_staged), by this warpgroup in the fused one (the loader's stores measured
    # 4-6 % slower there: notes/lab/bwd_loader_stores_h200.txt).
    if REST > 0:
        _stage_parts(k_tile, dk * sm_scale, dk1 * sm_scale, W0, REST)
        _stage_parts(v_tile, dv, dv1, W0, REST)
    else:
        k_tile.store((dk * sm_scale).to(dtype))
        v_tile.store(dv.to(dtype))
    fence_async_shared()
    if FUSED:
        n_kv = n_hz // GROUP
        dk_view, dv_view = views[4], views[5]
        _store(_descriptor(DK, n_kv, N_CTX_K, COLS, k_smem, dk_view, STRIDED), hz_kv, k0,
               k_tile, dk_view, STRIDED)
        _store(_descriptor(DV, n_kv, N_CTX_K, COLS, v_smem, dv_view, STRIDED), hz_kv, k0,
               v_tile, dv_view, STRIDED)
        tma.store_wait(0)
    else:
        mbarrier.arrive(staged)


@gluon.jit
def _dq_writer(args, fused, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr,
               HAS_WINDOW: gl.constexpr):
    # One warp: each step's dQ tile (both consumers' 64-column halves) added into the fp32
    # buffer DQ by the copy engine's reduce-add, which drops rows past the end. Programs add to
    # a query block in whatever order they run: the fp32 sums are not reproducible bit for bit.
    (DQ, H, GROUP, N_CTX_Q, vis, n_hz, NUM_TILES, HEAD_GROUP) = args
    ds_smem, dq_smem, ds_ready, dq_full, dq_empty, kv_done = fused
    hz_kv, n0 = _key_block(GROUP, n_hz, NUM_TILES, HEAD_GROUP)
    # DQ [batch * H, N_CTX_Q, HEAD_DIM] fp32 in [1, ROWS, ROWS] tiles
    dq_desc = tma.make_tensor_descriptor(DQ, [n_hz, N_CTX_Q, HEAD_DIM],
                                         [N_CTX_Q * HEAD_DIM, HEAD_DIM, 1], [1, ROWS, ROWS],
                                         dq_smem.index(0).reshape([1, ROWS, ROWS]).layout)
    lo, hi = _query_blocks(n0, N_CTX_Q, vis, CAUSAL, HAS_WINDOW, ROWS)  # (FUSED: BLOCK_M == ROWS)
    it = 0
    for g in range(GROUP):
        hz = _query_head(hz_kv, H, GROUP, g)
        for m in range(lo, hi):
            mbarrier.wait(dq_full, it & 1)
            for wg in gl.static_range(2):
                tma_add(dq_desc, [hz, m * ROWS, wg * ROWS],
                        dq_smem.index(wg).reshape([1, ROWS, ROWS]))
            tma.store_wait(0)  # the adds have read the tile: the consumers may write the next
            mbarrier.arrive(dq_empty)
            it += 1


@gluon.jit
def _fused_buffers(dtype: gl.constexpr, DS_LAYOUT: gl.constexpr, DQ_LAYOUT: gl.constexpr):
    # The fused dQ's shared memory: both warpgroups' dS^T two steps deep ([step * 2 +
    # warpgroup, keys, queries]), the dQ tile's two halves on their way to the writer, and
    # their mbarriers (both dS^T in; both halves in; the writer done with them; both warpgroups
    # done with the K tiles).
    ds_smem = gl.allocate_shared_memory(dtype, [4, ROWS, ROWS], DS_LAYOUT)
    dq_smem = gl.allocate_shared_memory(gl.float32, [2, ROWS, ROWS], DQ_LAYOUT)
    layout: gl.constexpr = mbarrier.MBarrierLayout()
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], layout)
    dq_full = gl.allocate_shared_memory(gl.int64, [1], layout)
    dq_empty = gl.allocate_shared_memory(gl.int64, [1], layout)
    kv_done = gl.allocate_shared_memory(gl.int64, [1], layout)
    for i in gl.static_range(2):
        mbarrier.init(ds_ready.index(i), count=2)
    mbarrier.init(dq_full, count=2)
    mbarrier.init(dq_empty, count=1)
    mbarrier.init(kv_done, count=2)
    fence_async_shared()
    return ds_smem, dq_smem, ds_ready, dq_full, dq_empty, kv_done


@gluon.jit
def _barriers(STAGES: gl.constexpr):
    # Both kernels' mbarriers: one for the tiles a program loads once (the copy engine's
    # bytes), per stage of the streamed ring "ready" (the copy engine's bytes) and "empty"
    # (one arrival per consumer warpgroup), and "staged" (both consumers' gradients staged in
    # shared memory for the loader to store; unused by the fused kernel); initialised and fenced.
    layout: gl.constexpr = mbarrier.MBarrierLayout()
    once = gl.allocate_shared_memory(gl.int64, [1], layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], layout)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], layout)
    staged = gl.allocate_shared_memory(gl.int64, [1], layout)
    mbarrier.init(once, count=1)
    mbarrier.init(staged, count=2)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    fence_async_shared()
    return once, ready, empty, staged


@gluon.jit
def _attn_bwd_dkdv_hopper(Q, K, V, DO, DK, DV, Lse, Delta, DQ, BATCH, H, GROUP, N_CTX_Q,
                          N_CTX_K, CAUSAL_OFFSET, LEFT_OFFSET, qk_scale, softcap_log2, sm_scale,
                          NUM_TILES, HEAD_GROUP,
                          stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_km,
                          stride_vz, stride_vh, stride_vm, stride_doz, stride_doh, stride_dom,
                          stride_dkz, stride_dkh, stride_dkm, stride_dvz, stride_dvh, stride_dvm,
                          STRIDED: gl.constexpr, HEAD_DIM: gl.constexpr, COLS: gl.constexpr,
                          STAGES: gl.constexpr, CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr,
                          SOFTCAP: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                          SMEM_LAYOUT: gl.constexpr, FUSED: gl.constexpr,
                          DS_LAYOUT: gl.constexpr, DQ_LAYOUT: gl.constexpr,
                          BLOCK_M: gl.constexpr, Q_LAYOUT: gl.constexpr):
    # grid: batch * K/V heads * key blocks of 2 * ROWS (_program_tile); q, dO, LSE and Delta
    # [batch * H, ...], streamed in blocks of BLOCK_M query rows. FUSED (BLOCK_M == ROWS): dQ =
    # dS K (before its scale) added into DQ as well, a zeroed fp32 [batch * H, N_CTX_Q,
    # HEAD_DIM] (unused otherwise), by a fourth partition. HEAD_DIM: the tiles' columns, COLS the
    # tensors' (fewer where a head_dim is padded to its tile: the copy engine reads zeros past
    # COLS and drops those columns of the stores). The strides (each tensor's batch,
    # head and row strides) are read with STRIDED only (_descriptor). CAUSAL, HAS_WINDOW (with
    # their offsets) and SOFTCAP (with qk_scale and softcap_log2) as common.visibility and
    # common.score_scales give them.
    gl.static_assert(not FUSED or (BLOCK_M == ROWS and HEAD_DIM == 2 * ROWS and COLS == HEAD_DIM),
                     "the fused dQ takes head_dim 128 in 64-row query blocks")
    qk_scale = qk_scale.to(gl.float32)  # (scale * log2e without a softcap)
    softcap_log2 = softcap_log2.to(gl.float32)
    sm_scale = sm_scale.to(gl.float32)
    vis = (CAUSAL_OFFSET, LEFT_OFFSET)
    dtype: gl.constexpr = Q.dtype.element_ty
    k_smem = gl.allocate_shared_memory(dtype, [2, ROWS, HEAD_DIM], SMEM_LAYOUT)
    v_smem = gl.allocate_shared_memory(dtype, [2, ROWS, HEAD_DIM], SMEM_LAYOUT)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], Q_LAYOUT)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], Q_LAYOUT)
    stat_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], stat_layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], stat_layout)
    kv_ready, ready, empty, staged = _barriers(STAGES)
    n_hz = BATCH * H
    h_kv = H // GROUP
    views = ((H, stride_qz, stride_qh, stride_qm), (h_kv, stride_kz, stride_kh, stride_km),
             (h_kv, stride_vz, stride_vh, stride_vm), (H, stride_doz, stride_doh, stride_dom),
             (h_kv, stride_dkz, stride_dkh, stride_dkm), (h_kv, stride_dvz, stride_dvh, stride_dvm))
    loads = (Q, K, V, DO, k_smem, v_smem, q_smem, do_smem, kv_ready, ready, empty, H, GROUP,
             N_CTX_Q, N_CTX_K, vis, n_hz, NUM_TILES, HEAD_GROUP, Lse, Delta, lse_smem,
             delta_smem, views, DK, DV, staged)
    work = (k_smem, v_smem, q_smem, do_smem, kv_ready, ready, empty, staged, DK, DV, lse_smem,
            delta_smem, H, GROUP, N_CTX_Q, N_CTX_K, vis, qk_scale, softcap_log2, sm_scale, n_hz,
            NUM_TILES, HEAD_GROUP, views)
    if FUSED:
        fused = _fused_buffers(dtype, DS_LAYOUT, DQ_LAYOUT)
        writes = (DQ, H, GROUP, N_CTX_Q, vis, n_hz, NUM_TILES, HEAD_GROUP)
        gl.warp_specialize([
            (_consumer, (work, fused, 0, HEAD_DIM, COLS, STAGES, CAUSAL, HAS_WINDOW, SOFTCAP, FUSED,
                         BLOCK_M, STRIDED)),
            (_consumer, (work, fused, 1, HEAD_DIM, COLS, STAGES, CAUSAL, HAS_WINDOW, SOFTCAP, FUSED,
                         BLOCK_M, STRIDED)),
            (_loader, (loads, HEAD_DIM, COLS, STAGES, CAUSAL, HAS_WINDOW, FUSED, BLOCK_M,
                       STRIDED)),
            (_dq_writer, (writes, fused, HEAD_DIM, CAUSAL, HAS_WINDOW)),
        ], [4, 1, 1], [CONSUMER_REGS, 32, 32])
    else:
        gl.warp_specialize([
            (_consumer, (work, None, 0, HEAD_DIM, COLS, STAGES, CAUSAL, HAS_WINDOW, SOFTCAP, FUSED,
                         BLOCK_M, STRIDED)),
            (_consumer, (work, None, 1, HEAD_DIM, COLS, STAGES, CAUSAL, HAS_WINDOW, SOFTCAP, FUSED,
                         BLOCK_M, STRIDED)),
            (_loader, (loads, HEAD_DIM, COLS, STAGES, CAUSAL, HAS_WINDOW, FUSED, BLOCK_M,
                       STRIDED)),
        ], [4, 1], [CONSUMER_REGS, 32])


# ---- dQ ---------------------------------------------------------------------------------------

@gluon.jit
def _dq_loader(args, HEAD_DIM: gl.constexpr, COLS: gl.constexpr, BLOCK_N: gl.constexpr,
               STAGES: gl.constexpr, CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr,
               STRIDED: gl.constexpr):
    (Q, K, V, DO, q_smem, do_smem, k_smem, v_smem, qdo_ready, ready, empty, H, GROUP, N_CTX_Q,
     N_CTX_K, vis, n_hz, NUM_TILES, HEAD_GROUP, views, DQ, staged) = args
    q_view, k_view, v_view, do_view, dq_view = views
    hz, m = _program_tile(n_hz, NUM_TILES, HEAD_GROUP, True)
    m0 = m * (2 * ROWS)
    hz_kv = hz // GROUP
    q_desc = _descriptor(Q, n_hz, N_CTX_Q, COLS, q_smem, q_view, STRIDED)
    do_desc = _descriptor(DO, n_hz, N_CTX_Q, COLS, do_smem, do_view, STRIDED)
    k_desc = _descriptor(K, n_hz // GROUP, N_CTX_K, COLS, k_smem, k_view, STRIDED)
    v_desc = _descriptor(V, n_hz // GROUP, N_CTX_K, COLS, v_smem, v_view, STRIDED)
    elem: gl.constexpr = Q.dtype.element_ty.primitive_bitwidth // 8
    # the tile's rows, once: each consumer's 64 rows of Q and of dO
    mbarrier.expect(qdo_ready, 4 * ROWS * HEAD_DIM * elem)
    for wg in gl.static_range(2):
        _load(q_desc, hz, m0 + wg * ROWS, qdo_ready, q_smem.index(wg), q_view, STRIDED)
        _load(do_desc, hz, m0 + wg * ROWS, qdo_ready, do_smem.index(wg), do_view, STRIDED)
    lo, hi = _key_blocks(m0, N_CTX_K, vis, CAUSAL, HAS_WINDOW, BLOCK_N)
    for j in range(lo, hi):
        i = j - lo
        slot = i % STAGES
        mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(slot), 2 * BLOCK_N * HEAD_DIM * elem)
        _load(k_desc, hz_kv, j * BLOCK_N, ready.index(slot), k_smem.index(slot), k_view,
              STRIDED)
        _load(v_desc, hz_kv, j * BLOCK_N, ready.index(slot), v_smem.index(slot), v_view,
              STRIDED)
    _store_staged(DQ, None, q_smem, q_smem, n_hz, N_CTX_Q, hz, m0, staged, dq_view, dq_view,
                  COLS, STRIDED)


@gluon.jit
def _key_blocks(m0, N_CTX_K, vis, CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr,
                BLOCK_N: gl.constexpr):
    # The K/V blocks a tile of 2 * ROWS query rows from m0 sees, [lo, hi): from the block of
    # the first key its first row sees (under a window; the blocks left of it are never
    # loaded) up to the key its last row sees.
    CAUSAL_OFFSET, LEFT_OFFSET = vis
    if CAUSAL:
        hi = gl.maximum(gl.minimum(m0 + 2 * ROWS + CAUSAL_OFFSET, N_CTX_K), 0)
    else:
        hi = N_CTX_K
    if HAS_WINDOW:
        lo = gl.minimum(gl.maximum(m0 + LEFT_OFFSET, 0), N_CTX_K) // BLOCK_N
    else:
        lo = 0
    return lo, gl.cdiv(hi, BLOCK_N)


@gluon.jit
def _dq_consumer(args, WG: gl.constexpr, HEAD_DIM: gl.constexpr, COLS: gl.constexpr,
                 BLOCK_N: gl.constexpr,
                 STAGES: gl.constexpr, CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr,
                 SOFTCAP: gl.constexpr):
    (q_smem, do_smem, k_smem, v_smem, qdo_ready, ready, empty, staged, Lse, Delta, H, N_CTX_Q,
     N_CTX_K, vis, qk_scale, softcap_log2, sm_scale, n_hz, NUM_TILES, HEAD_GROUP) = args
    CAUSAL_OFFSET, LEFT_OFFSET = vis
    hz, m = _program_tile(n_hz, NUM_TILES, HEAD_GROUP, True)
    m0 = m * (2 * ROWS)
    r0 = m0 + WG * ROWS  # this warpgroup's first query row
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = _mma_layout(BLOCK_N)
    W0: gl.constexpr = _first_width(COLS, HEAD_DIM)  # dQ's accumulators, as dK's and dV's
    REST: gl.constexpr = _rest_width(COLS, HEAD_DIM)
    acc_layout: gl.constexpr = _mma_layout(W0)
    a_layout: gl.constexpr = _a_layout(W0)
    rows = r0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    # each row's LSE (log2 units; +inf for a row that sees no key or past the end: P is 0
    # there) and Delta
    row_ok = rows < N_CTX_Q
    lse = gl.load(Lse + hz.to(gl.int64) * N_CTX_Q + rows, mask=row_ok, other=float("-inf"))
    lse = gl.where(lse == float("-inf"), float("inf"), lse * LOG2E_G)
    delta = gl.load(Delta + hz.to(gl.int64) * N_CTX_Q + rows, mask=row_ok, other=0.0)
    q = q_smem.index(WG)
    do = do_smem.index(WG)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    dq = gl.zeros([ROWS, W0], gl.float32, acc_layout)
    if REST > 0:
        dq1 = gl.zeros([ROWS, REST], gl.float32, _mma_layout(REST))
    # key blocks [first_full, full) every row of this warpgroup sees whole: no mask. Under a
    # window its last row sees keys from r0 + ROWS - 1 + LEFT_OFFSET on.
    if CAUSAL:
        full = gl.maximum(gl.minimum(r0 + CAUSAL_OFFSET + 1, N_CTX_K), 0) // BLOCK_N
    else:
        full = N_CTX_K // BLOCK_N
    if HAS_WINDOW:
        first_full = gl.cdiv(gl.maximum(r0 + ROWS - 1 + LEFT_OFFSET, 0), BLOCK_N)
    mbarrier.wait(qdo_ready, 0)
    lo, hi = _key_blocks(m0, N_CTX_K, vis, CAUSAL, HAS_WINDOW, BLOCK_N)
    for j in range(lo, hi):
        i = j - lo
        slot = i % STAGES
        mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
        k = k_smem.index(slot)
        # S = Q K^T and dP = dO V^T, [queries, keys]
        s_tok = _over_columns(q, k, s_zero, COLS, HEAD_DIM)
        dp_tok = _over_columns(do, v_smem.index(slot), s_zero, COLS, HEAD_DIM)
        # S alone: P's exponentials run under dP's (as many groups as S's, left in flight)
        s = warpgroup_mma_wait(_chunks(COLS, HEAD_DIM), deps=[s_tok])
        p, d_cap = _probabilities(s, gl.expand_dims(lse, 1), qk_scale, softcap_log2, SOFTCAP)
        # keys past the end (the copy engine's zeros) and keys a row does not see (_seen):
        # masked in the blocks from `full` on (under a causal bound, right of some row's
        # diagonal) and, under a window, before `first_full` (left of some row's edge)
        partial = j >= full
        if HAS_WINDOW:
            partial = partial | (j < first_full)
        if partial:
            keys = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            seen = gl.expand_dims(keys < N_CTX_K, 0)
            if CAUSAL or HAS_WINDOW:
                seen = seen & _seen(gl.expand_dims(keys, 0), gl.expand_dims(rows, 1), vis,
                                    CAUSAL, HAS_WINDOW)
            p = gl.where(seen, p, 0.0)
        dp = warpgroup_mma_wait(0, deps=[dp_tok])
        ds = p * (dp - gl.expand_dims(delta, 1))
        if SOFTCAP:
            ds = ds * d_cap
        # dQ += dS K
        if REST > 0:
            dq, dq1 = _mma_parts(ds.to(dtype), k, dq, dq1, W0, REST)
            dq, dq1 = warpgroup_mma_wait(0, deps=[dq, dq1])
        else:
            dq = warpgroup_mma(gl.convert_layout(ds.to(dtype), a_layout), k, dq, is_async=True)
            dq = warpgroup_mma_wait(0, deps=[dq])
        mbarrier.arrive(empty.index(slot))
    # dS was taken w.r.t. the scaled scores: the chain rule puts the scale on dQ. This warpgroup's
    # Q buffer is no longer read: it stages dQ for the loader's store (_store_staged).
    if REST > 0:
        _stage_parts(q, dq * sm_scale, dq1 * sm_scale, W0, REST)
    else:
        q.store((dq * sm_scale).to(dtype))
    fence_async_shared()
    mbarrier.arrive(staged)


@gluon.jit
def _attn_bwd_dq_hopper(Q, K, V, DO, DQ, Lse, Delta, BATCH, H, GROUP, N_CTX_Q, N_CTX_K,
                        CAUSAL_OFFSET, LEFT_OFFSET, qk_scale, softcap_log2, sm_scale, NUM_TILES,
                        HEAD_GROUP,
                        stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_km,
                        stride_vz, stride_vh, stride_vm, stride_doz, stride_doh, stride_dom,
                        stride_dqz, stride_dqh, stride_dqm, STRIDED: gl.constexpr,
                        HEAD_DIM: gl.constexpr, COLS: gl.constexpr, BLOCK_N: gl.constexpr,
                        STAGES: gl.constexpr, CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr,
                        SOFTCAP: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                        Q_LAYOUT: gl.constexpr, KV_LAYOUT: gl.constexpr):
    # grid: batch * H * query tiles of 2 * ROWS rows (_program_tile); the same structure as the
    # dK/dV kernel
    # with the roles of queries and keys exchanged: Q and dO stay, K and V stream
    qk_scale = qk_scale.to(gl.float32)
    softcap_log2 = softcap_log2.to(gl.float32)
    sm_scale = sm_scale.to(gl.float32)
    vis = (CAUSAL_OFFSET, LEFT_OFFSET)
    dtype: gl.constexpr = Q.dtype.element_ty
    q_smem = gl.allocate_shared_memory(dtype, [2, ROWS, HEAD_DIM], Q_LAYOUT)
    do_smem = gl.allocate_shared_memory(dtype, [2, ROWS, HEAD_DIM], Q_LAYOUT)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], KV_LAYOUT)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], KV_LAYOUT)
    qdo_ready, ready, empty, staged = _barriers(STAGES)
    n_hz = BATCH * H
    h_kv = H // GROUP
    views = ((H, stride_qz, stride_qh, stride_qm), (h_kv, stride_kz, stride_kh, stride_km),
             (h_kv, stride_vz, stride_vh, stride_vm), (H, stride_doz, stride_doh, stride_dom),
             (H, stride_dqz, stride_dqh, stride_dqm))
    loads = (Q, K, V, DO, q_smem, do_smem, k_smem, v_smem, qdo_ready, ready, empty, H, GROUP,
             N_CTX_Q, N_CTX_K, vis, n_hz, NUM_TILES, HEAD_GROUP, views, DQ, staged)
    work = (q_smem, do_smem, k_smem, v_smem, qdo_ready, ready, empty, staged, Lse, Delta, H,
            N_CTX_Q, N_CTX_K, vis, qk_scale, softcap_log2, sm_scale, n_hz, NUM_TILES,
            HEAD_GROUP)
    gl.warp_specialize([
        (_dq_consumer, (work, 0, HEAD_DIM, COLS, BLOCK_N, STAGES, CAUSAL, HAS_WINDOW, SOFTCAP)),
        (_dq_consumer, (work, 1, HEAD_DIM, COLS, BLOCK_N, STAGES, CAUSAL, HAS_WINDOW, SOFTCAP)),
        (_dq_loader, (loads, HEAD_DIM, COLS, BLOCK_N, STAGES, CAUSAL, HAS_WINDOW, STRIDED)),
    ], [4, 1], [CONSUMER_REGS, 32])


# (STAGES, consumer registers, BLOCK_M: query rows a streamed block) per head_dim: two stages;
# 240 registers. head_dim 128: dK and dV (64 + 64 fp32 a thread) next to S^T and dP^T (32 + 32)
# in 64-row query blocks (the fused dQ needs BLOCK_M == ROWS). head_dim 64: dK and dV take half
# as many, so S^T and dP^T take 128-row query blocks (FA4's tile at 64; 64 + 64; 64-row ones
# under a softcap, `dkdv_config`), each thread's LSE and Delta columns staged in shared memory by
# the loader, not in registers. Timed around
# these on the H200 (notes/lab/bwd_gluon_configs_h200.txt): three stages in either kernel,
# 128-key dQ blocks at 128 and 64-key ones at 64 were none of them faster.
CONFIGS = {64: (2, 240, 128), 128: (2, 240, 64)}
# The dQ kernel's (BLOCK_N, STAGES, consumer registers): S and dP of 64 keys (head_dim 128) or
# 128 (64) next to the dQ accumulator (64 fp32 registers a thread at head_dim 128, 32 at 64).
DQ_CONFIGS = {64: (128, 2, 240), 128: (64, 2, 240)}
# The tiles' columns (the kernels' HEAD_DIM, the key of CONFIGS and DQ_CONFIGS) per head_dim:
# 80, 96 and 112 run on head_dim 128's tiles and configs, the copy engine reading zeros past a
# head's columns (COLS) and dropping those columns of the stores, as the Triton backward pads
# to its BLOCK_D.
TILE = {64: 64, 80: 128, 96: 128, 112: 128, 128: 128}
# head_dim 64 takes these kernels from MIN_QUERIES queries on; below, the Triton pair is faster:
# a 128-key program then streams only a few query blocks and pays this pair's fixed costs (the
# partitions' start, the device-side descriptors) for them.
MIN_QUERIES = {64: 2049}
_GL_DTYPES = {"torch.float16": gl.float16, "torch.bfloat16": gl.bfloat16}


def dkdv_config(head_dim, softcap=0.0):
    """The dK/dV kernel's (STAGES, consumer registers, BLOCK_M) for a call: CONFIGS', in query
    blocks of at most 64 rows with a softcap. Its tanh tile is held next to S^T and dP^T there:
    at head_dim 64's 128-row blocks the kernel had 336 spill loads offline (Triton 3.6), at 64
    rows none."""
    stages, regs, block_m = CONFIGS[TILE[head_dim]]
    return stages, regs, (min(block_m, ROWS.value) if softcap > 0 else block_m)


def fuses_dq(head_dim):
    """Whether the dK/dV kernel can add dQ too (FUSED) at this head_dim: each consumer
    warpgroup multiplies dS by 64 of K's columns and the writer adds two 64-column halves, in
    the 64-row query blocks CONFIGS must stream there: head_dim 128."""
    return head_dim == 2 * ROWS.value and CONFIGS[head_dim][2] == ROWS.value


def supports(q, k, v, do, dq, dk, dv, window=(-1, -1), softcap=0.0, varlen=None):
    """True when these kernels compute the call's dQ, dK and dV: sm_90, fp16/bf16, head_dim in
    TILE (64 from MIN_QUERIES queries on), q/k/v/dO/dQ/dK/dV [batch, heads, seq, head_dim]
    contiguous or at strides the copy engine takes (`tma_strided_ok`: bshd views, e.g.) at
    16-byte aligned addresses (the copy engine reads and writes them), not a packed batch.
    Sliding windows and softcaps are taken (`window`, `softcap` as fused_attention's)."""
    return (q.shape[-1] in TILE and str(q.dtype) in _GL_DTYPES and q.is_cuda
            and q.shape[2] >= MIN_QUERIES.get(q.shape[-1], 0)
            and varlen is None
            and all(t.dtype == q.dtype and tma_strided_ok(t) and t.data_ptr() % 16 == 0
                    for t in (q, k, v, do, dq, dk, dv))
            and q.numel() > 0 and k.numel() > 0
            and device_properties(q.device).major == 9)


def attention_bwd_dkdv_hopper(q, k, v, do, dk, dv, lse, delta, *, causal, scale,
                              causal_offset, left_offset=None, softcap=0.0, key=None,
                              dq_acc=None):
    """dK and dV into dk, dv ([batch, kv_heads, kv_len, head_dim]) of a call
    `supports` accepts; lse (the forward's, natural log) and delta (the preprocess's):
    contiguous fp32 [batch, heads, q_len]. causal and causal_offset are common.visibility's
    CAUSAL and CAUSAL_OFFSET, left_offset its LEFT_OFFSET under a window (None: no window);
    softcap as fused_attention's (0: none). `key`: the backward's launch key (built when None).
    With dq_acc, a zeroed contiguous fp32 tensor of q's shape, the kernel also adds dS K into
    it (dQ before its scale) in whatever order its programs run: not reproducible bit for bit
    (attention_bwd's deterministic=False)."""
    batch, heads, q_len, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    tile = TILE[head_dim]
    stages, regs, block_m = dkdv_config(head_dim, softcap)
    num_tiles = -(-kv_len // 128)
    grid = (batch * kv_heads * num_tiles,)
    # each K/V head's programs stream the Q and dO of its query heads
    group = l2_group(q.device, batch * kv_heads, 2 * q_len * head_dim * q.element_size()
                     * (heads // kv_heads))
    fused = dq_acc is not None
    if fused and not fuses_dq(head_dim):
        raise ValueError(f"the fused dQ takes head_dim 128 in 64-row query blocks, not "
                         f"head_dim {head_dim} in {block_m}-row blocks")
    strided, strides = _strides(q, k, v, do, dk, dv)
    qk_scale, softcap_log2, has_softcap = score_scales(scale, softcap)
    args = (q, k, v, do, dk, dv, lse, delta, dq_acc if fused else lse, batch, heads,
            heads // kv_heads, q_len, kv_len, causal_offset, left_offset or 0, qk_scale,
            softcap_log2, scale, num_tiles, group, *strides)
    kwargs = dict(STRIDED=strided, HEAD_DIM=tile, COLS=head_dim, STAGES=stages, CAUSAL=causal,
                  HAS_WINDOW=left_offset is not None, SOFTCAP=has_softcap,
                  CONSUMER_REGS=regs, SMEM_LAYOUT=_smem_layout(64, tile, str(q.dtype)),
                  FUSED=fused,
                  DS_LAYOUT=_smem_layout(64, 64, str(q.dtype)),
                  DQ_LAYOUT=_smem_layout(64, 64, "torch.float32"), BLOCK_M=block_m,
                  Q_LAYOUT=_smem_layout(block_m, tile, str(q.dtype)), num_warps=4)
    ensure_scratch_allocator()  # the loader makes its TMA descriptors on the device
    if key is None:
        key = ("gluon-dkdv", q.device, q.dtype, q.shape, k.shape, strides,
               aligned(q, k, v, do, dk, dv, lse, delta), causal, causal_offset, left_offset,
               softcap, scale, fused)
    else:  # the backward's key; the launch keeps every argument but the tensors (per_call)
        key = _dkdv_key(key, scale, fused)
    return _launch(key, grid, args, kwargs, per_call=9,
                   config=dict(STAGES=stages, consumer_regs=regs, BLOCK_M=block_m, fused_dq=fused))


def _dkdv_key(key, scale, fused):
    # the dK/dV launch's key under the backward's (attention_bwd's) key
    return ("gluon-dkdv", key, scale, fused)


def _dq_key(key, scale):
    return ("gluon-dq", key, scale)


def kept_launches(key, scale, fused):
    """The dK/dV and dQ launches (launch._Bound) kept under the backward's key for this scale,
    None where one was not kept; the dQ one is None with fused (dQ comes from the dK/dV
    kernel). A call passes the tensors: dK/dV (q, k, v, do, dk, dv, lse, delta, dq_acc or lse),
    dQ (q, k, v, do, dq, lse, delta)."""
    return (_launch.bound.get(_dkdv_key(key, scale, fused)),
            None if fused else _launch_dq.bound.get(_dq_key(key, scale)))


def attention_bwd_dq_hopper(q, k, v, do, dq, lse, delta, *, causal, scale, causal_offset,
                            left_offset=None, softcap=0.0, key=None):
    """dQ into dq (q's shape) of a call `supports` accepts; lse, delta, the visibility and the
    softcap as attention_bwd_dkdv_hopper's. `key`: the backward's launch key (built when
    None)."""
    batch, heads, q_len, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    tile = TILE[head_dim]
    block_n, stages, regs = DQ_CONFIGS[tile]
    num_tiles = -(-q_len // 128)
    grid = (batch * heads * num_tiles,)
    # each query head's programs stream its K/V head's K and V (shared by its GROUP heads)
    group = l2_group(q.device, batch * heads, 2 * kv_len * head_dim * q.element_size()
                     // (heads // kv_heads))
    strided, strides = _strides(q, k, v, do, dq)
    qk_scale, softcap_log2, has_softcap = score_scales(scale, softcap)
    args = (q, k, v, do, dq, lse, delta, batch, heads, heads // kv_heads, q_len, kv_len,
            causal_offset, left_offset or 0, qk_scale, softcap_log2, scale, num_tiles, group,
            *strides)
    kwargs = dict(STRIDED=strided, HEAD_DIM=tile, COLS=head_dim, BLOCK_N=block_n,
                  STAGES=stages, CAUSAL=causal, HAS_WINDOW=left_offset is not None,
                  SOFTCAP=has_softcap, CONSUMER_REGS=regs,
                  Q_LAYOUT=_smem_layout(64, tile, str(q.dtype)),
                  KV_LAYOUT=_smem_layout(block_n, tile, str(q.dtype)), num_warps=4)
    ensure_scratch_allocator()
    if key is None:
        key = ("gluon-dq", q.device, q.dtype, q.shape, k.shape, strides,
               aligned(q, k, v, do, dq, lse, delta), causal, causal_offset, left_offset, softcap,
               scale)
    else:  # the backward's key; the launch keeps every argument but the tensors (per_call)
        key = _dq_key(key, scale)
    return _launch_dq(key, grid, args, kwargs, per_call=7,
                      config=dict(BLOCK_N=block_n, STAGES=stages, consumer_regs=regs))


def _strides(*tensors):
    """(STRIDED, every tensor's batch, head and row strides, flat): the kernels view every tensor
    through 4-D descriptors at its strides when any is not contiguous (bshd views, e.g.), else
    through contiguous 3-D ones, which read no strides."""
    strided = not all(t.is_contiguous() for t in tensors)
    return strided, tuple(s for t in tensors for s in tma_view_strides(t))


@functools.cache
def _smem_layout(rows, head_dim, dtype):
    element = gl.float32 if dtype == "torch.float32" else _GL_DTYPES[dtype]
    return gl.NVMMASharedLayout.get_default_for([rows, head_dim], element)


_launch = FastLaunch(_attn_bwd_dkdv_hopper)
_launch_dq = FastLaunch(_attn_bwd_dq_hopper)
