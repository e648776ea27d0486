"""`compare` (the default command): profile every implementation at one shape, side by side.

Per implementation: availability check, the seed recipe (capture.py), the trace analysis
(trace.py) of its forward ranges, error against the float64 reference. One row each in
`<out>/results.json`, rewritten after every row so an interrupted run keeps what it finished.
A row that cannot run (unavailable, unsupported dtype or shape, out of memory, any exception)
records why, and the run goes on.

On CUDA, Triton kernels get Tensor Core evidence from their compiled code (tier 2 of
tensor_cores.py), the fused kernel's compiled artifacts go to `<out>/fused/kernel/` (artifacts.py),
and every kernel event of the written traces carries its verdict, evidence and, for the fused
kernel, its source line and compiled configuration, for whoever clicks it in Perfetto.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from attnscope.attention import IMPLEMENTATIONS, attention_reference, get
from attnscope.profile import artifacts, report
from attnscope.profile import tensor_cores as tc
from attnscope.profile.capture import DTYPES, MODES, capture, make_inputs
from attnscope.profile.env import collect_env
from attnscope.profile.flops import attention_flops
from attnscope.profile.trace import analyze_file, annotate_kernels

HELP = "profile every available implementation at one shape; print the table, write results.json"
SHAPES = {"cuda": (8, 16, 1024, 64), "cpu": (1, 2, 128, 64)}  # seed shape; small enough for CPU
DEFAULT_DTYPE = {"cuda": "bf16", "cpu": "fp32"}
DEFAULT_OUT = "attnscope-out"
FUSED = "fused"  # the registry entry whose kernel is ours, with source and compiled artifacts
KERNEL_DIR = Path(FUSED, "kernel")  # under --out: where the report looks for its artifacts
CPU_NOTE = ("note: running on the CPU (no CUDA device requested or present): GPU columns are n/a, "
            "and the fused kernel runs through the Triton interpreter, so its CPU time is the "
            "interpreter's.")
# Messages PyTorch and the kernels raise when an implementation cannot take the dtype or shape.
_UNSUPPORTED_HINTS = ("No available kernel", "No viable backend", "not supported",
                      "only supports", "Unsupported", "not implemented")


def add_arguments(p):
    p.add_argument("--impl", nargs="+", metavar="NAME",
                   help="implementations to profile, in this order (default: all; see `list`)")
    p.add_argument("--batch", type=int, help="batch size (default 8 on CUDA, 1 on CPU)")
    p.add_argument("--heads", type=int, help="attention heads (default 16 on CUDA, 2 on CPU)")
    p.add_argument("--seq", type=int, help="sequence length (default 1024 on CUDA, 128 on CPU)")
    p.add_argument("--head-dim", type=int, help="head dimension (default 64)")
    p.add_argument("--dtype", choices=sorted(DTYPES),
                   help="input dtype (default bf16 on CUDA as in the blog, fp32 on CPU)")
    p.add_argument("--device", choices=("cuda", "cpu"),
                   help="where to run (default cuda when a GPU is present, else cpu)")
    p.add_argument("--mode", choices=MODES, default="fwd",
                   help="fwd: the blog's forward-only recipe (default); fwd_bwd: forward and "
                        "backward in each profiled range, FLOPs counted as 3.5x the forward")
    p.add_argument("--out", default=DEFAULT_OUT,
                   help=f"folder for traces, tables and results.json (default ./{DEFAULT_OUT})")
    p.add_argument("--report", action="store_true",
                   help="also write OUT/report.html (the `report` subcommand) at the end of the "
                        "run")
    p.add_argument("--dump-kernel", metavar="DIR",
                   help="write the fused kernel's TTIR, TTGIR, LLIR, PTX, SASS and a meta.json for "
                        f"the profiled shape to DIR (CUDA only; a CUDA run writes them to "
                        f"OUT/{KERNEL_DIR.as_posix()} by default)")


def resolve_device(requested):
    # On the CPU the fused kernel needs Triton's interpreter, which importing attnscope turns on
    # for machines without CUDA; elsewhere the `fused` row says how to get it.
    device = requested or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda, but torch sees no CUDA device")
    return device


def resolve_shape(args, device):
    """(batch, heads, seq, head_dim): the flags where given, else the device's default shape."""
    given = (args.batch, args.heads, args.seq, args.head_dim)
    shape = tuple(fallback if g is None else g for g, fallback in zip(given, SHAPES[device]))
    for flag, value in zip(("--batch", "--heads", "--seq", "--head-dim"), shape):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    return shape


