"""fused_attention against the float64 reference.

Tolerance rule (as FlashAttention's tests): the kernel's max abs error against float64 must be at
most twice the error of PyTorch's own attention computed in the same dtype (the eager reference
run in that dtype), plus a small absolute floor. Outputs are poisoned with NaN before the kernel
runs, so an element it fails to write fails the check. Inputs are fresh random normals.

CPU runs go through the Triton interpreter in fp16 and fp32 (its bf16 dot is wrong); the `cuda`
tests repeat the grid in bf16 and fp16 at realistic sizes.
"""

import math

import pytest
import torch
from einops import rearrange

from attnscope import fused_attention
from attnscope.attention import fused
from attnscope.attention.reference import attention_reference
from attnscope.kernels import attention_fwd as kernels

CPU = torch.device("cpu")
# (dtype, absolute error floor, LSE tolerance)
CPU_DTYPES = [(torch.float32, 1e-5, 1e-5), (torch.float16, 1e-3, 1e-3)]
GPU_DTYPES = [(torch.bfloat16, 4e-3, 1e-3), (torch.float16, 1e-3, 1e-3)]


@pytest.fixture(autouse=True)
def nan_outputs(monkeypatch):
    """Every output buffer the op allocates starts as NaN."""
    def poisoned(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    monkeypatch.setattr(fused, "_empty", poisoned)


def make_qkv(batch, heads, kv_heads, q_len, kv_len, head_dim, dtype, device, layout="bhsd"):
    def rand(h, s):
        shape = (batch, h, s, head_dim) if layout == "bhsd" else (batch, s, h, head_dim)
        return torch.randn(shape, dtype=dtype, device=device)
    return rand(heads, q_len), rand(kv_heads, kv_len), rand(kv_heads, kv_len)


def check(q, k, v, floor, lse_tol, **kwargs):
    """Run the op and assert the tolerance rule on the output and the LSE."""
    out, lse = fused_attention(q, k, v, return_lse=True, **kwargs)
    ref, ref_lse = attention_reference(q, k, v, return_lse=True, **kwargs)
    low = attention_reference(q, k, v, dtype=q.dtype, **kwargs)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == ref_lse.shape and lse.dtype == torch.float32
    assert not out.isnan().any(), "output has NaN (unwritten element or 0/0)"
    err = (out.double() - ref).abs().max().item()
    torch_err = (low.double() - ref).abs().max().item()
    assert err <= 2 * torch_err + floor, f"error {err:.3g} > 2 x torch's {torch_err:.3g} + {floor}"
    masked = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), masked), "LSE -inf exactly on rows that see no key"
    lse_err = (lse.double() - ref_lse)[~masked].abs().max().item() if (~masked).any() else 0.0
    assert lse_err <= lse_tol * max(1.0, ref_lse[~masked].abs().max().item())
    return out, lse


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


@pytest.mark.parametrize("pipeline", [False, True])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_tensor_descriptor_path(layout, pipeline):
    # K/V through tensor descriptors (the D=256 class's path on the GPU, pipelined there): ragged
    # length and a head_dim the descriptor's block pads, so the zero fill past both edges is
    # exercised.
    q, k, v = make_qkv(1, 2, 1, 45, 70, 48, torch.float16, CPU, layout)
    k4, v4 = (fused._as_bhsd(t, layout) for t in (k, v))
    assert kernels._tma_ok(k4) and kernels._tma_ok(v4)  # else the launch falls back to pointers
    with kernels.pinned_config(32, 16, 4, 1, pipeline=pipeline, use_tma=True):
        check(q, k, v, 1e-3, 1e-3, layout=layout, causal_alignment="bottom_right")


