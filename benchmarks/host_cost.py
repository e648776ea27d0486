"""Where the fused op's host time goes: per-call enqueue time (no synchronization) of each layer
of the eager path, from the public op down to the bare kernel launch, and of a training step's
forward and backward. The inputs are tiny (1, 1, 128, head_dim), so the GPU finishes each launch
long before the next is enqueued and the launch queue never fills: the loop measures the host
alone. head_dim 64 takes the Triton kernel,
128 the Gluon one on sm_90 with Triton 3.6. --profile adds cProfile's top functions (by own time)
of the public op, so a layer's cost can be traced to the function that spends it.
--decode measures a decode step instead: one sequence, 32 query heads on 8 K/V heads, 1024 keys,
8 queries (--q-len), bottom-right (the shape at which the op was host-bound), through the fused op's
decode route, fused_attention_with_kvcache on a fixed-capacity cache, and the split-KV launch.
--stub-launches measures the Python layers alone on a machine without a GPU: fp16 CPU tensors,
the kernel launches replaced by no-ops (best of --rounds loops; a CPU machine's timings are
noisy). There fused_attention_with_kvcache also reads its lengths back to check them (~2 us a
call), which it does on CPU tensors only; its stubs keep the forward's and the backward's
launches, so repeats take the remembered calls as on the GPU. --layout bshd times the prefill
rows on flash-attn's layout (every call of the transformers backend).

    python benchmarks/host_cost.py [--head-dim 64 128] [--profile] [--decode]
    python benchmarks/host_cost.py --stub-launches --rounds 5 --head-dim 64 [--layout bshd]
    python benchmarks/host_cost.py --stub-launches --rounds 5 --decode --head-dim 128
"""
import argparse
import cProfile
import functools
import io
import pstats
import sys
import time

import torch

import attnscope
from attnscope.attention import fused
from attnscope.kernels import attention_decode, dispatch, launch


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def per_call_us(fn, n=3000, rounds=1):
    """Host time per call: the best of `rounds` loops of n calls."""
    for _ in range(50):
        fn()
    sync()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
        sync()
    return best


def profile(fn, n=2000, top=25):
    """cProfile's top functions by own time over n calls (cProfile's own overhead inflates
    every figure; read them as shares)."""
    fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    sync()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def stub_launches():
    """Replace the kernel launches the op makes with no-ops (the op looks them up in the
    dispatch module)."""
    # The forward's first launch of a key keeps a launch that launches nothing, as FastLaunch
    # keeps the compiled kernel's: repeats take the dispatch's kept path and the op's repeats
    # (fused._repeats) as on the GPU.
    def keep_nothing(q, k, v, out, lse, *, key, **kwargs):
        launch.FORWARD_LAUNCHES[key] = lambda tensors: None
    dispatch.triton_fwd.attention_fwd_triton = keep_nothing
    # The backward's likewise: a training step's repeat takes its remembered backward
    # (fused._backward_repeat), as on the GPU.
    dispatch.attention_bwd = lambda *args, kept=False, **kwargs: (
        (lambda *tensors: None) if kept else None)
    stub_decode_launches()


class _NoLaunch:
    """Stands in for a JIT kernel and for its compiled kernel: a launch launches nothing."""

    def __init__(self, arg_names):
        self.arg_names = arg_names

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self


def stub_decode_launches():
    """The decode kernels' launches become no-ops that FastLaunch keeps, so repeats take the
    kept launch's path (launch._Bound, minus Triton's C launcher) as on the GPU."""
    launch.direct_launch_ok = lambda: True
    fast = attention_decode._split_launch
    fast.kernel, fast.jit = _NoLaunch(fast.kernel.arg_names), True


def rows(d, stubbed, layout="bhsd"):
    b, h, s = 1, 1, 128
    device, dtype = ("cpu", torch.float16) if stubbed else ("cuda", torch.bfloat16)
    g = torch.Generator(device=device).manual_seed(0)
    shape = (b, h, s, d) if layout == "bhsd" else (b, s, h, d)
    q, k, v = (torch.randn(shape, dtype=dtype, device=device, generator=g) for _ in range(3))
    if layout == "bshd":  # the kernels' [batch, heads, seq, head_dim] views
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out = torch.empty_like(q)
    lse = torch.empty(b, h, s, dtype=torch.float32, device=device)
    kernel = (None if stubbed else
              "Gluon" if dispatch.uses_hopper_kernel(q, k, v, out, d ** -0.5) else "Triton")
    launch = lambda: dispatch.attention_fwd(q, k, v, out, lse, causal=True,  # noqa: E731
                                            scale=d ** -0.5, causal_offset=0)
    caller = (q, k, v) if layout == "bhsd" else tuple(t.transpose(1, 2) for t in (q, k, v))
    op = functools.partial(attnscope.fused_attention, layout=layout)
    public = lambda: op(*caller)  # noqa: E731
    qg, kg, vg = (t.detach().requires_grad_() for t in caller)
    out_g = op(qg, kg, vg)
    dout = torch.randn(out_g.shape, dtype=dtype, device=device, generator=g)
    step = lambda: torch.autograd.grad(op(qg, kg, vg), (qg, kg, vg), dout)  # noqa: E731
    timed = [
        ("forward under autograd (inputs need grad)", lambda: op(qg, kg, vg)),
        ("backward: torch.autograd.grad", lambda: torch.autograd.grad(out_g, (qg, kg, vg), dout,
                                                                      retain_graph=True)),
        ("training step (forward + autograd.grad)", step),
        ("public op fused_attention", public),
        ("_forward (no validation, no LSE)", lambda: fused._forward(
            *caller, True, d ** -0.5, False, layout, lse=False)),
        (f"dispatch.attention_fwd ({kernel} launch)", launch),
        ("_validate", lambda: fused._validate(*caller, True, None, layout, "top_left")),
        ("two torch.empty (output, LSE)", lambda: (torch.empty_like(q),
                                                   torch.empty(b, h, s, device=device))),
        ("sdpa cudnn (for scale)", lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True)),
    ]
    if stubbed:  # no launch to time, and CPU SDPA says nothing about the GPU path's host cost
        timed = [row for row in timed if not row[0].startswith(("dispatch.", "sdpa"))]
    return kernel, public, step, timed


