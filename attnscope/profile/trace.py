"""What a Kineto trace says about each forward: pure Python over the trace file, no GPU needed.

A forward is one `record_function` range (a `user_annotation` event). A GPU op (kernel, memcpy,
memset) belongs to it when the CPU call that launched it (a `cuda_runtime` or `cuda_driver`
event, joined to the op by `args.correlation`) starts inside the range, on the range's thread,
or inside a backward node that autograd's engine runs on another thread during the range (an
`autograd::engine::evaluate_function` op): torch.autograd.grad inside the range (compare --mode
fwd_bwd) hands a GPU graph's nodes to the engine's per-device worker thread, which launches
their kernels while the calling thread waits inside the range. (Ranges that overlap in time on
two threads would both take such a backward's launches; compare's ranges run one after
another on one thread.)
Launch time, not GPU time, decides: the GPU runs behind the CPU, so a forward's kernels often
execute after its range has closed. `ProfilerStep#N` ranges are the profiler's own and skipped.

Times are in microseconds, as in the trace. Per range:
- `cuda_time_avg_us`: sum of the durations of the forward's GPU ops (busy GPU time; gaps
  between kernels not counted), averaged over forwards. TFLOP/s figures divide by this.
- `gpu_span_avg_us`: first GPU op start to last GPU op end, averaged: busy time plus the gaps,
  the extent the trace's `gpu_user_annotation` row draws for the range (for a forward; Kineto
  draws that row from the range thread's launches only, so it leaves out a backward's).
- `self_cuda_time_total_us`: sum of the durations of every GPU op of every forward.
- `cpu_time_avg_us`: the range's own duration on the CPU, averaged.
GPU figures are None for a trace without any GPU activity (a CPU-only profile).
"""

from __future__ import annotations

import bisect
import gzip
import json
import re
import zlib
from collections import Counter, defaultdict
from pathlib import Path

from attnscope.profile import occupancy, runs
from attnscope.profile.tensor_cores import TIER_STRENGTH, name_verdict

# Category names in current Kineto, and the older capitalised ones (PyTorch <= 1.9 traces).
_CATEGORY_ALIASES = {"kernel": "kernel", "gpu_memcpy": "gpu_memcpy", "memcpy": "gpu_memcpy",
                     "gpu_memset": "gpu_memset", "memset": "gpu_memset",
                     "cuda_runtime": "cuda_runtime", "runtime": "cuda_runtime",
                     "cuda_driver": "cuda_driver", "driver": "cuda_driver",
                     "user_annotation": "user_annotation",
                     "gpu_user_annotation": "gpu_user_annotation", "cpu_op": "cpu_op"}
GPU_OP_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
PROFILER_STEP_PREFIX = "ProfilerStep"
# The op autograd's engine records around each backward node it runs (RECORD_FUNCTION in
# Engine::thread_main, around its call to evaluate_function, with the node's name appended):
# launches inside one of these, on another thread during a range, are the range's backward
AUTOGRAD_NODE_PREFIX = "autograd::engine::evaluate_function"
# The kernel-event args `compare` writes (annotate_kernels): the verdict as a whole, which
# analysis reads back so that `analyze` on compare's trace says what compare's table says, and
# the two lines a Perfetto reader sees (traces written before the whole verdict was kept carry
# only these; _recorded_verdict reads them too).
VERDICT_ARG = "attnscope verdict"
VERDICT_LINE_ARG, EVIDENCE_LINE_ARG = "attnscope tensor cores", "attnscope evidence"
_COUNT = re.compile(r"(\d+) ([A-Z][\w.]*)")
_INSTRUCTIONS = re.compile(r" in (\d+) instructions")
_WEAKER = re.compile(r"\(weaker tiers: (.*)\)\s*$")


def find_row_trace(folder, row) -> Path | None:
    """A results row's trace: where compare wrote it, else the same file name under
    <folder>/<impl>/ (a results folder moved or copied elsewhere). None when neither exists."""
    if not row.get("trace"):
        return None
    written = Path(row["trace"])
    for candidate in (written, Path(folder) / row["impl"] / written.name):
        if candidate.is_file():
            return candidate
    return None


class TraceError(ValueError):
    """The file is not a readable Kineto/Chrome trace; the message says what is wrong."""


def load_events(path) -> list[dict]:
    """The trace's events from a .json or .json.gz file (object with traceEvents, or bare list)."""
    return _events_of(_load_document(path))


def _events_of(data) -> list[dict]:
    events = data.get("traceEvents") if isinstance(data, dict) else data
    return [e for e in events if isinstance(e, dict)]


def _load_document(path):
    """The whole JSON document (metadata included), checked to hold a traceEvents list."""
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
    return data


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _complete_events(events):
    """Duration ('X') events with their category normalised; others (metadata, flows) dropped.
    An event whose time fields are not numbers makes the trace unreadable (TraceError)."""
    out = defaultdict(list)
    for e in events:
        cat = _CATEGORY_ALIASES.get(str(e.get("cat", "")).lower())
        if e.get("ph") == "X" and cat and "ts" in e:
            for field in ("ts", "dur"):
                if field in e and not _is_number(e[field]):
                    raise TraceError(f"trace event {e.get('name', '?')!r} ({cat}) has a "
                                     f"non-numeric {field!r}: {e[field]!r}; expected microseconds "
                                     f"as a number")
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


