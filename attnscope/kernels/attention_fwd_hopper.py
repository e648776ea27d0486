"""
Fused attention forward for Hopper (sm_90) in Gluon, FlashAttention-3 style
============================================================================

Same contract and math as attention_fwd.py (online softmax in the exp2 domain, causal split,
LSE in natural log, rows that see no key written as zeros with LSE -inf), but written one level
lower, in Gluon (triton.experimental.gluon), so the schedule is ours instead of the compiler's:

- Persistent: one program per SM walks query tiles of (batch, head) pairs, in groups of heads
  whose K/V fit in L2 together and longest (last under a causal mask) first within a group.
  Which program runs which tiles is a table made on the host once per launch shape
  (tile_schedule.py: list scheduling, so the programs' work evens out). Warp partitions: a
  1-warp loader and two 4-warp consumer warpgroups (NUM_WG, the config's `consumers`), each
  owning 64 query rows of a 128-row tile; at head_dim 64, where every program has many tiles
  (`three_consumers`), three of them at 160 registers on 192-row tiles, as FA3 and FA4 run it.
  A consumer whose rows all lie past the sequence's end (a ragged last tile) only passes the
  barriers on (`_pass_blocks`).
  The loader brings in the next tile's Q as soon as the consumers' last Q K^T of the current
  one is done, so a tile's start-up and epilogue overlap its neighbours' work.
- The loader makes the copy engine's descriptors on the device (no host-side descriptor per
  launch) and streams K and V tiles through a STAGES-deep shared-memory ring with TMA. Each slot
  has a "ready" mbarrier (the copy engine signals it when the bytes land) and an "empty"
  mbarrier (every consumer arrives on it when its wgmma no longer reads the slot).
- Each consumer overlaps its softmax with its tensor cores (FA3's intra-warpgroup pipeline):
  it issues S_j = Q K_j^T and O += P_{j-1} V_{j-1} as asynchronous wgmma, waits only for S_j,
  runs the softmax of block j while the P V wgmma is still running, then waits for it and
  rescales O. P goes to the second wgmma straight from registers. The blocks past a tile's
  first (`block_loops`): at one column part of 128 columns or more, one loop choosing each
  block's mask; elsewhere none where every tile of a dense call holds one block, else two
  loops, the blocks every row of the consumer sees in full and then the masked ones.
- The consumers take turns at the tensor cores (FA3's ping-pong): a consumer issues its wgmma
  pair for block j only after the one before it has issued its pair for block j (warpgroup 0:
  the last one, block j - 1), through one mbarrier each, so one warpgroup's softmax tends to
  run while another's matrix multiplies do. From head_dim 112 on (a first column part of 128
  columns or more), but for dense calls of at most PINGPONG_SHORT_BLOCKS K/V blocks
  (`pingpong_for`), they take no turns, and O is rescaled by block j - 1's factor while S_j
  runs, before P_{j-1} V_{j-1} is issued (FA4's Hopper form there).

What it needs (dispatch.py routes everything else to the Triton kernel): an sm_90 GPU, Triton >=
3.6, fp16/bf16, a head_dim in CONFIGS (80, 96, 112, 128, 192, 256; 64 from MIN_QUERIES = 2049
queries on) or another multiple of 8 from 72 to 248 (`table_config`: its family's config),
tiles longer than SHORT_WORK or more of them than SMs, q/k/v [batch, heads, seq,
head_dim] contiguous or at strides the copy engine takes (`tma_strided_ok`), a positive scale, and a
launch that is not being traced (under torch.compile the Triton kernel runs). A head_dim that is not
a power of two runs as two column parts of power-of-two widths (`column_parts`: 80 = 64 + 16, 96 =
64 + 32, 192 = 128 + 64), each with its own buffers and descriptors: S is two wgmma chained on one
accumulator, O two accumulators, so no wgmma multiplies zero columns. Where two parts would cover as
many columns as one (112), one part padded to the next power of two: the descriptors' boxes are
wider than the rows, so the copy engine fills the padding columns with zeros (they add nothing to Q
K^T, and P V's padding columns are zeros) and drops them on the store. A dense call of many tiles
with few keys (`layout_for`) runs one padded part at 80 (and 72) up to 128 keys, and 64-key blocks
at 80 and 96 (72, 88) from 129 to 512: its tiles hold too few K/V blocks to repay the split's
per-block costs; 136-160 take 128-key blocks from 2049 keys on (`WIDE_BLOCK_KEYS`). Any query and
key length: the TMA descriptors see each tensor as [batch * heads, seq, head_dim], or,
where any of q, k, v, out is not contiguous (STRIDED: flash-attn's bshd layout, K/V slices of a
longer cache, padded rows), as [batch, heads, seq, head_dim] at its strides; so a block that runs
past a head's end reads the copy engine's zeros (never the next head's rows), keys past the end are
masked to -inf in the last K/V block only, and the copy engine drops the rows of an output block
past the end. Output blocks go to memory through shared memory and the copy engine (TMA store),
except those of an `out` the copy engine cannot address (an address or strides that are not 16-byte
multiples). At head_dim 200-256, and at 152-160 on 128-key blocks, where buffers of their own do
not fit in shared memory, outputs are staged in the consumer's Q buffer (O_IN_Q), which takes the
next tile's Q once the store has read it.

Sliding windows and softcaps as the Triton kernel takes them (HAS_WINDOW, SOFTCAP; without them
the kernel compiles to the code it had): a window's right edge is the causal bound moved right, its
left edge skips the K/V blocks left of a tile's first row's window (the loader never loads them)
and masks, like the diagonal, the blocks some row of a consumer sees in part; where a call takes
two block loops, a window's left edge takes a masked loop before them. A softcap
turns the scores into softcap * tanh(scale * s / softcap) before the max, tanh through one exp2.

Packed batches (fused_attention_varlen, VARLEN) at head_dim 64 (from MIN_QUERIES queries a sequence
on average), 80, 96, 128, 192 and 256 (PACKED_HEAD_DIMS): the packed [total, heads, head_dim]
tensors, whose rows may be any 16-byte multiple apart (slices of a fused QKV projection), are seen
by the copy engine as [total, heads * head_dim] and a tile reads its sequence's bounds from the
cumulative lengths, aligned bottom-right under the causal mask. A block that runs past its
sequence's end reads the next sequence's rows: keys past the end are masked to -inf (their V rows
are multiplied by zero, so only an inf or NaN there would reach this sequence), query rows past it
are computed and never stored (a consumer whose rows all lie past it skips the work). Output
blocks wholly inside their sequence leave by TMA store (at head_dim 256 staged in Q's buffer), a
sequence's ragged last block by register stores. The tiles are
handed out on the device as programs ask for them, from a counter zeroed at each launch, since the
host does not know the lengths (they are on the GPU) to schedule by: the loader takes the next
number, finds the sequence and tile it stands for (_packed_tile: the numbers count only tiles that
hold queries, sequence after sequence, each sequence's heads in groups that share L2 and their last
query block first) and passes the tile to the consumers through shared memory. Against the host's
round-robin this took the serving sweep's packed row from 1.956 to 1.770 ms in one job
(notes/lab/gluon_varlen_h200.txt).

Where things are: the kernel `_attn_fwd_hopper` partitions into `_loader` and `_consumer`, whose
K/V block loops call `_next_block` (one block's products, softmax and rescale). A call's config
is chosen in `attention_fwd_hopper()`: `three_consumers` (192-row tiles), else `layout_for` over
`table_config`'s CONFIGS entry (few keys, wide blocks), then `block_loops` and `pingpong_for`;
`supports` says which calls this kernel takes at all.
"""

import functools

import torch

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

from attnscope.kernels.common import (_grouped_tile, aligned, block_width, device_properties,
                                      head_group, score_scales, tma_strided_ok, tma_view_strides,
                                      visibility)
from attnscope.kernels.gluon_compat import tma_load, tma_store
from attnscope.kernels.launch import FORWARD_LAUNCHES, FastLaunch, ensure_scratch_allocator
from attnscope.kernels.tile_schedule import tile_schedule

LN2 = gl.constexpr(0.6931471805599453)
ROWS = gl.constexpr(64)  # query rows per consumer warpgroup (one wgmma M=64 tile)
# Lazy rescale, where O is one part of LAZY_COLUMNS columns or more (head_dim 112, 128 and 256;
# not the split head dims): past a tile's first block, a row's running max moves only when a
# block's max exceeds it by more than RESCALE_THRESHOLD (log2 units, so a score's exp2 is at
# most 2^8 and P within fp16's range), and a warp skips O's rescale, head_dim / 2 FMUL a thread,
# on blocks where none of its rows moved (_warp_moved, _rescale). H200, Triton 3.6,
# hopper_lab.py --time, two jobs (notes/lab/gluon_lazy_rescale_h200.txt): 2-5 % faster at
# head_dim 256's rows of 500 keys or more ((1,8,16384,256): 1.474 against 1.499 ms), level to
# 3 % faster at 128's, level at rows of one or two blocks a tile; at 64, 80, 96 and 192 it lost
# 2.6-5 % at long rows, 9 % at (512,16,256,96).
RESCALE_THRESHOLD = gl.constexpr(8.0)
LAZY_COLUMNS = gl.constexpr(128)
# The loader warp's registers: 32, not 24, since a packed batch's loader walks the sequences 32
# at a time (_packed_tile): at 24 it spilled at head_dim 256 (offline, Triton 3.6); the dense
# kernel's code is the same at 24, 32 and 40.
LOADER_REGS = gl.constexpr(32)


