"""Sliding window and softcap of fused_attention, forward and backward, against float64.

The forward's tolerance rule is fused_checks.check's, the gradients' test_fused_attention_backward's
(twice torch's own error in the input dtype, plus a floor): both pass `window` and `softcap` to
the reference (attention_reference) as to the op. Outputs, gradients and scratch start as NaN.

The interpreter tiles are BLOCK_M 32 x BLOCK_N 16 in the forward (pipelined loop), 16 x 32 in
the dK/dV kernel and 32 x 16 in the dQ kernel, so the windows below are chosen against 16 and 32:
left sizes 0, 1, 7, 15, 16 and one past the sequence; right sizes likewise for non-causal calls.
Lengths of 40-70 give 2-5 blocks each way: every stage (the window's left edge, whole blocks, the
diagonal or right edge, ragged ends) runs. Few, small cases: the interpreter is slow.
"""

import pytest
import torch

import triton
import triton.language as tl

from attnscope import fused_attention
from attnscope.attention import fused
from attnscope.attention.reference import window_mask
from attnscope.kernels.common import _window_key_ranges, visibility
from fused_checks import CPU, CPU_DTYPES, GPU_DTYPES, check, make_qkv, nan_outputs  # noqa: F401
from test_fused_attention_backward import CPU_DTYPES as GRAD_CPU_DTYPES
from test_fused_attention_backward import GPU_DTYPES as GRAD_GPU_DTYPES
from test_fused_attention_backward import check_grads


def check_both(q, k, v, dtype, **kwargs):
    """The forward (output, LSE) and the gradients of one call against float64."""
    floor, lse_tol = {d: (f, t) for d, f, t in CPU_DTYPES + GPU_DTYPES}[dtype]
    check(q, k, v, floor, lse_tol, **kwargs)
    grad_floor = dict(GRAD_CPU_DTYPES + GRAD_GPU_DTYPES)[dtype]
    return check_grads(q, k, v, grad_floor, **kwargs)


# (q_len, kv_len, causal, alignment, window, softcap)
CASES = [
    (70, 70, True, "top_left", (0, -1), 0.0),  # each row sees itself only: every block masked
    (70, 70, True, "top_left", (1, -1), 0.0),  # two keys, crossing a block edge every 16 rows
    (40, 70, True, "bottom_right", (7, -1), 0.0),  # cuts inside blocks; more keys than queries
    (70, 70, True, "top_left", (15, -1), 0.0),  # BLOCK_N - 1: whole blocks only at the edges
    (50, 70, True, "bottom_right", (16, -1), 0.0),  # BLOCK_N
    (45, 45, True, "top_left", (200, -1), 0.0),  # wider than the sequence: plain causal
    (70, 40, False, "top_left", (7, 16), 0.0),  # rows 56.. see no key (fewer keys than queries)
    (40, 70, False, "bottom_right", (0, 0), 0.0),  # one key per row, right of keys 0..29
    (70, 70, False, "top_left", (-1, 15), 0.0),  # right edge only (a causal bound moved right)
    (70, 40, False, "bottom_right", (31, 1), 0.0),  # first 29 rows see nothing
    (45, 45, False, "top_left", (-1, 100), 0.0),  # right edge past the sequence: no mask at all
    (70, 70, False, "top_left", (7, -1), 0.0),  # left edge only: a masked block some rows miss
    (70, 70, True, "top_left", (-1, -1), 5.0),  # softcap alone, causal
    (40, 70, False, "bottom_right", (-1, -1), 5.0),  # softcap alone, non-causal, ragged K
    (70, 70, True, "bottom_right", (16, -1), 5.0),  # softcap and window together
]


@pytest.mark.parametrize("q_len,kv_len,causal,alignment,window,softcap", CASES)
def test_window_and_softcap(q_len, kv_len, causal, alignment, window, softcap):
    # fp32 at scale 1.0 with softcap (scores ~N(0, 16), so the cap of 5 saturates most logits and
    # its derivative 1 - tanh^2 matters), the default scale without; GQA, 4 q heads on 2 K/V heads
    q, k, v = make_qkv(1, 4, 2, q_len, kv_len, 16, torch.float32, CPU)
    scale = 1.0 if softcap else None
    check_both(q, k, v, torch.float32, causal=causal, causal_alignment=alignment, window=window,
               softcap=softcap, scale=scale)


