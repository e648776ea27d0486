"""What a Kineto trace says about each forward: pure Python over the trace file, no GPU needed.

A forward is one `record_function` range (a `user_annotation` event). A GPU op (kernel, memcpy,
memset) belongs to it when the CPU call that launched it (a `cuda_runtime` or `cuda_driver`
event, joined to the op by `args.correlation`) starts inside the range, on the range's thread.
Launch time, not GPU time, decides: the GPU runs behind the CPU, so a forward's kernels often
execute after its range has closed. `ProfilerStep#N` ranges are the profiler's own and skipped.

Times are in microseconds, as in the trace. Per range:
- `cuda_time_avg_us`: sum of the durations of the forward's GPU ops (busy GPU time; gaps
  between kernels not counted), averaged over forwards. TFLOP/s figures divide by this.
- `gpu_span_avg_us`: first GPU op start to last GPU op end, averaged: busy time plus the gaps,
  the extent the trace's `gpu_user_annotation` row draws for the range.
- `self_cuda_time_total_us`: sum of the durations of every GPU op of every forward.
- `cpu_time_avg_us`: the range's own duration on the CPU, averaged.
GPU figures are None for a trace without any GPU activity (a CPU-only profile).
"""

from __future__ import annotations

import bisect
import gzip
import json
import zlib
from collections import Counter, defaultdict
from pathlib import Path

from attnscope.profile.tensor_cores import name_verdict

# Category names in current Kineto, and the older capitalised ones (PyTorch <= 1.9 traces).
_CATEGORY_ALIASES = {"kernel": "kernel", "gpu_memcpy": "gpu_memcpy", "memcpy": "gpu_memcpy",
                     "gpu_memset": "gpu_memset", "memset": "gpu_memset",
                     "cuda_runtime": "cuda_runtime", "runtime": "cuda_runtime",
                     "cuda_driver": "cuda_driver", "driver": "cuda_driver",
                     "user_annotation": "user_annotation",
                     "gpu_user_annotation": "gpu_user_annotation"}
GPU_OP_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
PROFILER_STEP_PREFIX = "ProfilerStep"


class TraceError(ValueError):
    """The file is not a readable Kineto/Chrome trace; the message says what is wrong."""


