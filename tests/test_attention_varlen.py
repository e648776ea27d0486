"""fused_attention_varlen (packed sequences) against the float64 per-sequence reference.

Tolerance rule as tests/fused_checks.py's and the backward's: the error of the output and of
each gradient against float64 autograd of attention_reference_varlen must be at most twice the
error of that reference run in the input dtype, plus a floor (the same floors). Every buffer
the op allocates starts as NaN. Causal sequences are aligned bottom-right (flash-attn's varlen).
"""

import pytest
import torch

from attnscope import fused_attention_varlen
from attnscope.attention.reference import attention_reference_varlen
from attnscope.attention.varlen import _as_batched
from attnscope.kernels import dispatch
from fused_checks import CPU, CPU_DTYPES, GPU_DTYPES, nan_outputs, on_hopper  # noqa: F401
from test_fused_attention_backward import CPU_DTYPES as GRAD_CPU_DTYPES
from test_fused_attention_backward import GPU_DTYPES as GRAD_GPU_DTYPES


def packed(lengths_q, lengths_k, heads, kv_heads, head_dim, dtype, device):
    """Random packed q, k, v and their int32 cumulative lengths."""
    def cumulative(lengths):
        return torch.tensor([0, *lengths], device=device).cumsum(0).to(torch.int32)
    q = torch.randn(sum(lengths_q), heads, head_dim, dtype=dtype, device=device)
    k = torch.randn(sum(lengths_k), kv_heads, head_dim, dtype=dtype, device=device)
    v = torch.randn(sum(lengths_k), kv_heads, head_dim, dtype=dtype, device=device)
    return q, k, v, cumulative(lengths_q), cumulative(lengths_k)


def _grads(fn, inputs, dout):
    leaves = [t.detach().requires_grad_() for t in inputs]
    out, lse = fn(*leaves)
    return (out, lse, *torch.autograd.grad(out, leaves, dout)) if out.numel() else (out, lse)


def check_varlen(lengths_q, lengths_k, heads, kv_heads, head_dim, dtype, device, **kwargs):
    """Output, LSE and gradients of one packed call against the float64 reference."""
    floor, lse_tol = {d: (f, t) for d, f, t in CPU_DTYPES + GPU_DTYPES}[dtype]
    grad_floor = dict(GRAD_CPU_DTYPES + GRAD_GPU_DTYPES)[dtype]
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, heads, kv_heads, head_dim, dtype, device)
    dout = torch.randn_like(q)
    ours = _grads(lambda *t: fused_attention_varlen(*t, cu_q, cu_k, max(lengths_q),
                                                    max(lengths_k), return_lse=True, **kwargs),
                  (q, k, v), dout)
    ref = _grads(lambda *t: attention_reference_varlen(*t, cu_q, cu_k, return_lse=True,
                                                       **kwargs),
                 (q.double(), k.double(), v.double()), dout.double())
    low = _grads(lambda *t: attention_reference_varlen(*t, cu_q, cu_k, return_lse=True,
                                                       dtype=dtype, **kwargs), (q, k, v), dout)
    out, lse, ref_out, ref_lse = ours[0], ours[1], ref[0], ref[1]
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (heads, q.shape[0]) and lse.dtype == torch.float32
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "LSE -inf on empty rows"
    seen = ~torch.isneginf(ref_lse)
    if seen.any():
        lse_err = (lse.double() - ref_lse)[seen].abs().max().item()
        assert lse_err <= lse_tol * max(1.0, ref_lse[seen].abs().max().item())
    names = ("out", "dq", "dk", "dv")
    for name, a, r, lo in zip(names, ours[:1] + ours[2:], ref[:1] + ref[2:], low[:1] + low[2:]):
        assert not a.isnan().any(), f"{name} has NaN (unwritten element or 0/0)"
        if not a.numel():
            continue
        err = (a.double() - r).abs().max().item()
        torch_err = (lo.double() - r).abs().max().item()
        scale = 1.0 if name == "out" else max(1.0, r.abs().max().item())
        bound = 2 * torch_err + (floor if name == "out" else grad_floor) * scale
        assert err <= bound, f"{name}: error {err:.3g} > 2 x torch's {torch_err:.3g} + floor"
    return ours, cu_q, cu_k


# ---- CPU (Triton interpreter; forward tiles 32 x 16, backward 16 x 32 and 32 x 16) ----------

