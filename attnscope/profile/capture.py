"""The seed recipe of the blog's 04_* scripts, for one implementation at one shape.

Three warm-up calls (compilation, autotuning and cuDNN plan selection happen here, outside the
trace); then torch.profiler with schedule(wait=1, warmup=1, active=3, repeat=1), one
`record_function` range named after the implementation around each forward, under no_grad.
Writes `<out>/<impl>/<batch>_<heads>_<seq>_<dim>_<impl>.json.gz` and beside it the `.txt`
key_averages table (sorted by CUDA time, 15 rows); `capture(..., mode="fwd_bwd")` puts the
backward in each range too. Peak memory is CUDA's high-water mark over
the profiled steps, inputs included, as the scripts print it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from attnscope.profile import scenarios
from attnscope.profile.inputs import WARMUP_CALLS

WAIT, WARMUP, ACTIVE = 1, 1, 3


@dataclass
class Capture:
    output: torch.Tensor  # the last warm-up forward's output, for the error column
    trace: Path
    table: Path
    peak_memory_mb: float | None  # None on CPU


MODES = ("fwd", "fwd_bwd")


def trace_paths(out_dir, impl_name, shape, mode="fwd"):
    # The blog's names for forward traces; a fwd_bwd capture says so in its name.
    stem = "_".join(str(x) for x in (*shape, impl_name, *(() if mode == "fwd" else (mode,))))
    folder = Path(out_dir) / impl_name
    return folder / f"{stem}.json.gz", folder / f"{stem}.txt"


def profiled_call(name, forward, leaves, backward):
    """One profiled call of a prepared implementation (`name`'s), as compare and ncu make it:
    the forward, and with `backward` dq, dk, dv by torch.autograd.grad for a fixed random
    upstream gradient (seeded, drawn once from the first output's shape), so no accumulation
    into .grad is traced. `leaves`: the q, k, v the forward was prepared on (requiring grad with
    `backward`). The call returns the output, detached."""
    upstream = []

    def call():
        out = forward()
        if backward:
            if out.grad_fn is None:
                raise NotImplementedError(f"backward not supported: {name}'s output carries no "
                                          "autograd graph")
            if not upstream:
                gen = torch.Generator(device="cpu").manual_seed(1)
                upstream.append(torch.randn(out.shape, generator=gen).to(out))
            torch.autograd.grad(out, leaves, upstream[0])
        return out.detach()
    return call


def capture(impl, q, k, v, out_dir, mode="fwd", packing=None, paging=None,
            options=None) -> Capture:
    """Profile `impl` on q, k, v; raises whatever the implementation raises. `packing`: packed
    sequences' (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k); `paging`: a paged KV
    cache's (k_cache, v_cache, block_table, cache_seqlens) (scenarios.Inputs); `options`: the
    case's window and softcap keywords (scenarios.options).

    mode "fwd_bwd" profiles forward and backward in each range: inputs require grad, and after
    each forward torch.autograd.grad computes dq, dk, dv for a fixed random upstream gradient
    (autograd.grad, so no accumulation into .grad is traced)."""
    cuda = q.device.type == "cuda"
    trace, table = trace_paths(out_dir, impl.name, tuple(q.shape), mode)
    backward = mode == "fwd_bwd"
    if backward:
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    trace.parent.mkdir(parents=True, exist_ok=True)

    def on_trace_ready(prof):
        prof.export_chrome_trace(str(trace))  # gzipped because of the .gz suffix
        table.write_text(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15)
                         + "\n")

    with torch.enable_grad() if backward else torch.no_grad():
        forward = scenarios.prepare(impl, scenarios.Inputs((q, k, v), packing, paging),
                                    causal=True, **(options or {}))
        step = profiled_call(impl.name, forward, (q, k, v), backward)
        for _ in range(WARMUP_CALLS):
            output = step()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with warnings.catch_warnings():
            # torch's note that a scheduled profiler reports only its last cycle: this one has one
            warnings.filterwarnings("ignore", message=".*Profiler clears events")
            with profile(activities=activities, on_trace_ready=on_trace_ready,
                         schedule=schedule(wait=WAIT, warmup=WARMUP, active=ACTIVE,
                                           repeat=1)) as prof:
                for _ in range(WAIT + WARMUP + ACTIVE):
                    with record_function(impl.name):
                        step()
                    if cuda:
                        # Outside the range: each step's kernels finish before the next starts.
                        torch.cuda.synchronize()
                    prof.step()
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
    return Capture(output=output, trace=trace, table=table, peak_memory_mb=peak)
