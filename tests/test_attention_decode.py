"""Split-KV decode attention (fused_attention_with_kvcache, and the fused op's decode route)
against the float64 reference.

Tolerance rule (as test_fused_attention.py and FlashAttention's tests): the kernel's max abs error
against float64 must be at most twice the error of PyTorch's own attention computed in the same
dtype, plus a small absolute floor; LSEs within a relative tolerance. Outputs and the kernel's
partial-result scratch are poisoned with NaN before the kernels run, so an element left unwritten
fails. The reference for a cache gathers each sequence's first cache_seqlens keys (through the
block table when paged) and runs attention_reference with bottom-right alignment.

CPU runs go through the Triton interpreter (fp32, fp16) with 16 x 16 tiles (16 x 32 for long
chunks, the threshold lowered by the `long_chunk` fixture), so small caches cross several tiles,
row blocks and splits; the `cuda` tests run bf16/fp16 at serving sizes,
including issue 20's two decode shapes.
"""

import collections
import math

import pytest
import torch

import attnscope
from attnscope import fused_attention, fused_attention_with_kvcache
from attnscope.attention import fused
from attnscope.attention.reference import attention_reference
from attnscope.kernels import attention_decode as kernels
from attnscope.kernels import launch

# (dtype, absolute error floor, LSE relative tolerance) and the NaN fill of the op's outputs
from fused_checks import keep_launches, nan_empty
from test_fused_attention import CPU_DTYPES, GPU_DTYPES, nan_outputs  # noqa: F401

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def nan_scratch(monkeypatch):
    """The kernel's partial results start as NaN too: the merge must read only written ones."""
    monkeypatch.setattr(kernels, "_empty", nan_empty)


@pytest.fixture(autouse=True)
def fresh_launches():
    """Each test starts with no kept launch or plan: plans remember the split rule's answers,
    which the `splits` fixture changes."""
    launch.forget_launches()
    yield
    launch.forget_launches()


@pytest.fixture
def splits(monkeypatch):
    """Call splits(n) to make the launch's split rule answer n (the launch still clamps it)."""
    def force(n):
        monkeypatch.setattr(kernels, "num_splits_for", lambda *args: n)
    return force


def randn(*shape, dtype, device=CPU, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, dtype=dtype, device=device, generator=g)


def make_cache(batch, q_len, heads, kv_heads, capacity, head_dim, dtype, device=CPU, seed=0):
    """q [batch, q_len, heads, d] and a contiguous cache [batch, capacity, kv_heads, d] each."""
    q = randn(batch, q_len, heads, head_dim, dtype=dtype, device=device, seed=seed)
    k = randn(batch, capacity, kv_heads, head_dim, dtype=dtype, device=device, seed=seed + 1)
    v = randn(batch, capacity, kv_heads, head_dim, dtype=dtype, device=device, seed=seed + 2)
    return q, k, v


def page(k, v, page_size, seed=0):
    """The same caches as a shuffled block pool [num_blocks, page_size, kv_heads, d] and the
    int32 block table that finds each sequence's keys in it (plus unused blocks, so a wrong
    index reads other data)."""
    batch, capacity, kv_heads, d = k.shape
    per_seq = -(-capacity // page_size)
    pad = per_seq * page_size - capacity
    k, v = (torch.nn.functional.pad(t, (0, 0, 0, 0, 0, pad)) for t in (k, v))
    num_blocks = batch * per_seq + 3
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(num_blocks, generator=g)[:batch * per_seq]
    pools = []
    for t in (k, v):
        pool = randn(num_blocks, page_size, kv_heads, d, dtype=t.dtype, device=t.device,
                     seed=seed + 7)
        pool[order] = t.reshape(batch * per_seq, page_size, kv_heads, d)
        pools.append(pool)
    table = order.reshape(batch, per_seq).to(torch.int32).to(k.device)
    return pools[0], pools[1], table


def reference(q, k, v, seqlens, causal, scale=None, dtype=torch.float64, window=(-1, -1),
              softcap=0.0):
    """Per sequence, attention_reference over its first seqlens[b] keys of a contiguous cache:
    out [batch, q_len, heads, d] in `dtype`, LSE [batch, heads, q_len] in float64."""
    outs, lses = [], []
    for b, n in enumerate(seqlens):
        qb, kb, vb = q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n]
        if n == 0:  # no key: zeros and -inf by the op's contract
            outs.append(torch.zeros(qb.shape, dtype=dtype, device=q.device))
            lses.append(torch.full((1, q.shape[2], q.shape[1]), float("-inf"), dtype=torch.float64,
                                   device=q.device))
            continue
        out, lse = attention_reference(qb, kb, vb, causal=causal, scale=scale, layout="bshd",
                                       causal_alignment="bottom_right", return_lse=True,
                                       dtype=dtype, window=window, softcap=softcap)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def assert_close(out, lse, q, k, v, seqlens, floor, lse_tol, causal=True, scale=None,
                 window=(-1, -1), softcap=0.0):
    """The tolerance rule on out and LSE; k, v: the contiguous caches the call read."""
    ref, ref_lse = reference(q, k, v, seqlens, causal, scale, window=window, softcap=softcap)
    low, _ = reference(q, k, v, seqlens, causal, scale, dtype=q.dtype, window=window,
                       softcap=softcap)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == ref_lse.shape and lse.dtype == torch.float32
    assert not out.isnan().any() and not lse.isnan().any(), "NaN: unwritten element or 0/0"
    err = (out.double() - ref).abs().max().item()
    torch_err = (low.double() - ref).abs().max().item()
    assert err <= 2 * torch_err + floor, f"error {err:.3g} > 2 x torch's {torch_err:.3g} + {floor}"
    masked = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), masked), "LSE -inf exactly on rows that see no key"
    if (~masked).any():
        lse_err = (lse.double() - ref_lse)[~masked].abs().max().item()
        assert lse_err <= lse_tol * max(1.0, ref_lse[~masked].abs().max().item())
    rows_without_key = masked.transpose(1, 2)  # [batch, q_len, heads]
    assert (out[rows_without_key] == 0).all(), "rows that see no key are zeros"


# ---- CPU (Triton interpreter) ---------------------------------------------------------------

@pytest.mark.parametrize("dtype,floor,lse_tol", CPU_DTYPES)
@pytest.mark.parametrize("batch,q_len,heads,kv_heads,kv_len,head_dim", [
    (2, 1, 4, 4, 1, 16),      # one key: a single masked tile; GQA 1
    (2, 3, 8, 2, 17, 40),     # GQA 4, q_len 3 (12 rows); ragged keys; head_dim 40 pads to 64
    (1, 8, 4, 1, 1000, 96),   # MQA, q_len 8: 32 rows = 2 row blocks; many tiles and splits
    (2, 1, 2, 2, 77, 256),    # the widest head_dim
])
def test_contiguous_cache(batch, q_len, heads, kv_heads, kv_len, head_dim, dtype, floor,
                          lse_tol):
    q, k, v = make_cache(batch, q_len, heads, kv_heads, kv_len, head_dim, dtype)
    out, lse = fused_attention_with_kvcache(q, k, v, kv_len, return_lse=True)
    assert_close(out, lse, q, k, v, [kv_len] * batch, floor, lse_tol)