def test_causal_gqa_with_empty_sequences():
    # sequence 0: more keys than queries; 1: keys but no query (its dk/dv must be 0);
    # 2: 37 queries on 30 keys, crossing blocks (bottom-right: rows 0..6 see no key);
    # 3: queries but no key (zeros, LSE -inf); 4: one query, one key.
    (out, lse, dq, dk, dv), cu_q, cu_k = check_varlen(
        [5, 0, 37, 20, 1], [9, 4, 30, 0, 1], 4, 2, 16, torch.float32, CPU)
    assert torch.equal(out[42:62], torch.zeros_like(out[42:62]))
    assert torch.isneginf(lse[:, 42:62]).all()
    assert torch.equal(dk[9:13], torch.zeros_like(dk[9:13]))
    assert torch.equal(dv[9:13], torch.zeros_like(dv[9:13]))


def test_window_softcap_non_causal():
    # a two-sided window (7, 3) and a softcap of 4 at scale 1.0 (so that the cap saturates),
    # per sequence from its own bottom-right alignment; MQA; odd lengths over several blocks
    check_varlen([5, 3, 37, 20], [9, 4, 50, 33], 3, 1, 16, torch.float32, CPU, causal=False,
                 window=(7, 3), softcap=4.0, scale=1.0)


def test_causal_window_fp16():
    # fp16, a causal window of 16 (BLOCK_N), head_dim 40 padded to 64; fewer keys than queries
    # in the first sequence and more in the second
    check_varlen([17, 40], [9, 70], 2, 2, 40, torch.float16, CPU, window=(16, -1))


def test_window_sizes_past_the_sequences_are_unbounded():
    # as fused_attention's (test_attention_window): a side near 2^31 runs as -1, not wrapped
    q, k, v, cu_q, cu_k = packed([5, 20], [9, 33], 2, 1, 16, torch.float32, CPU)
    args = (q, k, v, cu_q, cu_k, 20, 33)
    out = fused_attention_varlen(*args, causal=False, window=(-1, 2**31 - 1))
    assert torch.equal(out, fused_attention_varlen(*args, causal=False))


def test_no_query_at_all():
    # every sequence empty in q: nothing to launch, empty outputs, zero dk/dv
    q, k, v, cu_q, cu_k = packed([0, 0], [3, 5], 2, 1, 16, torch.float32, CPU)
    k.requires_grad_()
    out, lse = fused_attention_varlen(q, k, v, cu_q, cu_k, 0, 5, return_lse=True)
    assert out.shape == (0, 2, 16) and lse.shape == (2, 0)
    (dk,) = torch.autograd.grad(out.sum() + k.sum() * 0, [k])
    assert torch.equal(dk, torch.zeros_like(dk))


def test_a_saved_lse_relaid_by_a_hook_is_read_at_its_strides():
    # The backward reads the LSE [heads, total_q] as contiguous: a saved-tensor hook that
    # hands it back transposed still gets right gradients.
    torch.manual_seed(5)
    with torch.autograd.graph.saved_tensors_hooks(
            lambda t: t, lambda t: t.t().contiguous().t() if t.dim() == 2 else t):
        check_varlen([5, 11], [9, 11], 2, 1, 16, torch.float32, CPU)


def test_torch_func_gradients_are_refused_with_a_clear_error():
    torch.manual_seed(6)
    q, k, v, cu_q, cu_k = packed([3, 5], [3, 5], 2, 2, 16, torch.float32, CPU)
    with pytest.raises(NotImplementedError, match="torch.autograd.grad"):
        torch.func.grad(lambda x: fused_attention_varlen(x, k, v, cu_q, cu_k, 5, 5).sum())(q)


def test_torch_compile_fullgraph_traces_the_op():
    # dynamo traces the custom ops whole: the lengths' value checks, which would read the
    # tensor, are skipped while traced; inductor is GPU-tested with the fixed-length op
    q, k, v, cu_q, cu_k = packed([8, 12], [10, 20], 2, 1, 16, torch.float32, CPU)
    q.requires_grad_()
    kwargs = dict(window=(3, -1), softcap=5.0)
    compiled = torch.compile(lambda *t: fused_attention_varlen(*t, cu_q, cu_k, 12, 20, **kwargs),
                             fullgraph=True, backend="eager")
    out = compiled(q, k, v)
    (dq,) = torch.autograd.grad(out.sum(), [q])
    expected = fused_attention_varlen(q, k, v, cu_q, cu_k, 12, 20, **kwargs)
    assert torch.equal(out, expected)
    assert torch.equal(dq, torch.autograd.grad(expected.sum(), [q])[0])


