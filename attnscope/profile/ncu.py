"""`ncu`: re-run implementations under Nsight Compute and attach tensor-pipe counters (tier 1).

The call profiled is the one `compare` profiled: the case of the compare run in `--out` (its
results.json records scenario, shape, K/V length and heads, packed lengths, page size, window,
softcap, dtype), the same seeded inputs (scenarios.case_inputs) and the same prepared call
(scenarios.prepare, capture's). compare's case flags (`--scenario`, `--q-len`, `--window`, ...)
mean here what they mean there; given with a run whose case they do not give, they are refused,
since the run's rows describe another call's kernels (a run made on the CPU is refused too: its
rows hold no GPU kernels); with no run, they default as compare's do on CUDA. An implementation
the case does not suit is skipped with compare's reason (scenarios.unsupported).

Each implementation runs in its own child process (this module with `--target`, the case as
explicit flags) under `ncu --nvtx --nvtx-include <RANGE>`: warm-up calls (compilation,
autotuning, cuBLAS heuristics) happen outside the NVTX range, so only the profiled calls' own
kernels are profiled and replayed. `--mode fwd` (compare's default) profiles forwards inside a
push/pop range ("<RANGE>/", the calling thread's); `--mode fwd_bwd` a forward and its backward,
as `compare --mode fwd_bwd` profiles them, inside a start/end range ("<RANGE>", the whole
process's): the backward's kernels are launched by autograd's device thread, outside the calling
thread's push/pop stack. The CSV goes to <out>/ncu/<impl>.csv; per-kernel verdicts are merged
into <out>/results.json when `compare` wrote one there (in the same mode). `--stalls` adds a
second run per implementation under PC sampling (stalls.py): the report, its source page, and
per kernel the warp states and hottest SASS instructions, merged into results.json as `stalls`.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

from attnscope.profile import runs, scenarios, stalls
from attnscope.profile import tensor_cores as tc
from attnscope.profile.capture import MODES, profiled_call
from attnscope.profile.compare import add_case_arguments, recorded_case, resolve_case
from attnscope.profile.inputs import DEFAULT_DTYPE, DTYPES, WARMUP_CALLS
from attnscope.profile.sweeps import Case

HELP = "re-run implementations under Nsight Compute; Tensor Core verdicts from hardware counters"
RANGE = "attnscope_fwd"  # the NVTX range around each profiled call (a forward, or with --mode
# fwd_bwd a forward and its backward)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--impl", nargs="+", metavar="NAME", default=None,
                        help="implementations to profile (default: every one available here); "
                        "skipped with the reason: one the case does not suit (compare's "
                        "`unsupported` rows) and, under --mode fwd, one that differs from another "
                        "only in the backward")
    add_case_arguments(parser.add_argument_group(
        "the case", "what each profiled call computes, in compare's flags with their meaning "
        "(default: the case of the compare run in --out, else compare's on CUDA: the blog's "
        "prefill shape, bf16); flags that give another case than that run's are refused: its "
        "rows describe another call's kernels"))
    parser.add_argument("--mode", choices=MODES, default=None,
                        help="what each profiled call runs: fwd, the forward under no_grad; "
                        "fwd_bwd, the forward and its backward (torch.autograd.grad), as "
                        "compare --mode fwd_bwd profiles them (default: the mode of the compare "
                        "run in --out, else fwd)")
    parser.add_argument("--forwards", type=int, default=1, help="profiled calls per "
                        "implementation (forwards, each with its backward under --mode "
                        "fwd_bwd); ncu replays every kernel once per metric pass, so one is "
                        "usually enough (default: 1)")
    parser.add_argument("--out", default="attnscope-out", help="a compare results folder: its "
                        "last complete run (OUT/latest, else OUT itself) gets the CSVs under "
                        "ncu/ and the verdicts merged into its results.json if present "
                        "(default: attnscope-out)")
    parser.add_argument("--ncu", default=None, metavar="PATH", help="the ncu executable "
                        "(default: `ncu` on PATH, else /usr/local/cuda/bin/ncu)")
    parser.add_argument("--stalls", action="store_true", help="also sample where each kernel's "
                        "warps wait: a second ncu run per implementation (WarpStateStats and "
                        "SourceCounters sections) gives, per kernel, each warp state's share of "
                        "the samples and the SASS instructions that hold the most; printed, "
                        "merged into results.json as each kernel's `stalls`, the source page "
                        "in ncu/<impl>.stalls.csv and the report in ncu/<impl>.stalls.ncu-rep "
                        "(for the Nsight Compute GUI). attnscope/profile/stalls.py says how to "
                        "read it")
    parser.add_argument("--stall-lines", type=int, default=8, metavar="N",
                        help="instructions listed per kernel under --stalls (default: 8)")
    parser.add_argument("--target", default=None, help=argparse.SUPPRESS)  # child process mode


def find_ncu(explicit: str | None) -> str | None:
    if explicit:
        return explicit if Path(explicit).is_file() else shutil.which(explicit)
    return shutil.which("ncu") or next(
        (p for p in ("/usr/local/cuda/bin/ncu",) if Path(p).is_file()), None)


def ncu_command(ncu: str, log_file: Path, child: list[str], mode: str = "fwd") -> list[str]:
    # --clock-control none: keep the GPU's own clocks, as the traces saw them (ncu locks them to
    # base by default). --page raw + --print-units base: one row per launch, unscaled numbers.
    # The range: a push/pop one ("/" at its end) for forwards, a start/end one for forward and
    # backward (run_target).
    return [ncu, "--clock-control", "none", "--csv", "--page", "raw", "--print-units", "base",
            *_nvtx(mode), "--metrics", ",".join(tc.COUNTER_METRICS),
            "--log-file", str(log_file), *child]


def _nvtx(mode: str) -> list[str]:
    return ["--nvtx", "--nvtx-include", f"{RANGE}/" if mode == "fwd" else RANGE]


def stalls_command(ncu: str, report: Path, child: list[str], mode: str = "fwd") -> list[str]:
    # PC sampling (SourceCounters) into a report file (`-o`, `-f` to replace an older one); its
    # source page is exported afterwards (source_page_command).
    return [ncu, "--clock-control", "none", *_nvtx(mode), "--section", "WarpStateStats",
            "--section", "SourceCounters", "-f", "-o", str(report), *child]


def source_page_command(ncu: str, report: Path) -> list[str]:
    return [ncu, "-i", str(report), "--page", "source", "--csv", "--print-source", "sass"]


# compare's flags that say what is profiled, as argparse names them (--dtype apart: it is checked
# on its own, so a compare run's dtype is kept when only the shape is given)
CASE_FLAGS = ("batch", "heads", "seq", "head_dim", "scenario", "q_len", "kv_len", "kv_heads",
              "page_size", "window", "softcap")


def case_flags(case: Case, dtype: str) -> list[str]:
    """compare's flags that make resolve_case(..., "cuda") give `case` back (a varlen case's
    packed lengths are the scenario's own on CUDA), and --dtype."""
    flags = ["--scenario", case.scenario, "--heads", str(case.heads), "--head-dim",
             str(case.head_dim), "--kv-heads", str(case.kv_heads)]
    if case.seqlens is None:
        flags += ["--batch", str(case.batch), "--q-len", str(case.seq), "--kv-len",
                  str(case.keys)]
    if case.page_size is not None:
        flags += ["--page-size", str(case.page_size)]
    if case.window is not None:
        flags.append(f"--window={case.window[0]},{case.window[1]}")  # "=": a left of -1
    if case.softcap is not None:
        flags += ["--softcap", repr(case.softcap)]
    return [*flags, "--dtype", dtype]


