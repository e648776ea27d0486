"""Gradients of fused_attention against float64 autograd of the reference.

Tolerance rule, as for the forward (and FlashAttention's gradient tests): for each of dq, dk, dv
the kernel's max abs error against float64 autograd of attention_reference must be at most twice
the error of autograd through the same reference computed in the input dtype, plus a small
floor relative to the gradient's magnitude. Every buffer the op allocates (dq, dk, dv, the Delta
scratch) starts as NaN, so an element the kernels fail to write fails the check. Inputs and
upstream gradients are random normals drawn from the test's own seed (conftest.py's `seeded`).

CPU runs go through the Triton interpreter in fp32 and fp16 (its bf16 dot is wrong) with small
heads: the interpreter's time grows with seq^2 * heads. The `cuda` tests repeat the grid in bf16
and fp16 at realistic sizes; `test_gpu_gluon_backward*` (sm_90) check the Gluon kernels of
attention_bwd_hopper.py, deterministic and not.
"""

import collections

import pytest
import torch
from einops import rearrange

from attnscope import fused_attention
from attnscope.attention.reference import attention_reference
from attnscope.kernels import attention_bwd, common
# nan_outputs: autouse; here it also poisons dq, dk, dv and Delta
from fused_checks import CPU, keep_launches, make_qkv, nan_outputs, on_hopper  # noqa: F401

# (dtype, error floor per unit of the gradient's magnitude): fp16 2e-3 is two rounding steps
# (eps 9.8e-4), bf16 4e-3 half of one (eps 7.8e-3), fp32 1e-5 ~80 eps (see assert_grads_close)
CPU_DTYPES = [(torch.float32, 1e-5), (torch.float16, 2e-3)]
GPU_DTYPES = [(torch.bfloat16, 4e-3), (torch.float16, 1e-3)]


def _grads(fn, q, k, v, dout):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    return torch.autograd.grad(fn(*leaves), leaves, dout)


def assert_grads_close(grads, refs, lows, inputs, floor):
    """The tolerance rule on (dq, dk, dv). The floor scales with the gradient's magnitude: the
    kernels recompute P = exp2(s * scale * log2(e) - lse * log2(e)) from the fp32 LSE, as
    FlashAttention does, and the rounding of that exponent grows with the scores. At scale 1.0
    (scores ~8x the default's) the gradients reach ~5-25 and this recompute alone, emulated in
    torch without the kernel, errs up to 3.3x torch's eager fp32 softmax (60 seeds): an absolute
    1e-5 floor then failed about half the seeds though the kernel runs IEEE fp32 dots."""
    for name, g, ref, low, x in zip(("dq", "dk", "dv"), grads, refs, lows, inputs):
        assert g.shape == x.shape and g.dtype == x.dtype, name
        assert not g.isnan().any(), f"{name} has NaN (unwritten element or 0/0)"
        err = (g.double() - ref).abs().max().item()
        torch_err = (low.double() - ref).abs().max().item()
        bound = 2 * torch_err + floor * max(1.0, ref.abs().max().item())
        assert err <= bound, f"{name}: error {err:.3g} > 2 x torch's {torch_err:.3g} + floor"


def check_grads(q, k, v, floor, dout=None, op_kwargs=None, **kwargs):
    """Backward of the op (with kwargs and op_kwargs) against float64 autograd of the reference
    (with kwargs); returns (dq, dk, dv)."""
    dout = torch.randn_like(q) if dout is None else dout
    grads = _grads(lambda *t: fused_attention(*t, **kwargs, **(op_kwargs or {})), q, k, v, dout)
    refs = _grads(lambda *t: attention_reference(*t, **kwargs), q.double(), k.double(),
                  v.double(), dout.double())
    lows = _grads(lambda *t: attention_reference(*t, dtype=q.dtype, **kwargs), q, k, v, dout)
    assert_grads_close(grads, refs, lows, (q, k, v), floor)
    return grads


# ---- CPU (Triton interpreter) ---------------------------------------------------------------

@pytest.mark.parametrize("dtype,floor", CPU_DTYPES)
@pytest.mark.parametrize("seq,head_dim", [
    (1, 16),    # one query, one key: a single masked block in both kernels
    (17, 48),   # ragged length and head_dim: every tile is partial
    (113, 80),  # several blocks: unmasked stages run; head_dim 80 pads to 128
])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_causal_shapes(seq, head_dim, layout, dtype, floor):
    q, k, v = make_qkv(1, 2, 2, seq, seq, head_dim, dtype, CPU, layout)
    check_grads(q, k, v, floor, layout=layout)


@pytest.mark.parametrize("dtype,floor", CPU_DTYPES)
@pytest.mark.parametrize("q_len,kv_len", [
    (17, 70),  # fewer queries than keys: top-left leaves keys 17.. with zero dk/dv
    (70, 17),  # more queries than keys: bottom-right leaves 53 rows with no key
])
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_unequal_lengths(q_len, kv_len, alignment, dtype, floor):
    q, k, v = make_qkv(1, 2, 2, q_len, kv_len, 32, dtype, CPU)
    check_grads(q, k, v, floor, causal_alignment=alignment)


@pytest.mark.parametrize("dtype,floor", CPU_DTYPES)
def test_fully_masked_rows_get_zero_gradient(dtype, floor):
    q, k, v = make_qkv(1, 2, 2, 40, 9, 32, dtype, CPU)
    dq, dk, dv = check_grads(q, k, v, floor, causal_alignment="bottom_right")
    assert torch.equal(dq[:, :, :31], torch.zeros_like(dq[:, :, :31]))  # rows that see no key
    assert (dq[:, :, 32:] != 0).any(dim=-1).all()  # row 31 sees one key: its dq is ~0 too
    # the masked rows add nothing to dk/dv: a large gradient on them alone gives exactly zero
    _, dk1, dv1 = _grads(lambda *t: fused_attention(*t, causal_alignment="bottom_right"), q, k, v,
                         torch.cat([torch.randn(1, 2, 31, 32, dtype=dtype) * 1e3,
                                    torch.zeros(1, 2, 9, 32, dtype=dtype)], dim=2))
    assert torch.equal(dk1, torch.zeros_like(dk1)) and torch.equal(dv1, torch.zeros_like(dv1))


@pytest.mark.parametrize("dtype,floor", CPU_DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (3, 1)])  # GQA; MQA: dk/dv sum 3 heads
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_gqa(heads, kv_heads, layout, dtype, floor):
    q, k, v = make_qkv(2, heads, kv_heads, 37, 37, 32, dtype, CPU, layout)
    check_grads(q, k, v, floor, layout=layout)