def test_row_offsets_count_a_sequence_s_rows_not_the_batch_s(monkeypatch):
    # A packed batch's row offsets start at each sequence's first row (int64): the 32-bit bound
    # applies to the longest sequence, not the packed total, except in the backward's Delta
    # kernel, which walks the packed rows as one sequence.
    from attnscope.kernels import common
    monkeypatch.setattr(common, "MAX_ROW_OFFSET", 1000)
    q, k, v, cu_q, cu_k = packed([30, 25, 25], [30, 25, 25], 2, 2, 16, torch.float32, CPU)
    out = fused_attention_varlen(q, k, v, cu_q, cu_k, 30, 30)  # 29 x 32 + 15 = 943 per sequence
    assert out.isfinite().all()
    q.requires_grad_()
    with pytest.raises(ValueError, match="out's 80 rows reach 2543 elements"):
        fused_attention_varlen(q, k, v, cu_q, cu_k, 30, 30).sum().backward()


def test_validation():
    q, k, v, cu_q, cu_k = packed([3, 5], [4, 6], 2, 1, 16, torch.float32, CPU)
    call = fused_attention_varlen
    with pytest.raises(ValueError, match="int32"):
        call(q, k, v, cu_q.long(), cu_k, 5, 6)
    with pytest.raises(ValueError, match="same length"):
        call(q, k, v, cu_q, torch.tensor([0, 10], dtype=torch.int32), 5, 10)
    with pytest.raises(ValueError, match="start at 0"):
        call(q, k, v, torch.tensor([1, 3, 8], dtype=torch.int32), cu_k, 5, 6)
    with pytest.raises(ValueError, match="not decrease"):
        call(q, k, v, torch.tensor([0, 9, 8], dtype=torch.int32), cu_k, 9, 6)
    with pytest.raises(ValueError, match="max_seqlen"):
        call(q, k, v, cu_q, cu_k, 4, 6)
    with pytest.raises(ValueError, match="3-D"):
        call(q[None], k, v, cu_q, cu_k, 5, 6)
    with pytest.raises(ValueError, match="causal=True"):
        call(q, k, v, cu_q, cu_k, 5, 6, window=(3, 1))
    with pytest.raises(ValueError, match="got 0 q heads and 1 k/v heads"):
        call(q[:, :0], k, v, cu_q, cu_k, 5, 6)
    with pytest.raises(ValueError, match="scale must be >= 0"):
        call(q, k, v, cu_q, cu_k, 5, 6, scale=-1.0)
    # a strided view of the lengths: the kernels read bounds at offsets b and b + 1
    strided = torch.stack([cu_q, torch.zeros_like(cu_q)], 1)[:, 0]
    with pytest.raises(ValueError, match="cu_seqlens_q must be contiguous"):
        call(q, k, v, strided, cu_k, 5, 6)
    # int32 lengths: a max_seqlen past 2**31 - 1 (it wrapped in the comparison before), and a
    # negative one
    for wrong in (2 ** 31, 2 ** 32, -1):
        with pytest.raises(ValueError, match=f"between 0 and 2147483647.*got {wrong}"):
            call(q, k, v, cu_q, cu_k, wrong, 6)
    with pytest.raises(TypeError, match="must be an int"):
        call(q, k, v, cu_q, cu_k, 5.0, 6)


def test_lengths_are_checked_under_a_user_dispatch_mode():
    # A dispatch mode such as FlopCounterMode runs on real values: the CPU checks of the
    # lengths still run (only fake, proxy and functional tensors cannot be read).
    from torch.utils.flop_counter import FlopCounterMode
    q, k, v, cu_q, cu_k = packed([3, 5], [4, 6], 2, 1, 16, torch.float32, CPU)
    with FlopCounterMode(display=False), pytest.raises(ValueError, match="end at the packed"):
        fused_attention_varlen(q, k, v, torch.tensor([0, 3, 7], dtype=torch.int32), cu_k, 5, 6)


