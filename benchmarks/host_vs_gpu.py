"""Host-bound or GPU-bound? The fused op and SDPA cuDNN timed three ways at each shape:

  do_bench      as `attnscope bench` times them (triton.testing.do_bench, L2 cleared before each
                call by a memset that do_bench enqueues first);
  graph         the same memset and call captured once in a CUDA graph and replayed, timed with
                CUDA events around each replay the same way: GPU time with the host out of it;
  memset        the memset alone, as a graph.

do_bench starts its timer on the GPU right after the memset. If the host has not enqueued the
call's kernels by the time the memset ends, the GPU waits and the wait is counted, so a call
whose host time exceeds the memset's GPU time reads slower than its kernels. The gap between
`do_bench` and `graph - memset` is that wait (the graph keeps the memset, so L2 starts cold in
both). Also printed: time per call of a loop of calls without synchronization, the host's pace
where it is slower than the GPU. (Until v12 this script compared do_bench with
do_bench_cudagraph, whose replays run with L2 warm and no memset: a cache effect mixed in.)

    python benchmarks/host_vs_gpu.py [--shapes 16,16,512,64 8,16,1024,64 8,16,1024,128]
"""
import argparse
import statistics

import torch
import triton
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

from attnscope import fused_attention
from host_cost import per_call_us  # benchmarks/, the script's own folder


def graph_ms(fn, cache, reps=200):
    """Median ms of replays of one CUDA graph of [cache memset, fn()], CUDA events per replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm-up outside the capture (compiles, caches, allocations)
            cache.zero_()
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cache.zero_()
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+",
                   default=["16,16,512,64", "8,16,1024,64", "8,16,1024,128"],
                   help="batch,heads,seq,head_dim (bf16, causal; default: the sweep's short rows)")
    args = p.parse_args()
    cache = triton.runtime.driver.active.get_empty_cache_for_benchmark()
    memset = graph_ms(lambda: None, cache)
    print(f"memset of do_bench's {cache.numel() * cache.element_size() >> 20} MB L2 clear: GPU "
          f"{memset * 1e3:.1f} us")
    for shape in args.shapes:
        measure(tuple(int(x) for x in shape.split(",")), cache, memset)


def measure(shape, cache, memset):
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    calls = {"fused": lambda: fused_attention(q, k, v), "cudnn": cudnn}
    for name, fn in calls.items():
        bench = triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")
        gpu = graph_ms(fn, cache) - memset
        print(f"{shape} {name:6s} do_bench {bench * 1e3:7.1f} us   graph {gpu * 1e3:7.1f} us   "
              f"wait counted {max(bench - gpu, 0) * 1e3:6.1f} us   "
              f"loop/call {per_call_us(fn, n=2000):6.1f} us", flush=True)


if __name__ == "__main__":
    main()
