"""`report RESULTS_DIR [-o report.html]`: one self-contained HTML page from a `compare` folder.

Sections: the comparison table and the run's env; bar charts (time, kernels and TFLOP/s per
forward); a sweep plot when the folder holds a `bench --json` file named bench.json; for each
implementation a timeline of one forward drawn from its trace (trace.forward_events, the same
attribution as the table's figures) with its kernels and their Tensor Core evidence; the fused
kernel's Triton source beside what it compiled to (artifacts.py: config, registers, instruction
mix, and the source lines PTX `.loc` directives tie to matrix instructions); links to the traces.

Everything is inline (CSS, PNG data URIs), so the page opens without a network.
"""

from __future__ import annotations

import html
import importlib.util
import json
import os
import statistics
import sys
from pathlib import Path

from attnscope.profile import artifacts, runs, source_view
from attnscope.profile.bench_table import summary_text
from attnscope.profile.metrics import PEAK_DTYPES
from attnscope.profile.table import CPU_NOTE, evidence_text, table_cells
from attnscope.profile.table import headers as table_headers
from attnscope.profile.stalls import one_line as stalls_text
from attnscope.profile.tensor_cores import display_name, name_verdict
from attnscope.profile.trace import TraceError, find_row_trace, forward_events, load_events

HELP = ("HTML report from a compare folder: table, charts, per-forward timelines, the fused "
        "kernel's source beside its compiled code, trace links")
DEFAULT_NAME = "report.html"
BENCH_FILE = "bench.json"
NEEDS = ("matplotlib", "pygments")


class ReportError(RuntimeError):
    """The report cannot be written; the message says why and what to do."""


def add_arguments(p):
    p.add_argument("results_dir", metavar="RESULTS_DIR",
                   help="a folder written by `compare` (holds results.json and the traces)")
    p.add_argument("-o", "--output", metavar="FILE",
                   help=f"where to write the HTML (default RESULTS_DIR/{DEFAULT_NAME})")


def require_dependencies():
    missing = [name for name in NEEDS if importlib.util.find_spec(name) is None]
    if missing:
        raise ReportError(f"the report needs {' and '.join(missing)}: "
                          f"pip install 'attnscope[report]'")


def run(args) -> int:
    # A compare --out folder reads its last complete run (OUT/latest); a run folder reads itself.
    folder = runs.resolve(args.results_dir)
    try:
        path = write_report(folder, Path(args.output) if args.output else folder / DEFAULT_NAME)
    except ReportError as e:
        print(f"attnscope report: error: {e}", file=sys.stderr)
        return 2
    print(f"report: {path}")
    return 0


def _check_output(output: Path):
    """Fail before rendering when the page could not be written there."""
    if runs.not_a_file(output):  # /dev/null: writing replaces the file, it would replace that
        raise ReportError(f"-o {output} exists and is not a regular file (a device or a pipe); "
                          f"give a file name")
    if output.is_dir():
        raise ReportError(f"-o {output} is a directory; give a file name such as "
                          f"{output / DEFAULT_NAME}")
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ReportError(f"cannot create the folder of {output}: {e.strerror or e}") from None
    if not os.access(output.parent, os.W_OK | os.X_OK):
        raise ReportError(f"cannot write {output}: its folder is not writable")


def write_report(folder, output) -> Path:
    require_dependencies()
    folder, output = Path(folder), Path(output)
    try:
        results = json.loads((folder / runs.RESULTS).read_text())
    except OSError as e:
        unfinished = sorted((folder / runs.RUNS).glob(f"*/{runs.RESULTS}"))
        if unfinished:  # an --out folder whose runs were all interrupted
            raise ReportError(f"no complete run in {folder}: {len(unfinished)} interrupted "
                              f"one(s) under {folder / runs.RUNS}; pass one of those folders to "
                              f"report its finished rows") from None
        raise ReportError(f"no results.json in {folder} ({e.strerror or e}); run "
                          f"`python -m attnscope.profile compare --out {folder}` first") from None
    except ValueError as e:  # not JSON, or not UTF-8
        raise ReportError(f"{folder / runs.RESULTS} is not valid JSON: {e}") from None
    if isinstance(results, dict) and "sweep" in results:
        raise ReportError(f"{folder / runs.RESULTS} is a bench file (bench --json), not a compare "
                          f"run's results: save it as {BENCH_FILE} beside a compare run's "
                          f"results.json for its sweep plot")
    rows = runs.compare_rows(results) if isinstance(results, dict) else None
    if rows is None or any("status" not in row for row in rows):
        raise ReportError(f"{folder / runs.RESULTS} is not a compare run's results (no rows of "
                          f"implementations with a status): pass a folder written by compare")
    if not rows:
        raise ReportError(f"{folder / runs.RESULTS} holds no rows: the run that wrote it "
                          f"finished no implementation; nothing to report")
    _check_output(output)
    page = _Page(results, folder, output)
    try:
        runs.write_text(output, page.render())
    except OSError as e:
        raise ReportError(f"cannot write {output}: {e.strerror or e}") from None
    return output


