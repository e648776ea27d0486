"""`bench`: a timing sweep over shapes, every implementation at every shape.

Per (shape, implementation) one row: median time of the pass `--mode` names, TFLOP/s, % of the
measured matmul peak, the ratio to the fastest peer (any registry entry that is not ours), the
max abs error of the forward output against the float64 reference on that shape, and the wall
time of the first call.

Modes (`MODES`): "fwd" times the forward under no_grad. "bwd" times the backward alone: q, k, v
require grad, the forward runs once per input set outside the timed region, and each timed call
is `torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)` on that saved graph (grad, not
.backward(), so no accumulation into .grad is timed; retain_graph so one graph serves every call).
"fwd_bwd" times a forward plus `autograd.grad` of its output, a training step's attention.
dout is a fixed random normal tensor. An entry whose output carries no autograd graph is a row
with status 'unsupported' in the backward modes.

The time of one call is timing.py's: do_bench's median over a rotation of prepared input sets
on CUDA, CPU wall time (labelled so) elsewhere. The shapes are sweeps.py's, those `--shape`
lists (prefill), or one serving scenario's (scenarios.py: decode, chunked prefill, packed
sequences), whose module also decides what each entry can express, how it is asked, and the
reference and FLOPs of each case.

A row that cannot be timed says why (status unavailable, unsupported, skipped, oom or failed)
and the sweep goes on. The Python warnings an entry raises while it is prepared, run and timed
are kept in its row (`warnings`, warned.py) instead of printed. The JSON file is rewritten after
every row, so Ctrl-C keeps what finished, and `--resume` continues such a file: the same command
times only the rows it lacks (a long sweep can run in parts, e.g. on a machine with a time limit
per job).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

from attnscope.attention import registry
from attnscope.profile import runs, scenarios, sweeps, warned
from attnscope.profile.env import collect_env
from attnscope.profile.inputs import DEFAULT_DTYPE, DTYPES, resolve_device, resolve_impls
from attnscope.profile.memory import (SCORE_BYTES, SCORE_MEMORY_FRACTION, free_memory,
                                      out_of_memory, score_memory_skip)
from attnscope.profile.metrics import REF_MEMORY_FRACTION, pct_of_peak, tflops
from attnscope.profile.sweeps import SWEEPS, Case, resolve_sweep
from attnscope.profile.bench_table import format_table, progress_line, summary_line
from attnscope.profile.timing import DEFAULT_L2_BYTES, input_sets, median_ms, sync, timing_block

HELP = ("timing sweep over shapes: median time, TFLOP/s, ratio to the fastest peer, error against "
        "float64, first-call cost; ends with each of ours' geometric mean ratio to the best peer, "
        "over all shapes and over the kernel-bound ones")

MODES = ("fwd", "bwd", "fwd_bwd")


def _case_key(row: dict) -> tuple:
    return (tuple(row["shape"]), row["kv_heads"], row.get("kv_len"),
            tuple(row.get("seqlens") or ()), row.get("page_size"),
            tuple(row.get("window") or ()), row.get("softcap"), row["dtype"], row["causal"],
            row["mode"])


def _ours() -> set[str]:
    # Every registry entry that is not ours is a peer for ratio_to_best_peer.
    return {name for name, impl in registry.IMPLEMENTATIONS.items() if impl.ours}


# A peer whose error against the float64 reference is more than PEER_ERROR_FACTOR times the
# least error of any entry at the same shape, and above its dtype's floor (above what rounding
# alone gives there: bf16 outputs ~8e-3 at the swept shapes, fp16 ~1e-3, fp32 through TF32
# matmuls ~1e-3), computes something else (a window or mask it dropped: errors of ~0.1) and is
# not counted as the best peer. No committed H200 row comes near it.
PEER_ERROR_FACTOR = 8.0
PEER_ERROR_FLOOR = {"fp32": 1e-2, "fp16": 1e-2, "bf16": 3e-2}


def _wrong_peer(row: dict, least_error: dict) -> str | None:
    """Why an ok peer row is not counted as a best peer (its error; see PEER_ERROR_FACTOR), or
    None."""
    error, least = row.get("error"), least_error.get(_case_key(row))
    if error is None or least is None:
        return None
    if error > PEER_ERROR_FACTOR * least and error > PEER_ERROR_FLOOR.get(row["dtype"], 0.0):
        return (f"error {error:.3g} is over {PEER_ERROR_FACTOR:g}x the least at this shape "
                f"({least:.3g}): not counted as the best peer")
    return None


def with_peer_ratios(rows: list[dict]) -> list[dict]:
    """Copies of `rows` with ratio_to_best_peer = fastest ok peer's median / this row's median,
    per shape/dtype/causal/mode; > 1 means faster than every peer. None without a timed peer.
    A peer whose error says it computes something else (_wrong_peer) is left out of the best,
    and its row says why (`not_a_peer`)."""
    least_error: dict[tuple, float] = {}
    for row in rows:
        if row["status"] == "ok" and row.get("error") is not None:
            key = _case_key(row)
            least_error[key] = min(least_error.get(key, math.inf), row["error"])
    best: dict[tuple, float] = {}
    ours = _ours()
    wrong = {}
    for i, row in enumerate(rows):
        if row["status"] == "ok" and row["impl"] not in ours:
            why = _wrong_peer(row, least_error)
            if why:
                wrong[i] = why
                continue
            key = _case_key(row)
            best[key] = min(best.get(key, math.inf), row["median_ms"])
    out = []
    for i, row in enumerate(rows):
        peer_ms = best.get(_case_key(row))
        ok = row["status"] == "ok" and peer_ms is not None
        out.append({**row, "ratio_to_best_peer": peer_ms / row["median_ms"] if ok else None,
                    **({"not_a_peer": wrong[i]} if i in wrong else {})})
    return out


# A shape whose faster of ours and the best peer takes less than this is host-bound on a GPU:
# each side's time is its host cost a call, which swings between machines and jobs (on the
# H200 every implementation's read 1.3-3.5x its earlier times in one job), so the summary also
# gives the geometric mean over the other shapes, where the kernels decide.
KERNEL_BOUND_MS = 0.1
# the forward goal's per-shape floor: no shape below 0.95 of the best peer
SHAPE_FLOOR = 0.95


def _geomean(xs: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(x) for x in xs))


def geomean_ratios(rows: list[dict]) -> dict[str, dict]:
    """For each of ours: geometric mean of ratio_to_best_peer over the shapes where it has one
    (`shapes` of them); the same over the shapes where both it and the best peer take
    KERNEL_BOUND_MS or more (`geomean_ratio_kernel_bound`, None without such a shape, over
    `kernel_bound_shapes`); and how many shapes are below SHAPE_FLOOR."""
    summary = {}
    for name in sorted(_ours()):
        timed = [r for r in rows if r["impl"] == name and r["ratio_to_best_peer"] is not None]
        if not timed:
            continue
        ratios = [r["ratio_to_best_peer"] for r in timed]
        # the faster side's time: this row's, or the best peer's (its median x the ratio)
        bound = [r["ratio_to_best_peer"] for r in timed
                 if r["median_ms"] * min(1.0, r["ratio_to_best_peer"]) >= KERNEL_BOUND_MS]
        summary[name] = {"geomean_ratio_to_best_peer": _geomean(ratios), "shapes": len(ratios),
                         "kernel_bound_ms": KERNEL_BOUND_MS,
                         "geomean_ratio_kernel_bound": _geomean(bound) if bound else None,
                         "kernel_bound_shapes": len(bound),
                         "shapes_below_floor": sum(x < SHAPE_FLOOR for x in ratios),
                         "floor": SHAPE_FLOOR}
    return summary


# --- one row ---------------------------------------------------------------------------------

@dataclass
class _Context:
    device: torch.device
    dtype: str
    causal: bool
    mode: str
    warmup_ms: float
    rep_ms: float
    env: dict
    available: dict[str, tuple[bool, str]]


def _upstream_grad(q: torch.Tensor) -> torch.Tensor:
    # The gradient of the output, seeded like the inputs; normal, not ones (a sum's gradient).
    gen = torch.Generator(device=q.device).manual_seed(q.shape[-2] + q.shape[-1])
    return torch.randn(q.shape, generator=gen, device=q.device, dtype=q.dtype)


def _timed_call(forward, qkv, out, mode: str):
    """The zero-argument call timed for `mode`, given the prepared forward and its first output
    `out` (the graph "bwd" differentiates again and again; see the module docstring)."""
    if mode == "fwd":
        return forward
    dout = _upstream_grad(qkv[0])
    if mode == "fwd_bwd":
        return lambda: torch.autograd.grad(forward(), qkv, dout)
    return lambda: torch.autograd.grad(out, qkv, dout, retain_graph=True)


def _takes_causal(impl) -> bool:
    try:
        return "causal" in inspect.signature(impl.prepare).parameters
    except (TypeError, ValueError):  # builtins without a signature
        return False


def _row(ctx: _Context, case: Case, name: str) -> dict:
    return {"shape": case.shape, "kv_heads": case.kv_heads, "scenario": case.scenario,
            "kv_len": case.keys, "seqlens": list(case.seqlens) if case.seqlens else None,
            "page_size": case.page_size,
            # a window and a softcap only where set: rows without them read as before
            **{k: list(v) if k == "window" else v for k, v in scenarios.options(case).items()},
            "note": "", "dtype": ctx.dtype,
            "causal": ctx.causal, "mode": ctx.mode, "impl": name, "status": "ok", "reason": "",
            "median_ms": None, "tflops": None, "pct_of_peak": None, "ratio_to_best_peer": None,
            "error": None, "error_compared": None, "first_call_ms": None, "input_sets": None,
            "warnings": [],
            # Versions on every row, so rows copied out of their file still say what ran them.
            "torch": ctx.env.get("torch"), "triton": ctx.env.get("triton")}


def bench_one(ctx: _Context, case: Case, impl, inputs, reference, free_bytes) -> dict:
    """Time one implementation at one shape; never raises except for KeyboardInterrupt. The
    warnings raised meanwhile go into the row's `warnings` (warned.py), each distinct one once."""
    with warned.kept_warnings() as kept:
        row = _bench_one(ctx, case, impl, inputs, reference, free_bytes)
    return {**row, "warnings": kept}