def _kernel_summary(name, ops, launches_of, forwards, devices=None):
    """One row per kernel name: count and time per forward, launch API, resources from args
    (the first launch's; `launch_shapes` lists each grid and block with its launches where the
    name's launches differ in them)."""
    args = ops[0].get("args") or {}
    shapes = Counter(tuple(_hashable((op.get("args") or {}).get(field))
                           for field in ("grid", "block")) for op in ops)
    occ = _occupancy(args, (devices or {}).get(args.get("device")))
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
        **({"launch_shapes": [{"grid": _listed(g), "block": _listed(b), "launches": n}
                              for (g, b), n in shapes.items()]} if len(shapes) > 1 else {}),
        **occ,
        "tensor_cores": _recorded_verdict(args) or name_verdict(name),
    }


def _hashable(value):
    return tuple(value) if isinstance(value, list) else value


def _listed(value):
    return list(value) if isinstance(value, tuple) else value


def _recorded_verdict(args) -> dict | None:
    """The Tensor Core verdict `compare` wrote into a kernel event's args, or None."""
    whole = args.get(VERDICT_ARG)
    if isinstance(whole, dict) and whole.get("evidence") in TIER_STRENGTH:
        return whole
    verdict, text = args.get(VERDICT_LINE_ARG), args.get(EVIDENCE_LINE_ARG)
    if not isinstance(verdict, str) or not isinstance(text, str):
        return None
    tier = text.split(":", 1)[0]
    if tier not in TIER_STRENGTH:
        return None
    recorded = {"verdict": verdict, "evidence": tier, "reason": f"recorded by compare: {text}"}
    weaker = _WEAKER.search(text)
    main = text[:weaker.start()] if weaker else text
    if tier in ("sass", "ptx"):
        counts = {opcode: int(n) for n, opcode in _COUNT.findall(main.split(":", 1)[1])}
        instructions = _INSTRUCTIONS.search(main)
        recorded["counts"] = {**counts, "instructions": int(instructions.group(1))
                              if instructions else 0}
    if weaker:
        pairs = (p.split(": ", 1) for p in weaker.group(1).split(", "))
        recorded["other"] = {t: v for t, v in (p for p in pairs if len(p) == 2)}
    return recorded


def _occupancy(args, props):
    """`occupancy_pct`: Kineto's `est. achieved occupancy %` where it is non-zero, else our
    estimate (`occupancy_source` says which): Kineto writes 0 for every kernel with more than
    48 KiB of shared memory. `occupancy_est_pct`: the estimate, whenever the trace's
    deviceProperties allow it (see occupancy.py)."""
    kineto, est = args.get("est. achieved occupancy %"), occupancy.estimate(props, args)
    if (kineto or 0) > 0 or (est is None and kineto == 0
                             and (args.get("shared memory") or 0) <= occupancy.KINETO_SMEM_LIMIT):
        pct, source = kineto, "kineto"
    else:
        pct, source = est, (occupancy.SOURCE if est is not None else None)
    return {"occupancy_pct": pct, "occupancy_source": source, "occupancy_est_pct": est}


def _launches_in(r, idx):
    """The launches made inside range instance `r`, in time order: on its thread, and inside
    the backward nodes autograd's engine ran on other threads meanwhile (_backward_nodes)."""
    found = _launches_between(_thread(r), r["ts"], _end(r), idx)
    for node in _backward_nodes(r, idx):
        found += _launches_between(_thread(node), node["ts"], _end(node), idx)
    return sorted(found, key=lambda e: (e["ts"], _correlation(e)))


def _launches_between(thread, start, end, idx):
    starts, launches = idx["launches_by_thread"].get(thread, ([], []))
    return launches[bisect.bisect_left(starts, start):bisect.bisect_right(starts, end)]


def _backward_nodes(r, idx):
    """The backward nodes (AUTOGRAD_NODE_PREFIX ops) that autograd's engine started on threads
    other than `r`'s while `r` was open, outermost only."""
    inside = [e for e in idx["autograd_nodes"]
              if _thread(e) != _thread(r) and r["ts"] <= e["ts"] <= _end(r)]
    outer, covered = [], {}
    for e in sorted(inside, key=lambda e: (e["ts"], -e.get("dur", 0))):
        if e["ts"] >= covered.get(_thread(e), float("-inf")):
            outer.append(e)
            covered[_thread(e)] = _end(e)
    return outer


def _ops_launched_by(launches, idx):
    return [op for launch in launches
            for op in idx["ops_by_correlation"].get(_correlation(launch), ())]


