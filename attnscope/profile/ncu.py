"""`ncu`: re-run implementations under Nsight Compute and attach tensor-pipe counters (tier 1).

Each implementation runs in its own child process (this module with `--target`) under
`ncu --nvtx --nvtx-include "<RANGE>/"`: warm-up calls (compilation, autotuning, cuBLAS
heuristics) happen outside the NVTX range, so only the forward's own kernels are profiled and
replayed. The CSV goes to <out>/ncu/<impl>.csv; per-kernel verdicts are merged into
<out>/results.json when `compare` wrote one there.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from attnscope.profile import tensor_cores as tc

HELP = "re-run implementations under Nsight Compute; Tensor Core verdicts from hardware counters"
RANGE = "attnscope_fwd"  # the NVTX push/pop range around each profiled forward
DTYPES = ("bf16", "fp16", "fp32")
WARMUP_CALLS = 3  # as in the seed scripts: enough for compilation and autotuning to settle


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--impl", nargs="+", metavar="NAME", default=None,
                        help="implementations to profile (default: every one available here)")
    parser.add_argument("--batch", type=int, default=8, help="batch size (default: 8)")
    parser.add_argument("--heads", type=int, default=16, help="attention heads (default: 16)")
    parser.add_argument("--seq", type=int, default=1024, help="sequence length (default: 1024)")
    parser.add_argument("--head-dim", type=int, default=64, help="head dimension (default: 64)")
    parser.add_argument("--dtype", choices=DTYPES, default="bf16", help="input dtype "
                        "(default: bf16)")
    parser.add_argument("--forwards", type=int, default=1, help="profiled forwards per "
                        "implementation; ncu replays every kernel once per metric pass, so one "
                        "is usually enough (default: 1)")
    parser.add_argument("--out", default="attnscope-out", help="results folder: CSVs go to "
                        "OUT/ncu/, verdicts merge into OUT/results.json if present "
                        "(default: attnscope-out)")
    parser.add_argument("--ncu", default=None, metavar="PATH", help="the ncu executable "
                        "(default: `ncu` on PATH, else /usr/local/cuda/bin/ncu)")
    parser.add_argument("--target", default=None, help=argparse.SUPPRESS)  # child process mode


def find_ncu(explicit: str | None) -> str | None:
    if explicit:
        return explicit if Path(explicit).is_file() else shutil.which(explicit)
    return shutil.which("ncu") or next(
        (p for p in ("/usr/local/cuda/bin/ncu",) if Path(p).is_file()), None)


def ncu_command(ncu: str, log_file: Path, child: list[str]) -> list[str]:
    # --clock-control none: keep the GPU's own clocks, as the traces saw them (ncu locks them to
    # base by default). --page raw + --print-units base: one row per launch, unscaled numbers.
    return [ncu, "--clock-control", "none", "--csv", "--page", "raw", "--print-units", "base",
            "--nvtx", "--nvtx-include", f"{RANGE}/", "--metrics", ",".join(tc.COUNTER_METRICS),
            "--log-file", str(log_file), *child]


def child_args(args: argparse.Namespace, impl: str) -> list[str]:
    return [sys.executable, "-m", "attnscope.profile.ncu", "--target", impl,
            "--batch", str(args.batch), "--heads", str(args.heads), "--seq", str(args.seq),
            "--head-dim", str(args.head_dim), "--dtype", args.dtype,
            "--forwards", str(args.forwards)]


def run(args: argparse.Namespace) -> int:
    if args.target:
        return run_target(args)
    import torch

    from attnscope.attention import IMPLEMENTATIONS, get

    ncu = find_ncu(args.ncu)
    if ncu is None:
        print("error: Nsight Compute (ncu) not found; install it or pass --ncu PATH",
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: no CUDA GPU here; Nsight Compute counters need one", file=sys.stderr)
        return 2
    try:
        impls = [get(name) for name in (args.impl or IMPLEMENTATIONS)]
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    (out / "ncu").mkdir(parents=True, exist_ok=True)

    verdicts: dict[str, dict[str, dict]] = {}
    for i, impl in enumerate(impls, 1):
        ok, reason = impl.available(torch.device("cuda"))
        if not ok:
            print(f"[{i}/{len(impls)}] {impl.name}: skipped ({reason})", file=sys.stderr)
            continue
        print(f"[{i}/{len(impls)}] {impl.name}: profiling under ncu ...", file=sys.stderr,
              flush=True)
        csv_path = out / "ncu" / f"{impl.name}.csv"
        proc = subprocess.run(ncu_command(ncu, csv_path, child_args(args, impl.name)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        text = csv_path.read_text() if csv_path.exists() else ""
        launches = _launches(text) or _launches(proc.stdout)
        if launches and not _launches(text):  # this ncu printed the table instead of logging it
            csv_path.write_text(proc.stdout)
        if proc.returncode != 0 or not launches:
            print(f"    failed (exit {proc.returncode}): {_diagnosis(text + proc.stdout)}",
                  file=sys.stderr)
            continue
        verdicts[impl.name] = tc.counter_verdicts(launches)
        for name, v in verdicts[impl.name].items():
            figures = v["metrics"]
            print(f"    {v['verdict']:>7}  matrix inst {figures.get('matrix_instructions', '?')}"
                  f"  tensor pipe {figures.get(tc.TENSOR_PIPE_PCT, '?')}%  "
                  f"{tc.short_name(name)}", file=sys.stderr)
    results = out / "results.json"
    if results.exists() and verdicts:
        merge_into_results(results, verdicts)
        print(f"merged counter verdicts into {results}", file=sys.stderr)
    print(f"ncu CSVs in {out / 'ncu'}", file=sys.stderr)
    return 0 if verdicts else 1


def _launches(text: str) -> list[dict]:
    try:
        return tc.parse_ncu_csv(text)
    except ValueError:
        return []


def _diagnosis(output: str) -> str:
    """The line of ncu's output that says what went wrong, with the usual fixes."""
    if "ERR_NVGPUCTRPERM" in output:
        return ("no permission for GPU counters; run as root or allow profiling "
                "(NVreg_RestrictProfilingToAdminUsers=0)")
    if "Failed to find metric" in output:
        return ("a metric in tensor_cores.COUNTER_METRICS is unknown to this ncu/GPU; compare "
                "with `ncu --query-metrics`: " + _last_error(output))
    if "No kernels were profiled" in output:
        return f"no kernel ran inside the NVTX range {RANGE!r}: " + _last_error(output)
    return _last_error(output) or "ncu wrote no CSV table"