@pytest.mark.parametrize("dtype,floor", CPU_DTYPES)
@pytest.mark.parametrize("q_len,kv_len", [(45, 45), (30, 70)])
def test_non_causal(q_len, kv_len, dtype, floor):
    q, k, v = make_qkv(1, 2, 1, q_len, kv_len, 48, dtype, CPU)
    check_grads(q, k, v, floor, causal=False)


@pytest.mark.parametrize("dtype,floor", CPU_DTYPES)
@pytest.mark.parametrize("scale", [0.05, 1.0])
def test_custom_scale(scale, dtype, floor):
    q, k, v = make_qkv(1, 2, 2, 33, 33, 64, dtype, CPU)
    check_grads(q, k, v, floor, scale=scale)


@pytest.mark.parametrize("dtype,floor", CPU_DTYPES)
def test_non_contiguous_inputs_and_gradient(dtype, floor):
    # q: a head_dim slice (row stride 96); k: stored seq-major, seen as bhsd; v: every other batch
    # entry; the upstream gradient: a head_dim slice of a seq-major tensor, so no stride is alike.
    q = torch.randn(2, 3, 45, 96, dtype=dtype)[..., 16:80]
    k = rearrange(torch.randn(2, 45, 3, 64, dtype=dtype), "b s h d -> b h s d")
    v = torch.randn(4, 3, 45, 64, dtype=dtype)[::2]
    dout = rearrange(torch.randn(2, 45, 3, 80, dtype=dtype), "b s h d -> b h s d")[..., 8:72]
    assert not any(t.is_contiguous() for t in (q, k, v, dout))
    dq, dk, dv = check_grads(q, k, v, floor, dout=dout)
    assert dq.is_contiguous() and dk.is_contiguous() and dv.is_contiguous()


def test_broadcast_gradient_of_a_sum():
    # out.sum() sends back an expanded tensor: every stride 0
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, 2, 20, 20, 16, torch.float32, CPU,
                                                    "bshd"))
    fused_attention(q, k, v, layout="bshd").sum().backward()
    refs = _grads(lambda *t: attention_reference(*t, layout="bshd").sum(), q.double(), k.double(),
                  v.double(), None)
    for g, ref in zip((q.grad, k.grad, v.grad), refs):
        torch.testing.assert_close(g.double(), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("config", [
    (16, 16, 4, 1, 16, 16, 4, 1),  # square tiles: the band is exactly the diagonal blocks
    (32, 16, 4, 1, 16, 32, 2, 1),  # dK/dV with more query rows than keys per tile, dQ the reverse
])
def test_other_tile_shapes(config):
    # The backward kernels launched directly with `config`, on the forward's output and LSE.
    q, k, v = make_qkv(1, 2, 1, 50, 61, 24, torch.float32, CPU)
    dout = torch.randn_like(q)
    for alignment in ("top_left", "bottom_right"):
        out, lse = fused_attention(q, k, v, causal_alignment=alignment, return_lse=True)
        dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
        delta = torch.full_like(lse, float("nan"))
        attention_bwd.attention_bwd(dout, q, k, v, out, lse, dq, dk, dv, delta, causal=True,
                                    scale=24 ** -0.5, config=config,
                                    causal_offset=11 if alignment == "bottom_right" else 0)
        refs = _grads(lambda *t: attention_reference(*t, causal_alignment=alignment),
                      q.double(), k.double(), v.double(), dout.double())
        lows = _grads(lambda *t: attention_reference(*t, dtype=q.dtype,
                                                     causal_alignment=alignment), q, k, v, dout)
        assert_grads_close((dq, dk, dv), refs, lows, (q, k, v), 1e-5)


def test_a_config_of_the_wrong_shape_is_refused():
    q, k, v = make_qkv(1, 1, 1, 8, 8, 16, torch.float32, CPU)
    out, lse = fused_attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="config must be a tuple of"):
        attention_bwd.attention_bwd(q, q, k, v, out, lse, q, k, v, lse, causal=True, scale=0.25,
                                    causal_offset=0, config=(16, 16))


def test_gradients_are_deterministic():
    q, k, v = make_qkv(1, 4, 1, 40, 40, 32, torch.float16, CPU)
    dout = torch.randn_like(q)
    first = _grads(fused_attention, q, k, v, dout)
    second = _grads(fused_attention, q, k, v, dout)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_lse_output_is_not_differentiable():
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 1, 1, 8, 8, 16, torch.float32, CPU))
    out, lse = fused_attention(q, k, v, return_lse=True)
    assert out.requires_grad and not lse.requires_grad
    (out.sum() + lse.sum()).backward()  # lse's part is a constant: gradients are out's alone
    refs = _grads(lambda *t: attention_reference(*t).sum(), q.double(), k.double(), v.double(),
                  None)
    torch.testing.assert_close(q.grad.double(), refs[0], atol=1e-5, rtol=0)


def test_eager_autograd_matches_the_custom_ops():
    # Eager training calls run _EagerAttention (no dispatcher round trips); traced ones the
    # custom ops. Both must give the same gradients, bit for bit (same kernels, no atomics).
    from attnscope.attention import fused
    q, k, v = make_qkv(1, 4, 2, 40, 56, 32, torch.float16, CPU)
    dout = torch.randn_like(q)
    eager = _grads(lambda *t: fused_attention(*t, causal_alignment="bottom_right"), q, k, v, dout)
    ops = _grads(lambda *t: fused._attention_fwd(*t, True, 32 ** -0.5, True, "bhsd")[0], q, k, v,
                 dout)
    assert all(torch.equal(a, b) for a, b in zip(eager, ops))
    q.requires_grad_()
    out = fused_attention(q, k, v)
    assert type(out.grad_fn).__name__ == "_EagerAttentionBackward"


