"""Where the fused op's host time goes: per-call enqueue time (no synchronization) of each layer
of the eager path, from the public op down to the bare kernel launch, and of a training step's
forward and backward. The inputs are tiny (1, 1, 128, head_dim), so the GPU finishes each launch
long before the next is enqueued and the launch queue never fills: the loop measures the host
alone. head_dim 64 takes the Triton kernel,
128 the Gluon one on sm_90 with Triton 3.6. --profile adds cProfile's top functions (by own time)
of the public op, so a layer's cost can be traced to the function that spends it.

    python benchmarks/host_cost.py [--head-dim 64 128] [--profile]
"""
import argparse
import cProfile
import io
import pstats
import sys
import time

import torch

import attnscope
from attnscope.attention import fused
from attnscope.kernels import attention_fwd as fwd


def per_call_us(fn, n=3000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return us


def profile(fn, n=2000, top=25):
    """cProfile's top functions by own time over n calls (cProfile's own overhead inflates
    every figure; read them as shares)."""
    fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def rows(d):
    b, h, s = 1, 1, 128
    q, k, v = (torch.randn(b, h, s, d, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    out = torch.empty_like(q)
    lse = torch.empty(b, h, s, dtype=torch.float32, device="cuda")
    kernel = "Gluon" if fwd.uses_hopper_kernel(q, k, v, out, d ** -0.5) else "Triton"
    launch = lambda: fwd.attention_fwd(q, k, v, out, lse, causal=True, scale=d ** -0.5,  # noqa
                                       causal_offset=0)
    public = lambda: attnscope.fused_attention(q, k, v)  # noqa: E731
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    out_g = attnscope.fused_attention(qg, kg, vg)
    dout = torch.randn_like(out_g)
    return kernel, public, [
        ("forward under autograd (inputs need grad)",
         lambda: attnscope.fused_attention(qg, kg, vg)),
        ("backward: torch.autograd.grad", lambda: torch.autograd.grad(out_g, (qg, kg, vg), dout,
                                                                      retain_graph=True)),
        ("public op fused_attention", public),
        ("_forward (no validation)", lambda: fused._forward(q, k, v, True, d ** -0.5, False,
                                                            "bhsd")),
        (f"kernels.attention_fwd ({kernel} launch)", launch),
        ("_validate", lambda: fused._validate(q, k, v, True, None, "bhsd", "top_left")),
        ("two torch.empty", lambda: (torch.empty_like(q), torch.empty(b, h, s, device="cuda"))),
        ("sdpa cudnn (for scale)", lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True)),
    ]


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dim", type=int, nargs="+", default=[64, 128],
                   help="head_dims to measure (default: 64 128)")
    p.add_argument("--profile", action="store_true",
                   help="also print cProfile's top functions of the public op")
    args = p.parse_args()
    for d in args.head_dim:
        kernel, public, timed = rows(d)
        print(f"head_dim {d}: the op runs the {kernel} kernel", flush=True)
        for name, fn in timed:
            print(f"  {name:42s} {per_call_us(fn):7.1f} us/call", flush=True)
        if args.profile:
            print(profile(public), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
