"""How `bench` times one call: the median over a rotation of prepared input sets.

On CUDA, `triton.testing.do_bench(return_mode="median")` over a closure that cycles through
several prepared input sets, so that every call reads q/k/v the L2 cache has not kept (do_bench
also clears L2 between timed calls; the rotation keeps the figure honest either way). Without
CUDA, CPU wall time (`time.perf_counter`, median of repeats), labelled so.
"""

from __future__ import annotations

import gc
import itertools
import math
import statistics
import time

import torch

# L2 size when the device properties do not say (H200: 60 MB); rotation sets are capped because
# small shapes would otherwise need hundreds of them.
DEFAULT_L2_BYTES = 60 * 10**6
MAX_INPUT_SETS = 16

MIN_CPU_REPEATS = 3  # a median of fewer is one sample


def input_sets(set_bytes: int, l2_bytes: int) -> int:
    """How many q/k/v/out sets to cycle through so that, between two uses of one set, the others
    move at least an L2's worth of data and the set is evicted."""
    return min(MAX_INPUT_SETS, 1 + math.ceil(l2_bytes / set_bytes))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(forwards, device: torch.device, warmup_ms: float, rep_ms: float) -> float:
    """Median time of one call, each call taking the next prepared forward in turn. Python's
    cyclic garbage collector is off while timing, as in `timeit`. Two H200 runs read host-bound
    small-shape rows 1.3-2.4x slow right after a compiling first call (flex); collector passes
    over what a compile leaves behind, landing inside the timed loop, are the suspected cause."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _median_ms_no_gc(forwards, device, warmup_ms, rep_ms)
    finally:
        if enabled:
            gc.enable()


def _median_ms_no_gc(forwards, device: torch.device, warmup_ms: float, rep_ms: float) -> float:
    cycle = itertools.cycle(forwards)

    def call():
        return next(cycle)()

    if device.type == "cuda":
        import triton.testing  # only here: CPU runs never need Triton's driver

        return float(triton.testing.do_bench(call, warmup=warmup_ms, rep=rep_ms,
                                             return_mode="median"))
    deadline = time.perf_counter() + warmup_ms / 1e3
    call()
    while time.perf_counter() < deadline:
        call()
    times = []
    deadline = time.perf_counter() + rep_ms / 1e3
    while len(times) < MIN_CPU_REPEATS or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def timing_block(device: torch.device, l2_bytes: int | None, args) -> dict:
    if device.type == "cuda":
        return {"timer": "triton.testing.do_bench, return_mode='median', CUDA events",
                "warmup_ms": args.warmup_ms, "rep_ms": args.rep_ms,
                "rotation": f"each timed call takes the next of `input_sets` prepared forwards, "
                f"each on its own q/k/v; sets = 1 + ceil(L2 / bytes of q+k+v+out), at most "
                f"{MAX_INPUT_SETS}, so a set is evicted before its next use; do_bench also "
                f"clears L2 before each timed call",
                "l2_bytes": l2_bytes}
    return {"timer": "CPU wall time: time.perf_counter median over repeats (not GPU time)",
            "warmup_ms": args.warmup_ms, "rep_ms": args.rep_ms,
            "min_repeats": MIN_CPU_REPEATS, "rotation": "none: one input set"}