@pytest.fixture
def kept_backward(monkeypatch):
    """The backward's Triton launches are kept in the interpreter as on the GPU; returns the
    list of the op's calls into the backward launch (dispatch.attention_bwd): a remembered
    backward (fused._backward_repeat) does not make one. Starts and ends with nothing kept."""
    from attnscope.attention import fused
    from attnscope.kernels import launch as launches
    launches.forget_launches()
    counts, calls = collections.Counter(), []
    for name in ("_launch_preprocess", "_launch_dkdv", "_launch_dq"):
        keep_launches(monkeypatch, getattr(attention_bwd, name), name, counts)
    dispatch = fused._kernels()
    launch = dispatch.attention_bwd
    monkeypatch.setattr(dispatch, "attention_bwd",
                        lambda *a, **kw: calls.append(kw) or launch(*a, **kw))
    yield calls
    launches.forget_launches()


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_a_backward_repeat_runs_the_kept_launches(kept_backward, layout):
    # The second backward of one signature runs the three launches the first kept, with fresh
    # NaN-poisoned gradients and Delta: right on new inputs (GQA, bottom-right, a window that
    # cuts blocks, a dO of other strides than q's), bit for bit the full path on the same ones.
    kwargs = dict(layout=layout, causal_alignment="bottom_right", window=(20, 0))
    q, k, v = make_qkv(2, 4, 2, 40, 56, 16, torch.float16, CPU, layout)
    dout = torch.randn(q.shape[::-1], dtype=q.dtype).permute(3, 2, 1, 0)  # other strides
    first = check_grads(q, k, v, 2e-3, dout=dout, **kwargs)
    assert len(kept_backward) == 1 and kept_backward[0]["kept"]
    again = check_grads(q, k, v, 2e-3, dout=dout, **kwargs)
    assert len(kept_backward) == 1
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    q, k, v = make_qkv(2, 4, 2, 40, 56, 16, torch.float16, CPU, layout)
    check_grads(q, k, v, 2e-3, dout=torch.randn(q.shape[::-1], dtype=q.dtype).permute(3, 2, 1, 0),
                **kwargs)
    assert len(kept_backward) == 1


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_a_remembered_fused_dq_backward_writes_dq_in_the_caller_s_layout(layout):
    # The sm_90 fused-dQ path of a remembered backward (no Gluon here: its kept dK/dV launch is
    # a stand-in that adds dQ into the fp32 buffer by data pointer, [batch, heads, seq,
    # head_dim] order, as the kernel does): dq comes back in the caller's layout, scaled. A
    # bshd repeat handed the buffer the caller's bshd shape before, and dq came back permuted.
    import types
    from attnscope.attention import fused
    b, h, s, d = 2, 3, 5, 4
    truth = torch.randn(b, h, s, d)  # the dQ the kernel computes
    kept = types.SimpleNamespace(bound={"key": lambda tensors: None})
    gluon = types.SimpleNamespace(kept_launches=lambda key, scale, fused_dq: (
        lambda tensors: tensors[8].view(-1).add_(truth.reshape(-1)), None))
    launch = attention_bwd._kept_gluon_backward(gluon, "key", (kept, None, (None,) * 3, None),
                                                0.5, True)
    q = torch.randn((b, h, s, d) if layout == "bhsd" else (b, s, h, d))
    dq, _, _ = fused._backward_repeat(layout, launch)(q, q, q, q, q, torch.zeros(b, h, s))
    assert dq.shape == q.shape
    torch.testing.assert_close(fused._as_bhsd(dq, layout), truth * 0.5)


def test_each_backward_key_component_is_a_new_call(kept_backward):
    # What fixes the launches' arguments: dO's strides, the scale, the alignment, the lengths,
    # the deterministic flag; a call that differs in one takes the full path (and is right).
    q, k, v = make_qkv(1, 2, 1, 24, 24, 16, torch.float32, CPU)
    check_grads(q, k, v, 1e-5)
    check_grads(q, k, v, 1e-5, dout=torch.randn(q.shape[::-1]).permute(3, 2, 1, 0))
    check_grads(q, k, v, 1e-5, scale=0.3)
    check_grads(q, k, v, 1e-5, op_kwargs=dict(deterministic=False))
    shifted = torch.empty(q.numel() + 1)[1:].view(q.shape).copy_(q)  # 4-byte aligned
    check_grads(shifted, k, v, 1e-5)
    q2, k2, v2 = make_qkv(1, 2, 1, 25, 24, 16, torch.float32, CPU)
    check_grads(q2, k2, v2, 1e-5, causal_alignment="bottom_right")
    assert len(kept_backward) == 6  # each a first call
    check_grads(q, k, v, 1e-5, scale=0.3)  # a repeat
    assert len(kept_backward) == 6


def test_a_saved_output_moved_by_a_hook_is_a_new_call(kept_backward):
    # A saved-tensor hook may hand the backward the output in other strides than the op's own
    # allocation: the key holds the saved output's and LSE's strides, so that is a first call
    # (and right), not a repeat with the first call's strides.
    def relaid(t):  # every 4-D tensor column-major
        return t.permute(3, 2, 1, 0).contiguous().permute(3, 2, 1, 0) if t.dim() == 4 else t
    q, k, v = make_qkv(1, 2, 1, 24, 24, 16, torch.float32, CPU)
    check_grads(q, k, v, 1e-5)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, relaid):
        check_grads(q, k, v, 1e-5)
    assert len(kept_backward) == 2


def test_a_saved_lse_relaid_by_a_hook_is_read_at_its_strides(kept_backward):
    # The kernels read the LSE as contiguous [batch, heads, q_len]: a saved-tensor hook that
    # hands it back in other strides (here column-major) gets right gradients, on the first
    # call and on its repeat.
    q, k, v = make_qkv(2, 2, 1, 24, 24, 16, torch.float32, CPU)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, _lse_column_major):
        check_grads(q, k, v, 1e-5)
        check_grads(q, k, v, 1e-5)
    assert len(kept_backward) == 1


def _lse_column_major(t):
    return t.permute(2, 1, 0).contiguous().permute(2, 1, 0) if t.dim() == 3 else t


def test_a_saved_lse_relaid_by_a_hook_is_read_at_its_strides_by_the_custom_op():
    # The same on the custom ops' path (a dispatch mode makes the call a traced one).
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))
    q, k, v = make_qkv(2, 2, 1, 24, 24, 16, torch.float32, CPU)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, _lse_column_major), Passing():
        check_grads(q, k, v, 1e-5)


def test_a_traced_backward_is_never_a_repeat(kept_backward, monkeypatch):
    # Under a dispatch mode (what fused._traced detects) the backward takes the full path, so
    # the mode sees its launches, whatever was remembered. (The launches are left eager here:
    # the interpreter stand-ins cannot be wrapped by wrap_triton.)
    from attnscope.attention import fused
    q, k, v = make_qkv(1, 2, 1, 24, 24, 16, torch.float32, CPU)
    dout = torch.randn_like(q)
    first = _grads(fused_attention, q, k, v, dout)  # remembered
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = fused_attention(*leaves)  # eager autograd (_EagerAttention), then traced:
    monkeypatch.setattr(fused, "_traced", lambda t: True)
    monkeypatch.setattr(fused, "_launch_wrap", lambda t: None)
    again = torch.autograd.grad(out, leaves, dout)
    assert len(kept_backward) == 2 and not kept_backward[1]["kept"]
    assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_forget_launches_forgets_the_remembered_backward(kept_backward):
    from attnscope.kernels import launch
    q, k, v = make_qkv(1, 2, 1, 24, 24, 16, torch.float32, CPU)
    check_grads(q, k, v, 1e-5)
    launch.forget_launches()
    check_grads(q, k, v, 1e-5)
    assert len(kept_backward) == 2


