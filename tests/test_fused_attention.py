"""fused_attention (the public op's forward) against the float64 reference, through the
Triton interpreter on CPU in fp16 and fp32 (its bf16 dot is wrong); the `cuda` tests repeat the
grid in bf16 and fp16 at realistic sizes. The tolerance rule is fused_checks.py's. Tests of one
kernel's configs are in test_attention_fwd.py (Triton) and test_attention_fwd_hopper.py (Gluon);
the launch cache in test_launch.py.
"""

import math

import pytest
import torch
from einops import rearrange

from attnscope import fused_attention
from attnscope.attention import fused
from attnscope.attention.reference import attention_reference
# nan_outputs: autouse, poisons every buffer the op allocates
from fused_checks import CPU, CPU_DTYPES, GPU_DTYPES, check, make_qkv, nan_outputs  # noqa: F401


# ---- CPU (Triton interpreter) ---------------------------------------------------------------

@pytest.mark.parametrize("dtype,floor,lse_tol", CPU_DTYPES)
@pytest.mark.parametrize("seq,head_dim", [
    (1, 16),     # a single query and key: one masked diagonal block, nothing else
    (17, 48),    # ragged: neither length nor head_dim a power of two
    (113, 80),   # odd length over several blocks; head_dim 80 pads to 128
    (128, 128),  # exact multiple of every block size: no ragged tail at all
    (1000, 64),  # long enough for many unmasked blocks left of the diagonal
])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_causal_shapes(seq, head_dim, layout, dtype, floor, lse_tol):
    heads = 1 if seq >= 1000 else 2  # the interpreter's time grows with seq^2 * heads
    q, k, v = make_qkv(1, heads, heads, seq, seq, head_dim, dtype, CPU, layout)
    check(q, k, v, floor, lse_tol, layout=layout)


@pytest.mark.parametrize("dtype,floor,lse_tol", CPU_DTYPES)
@pytest.mark.parametrize("q_len,kv_len", [
    (17, 70),   # decoding-like: fewer queries than keys
    (70, 17),   # more queries than keys: bottom-right leaves the first 53 rows with no key
    (1, 100),   # one query against a cache
    (100, 1),   # one key: top-left still gives every row key 0
])
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_unequal_lengths(q_len, kv_len, alignment, dtype, floor, lse_tol):
    q, k, v = make_qkv(2, 2, 2, q_len, kv_len, 64, dtype, CPU)
    check(q, k, v, floor, lse_tol, causal_alignment=alignment)


@pytest.mark.parametrize("dtype,floor,lse_tol", CPU_DTYPES)
def test_fully_masked_rows_are_zero(dtype, floor, lse_tol):
    q, k, v = make_qkv(1, 2, 2, 40, 9, 32, dtype, CPU)
    out, lse = check(q, k, v, floor, lse_tol, causal_alignment="bottom_right")
    assert torch.equal(out[:, :, :31], torch.zeros_like(out[:, :, :31]))
    assert torch.isneginf(lse[:, :, :31]).all() and torch.isfinite(lse[:, :, 31:]).all()


@pytest.mark.parametrize("dtype,floor,lse_tol", CPU_DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 1)])  # GQA, and MQA with 6 q heads
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_gqa(heads, kv_heads, layout, dtype, floor, lse_tol):
    q, k, v = make_qkv(2, heads, kv_heads, 50, 50, 32, dtype, CPU, layout)
    check(q, k, v, floor, lse_tol, layout=layout)


@pytest.mark.parametrize("dtype,floor,lse_tol", CPU_DTYPES)
@pytest.mark.parametrize("q_len,kv_len", [(77, 77), (30, 90)])
def test_non_causal(q_len, kv_len, dtype, floor, lse_tol):
    q, k, v = make_qkv(1, 2, 1, q_len, kv_len, 48, dtype, CPU)
    check(q, k, v, floor, lse_tol, causal=False)


@pytest.mark.parametrize("dtype,floor,lse_tol", CPU_DTYPES)
@pytest.mark.parametrize("scale", [0.05, 1.0])
def test_custom_scale(scale, dtype, floor, lse_tol):
    q, k, v = make_qkv(1, 2, 2, 33, 33, 64, dtype, CPU)
    check(q, k, v, floor, lse_tol, scale=scale)