def check_writable(out: Path):
    """Fail now, not after minutes of profiling, when the results could not be saved."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        raise ValueError(f"cannot write to --out {out}: {e.strerror or e}") from None


def write_results(out: Path, results: dict):
    # Replace in one step, so a Ctrl-C during the write leaves the previous complete file.
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(results, indent=1) + "\n")
    os.replace(tmp, out / "results.json")


def _classify(exc):
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return "oom"
    return "unsupported" if any(h in str(exc) for h in _UNSUPPORTED_HINTS) else "error"


def _first_line(exc):
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def _reference(q, k, v):
    """The float64 oracle, kept on the CPU so it never counts in a row's peak memory; None when
    it does not fit (its S x S float64 scores are 8x a bf16 naive's)."""
    try:
        return attention_reference(q, k, v).cpu()
    except torch.cuda.OutOfMemoryError:
        _progress("note: the float64 reference does not fit in GPU memory at this shape; "
                  "the error column stays empty")
        return None
    finally:
        if q.is_cuda:
            torch.cuda.empty_cache()


def profile_one(impl, q, k, v, reference, out: Path, device, dtype_name, env, mode="fwd") -> dict:
    row = {"impl": impl.name, "description": impl.description, "seed_script": impl.seed_script,
           "status": "ok", "reason": ""}
    ok, reason = impl.available(torch.device(device))
    if not ok:
        return {**row, "status": "unavailable", "reason": reason}
    try:
        cap = capture(impl, q, k, v, out, mode)
    except Exception as exc:  # noqa: BLE001 - any failure becomes this row's status
        return {**row, "status": _classify(exc), "reason": _first_line(exc)}
    analysis = analyze_file(cap.trace, [impl.name])["ranges"][impl.name]
    if device == "cuda":
        _add_compiled_evidence(analysis["kernels"])
    row["tensor_cores"] = tc.forward_summary(analysis["kernels"])
    output = cap.output.detach().to("cpu", torch.float64)
    row.update(reason=reason, trace=str(cap.trace), table=str(cap.table),
               peak_memory_mb=cap.peak_memory_mb, max_abs_error=None, **analysis)
    if not output.isfinite().all():
        row.update(status="error", reason="output holds NaN or inf")
    elif reference is not None:
        row["max_abs_error"] = (output - reference).abs().max().item()
    row["tflops"] = row["pct_of_peak"] = None
    if analysis["cuda_time_avg_us"]:
        flops = attention_flops(*q.shape[:3], k.shape[2], q.shape[3], causal=True, mode=mode)
        row["tflops"] = flops / (analysis["cuda_time_avg_us"] * 1e-6) / 1e12
        peak = (env.get("gpu") or {}).get("measured_bf16_peak_tflops")
        if peak and dtype_name in ("bf16", "fp16"):  # the measured peak is a 16-bit matmul's
            row["pct_of_peak"] = 100 * row["tflops"] / peak
    return row


def _add_compiled_evidence(kernels):
    """Tier 2: Triton kernels compiled in this process (fused, flex, inductor) are judged by
    their SASS/PTX; the name verdict stays under `other`."""
    compiled = tc.triton_verdicts([k["name"] for k in kernels])
    for k in kernels:
        k["tensor_cores"] = tc.combine(compiled.get(k["name"]), k["tensor_cores"])


def evidence_text(verdict: dict) -> str:
    """One line saying how a kernel's Tensor Core verdict is known, with its figures."""
    evidence = verdict.get("evidence", "name")
    if evidence == "counters":
        metrics = verdict.get("metrics", {})
        text = (f"counters: {fmt(metrics.get('matrix_instructions'), ',.0f')} matrix "
                f"instructions executed, tensor pipe {fmt(metrics.get(tc.TENSOR_PIPE_PCT), '.1f')}"
                f"% active")
    elif evidence in ("sass", "ptx"):
        counts = {k: n for k, n in verdict.get("counts", {}).items() if n and k != "instructions"}
        text = (f"{evidence}: " + (", ".join(f"{n} {k}" for k, n in counts.items()) or "none")
                + f" in {verdict.get('counts', {}).get('instructions', 0)} instructions")
    else:
        text = f"name: {verdict.get('reason', 'no evidence')}"
    weaker = ", ".join(f"{tier}: {v}" for tier, v in (verdict.get("other") or {}).items())
    return text + (f" (weaker tiers: {weaker})" if weaker else "")


def _kernel_fields(row, fused_meta):
    """Per kernel name, the args a reader of the trace in Perfetto sees on clicking a kernel."""
    fields = {k["name"]: {"attnscope tensor cores": k["tensor_cores"]["verdict"],
                          "attnscope evidence": evidence_text(k["tensor_cores"])}
              for k in row["kernels"]}
    ours_name = (fused_meta or {}).get("kernel") or artifacts.KERNEL  # Triton's or Gluon's
    if row["impl"] == FUSED and ours_name in fields:
        ours = fields[ours_name]
        ours["attnscope source"] = (fused_meta or {}).get("source") or artifacts.source_location()
        if fused_meta:
            config, compiled = fused_meta["config"], fused_meta["compiled"]
            ours["attnscope config"] = " ".join(f"{k}={v}" for k, v in config.items())
            ours["attnscope compiled"] = (
                f"registers/thread {compiled['registers_per_thread']}, spills "
                f"{compiled['spills']}, shared memory {compiled['shared_memory_bytes']} B")
    return fields


def _dump_kernel(q, k, v, folder: Path):
    """The fused kernel's artifacts for the profiled inputs; their meta, or None (said why)."""
    try:
        written = artifacts.dump(q, k, v, folder)
    except artifacts.NeedsGPU as e:
        _progress(f"--dump-kernel: {e}")
        return None
    except Exception as exc:  # noqa: BLE001 - the profile is complete without them
        _progress(f"warning: no compiled artifacts for {artifacts.KERNEL}: {_first_line(exc)}")
        return None
    _progress(f"compiled artifacts of {artifacts.KERNEL}: {folder}/ "
              f"({', '.join(p.name.removeprefix(artifacts.KERNEL) for p in written)})")
    return json.loads(written[-1].read_text())


def fmt(value, spec):
    """A table cell: the number formatted, or "-" when there is none."""
    return "-" if value is None else format(value, spec)


def _verdict_cell(summary):
    # Rows from before the column existed have no summary; ncu's merge writes the same shape.
    return f"{summary['verdict']} ({summary['evidence']})" if summary else "-"


# (header, value of an "ok" row, GPU-only?). GPU-only columns read "n/a" on a CPU run.
COLUMNS = (
    ("impl", lambda r: r["impl"], False),
    ("kernels/fwd", lambda r: fmt(r["kernels_per_forward"], "g"), True),
    ("GPU ops/fwd", lambda r: fmt(r["gpu_ops_per_forward"], "g"), True),
    ("Tensor Cores", lambda r: _verdict_cell(r.get("tensor_cores")), True),
    ("CUDA us/fwd", lambda r: fmt(r["cuda_time_avg_us"], ".1f"), True),
    ("CPU us/fwd", lambda r: fmt(r["cpu_time_avg_us"], ".1f"), False),
    ("TFLOP/s", lambda r: fmt(r["tflops"], ".1f"), True),
    ("% peak", lambda r: fmt(r["pct_of_peak"], ".0f"), True),
    ("peak MB", lambda r: fmt(r["peak_memory_mb"], ".0f"), True),
    ("max abs err", lambda r: fmt(r["max_abs_error"], ".1e"), False),
    ("launch API", lambda r: ",".join(r["launch_apis"]) or "-", True),
    ("status", lambda r: r["status"] + (f": {r['reason']}" if r["status"] != "ok" else ""),
     False),
)


def _cell(row, header, value, gpu_only, device):
    if header in ("impl", "status"):
        return value(row)
    if gpu_only and device == "cpu":
        return "n/a"
    return value(row) if row["status"] == "ok" else "-"


def table_cells(rows, device) -> list[list[str]]:
    """The comparison table as text cells, one list per row (no header)."""
    return [[_cell(r, *column, device) for column in COLUMNS] for r in rows]


def format_table(rows, device) -> str:
    cells = [[header for header, _, _ in COLUMNS]] + table_cells(rows, device)
    # Every column but the last (status, free text) is padded; numbers right-aligned.
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS) - 1)]
    lines = ["  ".join([line[0].ljust(widths[0])] + [c.rjust(w) for c, w in
                                                      zip(line[1:-1], widths[1:])] + [line[-1]])
             for line in cells]
    lines.insert(1, "-" * max(map(len, lines)))
    return "\n".join(lines)