def test_second_order_gradients_raise_instead_of_dropping_terms():
    # A gradient penalty differentiates the backward: it has no derivative, so that must raise,
    # never run with the attention's second-order terms silently missing.
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, 2, 16, 16, 16, torch.float32, CPU))
    loss = (q * q).sum() + fused_attention(q, k, v).sum()
    (dq,) = torch.autograd.grad(loss, q, create_graph=True)
    with pytest.raises(RuntimeError, match="autograd"):
        dq.pow(2).sum().backward()


def test_no_gradient_reaching_the_output():
    # A later function may send no gradient back to `out`: q, k, v then get none from it.
    class Cut(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return None
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, 2, 16, 16, 16, torch.float32, CPU))
    loss = Cut.apply(fused_attention(q, k, v)).sum() + q.sum()
    loss.backward()
    assert torch.equal(q.grad, torch.ones_like(q)) and k.grad is None and v.grad is None


def test_torch_compile_fullgraph_forward_and_backward():
    q, k, v = make_qkv(1, 2, 1, 20, 20, 32, torch.float32, CPU)

    @torch.compile(fullgraph=True, backend="eager")  # dynamo tracing; inductor is GPU-tested
    def loss(q, k, v):
        return (fused_attention(q * 2, k, v) ** 2).sum()

    got = _grads(loss, q, k, v, None)
    expected = _grads(lambda q, k, v: (attention_reference(q * 2, k, v) ** 2).sum(), q.double(),
                      k.double(), v.double(), None)
    for g, ref in zip(got, expected):
        torch.testing.assert_close(g.double(), ref, atol=1e-4, rtol=0)


# ---- GPU ------------------------------------------------------------------------------------

GPU_SHAPES = [
    # (batch, heads, kv_heads, q_len, kv_len, head_dim, alignment)
    (8, 16, 16, 1024, 1024, 64, "top_left"),     # the blog's seed shape
    (1, 4, 4, 4096, 4096, 128, "top_left"),      # long sequence, head_dim 128
    (2, 16, 4, 2048, 2048, 128, "top_left"),     # GQA 4:1
    (2, 8, 1, 777, 777, 80, "top_left"),         # MQA, odd length and head_dim
    (2, 8, 8, 1023, 1023, 96, "top_left"),       # ragged length, non-power-of-two head_dim
    (1, 8, 8, 113, 2000, 64, "bottom_right"),    # chunked prefill against a KV cache
    (1, 8, 8, 2000, 113, 64, "bottom_right"),    # rows with no visible key
    (1, 8, 8, 300, 1500, 256, "top_left"),       # widest head_dim
    (2, 4, 4, 257, 257, 48, "top_left"),         # small head_dim, one row past a block
]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,floor", GPU_DTYPES)
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_gpu_grid(shape, layout, dtype, floor):
    batch, heads, kv_heads, q_len, kv_len, head_dim, alignment = shape
    q, k, v = make_qkv(batch, heads, kv_heads, q_len, kv_len, head_dim, dtype, "cuda", layout)
    check_grads(q, k, v, floor, layout=layout, causal_alignment=alignment)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,floor", GPU_DTYPES)
def test_gpu_non_causal_and_non_contiguous(dtype, floor):
    q = torch.randn(2, 8, 1000, 160, dtype=dtype, device="cuda")[..., 16:144]
    k = rearrange(torch.randn(2, 1500, 8, 128, dtype=dtype, device="cuda"), "b s h d -> b h s d")
    v = torch.randn(4, 8, 1500, 128, dtype=dtype, device="cuda")[::2]
    dout = rearrange(torch.randn(2, 1000, 8, 128, dtype=dtype, device="cuda"),
                     "b s h d -> b h s d")
    check_grads(q, k, v, floor, dout=dout, causal=False)
    check_grads(q, k, v, floor, dout=dout, scale=0.3)


@pytest.mark.cuda
def test_gpu_fp32():
    q, k, v = make_qkv(2, 4, 2, 513, 513, 64, torch.float32, "cuda")
    check_grads(q, k, v, 1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim,heads,kv_heads,deterministic", [
    (64, 8, 2, True),     # the Triton kernels, GQA
    (128, 8, 2, True),    # the Gluon kernels on sm_90 (bshd views at their strides), GQA
    (128, 8, 8, False),   # sm_90: the Gluon dK/dV kernel adding dQ (fused_dq), either layout
])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_gpu_a_repeated_backward_is_remembered(layout, head_dim, heads, kv_heads, deterministic,
                                               monkeypatch):
    # Two backwards of one signature (bottom-right): the second runs the kept launches (no
    # attention_bwd call where the direct launcher fits), right and, deterministic, bit for bit
    # the first; then new inputs of the same shapes.
    from attnscope.attention import fused
    from attnscope.kernels import launch
    launch.forget_launches()
    dispatch, calls = fused._kernels(), []
    bwd = dispatch.attention_bwd
    monkeypatch.setattr(dispatch, "attention_bwd",
                        lambda *a, **kw: calls.append(kw) or bwd(*a, **kw))
    shape = (2, heads, kv_heads, 300, 520, head_dim, torch.bfloat16, "cuda", layout)
    q, k, v = make_qkv(*shape)
    dout = torch.randn_like(q)
    kwargs = dict(layout=layout, causal_alignment="bottom_right")
    op_kwargs = dict(deterministic=deterministic)
    try:
        grads = [check_grads(q, k, v, 4e-3, dout=dout, op_kwargs=op_kwargs, **kwargs)
                 for _ in range(2)]
        assert len(calls) == (1 if launch.direct_launch_ok() else 2)
        if deterministic:
            assert all(torch.equal(a, b) for a, b in zip(*grads))
        q, k, v = make_qkv(*shape)
        check_grads(q, k, v, 4e-3, op_kwargs=op_kwargs, **kwargs)  # new inputs, a repeat
    finally:
        launch.forget_launches()


@pytest.mark.cuda
def test_gpu_torch_compile_fullgraph_forward_and_backward():
    q, k, v = make_qkv(4, 8, 2, 512, 512, 64, torch.bfloat16, "cuda")

    @torch.compile(fullgraph=True)  # inductor: both triton ops inside the compiled graphs
    def loss(q, k, v):
        return (fused_attention(q * 2, k, v).float() ** 2).sum()

    torch._dynamo.reset()
    got = _grads(loss, q, k, v, None)
    expected = _grads(lambda q, k, v: (attention_reference(q * 2, k, v) ** 2).sum(), q.double(),
                      k.double(), v.double(), None)
    for g, ref in zip(got, expected):
        scale = ref.abs().max().item()
        assert (g.double() - ref).abs().max().item() <= 0.02 * scale