@pytest.mark.parametrize("dtype,floor,lse_tol", CPU_DTYPES)
def test_non_contiguous_inputs(dtype, floor, lse_tol):
    # q: a head_dim slice of a wider tensor (row stride 96, not 64); k: stored seq-major and
    # transposed to bhsd; v: every other batch entry of a larger tensor.
    q = torch.randn(2, 3, 45, 96, dtype=dtype)[..., 16:80]
    k = rearrange(torch.randn(2, 45, 3, 64, dtype=dtype), "b s h d -> b h s d")
    v = torch.randn(4, 3, 45, 64, dtype=dtype)[::2]
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    check(q, k, v, floor, lse_tol)


def test_lse_is_natural_log_of_the_softmax_denominator():
    q, k, v = make_qkv(1, 1, 1, 5, 5, 16, torch.float32, CPU)
    _, lse = fused_attention(q, k, v, return_lse=True)
    scores = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(16)
    expected = torch.log(torch.exp(scores[0, 0, 4]).sum())  # the last row sees every key
    assert abs(lse[0, 0, 4].item() - expected.item()) < 1e-5


def test_returns_output_only_by_default_and_keeps_layout():
    q, k, v = make_qkv(2, 3, 3, 9, 9, 16, torch.float32, CPU, "bshd")
    out = fused_attention(q, k, v, layout="bshd")
    assert isinstance(out, torch.Tensor) and out.shape == (2, 9, 3, 16)


def test_torch_compile_fullgraph_traces_the_op():
    q, k, v = make_qkv(1, 2, 2, 20, 20, 32, torch.float32, CPU)

    @torch.compile(fullgraph=True, backend="eager")  # dynamo tracing; inductor is GPU-tested
    def layer(q, k, v):
        return fused_attention(q * 2, k, v).sum(-1)

    expected = attention_reference(q * 2, k, v).sum(-1)
    torch.testing.assert_close(layer(q, k, v).double(), expected, atol=1e-4, rtol=0)


def test_torch_compile_fullgraph_takes_a_scale_and_softcap_that_change():
    # dynamo makes a float argument symbolic on its second value; the checks must trace it
    q, k, v = make_qkv(1, 2, 2, 20, 20, 32, torch.float32, CPU)
    layer = torch.compile(lambda q, s, c: fused_attention(q, k, v, scale=s, softcap=c),
                          fullgraph=True, backend="eager")
    for scale, softcap in ((0.5, 2.0), (0.7, 3.0)):
        expected = attention_reference(q, k, v, scale=scale, softcap=softcap)
        torch.testing.assert_close(layer(q, scale, softcap).double(), expected, atol=1e-4,
                                   rtol=0)


def test_eager_fast_path_matches_the_custom_op():
    # Inference calls the op's body directly; it must be the same computation as the op.
    q, k, v = make_qkv(1, 2, 1, 37, 37, 48, torch.float32, CPU)
    direct = fused_attention(q, k, v, return_lse=True)
    via_op = fused._attention_fwd(q, k, v, True, 48 ** -0.5, False, "bhsd")
    assert all(torch.equal(a, b) for a, b in zip(direct, via_op))


def test_aot_compile_of_the_interpreter_is_refused_not_wrong():
    q, k, v = make_qkv(1, 1, 1, 8, 8, 16, torch.float32, CPU)
    torch._dynamo.reset()
    layer = torch.compile(lambda q, k, v: fused_attention(q, k, v), fullgraph=True,
                          backend="aot_eager")
    with pytest.raises(Exception, match="cannot trace kernels running in the Triton interpreter"):
        layer(q, k, v)


# ---- bad input ------------------------------------------------------------------------------

def qkv32(**shapes):
    q, k, v = make_qkv(1, 2, 2, 8, 8, 16, torch.float32, CPU)
    return {"q": q, "k": k, "v": v, **shapes}