def child_args(args: argparse.Namespace, impl: str, case: Case, dtype: str,
               mode: str = "fwd") -> list[str]:
    """The child's command line: the case as explicit flags, so it needs no results.json."""
    return [sys.executable, "-m", "attnscope.profile.ncu", "--target", impl,
            *case_flags(case, dtype), "--forwards", str(args.forwards), "--mode", mode]


def _compare_run(results: Path):
    """The parsed results.json of a compare run, or None when there is none. ValueError for one
    that cannot be read as a compare run's (the counters would be merged into it)."""
    if not results.exists():
        return None
    try:
        data = json.loads(results.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{results} cannot be read as a compare run's results ({e}): pass "
                         f"another --out, or remove it") from None
    if runs.compare_rows(data) is None:
        raise ValueError(f"{results} is not a compare run's results (a bench file, or no rows "
                         f"of implementations): pass another --out")
    return data


def run_case(args: argparse.Namespace, results: Path) -> tuple[Case, str]:
    """(the case, the dtype name) to profile: the flags given, resolved as compare resolves them
    on CUDA, or with none given the case of the compare run whose results.json is `results`,
    else compare's CUDA default. Likewise --dtype, else the run's, else bf16. ValueError naming
    both when the flags ask for another case or dtype than the run's: the counters would be
    merged into rows of another call; likewise for a run made on the CPU, whose rows hold no GPU
    kernels for the counters to describe."""
    data = _compare_run(results)
    made = recorded_case(data)
    if made is not None and data.get("device") == "cpu":
        raise ValueError(f"the compare run in {results.parent} ran on the CPU: its rows hold no "
                         f"GPU kernels for counters to describe; run compare on CUDA, or pass "
                         f"another --out")
    asked = any(getattr(args, flag) is not None for flag in CASE_FLAGS)
    if made is not None and not asked:
        case = made[0]
    else:
        case = resolve_case(args, "cuda")
    dtype = args.dtype or (made[1] if made is not None else DEFAULT_DTYPE["cuda"])
    where = f"the compare run in {results.parent}"
    if made is not None and case != made[0]:
        raise ValueError(f"{where} profiled {scenarios.describe(made[0])}; the flags give "
                         f"{scenarios.describe(case)}: drop the case flags to profile the run's "
                         f"case, or pass another --out")
    if made is not None and dtype != made[1]:
        raise ValueError(f"{where} profiled {made[1]} inputs; --dtype {dtype} asks for other "
                         f"ones: pass --dtype {made[1]} or none, or another --out")
    rebuilt = resolve_case(_case_namespace(case_flags(case, dtype)), "cuda")
    if rebuilt != case:  # a CPU run's packed lengths, which compare's flags cannot name
        raise ValueError(f"{where} profiled {scenarios.describe(case)}; compare's flags, which "
                         f"ncu's child takes, give {scenarios.describe(rebuilt)} on CUDA: run "
                         f"compare on CUDA into another --out")
    return case, dtype