GLUON_SHAPES = [
    # (batch, heads, kv_heads, q_len, kv_len, head_dim, alignment; None: not causal)
    (2, 4, 4, 1000, 1000, 128, "top_left"),      # a ragged last key block (1000 = 7 x 128 + 104)
    (2, 4, 2, 1000, 700, 128, None),             # not causal, GQA, fewer keys than queries
    (1, 8, 2, 700, 1500, 128, "bottom_right"),   # GQA, more keys than queries, ragged both
    (1, 4, 4, 1500, 300, 128, "bottom_right"),   # rows that see no key
    (1, 2, 2, 64, 64, 128, "top_left"),          # one block, half a key block
    (2, 3, 3, 700, 1500, 128, None),             # not causal, more keys than queries
]


@pytest.mark.cuda
@pytest.mark.skipif(not on_hopper(), reason="the Gluon backward kernels run on sm_90 only")
@pytest.mark.parametrize("shape", GLUON_SHAPES)
def test_gpu_gluon_backward(shape):
    # The Gluon dK/dV and dQ kernels (attention_bwd_hopper.py) take contiguous head_dim-128 calls
    # on sm_90 (and head_dim 64 ones from MIN_QUERIES queries on); Delta stays on the Triton
    # preprocess
    batch, heads, kv_heads, q_len, kv_len, head_dim, alignment = shape
    q, k, v = make_qkv(batch, heads, kv_heads, q_len, kv_len, head_dim, torch.bfloat16, "cuda")
    hopper = attention_bwd._hopper()
    assert hopper is not None and hopper.supports(q, k, v, q, q, k, v)
    if alignment is None:
        check_grads(q, k, v, 4e-3, causal=False)
    else:
        check_grads(q, k, v, 4e-3, causal_alignment=alignment)


def _gluon_grads(hopper, q, k, v, floor, alignment, deterministic, monkeypatch, layout="bhsd",
                 **call):
    """check_grads of the op with `deterministic` (alignment None: not causal) and `call`'s
    arguments (window, softcap, scale), recording each Gluon dK/dV launch as whether it added dQ
    too (the fused kernel); returns the records. The launch cache is emptied around it: a
    backward an earlier test remembered would skip the recording patch."""
    from attnscope.kernels import launch
    calls, dkdv = [], hopper.attention_bwd_dkdv_hopper
    monkeypatch.setattr(hopper, "attention_bwd_dkdv_hopper", lambda *a, **kw: (
        calls.append(kw.get("dq_acc") is not None), dkdv(*a, **kw))[1])
    kwargs = dict(causal=False) if alignment is None else dict(causal_alignment=alignment)
    kwargs.update(call)
    if layout != "bhsd":
        kwargs["layout"] = layout
    launch.forget_launches()
    try:
        check_grads(q, k, v, floor, op_kwargs=dict(deterministic=deterministic), **kwargs)
    finally:
        launch.forget_launches()
    return calls


@pytest.mark.cuda
@pytest.mark.skipif(not on_hopper(), reason="the Gluon backward kernels run on sm_90 only")
@pytest.mark.parametrize("shape", GLUON_SHAPES)
@pytest.mark.parametrize("dtype,floor", GPU_DTYPES)
def test_gpu_gluon_backward_nondeterministic(shape, dtype, floor, monkeypatch):
    # deterministic=False: without GQA the dK/dV kernel adds dQ too, in any order
    # (attention_bwd.fused_dq); under GQA the split kernels run as with True
    batch, heads, kv_heads, q_len, kv_len, head_dim, alignment = shape
    q, k, v = make_qkv(batch, heads, kv_heads, q_len, kv_len, head_dim, dtype, "cuda")
    hopper = attention_bwd._hopper()
    assert hopper is not None and hopper.supports(q, k, v, q, q, k, v)
    fused = _gluon_grads(hopper, q, k, v, floor, alignment, False, monkeypatch)
    assert fused == [heads == kv_heads]


GLUON_SHAPES_64 = [
    # head_dim 64 streams 128-row query blocks: ragged ones, GQA, both alignments
    (2, 3, 3, 333, 333, 64, "bottom_right"),
    (1, 8, 2, 700, 1500, 64, "top_left"),
    (2, 4, 4, 500, 300, 64, None),
    (1, 4, 4, 1500, 300, 64, "bottom_right"),    # rows that see no key
    (1, 2, 2, 2100, 2100, 64, "bottom_right"),   # from MIN_QUERIES on
]


@pytest.mark.cuda
@pytest.mark.skipif(not on_hopper(), reason="the Gluon backward kernels run on sm_90 only")
@pytest.mark.parametrize("shape", GLUON_SHAPES_64)
@pytest.mark.parametrize("deterministic", [True, False])
def test_gpu_gluon_backward_head_dim_64(shape, deterministic, monkeypatch):
    # head_dim 64 takes the Gluon pair from MIN_QUERIES queries on; the test lowers the bound
    # so that short, ragged calls take it too. deterministic=False runs the split kernels here
    # (the fused dQ takes 64-row query blocks)
    batch, heads, kv_heads, q_len, kv_len, head_dim, alignment = shape
    q, k, v = make_qkv(batch, heads, kv_heads, q_len, kv_len, head_dim, torch.bfloat16, "cuda")
    hopper = attention_bwd._hopper()
    assert hopper is not None
    if q_len < hopper.MIN_QUERIES[64]:
        assert not hopper.supports(q, k, v, q, q, k, v)
        monkeypatch.setattr(hopper, "MIN_QUERIES", {})
    assert hopper.supports(q, k, v, q, q, k, v)
    calls = _gluon_grads(hopper, q, k, v, 4e-3, alignment, deterministic, monkeypatch)
    assert calls == [False]


GLUON_BSHD_SHAPES = [
    # (batch, heads, kv_heads, q_len, kv_len, head_dim, alignment; None: not causal), bshd views
    (2, 4, 4, 1000, 1000, 128, "top_left"),
    (1, 8, 2, 700, 1500, 128, "bottom_right"),   # GQA, more keys than queries
    (2, 3, 3, 500, 300, 128, None),
    (1, 4, 2, 333, 333, 64, "bottom_right"),     # head_dim 64 (MIN_QUERIES lowered), GQA
]