def _bench_one(ctx: _Context, case: Case, impl, inputs, reference, free_bytes) -> dict:
    row = _row(ctx, case, impl.name)
    ok, why = ctx.available[impl.name]
    if not ok:
        return {**row, "status": "unavailable", "reason": why}
    if not ctx.causal and not _takes_causal(impl):
        return {**row, "status": "unsupported",
                "reason": "prepare() takes no causal argument (causal only)"}
    cannot = scenarios.unsupported(impl, case, ctx.mode)
    if cannot:
        return {**row, "status": "unsupported", "reason": cannot}
    row["note"] = scenarios.note(impl, case, ctx.causal)
    skip = score_memory_skip(impl, case, free_bytes, ctx.mode)
    if skip:
        return {**row, "status": "skipped", "reason": skip}
    try:
        options = scenarios.options(case)
        forward = scenarios.prepare(impl, inputs[0], ctx.causal, **options)
        # First call on this shape in this process: what a user waits for (JIT, autotune, plans);
        # in the backward modes, the first forward and backward together.
        t0 = time.perf_counter()
        out = forward()
        if ctx.mode != "fwd" and out.grad_fn is None:
            return {**row, "status": "unsupported",
                    "reason": "forward only: its output carries no autograd graph"}
        first = _timed_call(forward, inputs[0].qkv, out, ctx.mode)
        if ctx.mode != "fwd":
            first()
        sync(ctx.device)
        row["first_call_ms"] = (time.perf_counter() - t0) * 1e3
        q = inputs[0].qkv[0]
        if tuple(out.shape) != tuple(q.shape):
            return {**row, "status": "failed",
                    "reason": f"output shape {list(out.shape)}, expected {list(q.shape)}"}
        if reference is not None:
            with torch.no_grad():
                row["error"] = scenarios.error(out, *reference)
            row["error_compared"] = reference[1]
        if ctx.mode != "bwd":
            del out  # "bwd" keeps it: the first timed call differentiates its graph
        calls = [first]
        for more in inputs[1:]:
            other = scenarios.prepare(impl, more, ctx.causal, **options)
            calls.append(_timed_call(other, more.qkv, other() if ctx.mode == "bwd" else None,
                                     ctx.mode))
        row["input_sets"] = len(calls)
        ms = median_ms(calls, ctx.device, ctx.warmup_ms, ctx.rep_ms)
    except torch.OutOfMemoryError as exc:
        return {**row, "status": "oom", "reason": str(exc).splitlines()[0]}
    except Exception as exc:  # noqa: BLE001 -- one entry's failure must not end the sweep
        # an entry refusing its input (GQA, dtype, head_dim; scenarios.refuses), else a failure
        if scenarios.refuses(exc):
            return {**row, "status": "unsupported", "reason": f"{type(exc).__name__}: {exc}"}
        first = str(exc).splitlines()[0] if str(exc) else ""
        return {**row, "status": "failed", "reason": f"{type(exc).__name__}: {first}"}
    flops = scenarios.flops(case, ctx.causal, ctx.mode)
    row.update(median_ms=ms, tflops=tflops(flops, ms * 1e-3))
    row["pct_of_peak"] = pct_of_peak(row["tflops"], ctx.dtype, ctx.env)
    if row["error"] is not None and not math.isfinite(row["error"]):
        row.update(status="failed", reason="output is not finite", error=None)
    return row