@pytest.mark.parametrize("args,kwargs,error,match", [
    (qkv32(q=[[1.0]]), {}, TypeError, "q must be a torch.Tensor, got list"),
    (qkv32(q=torch.randn(2, 8, 16)), {}, ValueError, r"q must be 4-D \[batch, heads, seq, "
                                                     r"head_dim\].*got shape \(2, 8, 16\)"),
    (qkv32(k=torch.randn(1, 2, 8, 16, dtype=torch.float16)), {}, TypeError,
     "share one dtype, got torch.float32, torch.float16"),
    (qkv32(q=torch.randn(1, 2, 8, 16, dtype=torch.float64),
           k=torch.randn(1, 2, 8, 16, dtype=torch.float64),
           v=torch.randn(1, 2, 8, 16, dtype=torch.float64)), {}, TypeError,
     "float16, bfloat16 or float32, got torch.float64"),
    (qkv32(k=torch.randn(1, 2, 9, 16), v=torch.randn(1, 2, 8, 16)), {}, ValueError,
     r"k and v must have the same shape, got \(1, 2, 9, 16\) and \(1, 2, 8, 16\)"),
    (qkv32(k=torch.randn(2, 2, 8, 16), v=torch.randn(2, 2, 8, 16)), {}, ValueError,
     "same batch size, got 1 and 2"),
    (qkv32(k=torch.randn(1, 2, 8, 32), v=torch.randn(1, 2, 8, 32)), {}, ValueError,
     "same head_dim, got 16 and 32"),
    (qkv32(q=torch.randn(1, 3, 8, 16)), {}, ValueError,
     "multiple of k/v heads.*got 3 q heads and 2 k/v heads"),
    (qkv32(q=torch.randn(1, 2, 8, 8), k=torch.randn(1, 2, 8, 8), v=torch.randn(1, 2, 8, 8)), {},
     ValueError, "head_dim must be between 16 and 256, got 8"),
    (qkv32(q=torch.randn(1, 2, 8, 264), k=torch.randn(1, 2, 8, 264),
           v=torch.randn(1, 2, 8, 264)), {}, ValueError, "between 16 and 256, got 264"),
    (qkv32(q=torch.randn(1, 2, 0, 16)), {}, ValueError, "sequence lengths must be >= 1"),
    (qkv32(), {"layout": "sbhd"}, ValueError, "layout must be one of.*got 'sbhd'"),
    (qkv32(), {"layout": ["bhsd"]}, ValueError, "layout must be one of.*got \\['bhsd'\\]"),
    (qkv32(), {"window": torch.tensor([-1, -1])}, TypeError,
     "window must be a \\(left, right\\) pair of ints, got tensor"),
    (qkv32(), {"causal_alignment": "diagonal"}, ValueError,
     "causal_alignment must be one of.*got 'diagonal'"),
    (qkv32(), {"scale": float("nan")}, TypeError, "scale must be a finite float"),
    (qkv32(), {"scale": -0.25}, ValueError, "scale must be >= 0.*got -0.25"),
    (qkv32(), {"scale": 1e300}, ValueError, "scale must be >= 0 and at most 2.36e\\+38"),
    (qkv32(), {"softcap": 1e300}, ValueError, "softcap must be .* at most 2.36e\\+38"),
    (qkv32(), {"causal": 1}, TypeError, "causal must be a bool, got int"),
    (qkv32(q=torch.randn(1, 2, 8, 16).to_sparse()), {}, TypeError,
     "q must be a dense \\(strided\\) tensor, got layout torch.sparse_coo"),
    (qkv32(q=torch.randn(1, 2, 8, 16, device="meta")), {}, ValueError,
     "one device, got meta, cpu, cpu"),
])
def test_bad_input(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        fused_attention(args["q"], args["k"], args["v"], **kwargs)


def test_zero_scale_averages_the_visible_values():
    # scale 0: every visible key weighs the same (a negative scale is refused, above)
    q, k, v = make_qkv(1, 2, 2, 40, 40, 32, torch.float32, CPU)
    rows = torch.arange(1, 41, dtype=torch.float32).view(1, 1, 40, 1)
    torch.testing.assert_close(fused_attention(q, k, v, scale=0.0), v.cumsum(2) / rows,
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused_attention(q, k, v, scale=0, causal=False),
                               v.mean(2, keepdim=True).expand_as(v), atol=1e-5, rtol=1e-5)


def test_row_offsets_past_32_bits_are_refused_not_wrapped(monkeypatch):
    # The Triton kernels index a head's rows in 32 bits. A bshd view of a long sequence (row
    # stride heads x head_dim) can reach past that: a ValueError says so, and the same call
    # bhsd-contiguous (row stride head_dim) runs, backward too. (The bound lowered: 2^31
    # elements are too many for a CPU test.)
    from attnscope.kernels import common
    monkeypatch.setattr(common, "MAX_ROW_OFFSET", 1000)
    q, k, v = make_qkv(1, 2, 2, 40, 40, 16, torch.float32, CPU)  # bhsd: 39 x 16 + 15 = 639
    bshd = [t.transpose(1, 2).contiguous() for t in (q, k, v)]  # row stride 32: 1263
    with pytest.raises(ValueError, match="q's 40 rows reach 1263 elements past a head's first"):
        fused_attention(*bshd, layout="bshd")
    q.requires_grad_()
    out = fused_attention(q, k, v)
    torch.testing.assert_close(out, attention_reference(q.double(), k.double(), v.double()).float(),
                               atol=1e-5, rtol=1e-5)
    out.sum().backward()
    assert q.grad is not None and q.grad.isfinite().all()


def test_bf16_on_the_interpreter_is_refused_not_wrong():
    q, k, v = make_qkv(1, 1, 1, 8, 8, 16, torch.bfloat16, CPU)
    with pytest.raises(TypeError, match="bfloat16 is not supported on CPU"):
        fused_attention(q, k, v)


def test_bshd_shapes_are_named_in_errors():
    with pytest.raises(ValueError, match=r"\[batch, seq, heads, head_dim\] for layout='bshd'"):
        fused_attention(torch.randn(8, 2, 16), torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16),
                        layout="bshd")


