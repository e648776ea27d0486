"""What the attention kernels share: @triton.jit helpers and host helpers.

The jit helpers (masked loads, the launch's tile order, a query block's key ranges, causal and
sliding-window visibility, the softcap, a packed sequence's bounds) are inlined into each kernel that calls them, so the forward, the backward and the
Gluon kernel apply one rule each instead of three copies of it. The host helpers compute the
launch constants every kernel's launch needs (tile width and dot precision, heads per L2 group,
the device's properties, pointer alignment).
"""

import functools

import torch

import triton
import triton.language as tl

LOG2E = 1.44269504  # 1/ln(2): exp(x) == exp2(x * LOG2E)
LOG2E_C = tl.constexpr(LOG2E)  # jit functions read module globals only as constexprs
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
def _sees(rows, cols, CAUSAL_OFFSET):
    # Causal visibility, the one rule every kernel applies: query row i sees key j when
    # j <= i + CAUSAL_OFFSET (0: SDPA's top-left alignment; kv_len - q_len: bottom-right).
    # rows and cols come broadcastable ([M, 1] and [1, N], or transposed).
    return cols <= rows + CAUSAL_OFFSET


@triton.jit
def _sees_window(rows, cols, LEFT_OFFSET):
    # A sliding window's left edge: query row i sees key j only when j >= i + LEFT_OFFSET
    # (LEFT_OFFSET = the causal offset - the window's left size). Its right edge is a causal
    # bound (_sees) whose offset is the causal offset + the window's right size.
    return cols >= rows + LEFT_OFFSET


@triton.jit
def _tanh_exp2(x):
    # tanh(y) for x = 2 * y * log2(e), through one exp2: 1 - 2 / (e^(2y) + 1) is exactly +-1 where
    # exp2 overflows or underflows, so no NaN for any finite x (tl has no tanh the interpreter
    # also runs). Near 0 its absolute error is ~fp32 eps, which the softcap scales to ~1e-5 of a
    # logit at softcap 50: well below the inputs' own rounding.
    return 1.0 - 2.0 / (tl.math.exp2(x) + 1.0)


