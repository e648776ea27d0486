"""Where the fused op's host time goes: per-call enqueue time (no synchronization) of each layer
of the eager path, from the public op down to the bare Triton launch. The inputs are tiny
(1, 1, 128, 64), so the GPU finishes each launch long before the next is enqueued and the launch
queue never fills: the loop measures the host alone.

    python benchmarks/host_cost.py
"""
import sys
import time

import torch
import triton

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


def device_context(q):
    with torch.cuda.device(q.device):  # what the op entered on every call before
        pass


def on_device(q):
    with fused._on_device(q.device):  # what it enters now: nothing on the current device
        pass


def main():
    b, h, s, d = 1, 1, 128, 64
    q, k, v = (torch.randn(b, h, s, d, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    out = torch.empty_like(q)
    lse = torch.empty(b, h, s, dtype=torch.float32, device="cuda")
    bm, bn, warps, stages, pipeline, use_tma, _ = fwd.config_for(d)
    grid = (b * h, triton.cdiv(s, bm))
    args = (q, k, v, out, lse, *q.stride(), *k.stride(), *v.stride(), *out.stride(),
            h, 1, s, s, 0, d ** -0.5 * fwd.LOG2E)
    consts = dict(HEAD_DIM=d, BLOCK_D=d, CAUSAL=True, INPUT_PRECISION="tf32", BLOCK_M=bm,
                  BLOCK_N=bn, PIPELINE=pipeline, USE_TMA=False, num_warps=warps,
                  num_stages=stages)
    rows = [
        ("public op fused_attention", lambda: attnscope.fused_attention(q, k, v)),
        ("_forward (no validation)", lambda: fused._forward(q, k, v, True, d ** -0.5, False,
                                                            "bhsd")),
        ("kernels.attention_fwd", lambda: fwd.attention_fwd(q, k, v, out, lse, causal=True,
                                                            scale=d ** -0.5, causal_offset=0)),
        ("bare _attn_fwd[grid](...)", lambda: fwd._attn_fwd[grid](*args, **consts)),
        ("_validate", lambda: fused._validate(q, k, v, True, None, "bhsd", "top_left")),
        ("two torch.empty", lambda: (torch.empty_like(q), torch.empty(b, h, s, device="cuda"))),
        ("torch.cuda.device(q.device) enter/exit", lambda: device_context(q)),
        ("fused._on_device(q.device) enter/exit", lambda: on_device(q)),
        ("sdpa cudnn (for scale)", lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True)),
    ]
    for name, fn in rows:
        print(f"{name:40s} {per_call_us(fn):7.1f} us/call", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