def test_cpu_tensors_without_interpreter_are_refused(monkeypatch):
    monkeypatch.setattr(fused._kernels(), "interpreter_ready", lambda: False)
    q, k, v = make_qkv(1, 1, 1, 4, 4, 16, torch.float32, CPU)
    with pytest.raises(ValueError, match="CPU tensors but the Triton interpreter is off"):
        fused_attention(q, k, v)


# ---- GPU ------------------------------------------------------------------------------------

GPU_SHAPES = [
    # (batch, heads, kv_heads, q_len, kv_len, head_dim, alignment)
    (8, 16, 16, 1024, 1024, 64, "top_left"),     # the blog's seed shape
    (2, 8, 8, 1023, 1023, 96, "top_left"),       # ragged length, non-power-of-two head_dim
    (1, 4, 4, 4096, 4096, 128, "top_left"),      # long sequence
    (2, 16, 4, 2048, 2048, 128, "top_left"),     # GQA 4:1
    (2, 8, 1, 777, 777, 80, "top_left"),         # MQA, odd length and head_dim
    (1, 8, 8, 113, 2000, 64, "bottom_right"),    # chunked prefill against a KV cache
    (1, 8, 8, 2000, 113, 64, "bottom_right"),    # rows with no visible key
    (1, 8, 8, 300, 1500, 256, "top_left"),       # widest head_dim
    (3, 4, 4, 1, 4096, 48, "bottom_right"),      # single-token decoding
    (1, 4, 4, 2500, 2500, 64, "top_left"),       # past SHORT_SEQ: the long-sequence config
    (5, 4, 2, 201, 201, 64, "top_left"),         # FEW_KEYS at head_dim 64: 32-key blocks
    (2, 4, 4, 97, 250, 32, "bottom_right"),      # the same at head_dim 32, fewer queries
]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,floor,lse_tol", GPU_DTYPES)
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_gpu_grid(shape, layout, dtype, floor, lse_tol):
    batch, heads, kv_heads, q_len, kv_len, head_dim, alignment = shape
    q, k, v = make_qkv(batch, heads, kv_heads, q_len, kv_len, head_dim, dtype, "cuda", layout)
    check(q, k, v, floor, lse_tol, layout=layout, causal_alignment=alignment)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,floor,lse_tol", GPU_DTYPES)
def test_gpu_non_causal_and_non_contiguous(dtype, floor, lse_tol):
    q = torch.randn(2, 8, 1000, 160, dtype=dtype, device="cuda")[..., 16:144]
    k = rearrange(torch.randn(2, 1500, 8, 128, dtype=dtype, device="cuda"), "b s h d -> b h s d")
    v = torch.randn(4, 8, 1500, 128, dtype=dtype, device="cuda")[::2]
    check(q, k, v, floor, lse_tol, causal=False)
    check(q, k, v, floor, lse_tol, scale=0.3)