@pytest.mark.parametrize("dtype", [torch.float16])
@pytest.mark.parametrize("window,softcap", [((7, -1), 0.0), ((16, -1), 30.0)])
def test_fp16_bshd(window, softcap, dtype):
    # fp16 (P and dS are cast to it before their dots), the bshd layout and a padded head_dim 40
    q, k, v = make_qkv(1, 2, 1, 50, 50, 40, dtype, CPU, "bshd")
    check_both(q, k, v, dtype, window=window, softcap=softcap, layout="bshd")


def test_rows_without_keys_are_zero_with_zero_gradients():
    # window (31, 1), bottom-right with 70 queries on 40 keys: rows 0..28 see no key
    q, k, v = make_qkv(1, 2, 2, 70, 40, 16, torch.float32, CPU)
    kwargs = dict(causal=False, causal_alignment="bottom_right", window=(31, 1))
    dq, dk, dv = check_both(q, k, v, torch.float32, **kwargs)
    empty = ~window_mask(70, 40, "bottom_right", (31, 1), False).any(dim=1)
    assert empty.sum() == 29
    out, lse = fused_attention(q, k, v, return_lse=True, **kwargs)
    assert torch.equal(out[:, :, empty], torch.zeros_like(out[:, :, empty]))
    assert torch.isneginf(lse[:, :, empty]).all() and not torch.isneginf(lse[:, :, ~empty]).any()
    assert torch.equal(dq[:, :, empty], torch.zeros_like(dq[:, :, empty]))


@triton.jit
def _ranges_kernel(Out, N_CTX_K, CAUSAL_OFFSET, LEFT_OFFSET, CAUSAL: tl.constexpr,
                   HAS_WINDOW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start_m = tl.program_id(0)
    lo, full_lo, full_hi, hi = _window_key_ranges(start_m, N_CTX_K, CAUSAL_OFFSET, LEFT_OFFSET,
                                                  CAUSAL, HAS_WINDOW, BLOCK_M, BLOCK_N)
    tl.store(Out + start_m * 4 + tl.arange(0, 4),
             tl.where(tl.arange(0, 4) == 0, lo, tl.where(tl.arange(0, 4) == 1, full_lo,
                      tl.where(tl.arange(0, 4) == 2, full_hi, hi))))


@pytest.mark.parametrize("q_len,kv_len,alignment,window,causal", [
    (100, 100, "top_left", (7, -1), True),
    (64, 100, "bottom_right", (0, -1), True),
    (100, 60, "top_left", (20, 5), False),
    (100, 100, "bottom_right", (64, -1), True),
])
def test_key_ranges_skip_blocks_outside_the_window(q_len, kv_len, alignment, window, causal):
    # Each query block visits [lo, hi): every key its rows see lies there, the block before lo
    # holds none (skipped, not masked), and every row sees every key of [full_lo, full_hi).
    block_m, block_n = 32, 16  # the interpreter's forward tiles
    offset = kv_len - q_len if alignment == "bottom_right" else 0
    bounded, upper, has_window, left_offset = visibility(causal, offset, window)
    num_m = -(-q_len // block_m)
    out = torch.full((num_m, 4), -999, dtype=torch.int32)
    _ranges_kernel[(num_m,)](out, kv_len, upper, left_offset, bounded, has_window, block_m,
                             block_n)
    visible = window_mask(q_len, kv_len, alignment, window, causal)
    for m in range(num_m):
        lo, full_lo, full_hi, hi = out[m].tolist()
        rows = visible[m * block_m:(m + 1) * block_m]
        seen = rows.any(dim=0).nonzero().flatten()
        assert lo % block_n == 0 and lo <= full_lo <= full_hi and full_hi <= max(hi, lo)
        if len(seen):
            assert lo <= seen.min() < lo + block_n and seen.max() < hi
        else:
            assert hi <= lo  # nothing visited
        if full_hi > full_lo:
            # rows past q_len do not exist, so only real rows must see the whole block
            assert rows[:, full_lo:full_hi].all()


def test_window_validation():
    q, k, v = make_qkv(1, 1, 1, 8, 8, 16, torch.float32, CPU)
    with pytest.raises(ValueError, match="causal=True"):
        fused_attention(q, k, v, window=(4, 2))
    with pytest.raises(ValueError, match=">= 0, or -1"):
        fused_attention(q, k, v, window=(-2, 0))
    with pytest.raises(TypeError, match="pair of ints"):
        fused_attention(q, k, v, window=(4,))
    with pytest.raises(TypeError, match="pair of ints"):
        fused_attention(q, k, v, window=(4.0, 0))
    with pytest.raises(ValueError, match="softcap"):
        fused_attention(q, k, v, softcap=-1.0)
    with pytest.raises(ValueError, match="softcap"):
        fused_attention(q, k, v, softcap=float("inf"))


@pytest.mark.parametrize("window, causal", [((-1, 2**31 - 1), False), ((2**31 - 1, 0), True),
                                           ((2**31 - 40, -1), True), ((120, 2**31), False)])
def test_window_sizes_past_the_sequence_are_unbounded(window, causal):
    # A side as long as the queries and keys together hides nothing: it runs as -1, so sizes
    # near 2^31 (INT32_MAX for "unbounded") never reach the kernels' 32-bit offsets, where they
    # wrapped (wrong outputs, LSE inf, NaN gradients). The backward through the same call.
    torch.manual_seed(11)
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, 1, 33, 40, 16, torch.float32, CPU))
    unbounded = (-1 if window[0] >= 73 else window[0], -1 if window[1] >= 73 else window[1])
    kwargs = dict(causal=causal, causal_alignment="bottom_right")
    out, lse = fused_attention(q, k, v, window=window, return_lse=True, **kwargs)
    ref, ref_lse = fused_attention(q, k, v, window=unbounded, return_lse=True, **kwargs)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads))