# Free-text columns of COLUMNS, left-aligned; the others hold numbers.
TEXT_COLUMNS = ("impl", "Tensor Cores", "launch API", "status")


def _e(value) -> str:
    return html.escape(str(value))


def _section(anchor, title, body) -> str:
    return f'<section id="{anchor}"><h2>{_e(title)}</h2>\n{body}\n</section>'


def _kv_table(pairs) -> str:
    rows = "".join(f"<tr><th>{_e(k)}</th><td>{_e('-' if v is None else v)}</td></tr>"
                   for k, v in pairs)
    return f'<table class="kv">{rows}</table>'


def _img(uri, alt) -> str:
    return f'<img class="chart" src="{uri}" alt="{_e(alt)}">'


def _note(text) -> str:
    return f'<p class="note">{_e(text)}</p>'


class _Page:
    def __init__(self, results, folder: Path, output: Path):
        self.results, self.folder, self.output = results, folder, output
        self.rows = results.get("rows", [])
        self.ok = [r for r in self.rows if r.get("status") == "ok"]
        self.device = results.get("device", "cpu")
        self.gpu = any(r.get("kernels") for r in self.ok)

    def render(self) -> str:
        from pygments.formatters import HtmlFormatter

        shape = dict(self.results.get("shape", {}))
        # (results written before scenarios have none: they were prefill)
        if self.results.get("scenario", "prefill") != "prefill":
            shape = {"scenario": self.results["scenario"], **shape,
                     "keys": self.results.get("kv_len"), "kv_heads": self.results.get("kv_heads")}
        # a window and a softcap where the run had them
        shape.update({k: self.results[k] for k in ("window", "softcap") if k in self.results})
        title = (f"attnscope: {', '.join(f'{k} {v}' for k, v in shape.items())}, "
                 f"{self.results.get('dtype')}, {self.device}"
                 # Files from before run folders carry no flag: they were complete.
                 + ("" if self.results.get("complete", True) else
                    f" (incomplete run: {len(self.rows)} rows)"))
        sections = [self.table(), self.charts(), self.sweep(), self.timelines(),
                    self.fused_kernel(), self.traces()]
        nav = "".join(f'<a href="#{a}">{t}</a>' for a, t in (
            ("table", "table"), ("charts", "charts"), ("sweep", "sweep"),
            ("timelines", "timelines"), ("fused", "fused kernel"), ("traces", "traces")))
        css = CSS + HtmlFormatter(style="default").get_style_defs(".src")
        return (f"<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
                f"<title>{_e(title)}</title><style>{css}</style></head><body>\n"
                f"<h1>{_e(title)}</h1><nav>{nav}</nav>\n" + "\n".join(sections)
                + "\n</body></html>\n")

    # --- table and env ------------------------------------------------------------------------

    def table(self) -> str:
        mode = self.results.get("mode", "fwd")
        headers = table_headers(mode)
        align = ['' if h in TEXT_COLUMNS else ' class="num"' for h in headers]
        head = "".join(f"<th>{_e(h)}</th>" for h in headers)
        body = "".join("<tr>" + "".join(f"<td{a}>{_e(c)}</td>" for a, c in zip(align, cells))
                       + "</tr>" for cells in table_cells(self.rows, self.device))
        notes = [UNITS]
        if mode == "fwd_bwd":
            notes.append(FWD_BWD_UNITS)
        if self.device == "cpu":
            notes.append(CPU_NOTE)
        env = dict(self.results.get("env") or {})
        gpu = env.pop("gpu", None) or {}
        pairs = list(env.items()) + [(f"gpu.{k}", v) for k, v in gpu.items()]
        if not gpu:
            pairs.append(("gpu", "none (CPU run)"))
        return _section("table", "Comparison per forward",
                        f'<table class="results"><thead><tr>{head}</tr></thead>'
                        f"<tbody>{body}</tbody></table>" + "".join(map(_note, notes))
                        + "<h3>Environment</h3>" + _kv_table(pairs))

    # --- charts -------------------------------------------------------------------------------

    def charts(self) -> str:
        from attnscope.profile import charts

        names = [r["impl"] for r in self.ok]
        if not names:
            return _section("charts", "Charts", _note("no implementation ran: nothing to plot"))
        parts = [_img(charts.bars(
            names, {"CUDA (busy GPU time)": [r.get("cuda_time_avg_us") for r in self.ok],
                    "CPU (range duration)": [r.get("cpu_time_avg_us") for r in self.ok]},
            "Time per forward", "us per forward", value_fmt="{:,.1f}"), "time per forward")]
        if not self.gpu:
            parts.append(_note("kernels per forward and TFLOP/s: n/a, this run had no GPU "
                               "(CPU rows only; the CUDA bars above are absent for that reason)"))
            return _section("charts", "Charts", f'<div class="charts">{"".join(parts)}</div>')
        parts.append(_img(charts.bars(
            names, {"kernels": [r.get("kernels_per_forward") for r in self.ok]},
            "GPU kernels per forward", "kernels per forward", value_fmt="{:g}"),
            "kernels per forward"))
        peak = ((self.results.get("env") or {}).get("gpu") or {}).get("measured_bf16_peak_tflops")
        reference = None
        if peak and self.results.get("dtype") in PEAK_DTYPES:
            reference = (peak, f"measured bf16 matmul peak {peak:g} TFLOP/s")
        else:
            parts.append(_note("no measured peak for this GPU and dtype: TFLOP/s without a "
                               "reference line"))
        parts.append(_img(charts.bars(
            names, {"TFLOP/s": [r.get("tflops") for r in self.ok]},
            "TFLOP/s (causal FLOPs / busy CUDA time)", "TFLOP/s", value_fmt="{:.1f}",
            reference=reference), "TFLOP/s"))
        return _section("charts", "Charts", f'<div class="charts">{"".join(parts)}</div>')

    def sweep(self) -> str:
        from attnscope.profile import charts

        path = self.folder / BENCH_FILE
        if not path.is_file():
            return _section("sweep", "Shape sweep", _note(
                f"no {BENCH_FILE} in this folder: run `python -m attnscope.profile bench --json "
                f"{path}` to add a sweep plot"))
        try:
            bench = json.loads(path.read_text())
            if not isinstance(bench, dict):
                raise ValueError("not a JSON object")
            if bench.get("command") == "compare":
                raise ValueError("it is a compare run's results")
            rows = bench.get("rows", [])
            if not isinstance(rows, list) or any(
                    not isinstance(row, dict) or "shape" not in row or "impl" not in row
                    for row in rows):
                raise ValueError("its rows are not bench rows (impl, shape)")
        except (OSError, ValueError) as exc:  # a truncated or foreign file: say so, go on
            return _section("sweep", "Shape sweep", _note(
                f"{path} cannot be read as a bench file ({exc}); run `python -m "
                f"attnscope.profile bench --json {path}` again to add a sweep plot"))
        timer = (bench.get("timing") or {}).get("timer", "")
        ylabel = "TFLOP/s" + (" (CPU wall time)" if bench.get("device") == "cpu" else "")
        body = _img(charts.sweep(bench.get("rows", []), ylabel,
                                 f"bench sweep {bench.get('sweep', '')!r}: {timer}"), "sweep")
        summary = bench.get("summary") or {}
        if summary:
            body += _kv_table((f"{name}: geometric mean ratio to the best peer",
                               summary_text(s))
                              for name, s in summary.items())
        return _section("sweep", "Shape sweep", body)

    # --- timelines ----------------------------------------------------------------------------

    def timelines(self) -> str:
        parts = [_note("One forward per implementation, to scale: the forward whose busy GPU "
                       "time (CPU duration on a CPU run) is the median of the profiled ones. A "
                       "kernel belongs to the forward whose range launched it; grey lines join "
                       "each launch call to the GPU op it started.")]
        parts += [self._timeline(row) for row in self.ok]
        return _section("timelines", "Timelines: one forward each", "".join(parts))

    def _timeline(self, row) -> str:
        from attnscope.profile import charts

        heading = f'<h3 id="timeline-{_e(row["impl"])}">{_e(row["impl"])}</h3>'
        path = find_row_trace(self.folder, row)
        if path is None:
            return heading + _note(f"trace not found: {row.get('trace')}")
        try:
            forwards = forward_events(load_events(path), row["impl"])
        except TraceError as e:
            return heading + _note(str(e))
        gpu_busy = [sum(op.get("dur", 0) for op in f["ops"]) for f in forwards]
        key = gpu_busy if any(gpu_busy) else [f["range"].get("dur", 0) for f in forwards]
        index = key.index(statistics.median_low(key))
        forward = forwards[index]
        by_name = {k["name"]: k for k in row.get("kernels", [])}
        ops = sorted(forward["ops"], key=lambda op: op["ts"])
        numbered = []
        table = []
        for number, op in enumerate(ops, 1):
            is_kernel = op["_cat"] == "kernel"
            verdict = ((by_name.get(op["name"]) or {}).get("tensor_cores")
                       or name_verdict(op["name"])) if is_kernel else None
            numbered.append((number, op, verdict["verdict"] if verdict else None))
            table.append((number, op, verdict))
        title = (f"{row['impl']}: forward {index + 1} of {len(forwards)}, "
                 f"{sum(1 for op in ops if op['_cat'] == 'kernel')} kernels, "
                 f"{len(ops) - sum(1 for op in ops if op['_cat'] == 'kernel')} other GPU ops")
        image = _img(charts.timeline(forward, numbered, title), f"timeline of {row['impl']}")
        stalls = {name: k["stalls"] for name, k in by_name.items() if k.get("stalls")}
        return heading + _note(row.get("description", "")) + image + self._op_table(
            forward, table, stalls)

    def _op_table(self, forward, numbered, stalls=None) -> str:
        """The forward's GPU ops; with `ncu --stalls` figures ({kernel name: stalls}), a column
        of where each kernel's warps waited."""
        if not numbered:
            return ""
        t0 = forward["range"]["ts"]
        head = ("<tr><th>#</th><th>GPU op</th><th>start us</th><th>duration us</th>"
                "<th>Tensor Cores</th><th>how we know</th>"
                + ("<th>warp states (ncu --stalls)</th>" if stalls else "") + "</tr>")
        body = []
        for number, op, verdict in numbered:
            cls = f'tc-{verdict["verdict"]}' if verdict else "tc-copy"
            waits = f"<td>{_e(stalls_text(stalls[op['name']]))}</td>" if op["name"] in (
                stalls or {}) else ("<td>-</td>" if stalls else "")
            body.append(
                f'<tr><td>{number}</td><td title="{_e(op["name"])}"><code>'
                f'{_e(display_name(op["name"]))}</code></td>'
                f'<td class="num">{op["ts"] - t0:.1f}</td>'
                f'<td class="num">{op.get("dur", 0):.1f}</td>'
                f'<td class="{cls}">{_e(verdict["verdict"]) if verdict else "-"}</td>'
                f'<td>{_e(evidence_text(verdict)) if verdict else "copy/set"}</td>{waits}</tr>')
        return f'<table class="ops">{head}{"".join(body)}</table>'

    # --- fused kernel ---------------------------------------------------------------------------

    def fused_kernel(self) -> str:
        candidates = self._artifact_folders()
        found = next((a for a in map(artifacts.load_all, candidates) if a), [])
        if not found:
            looked = ", ".join(self._href(c) for c in candidates) or "-"
            if self.device == "cpu":
                why = ("this was a CPU run, where our kernels run in the Triton interpreter, "
                       "which compiles nothing")
            else:
                why = f"this folder has none (looked in: {looked})"
            return _section("fused", "Our compiled kernels", _note(
                f"compiled artifacts missing: {why}. `compare` on CUDA writes our kernels' "
                "source, TTIR, TTGIR, LLIR, PTX and SASS to the run folder's <impl>/kernel/, and "
                "this panel then shows each kernel's launch config, registers, spills, shared "
                "memory, instruction mix and which source lines became matrix instructions."))
        panels = "".join(self._kernel_panel(f) for f in found)
        title = "Our compiled kernels: " + ", ".join(f["name"] for f in found)
        return _section("fused", title, panels)

    def _artifact_folders(self) -> list[Path]:
        """Where this run's compiled artifacts may be: the folder compare recorded (relative to
        the run folder, or absolute from older runs), then <impl>/kernel/ of each row."""
        folders = []
        recorded = self.results.get("kernel_artifacts")
        if recorded:
            folders.append(self.folder / recorded if not Path(recorded).is_absolute()
                           else Path(recorded))
        folders += [self.folder / artifacts.folder_for(r["impl"]) for r in self.ok]
        return list(dict.fromkeys(folders))

    def _kernel_panel(self, found) -> str:
        meta, name = found["meta"], found["name"]
        where = meta.get("source") or "?"
        lines = {}
        if found.get("ptx"):
            lines = artifacts.ptx_line_map(found["ptx"], where.rsplit(":", 1)[0])
        if found.get("source"):
            source = source_view.source_html(found["source"], lines)
        else:
            source = _note(f"source missing: no {name}.{artifacts.SOURCE_SUFFIX} in "
                           f"{found['folder']}")
        return (f'<h3 id="kernel-{_e(name)}">{_e(name)}</h3>'
                f'<p>Source: <code>{_e(where)}</code> (<code>def {_e(name)}'
                f"</code>), from its first jit function on. Lines marked "
                f"in green became matrix (Tensor Core) instructions; "
                f"the badges count the PTX instructions the compiler's line info ties to each "
                f"line and link to them.</p>"
                f'<div class="pair"><div class="srcpane">{source}</div>'
                f'<div class="compiled">{self._compiled(found, lines)}</div></div>')

    def _compiled(self, found, lines) -> str:
        meta = found["meta"]
        config, compiled = meta.get("config", {}), meta.get("compiled", {})
        parts = ["<h3>Compiled for this shape</h3>", _kv_table(
            [("kernel", meta.get("kernel")), ("shape [b, h, s, d]", meta.get("shape")),
             ("dtype", meta.get("dtype"))]
            + list(config.items())
            + [("compiled num_warps", compiled.get("num_warps")),
               ("compiled num_stages", compiled.get("num_stages")),
               ("registers / thread", compiled.get("registers_per_thread")),
               ("spills", compiled.get("spills")),
               ("shared memory (bytes)", compiled.get("shared_memory_bytes")),
               ("target", compiled.get("target")),
               ("Tensor Cores", evidence_text(meta["tensor_cores"])
                if meta.get("tensor_cores") else None)])]
        mixes = {kind: artifacts.instruction_mix(found[kind], kind)
                 for kind in ("sass", "ptx") if found.get(kind)}
        if mixes:
            head = "".join(f"<th>{kind.upper()}</th>" for kind in mixes)
            body = "".join(f"<tr><th>{_e(cls)}</th>"
                           + "".join(f'<td class="num">{mix[cls]}</td>' for mix in mixes.values())
                           + "</tr>" for cls in artifacts.MIX_CLASSES)
            parts += ["<h3>Instruction mix (static counts)</h3>",
                      f'<table class="kv"><tr><th>class</th>{head}</tr>{body}</table>']
            if "sass" not in mixes:
                parts.append(_note("no SASS: no cuobjdump was found on the GPU machine"))
        parts += ["<h3>Source lines and what they became</h3>", source_view.line_list(lines)]
        links = [f'<a href="{_e(self._href(found["folder"] / name))}">{_e(name)}</a>'
                 for name in sorted(os.listdir(found["folder"]))
                 if name.startswith(found["name"] + ".")]
        parts.append("<p>Artifacts: " + ", ".join(links) + "</p>")
        return "".join(parts)

    # --- traces -------------------------------------------------------------------------------

    def _href(self, path: Path) -> str:
        return Path(os.path.relpath(path.resolve(), self.output.parent.resolve())).as_posix()

    def traces(self) -> str:
        items = []
        for row in self.ok:
            path = find_row_trace(self.folder, row)
            if path is None:
                items.append(f"<li>{_e(row['impl'])}: trace not found ({_e(row.get('trace'))})"
                             "</li>")
                continue
            table = path.with_name(path.name.removesuffix(".json.gz") + ".txt")
            extra = (f' &middot; <a href="{_e(self._href(table))}">key_averages table</a>'
                     if table.is_file() else "")
            items.append(f'<li>{_e(row["impl"])}: <a href="{_e(self._href(path))}">'
                         f"{_e(path.name)}</a> ({path.stat().st_size / 1024:.1f} KiB){extra}</li>")
        body = (f"<ul>{''.join(items)}</ul>" + f"<p>{PERFETTO}</p>") if items else _note(
            "no traces: no implementation ran")
        return _section("traces", "Traces", body)