# ---- GPU --------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [d for d, _, _ in GPU_DTYPES])
@pytest.mark.parametrize("causal,window,softcap", [
    (True, (-1, -1), 0.0),
    (True, (1024, -1), 50.0),
    (False, (-1, -1), 0.0),
    (False, (300, 77), 30.0),
])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_realistic(causal, window, softcap, head_dim, dtype):
    # lengths {0, 1, 127, 128, 1000, 4096} in q, the keys' a rotation of them so that every
    # sequence has q_len != kv_len (both alignments' cases, empty q and empty k)
    lengths = [0, 1, 127, 128, 1000, 4096]
    check_varlen(lengths, lengths[1:] + lengths[:1], 8, 2, head_dim, dtype, "cuda",
                 causal=causal, window=window, softcap=softcap)


# The Gluon kernel takes packed batches on sm_90 (attention_fwd_hopper.supports): lengths with
# empty sequences on either side, fewer keys than queries (rows that see no key), ragged tiles
# and K/V blocks that run into the next sequence's rows (masked), more tiles than SMs
# (the persistent loop, tiles handed out on the device), GQA.
GLUON_LENGTHS_Q = [0, 1, 127, 128, 1000, 2500, 2077, 2300]
GLUON_LENGTHS_K = [5, 0, 300, 128, 999, 2500, 2049, 64]


@pytest.mark.cuda
@pytest.mark.skipif(not on_hopper(), reason="the Gluon kernel runs on sm_90 only")
@pytest.mark.parametrize("dtype", [d for d, _, _ in GPU_DTYPES])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 112, 128, 192, 256])
def test_gpu_gluon_kernel(head_dim, causal, dtype):
    # and those it leaves to the Triton kernel (112; 64 under 2049 queries a sequence on average,
    # as these lengths), through the same checks
    from attnscope.kernels import attention_fwd_hopper as hopper
    dispatch.forget_launches()
    check_varlen(GLUON_LENGTHS_Q, GLUON_LENGTHS_K, 8, 2, head_dim, dtype, "cuda", causal=causal)
    long_enough = sum(GLUON_LENGTHS_Q) >= hopper.MIN_QUERIES.get(head_dim, 0) * len(GLUON_LENGTHS_Q)
    kernel = ("_attn_fwd_hopper" if head_dim in hopper.PACKED_HEAD_DIMS and long_enough
              else "_attn_fwd")
    assert dispatch.launched_forward_kernels()[0]["name"] == kernel


@pytest.mark.cuda
@pytest.mark.skipif(not on_hopper(), reason="the Gluon kernel runs on sm_90 only")
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_gluon_kernel_head_dim_64(causal):
    # head_dim 64 takes the Gluon kernel from 2049 queries a sequence on average (2189 here):
    # empty and one-row sequences, fewer keys than queries, ragged tiles, GQA
    lengths_q, lengths_k = [0, 1, 127, 4096, 4097, 3000, 4000], [5, 0, 300, 4096, 4000, 3100, 4000]
    dispatch.forget_launches()
    check_varlen(lengths_q, lengths_k, 4, 2, 64, torch.bfloat16, "cuda", causal=causal)
    assert dispatch.launched_forward_kernels()[0]["name"] == "_attn_fwd_hopper"


@pytest.mark.cuda
@pytest.mark.skipif(not on_hopper(), reason="the Gluon kernel runs on sm_90 only")
@pytest.mark.parametrize("dtype", [d for d, _, _ in GPU_DTYPES])
@pytest.mark.parametrize("causal,window,softcap", [
    (True, (100, -1), 0.0),     # each sequence's window from its own bottom-right diagonal
    (True, (300, -1), 30.0),
    (False, (200, 50), 0.0),    # a two-sided window on a non-causal batch
])
@pytest.mark.parametrize("head_dim", [96, 128, 256])
def test_gpu_gluon_kernel_window_and_softcap(head_dim, causal, window, softcap, dtype):
    # packed batches with a window or a softcap run the Gluon kernel too: the same lengths as
    # test_gpu_gluon_kernel's (empty sequences, fewer keys than queries, blocks that run into the
    # next sequence's rows)
    dispatch.forget_launches()
    check_varlen(GLUON_LENGTHS_Q, GLUON_LENGTHS_K, 8, 2, head_dim, dtype, "cuda", causal=causal,
                 window=window, softcap=softcap)
    assert dispatch.launched_forward_kernels()[0]["name"] == "_attn_fwd_hopper"