@pytest.mark.cuda
@pytest.mark.skipif(not on_hopper(), reason="the Gluon backward kernels run on sm_90 only")
@pytest.mark.parametrize("shape", GLUON_BSHD_SHAPES)
@pytest.mark.parametrize("deterministic", [True, False])
def test_gpu_gluon_backward_bshd_views(shape, deterministic, monkeypatch):
    # layout="bshd" (the transformers backend's): the op's bhsd views of the inputs, and the
    # gradients it allocates so, are not contiguous; the Gluon kernels read and write them at
    # their strides (STRIDED)
    batch, heads, kv_heads, q_len, kv_len, head_dim, alignment = shape
    q, k, v = make_qkv(batch, heads, kv_heads, q_len, kv_len, head_dim, torch.bfloat16, "cuda",
                       "bshd")
    hopper = attention_bwd._hopper()
    assert hopper is not None
    monkeypatch.setattr(hopper, "MIN_QUERIES", {})
    views = [t.transpose(1, 2) for t in (q, k, v)]
    assert not views[0].is_contiguous() and hopper.supports(*views, views[0], *views)
    calls = _gluon_grads(hopper, q, k, v, 4e-3, alignment, deterministic, monkeypatch,
                         layout="bshd")
    assert calls == [not deterministic and heads == kv_heads and hopper.fuses_dq(head_dim)]


GLUON_PADDED_CASES = [
    # (batch, heads, kv_heads, q_len, kv_len, head_dim, alignment (None: not causal), layout,
    # window, softcap): head dims on head_dim 128's tiles (TILE)
    (2, 4, 4, 1000, 1000, 96, "top_left", "bhsd", (-1, -1), 0.0),   # a ragged last key block
    (1, 8, 2, 700, 1500, 80, "bottom_right", "bhsd", (-1, -1), 0.0),  # GQA, more keys
    (1, 4, 4, 1500, 300, 112, "bottom_right", "bhsd", (-1, -1), 0.0),  # rows that see no key
    (2, 3, 3, 700, 1500, 96, None, "bhsd", (-1, -1), 0.0),  # not causal
    (1, 4, 2, 600, 700, 80, "bottom_right", "bshd", (-1, -1), 0.0),  # views at their strides
    (1, 4, 2, 1000, 1200, 96, "bottom_right", "bhsd", (300, -1), 30.0),  # window and softcap
    (1, 2, 2, 700, 700, 112, "top_left", "bshd", (127, -1), 0.0),  # bshd and a window
    (1, 4, 2, 500, 900, 96, "bottom_right", "padded_rows", (-1, -1), 0.0),  # rows 64 wider
]


@pytest.mark.cuda
@pytest.mark.skipif(not on_hopper(), reason="the Gluon backward kernels run on sm_90 only")
@pytest.mark.parametrize("case", GLUON_PADDED_CASES)
@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("dtype,floor", GPU_DTYPES)
def test_gpu_gluon_backward_padded_head_dims(case, deterministic, dtype, floor, monkeypatch):
    # head_dim 80, 96 and 112 on head_dim 128's tiles: the copy engine reads zeros past a
    # head's columns (the next row's first ones in a contiguous tensor, a padded row's padding,
    # here NaN) and drops those columns of dQ, dK and dV; deterministic=False runs the split
    # kernels (the fused dQ takes 128)
    batch, heads, kv_heads, q_len, kv_len, head_dim, alignment, layout, window, softcap = case
    if layout == "padded_rows":  # q, k, v: the first head_dim columns of rows 64 wider
        q, k, v = (t.index_fill(-1, torch.arange(head_dim, head_dim + 64, device="cuda"),
                                float("nan"))[..., :head_dim]
                   for t in make_qkv(batch, heads, kv_heads, q_len, kv_len, head_dim + 64,
                                     dtype, "cuda"))
        layout = "bhsd"
    else:
        q, k, v = make_qkv(batch, heads, kv_heads, q_len, kv_len, head_dim, dtype, "cuda",
                           layout)
    hopper = attention_bwd._hopper()
    assert hopper is not None and hopper.TILE[head_dim] == 128
    views = [t.transpose(1, 2) for t in (q, k, v)] if layout == "bshd" else [q, k, v]
    assert hopper.supports(*views, views[0], *views, window, softcap)
    calls = _gluon_grads(hopper, q, k, v, floor, alignment, deterministic, monkeypatch,
                         layout=layout, window=window, softcap=softcap)
    assert calls == [False]


GLUON_WINDOW_CASES = [
    # (batch, heads, kv_heads, q_len, kv_len, causal, alignment, window, softcap, scale (None:
    # head_dim ** -0.5)). The dK/dV programs own 128 keys (64 a consumer) and
    # stream 64- or 128-row query blocks; the dQ programs own 128 rows (64 a consumer) and
    # stream 64- or 128-key blocks. Left edges inside a block, on a consumer's edge (63, 64)
    # and a program's (127, 128); narrower than a consumer (no block every row sees whole), of
    # one key, wider than the keys; query and key blocks wholly outside the window skipped;
    # GQA; rows that see no key; a two-sided window, a left and a right edge alone on
    # non-causal calls; softcaps that saturate (scale 1.0) and that do not, alone, with a
    # window and non-causal
    (1, 4, 2, 1000, 1000, True, "top_left", (300, -1), 0.0, None),
    (1, 2, 2, 700, 700, True, "top_left", (63, -1), 0.0, None),
    (1, 2, 2, 700, 700, True, "top_left", (64, -1), 0.0, None),
    (1, 2, 2, 700, 700, True, "top_left", (127, -1), 0.0, None),
    (1, 2, 2, 700, 900, True, "bottom_right", (128, -1), 0.0, None),
    (2, 2, 2, 500, 500, True, "top_left", (37, -1), 0.0, None),
    (1, 2, 2, 333, 333, True, "top_left", (0, -1), 0.0, None),
    (1, 2, 2, 300, 300, True, "top_left", (5000, -1), 0.0, None),
    (1, 2, 2, 1500, 300, True, "bottom_right", (200, -1), 0.0, None),
    (1, 2, 1, 640, 300, False, "top_left", (100, 50), 0.0, None),
    (1, 2, 2, 333, 1000, False, "bottom_right", (-1, 77), 0.0, None),
    (1, 2, 2, 500, 800, False, "top_left", (200, -1), 0.0, None),
    (1, 2, 2, 500, 800, False, "bottom_right", (200, -1), 0.0, None),
    (1, 2, 2, 900, 400, False, "bottom_right", (100, 20), 0.0, None),
    (1, 4, 4, 1000, 1000, True, "top_left", (-1, -1), 5.0, 1.0),
    (1, 2, 2, 300, 1000, False, "top_left", (-1, -1), 30.0, None),
    (1, 4, 2, 1000, 1200, True, "bottom_right", (400, -1), 5.0, 1.0),
    (2, 4, 4, 2048, 2048, True, "top_left", (700, -1), 50.0, None),
]