# --- output ----------------------------------------------------------------------------------

def _write_json(path: str, header: dict, rows: list[dict], complete: bool) -> None:
    rows = with_peer_ratios(rows)
    head = json.dumps({**header, "complete": complete, "summary": geomean_ratios(rows)}, indent=1)
    # One row per line: a results file under git diffs row by row.
    body = ",\n".join("  " + json.dumps(row) for row in rows)
    runs.write_text(path, f'{head[:-2]},\n "rows": [\n{body}\n ]\n}}\n')


# --- CLI ---------------------------------------------------------------------------------------

def add_arguments(parser) -> None:
    parser.add_argument("--sweep", default=None,
                        help=f"named shape sweep: {', '.join(SWEEPS)} ('serving': decode, "
                        "chunked prefill, packed sequences and paged decode) (default: "
                        "'default' on CUDA, 'cpu' on the CPU)")
    parser.add_argument("--scenario", choices=scenarios.SCENARIOS, default=None,
                        help="time one serving scenario at its preset shape instead of a sweep: "
                        "prefill (q_len == kv_len), decode (q_len 1-8 on a long KV cache), "
                        "chunked (new queries on a longer cache), varlen (packed sequences), "
                        "paged (decode on a paged KV cache); causal aligned bottom-right when "
                        "q_len < kv_len")
    parser.add_argument("--shape", nargs="+", default=None, metavar="B,H,S,D[,KV]",
                        help="time these prefill shapes instead of a sweep (q_len == kv_len; "
                        "batch, query heads, sequence length, head_dim and optionally K/V heads, "
                        "e.g. --shape 1,8,256,128 64,32,1024,128,8); --dtype and --kv-heads "
                        "apply as to a sweep's shapes")
    parser.add_argument("--q-len", type=int, default=None, metavar="N",
                        help="queries per sequence of --scenario's shape (default: its preset)")
    parser.add_argument("--kv-len", type=int, default=None, metavar="N",
                        help="keys per sequence of --scenario's shape, >= --q-len (default: its "
                        "preset; q_len for prefill)")
    parser.add_argument("--page-size", type=int, default=None, metavar="N",
                        help="keys per page of --scenario paged's KV cache (default: its preset, "
                        "128 on CUDA)")
    scenarios.add_option_arguments(parser)
    parser.add_argument("--impl", nargs="+", metavar="NAME",
                        help="implementations to time, in this order (default: every registered "
                        "one; `attnscope list` names them)")
    parser.add_argument("--dtype", choices=list(DTYPES), default=None,
                        help="input dtype of the shapes that name none (the wide sweep's name "
                        "theirs) (default: bf16 on CUDA, as in the peers' measurements; "
                        "fp32 on the CPU, where the Triton interpreter gets bf16 wrong)")
    parser.add_argument("--no-causal", dest="causal", action="store_false",
                        help="full attention instead of causal; entries whose prepare() takes no "
                        "`causal` argument are rows with status 'unsupported'")
    parser.add_argument("--kv-heads", type=int, default=None, metavar="N",
                        help="K/V heads for every shape (GQA/MQA; must divide the query heads); "
                        "default: each shape's own")
    parser.add_argument("--mode", choices=list(MODES), default="fwd",
                        help="pass to time: fwd (forward, no_grad), bwd (backward alone, through "
                        "a graph built by one untimed forward), fwd_bwd (both); TFLOP/s count "
                        "the backward as 2.5x the forward (default: fwd)")
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="write results here, rewritten after every row so an interrupted "
                        "run keeps its finished rows (default: no file)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the --json file an interrupted run of the same command "
                        "left: keep its rows and time only the (shape, implementation) pairs it "
                        "lacks; refused when the file's sweep or shapes (with their window, "
                        "softcap, dtype and causality), mode, implementations, device and GPU, "
                        "--warmup-ms/--rep-ms or torch/Triton versions differ from this run's")
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None,
                        help="where to run (default: cuda when available, else cpu with CPU "
                        "wall-clock timing)")
    parser.add_argument("--warmup-ms", type=float, default=50.0,
                        help="warm-up time per row in ms (do_bench's warmup; default 50, as the "
                        "peers' table)")
    parser.add_argument("--rep-ms", type=float, default=200.0,
                        help="timed repetition per row in ms (do_bench's rep; default 200, as the "
                        "peers' table)")


