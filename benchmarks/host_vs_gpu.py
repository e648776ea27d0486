"""Host-bound or GPU-bound? The fused op and SDPA cuDNN timed eagerly (triton.testing.do_bench)
and replayed from a CUDA graph (do_bench_cudagraph: no Python, no launch cost per call), at the
small shapes of the default sweep. Eager minus graph is what the host adds per call plus a
cache effect: do_bench flushes L2 before each eager call, while the graph replays one input set
with L2 warm (at the seed shape q, k, v take 50 MB of the 60 MB L2).

    python benchmarks/host_vs_gpu.py
"""
import sys

import torch
import torch.nn.functional as F
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

import attnscope


def main():
    for shape in [(16, 16, 512, 64), (8, 16, 1024, 64), (8, 16, 1024, 128)]:
        q, k, v = (torch.randn(shape, dtype=torch.bfloat16, device="cuda") for _ in range(3))

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        for name, fn in [("fused", lambda: attnscope.fused_attention(q, k, v)), ("cudnn", cudnn)]:
            fn()
            torch.cuda.synchronize()
            eager = triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")
            graph = triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median")
            print(f"{shape} {name:6s} eager {eager:.4f} ms  graph {graph:.4f} ms  "
                  f"host adds {1e3 * (eager - graph):.1f} us", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
