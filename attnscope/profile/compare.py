"""`compare` (the default command): profile every implementation at one shape, side by side.

Per implementation: availability check, the seed recipe (capture.py), the trace analysis
(trace.py) of its forward ranges, error against the float64 reference. One row each in
`<out>/results.json`, rewritten after every row so an interrupted run keeps what it finished.
A row that cannot run (unavailable, unsupported dtype or shape, out of memory, any exception)
records why, and the run goes on.
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
from attnscope.profile.capture import DTYPES, capture, make_inputs
from attnscope.profile.env import collect_env
from attnscope.profile.flops import attention_flops
from attnscope.profile.trace import analyze_file

HELP = "profile every available implementation at one shape; print the table, write results.json"
SHAPES = {"cuda": (8, 16, 1024, 64), "cpu": (1, 2, 128, 64)}  # seed shape; small enough for CPU
DEFAULT_DTYPE = {"cuda": "bf16", "cpu": "fp32"}
DEFAULT_OUT = "attnscope-out"
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
    p.add_argument("--out", default=DEFAULT_OUT,
                   help=f"folder for traces, tables and results.json (default ./{DEFAULT_OUT})")


def resolve_device(requested):
    device = requested or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda, but torch sees no CUDA device")
    if device == "cpu":
        # The fused kernel is defined on first use; it reads this then (see attention/fused.py).
        os.environ["TRITON_INTERPRET"] = "1"
    return device


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


def profile_one(impl, q, k, v, reference, out: Path, device, dtype_name, env) -> dict:
    row = {"impl": impl.name, "description": impl.description, "seed_script": impl.seed_script,
           "status": "ok", "reason": ""}
    ok, reason = impl.available(torch.device(device))
    if not ok:
        return {**row, "status": "unavailable", "reason": reason}
    try:
        cap = capture(impl, q, k, v, out)
    except Exception as exc:  # noqa: BLE001 - any failure becomes this row's status
        return {**row, "status": _classify(exc), "reason": _first_line(exc)}
    analysis = analyze_file(cap.trace, [impl.name])["ranges"][impl.name]
    output = cap.output.detach().to("cpu", torch.float64)
    row.update(reason=reason, trace=str(cap.trace), table=str(cap.table),
               peak_memory_mb=cap.peak_memory_mb, max_abs_error=None, **analysis)
    if not output.isfinite().all():
        row.update(status="error", reason="output holds NaN or inf")
    elif reference is not None:
        row["max_abs_error"] = (output - reference).abs().max().item()
    row["tflops"] = row["pct_of_peak"] = None
    if analysis["cuda_time_avg_us"]:
        flops = attention_flops(*q.shape[:3], k.shape[2], q.shape[3], causal=True)
        row["tflops"] = flops / (analysis["cuda_time_avg_us"] * 1e-6) / 1e12
        peak = (env.get("gpu") or {}).get("measured_bf16_peak_tflops")
        if peak and dtype_name in ("bf16", "fp16"):  # the measured peak is a 16-bit matmul's
            row["pct_of_peak"] = 100 * row["tflops"] / peak
    return row


def _fmt(value, spec):
    return "-" if value is None else format(value, spec)


# (header, value of an "ok" row, GPU-only?). GPU-only columns read "n/a" on a CPU run.
COLUMNS = (
    ("impl", lambda r: r["impl"], False),
    ("kernels/fwd", lambda r: _fmt(r["kernels_per_forward"], "g"), True),
    ("GPU ops/fwd", lambda r: _fmt(r["gpu_ops_per_forward"], "g"), True),
    ("CUDA us/fwd", lambda r: _fmt(r["cuda_time_avg_us"], ".1f"), True),
    ("CPU us/fwd", lambda r: _fmt(r["cpu_time_avg_us"], ".1f"), False),
    ("TFLOP/s", lambda r: _fmt(r["tflops"], ".1f"), True),
    ("% peak", lambda r: _fmt(r["pct_of_peak"], ".0f"), True),
    ("peak MB", lambda r: _fmt(r["peak_memory_mb"], ".0f"), True),
    ("max abs err", lambda r: _fmt(r["max_abs_error"], ".1e"), False),
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


def format_table(rows, device) -> str:
    cells = [[header for header, _, _ in COLUMNS]]
    cells += [[_cell(r, *column, device) for column in COLUMNS] for r in rows]
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
        out = Path(args.out)
        check_writable(out)
    except ValueError as e:
        print(f"attnscope compare: error: {e}", file=sys.stderr)
        return 2
    default = SHAPES[device]
    shape = tuple(given or fallback for given, fallback in
                  zip((args.batch, args.heads, args.seq, args.head_dim), default))
    dtype_name = args.dtype or DEFAULT_DTYPE[device]
    env = collect_env()
    q, k, v = make_inputs(*shape, DTYPES[dtype_name], device)
    reference = _reference(q, k, v)
    results = {"command": "compare", "shape": dict(zip(("batch", "heads", "seq", "head_dim"),
                                                       shape)),
               "dtype": dtype_name, "device": device, "causal": True,
               "flops_per_forward": attention_flops(*shape[:3], shape[2], shape[3], causal=True),
               "env": env, "rows": []}
    write_results(out, results)
    _progress(f"attnscope compare: {len(impls)} implementations, shape {shape} "
              f"[batch, heads, seq, head_dim], {dtype_name}, {device}, out {out}")
    try:
        for i, impl in enumerate(impls, 1):
            _progress(f"[{i}/{len(impls)}] {impl.name} ...")
            row = profile_one(impl, q, k, v, reference, out, device, dtype_name, env)
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
    # `--report` (issue 6) hooks in here: render `out` to HTML once the rows are complete.
    print(format_table(results["rows"], device))
    if device == "cpu":
        print(CPU_NOTE)
    print("CUDA us/fwd is busy GPU time (sum of the forward's GPU ops); TFLOP/s divides by it. "
          f"Traces and tables under {out}/<impl>/; all figures in {out / 'results.json'}.")
    return 0