def _resolve(args):
    if not (math.isfinite(args.warmup_ms) and math.isfinite(args.rep_ms)
            and args.warmup_ms >= 0 and args.rep_ms > 0):
        raise ValueError(f"--warmup-ms must be finite and >= 0, --rep-ms finite and > 0, got "
                         f"{args.warmup_ms:g} and {args.rep_ms:g}")
    device = torch.device(resolve_device(args.device))
    args.dtype = args.dtype or DEFAULT_DTYPE[device.type]
    one_case = (args.scenario or args.q_len is not None or args.kv_len is not None
                or args.page_size is not None)
    given = [name for name, on in (("--sweep", args.sweep), ("--shape", args.shape),
                                   ("--scenario/--q-len/--kv-len/--page-size", one_case)) if on]
    if len(given) > 1:
        raise ValueError(f"{' and '.join(given)}: give one (a sweep times its own shapes, "
                         "--shape the listed ones, a scenario one shape)")
    if args.shape:
        sweep = "shapes"
        cases = tuple(dict.fromkeys(_shape_case(text, args.kv_heads) for text in args.shape))
    elif one_case:
        cases = (scenarios.scenario_case(args.scenario, device.type, q_len=args.q_len,
                                         kv_len=args.kv_len, kv_heads=args.kv_heads,
                                         page_size=args.page_size),)
        sweep = f"scenario {cases[0].scenario}"  # (lengths alone name theirs: q 4, kv 100 decode)
    else:
        sweep = args.sweep or ("default" if device.type == "cuda" else "cpu")
        cases = resolve_sweep(sweep, args.kv_heads)
    cases = tuple(dict.fromkeys(scenarios.with_options(c, args.window, args.softcap, args.causal)
                                for c in cases))
    impls, notes = resolve_impls(args.impl)
    if not impls:
        raise ValueError("no implementations are registered")
    return device, sweep, cases, impls, notes


