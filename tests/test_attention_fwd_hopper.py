"""The Gluon Hopper forward (attnscope/kernels/attention_fwd_hopper.py): on an sm_90 GPU against
the float64 reference (the tolerance rule is fused_checks.py's), what the dispatch routes to it,
its two output paths (TMA store, register stores) and CUDA-graph capture; on CPU, that the
dispatch never takes it.
"""

import itertools
import types

import pytest
import torch
from einops import rearrange

from attnscope import fused_attention
from attnscope.kernels import dispatch, tile_schedule
# nan_outputs: autouse, poisons every buffer the op allocates
from fused_checks import (CPU, GPU_DTYPES, check, make_qkv, nan_outputs,  # noqa: F401
                          on_hopper, replays_in_a_cuda_graph)


@pytest.fixture
def fresh_launches():
    """A process that has launched nothing: no kept launch, no tile schedule (a test that needs
    a shape to be new, whatever ran before it in this worker)."""
    dispatch.forget_launches()
    tile_schedule.forget_schedules()
    yield
    dispatch.forget_launches()


@pytest.fixture(autouse=True)
def gluon_at_any_length(monkeypatch):
    """The tests here run the Gluon kernel through the op at short lengths too, which the
    routing (attention_fwd_hopper.SHORT_WORK) otherwise gives the Triton kernel; calls other
    tests made at these shapes, remembered with their route, are forgotten first."""
    hopper = dispatch._hopper() if on_hopper() else None
    if hopper is not None:
        monkeypatch.setattr(hopper, "SHORT_WORK", 0)
        dispatch.forget_launches()
    yield
    if hopper is not None:
        dispatch.forget_launches()


HOPPER_SHAPES = [
    # (batch, heads, kv_heads, q_len, kv_len, causal, alignment): the kernel's 128-row tiles,
    # the diagonal, ragged query tiles and rows past a head's end, ragged last K/V blocks (the
    # copy engine's zeros past a head's end, masked to -inf)
    (2, 3, 3, 1000, 1024, True, "top_left"),
    (1, 4, 1, 333, 384, True, "top_left"),        # MQA, one ragged query tile
    (1, 2, 2, 77, 256, True, "bottom_right"),     # diagonal off the tile grid
    (1, 2, 2, 300, 128, True, "bottom_right"),    # rows that see no key, tiles with no block
    (2, 2, 1, 257, 512, False, "top_left"),       # non-causal
    (3, 1, 1, 1, 128, True, "bottom_right"),      # single-token decoding
    (3, 16, 16, 2048, 2048, True, "top_left"),    # more tiles than SMs: the persistent loop
    (2, 3, 3, 1000, 1000, True, "top_left"),      # ragged query and key tiles, same length
    (1, 8, 2, 3000, 3000, True, "top_left"),      # GQA, 3000 = 23 blocks + 56 keys
    (2, 2, 2, 129, 129, True, "top_left"),        # one key past a block: a 1-key last block
    (2, 2, 2, 1, 1, True, "top_left"),            # one query, one key
    (1, 2, 2, 1, 1000, True, "bottom_right"),     # decoding over a ragged cache
    (1, 3, 3, 200, 77, False, "top_left"),        # non-causal, more queries than keys: every
                                                  # row sees the ragged block
    (1, 3, 3, 300, 77, True, "top_left"),         # top-left, more queries than keys: rows past
                                                  # 77 see every key, the ragged block included
    (1, 2, 2, 300, 77, True, "bottom_right"),     # rows that see no key, ragged block
    (2, 2, 1, 700, 1500, False, "top_left"),      # non-causal, q_len < kv_len, both ragged
    (1, 2, 2, 640, 1000, True, "bottom_right"),   # aligned queries, ragged keys
    (1, 2, 2, 1000, 640, True, "top_left"),       # ragged queries, aligned keys
]


@pytest.mark.cuda
@pytest.mark.skipif(not on_hopper(), reason="the Gluon kernel runs on sm_90 only")
@pytest.mark.parametrize("dtype,floor,lse_tol", GPU_DTYPES)
@pytest.mark.parametrize("shape", HOPPER_SHAPES)
def test_hopper_kernel(shape, dtype, floor, lse_tol):
    batch, heads, kv_heads, q_len, kv_len, causal, alignment = shape
    q, k, v = make_qkv(batch, heads, kv_heads, q_len, kv_len, 128, dtype, "cuda")
    assert dispatch.uses_hopper_kernel(q, k, v, torch.empty_like(q), 128 ** -0.5)
    check(q, k, v, floor, lse_tol, causal=causal, causal_alignment=alignment)


OTHER_HEAD_DIM_SHAPES = [
    # (batch, heads, kv_heads, q_len, kv_len, causal, alignment) for the head dims other than
    # 128: 64 (three ring stages), column parts (80, 96, 192) or one part padded (112; 80 with
    # few keys), whose padding columns must read as zeros and never be written; 64-key blocks
    # (192, 256), the output staged in Q's buffer (256: O_IN_Q); the blocks past a tile's first
    # in two loops (64, 80, 96, 192: block_loops) or in none (one block a tile)
    (2, 3, 3, 1000, 1000, True, "top_left"),      # ragged query and key tiles
    (1, 8, 2, 3000, 3000, True, "top_left"),      # GQA, ragged last block
    (2, 2, 2, 129, 129, True, "top_left"),        # a 1-key last block
    (1, 2, 2, 1, 1000, True, "bottom_right"),     # decoding over a ragged cache
    (1, 2, 2, 300, 77, True, "bottom_right"),     # rows that see no key
    (1, 3, 3, 200, 77, False, "top_left"),        # non-causal, more queries than keys
    (2, 2, 1, 700, 1536, False, "top_left"),      # non-causal, aligned keys
    (3, 16, 16, 2048, 2048, True, "top_left"),    # more tiles than SMs: the persistent loop
    (2, 80, 8, 128, 128, True, "bottom_right"),   # many tiles, few keys (layout_for): 80
                                                  # one padded part, 96 the split
    (2, 40, 8, 500, 500, True, "top_left"),       # 80, 96: 64-key blocks, GQA, ragged block
]


@pytest.mark.cuda
@pytest.mark.skipif(not on_hopper(), reason="the Gluon kernel runs on sm_90 only")
@pytest.mark.parametrize("dtype,floor,lse_tol", GPU_DTYPES)
@pytest.mark.parametrize("head_dim", [64, 80, 96, 112, 192, 256])
@pytest.mark.parametrize("shape", OTHER_HEAD_DIM_SHAPES)
def test_hopper_kernel_other_head_dims(shape, head_dim, dtype, floor, lse_tol, monkeypatch):
    # (head_dim 64 at any length too: the routing gives it this kernel from MIN_QUERIES on)
    monkeypatch.setattr(dispatch._hopper(), "MIN_QUERIES", {})
    batch, heads, kv_heads, q_len, kv_len, causal, alignment = shape
    q, k, v = make_qkv(batch, heads, kv_heads, q_len, kv_len, head_dim, dtype, "cuda")
    assert dispatch.uses_hopper_kernel(q, k, v, torch.empty_like(q), head_dim ** -0.5)
    check(q, k, v, floor, lse_tol, causal=causal, causal_alignment=alignment)


