"""What the fused-attention tests share: inputs, the NaN-poisoned outputs, the tolerance rule.

Tolerance rule (as FlashAttention's tests): the kernel's max abs error against float64 must be at
most twice the error of PyTorch's own attention computed in the same dtype (the eager reference
run in that dtype), plus a small absolute floor. Outputs are poisoned with NaN before the kernel
runs, so an element it fails to write fails the check. Inputs are random normals drawn from the
test's own seed (conftest.py's `seeded`).
"""

import math

import pytest
import torch

from attnscope import fused_attention
from attnscope.attention import fused
from attnscope.attention.reference import attention_reference

CPU = torch.device("cpu")
# (dtype, absolute error floor, LSE tolerance). Outputs are averages of values ~1, so the floors
# are about one rounding step of the dtype there (fp16 eps 9.8e-4; bf16 7.8e-3, of which 4e-3 is
# half a step; fp32's 1e-5 is ~80 eps, for the interpreter's other summation order): they only
# matter where torch's own error is near zero. The LSE is computed in fp32 whatever the dtype.
CPU_DTYPES = [(torch.float32, 1e-5, 1e-5), (torch.float16, 1e-3, 1e-3)]
GPU_DTYPES = [(torch.bfloat16, 4e-3, 1e-3), (torch.float16, 1e-3, 1e-3)]


def nan_empty(like, shape, dtype):
    """An allocation hook's stand-in (fused._empty, attention_decode._empty): the buffer
    starts as NaN, so an element a kernel never writes shows."""
    return torch.full(shape, float("nan"), dtype=dtype, device=like.device)


@pytest.fixture(autouse=True)
def nan_outputs(monkeypatch):
    """Every output buffer the op allocates starts as NaN."""
    monkeypatch.setattr(fused, "_empty", nan_empty)


def make_qkv(batch, heads, kv_heads, q_len, kv_len, head_dim, dtype, device, layout="bhsd"):
    def rand(h, s):
        shape = (batch, h, s, head_dim) if layout == "bhsd" else (batch, s, h, head_dim)
        return torch.randn(shape, dtype=dtype, device=device)
    return rand(heads, q_len), rand(kv_heads, kv_len), rand(kv_heads, kv_len)


def _op(q, k, v, **kwargs):
    return fused_attention(q, k, v, return_lse=True, **kwargs)


def check(q, k, v, floor, lse_tol, forward=_op, **kwargs):
    """Run `forward` (the op by default; it returns (out, lse)) and assert the tolerance rule on
    the output and the LSE."""
    out, lse = forward(q, k, v, **kwargs)
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
    # relative past magnitude 1: the LSE is stored in fp32, whose rounding grows with it
    assert lse_err <= lse_tol * max(1.0, ref_lse[~masked].abs().max().item())
    return out, lse


def kernel_forward(launch, config):
    """A `forward` for check() that calls a kernel's launch function directly with `config`
    (tests of configs the tables do not hold), NaN-poisoned outputs, in the op's conventions."""
    def forward(q, k, v, causal=True, scale=None, layout="bhsd", causal_alignment="top_left"):
        out = torch.full_like(q, float("nan"))
        q4, k4, v4, out4 = (fused._as_bhsd(t, layout) for t in (q, k, v, out))
        lse = torch.full(q4.shape[:3], float("nan"), dtype=torch.float32, device=q.device)
        offset = k4.shape[2] - q4.shape[2] if causal_alignment == "bottom_right" else 0
        launch(q4, k4, v4, out4, lse, causal=causal, causal_offset=offset, config=config,
               scale=1 / math.sqrt(q.shape[-1]) if scale is None else scale)
        return out, lse
    return forward


def on_hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def replays_in_a_cuda_graph(q, k, v):
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


class _KeepingKernel:
    """Stands in for a JIT kernel so that FastLaunch keeps launches in the interpreter too: its
    launch runs the interpreted kernel and returns a compiled-kernel stand-in whose launch runs
    it again with what a kept launch passes (the call's arguments, then those kept from the
    key's first call). A key that misses an argument then gives a wrong result, as on the GPU."""

    def __init__(self, kernel, name, counts):
        self.kernel, self.name, self.counts = kernel, name, counts
        self.arg_names = kernel.arg_names

    def __getitem__(self, grid):
        def launch_through_triton(*args, **kwargs):
            self.counts[self.name, "triton"] += 1
            self.kernel[grid](*args, **kwargs)
            return _KeptKernel(self)
        return launch_through_triton


class _KeptKernel:
    def __init__(self, keeping):
        self.keeping = keeping

    def __getitem__(self, grid):
        def kept_launch(*args):  # every parameter in order, constexprs included
            self.keeping.counts[self.keeping.name, "kept"] += 1
            self.keeping.kernel[grid](*args)
        return kept_launch


def keep_launches(monkeypatch, fast, name, counts):
    """Make the launch.FastLaunch `fast` keep launches in the interpreter as on the GPU,
    counting them in `counts` (a Counter) by (name, "triton" | "kept")."""
    from attnscope.kernels import launch
    monkeypatch.setattr(launch, "direct_launch_ok", lambda: True)
    monkeypatch.setattr(fast, "jit", True)
    monkeypatch.setattr(fast, "kernel", _KeepingKernel(fast.kernel, name, counts))