def _shape_case(text: str, kv_heads: int | None) -> Case:
    # One --shape value, B,H,S,D[,KV], as a prefill case; --kv-heads replaces KV
    fields = text.split(",")
    try:
        values = [int(f) for f in fields]
    except ValueError:
        values = []
    if len(values) not in (4, 5) or min(values) < 1:
        raise ValueError(f"--shape {text!r}: expected B,H,S,D or B,H,S,D,KV, positive integers "
                         "(batch, query heads, sequence length, head_dim, K/V heads)")
    batch, heads, seq, head_dim = values[:4]
    kv = kv_heads if kv_heads is not None else (values[4] if len(values) == 5 else heads)
    if kv < 1 or heads % kv:
        raise ValueError(f"--shape {text!r}: K/V heads {kv} must divide the query heads {heads}")
    return sweeps.case(batch, heads, seq, head_dim, kv_heads=kv)


def _check_json_path(path: str) -> None:
    """ValueError, saying why, when --json could not be written."""
    target = os.path.abspath(path)
    if os.path.isdir(target):
        raise ValueError(f"--json {path} is a directory; give a file name such as "
                         f"{os.path.join(path, 'bench.json')}")
    if runs.not_a_file(target):  # /dev/null: the atomic rewrite would replace the device
        raise ValueError(f"--json {path} exists and is not a regular file (a device or a pipe): "
                         f"the results are rewritten by replacing the file; give a file name, or "
                         f"no --json")
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with tempfile.TemporaryFile(dir=os.path.dirname(target)):
            pass
    except (FileExistsError, NotADirectoryError) as exc:  # a file where a folder should be
        parent = next((p for p in _parents(target) if os.path.isfile(p)), None)
        why = f"{parent} is a file, not a folder" if parent else exc.strerror or exc
        raise ValueError(f"cannot write --json {path}: {why}") from None
    except OSError as exc:
        raise ValueError(f"cannot write --json {path}: {exc.strerror or exc}") from None


def _parents(path: str):
    while os.path.dirname(path) != path:
        path = os.path.dirname(path)
        yield path


MODE_TIMED = {
    "fwd": "the forward under torch.no_grad",
    "bwd": "torch.autograd.grad(out, (q, k, v), dout, retain_graph=True) on a graph built by one "
           "untimed forward per input set: the backward alone",
    "fwd_bwd": "forward, then torch.autograd.grad(out, (q, k, v), dout)",
}