def _case_namespace(flags: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_case_arguments(parser)
    return parser.parse_args(flags)


def run_mode(asked: str | None, results: Path) -> tuple[str | None, str]:
    """(the mode to profile in, or None; the reason when None): `asked` (--mode) or the mode of
    the compare run whose results.json is `results` (fwd when it has none or there is none).
    Counters profiled in one mode are not merged into a run of the other: its kernels differ."""
    data = _compare_run(results)
    made = (data.get("mode") or "fwd") if isinstance(data, dict) else None  # the run's mode
    if asked is None:
        return made or "fwd", ""
    if made is not None and asked != made:
        return None, (f"the compare run in {results.parent} was made with --mode {made}; its "
                      f"kernels are not --mode {asked}'s: pass --mode {made}, or another --out")
    return asked, ""


def run(args: argparse.Namespace) -> int:
    if args.target:
        return run_target(args)
    import torch

    from attnscope.attention import IMPLEMENTATIONS, get

    def error(message):
        print(f"attnscope ncu: error: {message}", file=sys.stderr)
        return 2
    # The flags and the run first (no GPU needed to find them wrong), then ncu and the GPU.
    try:
        impls = [get(name) for name in (args.impl or IMPLEMENTATIONS)]
    except ValueError as exc:
        return error(exc)
    if args.stall_lines < 1:
        return error(f"--stall-lines must be at least 1, got {args.stall_lines}")
    if args.forwards < 1:
        return error(f"--forwards must be at least 1, got {args.forwards}")
    out = runs.resolve(args.out)  # the same run `report` reads
    results = out / runs.RESULTS
    try:
        mode, why = run_mode(args.mode, results)
        if mode is None:
            return error(why)
        case, dtype = run_case(args, results)
    except ValueError as e:
        return error(e)
    ncu = find_ncu(args.ncu)
    if ncu is None:
        return error(f"--ncu {args.ncu}: no such executable" if args.ncu else
                     "Nsight Compute (ncu) not found on PATH or in /usr/local/cuda/bin; "
                     "install it or pass --ncu PATH")
    if not torch.cuda.is_available():
        return error("no CUDA GPU here; Nsight Compute counters need one")
    try:
        (out / "ncu").mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return error(f"cannot write to --out {out}: {e.strerror or e}")

    print(f"attnscope ncu: {len(impls)} implementations, {scenarios.describe(case)}, {dtype}, "
          f"{mode}, into {out}", file=sys.stderr)
    verdicts: dict[str, dict[str, dict]] = {}
    stalls_failed = 0  # implementations whose --stalls run gave nothing
    for i, impl in enumerate(impls, 1):
        ok, reason = impl.available(torch.device("cuda"))
        if not ok:
            print(f"[{i}/{len(impls)}] {impl.name}: skipped ({reason})", file=sys.stderr)
            continue
        # as compare's `unsupported` rows: the case asks what the entry cannot express, or under
        # --mode fwd its forward alone would be another entry's (its backward is what differs)
        cannot = scenarios.unsupported(impl, case, mode)
        if cannot:
            print(f"[{i}/{len(impls)}] {impl.name}: skipped ({cannot})", file=sys.stderr)
            continue
        print(f"[{i}/{len(impls)}] {impl.name}: profiling under ncu ({mode}) ...",
              file=sys.stderr, flush=True)
        child = child_args(args, impl.name, case, dtype, mode)
        csv_path = out / "ncu" / f"{impl.name}.csv"
        proc = subprocess.run(ncu_command(ncu, csv_path, child, mode),
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
                  f"{tc.display_name(name)}", file=sys.stderr)
        if results.exists():  # after each implementation: a run cut short keeps what it measured
            merge_into_results(results, {impl.name: verdicts[impl.name]}, {impl.name: launches})
        if args.stalls:
            summaries = profile_stalls(ncu, out / "ncu", impl.name, child, mode,
                                       args.stall_lines)
            stalls_failed += not summaries
            if summaries and results.exists():
                for name in merge_stalls_into_results(results, impl.name, summaries):
                    print(f"    stalls of {tc.display_name(name)}: no kernel of {impl.name}'s "
                          f"row in {results} matched it; they are in the printout and the CSV",
                          file=sys.stderr)
    if results.exists() and verdicts:
        print(f"merged counter verdicts of {len(verdicts)} implementation(s) into {results}",
              file=sys.stderr)
    elif not verdicts:
        print(f"no counters: none of the {len(impls)} implementation(s) was profiled (their "
              f"lines above say why)", file=sys.stderr)
    print(f"ncu CSVs in {out / 'ncu'}", file=sys.stderr)
    if stalls_failed:
        print(f"--stalls gave nothing for {stalls_failed} implementation(s) (their lines above "
              "say why)", file=sys.stderr)
    return 0 if verdicts and not stalls_failed else 1


def profile_stalls(ncu: str, folder: Path, name: str, child: list[str], mode: str,
                   top: int) -> dict[str, dict]:
    """`--stalls` for one implementation: its calls under PC sampling into
    <folder>/<name>.stalls.ncu-rep, the report's source page into <name>.stalls.csv, and
    stalls.summarize's figures per kernel (printed; {} with a line saying why on failure)."""
    written = folder / f"{name}.stalls.ncu-rep"  # named with ncu's extension: none is added
    page_csv = folder / f"{name}.stalls.csv"
    for older in (written, page_csv):  # an older run's must not pass for this one's
        older.unlink(missing_ok=True)
    print(f"    {name}: sampling warp states under ncu (--stalls) ...", file=sys.stderr,
          flush=True)
    proc = subprocess.run(stalls_command(ncu, written, child, mode), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0 or not written.exists():
        print(f"    stalls: failed (exit {proc.returncode}): {_diagnosis(proc.stdout)}",
              file=sys.stderr)
        return {}
    page = subprocess.run(source_page_command(ncu, written), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    page_csv.write_text(page.stdout)
    try:
        summaries = stalls.summarize(stalls.parse_source_page(page.stdout), top)
    except ValueError as e:
        print(f"    stalls: no source page from {written} (exit {page.returncode}): "
              f"{_last_error(page.stdout) or e}", file=sys.stderr)
        return {}
    for kernel, summary in summaries.items():
        for line in stalls.format_summary(tc.display_name(kernel), summary):
            print(line, file=sys.stderr)
    return summaries


def merge_stalls_into_results(path: Path, impl: str, summaries: dict[str, dict]) -> list[str]:
    """Attach `--stalls` figures to the kernels of `impl`'s results.json row (an earlier run's
    `stalls` dropped first). A kernel takes the summary of the ncu kernel its counters were
    matched to (launch order or name, merge_into_results), else one matched by name as
    match_kernels matches counters (the source page has no launch IDs). Each gets `stalls` with
    `ncu_kernel` and `matched_by`. Returns the profiled kernels no row kernel took."""
    data = json.loads(path.read_text())
    rows = data.get("rows", []) if isinstance(data, dict) else data
    taken: set[str] = set()
    for row in rows:
        if row.get("impl") != impl or not row.get("kernels"):
            continue
        for kernel in row["kernels"]:
            kernel.pop("stalls", None)
        matches = match_kernels({k["name"]: k.get("per_forward") for k in row["kernels"]},
                                {n: s["profiles"] for n, s in summaries.items()})
        for kernel in row["kernels"]:
            counted = (kernel.get("tensor_cores") or {}).get("ncu_kernel")
            if counted in summaries:
                ncu_name, how = counted, "the counters' match"
            elif kernel["name"] in matches:
                ncu_name, how = matches[kernel["name"]]
            else:
                continue
            kernel["stalls"] = {**summaries[ncu_name], "ncu_kernel": ncu_name,
                                "matched_by": how}
            taken.add(ncu_name)
    runs.write_json(path, data, indent=2)
    return [name for name in summaries if name not in taken]


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


# ncu and Kineto demangle the same kernel differently: ncu writes `at::` for `at::native::`,
# `<unnamed>` for `(anonymous namespace)`, `[lambda(int) (instance 1)]` for `{lambda(int)#1}`,
# T1, T2 placeholders for parameter types, 0/1 for false/true, `const T *` for `T const*`, and
# drops qualifiers such as `pytorch_flash::`, `cutlass::` and `PyTorchMemEffAttention::`.
_ANONYMOUS = re.compile(r"\(anonymous namespace\)::|<unnamed>::")
_LAMBDA_KINETO = re.compile(r"\{lambda\(([^(){}]*)\)#(\d+)\}")
_LAMBDA_NCU = re.compile(r"\[lambda\(([^()\[\]]*)\) \(instance (\d+)\)\]")
_QUALIFIER = re.compile(r"\b[A-Za-z_]\w*::")
_INT_SUFFIX = re.compile(r"\b(\d+)(?:[uU][lL]{0,2}|[lL]{1,2}[uU]?)\b")


def base_name(name: str) -> str:
    """The kernel's function identifier, without namespaces, template arguments or parameters:
    `void at::native::elementwise_kernel<...>(...)` -> `elementwise_kernel`."""
    n = _ANONYMOUS.sub("", name.strip().removeprefix("void "))
    return re.split(r"[<(]", n, maxsplit=1)[0].rsplit("::", 1)[-1].strip() or n


def _name_key(name: str) -> str:
    """A kernel name as both demanglers agree on it: no namespaces, no parameter lists (ncu
    writes placeholders there), lambdas, booleans and integer literals in one spelling, no
    `const`, no whitespace. Template arguments and lambda numbers stay, so instantiations of one
    function template keep distinct keys."""
    n = _ANONYMOUS.sub("", name.strip().removeprefix("void "))
    n = _LAMBDA_KINETO.sub(r"lambda#\2", n)
    n = _LAMBDA_NCU.sub(r"lambda#\2", n)
    n = _without_parameters(n)
    n = _QUALIFIER.sub("", n)
    n = re.sub(r"\bfalse\b", "0", n)
    n = re.sub(r"\btrue\b", "1", n)
    n = _INT_SUFFIX.sub(r"\1", n)
    n = re.sub(r"\b(?:const|void)\b", "", n)
    return re.sub(r"\s+", "", n)


def _without_parameters(name: str) -> str:
    """Every parenthesised list emptied (`f(int, T1 &)::g` -> `f()::g`) and the kernel's own
    parameter list, the last top-level one, dropped."""
    out, depth = [], 0
    for ch in name:
        if ch == "(":
            if depth == 0:
                out.append("()")
            depth += 1
        elif ch == ")":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out).removesuffix("()")


def match_kernels(trace_kernels: dict[str, float | None], ncu_kernels: dict[str, int | None],
                  trace_order: list[str] | None = None,
                  ncu_order: list[str] | None = None) -> dict[str, tuple[str, str]]:
    """{trace kernel name: (ncu kernel name, how)} for the kernels both saw, each ncu name given
    to one trace kernel at most. `trace_kernels`: {name: launches per forward};
    `ncu_kernels`: {name: launches profiled}. `how`, strongest first:
    - "launch order": `ncu_order` (ncu's launches by ID, one or more profiled forwards) lined up
      with `trace_order` (one forward's kernel launches in the trace), every position agreeing
      on the base name, and the pairing one to one;
    - "name": the same `_name_key`, unique on both sides;
    - "base name": the same `base_name`, unique among all kernels on both sides, and as many
      launches per profiled forward under ncu as per forward in the trace (a generic template
      such as `elementwise_kernel` could otherwise lend one kernel's counters to another).
    A trace kernel with none of these gets no counters."""
    matched: dict[str, tuple[str, str]] = {}
    taken: set[str] = set()
    total_t = sum(v or 0 for v in trace_kernels.values())
    forwards = round(sum(v or 0 for v in ncu_kernels.values()) / total_t) if total_t else 0

    def same_count(t, n):
        return bool(forwards and trace_kernels[t] and ncu_kernels[n]
                    and ncu_kernels[n] == trace_kernels[t] * forwards)

    def take(t, n, how):
        matched[t] = (n, how)
        taken.add(n)

    for t, n in _order_pairs(trace_order, ncu_order).items():
        if t in trace_kernels and n in ncu_kernels:
            take(t, n, "launch order")
    for key_of, how in ((_name_key, "name"), (base_name, "base name")):
        left_t = [t for t in trace_kernels if t not in matched]
        left_n = [n for n in ncu_kernels if n not in taken]
        # "name": unique among the kernels still unmatched; "base name": among all of them
        by_t = _group(left_t if how == "name" else trace_kernels, key_of)
        by_n = _group(left_n if how == "name" else ncu_kernels, key_of)
        for t in left_t:
            key = key_of(t)
            if len(by_t.get(key, ())) == 1 and len(by_n.get(key, ())) == 1:
                (n,) = by_n[key]
                if n not in taken and (how == "name" or same_count(t, n)):
                    take(t, n, how)
    return matched


def _group(names, key_of) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name in names:
        out.setdefault(key_of(name), []).append(name)
    return out


def _order_pairs(trace_order, ncu_order) -> dict[str, str]:
    """Trace kernel -> ncu kernel by launch position; {} unless ncu's launches are whole
    forwards of the trace's sequence, agreeing on the base name at every position, one to one,
    and no pair contradicting the names (its kernels' keys differ while one of them equals the
    key of another kernel in the sequence)."""
    if not trace_order or not ncu_order or len(ncu_order) % len(trace_order):
        return {}
    pairs = {(trace_order[i % len(trace_order)], n) for i, n in enumerate(ncu_order)}
    if any(base_name(t) != base_name(n) for t, n in pairs):
        return {}
    forward = dict(pairs)
    if len(forward) != len(pairs) or len(set(forward.values())) != len(forward):
        return {}  # one name on a side paired with two on the other: not the same sequence
    keys_t = {_name_key(t) for t in forward}
    keys_n = {_name_key(n) for n in forward.values()}
    for t, n in forward.items():
        if _name_key(t) != _name_key(n) and (_name_key(n) in keys_t or _name_key(t) in keys_n):
            return {}
    return forward


def trace_kernel_order(results: Path, row: dict) -> list[str] | None:
    """One forward's kernel names in launch order, from the row's trace (its recorded path, or
    the same file name under <results folder>/<impl>/, for a results folder moved elsewhere)."""
    from attnscope.profile.trace import TraceError, find_row_trace, forward_events, load_events

    path = find_row_trace(results.parent, row)
    if path is None:
        return None
    try:
        forwards = forward_events(load_events(path), row["impl"])
    except TraceError:
        return None
    orders = [[op["name"] for op in f["ops"] if op.get("_cat") == "kernel"] for f in forwards]
    return next((order for order in orders if order), None)


def merge_into_results(path: Path, verdicts: dict[str, dict[str, dict]],
                       launches: dict[str, list[dict]] | None = None) -> None:
    """Attach counter verdicts to results.json rows ({"impl", "kernels": [{"name",
    "tensor_cores"}]}, as a list or under "rows"), keeping weaker evidence under `other`.
    `launches` ({impl: ncu launches, as parse_ncu_csv gives them}) lets kernels be matched by
    launch order against the row's trace; without it, or when the orders disagree, by name
    (see match_kernels). Each kernel's verdict records `ncu_kernel` and `matched_by`."""
    data = json.loads(path.read_text())
    rows = data.get("rows", []) if isinstance(data, dict) else data
    for row in rows:
        counters = verdicts.get(row.get("impl"), {})
        if not counters or not row.get("kernels"):
            continue
        ncu_order = [launch["kernel"] for launch in
                     sorted((launches or {}).get(row["impl"], ()), key=lambda r: r["id"])]
        trace_order = trace_kernel_order(path, row) if ncu_order else None
        matches = match_kernels({k["name"]: k.get("per_forward") for k in row["kernels"]},
                                {n: v.get("launches") for n, v in counters.items()},
                                trace_order, ncu_order)
        for kernel in row["kernels"]:
            if kernel["name"] in matches:
                ncu_name, how = matches[kernel["name"]]
                evidence = {**counters[ncu_name], "ncu_kernel": ncu_name, "matched_by": how}
                kernel["tensor_cores"] = tc.combine(evidence,
                                                    *_weaker(kernel.get("tensor_cores"), evidence))
        row["tensor_cores"] = tc.forward_summary(row["kernels"])
        _annotate_trace(path.parent, row)
    runs.write_json(path, data, indent=2)


def _weaker(previous: dict | None, new: dict) -> list[dict]:
    """What a kernel's new counter verdict combines with: its verdict before any merge, or, where
    an earlier `ncu` run already merged counters (a second run, a --stalls run after one), the
    weaker tiers that merge kept under `other` (each as a verdict of its tier), not the old
    counters, which definite new ones replace (new counters that cannot tell keep the old)."""
    if (not previous or previous.get("evidence") != "counters"
            or new.get("verdict") == tc.UNKNOWN):
        return [previous]
    return [{"verdict": verdict, "evidence": tier}
            for tier, verdict in (previous.get("other") or {}).items() if tier != "counters"]


def _annotate_trace(folder: Path, row: dict) -> None:
    """Write the merged verdicts into the row's trace too, so `analyze` on it says what the
    table says (the trace is left alone when it is not found or not readable)."""
    from attnscope.profile.table import evidence_text
    from attnscope.profile.trace import (EVIDENCE_LINE_ARG, VERDICT_ARG, VERDICT_LINE_ARG,
                                         TraceError, annotate_kernels, find_row_trace)

    trace = find_row_trace(folder, row)
    if trace is None:
        return
    fields = {k["name"]: {VERDICT_LINE_ARG: k["tensor_cores"]["verdict"],
                          EVIDENCE_LINE_ARG: evidence_text(k["tensor_cores"]),
                          VERDICT_ARG: k["tensor_cores"]} for k in row["kernels"]}
    try:
        annotate_kernels(trace, fields)
    except TraceError:
        pass


def run_target(args: argparse.Namespace) -> int:
    """Child process: warm up outside the NVTX range, then run each profiled call inside it (a
    forward; with --mode fwd_bwd a forward and its backward, compare's profiled_call). Progress
    goes to stderr so ncu's CSV stays clean."""
    import torch

    from attnscope.attention import get

    impl = get(args.target)
    backward = (args.mode or "fwd") == "fwd_bwd"
    # The inputs and the call compare profiles (compare._run, capture), so the counters describe
    # the kernels in its traces: the case from the parent's explicit flags, seed 0.
    case = resolve_case(args, "cuda")
    inputs = scenarios.case_inputs(case, DTYPES[args.dtype or DEFAULT_DTYPE["cuda"]], "cuda",
                                   seed=0)
    q, k, v = inputs.qkv
    if backward:
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with torch.enable_grad() if backward else torch.no_grad():
        forward = scenarios.prepare(impl, scenarios.Inputs((q, k, v), inputs.packing,
                                                           inputs.paging),
                                    causal=True, **scenarios.options(case))
        call = profiled_call(impl.name, forward, (q, k, v), backward)
        for _ in range(WARMUP_CALLS):
            call()
        torch.cuda.synchronize()
        for _ in range(args.forwards):
            # ncu filters on the NVTX ranges at launch time, so no sync is needed inside; the
            # backward's launches come from autograd's device thread, which a start/end range
            # covers and this thread's push/pop stack does not. autograd.grad returns once the
            # backward has launched everything.
            if backward:
                handle = torch.cuda.nvtx.range_start(RANGE)
                call()
                torch.cuda.nvtx.range_end(handle)
            else:
                torch.cuda.nvtx.range_push(RANGE)
                call()
                torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
    what = "forward(s) with their backward" if backward else "forward(s)"
    print(f"{impl.name}: {args.forwards} {what} inside NVTX range {RANGE!r}, "
          f"{scenarios.describe(case)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m attnscope.profile.ncu", description=HELP)
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))