def decode_rows(d, stubbed, kv_len=1024, q_len=8):
    """A decode step of (1 sequence, 32/8 heads, kv_len keys, q_len queries, head_dim d)."""
    b, h, h_kv = 1, 32, 8
    device, dtype = ("cpu", torch.float16) if stubbed else ("cuda", torch.bfloat16)
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(b, h, q_len, d, dtype=dtype, device=device, generator=g)
    k, v = (torch.randn(b, h_kv, kv_len, d, dtype=dtype, device=device, generator=g)
            for _ in range(2))
    # the same keys as a flash-attn style cache [batch, capacity, kv_heads, d], full
    k_cache, v_cache = (t.transpose(1, 2).contiguous() for t in (k, v))
    q_bshd = q.transpose(1, 2).contiguous()
    seqlens = torch.full((b,), kv_len, dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    lse = torch.empty(b, h, q_len, dtype=torch.float32, device=device)
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
        q, k, v, is_causal=False, enable_gqa=True)
    public = lambda: attnscope.fused_attention(  # noqa: E731
        q, k, v, causal_alignment="bottom_right")
    timed = [
        ("public op fused_attention (decode route)", public),
        ("fused_attention_with_kvcache (cache_seqlens)",
         lambda: attnscope.fused_attention_with_kvcache(q_bshd, k_cache, v_cache, seqlens)),
        ("attention_decode (split launch)",
         lambda: attention_decode.attention_decode(q, k, v, out, lse, causal=True,
                                                   scale=d ** -0.5)),
        ("_validate", lambda: fused._validate(q, k, v, True, None, "bhsd", "bottom_right")),
        ("sdpa flash, no mask (for scale)", sdpa),
    ]
    if stubbed:  # the op routes CPU tensors to the prefill kernel; CPU SDPA is no GPU figure
        timed = [row for row in timed if not row[0].startswith(("public", "sdpa"))]
    return public, timed


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dim", type=int, nargs="+", default=[64, 128],
                   help="head_dims to measure (default: 64 128)")
    p.add_argument("--profile", action="store_true",
                   help="also print cProfile's top functions of the public op and of the "
                        "training step")
    p.add_argument("--stub-launches", action="store_true",
                   help="CPU fp16 tensors and no-op kernel launches: the Python layers alone, "
                        "on a machine without a GPU")
    p.add_argument("--decode", action="store_true",
                   help="time a decode step (1 x 32/8 heads x 1024 keys x --q-len queries) instead of "
                        "the (1, 1, 128) prefill call")
    p.add_argument("--q-len", type=int, default=8,
                   help="queries of the --decode step (1-8; default 8)")
    p.add_argument("--layout", choices=("bhsd", "bshd"), default="bhsd",
                   help="the prefill rows' layout: bhsd (SDPA's) or bshd (flash-attn's, every "
                        "call of the transformers backend; default bhsd)")
    p.add_argument("--rounds", type=int, default=1,
                   help="timing loops per row, the best one reported (default 1)")
    args = p.parse_args()
    if not 1 <= args.q_len <= attention_decode.MAX_Q_LEN:
        p.error(f"--q-len must be 1..{attention_decode.MAX_Q_LEN} (the decode route's queries)")
    if args.stub_launches:
        stub_launches()
    elif not torch.cuda.is_available():
        p.error("no CUDA device: use --stub-launches to time the Python layers on the CPU")
    for d in args.head_dim:
        step = None
        if args.decode:
            public, timed = decode_rows(d, args.stub_launches, q_len=args.q_len)
            what = "kernel launches stubbed out" if args.stub_launches else "the split-KV kernel"
            print(f"decode, q_len {args.q_len}, head_dim {d}: {what}", flush=True)
        else:
            kernel, public, step, timed = rows(d, args.stub_launches, args.layout)
            print(f"head_dim {d}: " + (f"the op runs the {kernel} kernel" if kernel else
                                        "kernel launches stubbed out"), flush=True)
        for name, fn in timed:
            print(f"  {name:42s} {per_call_us(fn, rounds=args.rounds):7.1f} us/call", flush=True)
        if args.profile:
            print("cProfile of the public op:\n" + profile(public), flush=True)
            if step is not None:
                print("cProfile of the training step:\n" + profile(step), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