def _reference_or_none(inputs, case: Case, causal: bool, device: torch.device):
    budget = REF_MEMORY_FRACTION * (free_memory(device) or 2**31)
    try:
        with torch.no_grad():  # the backward modes run with grad enabled
            return scenarios.reference(inputs, causal, budget, **scenarios.options(case))
    except RuntimeError as exc:  # the budget is an estimate; rows then carry no error
        if not out_of_memory(exc):
            raise
        print("bench: the float64 reference ran out of memory; no errors at this shape",
              file=sys.stderr)
        return None


def _make_inputs(case: Case, dtype: torch.dtype, device: torch.device, index: int):
    # Seeded per shape and set, so every implementation sees the same data.
    return scenarios.case_inputs(case, dtype, device, seed=1000 * index + case.seq + case.head_dim,
                                 draw_on=device)


def _with_grad(inputs):
    return dataclasses.replace(inputs, qkv=tuple(t.requires_grad_() for t in inputs.qkv))


def _case_rows(ctx: _Context, case: Case, impls, l2_bytes: int | None):
    """Rows of one shape, one per implementation, all on the same inputs and reference."""
    if case.dtype:  # the wide sweep's cases carry their own dtype
        ctx = dataclasses.replace(ctx, dtype=case.dtype)
    dtype = DTYPES[ctx.dtype]
    q_rows, kv_rows = ((sum(case.seqlens),) * 2 if case.seqlens
                       else (case.batch * case.seq, case.batch * case.keys))
    set_bytes = 2 * (q_rows * case.heads + kv_rows * case.kv_heads) * case.head_dim * \
        dtype.itemsize  # q, out, k, v
    n_sets = 1 if ctx.device.type == "cpu" else input_sets(set_bytes, l2_bytes)
    try:
        inputs = [_make_inputs(case, dtype, ctx.device, i) for i in range(n_sets)]
        if ctx.mode != "fwd":
            inputs = [_with_grad(one) for one in inputs]
    except RuntimeError as exc:  # the shape's inputs alone do not fit: every entry's row says so
        if not out_of_memory(exc):
            raise
        reason = f"its inputs do not fit in memory: {str(exc).splitlines()[0]}"
        for impl in impls:  # (an entry that cannot run here says that first)
            ok, why = ctx.available[impl.name]
            yield {**_row(ctx, case, impl.name), "status": "oom" if ok else "unavailable",
                   "reason": reason if ok else why}
        return
    reference = _reference_or_none(inputs[0], case, ctx.causal, ctx.device)
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()  # free memory must not count the reference's cached blocks
    free = free_memory(ctx.device)
    for impl in impls:
        yield bench_one(ctx, case, impl, inputs, reference, free)
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()  # the next entry starts from the same free memory


def _case_record(c: Case) -> dict:
    # page_size, window and softcap only where a case has them, so the header of a sweep without
    # them reads as it did before the fields (--resume compares headers)
    record = dataclasses.asdict(c)
    for field in ("page_size", "window", "softcap"):
        if record[field] is None:
            del record[field]
    return record


def _header(env: dict, sweep: str, cases, device: torch.device, l2_bytes: int | None,
            args) -> dict:
    return {
        "env": env, "command": list(sys.argv), "sweep": sweep, "device": device.type,
        # The torch/Triton pair every row ran on (each row repeats it), and the swept shapes.
        "torch": env.get("torch"), "triton": env.get("triton"),
        "cases": [_case_record(c) for c in cases],
        "mode": args.mode, "timed": MODE_TIMED[args.mode],
        "timing": timing_block(device, l2_bytes, args),
        "first_call": "first_call_ms: wall time of the first forward() on that shape in this "
        "process (with its first backward in the bwd and fwd_bwd modes; prepare() excluded), "
        "synchronized; includes Triton JIT compilation and "
        "autotuning unless an earlier shape or the on-disk Triton cache already had them, and "
        "torch.compile/cuDNN plan building for the entries that use them",
        "error": "max abs difference of the forward output against attention_reference in "
        "float64 on the same inputs (input set 0), in every mode; error_compared says which "
        "batch*heads and query rows",
        "warnings": "each row's distinct Python warnings (category: first line) raised while "
        "its entry was prepared, run and timed; kept here, not printed",
        "skip_rule": f"entries that materialize the scores skipped when B*H*q_len*kv_len*"
        f"{SCORE_BYTES} (packed sequences: H*total^2*{SCORE_BYTES}) "
        f"bytes > {SCORE_MEMORY_FRACTION:.0%} of free memory",
    }