@pytest.mark.parametrize("num_splits", [1, 3, 300])
def test_any_split_count_gives_the_same_attention(num_splits, splits):
    # 100 keys are 7 tiles of 16: 3 splits do not divide them, and 300 is clamped to 7 (one
    # tile a split). q_len 3 puts the causal diagonal inside the last split.
    splits(num_splits)
    q, k, v = make_cache(2, 3, 4, 2, 100, 32, torch.float32)
    out, lse = fused_attention_with_kvcache(q, k, v, 100, return_lse=True)
    assert_close(out, lse, q, k, v, [100, 100], 1e-5, 1e-5)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_a_remembered_decode_call_gives_the_op_s_result(layout, num_splits, splits,
                                                         kept_launches):
    # The op remembers an eager decode-route call (CUDA only) as fused._repeat over the launch
    # attention_decode kept for it (kept=True). Run here in the interpreter on new inputs of the
    # same shapes, that launch alone (no second Triton launch) gives the reference's output and
    # LSE, in either layout, with and without the merge.
    splits(num_splits)

    def in_layout(tensors):  # make_cache's bshd tensors as the op takes them in `layout`
        return tensors if layout == "bshd" else tuple(_bhsd(t) for t in tensors)
    first = in_layout(make_cache(2, 3, 4, 2, 70, 32, torch.float32, seed=19))
    _, lse, views = fused._outputs(*first, layout)  # as the op's first call
    *_, kept = kernels.attention_decode(*views[:3], views[3], lse, causal=True,
                                        scale=32 ** -0.5, kept=True)
    assert kept_launches == {("split", "triton"): 1}
    run = fused._repeat(layout, kept)
    q, k, v = make_cache(2, 3, 4, 2, 70, 32, torch.float32, seed=20)
    for _ in range(2):
        out, lse = run(*in_layout((q, k, v)))
        assert_close(in_layout((out,))[0], lse, q, k, v, [70, 70], 1e-5, 1e-5)
    assert kept_launches == {("split", "triton"): 1, ("split", "kept"): 2}


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("page_size", [None, 16])
def test_a_kvcache_call_with_tensor_lengths_is_remembered(page_size, num_splits, splits,
                                                          kept_launches, monkeypatch):
    # fused_attention_with_kvcache with cache_seqlens as a tensor: the second call of one
    # signature (new lengths, new queries and keys, a window and softcap) runs the launch kept
    # for the first (no checks, no attention_decode call) and is right, contiguous or paged.
    from attnscope.attention import decode
    splits(num_splits)
    checks, decodes = [], []
    validate, launch = decode._validate, kernels.attention_decode
    monkeypatch.setattr(decode, "_validate", lambda *a: checks.append(a) or validate(*a))
    monkeypatch.setattr(kernels, "attention_decode",
                        lambda *a, **kw: decodes.append(a) or launch(*a, **kw))
    kwargs = dict(window=(40, 0), softcap=5.0)
    for seed, lengths in ((30, [37, 0, 64, 5]), (31, [64, 12, 1, 50])):
        q, k, v = make_cache(4, 2, 8, 2, 64, 32, torch.float32, seed=seed)
        seqlens = torch.tensor(lengths, dtype=torch.int32)
        caches = (k, v) if page_size is None else page(k, v, page_size, seed=seed)[:2]
        table = None if page_size is None else page(k, v, page_size, seed=seed)[2]
        out, lse = fused_attention_with_kvcache(q, *caches, seqlens, block_table=table,
                                                return_lse=True, **kwargs)
        assert_close(out, lse, q, k, v, lengths, 1e-5, 1e-5, **kwargs)
    assert len(checks) == len(decodes) == 1
    assert kept_launches == {("split", "triton"): 1, ("split", "kept"): 1}


def test_a_kvcache_call_with_an_int_length_is_not_remembered(kept_launches, monkeypatch):
    # An int cache_seqlens changes every decode step: each call is checked and launched anew.
    from attnscope.attention import decode
    checks, validate = [], decode._validate
    monkeypatch.setattr(decode, "_validate", lambda *a: checks.append(a) or validate(*a))
    q, k, v = make_cache(1, 1, 4, 2, 40, 32, torch.float32, seed=21)
    for n in (30, 20, 20):
        out, lse = fused_attention_with_kvcache(q, k, v, n, return_lse=True)
        assert_close(out, lse, q, k, v, [n], 1e-5, 1e-5)
    assert len(checks) == 3


@pytest.mark.parametrize("merge_values", [256, 2048])
def test_the_merge_in_column_parts_and_unrolled_steps(merge_values, splits, monkeypatch):
    # The merge's budget set small: at 256 values a 16-row block takes four 16-column parts of
    # head_dim 40's 64-wide tiles (one cut by the mask, one wholly masked) one partial a step;
    # at 2048 one part and two partials a step over 5 splits (the last step half past
    # NUM_SPLITS). The arrival counts are zero again after each call.
    monkeypatch.setattr(kernels, "MERGE_VALUES", merge_values)
    splits(5)
    q, k, v = make_cache(2, 2, 4, 2, 90, 40, torch.float32, seed=17)
    for _ in range(2):
        out, lse = fused_attention_with_kvcache(q, k, v, 90, return_lse=True)
        assert_close(out, lse, q, k, v, [90, 90], 1e-5, 1e-5)
        assert all(not counts.any() for counts in kernels._arrival_counts.values())


def test_arrival_counts_outgrown_are_kept(monkeypatch, splits):
    # A call with more programs than the buffer holds makes a bigger one and keeps the old
    # alive (a captured graph or a running launch may hold its address).
    monkeypatch.setattr(kernels, "MIN_ARRIVALS", 2)
    monkeypatch.setattr(kernels, "_arrival_counts", {})
    monkeypatch.setattr(kernels, "_retired_counts", [])
    splits(2)
    for batch in (1, 3):
        q, k, v = make_cache(batch, 1, 4, 2, 50, 32, torch.float32, seed=18 + batch)
        out, lse = fused_attention_with_kvcache(q, k, v, 50, return_lse=True)
        assert_close(out, lse, q, k, v, [50] * batch, 1e-5, 1e-5)
    (counts,) = kernels._arrival_counts.values()
    assert counts.numel() == 6 and [c.numel() for c in kernels._retired_counts] == [2]


@pytest.mark.parametrize("dtype,floor,lse_tol", CPU_DTYPES)
def test_non_causal(dtype, floor, lse_tol, splits):
    splits(3)
    q, k, v = make_cache(2, 5, 4, 1, 70, 64, dtype)
    out, lse = fused_attention_with_kvcache(q, k, v, 70, causal=False, return_lse=True)
    assert_close(out, lse, q, k, v, [70, 70], floor, lse_tol, causal=False)


def test_more_queries_than_keys_leaves_rows_without_keys():
    # Bottom-right with q_len 8 and 3 keys: queries 0-4 see nothing (zeros, LSE -inf).
    q, k, v = make_cache(1, 8, 2, 1, 3, 16, torch.float32)
    out, lse = fused_attention_with_kvcache(q, k, v, 3, return_lse=True)
    assert_close(out, lse, q, k, v, [3], 1e-5, 1e-5)
    assert torch.isneginf(lse[:, :, :5]).all() and torch.isfinite(lse[:, :, 5:]).all()


@pytest.mark.parametrize("dtype,floor,lse_tol", CPU_DTYPES)
def test_sequences_of_different_lengths(dtype, floor, lse_tol, splits):
    # Empty, one key, ragged, full: with 4 splits of 32 keys the short sequences' later splits
    # see no key at all, and the merge must weight their partials 0.
    splits(4)
    q, k, v = make_cache(4, 2, 4, 2, 100, 48, dtype)
    seqlens = torch.tensor([0, 1, 17, 100], dtype=torch.int32)
    out, lse = fused_attention_with_kvcache(q, k, v, seqlens, return_lse=True)
    assert_close(out, lse, q, k, v, seqlens.tolist(), floor, lse_tol)


@pytest.mark.parametrize("dtype,floor,lse_tol", CPU_DTYPES)
@pytest.mark.parametrize("page_size,q_len", [
    (16, 1),  # vLLM's page size, one query: a page is one K/V tile
    (5, 4),   # pages smaller than a tile and not a power of two; 4 queries x GQA 4
])
def test_paged_cache(page_size, q_len, dtype, floor, lse_tol, splits):
    splits(3)
    q, k, v = make_cache(4, q_len, 8, 2, 64, 32, dtype, seed=3)
    seqlens = torch.tensor([37, 0, 64, 5], dtype=torch.int32)
    k_pool, v_pool, table = page(k, v, page_size, seed=4)
    out, lse = fused_attention_with_kvcache(q, k_pool, v_pool, seqlens, block_table=table,
                                            return_lse=True)
    assert_close(out, lse, q, k, v, seqlens.tolist(), floor, lse_tol)