@pytest.mark.cuda
def test_gpu_fp32():
    q, k, v = make_qkv(2, 4, 4, 513, 513, 64, torch.float32, "cuda")
    check(q, k, v, 1e-5, 1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", [64, 256])  # 256: the tensor-descriptor (TMA) config
def test_gpu_torch_compile_fullgraph(head_dim):
    q, k, v = make_qkv(4, 8, 8, 512, 512, head_dim, torch.bfloat16, "cuda")

    @torch.compile(fullgraph=True)
    def layer(q, k, v):
        return fused_attention(q * 2, k, v).float().sum(-1)

    torch._dynamo.reset()
    expected = attention_reference(q * 2, k, v).sum(-1)
    torch.testing.assert_close(layer(q, k, v).double(), expected, atol=0.1, rtol=0.02)


def test_compiled_autograd_traces_the_backward_op():
    # Compiled autograd traces _EagerAttention's backward with dynamo: it must see the op (and
    # get the same gradients), not trace into the launch.
    import torch._dynamo.compiled_autograd as compiled_autograd
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, 2, 24, 24, 32, torch.float32, CPU))
    expected = torch.autograd.grad(fused_attention(q, k, v).sum(), (q, k, v))
    targets = []

    def backend(gm, example_inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm
    out = fused_attention(q, k, v)
    torch._dynamo.reset()
    with compiled_autograd._enable(torch.compile(backend=backend)):
        got = torch.autograd.grad(out.sum(), (q, k, v))
    torch._dynamo.reset()
    assert any("attention_bwd" in t for t in targets)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)


def test_launches_are_wrapped_only_when_traced():
    # wrap_triton only where torch.compile traces the op body (fake tensors or an active
    # dispatch mode); on real tensors the body launches directly.
    from torch._subclasses.fake_tensor import FakeTensorMode
    q = torch.randn(1, 1, 4, 16)
    assert fused._launch_wrap(q) is None
    with FakeTensorMode():
        assert fused._launch_wrap(torch.empty(1, 1, 4, 16)) is fused.wrap_triton
    assert fused._launch_wrap(FakeTensorMode().from_tensor(q)) is fused.wrap_triton  # no mode
    with torch.utils._python_dispatch.TorchDispatchMode():  # a mode, real tensor
        assert fused._launch_wrap(q) is fused.wrap_triton
    assert torch.func.grad(lambda x: x.sum() * float(fused._traced(x)))(q).eq(1).all()
    # the infra modes (proxy: make_fx, functionalization) count in the mode stack's length,
    # which is all _traced reads of them
    from torch._subclasses.functional_tensor import FunctionalTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    seen = []
    make_fx(lambda x: seen.append(fused._traced(x)) or x + 1)(q)
    with FunctionalTensorMode():
        seen.append(fused._traced(q))
    assert seen == [True, True]


def test_torch_func_gradients_are_refused_with_a_clear_error():
    # PyTorch cannot run the custom op's registered autograd under torch.func's grad or jvp
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    with pytest.raises(NotImplementedError, match="torch.autograd.grad"):
        torch.func.grad(lambda x: fused_attention(x, k, v).sum())(q)
    # a transform over other inputs runs: the attention is a constant there
    x = torch.randn(1, 2, 8, 16)
    grad = torch.func.grad(lambda x: (fused_attention(q, k, v) * x).sum())(x)
    torch.testing.assert_close(grad, fused_attention(q, k, v))


def test_forward_mode_ad_is_refused_not_a_zero_tangent():
    # The ops have no forward-mode formula: a tangent on an input would come out as zeros
    # (eager calls do not record one, traced ones drop it), so jvp, jacfwd and dual tensors
    # raise; a dual level with no dual input runs as before.
    import torch.autograd.forward_ad as fwAD
    from attnscope import fused_attention_varlen, fused_attention_with_kvcache
    torch.manual_seed(4)
    q, k, v, t = (torch.randn(1, 2, 8, 16) for _ in range(4))
    with pytest.raises(NotImplementedError, match="forward-mode"):
        torch.func.jvp(lambda x: fused_attention(q, k, x), (v,), (t,))
    with pytest.raises(NotImplementedError, match="forward-mode"):
        torch.func.jacfwd(lambda x: fused_attention(x, k, v).sum())(q)
    with fwAD.dual_level():
        with pytest.raises(NotImplementedError, match="forward-mode"):
            fused_attention(fwAD.make_dual(q, t), k, v)
        torch.testing.assert_close(fused_attention(q, k, v).double(), attention_reference(q, k, v),
                                   atol=1e-5, rtol=1e-5)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    packed = [x[0].transpose(0, 1) for x in (q, k, v, t)]  # [8, 2, 16]
    with pytest.raises(NotImplementedError, match="forward-mode"):
        torch.func.jvp(lambda x: fused_attention_varlen(x, *packed[1:3], cu, cu, 5, 5),
                       (packed[0],), (packed[3],))
    cache, tangent = k.transpose(1, 2), t.transpose(1, 2)  # [1, 8, 2, 16]
    with fwAD.dual_level(), pytest.raises(NotImplementedError, match="forward-mode"):
        fused_attention_with_kvcache(q[:, :, :1].transpose(1, 2),
                                     fwAD.make_dual(cache, tangent), cache, 8)