UNITS = ("Units: times in microseconds per call, a forward unless the run's mode is fwd_bwd "
         "(CUDA us: busy GPU time, the sum of the call's GPU op durations; CPU us: the "
         "record_function range on the CPU); TFLOP/s = causal attention FLOPs / CUDA time; % "
         "peak of the measured bf16 matmul peak; peak MB = CUDA high-water mark in MiB; max abs "
         "err against a float64 reference. Tensor Cores: the call's verdict (yes / no / partial: "
         "which kernels) and its evidence tiers (counters > sass/ptx > name).")
FWD_BWD_UNITS = ("This run's mode is fwd_bwd: a call is a forward and its backward "
                 "(torch.autograd.grad), so the per-call columns read /fwd+bwd, their kernels, "
                 "time and FLOPs included; the Tensor Cores verdict covers both.")
PERFETTO = ("To explore a trace: open <a href=\"https://ui.perfetto.dev\">ui.perfetto.dev</a>, "
            "choose <b>Open trace file</b> and pick the .json.gz (no need to unzip it). Click a "
            "kernel on the GPU track: its args show <code>attnscope tensor cores</code> and "
            "<code>attnscope evidence</code>, and for <code>_attn_fwd</code> its source line and "
            "compiled configuration. The file links above are relative to this report.")
CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:1400px;padding:0 16px;
color:#212121}
h1{font-size:22px}h2{font-size:18px;border-bottom:1px solid #ddd;padding-bottom:4px;
margin-top:32px}h3{font-size:15px;margin:18px 0 6px}
nav a{margin-right:14px}
table{border-collapse:collapse;font-size:12px}
td,th{border:1px solid #e0e0e0;padding:3px 6px;text-align:left;vertical-align:top}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
table.results{width:100%}
table.results td:not(.num){overflow-wrap:anywhere}
table.results td:first-child{white-space:nowrap;overflow-wrap:normal}
table.kv th{background:#fafafa;font-weight:600}
.note{color:#616161;font-size:12px;max-width:1100px}
.charts{display:flex;flex-wrap:wrap;gap:12px;align-items:flex-start}
img.chart{display:block;max-width:100%;margin:10px 0}
.tc-yes{color:#2e7d32;font-weight:600}.tc-no{color:#757575}.tc-unknown{color:#ef6c00}
.pair{display:flex;gap:16px;align-items:flex-start}
.srcpane{flex:3;max-height:900px;overflow:auto;border:1px solid #e0e0e0}
.compiled{flex:2;min-width:380px}
table.src{font:12px/1.35 ui-monospace,monospace;border:none;width:100%}
table.src td{border:none;padding:0 6px;white-space:pre}
table.src td.ln{color:#9e9e9e;text-align:right;user-select:none}
table.src tr.hot td{background:#e8f5e9}
table.src td.bd{white-space:nowrap;width:1%}
.badge{display:inline-block;border-radius:3px;padding:0 4px;margin-right:3px;font-size:10px;
color:#fff}
.b-mma{background:#2e7d32}.b-exp{background:#6a1b9a}.b-mem{background:#1565c0}
.b-call{background:#81c784}
ul.lines li{margin:4px 0}
pre{font-size:11px;overflow:auto;max-height:300px;background:#fafafa;padding:6px}
"""