BETWEEN_THE_TABLE = [72, 88, 104, 136, 160, 176, 200, 248]  # each family and kind of parts


@pytest.mark.cuda
@pytest.mark.skipif(not on_hopper(), reason="the Gluon kernel runs on sm_90 only")
@pytest.mark.parametrize("dtype,floor,lse_tol", GPU_DTYPES)
@pytest.mark.parametrize("head_dim", BETWEEN_THE_TABLE)
@pytest.mark.parametrize("shape", [OTHER_HEAD_DIM_SHAPES[i] for i in (0, 1, 4, 5, 8, 9)])
def test_hopper_kernel_head_dims_between_the_table(shape, head_dim, dtype, floor, lse_tol):
    # Multiples of 8 the table does not name take their family's config (table_config) and
    # column_parts' parts: 72 = 64 + 16 and 136 = 128 + 16 with their last 8 columns read as
    # zeros (boxes past the head's columns) and never written, 104 and 200-248 one padded part
    batch, heads, kv_heads, q_len, kv_len, causal, alignment = shape
    q, k, v = make_qkv(batch, heads, kv_heads, q_len, kv_len, head_dim, dtype, "cuda")
    assert dispatch.uses_hopper_kernel(q, k, v, torch.empty_like(q), head_dim ** -0.5)
    check(q, k, v, floor, lse_tol, causal=causal, causal_alignment=alignment)
    assert dispatch.launched_forward_kernels()[0]["name"] == "_attn_fwd_hopper"


def _check_a_max_that_rises_late(shape, head_dim, dtype, floor, lse_tol):
    # The Gluon kernel's output and LSE against float64 with keys scaled up along the sequence
    # (0.2 to 6.0), so a row's scores in later blocks exceed its running max by far
    batch, heads, kv_heads, q_len, kv_len, causal, alignment = shape
    q, k, v = make_qkv(batch, heads, kv_heads, q_len, kv_len, head_dim, dtype, "cuda")
    k = (k.float() * torch.linspace(0.2, 6.0, kv_len, device="cuda")[:, None]).to(dtype)
    assert dispatch.uses_hopper_kernel(q, k, v, torch.empty_like(q), head_dim ** -0.5)
    check(q, k, v, floor, lse_tol, causal=causal, causal_alignment=alignment)


@pytest.mark.cuda
@pytest.mark.skipif(not on_hopper(), reason="the Gluon kernel runs on sm_90 only")
@pytest.mark.parametrize("dtype,floor,lse_tol", GPU_DTYPES)
@pytest.mark.parametrize("head_dim", [112, 128, 192, 256])
@pytest.mark.parametrize("shape", [(1, 4, 2, 1500, 1500, True, "top_left"),
                                   (2, 2, 2, 700, 1000, False, "top_left"),
                                   (1, 3, 3, 1000, 1200, True, "bottom_right")])
def test_hopper_kernel_a_max_that_rises_late(shape, head_dim, dtype, floor, lse_tol):
    # Keys scaled up along the sequence, so a row's scores in later blocks exceed its running
    # max by far more than RESCALE_THRESHOLD: the lazy rescale (one part of 128 columns or
    # more) must move the max and rescale O there, the other head dims as always; from 112 on,
    # in calls of more than four K/V blocks, O takes each factor one block late, before the P V
    # product (no ping-pong there: pingpong_for)
    _check_a_max_that_rises_late(shape, head_dim, dtype, floor, lse_tol)


@pytest.mark.cuda
@pytest.mark.skipif(not on_hopper(), reason="the Gluon kernel runs on sm_90 only")
@pytest.mark.parametrize("dtype,floor,lse_tol", GPU_DTYPES)
@pytest.mark.parametrize("pingpong", [True, False])
@pytest.mark.parametrize("head_dim", [80, 128, 192, 256])
@pytest.mark.parametrize("shape", [(1, 4, 2, 1500, 1500, True, "top_left"),
                                   (2, 3, 3, 200, 333, True, "bottom_right"),
                                   (1, 2, 2, 1500, 600, True, "bottom_right"),  # rows see no key
                                   (1, 2, 2, 300, 77, False, "top_left")])
def test_hopper_kernel_with_and_without_turns(shape, head_dim, pingpong, dtype, floor, lse_tol,
                                              monkeypatch):
    # Both forms of the consumers' schedule at every kind of head_dim, whichever pingpong_for
    # picks: turns at the tensor cores with O rescaled after the P V product, or no turns with
    # O rescaled by the block before's factor ahead of it (keys scaled up along the sequence,
    # so a row's max moves late and the factor carried to the next block matters). The launch
    # kept under the dispatch's key does not name the form: gluon_at_any_length forgets the
    # kept launches around each test, so the patched rule is the one the launch reads.
    hopper = dispatch._hopper()
    monkeypatch.setattr(hopper, "pingpong_for", lambda *args: pingpong)
    _check_a_max_that_rises_late(shape, head_dim, dtype, floor, lse_tol)


@pytest.mark.cuda
@pytest.mark.skipif(not on_hopper(), reason="the Gluon kernel runs on sm_90 only")
@pytest.mark.parametrize("dtype,floor,lse_tol", GPU_DTYPES)
@pytest.mark.parametrize("shape", OTHER_HEAD_DIM_SHAPES + [
    (1, 5, 5, 4100, 4100, True, "top_left"),      # a last tile of 68 rows: one consumer idle
    (2, 4, 2, 400, 400, True, "top_left"),        # a last tile of 16 rows: two consumers idle
    (1, 2, 2, 700, 1000, True, "bottom_right")])  # keys past a 192-row tile's diagonal
def test_hopper_kernel_three_consumers(shape, dtype, floor, lse_tol, monkeypatch):
    # head_dim 64 on three consumers (192-row tiles) at any length and tile count (the rule's
    # bound at 0; test_three_consumers_where_every_program_has_many_tiles checks what the launch
    # is given): consumers whose rows are all past the sequence's end pass the ring's and
    # turns' barriers on
    hopper = dispatch._hopper()
    monkeypatch.setattr(hopper, "MIN_QUERIES", {})
    monkeypatch.setattr(hopper, "MIN_TILES_PER_PROGRAM", 0)
    batch, heads, kv_heads, q_len, kv_len, causal, alignment = shape
    q, k, v = make_qkv(batch, heads, kv_heads, q_len, kv_len, 64, dtype, "cuda")
    assert dispatch.uses_hopper_kernel(q, k, v, torch.empty_like(q), 64 ** -0.5)
    check(q, k, v, floor, lse_tol, causal=causal, causal_alignment=alignment)