def test_custom_op_takes_window_and_softcap():
    # What torch.compile and dispatch modes call: the op with the window and the softcap as its
    # trailing arguments gives the eager call's result.
    q, k, v = make_qkv(1, 2, 1, 40, 40, 16, torch.float32, CPU)
    out, lse = fused._attention_fwd(q, k, v, True, 0.25, False, "bhsd", 7, -1, 5.0)
    ref, ref_lse = fused_attention(q, k, v, scale=0.25, window=(7, -1), softcap=5.0,
                                   return_lse=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)


# ---- GPU ------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [d for d, _, _ in GPU_DTYPES])
@pytest.mark.parametrize("causal,alignment,window,softcap", [
    (True, "top_left", (1024, -1), 0.0),  # Mistral-style window
    (True, "bottom_right", (1024, -1), 50.0),  # and Gemma 2's softcap (chunked prefill shape)
    (False, "top_left", (-1, -1), 50.0),  # softcap alone, non-causal
    (False, "bottom_right", (300, 77), 0.0),  # two-sided window, edges inside blocks
])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gpu_realistic(causal, alignment, window, softcap, head_dim, dtype):
    # 4k keys, 8 q heads on 2 K/V heads; 3000 queries so that the alignments differ
    q, k, v = make_qkv(1, 8, 2, 3000, 4096, head_dim, dtype, "cuda")
    check_both(q, k, v, dtype, causal=causal, causal_alignment=alignment, window=window,
               softcap=softcap)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [d for d, _, _ in GPU_DTYPES])
@pytest.mark.parametrize("window,softcap", [((37, -1), 0.0), ((100, -1), 20.0), ((-1, -1), 20.0)])
@pytest.mark.parametrize("head_dim", [64, 96])
def test_gpu_few_keys(window, softcap, head_dim, dtype):
    # at most FEW_KEYS (256) queries and keys: the Triton kernel's few-key configs (32-key
    # blocks at head_dim 64, 64-row tiles at 96) under a window's left edge and a softcap
    q, k, v = make_qkv(2, 4, 2, 200, 250, head_dim, dtype, "cuda")
    check_both(q, k, v, dtype, causal=True, causal_alignment="bottom_right", window=window,
               softcap=softcap)