def _progress(message):
    print(message, file=sys.stderr, flush=True)


def run(args) -> int:
    try:
        impls = [get(name) for name in (args.impl or IMPLEMENTATIONS)]
        device = resolve_device(args.device)
        shape = resolve_shape(args, device)
        out = Path(args.out)
        check_writable(out)
        if args.report:
            report.require_dependencies()  # now, not after minutes of profiling
    except (ValueError, report.ReportError) as e:
        print(f"attnscope compare: error: {e}", file=sys.stderr)
        return 2
    if args.dump_kernel and device == "cpu":
        _progress("--dump-kernel: needs a CUDA GPU; on the CPU the fused kernel runs in the "
                  "Triton interpreter, which compiles nothing. Skipped.")
    dtype_name = args.dtype or DEFAULT_DTYPE[device]
    env = collect_env()
    q, k, v = make_inputs(*shape, DTYPES[dtype_name], device)
    reference = _reference(q, k, v)
    results = {"command": "compare", "shape": dict(zip(("batch", "heads", "seq", "head_dim"),
                                                       shape)),
               "dtype": dtype_name, "device": device, "causal": True, "mode": args.mode,
               "flops_per_forward": attention_flops(*shape[:3], shape[2], shape[3], causal=True,
                                                    mode=args.mode),
               "env": env, "rows": []}
    write_results(out, results)
    _progress(f"attnscope compare: {len(impls)} implementations, shape {shape} "
              f"[batch, heads, seq, head_dim], {dtype_name}, {device}, out {out}")
    try:
        for i, impl in enumerate(impls, 1):
            _progress(f"[{i}/{len(impls)}] {impl.name} ...")
            row = profile_one(impl, q, k, v, reference, out, device, dtype_name, env,
                              args.mode)
            results["rows"].append(row)
            write_results(out, results)
            _progress(f"[{i}/{len(impls)}] {impl.name}: {row['status']}"
                      + (f" ({row['reason']})" if row["status"] != "ok" else ""))
            gc.collect()  # drop this implementation's buffers before the next one's peak memory
            if device == "cuda":
                torch.cuda.empty_cache()
    except KeyboardInterrupt:
        _progress(f"interrupted: {len(results['rows'])} finished rows kept in "
                  f"{out / 'results.json'}")
        raise
    if device == "cuda":
        _finish_cuda(args, results, out, q, k, v)
    print(format_table(results["rows"], device))
    if device == "cpu":
        print(CPU_NOTE)
    print("CUDA us/fwd is busy GPU time (sum of the forward's GPU ops); TFLOP/s divides by it. "
          f"Traces and tables under {out}/<impl>/; all figures in {out / 'results.json'}.")
    if args.report:
        print(f"report: {report.write_report(out, out / report.DEFAULT_NAME)}")
    return 0


def _finish_cuda(args, results, out: Path, q, k, v):
    """Compiled artifacts of the fused kernel, then the annotated traces (which cite them)."""
    fused_ok = any(r["impl"] == FUSED and r["status"] == "ok" for r in results["rows"])
    meta = None
    if args.dump_kernel or fused_ok:
        folder = Path(args.dump_kernel) if args.dump_kernel else out / KERNEL_DIR
        meta = _dump_kernel(q, k, v, folder)
        if meta:
            results["kernel_artifacts"] = str(folder)
            write_results(out, results)
    for row in results["rows"]:
        if row["status"] == "ok" and row["kernels"]:
            annotate_kernels(row["trace"], _kernel_fields(row, meta))