@pytest.mark.parametrize("causal,alignment,q_len,kv_len", [
    (True, "top_left", 45, 45), (True, "bottom_right", 70, 17), (True, "bottom_right", 17, 70),
    (False, "top_left", 33, 48),
])
@pytest.mark.parametrize("pipeline", [False, True])
def test_both_loop_schedules(pipeline, causal, alignment, q_len, kv_len):
    # The GPU table runs the software-pipelined loop (scores of the next K block issued before
    # this block's p @ V, last block peeled off) at head_dim 256 and the plain loop below; the
    # interpreter runs the pipelined one by default. Both on ragged, bottom-right and non-causal
    # tiles.
    q, k, v = make_qkv(1, 2, 2, q_len, kv_len, 24, torch.float16, CPU)
    with kernels.pinned_config(32, 16, 4, 1, pipeline=pipeline):
        check(q, k, v, 1e-3, 1e-3, causal=causal, causal_alignment=alignment)


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
    (qkv32(), {"causal_alignment": "diagonal"}, ValueError,
     "causal_alignment must be one of.*got 'diagonal'"),
    (qkv32(), {"scale": float("nan")}, TypeError, "scale must be a finite float"),
    (qkv32(), {"causal": 1}, TypeError, "causal must be a bool, got int"),
    (qkv32(q=torch.randn(1, 2, 8, 16, device="meta")), {}, ValueError,
     "one device, got meta, cpu, cpu"),
])
def test_bad_input(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        fused_attention(args["q"], args["k"], args["v"], **kwargs)


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


def test_config_for_short_causal_sequences(monkeypatch):
    # Compiled launches (not the interpreter's one config): causal calls with at most SHORT_SEQ
    # queries take the short-sequence entry where the head_dim class has one.
    monkeypatch.setattr(kernels, "is_interpreted", lambda: False)
    short, long = kernels.SHORT_CONFIGS[64], kernels.CONFIGS[64]
    assert short != long
    assert kernels.config_for(64, 1024, True) == short
    assert kernels.config_for(48, kernels.SHORT_SEQ, True) == short
    assert kernels.config_for(64, kernels.SHORT_SEQ + 1, True) == long
    assert kernels.config_for(64, 1024, False) == long
    assert kernels.config_for(64) == long
    assert kernels.config_for(128, 1024, True) == kernels.CONFIGS[128]
    with kernels.pinned_config(32, 32):
        assert kernels.config_for(64, 1024, True)[:2] == (32, 32)


def _reference_schedule(n_hz, num_m, group, programs, rows, block_n, kv_len, causal, offset,
                        overhead):
    # tile_schedule's contract written out independently: _grouped_tile's order (groups of
    # `group` heads, the last one smaller; last query tile first), a tile's cost = its K/V
    # blocks (those its last row sees) + overhead, each tile to the program whose work ends first
    # (lowest program on ties). Returns each program's tiles and the busiest one's cost.
    ends, runs = [0] * programs, [[] for _ in range(programs)]
    for t in range(n_hz * num_m):
        heads = min(group, n_hz - t // (group * num_m) * group)
        m = num_m - 1 - t % (group * num_m) // heads
        hi = min(max(m * rows + rows + offset, 0), kv_len) if causal else kv_len
        p = min(range(programs), key=lambda i: (ends[i], i))
        ends[p] += -(-hi // block_n) + overhead
        runs[p].append(t)
    return runs, max(ends)


def _runs(table):
    return [row[1:1 + row[0]] for row in table.tolist()]


SCHEDULE_CASES = [
    # (n_hz, num_m, head_group, programs, tile_rows, block_n, kv_len, causal, causal_offset)
    (128, 8, 43, 132, 128, 128, 1024, True, 0),      # (8,16,1024,128): three groups of 43
    (10, 3, 4, 4, 128, 128, 384, True, 0),           # a smaller last group
    (7, 1, 3, 3, 128, 128, 128, True, 0),            # one query tile per head
    (6, 5, 2, 4, 128, 64, 640, True, -300),          # rows that see no key, tiles of no block
    (6, 5, 2, 4, 128, 64, 200, True, 900),           # offset past the keys
    (6, 5, 3, 7, 128, 128, 640, False, 0),           # non-causal: equal tiles
    (3, 2, 3, 6, 128, 128, 256, True, 0),            # as many programs as tiles
]


@pytest.mark.parametrize("case", SCHEDULE_CASES)
def test_tile_schedule(case):
    hopper = pytest.importorskip("attnscope.kernels.attention_fwd_hopper")
    assert _runs(hopper.tile_schedule(torch.device("cpu"), *case, True)) == \
        _reference_schedule(*case, hopper.TILE_OVERHEAD)[0]
    # round-robin: round r gives program p tile r * programs + p, or the mirror in odd rounds
    tiles, programs = case[0] * case[1], case[3]
    expected = [[t for r in range(-(-tiles // programs))
                 for t in [r * programs + (p if r % 2 == 0 else programs - 1 - p)] if t < tiles]
                for p in range(programs)]
    assert _runs(hopper.tile_schedule(torch.device("cpu"), *case, False)) == expected


def test_tile_schedule_balances_the_short_head_dim_128_row():
    # (8,16,1024,128) on 132 programs: by the cost model the busiest program carries 17 % more
    # than the mean under round-robin, 3 % under list scheduling (with v12's overhead of 1)
    hopper = pytest.importorskip("attnscope.kernels.attention_fwd_hopper")
    overhead = hopper.TILE_OVERHEAD
    busiest = _reference_schedule(*SCHEDULE_CASES[0], overhead)[1]
    mean = 128 * sum(m + 1 + overhead for m in range(8)) / 132
    assert busiest / mean < 1.04


def test_tile_schedule_falls_back_to_round_robin_for_many_tiles(monkeypatch):
    hopper = pytest.importorskip("attnscope.kernels.attention_fwd_hopper")
    args = (torch.device("cpu"), 6, 5, 3, 4, 128, 128, 640, True, 0)
    monkeypatch.setattr(hopper, "SCHEDULE_MAX_TILES", 29)
    assert torch.equal(hopper.tile_schedule(*args, True), hopper.tile_schedule(*args, False))
    monkeypatch.setattr(hopper, "SCHEDULE_MAX_TILES", 30)
    assert not torch.equal(hopper.tile_schedule(*args, True), hopper.tile_schedule(*args, False))


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


# ---- GPU: the Gluon Hopper kernel (attention_fwd_hopper.py) ---------------------------------

def _on_hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


HOPPER_SHAPES = [
    # (batch, heads, kv_heads, q_len, kv_len, causal, alignment): the kernel's 128-row tiles,
    # the diagonal, ragged query tiles and rows past a head's end (key lengths are multiples of
    # its 128-key blocks: other lengths run the Triton kernel)
    (2, 3, 3, 1000, 1024, True, "top_left"),
    (1, 4, 1, 333, 384, True, "top_left"),        # MQA, one ragged query tile
    (1, 2, 2, 77, 256, True, "bottom_right"),     # diagonal off the tile grid
    (1, 2, 2, 300, 128, True, "bottom_right"),    # rows that see no key, tiles with no block
    (2, 2, 1, 257, 512, False, "top_left"),       # non-causal
    (3, 1, 1, 1, 128, True, "bottom_right"),      # single-token decoding
    (3, 16, 16, 2048, 2048, True, "top_left"),    # more tiles than SMs: the persistent loop
]


@pytest.mark.cuda
@pytest.mark.skipif(not _on_hopper(), reason="the Gluon kernel runs on sm_90 only")
@pytest.mark.parametrize("dtype,floor,lse_tol", GPU_DTYPES)
@pytest.mark.parametrize("shape", HOPPER_SHAPES)
@pytest.mark.parametrize("current", [False, True])  # lab switches: pre-v10 stores, pre-v12 order
def test_hopper_kernel(shape, dtype, floor, lse_tol, current, monkeypatch, request):
    from attnscope.kernels import attention_fwd_hopper
    monkeypatch.setattr(attention_fwd_hopper, "_TMA_STORE", current)
    monkeypatch.setattr(attention_fwd_hopper, "_BALANCED", current)
    kernels.forget_launches()  # kept launches hold the switches' effect: before and after
    request.addfinalizer(kernels.forget_launches)
    batch, heads, kv_heads, q_len, kv_len, causal, alignment = shape
    q, k, v = make_qkv(batch, heads, kv_heads, q_len, kv_len, 128, dtype, "cuda")
    assert kernels.uses_hopper_kernel(q, k, v, torch.empty_like(q), 128 ** -0.5)
    check(q, k, v, floor, lse_tol, causal=causal, causal_alignment=alignment)


@pytest.mark.cuda
@pytest.mark.skipif(not _on_hopper(), reason="the Gluon kernel runs on sm_90 only")
def test_hopper_kernel_strided_out_takes_register_stores():
    # An `out` that is not one contiguous matrix cannot take the TMA store; the register stores
    # write the same values.
    q, k, v = make_qkv(1, 2, 2, 320, 384, 128, torch.bfloat16, "cuda")
    wide = torch.full((1, 2, 320, 256), float("nan"), dtype=torch.bfloat16, device="cuda")
    out, lse = wide[..., :128], torch.empty(1, 2, 320, device="cuda")
    assert kernels.uses_hopper_kernel(q, k, v, out, 128 ** -0.5)
    kernels.attention_fwd(q, k, v, out, lse, causal=True, scale=128 ** -0.5, causal_offset=0)
    assert torch.equal(out, fused_attention(q, k, v))
    assert wide[..., 128:].isnan().all()  # nothing written outside the view


def _replays_in_a_cuda_graph(q, k, v):
    """A warmed-up call, captured in a CUDA graph, replays into its output what it computed
    eagerly."""
    expected = fused_attention(q, k, v)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_attention(q, k, v)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)


@pytest.mark.cuda
@pytest.mark.skipif(not _on_hopper(), reason="the Gluon kernel runs on sm_90 only")
def test_hopper_kernel_in_a_cuda_graph():
    # A warmed-up shape replays from a CUDA graph (its tile schedule stays on the GPU); a shape
    # first met during capture is refused with a clear error instead of a broken capture.
    _replays_in_a_cuda_graph(*make_qkv(2, 4, 4, 640, 640, 128, torch.bfloat16, "cuda"))
    q2, k2, v2 = make_qkv(2, 4, 4, 768, 768, 128, torch.bfloat16, "cuda")
    with pytest.raises(RuntimeError, match="before capturing"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            fused_attention(q2, k2, v2)


@pytest.mark.cuda
@pytest.mark.skipif(not _on_hopper(), reason="the Gluon kernel runs on sm_90 only")
def test_hopper_kernel_only_takes_what_it_supports():
    q, k, v = make_qkv(1, 2, 2, 256, 256, 128, torch.bfloat16, "cuda")
    out = torch.empty_like(q)
    scale = 128 ** -0.5
    assert kernels.uses_hopper_kernel(q, k, v, out, scale)
    assert not kernels.uses_hopper_kernel(q, k, v, out, 0.0)  # it masks before scaling
    assert not kernels.uses_hopper_kernel(q, k[:, :, :200], v[:, :, :200], out, scale)  # ragged K
    assert not kernels.uses_hopper_kernel(q[..., :64], k[..., :64], v[..., :64], out[..., :64],
                                          scale)
    assert not kernels.uses_hopper_kernel(q.float(), k.float(), v.float(), out.float(), scale)
    bshd = rearrange(torch.randn(1, 256, 2, 128, device="cuda", dtype=torch.bfloat16),
                     "b s h d -> b h s d")
    assert not kernels.uses_hopper_kernel(bshd, k, v, out, scale)  # not one [rows, d] matrix
    with kernels.pinned_config(64, 64):  # a pinned config means the Triton kernel
        assert not kernels.uses_hopper_kernel(q, k, v, out, scale)


@pytest.mark.cuda
@pytest.mark.skipif(not _on_hopper(), reason="the Gluon kernel runs on sm_90 only")
@pytest.mark.parametrize("scale", [0.0, -0.2])
def test_non_positive_scale_on_hopper_shapes(scale):
    # Such calls run the Triton kernel, which scales before masking.
    q, k, v = make_qkv(1, 2, 2, 300, 384, 128, torch.bfloat16, "cuda")
    check(q, k, v, 4e-3, 1e-3, scale=scale)


def test_hopper_kernel_is_never_used_on_cpu():
    q, k, v = make_qkv(1, 2, 2, 8, 128, 128, torch.float16, CPU)
    assert not kernels.uses_hopper_kernel(q, k, v, torch.empty_like(q), 0.1)


# ---- the launch: Triton's dispatch once per key (FastLaunch) ----------------------------------

class _RecordingKernel:
    """Stands in for a JIT kernel: kernel[grid](...) records the launch and returns a
    'compiled kernel' whose [grid](...) records the direct launches."""
    arg_names = ["X", "n", "BLOCK", "FLAG"]

    def __init__(self):
        self.jit_calls, self.direct_calls = [], []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.jit_calls.append((grid, args, kwargs))
            return self.compiled
        return launch

    @property
    def compiled(self):
        kernel = self

        class Compiled:
            def __getitem__(self, grid):
                return lambda *args: kernel.direct_calls.append((grid, args))
        return Compiled()


def test_fast_launch_dispatches_once_per_key():
    kernel = _RecordingKernel()
    launch = kernels.FastLaunch(kernel)
    launch.enabled = True  # as on Triton 3.6 with a compiled kernel
    kwargs = dict(BLOCK=64, FLAG=True, num_warps=4)
    launch(("a",), (7,), ("x", 3), kwargs)
    launch(("a",), (7,), ("y", 3), kwargs)
    launch(("b",), (9, 2), ("z", 5), kwargs)
    assert [c[0] for c in kernel.jit_calls] == [(7,), (9, 2)]  # one JIT launch per key
    # the repeat passes every parameter in order (constexprs too) and a 3-D grid; a stand-in
    # for a compiled kernel takes that path rather than a C launcher it does not have
    assert kernel.direct_calls == [((7, 1, 1), ("y", 3, 64, True))]


def test_fast_launch_keeps_the_arguments_after_per_call():
    # Arguments from `per_call` on are fixed by the key: a repeat passes the first ones and the
    # launch appends those of the first call (what attention_fwd's lookup relies on).
    kernel = _RecordingKernel()
    shared = {}
    launch = kernels.FastLaunch(kernel, shared)
    launch.enabled = True
    kwargs = dict(BLOCK=64, FLAG=False)
    launch(("a",), (7,), ("x", 3), kwargs, per_call=1)
    assert list(shared) == [("a",)]  # kept in the dict it was given
    shared[("a",)](("y",))
    launch(("a",), (7,), ("z", 99), kwargs, per_call=1)
    assert kernel.direct_calls == [((7, 1, 1), ("y", 3, 64, False)),
                                   ((7, 1, 1), ("z", 3, 64, False))]


class _NoLaunchKernel(_RecordingKernel):
    """kernel[grid](...) returns None, as Triton's JIT does when a cache hook skips a launch."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.jit_calls.append(grid)


def test_fast_launch_does_not_keep_a_launch_that_did_not_happen():
    kernel = _NoLaunchKernel()
    launch = kernels.FastLaunch(kernel)
    launch.enabled = True
    for _ in range(2):
        assert launch(("a",), (7,), ("x", 3), dict(BLOCK=64, FLAG=True)) is None
    assert kernel.jit_calls == [(7,), (7,)] and launch.bound == {}  # each went through Triton


def test_fast_launch_is_off_in_the_interpreter():
    assert not kernels._launch_fwd.enabled
    q, k, v = make_qkv(1, 2, 2, 40, 40, 32, torch.float16, CPU)
    check(q, k, v, 1e-3, 1e-3)
    check(q, k, v, 1e-3, 1e-3)
    assert kernels._launch_fwd.bound == {} and kernels._eager == {}


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", [64, 128])  # the Triton kernel, and the Gluon one on sm_90
def test_gpu_repeated_launches_are_right(head_dim):
    # A repeat launch skips Triton's dispatch: fresh data, a new shape and an input at an odd
    # address (another specialization) must all still come out right.
    for q_len in (384, 384, 512):
        q, k, v = make_qkv(2, 4, 2, q_len, q_len, head_dim, torch.bfloat16, "cuda")
        check(q, k, v, 4e-3, 1e-3)
    # the call before, again, but q 2 bytes past a 16-byte boundary: only the alignment differs
    base = torch.randn(q.numel() + 1, dtype=q.dtype, device="cuda")
    check(base[1:].view(q.shape), k, v, 4e-3, 1e-3)


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", [64, 128, 256])  # Triton; Gluon on sm_90; Triton with TMA
def test_gpu_kept_launches_follow_the_call(head_dim):
    # A kept launch fixes every argument but the five tensors: another scale or alignment is
    # another key; a repeat from a new thread (its own scratch allocator, for the kernels that
    # make TMA descriptors on the device) or on a side stream launches there; and nothing the
    # caller passed is kept alive.
    import gc
    import threading
    import weakref
    q, k, v = make_qkv(2, 4, 2, 384, 512, head_dim, torch.bfloat16, "cuda")
    for scale in (None, 0.05, None):
        for alignment in ("top_left", "bottom_right"):
            check(q, k, v, 4e-3, 1e-3, scale=scale, causal_alignment=alignment)
    expected = fused_attention(q, k, v)
    outs = []
    thread = threading.Thread(target=lambda out, *qkv: out.append(fused_attention(*qkv)),
                              args=(outs, q, k, v))
    thread.start()
    thread.join()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        outs.append(fused_attention(q, k, v))
    torch.cuda.synchronize()
    assert len(outs) == 2 and all(torch.equal(out, expected) for out in outs)
    refs = [weakref.ref(t) for t in (q, k, v, expected)]
    del q, k, v, expected, outs
    gc.collect()
    assert all(ref() is None for ref in refs)


@pytest.mark.cuda
def test_gpu_kept_launches_are_direct_and_hooks_still_fire():
    # Where the launcher layout is known (Triton 3.6 to 3.9) a repeat calls the launcher itself
    # (the host-time saving); with a launch hook set (a profiler) it goes through Triton's
    # runner, which calls the hook.
    import triton
    q, k, v = make_qkv(1, 2, 2, 256, 256, 64, torch.bfloat16, "cuda")
    expected = fused_attention(q, k, v)
    if kernels.launcher_layout() is not None:
        assert kernels._eager and all(bound.direct for bound in kernels._eager.values())
    seen = []
    hooks = triton.knobs.runtime.launch_enter_hook
    hook = lambda metadata: seen.append(metadata.get()["name"])  # noqa: E731
    hooks.add(hook)
    try:
        out = fused_attention(q, k, v)
    finally:
        hooks.remove(hook)
    assert seen == ["_attn_fwd"] and torch.equal(out, expected)


@pytest.mark.cuda
def test_gpu_triton_kernel_in_a_cuda_graph():
    _replays_in_a_cuda_graph(*make_qkv(2, 4, 4, 640, 640, 64, torch.bfloat16, "cuda"))


def test_scratch_allocator_is_set_per_thread():
    # Triton keeps its allocator per thread: a launch from another thread (autograd's device
    # thread under activation checkpointing, a thread pool) must get one too.
    import threading
    seen = []

    def launch_side():
        kernels.ensure_scratch_allocator()
        seen.append(kernels._thread_allocator.get() is not kernels._NULL_ALLOCATOR)
    thread = threading.Thread(target=launch_side)
    thread.start()
    thread.join()
    assert seen == [True]


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