def load_events(path) -> list[dict]:
    """The trace's events from a .json or .json.gz file (object with traceEvents, or bare list)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise TraceError(f"cannot read trace {path}: {e.strerror or e}") from None
    if raw[:2] == b"\x1f\x8b":  # gzip magic, whatever the file is called
        try:
            raw = gzip.decompress(raw)
        except (EOFError, OSError, zlib.error) as e:
            raise TraceError(f"trace {path} is a truncated or corrupt gzip file ({e}); was the "
                             f"profiled process killed while writing it?") from None
    try:
        data = json.loads(raw)
    except UnicodeDecodeError:
        raise TraceError(f"trace {path} is neither JSON nor gzipped JSON") from None
    except json.JSONDecodeError as e:
        raise TraceError(f"trace {path} is not valid JSON (line {e.lineno}, column {e.colno}: "
                         f"{e.msg}); a trace cut short ends like this") from None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise TraceError(f"trace {path} has no traceEvents list; is it a Kineto/Chrome trace?")
    return [e for e in events if isinstance(e, dict)]


def _complete_events(events):
    """Duration ('X') events with their category normalised; others (metadata, flows) dropped."""
    out = defaultdict(list)
    for e in events:
        cat = _CATEGORY_ALIASES.get(str(e.get("cat", "")).lower())
        if e.get("ph") == "X" and cat and "ts" in e:
            out[cat].append(e)
    return out


def _correlation(e):
    return (e.get("args") or {}).get("correlation")


def _thread(e):
    return (e.get("pid"), e.get("tid"))


def _end(e):
    return e["ts"] + e.get("dur", 0)


def _avg(values):
    return sum(values) / len(values) if values else None


def _kernel_summary(name, ops, launches_of, forwards):
    """One row per kernel name: count and time per forward, launch API, resources from args."""
    args = ops[0].get("args") or {}
    apis = Counter(launches_of[_correlation(op)]["name"] for op in ops)
    total = sum(op.get("dur", 0) for op in ops)
    return {
        "name": name,
        "per_forward": len(ops) / forwards,
        "avg_us": total / len(ops),
        "total_us": total,
        "launch_api": apis.most_common(1)[0][0],
        "registers": args.get("registers per thread"),
        "shared_memory": args.get("shared memory"),
        "grid": args.get("grid"),
        "block": args.get("block"),
        "occupancy_pct": args.get("est. achieved occupancy %"),
        "tensor_cores": name_verdict(name),
    }


def _analyze_range(instances, launches_by_thread, ops_by_correlation, launches_of,
                   gpu_annotations, has_gpu):
    per_forward_ops = []
    for r in instances:
        starts, launches = launches_by_thread.get(_thread(r), ([], []))
        lo, hi = bisect.bisect_left(starts, r["ts"]), bisect.bisect_right(starts, _end(r))
        per_forward_ops.append([op for launch in launches[lo:hi]
                                for op in ops_by_correlation.get(_correlation(launch), ())])
    n = len(instances)
    all_ops = [op for ops in per_forward_ops for op in ops]
    by_cat = Counter(op["_cat"] for op in all_ops)
    kernels_by_name = defaultdict(list)
    for op in all_ops:
        if op["_cat"] == "kernel":
            kernels_by_name[op["name"]].append(op)
    kernels = sorted((_kernel_summary(name, ops, launches_of, n)
                      for name, ops in kernels_by_name.items()),
                     key=lambda k: k["total_us"], reverse=True)
    apis = Counter(launches_of[_correlation(op)]["name"] for op in all_ops)
    busy = [sum(op.get("dur", 0) for op in ops) for ops in per_forward_ops]
    spans = [max(map(_end, ops)) - min(op["ts"] for op in ops) for ops in per_forward_ops if ops]
    gpu = (lambda value: value) if has_gpu else (lambda value: None)
    return {
        "forwards": n,
        "kernels_per_forward": gpu(by_cat["kernel"] / n),
        "gpu_ops_per_forward": gpu(len(all_ops) / n),
        "memcpy_per_forward": gpu(by_cat["gpu_memcpy"] / n),
        "memset_per_forward": gpu(by_cat["gpu_memset"] / n),
        "cuda_time_avg_us": gpu(_avg(busy)),
        "gpu_span_avg_us": gpu(_avg(spans)),
        "gpu_annotation_avg_us": _avg([e.get("dur", 0) for e in gpu_annotations]),
        "self_cuda_time_total_us": gpu(sum(busy)),
        "cpu_time_avg_us": _avg([r.get("dur", 0) for r in instances]),
        "launch_apis": [name for name, _ in apis.most_common()],
        "main_kernel": kernels[0]["name"] if kernels else None,
        "kernels": kernels,
    }


def analyze_events(events, ranges=None) -> dict:
    """Per-forward figures for each named range (default: every non-ProfilerStep user range)."""
    cats = _complete_events(events)
    ops = [dict(op, _cat=cat) for cat in GPU_OP_CATS for op in cats[cat]]
    ops_by_correlation = defaultdict(list)
    for op in ops:
        if _correlation(op) is not None:
            ops_by_correlation[_correlation(op)].append(op)
    # Only launches that put work on the GPU; cudaMalloc, syncs and the like share the category.
    # Should a runtime call and the driver call inside it both carry an op's correlation, the
    # outer (earlier) one is the launch, so the op is counted once.
    launches_of = {}
    for e in sorted((e for cat in LAUNCH_CATS for e in cats[cat]), key=lambda e: e["ts"]):
        if _correlation(e) in ops_by_correlation:
            launches_of.setdefault(_correlation(e), e)
    launches_by_thread = defaultdict(lambda: ([], []))
    for e in launches_of.values():
        starts, items = launches_by_thread[_thread(e)]
        starts.append(e["ts"])
        items.append(e)

    instances = defaultdict(list)
    for r in sorted(cats["user_annotation"], key=lambda e: e["ts"]):
        if not str(r.get("name", "")).startswith(PROFILER_STEP_PREFIX):
            instances[r["name"]].append(r)
    if ranges is not None:
        missing = [name for name in ranges if name not in instances]
        if missing:
            found = ", ".join(sorted(instances)) or "none"
            raise TraceError(f"no range named {', '.join(map(repr, missing))} in the trace; "
                             f"ranges found: {found}")
    gpu_annotations = defaultdict(list)
    for e in cats["gpu_user_annotation"]:
        gpu_annotations[e.get("name")].append(e)

    has_gpu = bool(ops)
    names = list(instances) if ranges is None else list(ranges)
    launched = {_correlation(op) for op in ops if _correlation(op) in launches_of}
    return {
        "gpu": has_gpu,
        # What key_averages prints as "Self CUDA time total": every GPU op in the trace.
        "self_cuda_time_total_us": sum(op.get("dur", 0) for op in ops) if has_gpu else None,
        # GPU ops whose launch was not found; >0 means the trace lost events or lacks runtime rows.
        "unlaunched_gpu_ops": sum(1 for op in ops if _correlation(op) not in launched),
        "ranges": {name: _analyze_range(instances[name], launches_by_thread, ops_by_correlation,
                                        launches_of, gpu_annotations[name], has_gpu)
                   for name in names},
    }


def analyze_file(path, ranges=None) -> dict:
    result = analyze_events(load_events(path), ranges)
    return {"trace": str(path), **result}