def test_packed_head_dims_are_whole_column_parts():
    # a packed row's box must not run into the neighbouring head's columns
    hopper = pytest.importorskip("attnscope.kernels.attention_fwd_hopper")
    assert all(sum(hopper.column_parts(d)) == d for d in hopper.PACKED_HEAD_DIMS)


def test_packed_layouts_the_copy_engine_reads():
    # The Gluon kernel sees a packed tensor as [total, heads * head_dim] rows: its heads must be
    # adjacent with unit last stride, and its rows 16-byte multiples apart (any such stride: a
    # slice of a fused QKV projection qualifies). Checked on the views the op builds.
    hopper = pytest.importorskip("attnscope.kernels.attention_fwd_hopper")
    qkv = torch.zeros(10, 3, 4, 128, dtype=torch.float16)
    assert hopper._packed(_as_batched(torch.zeros(10, 4, 128, dtype=torch.float16), 2))
    assert hopper._packed(_as_batched(qkv[:, 0], 2))  # rows 3 * 4 * 128 apart
    assert not hopper._packed(_as_batched(qkv[:, :, 0], 2))  # heads 4 * 128 apart
    assert not hopper._packed(_as_batched(qkv[:, 0, :, :64], 2))  # heads 128 apart, 64 wide
    odd = torch.zeros(10, 4 * 80 + 4, dtype=torch.float16)[:, :320].view(10, 4, 80)
    assert not hopper._packed(_as_batched(odd, 2))  # rows 648 bytes apart: not 16-byte aligned


def test_packed_tile_count_rule():
    # (batch, heads, max_q): the kernel's tile numbers, (batch * heads) x 128-row blocks of the
    # longest sequence, must fit int32 with room for the hand-out's program count
    hopper = pytest.importorskip("attnscope.kernels.attention_fwd_hopper")
    assert hopper.packed_tiles_ok(256, 32, 32768)  # one long sequence among short ones
    assert hopper.packed_tiles_ok(1 << 14, 64, 1 << 16)  # 2^29 tiles
    assert not hopper.packed_tiles_ok(1 << 16, 1 << 10, 1 << 16)  # 2^35 tiles


def test_packed_launch_key_holds_the_longest_sequences():
    # The packed launch's grid follows max_seqlen_q, the Gluon kernel's L2 head groups
    # max_seqlen_k, and its lengths' pointers are per call: a kept launch is found again only
    # for the same longest sequences and pointer alignment.
    from attnscope.kernels.attention_fwd import launch_key
    q, k, v, cu_q, cu_k = packed([3, 5], [4, 6], 2, 1, 16, torch.float32, CPU)
    views = [_as_batched(t, 2) for t in (q, k, v, q)]
    lse = torch.empty(2, 8)
    args = (*views, lse, True, 0, 0.25, (-1, -1), 0.0)
    key = launch_key(*args, (cu_q, cu_k, 5, 6))
    assert key == launch_key(*args, (cu_q.clone(), cu_k, 5, 6))
    assert key != launch_key(*args, (cu_q, cu_k, 6, 6))
    assert key != launch_key(*args, (cu_q, cu_k, 5, 7))
    assert key != launch_key(*args)


@pytest.mark.cuda
@pytest.mark.skipif(not on_hopper(), reason="the Gluon kernel runs on sm_90 only")
def test_gpu_gluon_kernel_strided_rows():
    # q, k, v slices of one fused projection (rows 3 * heads * head_dim apart), as a model's
    # packed QKV gives them: the copy engine reads them in place
    lengths = [700, 0, 1500, 33]
    cu = torch.tensor([0, *lengths], device="cuda").cumsum(0).to(torch.int32)
    qkv = torch.randn(sum(lengths), 3, 4, 128, dtype=torch.bfloat16, device="cuda")
    q, k, v = qkv.unbind(1)
    views = [_as_batched(t, len(lengths)) for t in (q, k, v)]
    varlen = (cu, cu, max(lengths), max(lengths))
    assert dispatch.uses_hopper_kernel(*views, torch.empty_like(views[0]), 0.1, varlen=varlen)
    out = fused_attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths))
    ref = attention_reference_varlen(q.double(), k.double(), v.double(), cu, cu)
    low = attention_reference_varlen(q, k, v, cu, cu, dtype=torch.bfloat16)
    floor = {d: f for d, f, _ in GPU_DTYPES}[torch.bfloat16]
    assert (out.double() - ref).abs().max() <= 2 * (low.double() - ref).abs().max() + floor