THREE_CONSUMER_MORE_CASES = [
    # (batch, heads, kv_heads, q_len, kv_len, alignment, window, softcap, layout): windows
    # cutting 192-row tiles, a ragged last tile, softcaps, bshd views (STRIDED)
    (1, 4, 2, 1000, 1000, "top_left", (300, -1), 0.0, "bhsd"),
    (2, 2, 2, 700, 1500, "bottom_right", (62, -1), 0.0, "bhsd"),
    (1, 4, 4, 4100, 4100, "top_left", (1000, 0), 30.0, "bhsd"),
    (1, 2, 2, 400, 400, "top_left", (-1, -1), 50.0, "bhsd"),
    (2, 4, 2, 1000, 1000, "top_left", (-1, -1), 0.0, "bshd"),
    (1, 4, 4, 700, 1000, "bottom_right", (256, 0), 0.0, "bshd"),
]


def _three_consumers_everywhere(monkeypatch):
    # head_dim 64 on three consumers at any length and for any call: the table's config made
    # THREE_CONSUMERS' (the launch's rule keeps narrow windows and softcaps on two, where three
    # measured slower)
    hopper = dispatch._hopper()
    monkeypatch.setattr(hopper, "MIN_QUERIES", {})
    monkeypatch.setattr(hopper, "CONFIGS", {**hopper.CONFIGS, 64: hopper.THREE_CONSUMERS[64]})


def _ran_on_three_consumers():
    ran = dispatch.launched_forward_kernels()[0]
    return ran["name"] == "_attn_fwd_hopper" and ran["config"]["consumers"] == 3


@pytest.mark.cuda
@pytest.mark.skipif(not on_hopper(), reason="the Gluon kernel runs on sm_90 only")
@pytest.mark.parametrize("dtype,floor,lse_tol", GPU_DTYPES)
@pytest.mark.parametrize("case", THREE_CONSUMER_MORE_CASES)
def test_hopper_kernel_three_consumers_more_calls(case, dtype, floor, lse_tol, monkeypatch):
    # windows, softcaps and bshd views on three consumers at any tile count
    _three_consumers_everywhere(monkeypatch)
    batch, heads, kv_heads, q_len, kv_len, alignment, window, softcap, layout = case
    q, k, v = make_qkv(batch, heads, kv_heads, q_len, kv_len, 64, dtype, "cuda", layout)
    check(q, k, v, floor, lse_tol, causal=True, causal_alignment=alignment, window=window,
          softcap=softcap, layout=layout)
    assert _ran_on_three_consumers()


@pytest.mark.cuda
@pytest.mark.skipif(not on_hopper(), reason="the Gluon kernel runs on sm_90 only")
@pytest.mark.parametrize("dtype,floor,lse_tol", GPU_DTYPES)
@pytest.mark.parametrize("window", [(300, -1), (1000, -1), (200, 150), (-1, 70)])
def test_hopper_kernel_three_consumers_non_causal_windows(window, dtype, floor, lse_tol,
                                                           monkeypatch):
    # non-causal windows, with and without a right edge, on three consumers
    _three_consumers_everywhere(monkeypatch)
    q, k, v = make_qkv(1, 4, 2, 1000, 1300, 64, dtype, "cuda")
    check(q, k, v, floor, lse_tol, causal=False, causal_alignment="bottom_right", window=window)
    assert _ran_on_three_consumers()


WINDOW_CASES = [
    # (batch, heads, kv_heads, q_len, kv_len, causal, alignment, window, softcap, scale): a
    # window's left edge inside K/V blocks; on block edges for every tile's first row (256 keys,
    # top-left: a tile's first block is the edge's); one past a block edge for a consumer's last
    # row (62: m0 + 63 - 62 = 64 k + 1 at 64-key blocks and for the first consumer at 128, 126
    # for the second), where the block must stay masked; narrower than a consumer's 64 rows (no
    # block every row sees), of one key, wider than the keys; the K/V blocks left of a tile's
    # window skipped; rows that see no key; a two-sided window, a left and a right edge alone on
    # non-causal calls; softcaps that saturate (scale 1.0) and that do not, alone and with a
    # window; the persistent loop over more tiles than SMs
    (1, 4, 2, 1000, 1000, True, "top_left", (300, -1), 0.0, None),
    (1, 2, 2, 1000, 1000, True, "top_left", (256, -1), 0.0, None),
    (1, 2, 2, 700, 700, True, "top_left", (62, -1), 0.0, None),
    (1, 2, 2, 700, 700, True, "top_left", (126, -1), 0.0, None),
    (2, 2, 2, 700, 1500, True, "bottom_right", (256, -1), 0.0, None),
    (1, 2, 2, 500, 500, True, "top_left", (37, -1), 0.0, None),
    (1, 2, 2, 333, 333, True, "top_left", (0, -1), 0.0, None),
    (1, 2, 2, 300, 300, True, "top_left", (5000, -1), 0.0, None),
    (1, 2, 1, 640, 300, False, "top_left", (100, 50), 0.0, None),
    (1, 2, 2, 333, 1000, False, "bottom_right", (-1, 77), 0.0, None),
    (1, 2, 2, 500, 800, False, "bottom_right", (200, -1), 0.0, None),
    (1, 4, 2, 1000, 1000, True, "top_left", (-1, -1), 5.0, 1.0),
    (1, 2, 2, 300, 1000, False, "bottom_right", (-1, -1), 30.0, None),
    (1, 4, 2, 1000, 1200, True, "bottom_right", (400, -1), 5.0, 1.0),
    (3, 16, 16, 2048, 2048, True, "top_left", (700, -1), 50.0, None),
]


# Every case at the table's head dims in both dtypes; three at two of the head dims table_config
# adds (104 one padded part, 160 two parts), in bf16; and 160 past WIDE_BLOCK_KEYS keys, on
# 128-key blocks (layout_for), with GQA, a window and a softcap
WINDOW_HOPPER_CASES = [
    *((shape, head_dim, *dtype) for dtype in GPU_DTYPES for head_dim in (64, 96, 128, 192, 256)
      for shape in WINDOW_CASES),
    *((WINDOW_CASES[i], head_dim, *GPU_DTYPES[0]) for head_dim in (104, 160) for i in (0, -2, -1)),
    ((1, 4, 2, 1000, 3000, True, "bottom_right", (700, -1), 30.0, None), 160, *GPU_DTYPES[0])]


@pytest.mark.cuda
@pytest.mark.skipif(not on_hopper(), reason="the Gluon kernel runs on sm_90 only")
@pytest.mark.parametrize("shape,head_dim,dtype,floor,lse_tol", WINDOW_HOPPER_CASES)
def test_hopper_kernel_window_and_softcap(shape, head_dim, dtype, floor, lse_tol, monkeypatch):
    # (head_dim 64 at any length too: the routing gives it this kernel from MIN_QUERIES on)
    monkeypatch.setattr(dispatch._hopper(), "MIN_QUERIES", {})
    batch, heads, kv_heads, q_len, kv_len, causal, alignment, window, softcap, scale = shape
    q, k, v = make_qkv(batch, heads, kv_heads, q_len, kv_len, head_dim, dtype, "cuda")
    assert dispatch.uses_hopper_kernel(q, k, v, torch.empty_like(q), scale or head_dim ** -0.5,
                                       window, softcap)
    check(q, k, v, floor, lse_tol, causal=causal, causal_alignment=alignment, window=window,
          softcap=softcap, scale=scale)
    assert dispatch.launched_forward_kernels()[0]["name"] == "_attn_fwd_hopper"