# What a resumed file must share with the run that continues it: the same rows would be timed,
# with the same timer and settings (warm-up, repetitions, L2 size) on the same kind of GPU.
RESUME_FIELDS = ("sweep", "device", "torch", "triton", "cases", "mode", "timing")


def _gpu_name(header: dict):
    return ((header.get("env") or {}).get("gpu") or {}).get("name")


def _resumed_rows(path: str, header: dict, ctx: _Context, cases, impls) -> list[dict]:
    """The rows an earlier run of the same command wrote to `path`, in the order this run would
    time them (shape by shape, each implementation in turn; each row the same implementation and
    `_case_key` as this run's would be); [] when the file does not exist. ValueError, saying what
    differs, when the file is not such a run's."""
    if not os.path.exists(path):
        return []
    try:
        with open(path) as f:
            saved = json.load(f)
        if not isinstance(saved, dict):
            raise TypeError(f"a JSON {type(saved).__name__}, not an object")
        if saved.get("command") == "compare" or "sweep" not in saved:
            raise TypeError("it is a compare run's results.json" if saved.get("command")
                            == "compare" else "it has no sweep field")
        rows = saved["rows"]
        if not (isinstance(rows, list) and all(isinstance(row, dict) for row in rows)):
            raise TypeError("its rows are not a list of objects")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--resume: cannot read {path} as a bench file: {exc}") from None
    for field in RESUME_FIELDS:
        current = json.loads(json.dumps(header[field]))  # as the file holds it (lists, not tuples)
        if saved.get(field) != current:
            raise ValueError(f"--resume: {path} has {field} {_differs(saved.get(field), current)}"
                             f"; give another --json or the same command")
    if _gpu_name(saved) != _gpu_name(header):
        raise ValueError(f"--resume: {path} was timed on {_gpu_name(saved) or 'no GPU'}, this run "
                         f"is on {_gpu_name(header) or 'no GPU'}; give another --json")
    # the rows this run would write, as _case_rows makes them (a case's own dtype wins)
    expected = [_row(dataclasses.replace(ctx, dtype=case.dtype) if case.dtype else ctx, case,
                     impl.name) for case in cases for impl in impls]
    if len(rows) > len(expected):
        raise ValueError(f"--resume: {path} has {len(rows)} rows, this run times "
                         f"{len(expected)}; give the same --impl list")
    for i, (row, want) in enumerate(zip(rows, expected)):
        try:
            same = row["impl"] == want["impl"] and _case_key(row) == _case_key(want)
        except (KeyError, TypeError):
            same = False
        if not same:
            raise ValueError(f"--resume: row {i} of {path} is {_row_label(row)}, where this run "
                             f"times {_row_label(want)}; give the same --impl list and flags")
    # The file keeps its first run's command and environment; each resume is listed after it.
    header["command"], header["env"] = saved.get("command"), saved.get("env")
    header["resumed"] = [*saved.get("resumed", []),
                         {"command": list(sys.argv), "from_row": len(rows),
                          "date": ctx.env.get("date"), "host": ctx.env.get("host")}]
    return rows


def _row_label(row: dict) -> str:
    # what _case_key compares, as a reader names it (the fields a row has)
    extra = ", ".join(f"{name} {row[name]}" for name in ("kv_len", "seqlens", "page_size",
                                                         "window", "softcap")
                      if row.get(name) is not None)
    return (f"{row.get('impl')} at {row.get('shape')} kv_heads {row.get('kv_heads')} "
            f"{row.get('dtype')} {'causal' if row.get('causal') else 'full'} {row.get('mode')}"
            + (f" ({extra})" if extra else ""))


def _differs(saved, current) -> str:
    """`saved` against `current`, short: the first case or key where they part, else both."""
    if isinstance(saved, list) and isinstance(current, list):
        for i, (a, b) in enumerate(zip(saved, current)):
            if a != b:  # the fields where two cases part, not two cut-off objects
                return (f"case {i}: {_differs(a, b)}" if isinstance(a, dict)
                        and isinstance(b, dict) else f"case {i} {_short(a)} where this run "
                                                     f"has {_short(b)}")
        return f"{len(saved)} cases, this run {len(current)}"
    if isinstance(saved, dict) and isinstance(current, dict):
        keys = [k for k in dict.fromkeys([*saved, *current]) if saved.get(k) != current.get(k)]
        return ", ".join(f"{k} {_short(saved.get(k))} where this run has {_short(current.get(k))}"
                         for k in keys[:3])
    return f"{_short(saved)}, this run {_short(current)}"


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _available(impl, device: torch.device) -> tuple[bool, str]:
    try:
        return impl.available(device)
    except Exception as exc:  # noqa: BLE001 -- a broken check makes its rows unavailable
        return False, f"available() raised {type(exc).__name__}: {exc}"