@gluon.jit
def _tile(t, n_hz, num_m, head_group, H, CuQ, CuK, N_CTX_Q, N_CTX_K, CAUSAL_OFFSET,
          LEFT_OFFSET, CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr, VARLEN: gl.constexpr,
          BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    # Tile t of the launch: (batch * head, first query row, first K/V block, number of K/V
    # blocks), in the Triton kernel's order (heads in groups that share L2, last query block
    # first within a group), and its sequence: first query and key rows in the tensors, query
    # and key lengths, causal offset and (HAS_WINDOW) the window's left offset (row i sees keys
    # from i + left on). The K/V blocks run from the one holding the first key the tile's first
    # row sees: those left of a window are skipped. A packed batch (VARLEN) reads its sequence's
    # bounds from the cumulative lengths, aligned bottom-right; its tile numbers name only tiles
    # that hold queries (_packed_tile).
    # Which program runs which tiles: the host's schedule (tile_schedule), or for a packed
    # batch the device's hand-out (_loader).
    if VARLEN:  # the hand-out's tile numbers (_packed_tile)
        off_hz = t // num_m
        m = t % num_m
    else:
        off_hz, m = _grouped_tile(t, n_hz, num_m, head_group)
    first_row = m * BLOCK_M
    if VARLEN:
        b = off_hz // H
        q_start = gl.load(CuQ + b)
        # (clamped: lengths that decrease are the caller's error, but must not make the
        # block counts negative, which would put the rings' phases out of step)
        q_len = gl.maximum(gl.load(CuQ + b + 1) - q_start, 0)
        k_start = gl.load(CuK + b)
        k_len = gl.maximum(gl.load(CuK + b + 1) - k_start, 0)
        offset = CAUSAL_OFFSET + k_len - q_len
        left = LEFT_OFFSET + k_len - q_len
    else:
        q_start = 0
        q_len = N_CTX_Q
        k_start = 0
        k_len = N_CTX_K
        offset = CAUSAL_OFFSET
        left = LEFT_OFFSET
    if CAUSAL:  # keys the tile's last row sees
        hi = gl.maximum(gl.minimum(first_row + BLOCK_M + offset, k_len), 0)
    else:
        hi = k_len
    if HAS_WINDOW:  # (no block counts below zero: a window right of every key visits none)
        lo = gl.minimum(gl.maximum(first_row + left, 0), k_len) // BLOCK_N
        n_blocks = gl.maximum(gl.cdiv(hi, BLOCK_N) - lo, 0)
    else:
        lo = 0
        n_blocks = gl.cdiv(hi, BLOCK_N)
    return (off_hz, first_row, lo, n_blocks, q_start, q_len, k_start, k_len, offset, left)


@gluon.jit
def _descriptor(ptr, n_hz, n_ctx, HEAD_DIM: gl.constexpr, smem, VARLEN: gl.constexpr,
                row_stride, heads, batch_stride, head_stride, STRIDED: gl.constexpr):
    # The copy engine's view of ptr whose blocks are one buffer of the ring `smem` ([buffers,
    # rows, width]). Dense: [heads, seq, HEAD_DIM], rows x width boxes at (head, row, column), so
    # a block past a head's end or columns past HEAD_DIM read as zeros. Dense and STRIDED (a
    # launch with a tensor that is not contiguous, e.g. bshd; every tensor of it is seen so):
    # [batch, heads, seq, HEAD_DIM] at its strides, boxes at (batch, head, row, column), with
    # the same zeros. Packed (VARLEN, n_hz the heads of one row): the packed tensor as [total
    # rows, heads * HEAD_DIM] with rows row_stride apart, boxes at (row, head * HEAD_DIM +
    # column); rows past a sequence's end read the next sequence's (masked or never stored),
    # columns must not run past the head (the host checks).
    rows: gl.constexpr = smem.shape[1]
    width: gl.constexpr = smem.shape[2]
    if VARLEN:
        return tma.make_tensor_descriptor(ptr, [n_ctx, n_hz * HEAD_DIM], [row_stride, 1],
                                          [rows, width], smem.index(0).layout)
    elif STRIDED:
        return tma.make_tensor_descriptor(ptr, [n_hz // heads, heads, n_ctx, HEAD_DIM],
                                          [batch_stride, head_stride, row_stride, 1],
                                          [1, 1, rows, width],
                                          smem.index(0).reshape([1, 1, rows, width]).layout)
    else:
        return tma.make_tensor_descriptor(ptr, [n_hz, n_ctx, HEAD_DIM],
                                          [n_ctx * HEAD_DIM, HEAD_DIM, 1], [1, rows, width],
                                          smem.index(0).reshape([1, rows, width]).layout)


@gluon.jit
def _descriptors(ptr, n_hz, n_ctx, HEAD_DIM: gl.constexpr, smem, smem1, VARLEN: gl.constexpr,
                 row_stride, heads, batch_stride, head_stride, STRIDED: gl.constexpr,
                 SPLIT: gl.constexpr):
    # _descriptor's view of ptr for each column part: smem's, and smem1's for a split head_dim
    # (its boxes start at column D0); without a split the second is the first, unused.
    desc = _descriptor(ptr, n_hz, n_ctx, HEAD_DIM, smem, VARLEN, row_stride, heads,
                       batch_stride, head_stride, STRIDED)
    desc1 = desc
    if SPLIT:
        desc1 = _descriptor(ptr, n_hz, n_ctx, HEAD_DIM, smem1, VARLEN, row_stride, heads,
                            batch_stride, head_stride, STRIDED)
    return desc, desc1


@gluon.jit
def _load(desc, b, hz, row, col, bar, buf, VARLEN: gl.constexpr, STRIDED: gl.constexpr,
          HEAD_DIM: gl.constexpr):
    # One box of desc (_descriptor's) into the 2-D shared buffer buf, signalling bar when its
    # bytes land: rows from `row`, columns from `col` of head `hz` (in the packed tensor's row
    # for VARLEN; of batch b's heads for STRIDED; of the [heads, seq, HEAD_DIM] view otherwise,
    # b unused).
    if VARLEN:
        tma_load(desc, [row, hz * HEAD_DIM + col], bar, buf)
    elif STRIDED:
        tma_load(desc, [b, hz, row, col], bar, buf.reshape([1, 1, buf.shape[0], buf.shape[1]]))
    else:
        tma_load(desc, [hz, row, col], bar, buf.reshape([1, buf.shape[0], buf.shape[1]]))


@gluon.jit
def _load_parts(desc, desc1, b, hz, row, bar, buf, buf1, VARLEN: gl.constexpr,
                STRIDED: gl.constexpr, HEAD_DIM: gl.constexpr, SPLIT: gl.constexpr):
    # One block of every column part (_load's coordinates): columns from 0 into buf and, for a
    # split head_dim, from buf's width on into buf1 (desc1's); all signal bar.
    _load(desc, b, hz, row, 0, bar, buf, VARLEN, STRIDED, HEAD_DIM)
    if SPLIT:
        _load(desc1, b, hz, row, buf.shape[1], bar, buf1, VARLEN, STRIDED, HEAD_DIM)


@gluon.jit
def _view_head(off_hz, H, VARLEN: gl.constexpr, STRIDED: gl.constexpr):
    # (batch, head) of tile head off_hz (batch * H + head) in the descriptors' coordinates: a
    # packed row's heads (VARLEN), batch and head of the 4-D view (STRIDED), or the [batch *
    # heads] dimension of the 3-D view (batch 0, unused)
    if VARLEN:
        return 0, off_hz % H
    elif STRIDED:
        return off_hz // H, off_hz % H
    else:
        return 0, off_hz


@gluon.jit
def _kv_view(off_hz, H, GROUP, VARLEN: gl.constexpr, STRIDED: gl.constexpr):
    # (batch, query head, K/V head) of tile head off_hz in the descriptors' coordinates
    # (_view_head's; the K/V head is the query head's group)
    batch_of, q_head = _view_head(off_hz, H, VARLEN, STRIDED)
    if VARLEN or STRIDED:  # heads within a packed row or a batch
        kv_head = q_head // GROUP
    else:
        kv_head = off_hz // H * (H // GROUP) + off_hz % H // GROUP
    return batch_of, q_head, kv_head


@gluon.jit
def _load_q(q_desc, q_desc1, b, hz, row, q_ready, q_empty, q_smem, q_smem1, ti, q_bytes,
            VARLEN: gl.constexpr, STRIDED: gl.constexpr, HEAD_DIM: gl.constexpr,
            SPLIT: gl.constexpr):
    # The loader's Q blocks of tile number ti (this program's), one per consumer from `row`,
    # each once its consumer has freed its buffer (q_empty). A fresh mbarrier is in phase 0, so
    # a wait for parity 1 passes at once: the first loads wait for nobody.
    NUM_WG: gl.constexpr = q_smem.shape[0]  # the consumers, one Q block each
    for wg in gl.static_range(NUM_WG):
        mbarrier.wait(q_empty.index(wg), (ti & 1) ^ 1)
        mbarrier.expect(q_ready.index(wg), q_bytes)
        _load_parts(q_desc, q_desc1, b, hz, row + wg * ROWS, q_ready.index(wg), q_smem.index(wg),
                    q_smem1.index(wg), VARLEN, STRIDED, HEAD_DIM, SPLIT)


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _packed_tile(k, seq, seq_first, batch, H, num_m, head_group, CuQ, n_tiles,
                 BLOCK_M: gl.constexpr):
    # Hand-out number k of a packed batch as a tile number (off_hz * num_m + query block, as
    # _tile reads it), n_tiles where k is past the last tile. The numbers walk the sequences in
    # order and, within one, its heads' query blocks (none past its end) in _grouped_tile's
    # order, so no number is spent on an empty tile. (seq, seq_first): the sequence this
    # program's last number fell in and that sequence's first number; the walk goes on from
    # there (a program's numbers only grow), 32 sequences' lengths a step, one a lane. Returns
    # the tile number and the new (seq, seq_first).
    lanes = gl.arange(0, 32, layout=gl.BlockedLayout([1], [32], [1], [0]))
    seq = gl.to_tensor(seq)  # (the first call's are constant zeros)
    seq_first = gl.to_tensor(seq_first)
    tiles = gl.to_tensor(0)  # the tiles of sequence `seq` once found
    searching = seq < batch
    while searching:
        inside = seq + lanes < batch
        lo = gl.load(CuQ + seq + lanes, mask=inside, other=0)
        hi = gl.load(CuQ + seq + lanes + 1, mask=inside, other=0)
        n = H * gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_M)  # each sequence's tiles (0 past batch)
        ends = seq_first + gl.associative_scan(n, 0, _add)  # the number after each's last
        at = gl.min(gl.where(ends > k, lanes, 32), 0)  # the first sequence that holds k
        if at < 32:
            seq_first = seq_first + gl.sum(gl.where(lanes < at, n, 0), 0)
            tiles = gl.sum(gl.where(lanes == at, n, 0), 0)
            seq = seq + at
            searching = False
        else:
            seq_first = seq_first + gl.sum(n, 0)
            seq = seq + 32
            searching = seq < batch
    if seq < batch:
        head, m = _grouped_tile(k - seq_first, H, tiles // H, head_group)
        t = (seq * H + head) * num_m + m
    else:
        t = n_tiles
    return t, seq, seq_first


@gluon.jit
def _publish(t, ids, ids_ready, ids_empty, fetched, WARPS: gl.constexpr):
    # The loader hands tile number t to the consumers through slot `fetched` % 2 of ids (a
    # two-slot ring: ids_ready signals the number is there, ids_empty that the consumers read
    # it). Returns the count of numbers handed out. WARPS: the calling partition's warps.
    slot = fetched % 2
    mbarrier.wait(ids_empty.index(slot), ((fetched // 2) & 1) ^ 1)
    one: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    ids.index(slot).store(gl.full([1], t, gl.int32, one))
    mbarrier.arrive(ids_ready.index(slot))
    return fetched + 1


@gluon.jit
def _receive(ids, ids_ready, ids_empty, fetched, WARPS: gl.constexpr):
    # A consumer's side of _publish: the next tile number, and the count read.
    slot = fetched % 2
    mbarrier.wait(ids_ready.index(slot), (fetched // 2) & 1)
    one: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    t = gl.max(ids.index(slot).load(one), 0)
    mbarrier.arrive(ids_empty.index(slot))
    return t, fetched + 1


@gluon.jit
def _tile_number(r, count, fetched, seq, seq_first, sched, Counter, ids, ids_ready, ids_empty,
                 n_tiles, batch, H, num_m, head_group, CuQ, FIRST: gl.constexpr,
                 VARLEN: gl.constexpr, LOADER: gl.constexpr, BLOCK_M: gl.constexpr):
    # Tile r of this program's walk, as the loader (LOADER) and the consumers both take it, so
    # they walk the same tiles. Dense: entry r of the host's schedule, row `sched` (its count,
    # FIRST reads it, then its tile numbers). Packed: the loader takes hand-out number
    # program_id first, then the next one not taken from Counter, turns it into a tile
    # (_packed_tile, from the sequence cursor seq, seq_first) and hands that to the consumers
    # (_publish, _receive; `fetched` counts the numbers handed over). Returns (tile number,
    # count, fetched, seq, seq_first, whether it is a tile: a number past the last ends the
    # walk).
    if VARLEN:
        if LOADER:
            if FIRST:
                k = gl.program_id(0)
            else:
                k = gl.atomic_add(Counter, 1) + gl.num_programs(0)
            t, seq, seq_first = _packed_tile(k, seq, seq_first, batch, H, num_m, head_group,
                                             CuQ, n_tiles, BLOCK_M)
            fetched = _publish(t, ids, ids_ready, ids_empty, fetched, 1)
        else:
            t, fetched = _receive(ids, ids_ready, ids_empty, fetched, 4)
        more = t < n_tiles
    else:
        if FIRST:
            count = gl.load(sched)
            t = gl.load(sched + 1)
        else:
            t = gl.load(sched + 1 + gl.minimum(r, count - 1))
        more = r < count
    return t, count, fetched, seq, seq_first, more


@gluon.jit
def _loader(args, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr,
            BLOCK_N: gl.constexpr, STAGES: gl.constexpr, D1: gl.constexpr,
            VARLEN: gl.constexpr, STRIDED: gl.constexpr, O_IN_Q: gl.constexpr):
    (Q, K, V, q_smem, k_smem, v_smem, q_smem1, k_smem1, v_smem1, q_ready, q_empty, k_ready,
     k_empty, v_ready, v_empty, sched, n_hz, num_m, head_group, H, GROUP, CuQ, CuK, N_CTX_Q,
     N_CTX_K, CAUSAL_OFFSET, LEFT_OFFSET, stride_qm, stride_km, stride_vm, stride_qz, stride_qh,
     stride_kz, stride_kh, stride_vz, stride_vh, ids, ids_ready, ids_empty, Counter) = args
    # The copy engine's descriptors, made here on the device once per program (_descriptor).
    # (Host-made descriptors cost ~50 us of Triton's launch per call.) A split head_dim has a
    # second set for its columns from D0 on. Making one takes ~0.6 us (a write to global memory
    # and a fence), so V's is made after the first tile's Q and first K block are issued: the
    # first S = Q K^T waits for those two only.
    SPLIT: gl.constexpr = D1 > 0
    # heads of the descriptors' views: all (batch, head) pairs, or the heads of one packed row
    q_hz = H if VARLEN else n_hz
    kv_hz = q_hz // GROUP
    q_desc, q_desc1 = _descriptors(Q, q_hz, N_CTX_Q, HEAD_DIM, q_smem, q_smem1, VARLEN,
                                   stride_qm, H, stride_qz, stride_qh, STRIDED, SPLIT)
    k_desc, k_desc1 = _descriptors(K, kv_hz, N_CTX_K, HEAD_DIM, k_smem, k_smem1, VARLEN,
                                   stride_km, H // GROUP, stride_kz, stride_kh, STRIDED, SPLIT)
    D0: gl.constexpr = q_smem.shape[2]
    elem: gl.constexpr = Q.dtype.element_ty.primitive_bitwidth // 8
    q_bytes: gl.constexpr = ROWS * (D0 + D1) * elem  # what one Q block's copies bring in
    TILE_M: gl.constexpr = q_smem.shape[0] * ROWS  # a tile's rows: one Q block per consumer
    kv_bytes: gl.constexpr = BLOCK_N * (D0 + D1) * elem
    it = 0  # K/V blocks loaded so far (ring slot and phase); ti: tiles so far (Q phase)
    ti = 0
    # The tiles: a dense call's from the host's schedule; a packed batch's handed out as
    # programs ask for them (the host cannot schedule what it does not know: the lengths are
    # on the GPU), from here to the consumers (_tile_number).
    n_tiles = n_hz * num_m
    r = 0
    batch = n_hz // H
    t, count, fetched, seq, seq_first, more = _tile_number(
        r, 0, 0, 0, 0, sched, Counter, ids, ids_ready, ids_empty, n_tiles, batch, H, num_m,
        head_group, CuQ, True, VARLEN, True, TILE_M)
    if more:  # the first tile's Q (unless O_IN_Q) and first K block, before V's descriptor
        off_hz, first_row, lo, n_blocks, q_start, q_len, k_start, k_len, offset, left = _tile(
            t, n_hz, num_m, head_group, H, CuQ, CuK, N_CTX_Q, N_CTX_K, CAUSAL_OFFSET,
            LEFT_OFFSET, CAUSAL, HAS_WINDOW, VARLEN, TILE_M, BLOCK_N)
        batch_of, q_head, kv_head = _kv_view(off_hz, H, GROUP, VARLEN, STRIDED)
        if not O_IN_Q:
            _load_q(q_desc, q_desc1, batch_of, q_head, q_start + first_row, q_ready, q_empty,
                    q_smem, q_smem1, 0, q_bytes, VARLEN, STRIDED, HEAD_DIM, SPLIT)
        if n_blocks > 0:  # ring slot 0, free at the start
            mbarrier.expect(k_ready.index(0), kv_bytes)
            _load_parts(k_desc, k_desc1, batch_of, kv_head, k_start + lo * BLOCK_N,
                        k_ready.index(0), k_smem.index(0), k_smem1.index(0), VARLEN, STRIDED,
                        HEAD_DIM, SPLIT)
    v_desc, v_desc1 = _descriptors(V, kv_hz, N_CTX_K, HEAD_DIM, v_smem, v_smem1, VARLEN,
                                   stride_vm, H // GROUP, stride_vz, stride_vh, STRIDED, SPLIT)
    while more:
        off_hz, first_row, lo, n_blocks, q_start, q_len, k_start, k_len, offset, left = _tile(
            t, n_hz, num_m, head_group, H, CuQ, CuK, N_CTX_Q, N_CTX_K, CAUSAL_OFFSET,
            LEFT_OFFSET, CAUSAL, HAS_WINDOW, VARLEN, TILE_M, BLOCK_N)
        batch_of, q_head, kv_head = _kv_view(off_hz, H, GROUP, VARLEN, STRIDED)
        # The tile's Q blocks, then its K/V blocks. With O_IN_Q a consumer frees its Q buffer
        # only once its output has left it, so its first STAGES K/V blocks go first (their ring
        # slots free up before the consumers' epilogue) and the Q blocks after them.
        q_row = q_start + first_row
        if not O_IN_Q and r > 0:  # (the first tile's went before V's descriptor)
            _load_q(q_desc, q_desc1, batch_of, q_head, q_row, q_ready, q_empty, q_smem, q_smem1,
                    ti, q_bytes, VARLEN, STRIDED, HEAD_DIM, SPLIT)
        early = gl.minimum(n_blocks, STAGES)  # (O_IN_Q) K/V blocks loaded before Q
        for j in range(n_blocks):
            if O_IN_Q:
                if j == early:
                    _load_q(q_desc, q_desc1, batch_of, q_head, q_row, q_ready, q_empty, q_smem,
                            q_smem1, ti, q_bytes, VARLEN, STRIDED, HEAD_DIM, SPLIT)
            slot = (it + j) % STAGES
            phase = (((it + j) // STAGES) & 1) ^ 1
            row = k_start + (lo + j) * BLOCK_N
            if r > 0 or j > 0:  # (the first tile's first K block went before V's descriptor)
                mbarrier.wait(k_empty.index(slot), phase)
                mbarrier.expect(k_ready.index(slot), kv_bytes)
                _load_parts(k_desc, k_desc1, batch_of, kv_head, row, k_ready.index(slot),
                            k_smem.index(slot), k_smem1.index(slot), VARLEN, STRIDED, HEAD_DIM,
                            SPLIT)
            mbarrier.wait(v_empty.index(slot), phase)
            mbarrier.expect(v_ready.index(slot), kv_bytes)
            _load_parts(v_desc, v_desc1, batch_of, kv_head, row, v_ready.index(slot),
                        v_smem.index(slot), v_smem1.index(slot), VARLEN, STRIDED, HEAD_DIM, SPLIT)
        if O_IN_Q:
            if early == n_blocks:  # no more blocks than stages: Q after all of them
                _load_q(q_desc, q_desc1, batch_of, q_head, q_row, q_ready, q_empty, q_smem,
                        q_smem1, ti, q_bytes, VARLEN, STRIDED, HEAD_DIM, SPLIT)
        it += n_blocks
        ti += 1
        r += 1
        t, count, fetched, seq, seq_first, more = _tile_number(
            r, count, fetched, seq, seq_first, sched, Counter, ids, ids_ready, ids_empty,
            n_tiles, batch, H, num_m, head_group, CuQ, False, VARLEN, True, TILE_M)


@gluon.jit
def _tanh_exp2(x):
    # tanh(y) for x = 2 * y * log2(e), common._tanh_exp2's form in Gluon: the Gluon backward
    # (attention_bwd_hopper) recomputes softcapped logits with it, so its P matches this LSE
    return 1.0 - 2.0 / (gl.exp2(x) + 1.0)


@gluon.jit
def _softmax(s, m_i, l_i, rows, start_n, vis, MASKED: gl.constexpr, CAUSAL: gl.constexpr,
             HAS_WINDOW: gl.constexpr, SOFTCAP: gl.constexpr, BLOCK_N: gl.constexpr,
             LAZY: gl.constexpr = False):
    # One block of the online softmax: p = exp2(s * qk_scale - m) with the new running max m,
    # alpha rescales what was accumulated under the old max. Scale and max subtraction fold
    # into one FMA per score. vis: the keys, the causal offset, the window's left offset (row i
    # sees keys from i + left on), the first block past the window's edge for every row (unused
    # here), qk_scale and softcap_log2 (common.score_scales). SOFTCAP: the logits are softcap *
    # tanh(scale * s / softcap) in log2 units, tanh through one exp2 (common._tanh_exp2's form).
    N_CTX_K, CAUSAL_OFFSET, left, _first_full, qk_scale, softcap_log2 = vis
    if SOFTCAP:
        s = _tanh_exp2(s * qk_scale) * softcap_log2
        scale = 1.0
    else:
        scale = qk_scale
    if MASKED:
        cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
        ok = gl.expand_dims(cols < N_CTX_K, 0)
        if CAUSAL:
            ok = ok & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows + CAUSAL_OFFSET, 1))
        if HAS_WINDOW:
            ok = ok & (gl.expand_dims(cols, 0) >= gl.expand_dims(rows + left, 1))
        s = gl.where(ok, s, float("-inf"))
    m_blk = gl.max(s, 1) * scale
    if LAZY:
        m_new = gl.where(m_blk > m_i + RESCALE_THRESHOLD, m_blk, m_i)
    else:
        m_new = gl.maximum(m_i, m_blk)
    if MASKED:  # a row that has seen no key yet keeps m == -inf; subtract 0 instead of -inf
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    p = gl.exp2(s * scale - gl.expand_dims(m_use, 1))
    alpha = gl.exp2(m_i - m_use)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, l_i, m_new


@gluon.jit
def _block_softmax(s, m_i, l_i, rows, j, full_blocks, vis, CAUSAL: gl.constexpr,
                   HAS_WINDOW: gl.constexpr, SOFTCAP: gl.constexpr, BLOCK_N: gl.constexpr,
                   LAZY: gl.constexpr = False):
    # Blocks every row of this warpgroup sees in full run without mask arithmetic: K/V block j
    # (of the sequence) is one where j < full_blocks and, under a window, j >= vis's first_full.
    if HAS_WINDOW:
        full = (j < full_blocks) & (j >= vis[3])
    else:
        full = j < full_blocks
    if full:
        p, alpha, l_i, m_i = _softmax(s, m_i, l_i, rows, j * BLOCK_N, vis, False, CAUSAL,
                                      HAS_WINDOW, SOFTCAP, BLOCK_N, LAZY)
    else:
        p, alpha, l_i, m_i = _softmax(s, m_i, l_i, rows, j * BLOCK_N, vis, True, CAUSAL,
                                      HAS_WINDOW, SOFTCAP, BLOCK_N, LAZY)
    return p, alpha, l_i, m_i


@gluon.jit
def _warp_moved(alpha):
    # The rows' rescale factors (alpha, 1 where a row's max did not move) where some row of this
    # warp moved, else -1 for every row: the sign is the same in every lane of a warp, so the
    # branch it takes in _rescale is uniform. (A warpgroup-wide reduction instead, an `if` on a
    # scalar, costs three BAR.SYNC a block and lost 3-13 %: gluon_lazy_rescale_h200.txt.) A
    # thread holds two rows of a 64-row wgmma layout (r and r + 8 of its warp's 16), both in
    # one asm, so every factor a thread holds has its warp's sign. The vote needs the whole
    # warp: the asm is called where control flow is warp-uniform (every block of the loop).
    gl.static_assert(alpha.shape[0] == 64, "one asm must hold all of a thread's rows")
    return gl.inline_asm_elementwise(
        """{
        .reg .pred p0, p1, q;
        setp.ne.f32 p0, $2, 0f3F800000;
        setp.ne.f32 p1, $3, 0f3F800000;
        or.pred p0, p0, p1;
        vote.sync.any.pred q, p0, 0xffffffff;
        selp.b32 $0, $2, 0fBF800000, q;
        selp.b32 $1, $3, 0fBF800000, q;
        }""", "=r,=r,r,r", [alpha], dtype=gl.float32, is_pure=True, pack=2)


# _rescale's asm takes RESCALE_PACK elements of O: $0-$31 out, tied to the inputs $32-$63, and
# their rows' factors $64-$95; every element's factor has its warp's sign, so testing one suffices
RESCALE_PACK = gl.constexpr(32)
_N = RESCALE_PACK.value
RESCALE_ASM = gl.constexpr(
    "{\n.reg .pred p;\nsetp.lt.s32 p, $" + str(2 * _N) + ", 0;\n@p bra DONE;\n"
    + "".join(f"mul.f32 ${i}, ${i}, ${i + 2 * _N};\n" for i in range(_N)) + "DONE:\n}")
RESCALE_CONSTRAINTS = gl.constexpr(",".join(["=r"] * _N + [str(i) for i in range(_N)]
                                            + ["r"] * _N))


@gluon.jit
def _rescale(acc, alpha):
    # acc * alpha by rows (alpha from _warp_moved), the multiplies branched over by a warp
    # whose factors are negative
    a = gl.expand_dims(alpha, 1)
    a, acc = gl.broadcast(a, acc)
    return gl.inline_asm_elementwise(RESCALE_ASM, RESCALE_CONSTRAINTS, [acc, a],
                                     dtype=gl.float32, is_pure=True, pack=RESCALE_PACK)


@gluon.jit
def _scale_o(acc, acc1, alpha, SPLIT: gl.constexpr, LAZY: gl.constexpr):
    # O (both column parts under SPLIT) times the rows' factors alpha
    if SPLIT:
        alpha1 = gl.convert_layout(alpha, gl.SliceLayout(1, acc1.type.layout))
        acc1 = acc1 * gl.expand_dims(alpha1, 1)
    alpha0 = gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))
    if LAZY:
        acc = _rescale(acc, _warp_moved(alpha0))
    else:
        acc = acc * gl.expand_dims(alpha0, 1)
    return acc, acc1


@gluon.jit
def _next_block(ring, g, acc, acc1, p_op, l_i, m_i, alpha_in, s_zero, rows, j, full_blocks, vis,
                WG: gl.constexpr, STAGES: gl.constexpr, MASKED: gl.constexpr,
                CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr, SOFTCAP: gl.constexpr,
                SPLIT: gl.constexpr, PINGPONG: gl.constexpr):
    # The consumer's K/V block g (block j of the sequence, past the tile's first): S_j = Q K_j^T
    # and O += P_{j-1} V_{j-1} issued as asynchronous wgmma (in this warpgroup's turn under
    # PINGPONG), block j's softmax while the P V product runs, then O rescaled by block j's
    # factor alpha; without PINGPONG, O is rescaled by block j-1's (alpha_in) between the two
    # issues, and block j's alpha is returned for the next block. With a split head_dim (SPLIT) each
    # product is two wgmma, one per column part. MASKED: whether the block is masked (True,
    # False), or None: chosen at run time (_block_softmax). vis: what its rows see (_softmax).
    # ring: the consumer's Q buffers, the K/V ring's buffers and barriers, the ping-pong's turn
    # barriers.
    q, q1, k_smem, k_smem1, v_smem, v_smem1, k_ready, k_empty, v_ready, v_empty, turn = ring
    NUM_WG: gl.constexpr = turn.shape[0]  # the consumers, one turn barrier each
    # SERIAL: a masked block on three consumers waits for P_{j-1} V_{j-1} before its softmax;
    # at 160 registers, P_{j-1} held through the masked softmax spills. (Not under SPLIT, whose
    # branch comes first, nor in BLOCK_LOOPS 1's loop, whose blocks' MASKED is None.)
    SERIAL: gl.constexpr = (NUM_WG == 3) and (MASKED is True)
    slot = g % STAGES
    prev = (g - 1) % STAGES
    mbarrier.wait(k_ready.index(slot), (g // STAGES) & 1)
    mbarrier.wait(v_ready.index(prev), ((g - 1) // STAGES) & 1)
    EARLY: gl.constexpr = not PINGPONG  # O rescaled before the P V product
    if PINGPONG:
        mbarrier.wait(turn.index(WG), g & 1)
    s_tok = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False,
                          is_async=True)
    LAZY: gl.constexpr = (not SPLIT) and acc.shape[1] >= LAZY_COLUMNS
    if SPLIT:
        s_tok = warpgroup_mma(q1, k_smem1.index(slot).permute((1, 0)), s_tok, is_async=True)
    if EARLY:  # the block before's factor, while Q K_j^T runs
        acc, acc1 = _scale_o(acc, acc1, alpha_in, SPLIT, LAZY)
    if SPLIT:
        acc = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
        p_layout1: gl.constexpr = gl.DotOperandLayout(operand_index=0,
                                                      parent=acc1.type.layout, k_width=2)
        acc1 = warpgroup_mma(gl.convert_layout(p_op, p_layout1), v_smem1.index(prev), acc1,
                             is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn.index((WG + 1) % NUM_WG))
        # S_j is done (wgmma retire in order); the P V pair may still run
        s, acc, acc1 = warpgroup_mma_wait(2, deps=[s_tok, acc, acc1])
    elif SERIAL:
        acc = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn.index((WG + 1) % NUM_WG))
        # both done: P_{j-1} dies before this block's masked softmax
        s, acc = warpgroup_mma_wait(0, deps=[s_tok, acc])
    else:
        acc = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn.index((WG + 1) % NUM_WG))
        # S_j is done; P_{j-1} V_{j-1} may still run during this block's softmax
        s, acc = warpgroup_mma_wait(1, deps=[s_tok, acc])
    mbarrier.arrive(k_empty.index(slot))
    if MASKED is None:
        p, alpha, l_i, m_i = _block_softmax(s, m_i, l_i, rows, j, full_blocks, vis, CAUSAL,
                                            HAS_WINDOW, SOFTCAP, s.shape[1], LAZY)
    else:
        p, alpha, l_i, m_i = _softmax(s, m_i, l_i, rows, j * s.shape[1], vis, MASKED, CAUSAL,
                                      HAS_WINDOW, SOFTCAP, s.shape[1], LAZY)
    if SPLIT:
        acc, acc1 = warpgroup_mma_wait(0, deps=[acc, acc1])
        if not EARLY:  # the second part first, before V's release
            alpha1 = gl.convert_layout(alpha, gl.SliceLayout(1, acc1.type.layout))
            acc1 = acc1 * gl.expand_dims(alpha1, 1)
    elif not SERIAL:
        acc = warpgroup_mma_wait(0, deps=[acc])
    mbarrier.arrive(v_empty.index(prev))
    if not EARLY:  # (EARLY: alpha is the next block's to apply)
        acc, acc1 = _scale_o(acc, acc1, alpha, False, LAZY)
    return acc, acc1, gl.convert_layout(p.to(p_op.dtype), p_op.type.layout), l_i, m_i, alpha


@gluon.jit
def _pass_blocks(ring, it, n_blocks, WG: gl.constexpr, STAGES: gl.constexpr,
                 PINGPONG: gl.constexpr):
    # A consumer's part in the barriers of a tile's n_blocks K/V blocks (the ring's from `it`)
    # without their products: its turns passed on (PINGPONG), the slots released once loaded
    # (an arrival before the slot's load would count toward the release of the block before).
    q, q1, k_smem, k_smem1, v_smem, v_smem1, k_ready, k_empty, v_ready, v_empty, turn = ring
    NUM_WG: gl.constexpr = turn.shape[0]
    for j in range(n_blocks):
        g = it + j
        slot = g % STAGES
        mbarrier.wait(k_ready.index(slot), (g // STAGES) & 1)
        if PINGPONG:
            mbarrier.wait(turn.index(WG), g & 1)
            mbarrier.arrive(turn.index((WG + 1) % NUM_WG))
        mbarrier.arrive(k_empty.index(slot))
        mbarrier.wait(v_ready.index(slot), (g // STAGES) & 1)
        mbarrier.arrive(v_empty.index(slot))


@gluon.jit
def _row_ends(m_i, l_i, rows, Lse, off_hz, H, N_CTX_Q, q_start, q_len, VARLEN: gl.constexpr,
              STORE_LSE: gl.constexpr):
    # A tile's rows once their softmax is done: the LSE stored (not where an inference call
    # wants none: Lse is then Out) and 1 / l returned, 1 for rows that saw no key (l_i == 0:
    # their output is written as zeros). Issued while the last P V product runs.
    if STORE_LSE:
        lse = (m_i + gl.log2(l_i)) * LN2
        if VARLEN:  # flash-attn's [heads, total_q]
            lse_row = Lse + (off_hz % H).to(gl.int64) * N_CTX_Q + q_start
        else:
            lse_row = Lse + off_hz.to(gl.int64) * N_CTX_Q
        gl.store(lse_row + rows, lse, mask=rows < q_len)
    return 1.0 / gl.where(l_i == 0.0, 1.0, l_i)


@gluon.jit
def _normalized(acc, inv_l):
    # O / l in the output's dtype (acc in its wgmma layout, 1 / l per row in the scores' layout):
    # one reciprocal a row, a multiply an element
    inv_o = gl.convert_layout(inv_l, gl.SliceLayout(1, acc.type.layout))
    return acc * gl.expand_dims(inv_o, 1)


@gluon.jit
def _stage(acc, inv_l, buf):
    buf.store(_normalized(acc, inv_l).to(buf.dtype))


@gluon.jit
def _store(desc, b, hz, row, col, buf, VARLEN: gl.constexpr, STRIDED: gl.constexpr,
           HEAD_DIM: gl.constexpr):
    # The copy engine's store of the 2-D shared buffer buf into desc (_descriptor's) at rows
    # from `row`, columns from `col` of head `hz` (as _load's coordinates, b the batch).
    if VARLEN:
        tma_store(desc, [row, hz * HEAD_DIM + col], buf)
    elif STRIDED:
        tma_store(desc, [b, hz, row, col], buf.reshape([1, 1, buf.shape[0], buf.shape[1]]))
    else:
        tma_store(desc, [hz, row, col], buf.reshape([1, buf.shape[0], buf.shape[1]]))


@gluon.jit
def _store_by_copy(acc, acc1, inv_l, o_smem, o_smem1, o_desc, o_desc1, b, hz, row,
                   WG: gl.constexpr, VARLEN: gl.constexpr, STRIDED: gl.constexpr,
                   HEAD_DIM: gl.constexpr, SPLIT: gl.constexpr):
    # A consumer's block (both column parts of a split head_dim) staged in its shared buffers
    # and stored by the copy engine at head hz, rows from `row` (_store's coordinates). The copy
    # engine stores it while this warpgroup moves on to its next tile; only the next tile's
    # epilogue waits for it (the buffers are reused). (With O_IN_Q the buffers are Q's, and the
    # consumer waits for the store at once: the next tile's Q needs them.)
    tma.store_wait(0)
    _stage(acc, inv_l, o_smem.index(WG))
    if SPLIT:
        _stage(acc1, inv_l, o_smem1.index(WG))
    fence_async_shared()
    _store(o_desc, b, hz, row, 0, o_smem.index(WG), VARLEN, STRIDED, HEAD_DIM)
    if SPLIT:
        _store(o_desc1, b, hz, row, acc.shape[1], o_smem1.index(WG), VARLEN, STRIDED, HEAD_DIM)


@gluon.jit
def _store_part(acc, inv_l, o_base, stride_om, m0, col0, n_rows, HEAD_DIM: gl.constexpr):
    # Register stores of one column part (columns col0 on) of a consumer's rows; rows past the
    # sequence's n_rows and padding columns past HEAD_DIM are not out's.
    layout: gl.constexpr = acc.type.layout
    o_rows = m0 + gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, layout))
    o_cols = col0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, layout))
    o_ptrs = (o_base + gl.expand_dims(o_rows.to(gl.int64) * stride_om, 1)
              + gl.expand_dims(o_cols, 0))
    o_mask = gl.expand_dims(o_rows < n_rows, 1) & gl.expand_dims(o_cols < HEAD_DIM, 0)
    gl.store(o_ptrs, _normalized(acc, inv_l).to(o_base.dtype.element_ty), mask=o_mask)


@gluon.jit
def _store_rows(acc, acc1, inv_l, Out, stride_oz, stride_oh, stride_om, off_hz, H, q_start,
                m0, n_rows, HEAD_DIM: gl.constexpr, SPLIT: gl.constexpr):
    # A consumer's rows [m0, m0 + 64) of (batch, head) off_hz by register stores (both column
    # parts of a split head_dim); a packed sequence's rows start at q_start.
    o_base = (Out + (off_hz // H).to(gl.int64) * stride_oz
              + (off_hz % H).to(gl.int64) * stride_oh + gl.cast(q_start, gl.int64) * stride_om)
    _store_part(acc, inv_l, o_base, stride_om, m0, 0, n_rows, HEAD_DIM)
    if SPLIT:
        _store_part(acc1, inv_l, o_base, stride_om, m0, acc.shape[1], n_rows, HEAD_DIM)


@gluon.jit
def _consumer(args, WG: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr,
              SOFTCAP: gl.constexpr, TMA_STORE: gl.constexpr,
              D1: gl.constexpr, VARLEN: gl.constexpr, STRIDED: gl.constexpr,
              O_IN_Q: gl.constexpr, BLOCK_LOOPS: gl.constexpr, STORE_LSE: gl.constexpr,
              PINGPONG: gl.constexpr):
    # Consumer warpgroup WG of NUM_WG: rows [WG * 64, WG * 64 + 64) of each tile. With a split
    # head_dim (D1 > 0) every product runs as two wgmma, one per column part: S = Q0 K0^T +
    # Q1 K1^T chained on one accumulator, O0 += P V0 and O1 += P V1 into two.
    (q_smem, k_smem, v_smem, o_smem, q_smem1, k_smem1, v_smem1, o_smem1, q_ready, q_empty,
     k_ready, k_empty, v_ready, v_empty, turn, Out, Lse, stride_oz, stride_oh, stride_om, sched,
     n_hz, num_m, head_group, H, CuQ, CuK, N_CTX_Q, N_CTX_K, CAUSAL_OFFSET, LEFT_OFFSET, qk_scale,
     softcap_log2, ids, ids_ready, ids_empty) = args
    SPLIT: gl.constexpr = D1 > 0
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    D0: gl.constexpr = q_smem.shape[2]
    NUM_WG: gl.constexpr = q_smem.shape[0]  # the consumers, one Q block each
    TILE_M: gl.constexpr = NUM_WG * ROWS
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D0, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    dtype: gl.constexpr = q_smem.dtype
    if SPLIT:
        o_layout1: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, D1, 16])
        p_layout1: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout1,
                                                      k_width=2)
    q = q_smem.index(WG)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    if SPLIT:
        q1 = q_smem1.index(WG)
    else:  # unused
        q1 = q
    ring = (q, q1, k_smem, k_smem1, v_smem, v_smem1, k_ready, k_empty, v_ready, v_empty, turn)
    if TMA_STORE:  # out is contiguous [heads, seq, HEAD_DIM], or [batch, heads, seq,
        # HEAD_DIM] at 16-byte aligned strides for STRIDED (the launch checked); the copy
        # engine drops the rows of a block that run past the head's end. A packed out is
        # [total rows, heads * HEAD_DIM]: the epilogue stores only blocks inside a sequence
        # through it.
        o_desc, o_desc1 = _descriptors(Out, H if VARLEN else n_hz, N_CTX_Q, HEAD_DIM, o_smem,
                                       o_smem1, VARLEN, stride_om, H, stride_oz, stride_oh,
                                       STRIDED, SPLIT)
    it = 0  # K/V blocks consumed so far: ring slot, phases and ping-pong turn parity
    ti = 0  # tiles so far: Q phase
    # the tiles, as the loader walks them (_tile_number)
    n_tiles = n_hz * num_m
    r = 0
    t, count, fetched, seq, seq_first, more = _tile_number(
        r, 0, 0, 0, 0, sched, 0, ids, ids_ready, ids_empty, n_tiles, 0, H, num_m, head_group,
        CuQ, True, VARLEN, False, TILE_M)
    while more:
        off_hz, first_row, lo, n_blocks, q_start, q_len, k_start, k_len, offset, left = _tile(
            t, n_hz, num_m, head_group, H, CuQ, CuK, N_CTX_Q, N_CTX_K, CAUSAL_OFFSET,
            LEFT_OFFSET, CAUSAL, HAS_WINDOW, VARLEN, TILE_M, BLOCK_N)
        m0 = first_row + WG * ROWS
        rows = m0 + gl.arange(0, ROWS, layout=row_layout)
        # K blocks [first_full, full_blocks) are fully visible to every row of this warpgroup:
        # left of full_blocks for its first row, and (HAS_WINDOW) right of the window's left
        # edge for its last
        if CAUSAL:
            full_hi = gl.maximum(gl.minimum(m0 + offset + 1, k_len), 0)
        else:
            full_hi = k_len
        full_blocks = full_hi // BLOCK_N
        if HAS_WINDOW:
            first_full = gl.cdiv(gl.maximum(m0 + ROWS - 1 + left, 0), BLOCK_N)
        else:
            first_full = 0
        vis = (k_len, offset, left, first_full, qk_scale, softcap_log2)

        if m0 >= q_len:
            # Every row of this warpgroup is past the sequence's end (a ragged last tile): no
            # product, no store, only its part in the ring's and the ping-pong's barriers.
            mbarrier.wait(q_ready.index(WG), ti & 1)
            mbarrier.arrive(q_empty.index(WG))
            _pass_blocks(ring, it, n_blocks, WG, STAGES, PINGPONG)
        else:
            m_i = gl.full([ROWS], float("-inf"), gl.float32, row_layout)
            l_i = gl.zeros([ROWS], gl.float32, row_layout)
            acc = gl.zeros([ROWS, D0], gl.float32, o_layout)
            p_op = gl.zeros([ROWS, BLOCK_N], dtype, p_layout)
            alpha = gl.full([ROWS], 1.0, gl.float32, row_layout)  # O's next factor (no PINGPONG)
            if SPLIT:
                acc1 = gl.zeros([ROWS, D1], gl.float32, o_layout1)
            else:  # unused
                acc1 = acc

            mbarrier.wait(q_ready.index(WG), ti & 1)
            if n_blocks > 0:
                mbarrier.wait(k_ready.index(it % STAGES), (it // STAGES) & 1)
                # turn k waits for phase k of this warpgroup's turn barrier
                if PINGPONG:
                    mbarrier.wait(turn.index(WG), it & 1)
                s_tok = warpgroup_mma(q, k_smem.index(it % STAGES).permute((1, 0)), s_zero,
                                      use_acc=False, is_async=True)
                if SPLIT:
                    s_tok = warpgroup_mma(q1, k_smem1.index(it % STAGES).permute((1, 0)),
                                          s_tok, is_async=True)
                if PINGPONG:
                    mbarrier.arrive(turn.index((WG + 1) % NUM_WG))
                s = warpgroup_mma_wait(0, deps=[s_tok])
                mbarrier.arrive(k_empty.index(it % STAGES))
                p, alpha, l_i, m_i = _block_softmax(s, m_i, l_i, rows, lo, full_blocks, vis, CAUSAL,
                                                    HAS_WINDOW, SOFTCAP, BLOCK_N)
                p_op = gl.convert_layout(p.to(dtype), p_layout)

            # The blocks past the first, as BLOCK_LOOPS says (the launch's rule, `block_loops`):
            # none (every tile holds one K/V block), one loop choosing each block's mask at run
            # time, or two loops: the blocks every row of this warpgroup sees in full, then those it
            # sees in part (the causal diagonal, the keys' end), so the first loop holds no mask
            # arithmetic and no column indices in its registers. Under a window a masked loop
            # comes before them: the blocks its left edge cuts for some row of this warpgroup.
            if BLOCK_LOOPS == 1:
                for j in range(1, n_blocks):
                    acc, acc1, p_op, l_i, m_i, alpha = _next_block(
                        ring, it + j, acc, acc1, p_op, l_i, m_i, alpha, s_zero, rows, lo + j,
                        full_blocks, vis, WG, STAGES, None, CAUSAL, HAS_WINDOW, SOFTCAP, SPLIT,
                        PINGPONG)
            elif BLOCK_LOOPS == 2:
                # (j counts the tile's blocks, lo + j is the sequence's; lo is 0 without a window)
                if HAS_WINDOW:
                    edge_end = gl.minimum(gl.maximum(first_full - lo, 1), n_blocks)
                    for j in range(1, edge_end):
                        acc, acc1, p_op, l_i, m_i, alpha = _next_block(
                            ring, it + j, acc, acc1, p_op, l_i, m_i, alpha, s_zero, rows, lo + j,
                            full_blocks, vis, WG, STAGES, True, CAUSAL, HAS_WINDOW, SOFTCAP, SPLIT,
                            PINGPONG)
                else:
                    edge_end = 1
                full_end = gl.maximum(gl.minimum(full_blocks - lo, n_blocks), edge_end)
                for j in range(edge_end, full_end):
                    acc, acc1, p_op, l_i, m_i, alpha = _next_block(
                        ring, it + j, acc, acc1, p_op, l_i, m_i, alpha, s_zero, rows, lo + j,
                        full_blocks, vis, WG, STAGES, False, CAUSAL, HAS_WINDOW, SOFTCAP, SPLIT,
                        PINGPONG)
                for j in range(full_end, n_blocks):
                    acc, acc1, p_op, l_i, m_i, alpha = _next_block(
                        ring, it + j, acc, acc1, p_op, l_i, m_i, alpha, s_zero, rows, lo + j,
                        full_blocks, vis, WG, STAGES, True, CAUSAL, HAS_WINDOW, SOFTCAP, SPLIT,
                        PINGPONG)
            # Q is no longer read: the loader may bring in the next tile's while this one ends
            # (O_IN_Q: once the output staged in Q's buffer has left, below)
            if not O_IN_Q:
                mbarrier.arrive(q_empty.index(WG))

            if n_blocks > 0:
                last = (it + n_blocks - 1) % STAGES
                mbarrier.wait(v_ready.index(last), ((it + n_blocks - 1) // STAGES) & 1)
                if not PINGPONG:  # the last block's factor, before its P V
                    acc, acc1 = _scale_o(acc, acc1, alpha, SPLIT,
                                         (not SPLIT) and D0 >= LAZY_COLUMNS)
                acc = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
                if SPLIT:
                    acc1 = warpgroup_mma(gl.convert_layout(p_op, p_layout1),
                                         v_smem1.index(last), acc1, is_async=True)
                inv_l = _row_ends(m_i, l_i, rows, Lse, off_hz, H, N_CTX_Q, q_start, q_len,
                                  VARLEN, STORE_LSE)
                if SPLIT:
                    acc, acc1 = warpgroup_mma_wait(0, deps=[acc, acc1])
                else:
                    acc = warpgroup_mma_wait(0, deps=[acc])
                mbarrier.arrive(v_empty.index(last))
            else:
                inv_l = _row_ends(m_i, l_i, rows, Lse, off_hz, H, N_CTX_Q, q_start, q_len,
                                  VARLEN, STORE_LSE)

            # epilogue: O / l, stored
            o_batch, o_head = _view_head(off_hz, H, VARLEN, STRIDED)
            if TMA_STORE and VARLEN:
                # the copy engine may store only a block wholly inside its sequence
                if m0 + ROWS <= q_len:
                    _store_by_copy(acc, acc1, inv_l, o_smem, o_smem1, o_desc, o_desc1, o_batch,
                                   o_head, q_start + m0, WG, VARLEN, STRIDED, HEAD_DIM, SPLIT)
                else:
                    _store_rows(acc, acc1, inv_l, Out, stride_oz, stride_oh, stride_om,
                                off_hz, H, q_start, m0, q_len, HEAD_DIM, SPLIT)
            elif TMA_STORE:  # it drops the rows past a head's end
                _store_by_copy(acc, acc1, inv_l, o_smem, o_smem1, o_desc, o_desc1, o_batch, o_head,
                               m0, WG, VARLEN, STRIDED, HEAD_DIM, SPLIT)
            else:  # an out the copy engine cannot address
                _store_rows(acc, acc1, inv_l, Out, stride_oz, stride_oh, stride_om, off_hz, H,
                            q_start, m0, q_len, HEAD_DIM, SPLIT)
            if O_IN_Q:  # the store has read Q's buffer: the next tile's Q may come in
                tma.store_wait(0)
                mbarrier.arrive(q_empty.index(WG))
        it += n_blocks
        ti += 1
        r += 1
        t, count, fetched, seq, seq_first, more = _tile_number(
            r, count, fetched, seq, seq_first, sched, 0, ids, ids_ready, ids_empty, n_tiles, 0,
            H, num_m, head_group, CuQ, False, VARLEN, False, TILE_M)
    if TMA_STORE:
        tma.store_wait(0)  # the last store must have read shared memory before the exit


@gluon.jit
def _attn_fwd_hopper(Q, K, V, Out, Lse, CuQ, CuK, Counter, Sched, stride_qm, stride_km, stride_vm,
                     stride_oz, stride_oh, stride_om, stride_qz, stride_qh, stride_kz, stride_kh,
                     stride_vz, stride_vh,
                     BATCH, H, GROUP, N_CTX_Q, N_CTX_K, CAUSAL_OFFSET, LEFT_OFFSET, qk_scale,
                     softcap_log2, HEAD_GROUP, SCHED_STRIDE, NUM_M,
                     HEAD_DIM: gl.constexpr, BLOCK_D0: gl.constexpr, BLOCK_D1: gl.constexpr,
                     BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                     CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr, SOFTCAP: gl.constexpr,
                     CONSUMER_REGS: gl.constexpr, Q_LAYOUT: gl.constexpr,
                     KV_LAYOUT: gl.constexpr, Q_LAYOUT1: gl.constexpr, KV_LAYOUT1: gl.constexpr,
                     TMA_STORE: gl.constexpr, VARLEN: gl.constexpr, STRIDED: gl.constexpr,
                     O_IN_Q: gl.constexpr, BLOCK_LOOPS: gl.constexpr, NUM_WG: gl.constexpr,
                     STORE_LSE: gl.constexpr, PINGPONG: gl.constexpr):
    # Persistent: program pid runs the tiles of row pid of the host's schedule (tile_schedule):
    # their count, then their numbers in _tile's order. NUM_M: query tiles per head (of the
    # longest sequence, for a packed batch: VARLEN, CuQ and CuK its cumulative lengths, Q, K
    # and V rows stride_qm, stride_km and stride_vm apart). STRIDED: a dense call whose q, k, v
    # or out is not contiguous, each seen at its batch, head and row strides (_descriptor);
    # those strides are unused otherwise.
    # A packed batch's programs take tiles as they go instead (_loader), counted by Counter
    # (one int32, zero at the launch).
    qk_scale = qk_scale.to(gl.float32)
    softcap_log2 = softcap_log2.to(gl.float32)
    sched = Sched + gl.program_id(0) * SCHED_STRIDE  # not read by a packed batch's programs
    n_hz = BATCH * H
    num_m = NUM_M

    dtype: gl.constexpr = Q.dtype.element_ty
    # Q, the K/V ring and the output staging hold columns [0, BLOCK_D0) of head_dim; a split
    # head_dim (BLOCK_D1 > 0) has a second set of buffers for the columns from BLOCK_D0 on.
    q_smem = gl.allocate_shared_memory(dtype, [NUM_WG, ROWS, BLOCK_D0], Q_LAYOUT)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_D0], KV_LAYOUT)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_D0], KV_LAYOUT)
    if BLOCK_D1 > 0:
        q_smem1 = gl.allocate_shared_memory(dtype, [NUM_WG, ROWS, BLOCK_D1], Q_LAYOUT1)
        k_smem1 = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_D1], KV_LAYOUT1)
        v_smem1 = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_D1], KV_LAYOUT1)
    else:  # unused
        q_smem1 = q_smem
        k_smem1 = k_smem
        v_smem1 = v_smem
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_WG, 1], bar_layout)
    q_empty = gl.allocate_shared_memory(gl.int64, [NUM_WG, 1], bar_layout)
    turn = gl.allocate_shared_memory(gl.int64, [NUM_WG, 1], bar_layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    for i in gl.static_range(NUM_WG):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)
        mbarrier.init(turn.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=NUM_WG)  # one arrival per consumer warpgroup
        mbarrier.init(v_empty.index(i), count=NUM_WG)
    # A packed batch's tile numbers, from the loader to the consumers (_publish). (Allocated
    # only where used: Triton 3.6 fails to lower a kernel with an unused shared buffer.)
    ids = q_ready  # unused without VARLEN
    ids_ready = q_ready
    ids_empty = q_ready
    if VARLEN:
        ids = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        ids_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
        ids_empty = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
        for i in gl.static_range(2):
            mbarrier.init(ids_ready.index(i), count=1)
            mbarrier.init(ids_empty.index(i), count=NUM_WG)
    # warpgroup 0 has the first turn: its turn barrier starts one phase ahead
    mbarrier.arrive(turn.index(0))
    fence_async_shared()

    o_smem = q_smem  # unused without TMA_STORE; with O_IN_Q, outputs are staged in Q's buffers
    o_smem1 = q_smem1
    if TMA_STORE and not O_IN_Q:  # one output block per consumer for the copy engine's stores
        o_smem = gl.allocate_shared_memory(dtype, [NUM_WG, ROWS, BLOCK_D0], Q_LAYOUT)
        if BLOCK_D1 > 0:
            o_smem1 = gl.allocate_shared_memory(dtype, [NUM_WG, ROWS, BLOCK_D1], Q_LAYOUT1)
    shared = (q_smem, k_smem, v_smem, o_smem, q_smem1, k_smem1, v_smem1, o_smem1, q_ready,
              q_empty, k_ready, k_empty, v_ready, v_empty, turn, Out, Lse, stride_oz, stride_oh,
              stride_om, sched, n_hz, num_m, HEAD_GROUP, H, CuQ, CuK, N_CTX_Q, N_CTX_K,
              CAUSAL_OFFSET, LEFT_OFFSET, qk_scale, softcap_log2, ids, ids_ready, ids_empty)
    loads = (Q, K, V, q_smem, k_smem, v_smem, q_smem1, k_smem1, v_smem1, q_ready, q_empty,
             k_ready, k_empty, v_ready, v_empty, sched, n_hz, num_m, HEAD_GROUP, H, GROUP, CuQ,
             CuK, N_CTX_Q, N_CTX_K, CAUSAL_OFFSET, LEFT_OFFSET, stride_qm, stride_km, stride_vm,
             stride_qz, stride_qh, stride_kz, stride_kh, stride_vz, stride_vh, ids, ids_ready,
             ids_empty, Counter)
    # (Constexpr arguments are written out in each tuple literal: a tuple held in a variable or
    # built with + turns them into runtime values.)
    if NUM_WG == 3:
        gl.warp_specialize([
            (_consumer, (shared, 0, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, HAS_WINDOW, SOFTCAP,
                         TMA_STORE, BLOCK_D1, VARLEN, STRIDED, O_IN_Q, BLOCK_LOOPS,
                         STORE_LSE, PINGPONG)),
            (_consumer, (shared, 1, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, HAS_WINDOW, SOFTCAP,
                         TMA_STORE, BLOCK_D1, VARLEN, STRIDED, O_IN_Q, BLOCK_LOOPS,
                         STORE_LSE, PINGPONG)),
            (_consumer, (shared, 2, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, HAS_WINDOW, SOFTCAP,
                         TMA_STORE, BLOCK_D1, VARLEN, STRIDED, O_IN_Q, BLOCK_LOOPS,
                         STORE_LSE, PINGPONG)),
            (_loader, (loads, HEAD_DIM, CAUSAL, HAS_WINDOW, BLOCK_N, STAGES, BLOCK_D1, VARLEN,
                       STRIDED, O_IN_Q)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, LOADER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (shared, 0, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, HAS_WINDOW, SOFTCAP,
                         TMA_STORE, BLOCK_D1, VARLEN, STRIDED, O_IN_Q, BLOCK_LOOPS,
                         STORE_LSE, PINGPONG)),
            (_consumer, (shared, 1, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, HAS_WINDOW, SOFTCAP,
                         TMA_STORE, BLOCK_D1, VARLEN, STRIDED, O_IN_Q, BLOCK_LOOPS,
                         STORE_LSE, PINGPONG)),
            (_loader, (loads, HEAD_DIM, CAUSAL, HAS_WINDOW, BLOCK_N, STAGES, BLOCK_D1, VARLEN,
                       STRIDED, O_IN_Q)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


# (BLOCK_N, STAGES, consumer registers, consumer warpgroups) per head_dim, measured on the H200
# with benchmarks/labs/hopper_lab.py (notes/forward.md, "The Gluon kernel"); THREE_CONSUMERS
# below for head_dim 64's calls of many tiles. The schedule is persistent (one program per SM);
# the consumers' ping-pong is pingpong_for's rule (at 64, without it 0.6913 against 0.6842 ms
# at (4,32,4096,64), an earlier kernel). head_dim 80, 96 (two column parts) and 112 (padded to
# 128) take the head_dim-128 config; a third ring stage, which their smaller tiles leave room for,
# measured within 2 % either way. At 256 and 192 (128 + 64) a consumer's fp32 O accumulator
# takes 128 or 96 registers a thread, so K/V blocks are 64 keys (S: 32 registers); at 256 two
# ring stages of 64 keys and Q take 192 KB of shared memory, which leaves no room for the
# output's staging buffers (outputs are staged in Q's, O_IN_Q). A third stage at 128 or 192
# (which then stages in Q's buffer too) measured 4-11 % and 1-6 % slower, at 192 7-12 % with
# register stores before O_IN_Q (notes/lab/gluon_third_stage_h200.txt). Offline sm_90 SASS
# (benchmarks/sass_offline.py --gluon --head-dim N): Triton 3.6 and 3.7.1 keep a stack only at
# 256 (8 B) and 128 (16 B, with or without the turns); 3.9 at 96-256 (32-88 B: at 128 mostly
# kernel arguments stored on entry and reloaded in the partitions). Timed against the Triton
# kernel and cuDNN in notes/forward.md ("Which calls it takes", "Column parts instead of
# padding").
CONFIG_FIELDS = ("BLOCK_N", "STAGES", "consumer_regs", "consumers")
CONFIGS = {64: (128, 3, 240, 2), 80: (128, 2, 240, 2), 96: (128, 2, 240, 2),
           112: (128, 2, 240, 2), 128: (128, 2, 240, 2), 192: (64, 2, 240, 2),
           256: (64, 2, 240, 2)}


def table_config(head_dim):
    """The CONFIGS entry a head_dim runs: its own, or for another multiple of 8 between the
    table's (72-120, 136-248) that of its family, 128's above 64 and 256's above 128: the same
    fp32 O accumulator per consumer at most (64-key blocks once it passes 64 registers a thread
    with S beside it), its column parts by column_parts (72 = 64 + 16 with the last 8 columns
    read as zeros, 160 = 128 + 32, 224 = one part of 256). None where the kernel takes no such
    head_dim (not a multiple of 8, the copy engine's 16-byte rows; under 64 or over 256).
    layout_for gives 136-160 128-key blocks on long calls."""
    if head_dim in CONFIGS:
        return CONFIGS[head_dim]
    if head_dim % 8 or not 64 < head_dim <= 256:
        return None
    return CONFIGS[128 if head_dim <= 128 else 256]


def ring_bytes(config, parts, element_size=2):
    """Shared memory a launch of this config and these column parts needs for its consumers' Q
    blocks and its K/V ring (fp16/bf16 by default), without the output's staging buffers."""
    block_n, stages, _, consumers = config
    return (consumers * ROWS.value + 2 * stages * block_n) * sum(parts) * element_size


# head_dim 64 takes this kernel from MIN_QUERIES queries on: below, the Triton kernel is faster
# (0.0604 against 0.0745 ms at (8,16,1024,64), Triton 3.6); above, the two are within 1 % on
# Triton 3.6 (0.6816 against 0.6878 ms at (4,32,4096,64)), but the Triton kernel's code is
# the compiler's and lost 4.6 % there under Triton 3.9 (0.714 against 0.683 ms), where this
# kernel's schedule is its own (notes/forward.md, "Triton releases").
MIN_QUERIES = {64: 2049}
# Three consumer warpgroups (192-row tiles, FA3's and FA4's shape at head_dim 64) instead of the
# table's two, at 160 registers each (the register file's share of four warpgroups, the loader's
# padded to one), for dense calls that give every program at least MIN_TILES_PER_PROGRAM of
# those tiles, have no softcap and whose window, if any, reaches MIN_WINDOW_KEYS keys left or
# more (`three_consumers`), with an output the copy engine stores. At 128-key blocks a consumer
# holds S, P and O within 160 registers in the unmasked loop; a masked block waits for the P V
# product before its softmax (`_next_block`'s SERIAL), which else spills (Triton 3.6, offline).
# H200, Triton 3.6, against two consumers (notes/lab/gluon_three_consumers_rule_h200.txt, before
# SERIAL): 6.5-7.6 % faster at long rows ((8,16,16384,64): 9.05 against 9.79 ms), 11 % slower
# at (2,16,2500,64) (3.4 such tiles a program) and 22 % at (1,8,4096,64) (1.3): with few tiles
# a program, the longest tile, half as long again as a 128-row one, sets the end. SERIAL took
# 0.5-4 % more off (notes/lab/gluon_three_consumers_serial_window_h200.txt): (4,32,4096,64)
# 0.654 against 0.676 ms without it (two consumers: 0.665-0.669 in other jobs). Windows (same
# file): 0.94 of two consumers' time at a 4096-key window, 1.05 at 2048, 1.31 at 1024, 1.58 at
# 512 ((4,32,8192,64,kv8)); softcap 30 1.45 at (8,16,8192,64) (its softmax spills at 160
# registers); bshd views 0.93. Non-causal calls, windowed or not, follow the causal rule (their
# GPU tests ran on three consumers; their speed there was not timed). The bound of 4 tiles a
# program (same file, SERIAL on): 0.93-0.98 of two consumers' time at 5.2-7.8 tiles a program
# at 8192 queries, level at 5.3 at 4096 ((2,16,4096,64)); 0.95 at 3.9 ((1,12,8192,64)) but
# 1.11 at 3.4 ((2,16,2500,64), before SERIAL).
THREE_CONSUMERS = {64: (128, 2, 160, 3)}
MIN_TILES_PER_PROGRAM = 4
MIN_WINDOW_KEYS = 3072
# A thread's registers over the consumer warpgroups together: the SM's 64K over 128 threads a
# warpgroup, less the loader warpgroup's
CONSUMER_REGISTERS = 65536 // 128 - LOADER_REGS.value
# A dense call whose tiles fit in one program each (no more than the SMs) and whose tiles are
# short, keys x head_dim <= SHORT_WORK (256 keys at head_dim 128, 128 at 256, 409 at 80), takes
# the Triton kernel: each program then pays this kernel's fixed costs (its partitions' start,
# the device-side TMA descriptors) for one or two K/V blocks. Through the op, H200, Triton 3.6,
# this rule against the Gluon kernel everywhere (notes/lab/gluon_vs_triton_short_h200.txt):
# 0.786-0.980 of the time at 128-256 keys and head_dim 80-128 ((1,8,128,80): 0.0109 against
# 0.0139 ms; (1,32,128,128): 0.0108 against 0.0129; (2,16,256,128): 0.0138 against 0.0155) and
# at (1,8,128,192) 0.960; at 256 keys and head_dim 192 or 256 (work past the bound) the
# Triton kernel was 2-7 % slower, at (1,8,500,96) the two tied. Launched directly
# (benchmarks/labs/hopper_lab.py --time), the two traded places by up to 11 % at ~500 keys and
# the Gluon kernel won from 1024 keys at every head_dim, by 1.4-1.9x with many tiles. The bound
# between those points (e.g. 409 keys at head_dim 80) is the rule's, not measured at each.
SHORT_WORK = 256 * 128
# Few keys at the head dims split into column parts with 128-key blocks (80, 96; 72 and 88 follow
# the same rule, not timed), in a dense call
# of more 128-row tiles than SMs (`layout_for`): a tile there holds one to four K/V blocks, too
# few to repay the split's extra loads, wgmma and stores per block. Up to PADDED_KEYS keys (one
# block a tile) a split whose second part is 16 columns wide (80 = 64 + 16: 32-byte box rows,
# N=16 wgmma) runs one part padded to 128 columns instead; from there up to SHORT_KEYS, 64-key
# blocks (more blocks a tile for the consumers' overlap and ping-pong). H200, Triton 3.6,
# causal, against the table's split (notes/lab/gluon_short_keys_h200.txt, two jobs):
# - padded 0.4506 against 0.4848 ms at (1024,16,128,80,kv 4) (64-key blocks: 0.5235); at 96
#   (a 32-column part) no gain: 0.5091 against 0.4672 at (1024,16,128,96), rounds overlapping;
# - 64-key blocks 0.7600 against 0.8682 at (262,16,500,80), 0.5777 against 0.6075 at
#   (512,16,256,80,kv 4), 0.6494 against 0.7394 at (512,16,256,96), 0.4247 against 0.4460 at
#   (100,16,640,80,kv 4), past the bound; 0.8247 against 0.8128 at (262,16,500,96,kv 2);
# - from 1024 keys the split wins where the work is long: 1.2028 against 1.2485 (64-key
#   blocks) and 1.2570 (padded) at (128,16,1024,96,kv 2), 1.8188 against 2.0837 and 2.0571 at
#   (65,16,2000,80,kv 2) (at (8,16,1024,96), 128 tiles, the three within 2 %);
# - with few tiles 64-key blocks lost: (1,8,500,96,kv 2) 0.0201 against 0.0173 ms through the
#   op (two wide sweeps), hence the tile count;
# - at 192 (64-key blocks already) padding to 256 lost 26-35 %.
PADDED_KEYS = 128
SHORT_KEYS = 512
# head_dim 136-160 on 128-key blocks (O 80 registers a thread next to S, no spills offline)
# against 64-key ones, the Gluon kernel alone (H200, Triton 3.6, hopper_lab.py, interleaved):
# 0.905-0.91 of the time at 8192-16384 keys, 0.96-0.97 at 4096, 1.00 at 2048, 1.12 at 1024
# (notes/lab/gluon_wide_blocks_d160_h200.txt)
WIDE_BLOCK_KEYS = 2048
# Packed batches (fused_attention_varlen) take this kernel at these head dims, at 64 as dense
# calls do, from MIN_QUERIES queries, here a sequence on average (total queries / sequences):
# with two block loops it ran 2.6-5.6 % faster than the Triton kernel on packed batches of longer
# sequences (the serving sweep's 16 lengths of 272-3916, 32 / 8 heads: 1.208 against 1.270 ms;
# 16384 + 8192 + 3000 + 12000: 4.58 against 4.72) and 15-30 % slower on 256 sequences of
# 64-1024 (1.724 against 1.492), as dense calls under 2049 queries
# (notes/lab/gluon_block_loops_varlen_h200.txt). Where between a mean of 503 queries (lost) and
# 2047 (won: 0.961 ms against the Triton kernel's 1.020, same file) the two cross was not
# measured; the threshold is the dense one, so that 2047-query batch takes the Triton kernel.
# Not where the column parts pad head_dim (112: a box would read the neighbouring head's columns).
PACKED_HEAD_DIMS = frozenset({64, 80, 96, 128, 192, 256})
_GL_DTYPES = {"torch.float16": gl.float16, "torch.bfloat16": gl.bfloat16}
TILE_ROWS = 2 * ROWS.value  # query rows of a tile of two consumers (CONFIGS')
# Shared memory one program may take on sm_90 (227 KB), less 1 KB for the mbarriers and what
# the compiler adds (504 B at head_dim 128).
SHARED_MEMORY_BYTES = 227 * 1024 - 1024


def supports(q, k, v, out, varlen=None):
    """True when this kernel takes the call: a CUDA sm_90 device, fp16/bf16, a head_dim table_config
    takes, non-empty q/k/v [batch, heads, seq, head_dim] at 16-byte aligned addresses, each
    contiguous or with a unit last stride and the others positive 16-byte multiples (bshd, padded
    rows, K/V slices; `tma_strided_ok`: a launch with any such tensor views every tensor at its
    strides, otherwise each as [batch * heads, seq, head_dim]), and out with unit last
    stride. Any query and key length, but a dense call of short tiles (SHORT_WORK) no more than
    the SMs runs the Triton kernel (faster there). A packed batch (`varlen`, as
    attention_fwd_triton's: the views with batch stride 0 of packed [total, heads, head_dim]
    tensors) needs a head_dim in PACKED_HEAD_DIMS (64: MIN_QUERIES queries a sequence on average,
    q.shape[2] being the packed total and q.shape[0] the sequences), a tile count within the
    kernel's int32 (packed_tiles_ok) and in each packed tensor a unit last stride, heads next to
    each other and rows at 16-byte aligned strides."""
    # cheapest refusals first: this runs on every eager call
    head_dim = q.shape[-1]
    if varlen is None:
        shape_ok = (table_config(head_dim) is not None
                    and q.shape[2] >= MIN_QUERIES.get(head_dim, 0))
    else:
        shape_ok = (head_dim in PACKED_HEAD_DIMS and packed_tiles_ok(*q.shape[:2], varlen[2])
                    and q.shape[2] >= MIN_QUERIES.get(head_dim, 0) * q.shape[0])
    return (shape_ok and str(q.dtype) in _GL_DTYPES and q.is_cuda
            and k.dtype == q.dtype and v.dtype == q.dtype and out.dtype == q.dtype
            and q.numel() > 0 and k.numel() > 0 and out.stride(-1) == 1
            and (tma_strided_ok(q) and tma_strided_ok(k) and tma_strided_ok(v) if varlen is None
                 else _packed(q) and _packed(k) and _packed(v))
            and q.data_ptr() % 16 == 0 and k.data_ptr() % 16 == 0 and v.data_ptr() % 16 == 0
            and device_properties(q.device).major == 9
            and (varlen is not None or not _short(q, k)))


def _short(q, k):
    # SHORT_WORK's rule: short tiles, no more than the SMs (q on an sm_90 device)
    batch, heads, q_len, head_dim = q.shape
    return (k.shape[2] * head_dim <= SHORT_WORK and batch * heads * -(-q_len // TILE_ROWS)
            <= device_properties(q.device).multi_processor_count)


def three_consumers(head_dim, pairs, q_len, programs, left=-1, softcap=False):
    """Whether a dense call of `pairs` (batch, head) pairs of q_len queries on `programs`
    persistent programs runs THREE_CONSUMERS' config: its head_dim has one, its tiles (192 rows)
    number MIN_TILES_PER_PROGRAM a program or more, it has no softcap, and a window's left
    reach (`left` keys, -1 unbounded) is MIN_WINDOW_KEYS or more."""
    if head_dim not in THREE_CONSUMERS or softcap:
        return False
    tile_rows = ROWS.value * THREE_CONSUMERS[head_dim][3]
    return ((left < 0 or left >= MIN_WINDOW_KEYS)
            and pairs * -(-q_len // tile_rows) >= MIN_TILES_PER_PROGRAM * programs)


def _config_fits(config):
    # A config the kernel can run: two or three consumer partitions, whose registers fit beside
    # the loader warpgroup's (CONSUMER_REGISTERS; the tables' all do; a lab's may not)
    consumers, regs = config[3], config[2]
    return consumers in (2, 3) and consumers * regs <= CONSUMER_REGISTERS


def packed_tiles_ok(batch, heads, max_q):
    """Whether the tile numbers of a packed batch of `batch` sequences, the longest max_q, fit
    the kernel's int32: (batch * heads + head) * query blocks of the longest + query block
    (_packed_tile), and the hand-out's numbers, up to the tiles plus the program count."""
    return batch * heads * -(-max_q // TILE_ROWS) < 2 ** 31 - 2 ** 16


def _packed(t):
    # t, the [batch, heads, total, head_dim] view of a packed [total, heads, head_dim] whose
    # rows the copy engine can read as [total, heads * head_dim] with any row stride
    _, heads, _, head_dim = t.shape
    _, stride_h, stride_m, stride_d = t.stride()
    return (stride_d == 1 and stride_h == head_dim and stride_m >= heads * head_dim
            and stride_m * t.element_size() % 16 == 0)


def attention_fwd_hopper(q, k, v, out, lse, *, causal, scale, causal_offset, window=(-1, -1),
                         softcap=0.0, varlen=None, config=None, parts=None, loops=None,
                         pingpong=None, key=None):
    """Launch the Hopper forward on inputs `supports` accepts; arguments as
    attention_fwd.attention_fwd_triton's (`window` and `softcap` as fused_attention's; `varlen`:
    (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) for a packed batch, q/k/v/out its
    [batch, heads, total, head_dim] views, lse [heads, total_q]; an lse of None: no LSE
    stored): `config` a tuple named by CONFIG_FIELDS and `parts` the column parts (D0, D1)
    instead of layout_for's (the lab; a dense call's parts may pad, D0 + D1 >= head_dim, a
    packed batch's must be head_dim exactly),
    `loops` the kernel's BLOCK_LOOPS instead of block_loops' (the lab; 0 only for a dense call of
    at most one K/V block a tile), `pingpong` the kernel's PINGPONG instead of pingpong_for's
    (the lab), `key` the dispatch's launch key for this call (built here when None)."""
    batch, heads, q_len, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    if config is not None and len(config) != len(CONFIG_FIELDS):
        raise ValueError(f"config must be a tuple of {CONFIG_FIELDS}, got {config!r}")
    if config is not None and not _config_fits(config):
        raise ValueError(f"config {config}: 2 or 3 consumers of at most "
                         f"{CONSUMER_REGISTERS // max(config[3], 1)} registers")
    if parts is not None and not _parts_ok(parts, head_dim, varlen is not None):
        raise ValueError(f"parts must be (D0, D1), powers of two from 16 to 256 with D0 >= D1 (D1 "
                         f"may be 0), covering head_dim {head_dim}{' exactly' if varlen else ''}, "
                         f"got {parts!r}")
    dtype = str(q.dtype)
    # what each row sees (a window's right edge is the causal bound moved right) and the scores'
    # scales, as the Triton kernel takes them
    bounded, offset, has_window, left_offset = visibility(causal, causal_offset, window)
    qk_scale, softcap_log2, has_softcap = score_scales(scale, softcap)
    cu_q, cu_k, max_q, max_k = (None, None, q_len, kv_len) if varlen is None else varlen
    sms = device_properties(q.device).multi_processor_count
    # the output leaves by the copy engine where it can address out: contiguous, or at its
    # strides (out_strided, with the inputs' STRIDED view below); else by register stores
    out_strided = not out.is_contiguous() and tma_strided_ok(out) and out.data_ptr() % 16 == 0
    stored_by_copy = ((_packed(out) if varlen else out.is_contiguous() or out_strided)
                      and out.data_ptr() % 16 == 0)
    if (config is None and varlen is None and stored_by_copy
            and three_consumers(head_dim, batch * heads, q_len, sms, window[0], has_softcap)):
        config = THREE_CONSUMERS[head_dim]
    tile_rows = ROWS.value * (config or table_config(head_dim))[3]
    num_m = -(-max_q // tile_rows)
    tiles = batch * heads * num_m
    grid = (min(tiles, sms),)  # one per SM
    chosen, table = layout_for(head_dim, kv_len, varlen is None and tiles > grid[0])
    if parts is None:
        parts = chosen
    else:  # a lab's parts: layout_for's config where Q and its ring fit them, else the family's
        parts = tuple(parts)
        if ring_bytes(table, parts, q.element_size()) > SHARED_MEMORY_BYTES:
            table = table_config(head_dim)
    config = table if config is None else config
    block_n, stages, regs, consumers = config
    # a packed batch's tiles go one sequence after another, its heads grouped as a dense call's
    group = head_group(q, k) if varlen is None else head_group(q, k, kv_len=max_k, pairs=heads)
    if varlen is None:
        sched = tile_schedule(q.device, batch * heads, num_m, group, grid[0], tile_rows, block_n,
                              kv_len, bounded, offset, left_offset if has_window else None)
        sched_width, counter = sched.shape[1], None
    else:  # tiles handed out on the device (_loader), counted from zero at every launch
        counter = torch.zeros(1, dtype=torch.int32, device=q.device)
        sched, sched_width = counter, 0  # a placeholder: the kernel reads no schedule
    # A dense call whose q, k or v is not contiguous, or whose out is not but the copy engine
    # can store it, views all four at their strides (STRIDED; an out it cannot address takes
    # the register stores either way)
    strided = varlen is None and (out_strided or not (
        q.is_contiguous() and k.is_contiguous() and v.is_contiguous()))
    # (batch, head and row strides; without STRIDED the batch and head ones of q, k, v unused)
    view_strides = tma_view_strides if strided else (lambda t: t.stride()[:3])
    (stride_qz, stride_qh, stride_qm), (stride_kz, stride_kh, stride_km), (
        stride_vz, stride_vh, stride_vm), (stride_oz, stride_oh, stride_om) = map(
            view_strides, (q, k, v, out))
    args = (q, k, v, out, out if lse is None else lse, cu_q, cu_k, counter, sched, stride_qm,
            stride_km, stride_vm, stride_oz, stride_oh, stride_om, stride_qz, stride_qh,
            stride_kz, stride_kh, stride_vz, stride_vh,
            batch, heads, heads // kv_heads, q_len, kv_len, offset, left_offset, qk_scale,
            softcap_log2, group, sched_width, num_m)
    # Output blocks by TMA store where the copy engine can address out (contiguous, or at its
    # strides for STRIDED): 0.1004 against 0.1088 ms with register stores at (8,16,1024,128)
    # (notes/forward.md, "TMA, both directions"). They are staged in buffers of their own where
    # those fit in shared memory next to Q and the K/V ring, else in the consumer's Q buffer
    # (O_IN_Q: head_dim 256, or a lab's config of more stages), which then takes the next
    # tile's Q only once the store has read it (the loader sends that tile's first K/V blocks
    # ahead of its Q). A packed batch's blocks that run past their sequence's end leave by
    # register stores (the copy engine would write them over the next sequence's rows).
    d0, d1 = parts
    if loops is None:
        loops = block_loops(d0, d1, block_n, None if varlen else kv_len)
    elif loops not in (1, 2) and not (loops == 0 and varlen is None and kv_len <= block_n):
        # (no loop where a tile holds more blocks would leave the loader's ring unread: a hang)
        raise ValueError(f"loops must be 1 or 2, or 0 for a dense call of at most one {block_n}"
                         f"-key block a tile; got {loops!r} at {kv_len} keys"
                         f"{' (packed)' if varlen else ''}")
    if pingpong is None:
        pingpong = pingpong_for(head_dim, block_n, None if varlen else kv_len)
    tile_bytes = ROWS.value * (d0 + d1) * q.element_size()  # one consumer's Q or O block
    smem = ring_bytes(config, parts, q.element_size())
    if smem > SHARED_MEMORY_BYTES:  # (a lab's config or parts; the table's all fit)
        raise ValueError(f"config {config} with column parts {(d0, d1)} needs {smem} B of shared "
                         f"memory for Q and the K/V ring, more than {SHARED_MEMORY_BYTES}")
    staging_fits = smem + consumers * tile_bytes <= SHARED_MEMORY_BYTES
    kwargs = dict(HEAD_DIM=head_dim, BLOCK_D0=d0, BLOCK_D1=d1, BLOCK_N=block_n, STAGES=stages,
                  CAUSAL=bounded, HAS_WINDOW=has_window, SOFTCAP=has_softcap, CONSUMER_REGS=regs,
                  Q_LAYOUT=_smem_layout(ROWS.value, d0, dtype),
                  KV_LAYOUT=_smem_layout(block_n, d0, dtype),
                  Q_LAYOUT1=_smem_layout(ROWS.value, d1 or d0, dtype),
                  KV_LAYOUT1=_smem_layout(block_n, d1 or d0, dtype),
                  TMA_STORE=stored_by_copy, O_IN_Q=stored_by_copy and not staging_fits,
                  VARLEN=varlen is not None, STRIDED=strided, BLOCK_LOOPS=loops, NUM_WG=consumers,
                  STORE_LSE=lse is not None, PINGPONG=bool(pingpong), num_warps=4)
    ensure_scratch_allocator()  # the loader makes its TMA descriptors on the device
    if key is None:  # q, k, v are 16-byte aligned (supports): shapes and strides say the rest
        key = ("gluon", q.device, q.dtype, lse is None or lse.dtype, q.shape, k.shape,
               q.stride(), k.stride(), v.stride(), out.stride(),
               aligned(out, out if lse is None else lse), stored_by_copy, sched_width,
               causal, causal_offset, scale, window, softcap, grid, config, parts, loops,
               pingpong)
        if varlen is not None:
            key += ("varlen", max_q, max_k, aligned(cu_q, cu_k))
    launch = _launch if varlen is None else _launch_packed
    return launch(key, grid, args, kwargs, per_call=5 if varlen is None else 8,
                  config=dict(zip(CONFIG_FIELDS, config), BLOCK_D0=d0, BLOCK_D1=d1,
                               BLOCK_LOOPS=loops, PINGPONG=bool(pingpong)))


# The consumers' ping-pong (`pingpong_for`): always up to PINGPONG_MAX_HEAD_DIM; above it only
# for dense calls of at most PINGPONG_SHORT_BLOCKS K/V blocks of keys.
PINGPONG_MAX_HEAD_DIM = 96
PINGPONG_SHORT_BLOCKS = 4


def pingpong_for(head_dim, block_n, kv_len):
    """Whether the consumers take turns at the tensor cores (the kernel's PINGPONG) for a
    head_dim, blocks of block_n keys and a dense call's kv_len (None for a packed batch): up to
    head_dim PINGPONG_MAX_HEAD_DIM always (64; 80 and 96, two column parts); above it (112 and
    128, one part of 128 columns; 192, 256) FA4's Hopper form, no turns and O rescaled before
    the P V product is issued, but for dense calls of at most PINGPONG_SHORT_BLOCKS blocks of
    keys (by kv_len: a window or top-left queries shorter than the keys may leave fewer blocks
    a tile, and keep the long calls' form). H200, Triton 3.6, hopper_lab.py --time, each form
    in one job (notes/lab/gluon_no_pingpong_h200.txt): without turns at 192 and 256 3.5-6 %
    faster at rows of 2000 keys or more ((8,16,4096,256,2): 1.64-1.67 against 1.72-1.80 ms),
    level at 500 keys ((262,16,500,256,4)), slower at 256 keys and fewer ((512,16,256,192):
    1.12 against 1.05-1.08 ms; (1024,16,128,256): 1.10 against 1.09); at 128 0-3.3 % faster
    from 2000 keys on ((16,16,8192,128,2): 6.95 against 7.13 ms), level at 500 and 1024, and
    chunked prefill 2-7 % faster; at 112 1.3 % faster at (4,16,8192,112); at 64, 80 and 96
    2-9 % slower at every row timed (notes/lab/gluon_no_pingpong_d64_d128_h200.txt)."""
    if head_dim <= PINGPONG_MAX_HEAD_DIM:
        return True
    return kv_len is not None and kv_len <= PINGPONG_SHORT_BLOCKS * block_n


def block_loops(d0, d1, block_n, kv_len):
    """How the consumers walk a tile's K/V blocks past the first (the kernel's BLOCK_LOOPS), for
    column parts (d0, d1), blocks of block_n keys and a dense call's kv_len (None for a packed
    batch): 1, one loop choosing each block's mask at run time, where the head_dim is one part
    of 128 columns or more; else 0, no loop, where a dense call's tiles hold one block each, and
    2, the unmasked blocks' loop then the masked ones' (under a sliding window, after a masked
    loop over the blocks its left edge cuts). H200, Triton 3.6, hopper_lab.py --time, three jobs
    against one loop everywhere (notes/lab/gluon_block_loops_h200.txt):
    - two loops 2-4 % faster at head_dim 64's long rows (9.81 against 10.21 ms at
      (8,16,16384,64), 0.669 against 0.693 at (4,32,4096,64)), 2.3 % at (8,16,4096,192,kv4), 7 %
      at (512,16,256,96) (64-key blocks), 1 % at (4,32,4096,96); no loop 6.4 % at
      (1024,16,128,96);
    - at one part of 128 columns two loops were level at long rows and 3-9 % slower with one
      or two blocks a tile ((1024,16,128,128): 0.556 against 0.512 ms; no loop there: 0.546
      against 0.519; (512,16,256,128): 0.80-0.82 against 0.78); at 256 only a long row was
      measured (level); one loop at 128 reads as before (0.513 against 0.513, 0.761 against
      0.768);
    - packed batches (16 sequences of 517-4096 keys, 32/8 heads) the same way: two loops 5 %
      faster at head_dim 64 (0.961 against 1.013 ms), 3.3 % at 192, 1.5 % at 96, and 1.7 % at
      128, inside that job's spread, so 128 keeps the dense rule's one loop
      (notes/lab/gluon_block_loops_varlen_h200.txt);
    - windowed calls (4096 keys, causal) the same way, one job: two loops 2.3-3.1 % faster at
      head_dim 64 (1.976 against 2.039 ms at (4,32,8192,64,kv8)), 1.3 % at 192, level at 96 and
      with a window of 1024 keys (notes/lab/gluon_window_loops_h200.txt)."""
    if d1 == 0 and d0 >= 128:
        return 1
    if kv_len is not None and kv_len <= block_n:
        return 0
    return 2


def layout_for(head_dim, kv_len, many_tiles):
    """((D0, D1), config) of a call with kv_len keys: the column parts (column_parts) and the
    CONFIGS entry, except where `many_tiles` (a dense call of more 128-row tiles than SMs) has
    few keys at a head_dim split into parts with 128-key blocks (80, 96): up to PADDED_KEYS keys,
    one part padded to block_width(head_dim) columns if the second part is 16 columns wide (80;
    96 keeps its parts and table); from there up to SHORT_KEYS, 64-key blocks. Above 128
    columns, 128's config (128-key blocks) from WIDE_BLOCK_KEYS + 1 keys wherever Q and that
    ring fit shared memory (`ring_bytes`: 136-160, a second part of at most 32 columns). (Measured
    on causal calls; others follow the same rule.)"""
    parts, config = column_parts(head_dim), table_config(head_dim)
    if head_dim > 128:
        wide = CONFIGS[128]
        if kv_len > WIDE_BLOCK_KEYS and ring_bytes(wide, parts) <= SHARED_MEMORY_BYTES:
            return parts, wide
        return parts, config
    if not many_tiles or not parts[1] or config[0] != 128 or kv_len > SHORT_KEYS:
        return parts, config
    if kv_len <= PADDED_KEYS:
        return ((block_width(head_dim), 0), config) if parts[1] == 16 else (parts, config)
    return parts, (64,) + config[1:]


def _parts_ok(parts, head_dim, packed):
    # A lab's column parts: two widths the kernel's buffers and wgmma take (block_width's: powers
    # of two >= 16; the second may be 0; a box is at most 256 wide) that cover head_dim, exactly
    # for a packed batch (a wider box would read the next head's columns).
    if len(parts) != 2:
        return False
    d0, d1 = parts
    covers = d0 + d1 == head_dim if packed else d0 + d1 >= head_dim
    return (block_width(d0) == d0 and (d1 == 0 or block_width(d1) == d1) and covers
            and 256 >= d0 >= d1)


def column_parts(head_dim):
    """(D0, D1): the widths, powers of two, of the column parts the kernel splits head_dim into,
    D1 = 0 for one part. One part of block_width(head_dim) columns unless two parts cover
    fewer: D0 the largest power of two <= head_dim and D1 the rest rounded up to one (>= 16, the
    wgmma K step). 80 = 64 + 16, 96 = 64 + 32 and 192 = 128 + 64 run on exactly their columns
    instead of 128 or 256; 112 pads to 128 either way and keeps one part."""
    d0 = 1 << (head_dim.bit_length() - 1)
    if d0 == head_dim:
        return d0, 0
    d1 = block_width(head_dim - d0)
    return (d0, d1) if d0 + d1 < block_width(head_dim) else (block_width(head_dim), 0)


# Host cost matters at small shapes (notes/launch.md): what does not change
# between calls is computed once (here, in device_properties, tile_schedule and FastLaunch).
@functools.cache
def _smem_layout(rows, block_d, dtype):
    return gl.NVMMASharedLayout.get_default_for([rows, block_d], _GL_DTYPES[dtype])


_launch = FastLaunch(_attn_fwd_hopper, FORWARD_LAUNCHES)  # shared with the Triton forward's
# Packed batches' launches take a fresh tile counter per call, made above: they are kept apart
# from the dispatch's FORWARD_LAUNCHES (whose repeats pass only the tensors the caller has).
_launch_packed = FastLaunch(_attn_fwd_hopper)