def _last_error(output: str) -> str:
    errors = [line for line in output.splitlines() if "==ERROR==" in line or "Error" in line]
    return (errors or output.strip().splitlines()[-1:] or [""])[-1].strip()


def _name_key(name: str) -> str:
    # ncu and Kineto may differ in a leading return type and in whitespace inside templates.
    return re.sub(r"\s+", "", name.removeprefix("void "))


def merge_into_results(path: Path, verdicts: dict[str, dict[str, dict]]) -> None:
    """Attach counter verdicts to results.json rows ({"impl", "kernels": [{"name",
    "tensor_cores"}]}, as a list or under "rows"), keeping weaker evidence under `other`."""
    data = json.loads(path.read_text())
    rows = data.get("rows", []) if isinstance(data, dict) else data
    for row in rows:
        per_kernel = {_name_key(n): v for n, v in verdicts.get(row.get("impl"), {}).items()}
        if not per_kernel or not row.get("kernels"):
            continue
        for kernel in row["kernels"]:
            counters = per_kernel.get(_name_key(kernel["name"]))
            if counters:
                kernel["tensor_cores"] = tc.combine(counters, kernel.get("tensor_cores"))
        row["tensor_cores"] = tc.forward_summary(row["kernels"])
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def run_target(args: argparse.Namespace) -> int:
    """Child process: warm up outside the NVTX range, then run each profiled forward inside it.
    Progress goes to stderr so ncu's CSV stays clean."""
    import torch

    from attnscope.attention import get

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    impl = get(args.target)
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    q, k, v = (torch.randn(shape, generator=gen, device="cuda", dtype=dtype) for _ in range(3))
    with torch.no_grad():
        forward = impl.prepare(q, k, v)
        for _ in range(WARMUP_CALLS):
            forward()
        torch.cuda.synchronize()
        for _ in range(args.forwards):
            # ncu filters on the NVTX stack at launch time, so no sync is needed inside.
            torch.cuda.nvtx.range_push(RANGE)
            forward()
            torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
    print(f"{impl.name}: {args.forwards} forward(s) inside NVTX range {RANGE!r}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m attnscope.profile.ncu", description=HELP)
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))