def test_dispatch_modes_see_one_op():
    # A dispatch mode (FlopCounterMode, a tracer) sees the call as the custom op, with its
    # result computed, not as loose allocations around an invisible kernel.
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))
    q, k, v = make_qkv(1, 2, 2, 24, 24, 16, torch.float32, CPU)
    expected = fused_attention(q, k, v)
    with Record() as record:
        out = fused_attention(q, k, v)
    assert record.ops == ["attnscope.attention_fwd.default"]
    torch.testing.assert_close(out, expected)


# ---- the registry entry's compiled kernels ---------------------------------------------------

def test_compiled_kernels_are_empty_in_the_interpreter():
    from attnscope.attention.registry import get
    fused_attention(*make_qkv(1, 1, 1, 8, 8, 16, torch.float32, CPU))
    assert get("fused").compiled_kernels() == []


def test_compiled_kernels_are_records_of_what_the_launches_kept(monkeypatch):
    # A stand-in for Triton's compiled kernel, noted as the launch cache notes a real one: the
    # record carries its stages, its metadata with registers and spills, its source and config.
    from collections import namedtuple

    from attnscope.attention.registry import CompiledKernel, get
    from attnscope.kernels import launch

    Metadata = namedtuple("KernelMetadata", "name num_warps shared")

    class Compiled:
        asm = {"ttir": "tt", "ttgir": "ttg", "llir": "ll", "ptx": "ptx", "cubin": b"elf",
               "json": "{}"}
        metadata = Metadata("_attn_fwd", 8, 49152)
        n_regs, n_spills = 168, 0

    monkeypatch.setattr(launch, "_launched", {})
    fused._kernels()
    older, newer = Compiled(), Compiled()
    launch._note("_attn_fwd", older, {"BLOCK_M": 128})
    launch._note("_attn_bwd_dq", Compiled(), None)  # a backward kernel: not listed
    launch._note("_attn_fwd_hopper", newer, {"BLOCK_N": 128})
    records = get("fused").compiled_kernels()
    assert [r.name for r in records] == ["_attn_fwd_hopper", "_attn_fwd"]  # most recent first
    hopper, triton_fwd = records
    assert isinstance(triton_fwd, CompiledKernel)
    assert triton_fwd.source_path == "attnscope/kernels/attention_fwd.py"
    assert "def _attn_fwd(" in triton_fwd.source
    assert hopper.source_path == "attnscope/kernels/attention_fwd_hopper.py"
    assert "def _attn_fwd_hopper(" in hopper.source
    assert triton_fwd.config == {"BLOCK_M": 128}
    assert set(triton_fwd.asm) == {"ttir", "ttgir", "llir", "ptx", "cubin"}
    assert triton_fwd.metadata == {"name": "_attn_fwd", "num_warps": 8, "shared": 49152,
                                   "n_regs": 168, "n_spills": 0}
    launch._note("_attn_fwd", older, {"BLOCK_M": 128})  # used again: first now
    assert [r.name for r in get("fused").compiled_kernels()] == ["_attn_fwd", "_attn_fwd_hopper"]


def test_outputs_are_plain_tensors_with_standard_strides():
    # The allocation hook's cheap paths (empty_like, new_empty) keep the outputs as torch.empty
    # made them: standard contiguous strides even where q's size-1 or empty dims carry others,
    # and plain tensors for a subclass input.
    from attnscope.attention import fused
    q = torch.randn(1, 5, 4, 16)[:, -1:]  # contiguous, strides (320, 64, 16, 1)
    assert fused._empty(q, q.shape, q.dtype).stride() == (64, 64, 16, 1)
    empty = torch.empty_strided((0, 2, 3, 4), (0, 1, 7, 3))
    assert fused._empty(empty, empty.shape, torch.float32).stride() == (24, 12, 4, 1)
    lse = fused._empty(q, (1, 1, 4), torch.float32)
    assert lse.dtype == torch.float32 and lse.stride() == (4, 4, 1)
    param = torch.nn.Parameter(torch.randn(2, 3))
    out = fused._empty(param, param.shape, param.dtype)
    assert type(out) is torch.Tensor and not out.requires_grad