@pytest.mark.cuda
@pytest.mark.skipif(not on_hopper(), reason="the Gluon kernel runs on sm_90 only")
@pytest.mark.parametrize("causal", [True, False])
def test_hopper_kernel_never_reads_the_next_heads_keys(causal):
    # The last K/V block of head 0 runs past its 200 keys into the memory of head 1, whose keys
    # and values are infinite: a block that read them would turn head 0's rows into NaN (a
    # masked p = 0 times inf) or inf. Head 0 must match the reference computed on it alone.
    q, k, v = make_qkv(1, 2, 2, 300, 200, 128, torch.bfloat16, "cuda")
    k[:, 1], v[:, 1] = float("inf"), float("inf")
    assert dispatch.uses_hopper_kernel(q, k, v, torch.empty_like(q), 128 ** -0.5)
    out, lse = fused_attention(q, k, v, causal=causal, return_lse=True)
    head0 = lambda t: t[:, :1]  # noqa: E731
    check(head0(q), head0(k), head0(v), 4e-3, 1e-3, causal=causal,
          forward=lambda *_, **__: (head0(out), head0(lse)))


@pytest.mark.cuda
@pytest.mark.skipif(not on_hopper(), reason="the Gluon kernel runs on sm_90 only")
@pytest.mark.parametrize("head_dim", [128, 96, 112, 192])  # 96, 192: two parts; 112 padded
@pytest.mark.parametrize("width", [256, 260])
def test_hopper_kernel_strided_out(head_dim, width, monkeypatch):
    # An `out` that is not contiguous: rows of `width` elements, the first head_dim of each
    # out's. At 256 (512-byte rows) the copy engine stores it at its strides (STRIDED); at 260
    # (520 bytes, not a multiple of 16) it cannot, and the register stores do. Either writes the
    # values the op writes into a contiguous out, and nothing past the view's columns.
    q, k, v = make_qkv(1, 2, 2, 320, 300, head_dim, torch.bfloat16, "cuda")
    wide = torch.full((1, 2, 320, width), float("nan"), dtype=torch.bfloat16, device="cuda")
    out, lse = wide[..., :head_dim], torch.empty(1, 2, 320, device="cuda")
    scale = head_dim ** -0.5
    assert dispatch.uses_hopper_kernel(q, k, v, out, scale)
    hopper, launched = dispatch._hopper(), []
    launch = hopper._launch
    monkeypatch.setattr(hopper, "_launch", lambda key, grid, args, kwargs, **kw: (
        launched.append(kwargs), launch(key, grid, args, kwargs, **kw))[1])
    dispatch.forget_launches()
    dispatch.attention_fwd(q, k, v, out, lse, causal=True, scale=scale, causal_offset=0)
    assert [(c["STRIDED"], c["TMA_STORE"]) for c in launched] == [(width == 256,) * 2]
    assert torch.equal(out, fused_attention(q, k, v))
    assert wide[..., head_dim:].isnan().all()  # nothing written outside the view


def _strided_views(view, head_dim, dtype):
    # q, k, v and a NaN-poisoned out of (2 batches, 6 heads, 2 KV heads, 1000 queries, 700
    # keys) that are not contiguous, and what lies around them (inf: a copy that read it would
    # make the rows inf or NaN): flash-attn's bshd layout; K/V the first 700 rows of a 1024-row
    # cache; every row padded to 64 more columns.
    batch, heads, kv_heads, q_len, kv_len = 2, 6, 2, 1000, 700
    nan = float("nan")
    if view == "bshd":
        q, k, v = (t.transpose(1, 2) for t in make_qkv(batch, heads, kv_heads, q_len, kv_len,
                                                       head_dim, dtype, "cuda", "bshd"))
        out = torch.full((batch, q_len, heads, head_dim), nan, dtype=dtype,
                         device="cuda").transpose(1, 2)
    elif view == "kv_slices":
        q, k, v = make_qkv(batch, heads, kv_heads, q_len, 1024, head_dim, dtype, "cuda")
        k[:, :, kv_len:], v[:, :, kv_len:] = float("inf"), float("inf")
        k, v = k[:, :, :kv_len], v[:, :, :kv_len]
        out = torch.full_like(q, nan)
    else:  # padded rows
        def padded(t):
            wide = torch.full(t.shape[:-1] + (head_dim + 64,), float("inf"), dtype=dtype,
                              device="cuda")
            wide[..., :head_dim] = t
            return wide[..., :head_dim]
        q, k, v = map(padded, make_qkv(batch, heads, kv_heads, q_len, kv_len, head_dim, dtype,
                                       "cuda"))
        out = torch.full((batch, heads, q_len, head_dim + 64), nan, dtype=dtype,
                         device="cuda")[..., :head_dim]
    return q, k, v, out


# Every view at the table's head dims (112: boxes past the rows), causal or not; and the head
# dims table_config adds (72, 160, 224) causal: at 72 and 224 boxes past a head's columns read the
# next head's (bshd) or the row's padding (padded_rows) as nothing and write neither; 160's two
# parts cover its columns exactly
STRIDED_CASES = [*itertools.product(["bshd", "kv_slices", "padded_rows"],
                                    [128, 80, 96, 112, 192, 256], [True, False]),
                 *itertools.product(["bshd", "padded_rows"], [72, 160, 224], [True])]


@pytest.mark.cuda
@pytest.mark.skipif(not on_hopper(), reason="the Gluon kernel runs on sm_90 only")
@pytest.mark.parametrize("dtype,floor,lse_tol", GPU_DTYPES)
@pytest.mark.parametrize("view,head_dim,causal", STRIDED_CASES)
def test_hopper_kernel_strided_inputs(view, head_dim, causal, dtype, floor, lse_tol):
    # Tensors that are not contiguous take the kernel at their strides (4-D copy-engine views,
    # STRIDED): against the float64 reference, nothing read or written outside the views.
    q, k, v, out = _strided_views(view, head_dim, dtype)
    lse = torch.full(q.shape[:3], float("nan"), device="cuda")
    scale = head_dim ** -0.5
    assert not (q.is_contiguous() and k.is_contiguous() and out.is_contiguous())
    assert dispatch.uses_hopper_kernel(q, k, v, out, scale)

    def forward(*_, **__):
        dispatch.attention_fwd(q, k, v, out, lse, causal=causal, scale=scale, causal_offset=0)
        return out, lse
    check(q, k, v, floor, lse_tol, causal=causal, forward=forward)
    if view == "padded_rows":
        assert out.as_strided((*out.shape[:3], 64), out.stride(),
                              out.storage_offset() + head_dim).isnan().all()