def _analyze_range(instances, idx, gpu_annotations):
    launches_of, has_gpu = idx["launches_of"], bool(idx["ops"])
    per_forward_ops = [_ops_launched_by(_launches_in(r, idx), idx) for r in instances]
    n = len(instances)
    all_ops = [op for ops in per_forward_ops for op in ops]
    by_cat = Counter(op["_cat"] for op in all_ops)
    kernels_by_name = defaultdict(list)
    for op in all_ops:
        if op["_cat"] == "kernel":
            kernels_by_name[op["name"]].append(op)
    kernels = sorted((_kernel_summary(name, ops, launches_of, n, idx.get("devices"))
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


def _index(events) -> dict:
    """What attribution needs: GPU ops by correlation, their launches (by thread, sorted) and the
    user ranges by name, each list in time order."""
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
    autograd_nodes = [e for e in cats["cpu_op"]
                      if str(e.get("name", "")).startswith(AUTOGRAD_NODE_PREFIX)]
    return {"cats": cats, "ops": ops, "ops_by_correlation": ops_by_correlation,
            "launches_of": launches_of, "launches_by_thread": launches_by_thread,
            "instances": instances, "autograd_nodes": autograd_nodes}


def _check_ranges(instances, ranges):
    missing = [name for name in ranges if name not in instances]
    if missing:
        found = ", ".join(sorted(instances)) or "none"
        raise TraceError(f"no range named {', '.join(map(repr, missing))} in the trace; "
                         f"ranges found: {found}")


def analyze_events(events, ranges=None, device_properties=None) -> dict:
    """Per-forward figures for each named range (default: every non-ProfilerStep user range).
    `device_properties`: the trace's `deviceProperties` list, for occupancy estimates."""
    idx = _index(events)
    idx["devices"] = {p.get("id"): p for p in device_properties or () if isinstance(p, dict)}
    ops, launches_of, instances = idx["ops"], idx["launches_of"], idx["instances"]
    if ranges is not None:
        _check_ranges(instances, ranges)
    gpu_annotations = defaultdict(list)
    for e in idx["cats"]["gpu_user_annotation"]:
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
        "ranges": {name: _analyze_range(instances[name], idx, gpu_annotations[name])
                   for name in names},
    }


def _top_level_cpu_ops(r, cats):
    """The CPU ops called directly inside range `r` on its thread (nested ops left out)."""
    inside = sorted((e for e in cats["cpu_op"] if _thread(e) == _thread(r)
                     and r["ts"] <= e["ts"] and _end(e) <= _end(r)),
                    key=lambda e: (e["ts"], -e.get("dur", 0)))
    top, covered_until = [], float("-inf")
    for e in inside:
        if e["ts"] >= covered_until:
            top.append(e)
            covered_until = _end(e)
    return top


def forward_events(events, range_name) -> list[dict]:
    """Each forward of a range with the events that drawing it needs, attributed exactly as
    analyze_events attributes them: {"range", "cpu_ops" (top level: the range thread's and the
    backward nodes run on other threads), "launches", "ops"}."""
    idx = _index(events)
    _check_ranges(idx["instances"], [range_name])
    forwards = []
    for r in idx["instances"][range_name]:
        launches = _launches_in(r, idx)
        cpu_ops = sorted(_top_level_cpu_ops(r, idx["cats"]) + _backward_nodes(r, idx),
                         key=lambda e: e["ts"])
        forwards.append({"range": r, "cpu_ops": cpu_ops, "launches": launches,
                         "ops": _ops_launched_by(launches, idx)})
    return forwards


def annotate_kernels(path, fields_by_name: dict[str, dict]) -> int:
    """Add `fields_by_name[kernel name]` to the args of each kernel event of the trace at `path`
    (what a reader sees on clicking the kernel in Perfetto), rewriting it in place, gzipped as
    before. Returns how many events were annotated."""
    path = Path(path)
    data = _load_document(path)
    with path.open("rb") as f:
        gzipped = f.read(2) == b"\x1f\x8b"
    annotated = 0
    for e in _events_of(data):  # the same dicts as in `data`, so edits land in the document
        if (_CATEGORY_ALIASES.get(str(e.get("cat", "")).lower()) == "kernel"
                and e.get("name") in fields_by_name):
            e["args"] = {**(e.get("args") or {}), **fields_by_name[e["name"]]}
            annotated += 1
    raw = json.dumps(data).encode()
    runs.write_bytes(path, gzip.compress(raw) if gzipped else raw)  # original kept on failure
    return annotated


def analyze_file(path, ranges=None) -> dict:
    """A trace file's figures (what `analyze --json` prints): {"trace": path, "gpu",
    "self_cuda_time_total_us", "unlaunched_gpu_ops", "ranges": {range name: per-forward figures
    (kernels, GPU ops, memcpy and memset per forward, CUDA busy time and span, CPU time, launch
    APIs, main kernel) and "kernels": one row per kernel name (_kernel_summary)}}."""
    data = _load_document(path)
    props = data.get("deviceProperties") if isinstance(data, dict) else None
    result = analyze_events(_events_of(data), ranges, props)
    return {"trace": str(path), **result}