@pytest.mark.cuda
@pytest.mark.skipif(not on_hopper(), reason="the Gluon kernel runs on sm_90 only")
def test_gpu_gluon_kernel_only_takes_what_it_supports():
    def takes(head_dim, lengths, dtype=torch.bfloat16):
        q, k, v, cu_q, cu_k = packed(lengths, lengths, 4, 2, head_dim, dtype, "cuda")
        views = [_as_batched(t, len(lengths)) for t in (q, k, v)]
        return dispatch.uses_hopper_kernel(*views, torch.empty_like(views[0]), 0.1,
                                           varlen=(cu_q, cu_k, max(lengths), max(lengths)))
    assert takes(128, [300, 5])
    assert not takes(112, [300, 5])  # padded to 128: a box would read the next head's columns
    # head_dim 64 from 2049 queries a sequence on average (MIN_QUERIES): below, the Triton kernel
    assert takes(64, [4096, 2100]) and takes(64, [4096, 5])
    assert not takes(64, [4096, 5, 5]) and not takes(64, [2048] * 4)
    assert takes(128, [2048] + [1] * 31)  # a mostly empty tile grid: no tile is handed out empty
    assert not takes(128, [300, 5], torch.float32)


def _many_lengths():
    # 97 sequences (the loader reads 32 lengths a step: three steps and one more), seeded, a
    # tenth of them empty, keys at least as many as queries (a cache before new queries)
    g = torch.Generator().manual_seed(20)
    q = torch.randint(1, 400, (97,), generator=g)
    q[torch.randperm(97, generator=g)[:10]] = 0
    return q.tolist(), (q + torch.randint(0, 300, (97,), generator=g)).tolist()


@pytest.mark.cuda
@pytest.mark.skipif(not on_hopper(), reason="the Gluon kernel runs on sm_90 only")
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("lengths", [
    ([2048] + [1] * 31 + [300],) * 2,  # one long sequence among many of one row
    _many_lengths(),
], ids=["one-long", "97-sequences"])
def test_gpu_gluon_kernel_many_sequences(causal, lengths):
    # Tile grids (every sequence padded to the longest) mostly empty: the hand-out numbers only
    # the tiles that hold queries, walking the lengths 32 at a time (_packed_tile)
    lengths_q, lengths_k = lengths
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, 4, 2, 128, torch.bfloat16, "cuda")
    views = [_as_batched(t, len(lengths_q)) for t in (q, k, v)]
    assert dispatch.uses_hopper_kernel(*views, torch.empty_like(views[0]), 0.1,
                                       varlen=(cu_q, cu_k, max(lengths_q), max(lengths_k)))
    out = fused_attention_varlen(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                 causal=causal)
    ref = attention_reference_varlen(q.double(), k.double(), v.double(), cu_q, cu_k,
                                     causal=causal)
    low = attention_reference_varlen(q, k, v, cu_q, cu_k, causal=causal, dtype=torch.bfloat16)
    floor = {d: f for d, f, _ in GPU_DTYPES}[torch.bfloat16]
    assert not out.isnan().any()
    assert (out.double() - ref).abs().max() <= 2 * (low.double() - ref).abs().max() + floor


@pytest.mark.cuda
@pytest.mark.skipif(not on_hopper(), reason="the Gluon kernel runs on sm_90 only")
def test_gpu_gluon_kernel_returns_on_decreasing_lengths():
    # Cumulative lengths that decrease break the op's contract (unchecked on CUDA): the result
    # is undefined, but the kernel must return (negative lengths are clamped at 0, so no block
    # count goes negative and the rings stay in step).
    q, k, v, cu_q, cu_k = packed([300, 700], [300, 700], 4, 2, 128, torch.bfloat16, "cuda")
    cu_k = torch.tensor([0, 1000, 300], dtype=torch.int32, device="cuda")
    out = fused_attention_varlen(q, k, v, cu_q, cu_k, 700, 1000, causal=False)
    torch.cuda.synchronize()
    assert out.shape == q.shape