@pytest.mark.cuda
@pytest.mark.skipif(not on_hopper(), reason="the Gluon backward kernels run on sm_90 only")
@pytest.mark.parametrize("shape", GLUON_WINDOW_CASES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("deterministic", [True, False])
def test_gpu_gluon_backward_window_and_softcap(shape, head_dim, deterministic, monkeypatch):
    # The Gluon dK/dV and dQ kernels take sliding windows and softcaps (head_dim 64 at any
    # length here: MIN_QUERIES lowered); deterministic=False adds dQ in the dK/dV kernel where
    # fused_dq says so (head_dim 128, no GQA)
    batch, heads, kv_heads, q_len, kv_len, causal, alignment, window, softcap, scale = shape
    q, k, v = make_qkv(batch, heads, kv_heads, q_len, kv_len, head_dim, torch.bfloat16, "cuda")
    hopper = attention_bwd._hopper()
    assert hopper is not None
    monkeypatch.setattr(hopper, "MIN_QUERIES", {})
    assert hopper.supports(q, k, v, q, q, k, v, window, softcap)
    calls = _gluon_grads(hopper, q, k, v, 4e-3, alignment if causal else None, deterministic,
                         monkeypatch, causal_alignment=alignment, window=window,
                         softcap=softcap, scale=scale)
    assert calls == [not deterministic and heads == kv_heads and hopper.fuses_dq(head_dim)]


@pytest.mark.cuda
@pytest.mark.skipif(not on_hopper(), reason="the Gluon backward kernels run on sm_90 only")
@pytest.mark.parametrize("window,softcap", [((100, -1), 0.0), ((100, -1), 30.0)])
@pytest.mark.parametrize("kv_heads,deterministic", [(2, True), (4, False)])
def test_gpu_gluon_backward_window_and_softcap_fp16_bshd(window, softcap, kv_heads,
                                                         deterministic, monkeypatch):
    # fp16, and bshd views read and written at their strides: with GQA, and without it in the
    # dK/dV kernel that adds dQ (deterministic=False)
    q, k, v = make_qkv(1, 4, kv_heads, 600, 700, 128, torch.float16, "cuda", "bshd")
    hopper = attention_bwd._hopper()
    assert hopper is not None
    calls = _gluon_grads(hopper, q, k, v, 1e-3, "bottom_right", deterministic, monkeypatch,
                         layout="bshd", window=window, softcap=softcap)
    assert calls == [not deterministic]


@pytest.mark.cuda
@pytest.mark.skipif(not on_hopper(), reason="the Gluon backward kernels run on sm_90 only")
def test_gpu_gluon_fused_dq_ignores_keys_past_the_end(monkeypatch):
    # Every score -20 over 1000 keys (a ragged last block): LSE ~ -13, so a key past the end (K's
    # zero rows, score 0) has P ~ e^13, over fp16's range; the dK/dV kernel that adds dQ must
    # mask those keys, or their dS (inf in fp16) times K's zero rows is NaN in dQ
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (1, 2, 1000, 128)
    q = torch.full(shape, -20 / 128 ** 0.5, device="cuda", dtype=torch.float16)
    k = torch.ones(shape, device="cuda", dtype=torch.float16)
    v = torch.randn(shape, device="cuda", dtype=torch.float16, generator=gen)
    hopper = attention_bwd._hopper()
    assert hopper is not None and hopper.supports(q, k, v, q, q, k, v)
    calls = _gluon_grads(hopper, q, k, v, 1e-3, None, False, monkeypatch)
    assert calls == [True]


def test_the_dkdv_kernel_streams_64_row_blocks_under_a_softcap():
    # Its tanh tile next to S^T and dP^T: 128-row blocks spilled at head_dim 64 (dkdv_config)
    hopper = pytest.importorskip("attnscope.kernels.attention_bwd_hopper")
    assert hopper.dkdv_config(64) == hopper.CONFIGS[64] and hopper.CONFIGS[64][2] == 128
    assert hopper.dkdv_config(64, 30.0)[2] == 64
    assert hopper.dkdv_config(128, 30.0) == hopper.CONFIGS[128]


def test_gluon_backward_runs_80_96_112_on_128_column_tiles(monkeypatch):
    # The launches on CPU tensors (kernels recorded, not run; an H200's properties): the tiles'
    # columns (HEAD_DIM) from TILE, the tensors' own (COLS) as given, and head_dim 128's
    # configs and buffers; the fused dQ stays at 128 exactly
    import types
    hopper = pytest.importorskip("attnscope.kernels.attention_bwd_hopper")
    h200 = types.SimpleNamespace(major=9, multi_processor_count=132, L2_cache_size=50 << 20)
    monkeypatch.setattr(common, "device_properties", lambda device: h200)
    seen = []

    def record(key, grid, args, kwargs, **kw):
        seen.append((kwargs["HEAD_DIM"], kwargs["COLS"], kw["config"]))
    monkeypatch.setattr(hopper, "_launch", record)
    monkeypatch.setattr(hopper, "_launch_dq", record)
    for head_dim in (64, 80, 96, 112, 128):
        q = torch.empty(1, 2, 300, head_dim, dtype=torch.bfloat16)
        lse = torch.empty(1, 2, 300)
        kw = dict(causal=True, scale=0.1, causal_offset=0)
        hopper.attention_bwd_dkdv_hopper(q, q, q, q, q, q, lse, lse, **kw)
        hopper.attention_bwd_dq_hopper(q, q, q, q, q, lse, lse, **kw)
        tile = 64 if head_dim == 64 else 128
        assert hopper.TILE[head_dim] == tile
        assert seen[-2][:2] == seen[-1][:2] == (tile, head_dim)
        stages, regs, block_m = hopper.CONFIGS[tile]
        assert seen[-2][2]["BLOCK_M"] == block_m and seen[-1][2]["BLOCK_N"] == \
            hopper.DQ_CONFIGS[tile][0]
        assert hopper.fuses_dq(head_dim) == (head_dim == 128)
    assert 72 not in hopper.TILE and 192 not in hopper.TILE  # the Triton kernels' calls
    # the products' column chains: one group over a whole tile, two or three at 80, 96, 112;
    # another head_dim put into TILE is refused when the kernels compile, not run short
    assert [hopper._chunks(c, t) for c, t in ((64, 64), (128, 128), (80, 128), (96, 128),
                                              (112, 128))] == [1, 1, 2, 2, 3]
    assert [(hopper._first_width(c, 128), hopper._rest_width(c, 128))
            for c in (80, 96, 112, 128)] == [(64, 16), (64, 32), (128, 0), (128, 0)]
    for cols in (72, 88, 104, 120):
        with pytest.raises(ValueError, match="80, 96 or 112"):
            hopper._chunks(cols, 128)


def test_gluon_backward_views_strided_tensors_in_four_dimensions():
    # _strides on the CPU: contiguous calls keep the 3-D views (STRIDED off); a call with any
    # tensor that is not contiguous views every tensor at its batch, head and row strides
    hopper = pytest.importorskip("attnscope.kernels.attention_bwd_hopper")
    bhsd = torch.empty(2, 4, 300, 128, dtype=torch.float16, device="meta")
    bshd = torch.empty(2, 300, 4, 128, dtype=torch.float16, device="meta").transpose(1, 2)
    assert hopper._strides(bhsd, bhsd) == (False, (4 * 300 * 128, 300 * 128, 128) * 2)
    assert hopper._strides(bhsd, bshd) == (True, (4 * 300 * 128, 300 * 128, 128,
                                                  300 * 4 * 128, 128, 4 * 128))


@pytest.mark.cuda
@pytest.mark.skipif(not on_hopper(), reason="the Gluon backward kernels run on sm_90 only")
def test_gpu_gluon_backward_takes_each_calls_scale_window_and_softcap():
    # A repeat of a launch passes only its tensors: the scale, the window and the softcap must
    # be part of what tells launches apart, and a repeat of an earlier call must match it again
    q, k, v = make_qkv(1, 4, 4, 600, 600, 128, torch.bfloat16, "cuda")
    hopper = attention_bwd._hopper()
    assert hopper is not None and hopper.supports(q, k, v, q, q, k, v)
    for call in (dict(scale=0.05), dict(scale=0.2), dict(window=(100, -1)),
                 dict(window=(200, -1)), dict(softcap=30.0), dict(softcap=50.0),
                 dict(window=(100, -1), softcap=30.0), dict(window=(100, -1))):
        check_grads(q, k, v, 4e-3, **call)


def test_nondeterministic_backward_elsewhere_is_the_deterministic_one():
    # deterministic=False changes only the calls attention_bwd.fused_dq takes (sm_90 Gluon, no
    # GQA): on the CPU the gradients are the deterministic kernels', bit for bit
    q, k, v = make_qkv(1, 2, 2, 70, 70, 32, torch.float32, CPU)
    dout = torch.randn_like(q)
    grads = [_grads(lambda *t: fused_attention(*t, deterministic=flag), q, k, v, dout)
             for flag in (True, False)]
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("bad", [None, 0, "no"])
def test_deterministic_takes_a_bool(bad):
    q, k, v = make_qkv(1, 2, 2, 8, 8, 16, torch.float32, CPU)
    with pytest.raises(TypeError, match="deterministic"):
        fused_attention(q, k, v, deterministic=bad)


def test_fused_dq_takes_calls_without_gqa_where_the_copy_engine_adds():
    import types
    fuses = lambda head_dim: head_dim == 128  # noqa: E731
    adds = types.SimpleNamespace(tma_add=object(), fuses_dq=fuses)
    none = types.SimpleNamespace(tma_add=None, fuses_dq=fuses)
    assert attention_bwd.fused_dq(adds, 8, 8, 128)
    assert not attention_bwd.fused_dq(adds, 8, 8, 64)  # not a head_dim the fused kernel takes
    assert not attention_bwd.fused_dq(adds, 8, 2, 128)  # GQA: its consumers spill, the split won
    assert not attention_bwd.fused_dq(none, 8, 8, 128)  # a Triton whose Gluon cannot add
    torch.use_deterministic_algorithms(True)  # PyTorch's global setting wins
    try:
        assert not attention_bwd.fused_dq(adds, 8, 8, 128)
    finally:
        torch.use_deterministic_algorithms(False)


def test_the_fused_dq_kernel_takes_head_dim_128_in_64_row_blocks(monkeypatch):
    # Each consumer adds 64 of the head's columns: 128 and only there, and only in 64-row query
    # blocks (the kernel asserts the same; its launch refuses the rest)
    hopper = pytest.importorskip("attnscope.kernels.attention_bwd_hopper")
    assert hopper.fuses_dq(128) and not hopper.fuses_dq(64)
    monkeypatch.setitem(hopper.CONFIGS, 64, (2, 240, 64))  # 64-row blocks: still 64 columns
    assert not hopper.fuses_dq(64)
    monkeypatch.setitem(hopper.CONFIGS, 128, (2, 240, 128))
    assert not hopper.fuses_dq(128)


def test_gluon_backward_takes_no_cpu_call_and_groups_heads_for_l2(monkeypatch):
    # The Gluon kernels never take CPU tensors; their tile order groups heads so that what the
    # programs running at once stream fits in half of L2, in groups of equal size
    import types
    hopper = pytest.importorskip("attnscope.kernels.attention_bwd_hopper")
    q, k, v = make_qkv(1, 2, 2, 64, 64, 128, torch.float16, CPU)  # a head_dim it takes
    assert not hopper.supports(q, k, v, q, q, k, v)
    h200 = types.SimpleNamespace(major=9, multi_processor_count=132, L2_cache_size=50 << 20)
    monkeypatch.setattr(common, "device_properties", lambda device: h200)
    assert hopper.l2_group(q.device, 128, 2 << 20) == 12  # 25 MB / 2 MB: 12 a group, 11 groups
    assert hopper.l2_group(q.device, 8, 64 << 20) == 1  # more than half of L2 each: one at a time
    assert hopper.l2_group(q.device, 8, 1 << 10) == 8  # all together


@pytest.mark.cuda
@pytest.mark.skipif(not on_hopper(), reason="the Gluon backward kernels run on sm_90 only")
def test_gpu_gluon_backward_in_small_head_groups(monkeypatch):
    # Heads in groups of 3 (8 query heads, 4 K/V heads: a smaller last group in both kernels'
    # tile orders), as long sequences get where one head's streamed tensors fill L2
    hopper = attention_bwd._hopper()
    q, k, v = make_qkv(1, 8, 4, 600, 600, 128, torch.bfloat16, "cuda")
    assert hopper is not None and hopper.supports(q, k, v, q, q, k, v)
    monkeypatch.setattr(hopper, "l2_group", lambda device, pairs, streamed, **kw: 3)
    check_grads(q, k, v, 4e-3)