@pytest.mark.cuda
@pytest.mark.skipif(not on_hopper(), reason="the Gluon kernel runs on sm_90 only")
def test_hopper_kernel_in_a_cuda_graph(fresh_launches):
    # A warmed-up shape replays from a CUDA graph (its tile schedule stays on the GPU); a shape
    # first met during capture is refused with a clear error instead of a broken capture. The
    # second shape must be new to the process: fresh_launches forgets what other tests warmed.
    replays_in_a_cuda_graph(*make_qkv(2, 4, 4, 640, 640, 128, torch.bfloat16, "cuda"))
    q2, k2, v2 = make_qkv(2, 4, 4, 768, 768, 128, torch.bfloat16, "cuda")
    with pytest.raises(RuntimeError, match="before capturing"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            fused_attention(q2, k2, v2)


@pytest.mark.cuda
@pytest.mark.skipif(not on_hopper(), reason="the Gluon kernel runs on sm_90 only")
def test_hopper_kernel_only_takes_what_it_supports():
    q, k, v = make_qkv(1, 2, 2, 256, 256, 128, torch.bfloat16, "cuda")
    out = torch.empty_like(q)
    scale = 128 ** -0.5
    assert dispatch.uses_hopper_kernel(q, k, v, out, scale)
    assert not dispatch.uses_hopper_kernel(q, k, v, out, 0.0)  # it masks before scaling
    k2, v2 = k[:, :, :200].contiguous(), v[:, :, :200].contiguous()
    assert dispatch.uses_hopper_kernel(q, k2, v2, out, scale)  # a ragged last K/V block
    # K/V slices of a longer cache, at their strides
    assert dispatch.uses_hopper_kernel(q, k[:, :, :200], v[:, :, :200], out, scale)
    assert not dispatch.uses_hopper_kernel(q[..., :64], k[..., :64], v[..., :64], out[..., :64],
                                          scale)  # head_dim 64 below MIN_QUERIES
    q96, k96, v96 = make_qkv(1, 2, 2, 256, 200, 96, torch.bfloat16, "cuda")
    assert dispatch.uses_hopper_kernel(q96, k96, v96, torch.empty_like(q96), scale)  # padded
    assert not dispatch.uses_hopper_kernel(q.float(), k.float(), v.float(), out.float(), scale)
    bshd = rearrange(torch.randn(1, 256, 2, 128, device="cuda", dtype=torch.bfloat16),
                     "b s h d -> b h s d")
    assert dispatch.uses_hopper_kernel(bshd, k, v, out, scale)  # flash-attn's layout
    rows_264 = torch.randn(1, 2, 256, 132, device="cuda", dtype=torch.bfloat16)[..., :128]
    assert not dispatch.uses_hopper_kernel(rows_264, k, v, out, scale)  # rows not 16-byte apart
    every_other = torch.randn(1, 2, 256, 256, device="cuda", dtype=torch.bfloat16)[..., ::2]
    assert not dispatch.uses_hopper_kernel(every_other, k, v, out, scale)  # columns apart


@pytest.mark.cuda
@pytest.mark.skipif(not on_hopper(), reason="the Gluon kernel runs on sm_90 only")
def test_short_calls_in_few_tiles_take_the_triton_kernel(monkeypatch):
    # SHORT_WORK's rule: keys x head_dim at most 256 x 128 in no more 128-row tiles than SMs
    # -> Triton; longer tiles, or more tiles than SMs -> Gluon. Either way the op is right.
    hopper = dispatch._hopper()
    monkeypatch.setattr(hopper, "SHORT_WORK", 256 * 128)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for (batch, heads, q_len, kv_len, head_dim), gluon in [
            ((1, 8, 256, 256, 128), False), ((1, 8, 300, 200, 128), False),
            ((1, 8, 256, 257, 128), True), ((1, 8, 256, 256, 192), True),
            ((1, 8, 128, 128, 256), False), ((1, 8, 340, 340, 96), False),
            ((1, 8, 1024, 1024, 96), True), ((1, 2, 4096, 256, 128), False),
            ((sms // 2, 2, 128, 128, 128), False), ((sms // 2 + 1, 2, 128, 128, 128), True)]:
        q, k, v = make_qkv(batch, heads, 2, q_len, kv_len, head_dim, torch.bfloat16, "cuda")
        assert dispatch.uses_hopper_kernel(q, k, v, torch.empty_like(q), 0.1) == gluon, (
            batch, heads, q_len, kv_len, head_dim)
        if batch * heads < 16:
            check(q, k, v, 4e-3, 1e-3, causal_alignment="bottom_right")
            ran = dispatch.launched_forward_kernels()[0]["name"]  # the kernel that ran last
            assert ran == ("_attn_fwd_hopper" if gluon else "_attn_fwd"), (q.shape, ran)


@pytest.mark.cuda
@pytest.mark.skipif(not on_hopper(), reason="the Gluon kernel runs on sm_90 only")
@pytest.mark.parametrize("head_dim", [80, 96])
def test_few_keys_at_split_head_dims_run_the_layout_for_them(head_dim):
    # layout_for's rule, through the op: the launched kernel's column parts and key blocks, in
    # calls of more 128-row tiles than SMs (144 heads) and, with 64-key blocks' keys, fewer.
    split = (64, head_dim - 64)
    padded = (128, 0) if head_dim == 80 else split
    for heads, kv_len, parts, block_n in [(144, 128, padded, 128), (144, 129, split, 64),
                                          (144, 512, split, 64), (144, 513, split, 128),
                                          (2, 500, split, 128)]:
        q, k, v = make_qkv(1, heads, 2, kv_len, kv_len, head_dim, torch.float16, "cuda")
        check(q, k, v, 4e-3, 1e-3)
        ran = dispatch.launched_forward_kernels()[0]
        assert ran["name"] == "_attn_fwd_hopper"
        config = ran["config"]
        assert (config["BLOCK_D0"], config["BLOCK_D1"], config["BLOCK_N"]) == (*parts, block_n)


def test_few_keys_at_split_head_dims_choose_padding_or_short_blocks():
    # layout_for on the CPU: dense calls of many tiles at 80 and 96 with few keys; few tiles,
    # packed batches (many_tiles False), other head dims and more keys keep column_parts and
    # the table.
    hopper = pytest.importorskip("attnscope.kernels.attention_fwd_hopper")
    table = hopper.CONFIGS
    for head_dim in (80, 96):
        split = hopper.column_parts(head_dim)
        assert split == (64, head_dim - 64)
        short = (64,) + table[head_dim][1:]
        padded = (128, 0) if head_dim == 80 else split  # a 16-column part pads
        assert hopper.layout_for(head_dim, 1, True) == (padded, table[head_dim])
        assert hopper.layout_for(head_dim, hopper.PADDED_KEYS, True) == (padded, table[head_dim])
        assert hopper.layout_for(head_dim, hopper.PADDED_KEYS + 1, True) == (split, short)
        assert hopper.layout_for(head_dim, hopper.SHORT_KEYS, True) == (split, short)
        assert hopper.layout_for(head_dim, hopper.SHORT_KEYS + 1, True) == (split, table[head_dim])
        for kv_len in (100, 300):
            assert hopper.layout_for(head_dim, kv_len, False) == (split, table[head_dim])
    for head_dim in (64, 112, 128, 192, 256):
        for kv_len in (1, 128, 300, 4096):
            assert hopper.layout_for(head_dim, kv_len, True) == (hopper.column_parts(head_dim),
                                                                 table[head_dim])


def test_block_loops_by_column_parts_and_keys():
    # block_loops on the CPU: one loop choosing each block's mask where the head_dim is one part
    # of 128 columns or more; elsewhere no loop for a dense call of at most one K/V block, two
    # loops (unmasked, then masked blocks) past that and for every packed batch (kv_len None).
    # A sliding window takes the same rule (its left edge's blocks get a masked loop first).
    hopper = pytest.importorskip("attnscope.kernels.attention_fwd_hopper")
    for parts in ((128, 0), (256, 0)):
        for kv_len in (1, 64, 128, 129, 4096, None):
            assert hopper.block_loops(*parts, 128, kv_len) == 1
    for parts in ((64, 0), (64, 16), (64, 32), (128, 64)):
        for block_n in (64, 128):
            assert hopper.block_loops(*parts, block_n, 1) == 0
            assert hopper.block_loops(*parts, block_n, block_n) == 0
            assert hopper.block_loops(*parts, block_n, block_n + 1) == 2
            assert hopper.block_loops(*parts, block_n, None) == 2
    # through layout_for: the head dims' own layouts at few and many keys
    for head_dim, kv_len, loops in ((64, 4096, 2), (96, 128, 0), (96, 300, 2), (80, 100, 1),
                                    (112, 4096, 1), (128, 128, 1), (192, 64, 0), (192, 4096, 2),
                                    (256, 64, 1)):
        parts, config = hopper.layout_for(head_dim, kv_len, True)
        assert hopper.block_loops(*parts, config[0], kv_len) == loops, (head_dim, kv_len)


def test_table_config_takes_multiples_of_8_by_family():
    # table_config on the CPU: the table's own entries; other multiples of 8 above 64 take 128's
    # config up to 128 and 256's above; nothing under 64, past 256 or off the copy engine's
    # 16-byte rows; their column parts as column_parts gives them. layout_for: above 128, 128's
    # config (128-key blocks) from WIDE_BLOCK_KEYS + 1 keys where Q and that ring fit shared
    # memory (136-160), few tiles or many
    hopper = pytest.importorskip("attnscope.kernels.attention_fwd_hopper")
    for head_dim, config in hopper.CONFIGS.items():
        assert hopper.table_config(head_dim) == config
    for head_dim in range(72, 129, 8):
        assert hopper.table_config(head_dim) == hopper.CONFIGS[128]
    long_call = hopper.WIDE_BLOCK_KEYS + 1
    for head_dim in range(136, 257, 8):
        assert hopper.table_config(head_dim) == hopper.CONFIGS[256]
        parts = hopper.column_parts(head_dim)
        wide = head_dim <= 160
        assert (hopper.ring_bytes(hopper.CONFIGS[128], parts) <= hopper.SHARED_MEMORY_BYTES) == wide
        for many_tiles in (False, True):
            assert hopper.layout_for(head_dim, long_call, many_tiles) == (
                parts, hopper.CONFIGS[128 if wide else 256])
            assert hopper.layout_for(head_dim, long_call - 1, many_tiles) == (
                parts, hopper.CONFIGS[256])
    for head_dim in (8, 32, 48, 56, 100, 130, 264, 512):
        assert hopper.table_config(head_dim) is None
    assert [hopper.column_parts(d) for d in (72, 88, 104, 136, 160, 176, 200, 248)] == [
        (64, 16), (64, 32), (128, 0), (128, 16), (128, 32), (128, 64), (256, 0), (256, 0)]


def test_pingpong_for_by_head_dim_and_keys():
    # pingpong_for on the CPU: the consumers take turns up to head_dim 96 at any length and in
    # packed batches (kv_len None); from 112 on only where a dense call's tiles hold at most
    # PINGPONG_SHORT_BLOCKS K/V blocks
    hopper = pytest.importorskip("attnscope.kernels.attention_fwd_hopper")
    short = hopper.PINGPONG_SHORT_BLOCKS
    for head_dim in (64, 80, 96):
        for kv_len in (1, 128, 4096, None):
            assert hopper.pingpong_for(head_dim, 128, kv_len)
    for head_dim in (112, 128, 192, 256):
        for block_n in (64, 128):
            assert hopper.pingpong_for(head_dim, block_n, 1)
            assert hopper.pingpong_for(head_dim, block_n, short * block_n)
            assert not hopper.pingpong_for(head_dim, block_n, short * block_n + 1)
            assert not hopper.pingpong_for(head_dim, block_n, None)


def _as_an_h200(monkeypatch, hopper):
    # the Gluon forward's launch on CPU tensors sees an H200's properties
    from attnscope.kernels import common
    h200 = types.SimpleNamespace(major=9, multi_processor_count=132, L2_cache_size=60 << 20)
    monkeypatch.setattr(hopper, "device_properties", lambda device: h200)
    monkeypatch.setattr(common, "device_properties", lambda device: h200)


def _recorded_launches(monkeypatch, hopper, field):
    # attention_fwd_hopper on CPU tensors as on an H200, each launch recorded (not run) as
    # (the kernel's constexpr `field`, the launch config's, the launch key); call(seq, head_dim,
    # **kw) launches a causal [2, 4, seq, head_dim] call and returns its (kernel's, config's)
    _as_an_h200(monkeypatch, hopper)
    launched = []

    def record(key, grid, args, kwargs, **kw):
        launched.append((kwargs[field], kw["config"][field], key))
    monkeypatch.setattr(hopper, "_launch", record)
    monkeypatch.setattr(hopper, "_launch_packed", record)

    def call(seq, head_dim, **kw):
        q = torch.empty(2, 4, seq, head_dim, dtype=torch.bfloat16)
        hopper.attention_fwd_hopper(q, q, q, torch.empty_like(q), torch.empty(2, 4, seq),
                                    causal=True, scale=0.1, causal_offset=0, **kw)
        return launched[-1][:2]
    return launched, call


def test_the_launch_passes_block_loops_and_refuses_a_forced_none_over_many_blocks(monkeypatch):
    # attention_fwd_hopper on CPU tensors up to its launch (an H200's properties, the launch
    # recorded): BLOCK_LOOPS as block_loops says, or as a lab forces it; no loop forced where a
    # tile holds more than one K/V block, or on a packed batch, is refused (the loader would
    # fill a ring nobody reads).
    hopper = pytest.importorskip("attnscope.kernels.attention_fwd_hopper")
    from attnscope.attention.varlen import _as_batched
    launched, call = _recorded_launches(monkeypatch, hopper, "BLOCK_LOOPS")
    assert call(128, 96) == (0, 0) and call(1024, 96) == (2, 2) and call(1024, 128) == (1, 1)
    assert call(128, 96, loops=2) == (2, 2) and call(1024, 128, loops=2) == (2, 2)
    assert call(128, 128, loops=0) == (0, 0)
    assert launched[-1][2] != launched[-2][2]  # a forced form is its own launch
    assert call(64, 96, config=(64, 2, 240, 2), loops=0) == (0, 0)  # a lab's 64-key blocks
    for seq, loops, config in ((129, 0, None), (1024, 0, None), (128, 3, None),
                               (100, 0, (64, 2, 240, 2))):
        with pytest.raises(ValueError, match="loops must be"):
            call(seq, 96, loops=loops, config=config)
    # a window takes the same loops (its left edge's blocks a masked loop of their own, within
    # BLOCK_LOOPS 2), one loop when forced; a window or a softcap is its own launch
    assert call(1024, 96, window=(300, -1)) == (2, 2)
    assert call(128, 96, window=(300, -1)) == (0, 0)
    assert call(1024, 96, softcap=30.0) == (2, 2)
    assert call(1024, 96, window=(300, -1), loops=1) == (1, 1)
    call(1024, 128)
    plain = launched[-1][2]
    call(1024, 128, window=(300, -1))
    call(1024, 128, softcap=30.0)
    assert len({plain, launched[-2][2], launched[-1][2]}) == 3
    packed = _as_batched(torch.empty(600, 4, 96, dtype=torch.bfloat16), 2)  # the op's view
    cu = torch.tensor([0, 100, 600], dtype=torch.int32)
    kw = dict(causal=True, scale=0.1, causal_offset=0, varlen=(cu, cu, 500, 500))
    hopper.attention_fwd_hopper(packed, packed, packed, torch.empty_like(packed),
                                torch.empty(4, 600), **kw)
    assert launched[-1][:2] == (2, 2)
    with pytest.raises(ValueError, match="packed"):
        hopper.attention_fwd_hopper(packed, packed, packed, torch.empty_like(packed),
                                    torch.empty(4, 600), loops=0, **kw)
    tile_schedule.forget_schedules()  # the CPU tensors' schedules made above


def test_the_launch_passes_pingpong_and_a_labs_forced_form(monkeypatch):
    # attention_fwd_hopper on CPU tensors up to its launch: PINGPONG as pingpong_for says (the
    # table's 128-key blocks at 96 and 128, 64-key ones at 192 and 256), or as a lab forces it,
    # each its own launch
    hopper = pytest.importorskip("attnscope.kernels.attention_fwd_hopper")
    from attnscope.attention.varlen import _as_batched
    launched, call = _recorded_launches(monkeypatch, hopper, "PINGPONG")
    short = hopper.PINGPONG_SHORT_BLOCKS * 64
    assert call(4096, 96) == (True, True)
    default = launched[-1][2]  # (4096, 96)'s key
    assert call(2 * short, 128) == (True, True) and call(2 * short + 1, 128) == (False, False)
    assert call(short, 192) == (True, True) and call(short + 1, 192) == (False, False)
    assert call(short, 256) == (True, True) and call(4096, 256) == (False, False)
    assert call(4096, 96, pingpong=False) == (False, False)
    assert launched[-1][2] != default  # the forced form is its own launch
    assert call(4096, 128, pingpong=True) == (True, True)
    assert call(short, 192, pingpong=False) == (False, False)
    packed = _as_batched(torch.empty(600, 4, 192, dtype=torch.bfloat16), 2)  # the op's view
    cu = torch.tensor([0, 100, 600], dtype=torch.int32)
    hopper.attention_fwd_hopper(packed, packed, packed, torch.empty_like(packed),
                                torch.empty(4, 600), causal=True, scale=0.1, causal_offset=0,
                                varlen=(cu, cu, 500, 500))
    assert launched[-1][:2] == (False, False)  # a packed batch: by head_dim alone
    tile_schedule.forget_schedules()  # the CPU tensors' schedules made above


def test_a_labs_column_parts_are_checked():
    # attention_fwd_hopper(parts=...): widths the kernel's buffers take, covering head_dim (a
    # packed batch's exactly: a wider box would read the next head's columns).
    hopper = pytest.importorskip("attnscope.kernels.attention_fwd_hopper")
    for parts, head_dim, packed, ok in [((128, 0), 80, False, True), ((64, 16), 80, True, True),
                                        ((128, 0), 80, True, False), ((64, 16), 96, False, False),
                                        ((64, 32), 96, False, True), ((96, 0), 96, False, False),
                                        ((16, 64), 80, False, False), ((128, 8), 136, False, False),
                                        ((128,), 128, False, False)]:
        assert hopper._parts_ok(parts, head_dim, packed) == ok, (parts, head_dim, packed)


def test_strided_views_the_copy_engine_reads():
    # tma_strided_ok on the CPU: which dense views the kernel reads at their strides (a 4-D TMA
    # view wants a unit last stride and the others positive 16-byte multiples), and the strides
    # it is given (tma_view_strides: a dimension of one element gets a contiguous tensor's).
    from attnscope.kernels import common
    f16 = dict(dtype=torch.float16, device="meta")
    bshd = torch.empty(2, 300, 4, 128, **f16).transpose(1, 2)
    assert common.tma_strided_ok(bshd) and common.tma_view_strides(bshd) == (300 * 512, 128, 512)
    assert common.tma_strided_ok(torch.empty(2, 4, 300, 128, **f16))  # contiguous
    assert common.tma_strided_ok(torch.empty(2, 4, 1024, 128, **f16)[:, :, :300])  # a K/V slice
    assert common.tma_strided_ok(torch.empty(2, 4, 300, 192, **f16)[..., :128])  # padded rows
    assert not common.tma_strided_ok(torch.empty(2, 4, 300, 132, **f16)[..., :128])  # 264-byte rows
    assert not common.tma_strided_ok(torch.empty(2, 4, 300, 256, **f16)[..., ::2])  # columns apart
    assert not common.tma_strided_ok(torch.empty(2, 1, 300, 128, **f16).expand(2, 4, 300, 128))
    # one batch, one head, one query: their strides address nothing and are replaced
    odd = torch.empty(1, 1, 1, 128, **f16).as_strided((1, 1, 1, 128), (3, 5, 7, 1))
    assert common.tma_view_strides(odd) == (128, 128, 128) and common.tma_strided_ok(odd)
    decode = torch.empty(3, 1, 8, 128, **f16).transpose(1, 2)  # bshd, one query a sequence
    assert common.tma_view_strides(decode) == (1024, 128, 128)


def test_the_short_tile_rule_counts_keys_times_head_dim_and_tiles(monkeypatch):
    # The rule itself, on the CPU: a fake 132-SM device; q/k as shapes only.
    hopper = pytest.importorskip("attnscope.kernels.attention_fwd_hopper")
    props = type("Props", (), {"multi_processor_count": 132, "major": 9})()
    monkeypatch.setattr(hopper, "device_properties", lambda device: props)
    monkeypatch.setattr(hopper, "SHORT_WORK", 256 * 128)
    meta = lambda *shape: torch.empty(shape, device="meta")  # noqa: E731
    for (batch, heads, q_len, kv_len, head_dim), short in [
            ((1, 8, 256, 256, 128), True), ((1, 8, 256, 257, 128), False),
            ((1, 8, 128, 128, 256), True), ((1, 8, 128, 129, 256), False),
            ((1, 8, 409, 409, 80), True), ((1, 8, 410, 410, 80), False),
            ((66, 2, 128, 128, 128), True), ((67, 2, 128, 128, 128), False),
            ((1, 2, 8448, 100, 64), True), ((1, 2, 8449, 100, 64), False)]:
        q, k = meta(batch, heads, q_len, head_dim), meta(batch, 2, kv_len, head_dim)
        assert hopper._short(q, k) == short, (batch, heads, q_len, kv_len, head_dim)


def test_three_consumers_where_every_program_has_many_tiles(monkeypatch):
    # THREE_CONSUMERS' config (192-row tiles) for dense head_dim-64 calls of at least
    # MIN_TILES_PER_PROGRAM such tiles a program, on CPU tensors up to the launch (an H200's
    # properties, the launch recorded); two consumers otherwise, and for packed batches
    hopper = pytest.importorskip("attnscope.kernels.attention_fwd_hopper")
    from attnscope.attention.varlen import _as_batched
    assert hopper.MIN_TILES_PER_PROGRAM == 4 and hopper.THREE_CONSUMERS[64][3] == 3
    assert hopper.three_consumers(64, 8 * 16, 16384, 132)  # 86 tiles a head
    assert hopper.three_consumers(64, 528, 192, 132) and not hopper.three_consumers(
        64, 527, 192, 132)
    assert not hopper.three_consumers(64, 2 * 16, 2500, 132)  # 448 tiles: 3.4 a program
    assert not hopper.three_consumers(128, 8 * 16, 16384, 132)
    assert hopper.MIN_WINDOW_KEYS == 3072
    assert all(map(hopper._config_fits, [*hopper.CONFIGS.values(),
                                         *hopper.THREE_CONSUMERS.values()]))
    _as_an_h200(monkeypatch, hopper)
    launched = []
    monkeypatch.setattr(hopper, "_launch", lambda key, grid, args, kwargs, **kw: launched.append(
        (kwargs["NUM_WG"], args[-1], grid[0])))
    monkeypatch.setattr(hopper, "_launch_packed", hopper._launch)

    def call(batch, heads, seq, varlen=None):
        q = torch.empty(batch, heads, seq, 64, dtype=torch.bfloat16)
        hopper.attention_fwd_hopper(q, q, q, torch.empty_like(q), torch.empty(batch, heads, seq),
                                    causal=True, scale=0.1, causal_offset=0, varlen=varlen)
        return launched[-1]
    assert call(8, 16, 16384) == (3, 86, 132)  # NUM_WG, query tiles a head (NUM_M), programs
    assert call(2, 16, 2500) == (2, 20, 132)
    q = torch.empty(8, 16, 16384, 64, dtype=torch.bfloat16)
    # a window reaching MIN_WINDOW_KEYS keys left or more takes three, on causal and non-causal
    # calls, with a right edge or without; a narrower one and a softcap keep two
    for kw, consumers in ((dict(window=(3072, 0)), 3), (dict(window=(3071, 0)), 2),
                          (dict(window=(512, -1)), 2), (dict(window=(-1, 100)), 3),
                          (dict(window=(-1, 100), causal=False), 3),
                          (dict(window=(4000, 100), causal=False), 3),
                          (dict(window=(300, 100), causal=False), 2),
                          (dict(window=(4000, -1), causal=False), 3),
                          (dict(window=(3071, -1), causal=False), 2),
                          (dict(causal=False), 3),
                          (dict(softcap=30.0), 2), (dict(window=(4096, 0), softcap=30.0), 2)):
        hopper.attention_fwd_hopper(q, q, q, torch.empty_like(q), torch.empty(8, 16, 16384),
                                    scale=0.1, causal_offset=0, **{"causal": True, **kw})
        assert launched[-1][0] == consumers, kw
    bshd = torch.empty(8, 16384, 16, 64, dtype=torch.bfloat16).transpose(1, 2)
    hopper.attention_fwd_hopper(bshd, bshd, bshd, torch.empty_like(bshd), torch.empty(8, 16, 16384),
                                causal=True, scale=0.1, causal_offset=0)
    assert launched[-1][0] == 3  # q, k, v and out at their strides (STRIDED)
    # an out the copy engine cannot address (rows 8 bytes apart from a 16-byte boundary) keeps
    # two consumers: its register stores have not run on three
    odd = torch.empty(8 * 16 * 16384 * 64 + 4, dtype=torch.bfloat16)[4:].view(q.shape)
    hopper.attention_fwd_hopper(q, q, q, odd, torch.empty(8, 16, 16384),
                                causal=True, scale=0.1, causal_offset=0)
    assert launched[-1][0] == 2
    for config in ((128, 2, 240, 3), (128, 2, 160, 4), (128, 2, 240, 1)):
        with pytest.raises(ValueError, match="2 or 3 consumers"):
            hopper.attention_fwd_hopper(q, q, q, torch.empty_like(q), torch.empty(8, 16, 16384),
                                        causal=True, scale=0.1, causal_offset=0, config=config)
    cu = torch.tensor([0, 9000, 16384], dtype=torch.int32)
    packed = torch.empty(16384, 64, 64, dtype=torch.bfloat16)
    q = _as_batched(packed, 2)
    hopper.attention_fwd_hopper(q, q, q, torch.empty_like(q), torch.empty(64, 16384),
                                causal=True, scale=0.1, causal_offset=0,
                                varlen=(cu, cu, 9000, 9000))
    assert launched[-1][0] == 2  # packed batches keep two


@pytest.mark.cuda
@pytest.mark.skipif(not on_hopper(), reason="the Gluon kernel runs on sm_90 only")
@pytest.mark.parametrize("scale", [0.0, -0.2])
def test_non_positive_scale_on_hopper_shapes(scale):
    # Such calls run the Triton kernel, which scales before masking.
    q, k, v = make_qkv(1, 2, 2, 300, 384, 128, torch.bfloat16, "cuda")
    check(q, k, v, 4e-3, 1e-3, scale=scale)


def test_hopper_kernel_is_never_used_on_cpu():
    q, k, v = make_qkv(1, 2, 2, 8, 128, 128, torch.float16, CPU)
    assert not dispatch.uses_hopper_kernel(q, k, v, torch.empty_like(q), 0.1)


@pytest.mark.cuda
@pytest.mark.skipif(not on_hopper(), reason="the Gluon kernel runs on sm_90 only")
def test_hopper_kernel_with_the_round_robin_schedule(fresh_launches, monkeypatch):
    # Launches of more than SCHEDULE_MAX_TILES tiles hand tiles out round-robin; forced here at a
    # shape of more tiles than SMs, so programs run several tiles in that order.
    monkeypatch.setattr(tile_schedule, "SCHEDULE_MAX_TILES", 0)
    q, k, v = make_qkv(3, 16, 16, 2048, 2048, 128, torch.bfloat16, "cuda")
    check(q, k, v, 4e-3, 1e-3)