@triton.jit
def _logits(qk, qk_scale, softcap_log2, SOFTCAP: tl.constexpr):
    # Raw scores q @ k^T -> logits in log2 units. Without SOFTCAP qk_scale is scale * log2(e);
    # with it, qk_scale is 2 * scale / softcap * log2(e) (_tanh_exp2's argument) and the logit
    # is softcap * tanh(scale * qk / softcap) * log2(e). Also returns the tanh (the backward's
    # derivative 1 - tanh^2 needs it); without SOFTCAP that is the unused raw scores.
    if SOFTCAP:
        t = _tanh_exp2(qk * qk_scale)
        return t * softcap_log2, t
    else:
        return qk * qk_scale, qk


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
    # t of a 1-D grid of batch * H * NUM_M takes tile t of _grouped_tile's order. (The forward
    # and the backward's dQ kernel use the same grid.)
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
def _window_key_ranges(start_m, N_CTX_K, CAUSAL_OFFSET, LEFT_OFFSET, CAUSAL: tl.constexpr,
                       HAS_WINDOW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # _key_ranges with a sliding window's left edge: query block start_m visits key blocks
    # [lo, hi) = [lo, full_lo) masked (the window's left edge), [full_lo, full_hi) unmasked,
    # [full_hi, hi) masked (the diagonal or the window's right edge, and the ragged end of K).
    # Blocks left of lo are seen by no row of the tile: they are skipped, not masked. Without
    # HAS_WINDOW, lo = full_lo = 0 and the rest is _key_ranges's, so that code is unchanged.
    full_hi, hi = _key_ranges(start_m, N_CTX_K, CAUSAL_OFFSET, CAUSAL, BLOCK_M, BLOCK_N)
    if HAS_WINDOW:
        first_row = start_m * BLOCK_M
        # the first row sees keys from first_row + LEFT_OFFSET, the last row from BLOCK_M - 1 on
        # (lo may pass N_CTX_K: a window right of every key visits nothing)
        lo = tl.maximum(first_row + LEFT_OFFSET, 0) // BLOCK_N * BLOCK_N
        full_lo = tl.minimum(tl.maximum(first_row + BLOCK_M - 1 + LEFT_OFFSET, 0), N_CTX_K)
        full_lo = tl.cdiv(full_lo, BLOCK_N) * BLOCK_N
        # a window narrower than a block leaves no block every row sees: all of [lo, hi) masked
        no_full = full_lo >= full_hi
        full_lo = tl.where(no_full, lo, full_lo)
        full_hi = tl.where(no_full, lo, full_hi)
    else:
        lo = 0
        full_lo = 0
    return lo, full_lo, full_hi, hi


@triton.jit
def _head_base(ptr, off_z, off_h, stride_z, stride_h, start, stride_s, VARLEN: tl.constexpr):
    # Where (batch off_z, head off_h)'s rows of a [batch, heads, seq, head_dim] view begin. A
    # packed batch's view has batch stride 0: its sequence begins `start` rows in.
    base = ptr + off_z * stride_z + off_h * stride_h
    if VARLEN:
        base += start.to(tl.int64) * stride_s
    return base


@triton.jit
def _sequence(CU_SEQLENS, off_z, N_CTX, VARLEN: tl.constexpr):
    # A packed batch's sequence off_z: its first row in the packed tensor and its length, read
    # from the cumulative lengths. Not VARLEN: every sequence starts at 0 (the batch stride
    # places it) and has length N_CTX.
    if VARLEN:
        start = tl.load(CU_SEQLENS + off_z)
        return start, tl.load(CU_SEQLENS + off_z + 1) - start
    else:
        return 0, N_CTX


def visibility(causal, causal_offset, window):
    """The kernels' visibility arguments (CAUSAL, CAUSAL_OFFSET, HAS_WINDOW, LEFT_OFFSET) of a
    call: query i sees key j when i + offset - left <= j <= i + offset + right, -1 leaving a
    side unbounded and causal setting right = 0 (flash-attn's window_size). The right edge is
    the causal bound moved right by `right`, so a non-causal window with right >= 0 runs the
    causal code with that offset; the left edge is HAS_WINDOW's. With no window this is
    (causal, causal_offset, False, 0): today's arguments."""
    left, right = window
    if causal:
        right = 0
    return right >= 0, causal_offset + max(right, 0), left >= 0, causal_offset - max(left, 0)


# The Triton kernels index a head's rows in 32 bits: row * row stride + column * column stride
# (the batch, head and packed-sequence offsets are int64). Larger offsets would wrap.
MAX_ROW_OFFSET = 2 ** 31 - 1


def check_row_offsets(rows, views, names):
    """Raise ValueError where `rows` rows of any [batch, heads, seq, head_dim] view reach past
    MAX_ROW_OFFSET elements from their head's first: the Triton kernels' 32-bit row offsets
    would wrap (bshd views of very long sequences, whose row stride is heads x head_dim)."""
    for name, t in zip(names, views):
        reach = (rows - 1) * abs(t.stride(2)) + (t.shape[3] - 1) * abs(t.stride(3))
        if reach > MAX_ROW_OFFSET:
            raise ValueError(
                f"{name}'s {rows} rows reach {reach} elements past a head's first (row stride "
                f"{t.stride(2)}), more than the Triton kernels' 32-bit row offsets take "
                f"({MAX_ROW_OFFSET}): pass [batch, heads, seq, head_dim]-contiguous tensors "
                f"(layout='bhsd'), whose row stride is head_dim, or shorter sequences")


def score_scales(scale, softcap):
    """The kernels' (qk_scale, softcap_log2, SOFTCAP) for a scale and a softcap (0: off): see
    _logits. Exponentials are exp2, so logits are kept in log2 units."""
    if softcap > 0:
        return 2.0 * scale / softcap * LOG2E, softcap * LOG2E, True
    return scale * LOG2E, 1.0, False


def is_interpreted():
    """True when the kernels were defined under TRITON_INTERPRET=1 and so run on CPU tensors."""
    return not isinstance(_load, triton.runtime.JITFunction)


def interpreter_ready():
    """True when CPU tensors can run: our kernels and Triton's own library functions (tl.max,
    tl.sum, ... are jit functions too) were all defined under the interpreter. Setting
    TRITON_INTERPRET after triton was imported interprets ours but not Triton's."""
    return is_interpreted() and not isinstance(tl.standard.max, triton.runtime.JITFunction)


def block_width(head_dim):
    """BLOCK_D, the width of every kernel's tiles over head_dim: the next power of two >= 16
    (Triton's and Gluon's tensors have power-of-two shapes; the extra columns load as zeros)."""
    return max(16, 1 << (head_dim - 1).bit_length())


def tile_constants(head_dim, dtype):
    """The BLOCK_D and INPUT_PRECISION constexprs of a launch (forward and backward): tiles
    block_width wide, and fp32 inputs use IEEE fp32 dots (tf32 is unused for 16-bit inputs)."""
    return block_width(head_dim), "ieee" if dtype.itemsize == 4 else "tf32"


@functools.cache
def device_properties(device):
    """torch.cuda.get_device_properties, read once per device (the launch is on the host's
    critical path at small shapes)."""
    return torch.cuda.get_device_properties(device)


def head_group(q, k, l2_share=0.5, *, kv_len=None, pairs=None):
    """How many (batch, head) pairs a launch runs together (`_grouped_tile`): about as many as
    keep their K and V within `l2_share` of L2 (the rest for Q, the output and other streams),
    with the heads split into groups of equal size. A group of query heads shares one K/V head
    under GQA. Measured (notes/forward.md, "The tile order"): all heads in one group at
    (4,32,4096,128) made each running program stream its own head's K/V from DRAM (10 % L2
    hits); and a small last group puts its longest tiles at the very end of the launch, where
    nothing overlaps them. In the interpreter, groups of two, so that CPU tests cross group
    edges (and a smaller last group). `pairs` (default: all of q's) and `kv_len` (default: k's
    length) for a launch that groups fewer, e.g. one packed sequence's heads over its keys."""
    n_hz = q.shape[0] * q.shape[1] if pairs is None else pairs
    if not q.is_cuda:
        return min(n_hz, 2)
    kv_len = k.shape[2] if kv_len is None else kv_len
    kv_bytes = 2 * max(kv_len, 1) * k.shape[3] * k.element_size()  # per K/V head
    return l2_group(q.device, n_hz, kv_bytes, l2_share, sharing=q.shape[1] // k.shape[1])


def l2_group(device, pairs, streamed_bytes, l2_share=0.5, sharing=1):
    """How many of `pairs` (batch, head) pairs a launch runs together (`_grouped_tile`): about
    as many as keep what their programs stream (`streamed_bytes`, shared by `sharing` pairs)
    within `l2_share` of L2, the pairs split into groups of equal size."""
    budget = int(device_properties(device).L2_cache_size * l2_share)
    cap = max(1, budget * sharing // max(streamed_bytes, 1))
    groups = -(-pairs // cap)
    return -(-pairs // groups)


def aligned(*tensors):
    """Which tensors start at a 16-byte aligned address: Triton specializes pointer arguments
    on it, so launch keys hold it."""
    return tuple(t.data_ptr() % 16 == 0 for t in tensors)


def tma_strided_ok(t):
    # A dense [batch, heads, seq, head_dim] tensor the copy engine can read: contiguous, or at
    # strides it takes (unit last stride, the others positive 16-byte multiples below 2^40 B)
    if t.is_contiguous():
        return True
    size = t.element_size()
    return t.stride(-1) == 1 and all(0 < s * size < 2 ** 40 and s * size % 16 == 0
                                     for s in tma_view_strides(t))


def tma_view_strides(t):
    # t's batch, head and row strides for the copy engine's 4-D view: a dimension of one element
    # has any stride in torch (it addresses nothing), so it gets the one a contiguous tensor
    # would have, which the copy engine takes
    batch, heads, seq, head_dim = t.shape
    stride_z, stride_h, stride_m, _ = t.stride()
    stride_m = head_dim if seq == 1 else stride_m
    stride_h = stride_m * seq if heads == 1 else stride_h
    stride_z = stride_h * heads if batch == 1 else stride_z
    return stride_z, stride_h, stride_m
