"""`compare` (the default command): profile every implementation at one shape, side by side.

Per implementation: availability check, the seed recipe (capture.py), the trace analysis
(trace.py) of its forward ranges, error against the float64 reference. A row that cannot run
(unavailable, unsupported dtype or shape, out of memory, any exception) records why, and the run
goes on.

Each run writes into its own folder, `<out>/runs/<UTC time>/` (runs.py): results.json there is
rewritten after every row and marked `"complete": false` until the end, and `<out>/latest` is
pointed at the folder only once the run has finished; so an interrupted or failed run never
touches the last complete one, and keeps its own finished rows beside it. A lock refuses a second
run into the same `--out` while one is in progress.

Triton kernels compiled in this process (compiled.py) get Tensor Core evidence from their code
(tier 2 of tensor_cores.py); the entries that are ours hand over their compiled kernels
(`compiled_kernels()`, CompiledKernel records), whose artifacts go to `<run>/<impl>/kernel/`
(artifacts.py); every kernel event of the written traces carries its verdict and evidence (which
`analyze` reads back) and, for our kernels, their source line and compiled configuration, for
whoever clicks them in Perfetto.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import torch

from attnscope.attention import attention_reference
from attnscope.attention.reference import attention_reference_varlen
from attnscope.profile import artifacts, compiled, report, runs, scenarios, warned
from attnscope.profile import tensor_cores as tc
from attnscope.profile.capture import MODES, capture
from attnscope.profile.env import collect_env
from attnscope.profile.inputs import DEFAULT_DTYPE, DTYPES, resolve_device, resolve_impls
from attnscope.profile.memory import out_of_memory
from attnscope.profile.metrics import max_abs_error, pct_of_peak, tflops
from attnscope.profile.sweeps import Case, varlen_case
from attnscope.profile.sweeps import case as make_case
from attnscope.profile.table import CPU_NOTE, evidence_text, format_table
from attnscope.profile.trace import VERDICT_ARG, analyze_file, annotate_kernels

HELP = "profile every available implementation at one shape; print the table, write results.json"
DEFAULT_OUT = "attnscope-out"


def add_case_arguments(p):
    """The flags of the case a run profiles (shape, scenario, window, softcap, dtype): compare's,
    and ncu's, which re-runs a compare run's case and must mean by them what compare means."""
    p.add_argument("--batch", type=int, help="batch size (default 8 on CUDA, 1 on CPU)")
    p.add_argument("--heads", type=int, help="attention heads (default 16 on CUDA, 2 on CPU)")
    p.add_argument("--seq", type=int, help="sequence length, queries and keys alike (default 1024 "
                   "on CUDA, 128 on CPU); for unequal lengths use --q-len/--kv-len")
    p.add_argument("--head-dim", type=int, help="head dimension (default 64)")
    p.add_argument("--scenario", choices=scenarios.SCENARIOS,
                   help="serving scenario, each with its preset shape that the flags above "
                        "change: prefill (default; q_len == kv_len), decode (q_len 1-8 on a "
                        "long KV cache, GQA), chunked (new queries on a longer cache), varlen "
                        "(packed sequences of the lengths sweeps.VARLEN_LENGTHS lists), paged "
                        "(decode on a paged KV cache); causal aligned bottom-right when q_len < "
                        "kv_len")
    p.add_argument("--page-size", type=int, metavar="N",
                   help="keys per page of --scenario paged's KV cache (default: its preset, 128 "
                        "on CUDA)")
    p.add_argument("--q-len", type=int, metavar="N",
                   help="queries per sequence (default: the scenario's)")
    p.add_argument("--kv-len", type=int, metavar="N",
                   help="keys per sequence, >= --q-len (default: the scenario's; q_len for "
                        "prefill)")
    p.add_argument("--kv-heads", type=int, metavar="N",
                   help="K/V heads (GQA/MQA; must divide --heads) (default: the scenario's "
                        "query heads per K/V head kept, e.g. 4 on CUDA's decode preset, none "
                        "for prefill: --heads there; --heads where that grouping does not "
                        "divide it)")
    scenarios.add_option_arguments(p)
    p.add_argument("--dtype", choices=sorted(DTYPES),
                   help="input dtype (default bf16 on CUDA as in the blog, fp32 on CPU)")


def add_arguments(p):
    p.add_argument("--impl", nargs="+", metavar="NAME",
                   help="implementations to profile, in this order (default: all; see `list`); "
                        "a name given twice runs once")
    add_case_arguments(p)
    p.add_argument("--device", choices=("cuda", "cpu"),
                   help="where to run (default cuda when a GPU is present, else cpu)")
    p.add_argument("--mode", choices=MODES, default="fwd",
                   help="fwd: the blog's forward-only recipe (default); fwd_bwd: forward and "
                        "backward in each profiled range, FLOPs counted as 3.5x the forward")
    p.add_argument("--out", default=DEFAULT_OUT,
                   help=f"results folder (default ./{DEFAULT_OUT}): each run writes "
                        f"OUT/runs/<UTC time>/, and OUT/latest points at the last complete one")
    p.add_argument("--report", action="store_true",
                   help="also write report.html (the `report` subcommand) into the run folder")
    p.add_argument("--dump-kernel", metavar="DIR",
                   help="write our kernels' source, TTIR, TTGIR, LLIR, PTX, SASS and a meta.json "
                        "to DIR (a CUDA run writes them to the run folder's <impl>/kernel/ by "
                        "default; the CPU's Triton interpreter compiles nothing)")


def resolve_case(args, device):
    """The sweeps.Case to profile: the scenario's preset on `device` (prefill: the blog's shape),
    changed by the flags given, with their window and softcap (causal, as compare always is)."""
    if args.seq is not None and (args.q_len is not None or args.kv_len is not None):
        raise ValueError(f"--seq sets both lengths; give it or --q-len/--kv-len, not both "
                         f"(got --seq {args.seq}, --q-len {args.q_len}, --kv-len {args.kv_len})")
    if args.seq is not None and args.seq < 1:
        raise ValueError(f"--seq must be >= 1, got {args.seq}")
    q_len = args.seq if args.q_len is None else args.q_len
    kv_len = args.seq if args.kv_len is None else args.kv_len
    c = scenarios.scenario_case(args.scenario, device, batch=args.batch, heads=args.heads,
                                q_len=q_len, kv_len=kv_len, head_dim=args.head_dim,
                                kv_heads=args.kv_heads, page_size=args.page_size)
    return scenarios.with_options(c, args.window, args.softcap, causal=True)


def write_results(folder: Path, results: dict):
    runs.write_json(folder / runs.RESULTS, results)


def _classify(exc):
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return "oom"
    return "unsupported" if scenarios.refuses(exc) else "error"


def _first_line(exc):
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def _reference(inputs, case):
    """The float64 oracle (bottom-right causal, the registry's alignment for q_len < kv_len, under
    the case's window and softcap), kept on the CPU so it never counts in a row's peak memory;
    None when it does not fit (its S x S float64 scores are 8x a bf16 naive's)."""
    q, k, v = inputs.qkv
    options = scenarios.options(case)
    try:
        if inputs.packing is not None:
            return attention_reference_varlen(q, k, v, *inputs.packing[:2], **options).cpu()
        return attention_reference(q, k, v, causal_alignment="bottom_right", **options).cpu()
    except RuntimeError as exc:  # the CUDA allocator's OutOfMemoryError, or the CPU's
        if not out_of_memory(exc):
            raise
        _progress(f"note: the float64 reference does not fit in {q.device.type} memory at this "
                  f"shape; the error column stays empty")
        return None
    finally:
        if q.is_cuda:
            torch.cuda.empty_cache()


def profile_one(impl, inputs, case, reference, out: Path, device, dtype_name, env,
                mode="fwd") -> dict:
    row = {"impl": impl.name, "description": impl.description, "seed_script": impl.seed_script,
           "status": "ok", "reason": "", "note": scenarios.note(impl, case, causal=True)}
    try:
        ok, reason = impl.available(torch.device(device))
    except Exception as exc:  # noqa: BLE001 -- a broken check makes the entry unavailable
        ok, reason = False, f"available() raised {_first_line(exc)}"
    if not ok:
        return {**row, "status": "unavailable", "reason": reason}
    cannot = scenarios.unsupported(impl, case, mode)
    if cannot:
        return {**row, "status": "unsupported", "reason": cannot}
    try:
        cap = capture(impl, *inputs.qkv, out, mode, inputs.packing, inputs.paging,
                      scenarios.options(case))
    except OSError as exc:
        if runs.cannot_write(exc, out):
            raise  # the out folder, not the implementation: the run cannot go on
        return {**row, "status": _classify(exc), "reason": _first_line(exc)}
    except Exception as exc:  # noqa: BLE001 - any failure becomes this row's status
        return {**row, "status": _classify(exc), "reason": _first_line(exc)}
    analysis = analyze_file(cap.trace, [impl.name])["ranges"][impl.name]
    _add_compiled_evidence(analysis["kernels"], impl)
    row["tensor_cores"] = tc.forward_summary(analysis["kernels"])
    row.update(reason=reason, trace=str(cap.trace), table=str(cap.table),
               peak_memory_mb=cap.peak_memory_mb, max_abs_error=None, **analysis)
    if not cap.output.isfinite().all():
        row.update(status="error", reason="output holds NaN or inf")
    elif reference is not None:
        row["max_abs_error"] = max_abs_error(cap.output, reference)
    row["tflops"] = row["pct_of_peak"] = None
    if analysis["cuda_time_avg_us"]:
        flops = scenarios.flops(case, causal=True, mode=mode)
        row["tflops"] = tflops(flops, analysis["cuda_time_avg_us"] * 1e-6)
        row["pct_of_peak"] = pct_of_peak(row["tflops"], dtype_name, env)
    return row


def _add_compiled_evidence(kernels, impl=None):
    """Tier 2: Triton kernels compiled in this process (ours from the entry's own records, flex's
    and inductor's from Triton's) are judged by their SASS/PTX; the name verdict stays under
    `other`."""
    if not kernels:
        return
    verdicts = compiled.triton_verdicts([k["name"] for k in kernels])
    for record in _records(impl):
        verdicts[record.name] = artifacts.verdict(record)
    for k in kernels:
        k["tensor_cores"] = tc.combine(verdicts.get(k["name"]), k["tensor_cores"])


def _records(impl) -> list:
    """The CompiledKernel records an entry that is ours hands over ([] for the others)."""
    if impl is None or impl.compiled_kernels is None:
        return []
    return list(impl.compiled_kernels())


def _kernel_fields(row, metas) -> dict:
    """Per kernel name, the args a reader of the trace in Perfetto sees on clicking a kernel;
    `metas`: the artifacts' metas of this row's compiled kernels (artifacts.meta)."""
    fields = {k["name"]: {"attnscope tensor cores": k["tensor_cores"]["verdict"],
                          "attnscope evidence": evidence_text(k["tensor_cores"]),
                          VERDICT_ARG: k["tensor_cores"]}
              for k in row["kernels"]}
    for meta in metas:
        if meta["kernel"] in fields:
            compiled = meta["compiled"]
            fields[meta["kernel"]].update({
                "attnscope source": meta["source"],
                "attnscope config": " ".join(f"{k}={v}" for k, v in meta["config"].items()),
                "attnscope compiled": (
                    f"registers/thread {compiled['registers_per_thread']}, spills "
                    f"{compiled['spills']}, shared memory {compiled['shared_memory_bytes']} B")})
    return fields


def _progress(message):
    print(message, file=sys.stderr, flush=True)


def run(args) -> int:
    try:
        impls, notes = resolve_impls(args.impl)
        device = resolve_device(args.device)
        case = resolve_case(args, device)
        if args.report:
            report.require_dependencies()  # now, not after minutes of profiling
    except (ValueError, report.ReportError) as e:
        print(f"attnscope compare: error: {e}", file=sys.stderr)
        return 2
    for note in notes:
        _progress(note)
    try:
        with runs.Run(args.out) as run_:
            return _run(args, run_, impls, device, case)
    except runs.RunError as e:
        print(f"attnscope compare: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, or an out folder that turned unwritable mid-run
        print(f"attnscope compare: error: cannot write the results ({e.strerror or e}"
              f"{': ' + str(e.filename) if e.filename else ''}); {Path(args.out) / runs.LATEST} "
              f"still names the last complete run", file=sys.stderr)
        return 1


def _run(args, run_, impls, device, case) -> int:
    out, folder = Path(args.out), run_.folder
    dtype_name = args.dtype or DEFAULT_DTYPE[device]
    shape = tuple(case.shape)
    results = {"command": "compare", "argv": run_.command, "complete": False,
               "shape": dict(zip(("batch", "heads", "seq", "head_dim"), shape)),
               "scenario": case.scenario, "kv_len": case.keys, "kv_heads": case.kv_heads,
               "seqlens": list(case.seqlens) if case.seqlens else None,
               "page_size": case.page_size, "dtype": dtype_name, "device": device,
               "causal": True, "mode": args.mode,
               "flops_per_forward": scenarios.flops(case, causal=True, mode=args.mode),
               "env": collect_env(), "rows": []}
    # a window and a softcap only where set, so a run without them writes what it always did
    results.update(scenarios.options(case))
    write_results(folder, results)
    try:
        inputs = scenarios.case_inputs(case, DTYPES[dtype_name], device, seed=0)
    except RuntimeError as exc:  # the CUDA allocator's OutOfMemoryError, or the CPU's
        if not out_of_memory(exc):
            raise
        _progress(f"attnscope compare: error: the inputs of {scenarios.describe(case)} do not "
                  f"fit in {device} memory ({_first_line(exc)}); {out / runs.LATEST} still names "
                  f"the last complete run")
        return 1
    reference = _reference(inputs, case)
    _progress(f"attnscope compare: {len(impls)} implementations, {scenarios.describe(case)}, "
              f"{dtype_name}, {device}, run folder {folder}")
    try:
        for i, impl in enumerate(impls, 1):
            _progress(f"[{i}/{len(impls)}] {impl.name} ...")
            with warned.kept_warnings() as kept:
                row = profile_one(impl, inputs, case, reference, folder, device, dtype_name,
                                  results["env"], args.mode)
            row["warnings"] = kept
            results["rows"].append(row)
            write_results(folder, results)
            _progress(f"[{i}/{len(impls)}] {impl.name}: {row['status']}"
                      + (f" ({row['reason']})" if row["status"] != "ok" else "")
                      + warned.progress_suffix(row))
            gc.collect()  # drop this implementation's buffers before the next one's peak memory
            if device == "cuda":
                torch.cuda.empty_cache()
    except KeyboardInterrupt:
        _progress(f"interrupted: {len(results['rows'])} finished rows kept in "
                  f"{folder / runs.RESULTS} (marked incomplete); {out / runs.LATEST} still names "
                  f"the last complete run")
        raise
    _finish(args, results, folder, impls, shape, dtype_name)
    results["complete"] = True
    write_results(folder, results)
    status = 0
    if args.report:
        try:
            print(f"report: {report.write_report(folder, folder / report.DEFAULT_NAME)}")
        except report.ReportError as e:
            print(f"attnscope compare: error: {e}", file=sys.stderr)
            status = 1
    latest = run_.complete()
    print(format_table(results["rows"], device, args.mode))
    for row in results["rows"]:
        if row.get("note"):
            print(f"note: {row['impl']}: {row['note']}")
    for line in warned.notes(results["rows"], f"{runs.RESULTS}'s rows' \"warnings\""):
        print(line)
    if device == "cpu":
        print(CPU_NOTE)
    call = "forward and its backward" if args.mode == "fwd_bwd" else "forward"
    print(f"Per-call columns count one {call}. CUDA us is busy GPU time (the sum of the call's GPU "
          "ops); TFLOP/s divides by it. "
          f"Traces and tables under {folder}/<impl>/; all figures in {folder / runs.RESULTS}; "
          f"{latest} points there.")
    return status


def recorded_case(results) -> tuple[Case, str] | None:
    """(the case, the dtype name) a results.json of _run records, or None where it records no
    shape (not a compare run's). A run written before a field existed reads as it ran: no
    scenario, kv_len or kv_heads is prefill's self-attention, no window or softcap is none."""
    dims = ("batch", "heads", "seq", "head_dim")
    shape = results.get("shape") if isinstance(results, dict) else None
    if not isinstance(shape, dict) or any(k not in shape for k in dims):
        return None
    batch, heads, seq, head_dim = (shape[k] for k in dims)
    kv_heads = results.get("kv_heads") or heads
    if results.get("seqlens"):
        c = varlen_case(results["seqlens"], heads, head_dim, kv_heads=kv_heads)
    else:
        kv_len = results.get("kv_len") or seq
        c = make_case(batch, heads, seq, head_dim, kv_heads=kv_heads,
                      kv_len=None if kv_len == seq else kv_len,
                      page_size=results.get("page_size"))
    window = results.get("window")
    # through with_options, as the run made it: a run written before a window as long as the
    # call's queries and keys read as none recorded that window
    c = scenarios.with_options(c, tuple(window) if window else None, results.get("softcap"),
                               causal=True)
    return c, results.get("dtype") or DEFAULT_DTYPE["cuda"]


def _finish(args, results, folder: Path, impls, shape, dtype_name):
    """Compiled artifacts of our kernels, then the annotated traces (which cite them)."""
    rows = {r["impl"]: r for r in results["rows"]}
    metas = {}
    # An entry that differs from another only in its backward (backward_variant_of) hands over
    # that entry's forward kernels: written once, under the entry they belong to.
    for impl in sorted(impls, key=lambda impl: impl.backward_variant_of is not None):
        if not (impl.ours or impl.compiled_kernels) or rows[impl.name]["status"] != "ok":
            continue
        if impl.backward_variant_of in metas:
            metas[impl.name] = metas[impl.backward_variant_of]
            _progress(f"compiled artifacts of {impl.name}: its forward kernels are "
                      f"{impl.backward_variant_of}'s, written there")
            continue
        records = _records(impl)
        target = Path(args.dump_kernel) if args.dump_kernel else folder / artifacts.folder_for(
            impl.name)
        if not records:
            if args.dump_kernel:
                _progress("--dump-kernel: needs a CUDA GPU; on the CPU our kernels run in the "
                          "Triton interpreter, which compiles nothing. Skipped."
                          if results["device"] == "cpu" else
                          f"--dump-kernel: {impl.name} handed over no compiled kernel; nothing "
                          f"written")
            continue
        metas[impl.name] = artifacts.write(records, target, shape, dtype_name)
        results["kernel_artifacts"] = str(target.relative_to(folder) if target.is_relative_to(
            folder) else target)
        _progress(f"compiled artifacts of {', '.join(r.name for r in records)}: {target}/")
    for row in results["rows"]:
        if row["status"] == "ok" and row["kernels"]:
            annotate_kernels(row["trace"], _kernel_fields(row, metas.get(row["impl"], [])))