def run(args) -> int:
    if args.mode != "bwd":
        return _run(args)
    # "bwd" differentiates one saved graph again and again (retain_graph=True); a compiled entry
    # (flex) would otherwise hand its saved buffers to the first backward (AOT autograd's donated
    # buffers) and refuse every later one. For this run only ("fwd_bwd" keeps them).
    import torch._functorch.config as functorch_config
    with functorch_config.patch(donated_buffer=False):
        return _run(args)


def _run(args) -> int:
    try:
        device, sweep, cases, impls, notes = _resolve(args)
        if args.resume and not args.json:
            raise ValueError("--resume continues a --json file: give --json PATH")
        if args.json:
            _check_json_path(args.json)  # now, not after the first row's minutes of timing
            if not args.resume and os.path.exists(args.json):
                notes = [*notes, f"bench: note: {args.json} exists and is overwritten from the "
                                 f"first row on (--resume continues it instead)"]
    except ValueError as exc:
        print(f"bench: error: {exc}", file=sys.stderr)
        return 2
    for note in notes:
        print(note, file=sys.stderr)
    env = collect_env()
    gpu = env.get("gpu") or {}
    l2_bytes = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        l2_bytes = int(getattr(props, "L2_cache_size", 0) or DEFAULT_L2_BYTES)
    ctx = _Context(
        device=device, dtype=args.dtype, causal=args.causal, mode=args.mode,
        warmup_ms=args.warmup_ms, rep_ms=args.rep_ms,
        env=env,
        available={impl.name: _available(impl, device) for impl in impls})
    header = _header(env, sweep, cases, device, l2_bytes, args)
    rows: list[dict] = []
    if args.resume:
        try:
            rows = _resumed_rows(args.json, header, ctx, cases, impls)
        except ValueError as exc:
            print(f"bench: error: {exc}", file=sys.stderr)
            return 2
        print(f"bench: resuming {args.json}: {len(rows)} rows kept", file=sys.stderr)
    time_label = "median ms" if device.type == "cuda" else "CPU wall ms"
    total = len(cases) * len(impls)
    print(f"bench: sweep {sweep!r}, {len(cases)} shapes x {len(impls)} implementations, "
          f"{args.dtype} {'causal' if args.causal else 'full'} {args.mode}"
          f"{scenarios.describe_options(cases[0])} on {gpu.get('name') or device.type}; "
          f"timer: {header['timing']['timer']}", file=sys.stderr)
    done = len(rows)  # resumed rows: the first cases' implementations, in order
    try:
        with torch.set_grad_enabled(args.mode != "fwd"):
            for i, case in enumerate(cases):
                todo = impls[max(0, done - i * len(impls)):]
                if not todo:
                    continue
                for row in _case_rows(ctx, case, todo, l2_bytes):
                    rows.append(row)
                    print(progress_line(len(rows), total, row), file=sys.stderr)
                    if args.json:
                        _write_json(args.json, header, rows, complete=False)
        if args.json:
            _write_json(args.json, header, rows, complete=True)
    except KeyboardInterrupt:
        print(format_table(with_peer_ratios(rows), time_label))
        if args.json:
            print(f"bench: {len(rows)} of {total} rows kept in {args.json}; the same command "
                  f"with --resume times the rest", file=sys.stderr)
        raise
    except OSError as exc:  # a full disk, or a folder that turned unwritable mid-run
        print(format_table(with_peer_ratios(rows), time_label))  # what was measured, on stdout
        print(f"bench: error: cannot write --json {args.json}: {exc.strerror or exc}; "
              f"{len(rows)} rows measured (above), the file keeps what was last written",
              file=sys.stderr)
        return 1
    final = with_peer_ratios(rows)
    print(format_table(final, time_label))
    for name, text in dict.fromkeys((r["impl"], r["note"]) for r in final if r["note"]):
        print(f"note: {name}: {text}")
    for r in final:
        if r.get("not_a_peer"):
            print(f"note: {r['impl']} at {r['shape']}: {r['not_a_peer']}")
    for line in warned.notes(final, 'the JSON rows\' "warnings"'):
        print(line)
    for name, s in geomean_ratios(final).items():
        print(summary_line(name, s))
    if device.type == "cpu":
        print("note: CPU wall time on a machine without CUDA; not comparable with GPU figures")
    return 0