def test_empty_cache_gives_zeros_and_neg_inf():
    q, k, v = make_cache(2, 3, 4, 2, 16, 32, torch.float32)
    out, lse = fused_attention_with_kvcache(q, k, v, 0, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


def test_paged_cache_with_one_length_for_all():
    q, k, v = make_cache(2, 1, 4, 4, 40, 16, torch.float16, seed=5)
    k_pool, v_pool, table = page(k, v, 8, seed=6)
    out, lse = fused_attention_with_kvcache(q, k_pool, v_pool, 33, block_table=table,
                                            return_lse=True)
    assert_close(out, lse, q, k, v, [33, 33], 1e-3, 1e-3)


def test_strided_inputs_and_custom_scale():
    # q: a head_dim slice of a wider tensor; the caches: every other entry of a larger batch.
    q = randn(2, 2, 4, 96, dtype=torch.float32, seed=8)[..., 16:80]
    k = randn(4, 50, 2, 64, dtype=torch.float32, seed=9)[::2]
    v = randn(4, 50, 2, 64, dtype=torch.float32, seed=10)[::2]
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    out, lse = fused_attention_with_kvcache(q, k, v, 50, scale=0.3, return_lse=True)
    assert_close(out, lse, q, k, v, [50, 50], 1e-5, 1e-5, scale=0.3)


def test_returns_output_only_by_default():
    q, k, v = make_cache(1, 1, 2, 2, 9, 16, torch.float32)
    out = fused_attention_with_kvcache(q, k, v, 9)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
    assert attnscope.fused_attention_with_kvcache is fused_attention_with_kvcache


@pytest.mark.parametrize("change,error,match", [
    (dict(q=torch.zeros(1, 2, 16)), ValueError, "q must be 4-D"),
    (dict(k_cache=torch.zeros(1, 8, 2, 16, dtype=torch.float16)), TypeError, "share one dtype"),
    (dict(q=torch.zeros(1, 1, 3, 16)), ValueError, "multiple of the caches' kv_heads"),
    (dict(k_cache=torch.zeros(2, 8, 2, 16), v_cache=torch.zeros(2, 8, 2, 16)), ValueError,
     "must have q's batch 1"),
    (dict(cache_seqlens=9), ValueError, "between 0 and the cache's capacity 8"),
    (dict(cache_seqlens=torch.tensor([3])), ValueError, "cache_seqlens must be int32"),
    (dict(block_table=torch.zeros(1, 2)), ValueError, "block_table must be int32"),
    (dict(scale=float("nan")), TypeError, "scale must be a finite float"),
    (dict(q=torch.zeros(1, 1, 4, 16, requires_grad=True)), ValueError, "forward only"),
])
def test_bad_input_says_what_it_got(change, error, match):
    args = dict(q=torch.zeros(1, 1, 4, 16), k_cache=torch.zeros(1, 8, 2, 16),
                v_cache=torch.zeros(1, 8, 2, 16), cache_seqlens=8, block_table=None, scale=None)
    args.update(change)
    with pytest.raises(error, match=match):
        fused_attention_with_kvcache(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"),
                                     args.pop("cache_seqlens"), **args)


def test_lengths_or_block_table_entries_out_of_range_are_refused_on_cpu():
    # On CPU the values are read and checked (on CUDA that would synchronise every call), also
    # on a remembered call's repeat, which skips the other checks.
    q, k, v = make_cache(2, 1, 4, 2, 32, 16, torch.float32)
    good = torch.tensor([5, 32], dtype=torch.int32)
    fused_attention_with_kvcache(q, k, v, good)  # remembered: the next call is a repeat
    with pytest.raises(ValueError, match="between 0 and the cache's capacity 32, got \\[5, 33\\]"):
        fused_attention_with_kvcache(q, k, v, torch.tensor([5, 33], dtype=torch.int32))
    with pytest.raises(ValueError, match="capacity 32, got \\[-1, 3\\]"):
        fused_attention_with_kvcache(q, k, v, torch.tensor([-1, 3], dtype=torch.int32))
    k_pool, v_pool, table = page(k, v, 8)
    for bad, named in ((k_pool.shape[0], f"0..{k_pool.shape[0] - 1}"), (-1, "from -1")):
        wrong = table.clone()
        wrong[1, 2] = bad
        with pytest.raises(ValueError, match=f"block_table's entries must name cache blocks.*"
                                             f"{named}"):
            fused_attention_with_kvcache(q, k_pool, v_pool, good, block_table=wrong)
        with pytest.raises(ValueError, match="block_table's entries"):  # an int length too
            fused_attention_with_kvcache(q, k_pool, v_pool, 32, block_table=wrong)


def test_lengths_and_block_tables_are_checked_under_a_user_dispatch_mode():
    # FlopCounterMode runs on real values: the CPU checks run as on a plain call.
    from torch.utils.flop_counter import FlopCounterMode
    q, k, v = make_cache(2, 1, 4, 2, 32, 16, torch.float32)
    k_pool, v_pool, table = page(k, v, 8)
    table[1, 2] = k_pool.shape[0]
    good = torch.tensor([5, 32], dtype=torch.int32)
    with FlopCounterMode(display=False):
        with pytest.raises(ValueError, match="capacity 32, got \\[5, 50\\]"):
            fused_attention_with_kvcache(q, k, v, torch.tensor([5, 50], dtype=torch.int32))
        with pytest.raises(ValueError, match="block_table's entries"):
            fused_attention_with_kvcache(q, k_pool, v_pool, good, block_table=table)


def test_more_sequences_and_kv_heads_than_the_grid_takes_are_refused(monkeypatch):
    monkeypatch.setattr(kernels, "MAX_GROUPS", 3)
    q, k, v = make_cache(2, 1, 4, 2, 32, 16, torch.float32)
    with pytest.raises(ValueError, match="batch \\* kv_heads must be at most 3 .* got 2 x 2"):
        fused_attention_with_kvcache(q, k, v, 8)


def test_a_cache_past_32_bit_row_offsets_is_refused(monkeypatch):
    # A contiguous cache's rows are 32-bit offsets from its head's first: a cache whose
    # capacity x row stride passes that is a ValueError (the bound lowered: 2^31 elements are
    # too many for a CPU test); paged caches (int64 page offsets) are not bound by it.
    from attnscope.kernels import common
    monkeypatch.setattr(common, "MAX_ROW_OFFSET", 1000)
    q, k, v = make_cache(1, 1, 4, 2, 40, 16, torch.float32)  # rows 32 apart: 39 x 32 + 15
    with pytest.raises(ValueError, match="k_cache's 40 rows reach 1263 elements"):
        fused_attention_with_kvcache(q, k, v, 40)
    k_pool, v_pool, table = page(k, v, 8)
    out, lse = fused_attention_with_kvcache(q, k_pool, v_pool, 40, block_table=table,
                                            return_lse=True)
    assert_close(out, lse, q, k, v, [40], 1e-5, 1e-5)


def test_strided_lengths_or_block_table_rows_are_refused():
    # The kernel reads cache_seqlens[b] at offset b and a sequence's table entries one after
    # another: other strides would read the wrong entries, so they are refused, not misread.
    q, k, v = make_cache(2, 1, 4, 2, 32, 16, torch.float32)
    lengths = torch.tensor([[5, 0], [7, 0]], dtype=torch.int32)[:, 0]  # stride 2
    with pytest.raises(ValueError, match="cache_seqlens must be contiguous"):
        fused_attention_with_kvcache(q, k, v, lengths)
    k_pool, v_pool, table = page(k, v, 8)
    strided = torch.zeros(2, 2 * table.shape[1], dtype=torch.int32)[:, ::2].copy_(table)
    with pytest.raises(ValueError, match="block_table's rows must be contiguous"):
        fused_attention_with_kvcache(q, k_pool, v_pool, lengths.contiguous(),
                                     block_table=strided)


# Sliding windows, bottom-right (query i of q_len sees keys kv_len - q_len + i - left ..
# kv_len - q_len + i + right). 16-key tiles in the interpreter: with 100 keys and 3 forced splits,
# window 7 cuts inside one tile, 20 across a split's edge, 200 is wider than the cache.
@pytest.mark.parametrize("dtype,floor,lse_tol", CPU_DTYPES)
@pytest.mark.parametrize("window", [(0, 0), (1, 0), (7, -1), (20, 0), (200, 0)])
def test_sliding_window(window, dtype, floor, lse_tol, splits):
    splits(3)
    q, k, v = make_cache(2, 3, 8, 2, 100, 32, dtype, seed=20)
    out, lse = fused_attention_with_kvcache(q, k, v, 100, window=window, return_lse=True)
    assert_close(out, lse, q, k, v, [100, 100], floor, lse_tol, window=window)


@pytest.mark.parametrize("window", [(-1, 2**31 - 1), (2**31 - 1, 2**31 - 1), (2**31 - 5, -1)])
def test_window_sizes_past_the_cache_are_unbounded(window):
    # A side as long as the queries and the cache together hides nothing: it runs as -1, never
    # as a 32-bit offset near 2^31 (INT32_MAX for "unbounded" wrapped there: wrong outputs).
    q, k, v = make_cache(2, 3, 4, 2, 40, 16, torch.float32, seed=21)
    out = fused_attention_with_kvcache(q, k, v, 33, causal=False, window=window)
    expected = fused_attention_with_kvcache(q, k, v, 33, causal=False)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("window,q_len", [((3, 2), 1), ((40, -1), 4), ((-1, 5), 4)])
def test_non_causal_window(window, q_len, splits):
    # A right size > 0 looks past the diagonal (keys past the cache's end stay hidden); a left
    # edge alone keeps the whole cache's right side. fp32: one dtype is enough for the edges.
    splits(4)
    q, k, v = make_cache(2, q_len, 4, 2, 90, 16, torch.float32, seed=21)
    seqlens = torch.tensor([90, 33], dtype=torch.int32)
    out, lse = fused_attention_with_kvcache(q, k, v, seqlens, causal=False, window=window,
                                            return_lse=True)
    assert_close(out, lse, q, k, v, seqlens.tolist(), 1e-5, 1e-5, causal=False, window=window)


@pytest.mark.parametrize("dtype,floor,lse_tol", CPU_DTYPES)
@pytest.mark.parametrize("page_size", [16, 5])
def test_window_and_softcap_on_a_paged_cache(page_size, dtype, floor, lse_tol, splits):
    # Per-sequence lengths (empty, shorter than the window, longer): each sequence's window
    # starts at its own key, inside a page or on a page's edge.
    splits(3)
    q, k, v = make_cache(4, 2, 8, 2, 64, 32, dtype, seed=22)
    seqlens = torch.tensor([37, 0, 64, 5], dtype=torch.int32)
    k_pool, v_pool, table = page(k, v, page_size, seed=23)
    out, lse = fused_attention_with_kvcache(q, k_pool, v_pool, seqlens, block_table=table,
                                            window=(9, 0), softcap=5.0, return_lse=True)
    assert_close(out, lse, q, k, v, seqlens.tolist(), floor, lse_tol, window=(9, 0),
                 softcap=5.0)


@pytest.mark.parametrize("dtype,floor,lse_tol", CPU_DTYPES)
@pytest.mark.parametrize("causal", [True, False])
def test_softcap(causal, dtype, floor, lse_tol, splits):
    # scale 1.5 makes raw scores of ~+-10 that a softcap of 4 visibly bends.
    splits(2)
    q, k, v = make_cache(2, 4, 4, 1, 70, 48, dtype, seed=24)
    out, lse = fused_attention_with_kvcache(q, k, v, 70, causal=causal, scale=1.5, softcap=4.0,
                                            return_lse=True)
    assert_close(out, lse, q, k, v, [70, 70], floor, lse_tol, causal=causal, scale=1.5,
                 softcap=4.0)


def test_window_rows_that_see_no_key():
    # 8 queries, 3 keys, window 1: queries 0-4 see nothing (zeros, LSE -inf), the rest 1-2 keys.
    q, k, v = make_cache(1, 8, 2, 1, 3, 16, torch.float32, seed=25)
    out, lse = fused_attention_with_kvcache(q, k, v, 3, window=(1, 0), return_lse=True)
    assert_close(out, lse, q, k, v, [3], 1e-5, 1e-5, window=(1, 0))
    assert torch.isneginf(lse[:, :, :5]).all() and torch.isfinite(lse[:, :, 5:]).all()


def test_keys_left_of_the_window_are_never_read(splits):
    # The window's first key is 200 - 2 - 30 = 168 (query 0); its tile starts at 160. NaN in
    # every key and value before that would reach the output if any of them were loaded.
    splits(2)
    q, k, v = make_cache(1, 2, 4, 2, 200, 16, torch.float32, seed=26)
    k_nan, v_nan = k.clone(), v.clone()
    k_nan[:, :160] = float("nan")
    v_nan[:, :160] = float("nan")
    out, lse = fused_attention_with_kvcache(q, k_nan, v_nan, 200, window=(30, 0), return_lse=True)
    assert_close(out, lse, q, k, v, [200], 1e-5, 1e-5, window=(30, 0))


def test_window_shrinks_the_split_range():
    # The split rule sees the window's keys, not the cache's: 100000 keys, a window of 40 and
    # 16-key tiles are 4 tiles, too few to split (MIN_SPLIT_BLOCKS), so one split runs.
    q, k, v = make_cache(1, 1, 2, 2, 1, 16, torch.float32, seed=27)
    k, v = (t.expand(1, 100000, 2, 16) for t in (k, v))  # stride 0: no 100000-key allocation
    out = torch.empty(1, 2, 1, 16)
    lse = torch.empty(1, 2, 1)
    assert kernels.attention_decode(_bhsd(q), _bhsd(k), _bhsd(v), out, lse, causal=True,
                                    scale=0.25, window=(40, 0))[0] == 1


@pytest.mark.parametrize("window,softcap,match", [
    ((2, 1), 0.0, "right size must be 0 or -1"),
    ((2,), 0.0, "window must be a \\(left, right\\) pair"),
    ((-1, -1), -1.0, "softcap must be a finite float"),
])
def test_bad_window_or_softcap_says_what_it_got(window, softcap, match):
    q, k, v = make_cache(1, 1, 2, 2, 8, 16, torch.float32)
    with pytest.raises((TypeError, ValueError), match=match):
        fused_attention_with_kvcache(q, k, v, 8, window=window, softcap=softcap)


def test_torch_compile_runs_the_call_eagerly():
    # a graph break, not a dynamo error: the same output as the eager call
    q, k, v = make_cache(2, 1, 4, 2, 32, 16, torch.float32, seed=31)
    lengths = torch.tensor([20, 32], dtype=torch.int32)
    step = torch.compile(lambda q: fused_attention_with_kvcache(q, k, v, lengths) * 2,
                         backend="eager")
    assert torch.equal(step(q), fused_attention_with_kvcache(q, k, v, lengths) * 2)


def test_split_rule_fills_the_gpu_without_tiny_chunks():
    # 396 slots: 132 SMs (H200) x 3 programs of 3-stage 64 x 128 bf16 K/V tiles (70 KB each).
    assert kernels.num_splits_for(64 * 8, 8192, 64, 396) == 3  # 1536 programs: 3.9 waves
    assert kernels.num_splits_for(8 * 8, 32768, 64, 396) == 6  # 384 programs: one wave
    assert kernels.num_splits_for(1 * 8, 131072, 64, 396) == 49  # 392 programs
    assert kernels.num_splits_for(1, 1 << 20, 64, 396) == kernels.MAX_SPLITS
    assert kernels.num_splits_for(1, 100, 64, 396) == 1  # 2 tiles: too short to split
    # 300 groups do not fill two waves: 5 splits make 1500 programs, 3.8 waves.
    assert kernels.num_splits_for(300, 8192, 64, 396) == 5


# ---- key tiles by chunk length (split_rule, long_config_for) ----------------------------------

# H200, bf16, head_dim 128, 16-row blocks: (block_n, slots) of 64-key tiles (3 programs an SM)
# and of 128-key tiles (1: 136 KB of shared memory each), 132 SMs.
H200_TILES = ((64, 396), (128, 132))


@pytest.mark.parametrize("groups,kv_len,expected", [
    # the lab's shapes (notes/lab/decode_tiles_h200.txt, decode_configs_h200.txt); 128-key
    # tiles won where their own chunks are 2048 keys or more, 64-key tiles where they are shorter
    (64 * 8, 8192, (128, 1, 8192)),
    (8 * 8, 32768, (128, 2, 16384)),
    (1 * 8, 131072, (128, 16, 8192)),
    (16 * 8, 4096, (128, 1, 4096)),
    (4 * 8, 8192, (128, 4, 2048)),       # 4 queries a sequence: 16 rows, one block
    (1 * 8, 2048, (64, 8, 256)),         # 128-key tiles: 4 chunks of 512
    (128 * 8, 1024, (64, 1, 1024)),      # 128-key tiles: one chunk of 1024
    # the boundary: 128 programs take one 128-key chunk, 15 tiles (1920 keys) or 16 (2048)
    (16 * 8, 1920, (64, 3, 640)),
    (16 * 8, 1921, (128, 1, 2048)),
])
def test_split_rule_takes_long_tiles_for_long_chunks(groups, kv_len, expected):
    assert kernels.split_rule(kv_len, None, groups, H200_TILES, None, 2048) == expected


def test_split_rule_without_a_long_tile_or_with_forced_splits():
    # One tile (a pinned config, fp32, head_dim > 128) never switches; a forced split count is
    # kept by both tiles and decides by the long tile's chunk as the rule's own would; a window
    # bounds the keys split.
    assert kernels.split_rule(8192, None, 512, H200_TILES[:1], None, 2048) == (64, 3, 2752)
    assert kernels.split_rule(16384, None, 8, H200_TILES, 4, 2048) == (128, 4, 4096)
    assert kernels.split_rule(16384, None, 8, H200_TILES, 16, 2048) == (64, 16, 1024)
    assert kernels.split_rule(16384, None, 8, H200_TILES, 1, 2048) == (128, 1, 16384)
    # A window of 4096 keys (Mistral) on 131072: its 4096 + 128 keys in 128-key tiles split 7
    # ways, chunks of 640: short tiles, 13 ways; the whole cache: 16 chunks of 8192, long.
    assert kernels.split_rule(131072, 4096, 8, H200_TILES, None, 2048) == (64, 13, 320)
    assert kernels.split_rule(131072, None, 8, H200_TILES, None, 2048) == (128, 16, 8192)
    assert kernels.split_rule(131072, 64, 8, H200_TILES, None, 2048) == (64, 1, 128)


def test_long_config_for_compiled_kernels(monkeypatch):
    # The configs a GPU launch takes (the interpreter's are smaller): 128-key tiles at head_dim
    # <= 128 and 16-bit inputs; 8 warps for 64-row blocks; fp32 and head_dim 256 keep theirs.
    monkeypatch.setattr(kernels, "is_interpreted", lambda: False)
    assert kernels.config_for(128, 4, torch.bfloat16) == (16, 64, 128, 4, 3)
    assert kernels.long_config_for(128, 4, torch.bfloat16) == (16, 128, 128, 4, 3)
    assert kernels.long_config_for(80, 32, torch.float16) == (32, 128, 128, 4, 3)
    assert kernels.long_config_for(128, 64, torch.bfloat16) == (64, 128, 128, 8, 3)
    assert kernels.long_config_for(128, 4, torch.float32) is None
    assert kernels.long_config_for(256, 4, torch.bfloat16) is None


@pytest.fixture
def long_chunk(monkeypatch):
    """Call long_chunk(n) to make chunks of n keys or more take the long tile (the interpreter's
    caches are far shorter than LONG_CHUNK)."""
    def lower(n):
        monkeypatch.setattr(kernels, "LONG_CHUNK", n)
        launch.forget_launches()  # plans decided with the old threshold
    return lower


@pytest.fixture
def tiles_taken(monkeypatch):
    """The key tiles (BLOCK_N) the decode launches walked, in call order."""
    taken = []
    launch = kernels.attention_decode

    def recording(*args, **kwargs):
        result = launch(*args, **kwargs)  # (num_splits, block_n[, kept launch])
        taken.append(result[1])
        return result
    monkeypatch.setattr(kernels, "attention_decode", recording)
    return taken


@pytest.mark.parametrize("dtype,floor,lse_tol", CPU_DTYPES)
@pytest.mark.parametrize("q_len,heads,kv_heads,head_dim,forced", [
    (1, 8, 2, 64, None),  # one query, GQA 4; the rule's own split counts
    (5, 4, 1, 40, 3),     # MQA, 20 rows: 2 row blocks; 3 forced splits; head_dim 40 pads to 64
])
def test_long_chunks_take_long_tiles(q_len, heads, kv_heads, head_dim, forced, dtype, floor,
                                     lse_tol, tiles_taken, splits, long_chunk):
    # 300 keys in 32-key tiles: the rule's 2 splits of 160 keys, or 3 forced of 128 (128, 128
    # and 44 keys, a ragged last tile), at least the lowered threshold of 64: 32-key tiles.
    # Per-sequence lengths: a short one and an empty one too, whose later splits see no key.
    long_chunk(64)
    if forced:
        splits(forced)
    q, k, v = make_cache(3, q_len, heads, kv_heads, 300, head_dim, dtype, seed=60)
    seqlens = torch.tensor([300, 45, 0], dtype=torch.int32)
    out, lse = fused_attention_with_kvcache(q, k, v, seqlens, return_lse=True)
    assert tiles_taken == [32]
    assert_close(out, lse, q, k, v, seqlens.tolist(), floor, lse_tol)


@pytest.mark.parametrize("dtype,floor,lse_tol", CPU_DTYPES)
@pytest.mark.parametrize("page_size,block_n", [
    (32, 32),  # pages of whole long tiles: one table entry a tile
    (16, 16),  # pages of whole short tiles but not long ones (64 keys on the GPU): short kept
    (5, 16),   # pages smaller than either tile: short kept, one table entry a key row
])
def test_long_tiles_on_a_paged_cache(page_size, block_n, dtype, floor, lse_tol, tiles_taken,
                                     splits, long_chunk):
    long_chunk(64)
    splits(3)  # 300 keys: 3 chunks of 128 keys in 32-key tiles
    q, k, v = make_cache(4, 2, 8, 2, 300, 32, dtype, seed=61)
    seqlens = torch.tensor([300, 0, 133, 7], dtype=torch.int32)
    k_pool, v_pool, table = page(k, v, page_size, seed=62)
    out, lse = fused_attention_with_kvcache(q, k_pool, v_pool, seqlens, block_table=table,
                                            return_lse=True)
    assert tiles_taken == [block_n]
    assert_close(out, lse, q, k, v, seqlens.tolist(), floor, lse_tol)


def test_a_pinned_long_tile_on_pages_of_short_tiles():
    # What the rule avoids still computes right: a pinned 32-key tile on 16-key pages (on the
    # GPU, 128-key tiles on 64-key pages) takes the one-entry-a-key-row path.
    q, k, v = make_cache(2, 3, 4, 2, 150, 32, torch.float32, seed=64)
    seqlens = torch.tensor([150, 61], dtype=torch.int32)
    k_pool, v_pool, table = page(k, v, 16, seed=65)
    out = torch.full((2, 4, 3, 32), float("nan"))
    lse = torch.full((2, 4, 3), float("nan"))
    assert kernels.attention_decode(_bhsd(q), k_pool, v_pool, out, lse, causal=True,
                                    scale=32 ** -0.5, seqlens=seqlens, block_table=table,
                                    num_splits=2, config=(16, 32, 4, 1)) == (2, 32)
    assert_close(_bhsd(out), lse, q, k, v, seqlens.tolist(), 1e-5, 1e-5)


# ---- kept launches: the launch keys, in the interpreter ----------------------------------------

@pytest.fixture
def kept_launches(monkeypatch):
    """The decode kernels' launches are kept as on the GPU; returns a Counter of launches by
    (kernel, "triton" | "kept")."""
    counts = collections.Counter()
    keep_launches(monkeypatch, kernels._split_launch, "split", counts)
    return counts


def _decode(q, k, v, **kwargs):
    # attention_decode on bshd q and contiguous [batch, kv_heads, kv_len, d] K/V (the op's own
    # decode route takes only CUDA tensors); returns bshd out and LSE.
    batch, q_len, heads, d = q.shape
    out = torch.full((batch, heads, q_len, d), float("nan"), dtype=q.dtype)
    lse = torch.full((batch, heads, q_len), float("nan"))
    kernels.attention_decode(_bhsd(q), k, v, out, lse, causal=True, **kwargs)
    return _bhsd(out), lse


def test_a_growing_cache_keeps_its_launches(kept_launches, splits):
    # A plain decode loop: K/V made anew each step with one key more (torch.cat's layout: every
    # stride but the last changes). Within one split count the key holds only what Triton
    # specializes the length on: 33..37 keys share launches, 48 (a multiple of 16) takes its own
    # split kernel. 2 splits of 32 keys at every length, merged in the split kernel.
    splits(2)
    q, k, v = make_cache(1, 2, 8, 2, 48, 32, torch.float16, seed=40)
    for n in (33, 34, 35, 36, 37, 48):
        k_n, v_n = (_bhsd(t[:, :n]).contiguous() for t in (k, v))
        out, lse = _decode(q, k_n, v_n, scale=32 ** -0.5)
        assert_close(out, lse, q, k, v, [n], 1e-3, 1e-3)
    assert kept_launches == {("split", "triton"): 2, ("split", "kept"): 4}


def test_a_growing_cache_switches_tiles_in_one_plan(kept_launches, tiles_taken, long_chunk):
    # The rule's own split counts for 2 programs (2 kv heads, one row block) on 4 slots, the
    # threshold lowered to 160 keys: 100 and 104 keys take one 128-key chunk in 32-key tiles
    # (short of it: 16-key tiles), 161 and 170 one of 192 (32-key tiles). One plan throughout;
    # the tile is in the split kernel's key: 100 and 161 go through Triton, 104 and 170 (their
    # specializations) launch those kernels again; one split each.
    long_chunk(160)
    q, k, v = make_cache(1, 2, 8, 2, 170, 32, torch.float16, seed=63)
    for n in (100, 104, 161, 170):
        k_n, v_n = (_bhsd(t[:, :n]).contiguous() for t in (k, v))
        out, lse = _decode(q, k_n, v_n, scale=32 ** -0.5)
        assert_close(out, lse, q, k, v, [n], 1e-3, 1e-3)
    assert tiles_taken == [16, 16, 32, 32] and len(kernels._plans) == 1
    assert kept_launches == {("split", "triton"): 2, ("split", "kept"): 2}


@pytest.mark.parametrize("page_size", [None, 16])
def test_a_kv_cache_loop_keeps_its_launches(page_size, kept_launches, splits):
    # fused_attention_with_kvcache on a fixed-capacity cache: new lengths, a new block table
    # (and block pool), a new scale at each step, all on the first step's launches.
    splits(3)
    q, k, v = make_cache(2, 2, 8, 2, 64, 32, torch.float16, seed=41)
    steps = [([37, 0], None), ([38, 1], 0.3), ([64, 17], 0.5)]
    for step, (lengths, scale) in enumerate(steps):
        seqlens = torch.tensor(lengths, dtype=torch.int32)
        if page_size is None:
            k_cache, v_cache, table = k, v, None
        else:
            k_cache, v_cache, table = page(k, v, page_size, seed=42 + step)
        out, lse = fused_attention_with_kvcache(q, k_cache, v_cache, seqlens, block_table=table,
                                                scale=scale, return_lse=True)
        assert_close(out, lse, q, k, v, lengths, 1e-3, 1e-3, scale=scale)
    assert kept_launches == {("split", "triton"): 1, ("split", "kept"): 2}


def test_what_the_key_fixes_is_a_new_launch(kept_launches):
    # q 2 bytes past a 16-byte boundary (Triton specializes pointers on it), then a window, then
    # the first call again: three launches through Triton, one kept.
    q, k, v = make_cache(1, 1, 4, 2, 40, 32, torch.float16, seed=43)
    shifted = torch.empty(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape).copy_(q)
    k4, v4 = _bhsd(k), _bhsd(v)
    for q_in, window in ((q, (-1, -1)), (shifted, (-1, -1)), (q, (9, 0)), (q, (-1, -1))):
        out, lse = _decode(q_in, k4, v4, scale=32 ** -0.5, window=window)
        assert_close(out, lse, q, k, v, [40], 1e-3, 1e-3, window=window)
    assert kept_launches == {("split", "triton"): 3, ("split", "kept"): 1}


def test_int_specializations_are_triton_s():
    # Two ints with the same int_specializations must get the same specialization from Triton
    # (the compiled kernel a kept launch reuses), and the reverse.
    libtriton = pytest.importorskip("triton._C.libtriton")
    from triton.backends.compiler import BaseBackend
    native = getattr(libtriton, "native_specialize_impl", None)
    if native is None:
        pytest.skip("this Triton specializes arguments elsewhere")
    values = [0, 1, 2, 15, 16, 17, 48, -1, -16, 2 ** 31 - 16, 2 ** 31 - 1, 2 ** 31, 2 ** 31 + 16,
              -2 ** 31, -2 ** 31 - 1]
    ours = {x: launch.int_specializations(x) for x in values}
    triton_s = {x: native(BaseBackend, x, False, True, True) for x in values}
    for a in values:
        for b in values:
            assert (ours[a] == ours[b]) == (triton_s[a] == triton_s[b]), (a, b)


# ---- GPU ------------------------------------------------------------------------------------

def _bhsd(t):
    return t.transpose(1, 2)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,floor,lse_tol", GPU_DTYPES)
@pytest.mark.parametrize("batch,heads,kv_heads,kv_len", [
    (64, 32, 8, 8192),   # issue 20's first decode shape
    (8, 32, 8, 32768),   # issue 20's second: long caches, many splits
    (3, 16, 16, 1000),   # MHA, a cache length no tile size divides
])
@pytest.mark.parametrize("q_len", [1, 3, 8])
def test_gpu_decode_through_the_op(batch, heads, kv_heads, kv_len, q_len, dtype, floor, lse_tol,
                                   monkeypatch):
    # fused_attention at q_len <= MAX_Q_LEN, bottom-right, inference: routed to the decode kernel.
    launches = []
    launch = kernels.attention_decode
    monkeypatch.setattr(kernels, "attention_decode",
                        lambda *a, **kw: launches.append(1) or launch(*a, **kw))
    q, k, v = make_cache(batch, q_len, heads, kv_heads, kv_len, 128, dtype, "cuda", seed=11)
    out, lse = fused_attention(_bhsd(q), _bhsd(k), _bhsd(v), causal_alignment="bottom_right",
                               return_lse=True)
    assert launches == [1], "short bottom-right inference calls take the decode kernel"
    assert_close(_bhsd(out), lse, q, k, v, [kv_len] * batch, floor, lse_tol)


@pytest.mark.cuda
def test_gpu_training_and_top_left_calls_keep_the_prefill_kernel(monkeypatch):
    monkeypatch.setattr(kernels, "attention_decode", lambda *a, **kw: pytest.fail("decode ran"))
    q, k, v = (_bhsd(t) for t in make_cache(2, 1, 8, 2, 300, 64, torch.bfloat16, "cuda"))
    fused_attention(q, k, v, causal_alignment="top_left")
    q.requires_grad_(True)
    fused_attention(q, k, v, causal_alignment="bottom_right").sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,floor,lse_tol", GPU_DTYPES)
@pytest.mark.parametrize("page_size", [16, 256])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gpu_paged_cache(page_size, head_dim, dtype, floor, lse_tol):
    batch, capacity = 16, 4096
    q, k, v = make_cache(batch, 2, 32, 8, capacity, head_dim, dtype, "cuda", seed=12)
    g = torch.Generator().manual_seed(13)
    seqlens = torch.randint(0, capacity + 1, (batch,), generator=g, dtype=torch.int32)
    seqlens[0], seqlens[1] = 0, capacity  # an empty sequence and a full one
    k_pool, v_pool, table = page(k, v, page_size, seed=14)
    out, lse = fused_attention_with_kvcache(q, k_pool, v_pool, seqlens.cuda(), block_table=table,
                                            return_lse=True)
    assert_close(out, lse, q, k, v, seqlens.tolist(), floor, lse_tol)


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", [40, 96, 256])
def test_gpu_fp32_and_odd_head_dims(head_dim):
    # fp32 takes IEEE dots (tf32 would miss 1e-5 by two orders) and 2-stage pipelining.
    q, k, v = make_cache(4, 4, 8, 2, 3000, head_dim, torch.float32, "cuda", seed=15)
    out, lse = fused_attention_with_kvcache(q, k, v, 3000, return_lse=True)
    assert_close(out, lse, q, k, v, [3000] * 4, 1e-5, 1e-5)


@pytest.mark.cuda
def test_gpu_merge_matches_one_split_on_the_lse():
    # Splitting must not change the math beyond rounding: LSE of 1 vs 64 splits.
    q, k, v = make_cache(2, 1, 8, 8, 16384, 128, torch.bfloat16, "cuda", seed=16)
    results = []
    for n in (1, 64):
        out = torch.empty_like(_bhsd(q))
        lse = torch.empty(2, 8, 1, dtype=torch.float32, device="cuda")
        assert kernels.attention_decode(_bhsd(q), _bhsd(k), _bhsd(v), out, lse, causal=True,
                                        scale=1 / math.sqrt(128), num_splits=n)[0] == n
        results.append((out.float(), lse))
    torch.testing.assert_close(results[0][1], results[1][1], atol=1e-4, rtol=0)
    # Outputs are means over 16384 random values, |out| < ~0.15: 2e-3 is a few bf16 ulps there
    # (fp16 in the interpreter, 2048 keys, 1 vs 16 splits: 6e-5), while a wrongly weighted merge
    # is off by the size of the output itself.
    torch.testing.assert_close(results[0][0], results[1][0], atol=2e-3, rtol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,floor,lse_tol", GPU_DTYPES)
@pytest.mark.parametrize("window,softcap", [((4095, 0), 0.0), ((0, 0), 0.0), ((1000, 0), 50.0),
                                            ((-1, -1), 30.0), ((20000, 0), 0.0)])
@pytest.mark.parametrize("q_len", [1, 8])
def test_gpu_window_and_softcap_through_the_op(window, softcap, q_len, dtype, floor, lse_tol,
                                               monkeypatch):
    # Mistral's 4096-key window and Gemma 2's softcap 50 / 30 on an 8192-key cache; a window
    # wider than the cache; windowed and softcapped decode calls take the decode kernel.
    launches = []
    launch = kernels.attention_decode
    monkeypatch.setattr(kernels, "attention_decode",
                        lambda *a, **kw: launches.append(1) or launch(*a, **kw))
    q, k, v = make_cache(8, q_len, 32, 8, 8192, 128, dtype, "cuda", seed=30)
    out, lse = fused_attention(_bhsd(q), _bhsd(k), _bhsd(v), causal_alignment="bottom_right",
                               window=window, softcap=softcap, return_lse=True)
    assert launches == [1], "short bottom-right windowed/softcapped calls take the decode kernel"
    assert_close(_bhsd(out), lse, q, k, v, [8192] * 8, floor, lse_tol, window=window,
                 softcap=softcap)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,floor,lse_tol", GPU_DTYPES)
@pytest.mark.parametrize("page_size", [16, 256])
@pytest.mark.parametrize("window,causal", [((511, 0), True), ((100, 7), False)])
def test_gpu_paged_cache_with_window_and_softcap(window, causal, page_size, dtype, floor,
                                                 lse_tol):
    batch, capacity = 16, 4096
    q, k, v = make_cache(batch, 4, 32, 8, capacity, 128, dtype, "cuda", seed=31)
    g = torch.Generator().manual_seed(32)
    seqlens = torch.randint(0, capacity + 1, (batch,), generator=g, dtype=torch.int32)
    seqlens[0], seqlens[1], seqlens[2] = 0, capacity, 2  # empty, full, fewer keys than queries
    k_pool, v_pool, table = page(k, v, page_size, seed=33)
    out, lse = fused_attention_with_kvcache(q, k_pool, v_pool, seqlens.cuda(), block_table=table,
                                            causal=causal, window=window, softcap=20.0,
                                            return_lse=True)
    assert_close(out, lse, q, k, v, seqlens.tolist(), floor, lse_tol, causal=causal,
                 window=window, softcap=20.0)


@pytest.mark.cuda
def test_gpu_top_left_window_keeps_the_prefill_kernel(monkeypatch):
    # The decode kernel's window is bottom-right; a top-left one is the prefill kernel's.
    monkeypatch.setattr(kernels, "attention_decode", lambda *a, **kw: pytest.fail("decode ran"))
    q, k, v = (_bhsd(t) for t in make_cache(2, 1, 8, 2, 300, 64, torch.bfloat16, "cuda"))
    fused_attention(q, k, v, causal=False, window=(5, 5), causal_alignment="top_left")


@pytest.mark.cuda
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_gpu_more_groups_than_the_decode_grid_takes_keep_the_prefill_kernel(layout, monkeypatch):
    # A decode-route call of more (batch, kv head) pairs than the decode kernel's grid takes
    # (MAX_GROUPS, lowered here) runs the prefill kernel, and is right.
    monkeypatch.setattr(kernels, "MAX_GROUPS", 15)
    monkeypatch.setattr(kernels, "attention_decode", lambda *a, **kw: pytest.fail("decode ran"))
    q, k, v = make_cache(4, 2, 16, 4, 300, 64, torch.bfloat16, "cuda", seed=95)
    args = (q, k, v) if layout == "bshd" else tuple(_bhsd(t) for t in (q, k, v))
    out, lse = fused_attention(*args, layout=layout, causal_alignment="bottom_right",
                               return_lse=True)
    assert_close(out if layout == "bshd" else _bhsd(out), lse, q, k, v, [300] * 4, 4e-3, 1e-3)


def _kept():
    # How many launches the decode kernel keeps (none where the direct launcher does not fit).
    return len(kernels._split_launch.bound)


@pytest.mark.cuda
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_gpu_a_repeated_decode_call_is_remembered(layout, monkeypatch):
    # The same decode-route call twice through the op: the second is a repeat (no checks, and
    # the launch kept for it rather than attention_decode), right, and bit for bit the first
    # (the merge adds the splits in one order whichever split finishes last). A call of the
    # same shapes whose q requires grad, under no_grad, is checked again and keeps off the
    # decode route.
    q, k, v = make_cache(4, 1, 32, 8, 3000, 128, torch.bfloat16, "cuda", seed=80)
    args = (q, k, v) if layout == "bshd" else tuple(_bhsd(t) for t in (q, k, v))
    checks, decodes = [], []
    validate, decode = fused._validate, kernels.attention_decode
    monkeypatch.setattr(fused, "_validate", lambda *a: checks.append(a) or validate(*a))
    monkeypatch.setattr(kernels, "attention_decode",
                        lambda *a, **kw: decodes.append(a) or decode(*a, **kw))
    outs = [fused_attention(*args, layout=layout, causal_alignment="bottom_right",
                            return_lse=True) for _ in range(2)]
    # (where the direct launcher does not fit this Triton, the repeat calls attention_decode)
    repeat_decodes = 0 if launch.direct_launch_ok() else 1
    assert len(checks) == 1 and len(decodes) == 1 + repeat_decodes
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    out, lse = outs[1]
    assert_close(out if layout == "bshd" else _bhsd(out), lse, q, k, v, [3000] * 4, 4e-3, 1e-3)
    with torch.no_grad():
        fused_attention(args[0].clone().requires_grad_(), *args[1:], layout=layout,
                        causal_alignment="bottom_right")
    assert len(checks) == 2 and len(decodes) == 1 + repeat_decodes


@pytest.mark.cuda
@pytest.mark.parametrize("page_size", [None, 16])
def test_gpu_a_repeated_kvcache_call_is_remembered(page_size, monkeypatch):
    # Two decode steps through fused_attention_with_kvcache with tensor lengths (the second
    # with longer ones): the second runs the kept launch (no attention_decode call where the
    # direct launcher fits) and is right, contiguous or paged.
    decodes, decode = [], kernels.attention_decode
    monkeypatch.setattr(kernels, "attention_decode",
                        lambda *a, **kw: decodes.append(a) or decode(*a, **kw))
    q, k, v = make_cache(8, 1, 32, 8, 4096, 128, torch.bfloat16, "cuda", seed=90)
    caches, table = ((k, v), None) if page_size is None else (
        page(k, v, page_size, seed=91)[:2], page(k, v, page_size, seed=91)[2])
    for lengths in ([4000, 1, 2048, 0, 4096, 77, 3000, 512], [4001, 2, 2049, 1, 4096, 78, 3001,
                                                               513]):
        seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
        out, lse = fused_attention_with_kvcache(q, *caches, seqlens, block_table=table,
                                                return_lse=True)
        assert_close(out, lse, q, k, v, lengths, 4e-3, 1e-3)
    assert len(decodes) == (1 if launch.direct_launch_ok() else 2)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,floor,lse_tol", GPU_DTYPES)
def test_gpu_decode_loop_through_the_op_keeps_its_launches(dtype, floor, lse_tol):
    # A plain decode loop through fused_attention: K/V made anew with one key more each step
    # (torch.cat's layout: new strides and length), then a new scale, then q at an odd address.
    # Every step is right; the steps that change only what a kept launch takes per call keep
    # no new launch (1000..1007 keys: one split count, no multiple of 16).
    q, k, v = make_cache(1, 8, 32, 8, 1007, 128, dtype, "cuda", seed=50)
    kept = []
    for n, scale in ((1000, None), (1001, None), (1002, None), (1007, 0.05)):
        k_n, v_n = (_bhsd(t[:, :n]).contiguous() for t in (k, v))
        out, lse = fused_attention(_bhsd(q), k_n, v_n, causal_alignment="bottom_right",
                                   scale=scale, return_lse=True)
        assert_close(_bhsd(out), lse, q, k, v, [n], floor, lse_tol, scale=scale)
        kept.append(_kept())
    if launch.direct_launch_ok():
        assert kept[0] == 1 and kept[1:] == kept[:1] * 3
    shifted = torch.empty(q.numel() + 1, dtype=dtype, device="cuda")[1:].view(q.shape).copy_(q)
    out, lse = fused_attention(_bhsd(shifted), k_n, v_n, causal_alignment="bottom_right",
                               return_lse=True)
    assert_close(_bhsd(out), lse, q, k, v, [1007], floor, lse_tol)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,floor,lse_tol", GPU_DTYPES)
@pytest.mark.parametrize("page_size", [None, 16, 256])
def test_gpu_kv_cache_loop_keeps_its_launches(page_size, dtype, floor, lse_tol):
    # fused_attention_with_kvcache on a fixed-capacity cache: new lengths (an empty sequence and
    # a full one among them), a new block table and block pool, a new scale at each step, all
    # on the first step's kept launches.
    batch, capacity = 8, 4096
    q, k, v = make_cache(batch, 4, 32, 8, capacity, 128, dtype, "cuda", seed=51)
    g = torch.Generator().manual_seed(52)
    kept = []
    for step, scale in enumerate((None, 0.05, 0.1)):
        seqlens = torch.randint(0, capacity + 1, (batch,), generator=g, dtype=torch.int32)
        seqlens[step] = 0
        seqlens[step + 1] = capacity
        if page_size is None:
            k_cache, v_cache, table = k, v, None
        else:
            k_cache, v_cache, table = page(k, v, page_size, seed=53 + step)
        out, lse = fused_attention_with_kvcache(q, k_cache, v_cache, seqlens.cuda(),
                                                block_table=table, scale=scale, return_lse=True)
        assert_close(out, lse, q, k, v, seqlens.tolist(), floor, lse_tol, scale=scale)
        kept.append(_kept())
    if launch.direct_launch_ok():
        assert kept[0] == 1 and kept[1:] == kept[:1] * 2


def _h200():
    # The tiles the split rule picks depend on the SM count: the expected ones are the H200's.
    return torch.cuda.get_device_properties(0).multi_processor_count == 132


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,floor,lse_tol", GPU_DTYPES)
@pytest.mark.parametrize("batch,q_len,kv_len,block_n", [
    (64, 1, 8192, 128),    # in 128-key tiles, 1 chunk of 8192 keys
    (1, 1, 131072, 128),   # 16 chunks of 8192
    (2, 8, 65536, 128),    # 32-row blocks (q_len 8 x GQA 4): 8 chunks of 8192
    (128, 1, 1024, 64),    # 1 chunk of 1024: 64-key tiles
    (1, 1, 2048, 64),      # 4 chunks of 512: 64-key tiles
    (16, 4, 4096, 128),    # 1 chunk of 4096
])
def test_gpu_key_tile_by_chunk_length(batch, q_len, kv_len, block_n, dtype, floor, lse_tol,
                                     tiles_taken):
    q, k, v = make_cache(batch, q_len, 32, 8, kv_len, 128, dtype, "cuda", seed=70)
    out, lse = fused_attention(_bhsd(q), _bhsd(k), _bhsd(v), causal_alignment="bottom_right",
                               return_lse=True)
    assert len(tiles_taken) == 1, "short bottom-right inference calls take the decode kernel"
    if _h200():
        assert tiles_taken == [block_n]
    assert_close(_bhsd(out), lse, q, k, v, [kv_len] * batch, floor, lse_tol)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,floor,lse_tol", GPU_DTYPES)
@pytest.mark.parametrize("page_size,config,block_n", [
    (128, None, 128),             # pages of whole 128-key tiles
    (16, None, 64),               # vLLM's pages: one table entry a key row, short tile kept
    (64, None, 64),               # pages of whole 64-key tiles: the rule keeps them
    (64, (16, 128, 4, 3), 128),   # a pinned 128-key tile on them: one entry a key row
    (16, (16, 128, 4, 3), 128),   # and on vLLM's pages
])
def test_gpu_long_tiles_on_a_paged_cache(page_size, config, block_n, dtype, floor, lse_tol):
    # 8 sequences of up to 32768 keys: 2 chunks of 16384 keys in 128-key tiles, so the long tile.
    batch, capacity = 8, 32768
    q, k, v = make_cache(batch, 1, 32, 8, capacity, 128, dtype, "cuda", seed=71)
    g = torch.Generator().manual_seed(72)
    seqlens = torch.randint(0, capacity + 1, (batch,), generator=g, dtype=torch.int32)
    seqlens[0], seqlens[1] = 0, capacity  # an empty sequence and a full one
    k_pool, v_pool, table = page(k, v, page_size, seed=73)
    out = torch.full((batch, 32, 1, 128), float("nan"), dtype=dtype, device="cuda")
    lse = torch.full((batch, 32, 1), float("nan"), device="cuda")
    _, taken = kernels.attention_decode(_bhsd(q), k_pool, v_pool, out, lse, causal=True,
                                        scale=128 ** -0.5, seqlens=seqlens.cuda(),
                                        block_table=table, config=config)
    if _h200() or config is not None:
        assert taken == block_n
    assert_close(_bhsd(out), lse, q, k, v, seqlens.tolist(), floor, lse_tol)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,floor,lse_tol", GPU_DTYPES)
def test_gpu_growing_cache_switches_tiles_in_one_plan(dtype, floor, lse_tol, tiles_taken):
    # 16 sequences x 8 KV heads: up to 1920 keys one chunk of 15 128-key tiles, short of 2048:
    # 64-key tiles; from 1921 one of 16 tiles (2048 keys): 128-key tiles. One plan; the split
    # kernel keeps a launch per tile and specialization: 1900, 1920 (a multiple of 16) and 1921
    # (the long tile) each a new one, 1950 launches 1921's again.
    q, k, v = make_cache(16, 1, 32, 8, 1950, 128, dtype, "cuda", seed=74)
    kept = []
    for n in (1900, 1920, 1921, 1950):
        k_n, v_n = (_bhsd(t[:, :n]).contiguous() for t in (k, v))
        out, lse = fused_attention(_bhsd(q), k_n, v_n, causal_alignment="bottom_right",
                                   return_lse=True)
        assert_close(_bhsd(out), lse, q, k, v, [n] * 16, floor, lse_tol)
        kept.append(_kept())
    assert len(kernels._plans) == 1
    if _h200():
        assert tiles_taken == [64, 64, 128, 128]
        if launch.direct_launch_ok():
            assert kept == [1, 2, 3, 3]
