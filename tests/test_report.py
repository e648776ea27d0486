"""The HTML report, the compiled-artifact readers and the annotated traces, on the CPU.

Two results folders: one from a real CPU `compare --report` run (no GPU columns, interpreter),
and a synthetic GPU-like one (H200 env, GPU kernels in small traces, the fused kernel's
artifacts with PTX line info) whose expected contents are worked out below. The HTML is parsed
with html.parser and checked section by section.
"""

import gzip
import json
import os
import shutil
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from attnscope.attention import IMPLEMENTATIONS, Implementation
from attnscope.attention.registry import CompiledKernel
from attnscope.profile import artifacts, compare, compiled, report, runs
from attnscope.profile import tensor_cores as tc
from attnscope.profile.cli import main
from attnscope.profile.table import COLUMNS, CPU_NOTE
from attnscope.profile.trace import VERDICT_ARG, analyze_file, annotate_kernels, load_events

TINY = ["--device", "cpu", "--batch", "1", "--heads", "2", "--seq", "24", "--head-dim", "16"]
CPU_IMPLS = ["naive", "sdpa_math", "fused"]
KERNEL = "_attn_fwd"
SOURCE_PATH = "attnscope/kernels/attention_fwd.py"
# What an H200 `compare` wrote for the Triton forward at the seed shape (bf16): the source it
# compiled (an older version of the kernel, kept because its PTX's line info refers to it), the
# PTX, and the meta with the compiler's figures.
H200_KERNEL = Path(__file__).parent / "data" / "h200_seed" / "fused" / "kernel"


def _h200_record(ptx=None) -> CompiledKernel:
    """The CompiledKernel record the fused entry would hand over for that launch, built from the
    committed artifacts; `ptx` replaces the real PTX (the synthetic one below has known lines)."""
    meta = json.loads((H200_KERNEL / f"{KERNEL}.meta.json").read_text())
    compiled = meta["compiled"]
    return CompiledKernel(
        name=KERNEL, source_path=SOURCE_PATH,
        source=gzip.decompress((H200_KERNEL / f"{KERNEL}.0.py.gz").read_bytes()).decode(),
        config=meta["config"],
        asm={"ptx": ptx or gzip.decompress((H200_KERNEL / f"{KERNEL}.4.ptx.gz").read_bytes())
             .decode()},
        metadata={"n_regs": compiled["registers_per_thread"], "n_spills": compiled["spills"],
                  "shared": compiled["shared_memory_bytes"], "num_warps": compiled["num_warps"],
                  "num_stages": compiled["num_stages"], "target": compiled["target"]})


class _Html(HTMLParser):
    """Tags (with attributes) and text, each under the id of the <section> it sits in."""

    def __init__(self, text):
        super().__init__()
        self.section = None
        self.tags, self.text = {}, {}
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "section":
            self.section = attrs["id"]
        self.tags.setdefault(self.section, []).append((tag, attrs))

    def handle_data(self, data):
        self.text[self.section] = self.text.get(self.section, "") + data

    def find(self, section, tag, **attrs):
        return [a for t, a in self.tags.get(section, []) if t == tag
                and all(a.get(k) == v for k, v in attrs.items())]


def _images(page, section):
    imgs = page.find(section, "img")
    assert all(a["src"].startswith("data:image/png;base64,") for a in imgs)  # inline, no network
    return imgs


def _check_links(page, report_path):
    hrefs = [a["href"] for a in page.find("traces", "a") if a["href"].endswith(".json.gz")]
    for href in hrefs:
        assert (report_path.parent / href).is_file(), href
    return hrefs


# --- a real CPU run ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("cpu") / "out"
    dump = out.parent / "dump"
    assert main(["compare", *TINY, "--impl", *CPU_IMPLS, "--out", str(out), "--report",
                 "--dump-kernel", str(dump)]) == 0
    return out / runs.LATEST, dump


def test_cpu_report(cpu_run):
    out, _ = cpu_run
    page = _Html((out / "report.html").read_text())
    # The table: header, one row per implementation, GPU columns n/a, the CPU note.
    headers = [h for h, _, _ in COLUMNS]
    assert "Tensor Cores" in headers
    assert page.text["table"].count("n/a") >= len(CPU_IMPLS) * 5
    for name in CPU_IMPLS:
        assert name in page.text["table"]
    assert CPU_NOTE in page.text["table"]
    assert "none (CPU run)" in page.text["table"]  # env block: no GPU
    # One chart (CPU time) and the n/a note for the GPU-only ones.
    assert len(_images(page, "charts")) == 1
    assert "n/a, this run had no GPU" in page.text["charts"]
    assert "no bench.json" in page.text["sweep"]
    # A timeline image per implementation, drawn from its trace.
    for name in CPU_IMPLS:
        assert page.find("timelines", "h3", id=f"timeline-{name}")
        assert page.find("timelines", "img", alt=f"timeline of {name}")
    # The interpreter compiles nothing: the panel says the artifacts are missing, and why.
    assert "compiled artifacts missing: this was a CPU run" in page.text["fused"]
    assert page.find("fused", "tr") == []
    assert len(_check_links(page, out / "report.html")) == len(CPU_IMPLS)
    assert "Open trace file" in page.text["traces"]


def test_cpu_dump_kernel_needs_gpu(cpu_run, capsys):
    _, dump = cpu_run
    assert not dump.exists()
    assert main(["compare", *TINY, "--impl", "fused", "--out", str(dump.parent / "again"),
                 "--dump-kernel", str(dump)]) == 0
    assert "--dump-kernel: needs a CUDA GPU" in capsys.readouterr().err
    assert not dump.exists()


def test_report_subcommand_output_elsewhere(cpu_run, tmp_path, capsys):
    out, _ = cpu_run
    target = tmp_path / "elsewhere" / "r.html"
    assert main(["report", str(out), "-o", str(target)]) == 0
    assert capsys.readouterr().out.strip() == f"report: {target}"
    page = _Html(target.read_text())
    assert len(_check_links(page, target)) == len(CPU_IMPLS)  # relative to the report


def test_report_says_so_of_an_unreadable_bench_file(cpu_run, tmp_path):
    # a truncated bench.json in the folder: the report says so in its sweep section, no traceback
    out, _ = cpu_run
    folder = tmp_path / "copy"
    shutil.copytree(out.resolve(), folder)
    (folder / report.BENCH_FILE).write_text('{"rows": [{"impl": "fus')
    target = tmp_path / "r.html"
    assert main(["report", str(folder), "-o", str(target)]) == 0
    assert "cannot be read as a bench file" in target.read_text()


# --- a synthetic GPU run -----------------------------------------------------------------------

GEMM = "ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x4_nn"  # name tier: yes
SOFTMAX = "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>(float*)"
SGEMM = "ampere_sgemm_64x64_nn"  # name says no; counters below say no too
PEAK = 809.0


def _x(cat, name, ts, dur, pid, tid, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": pid, "tid": tid,
            "args": args}


def _trace(impl, kernels):
    """Two forwards of `impl`, each launching `kernels` (names) back to back; 2 us launches."""
    events = [{"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "python"}}]
    corr = 0
    for start in (1000, 5000):
        events.append(_x("user_annotation", impl, start, 100, 1, 1))
        events.append(_x("cpu_op", "aten::op", start + 5, 80, 1, 1))
        for i, name in enumerate(kernels):
            corr += 1
            events.append(_x("cuda_runtime", "cudaLaunchKernel", start + 10 + 10 * i, 2, 1, 1,
                             correlation=corr))
            events.append(_x("kernel", name, start + 50 + 30 * i, 20, 0, 7, correlation=corr,
                             stream=7, **{"registers per thread": 96}))
    return {"traceEvents": events}


def _source_line(source, needle):
    return next(i for i, line in enumerate(source.splitlines(), 1) if needle in line)


def _ptx(source):
    """PTX with the compiler's line info: one wgmma per tl.dot, inlined into the stage calls."""
    qk = _source_line(source, "tl.dot(q, k,")
    pv = _source_line(source, "tl.dot(p.to(")
    exp = _source_line(source, "p = tl.math.exp2(qk)")
    stage1 = _source_line(source, "# stage 1:") + 1
    store = _source_line(source, "tl.store(o_ptrs")
    inl = ", function_name $L__info_string0, inlined_at 1 {} 21"
    body = f"""
.visible .entry _attn_fwd(
	.param .u64 _attn_fwd_param_0
)
{{
	.loc	1 92 0
	ld.param.u64 	%rd1, [_attn_fwd_param_0];
	ld.global.b16 	%rs1, [%rd1];
	.loc	1 {qk} 14{inl.format(stage1)}
	wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {{%r1,%r2}}, %rd2, %rd3, 0, 1, 1, 0, 1;
	.loc	1 {exp} 12{inl.format(stage1)}
	ex2.approx.ftz.f32 	%f1, %f2;
	ex2.approx.ftz.f32 	%f3, %f4;
	.loc	1 {pv} 15{inl.format(stage1)}
	@%p1 wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {{%r1,%r2}}, %rd4, %rd5, %p2, 1, 1, 0, 1;
	.loc	2 40 10
	max.f32 	%f5, %f6, %f7;
	.loc	1 {store} 4
	st.global.b16 	[%rd6], %rs2;
	ret;
}}
	.file	1 "/elsewhere/attnscope/kernels/attention_fwd.py"
	.file	2 "/elsewhere/triton/language/standard.py"
"""
    return body, {"qk": qk, "pv": pv, "exp": exp, "stage1": stage1}


SASS = """
        /*0a40*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8].tnspB, RZ, !UPT ;
        /*0a50*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR12].tnspB, R24 ;
        /*0a60*/              @!P0 MUFU.EX2 R3, R3 ;
        /*0a70*/                   MUFU.RCP R4, R4 ;
        /*0a80*/                   FFMA R5, R5, R6, R7 ;
        /*0a90*/                   LDG.E.U16 R8, desc[UR4][R2.64] ;
        /*0aa0*/                   STG.E.U16 desc[UR4][R2.64], R8 ;
        /*0ab0*/                   EXIT ;
"""


@pytest.fixture
def gpu_folder(tmp_path):
    out = tmp_path / "gpu"
    record = _h200_record()
    source = record.source
    counters = tc.counter_verdict({tc.GMMA: 0, tc.HMMA: 4e6, tc.HFMA2_MMA: 4e6, tc.IMMA: 0,
                                   tc.DMMA: 0, tc.TENSOR_PIPE_PCT: 2.0})
    sass_yes = tc.sass_verdict(SASS)
    impls = {"naive": [(GEMM, tc.name_verdict(GEMM)), (SOFTMAX, tc.name_verdict(SOFTMAX)),
                       (GEMM, None)],
             "sdpa_math": [(SGEMM, tc.combine(counters, tc.name_verdict(SGEMM)))],
             "fused": [(KERNEL, tc.combine(sass_yes, tc.name_verdict(KERNEL)))]}
    rows = []
    for impl, kernels in impls.items():
        trace = out / impl / f"8_16_1024_64_{impl}.json.gz"
        trace.parent.mkdir(parents=True)
        trace.write_bytes(gzip.compress(json.dumps(_trace(impl, [n for n, _ in kernels]))
                                        .encode()))
        trace.with_name(trace.name.removesuffix(".json.gz") + ".txt").write_text("table\n")
        analysis = analyze_file(trace, [impl])["ranges"][impl]
        for k in analysis["kernels"]:
            k["tensor_cores"] = next(v for n, v in kernels if n == k["name"])
        cuda_us = analysis["cuda_time_avg_us"]
        rows.append({"impl": impl, "description": f"{impl} test row", "seed_script": "",
                     "status": "ok", "reason": "", "trace": str(trace), "table": "",
                     "peak_memory_mb": 100.0, "max_abs_error": 1e-3, **analysis,
                     "tensor_cores": tc.forward_summary(analysis["kernels"]),
                     "tflops": 68.7e9 / (cuda_us * 1e-6) / 1e12,
                     "pct_of_peak": 100 * 68.7e9 / (cuda_us * 1e-6) / 1e12 / PEAK})
    rows.append({"impl": "sdpa_cudnn", "description": "", "seed_script": "",
                 "status": "unavailable", "reason": "cuDNN too old"})
    env = {"torch": "2.11", "triton": "3.6", "gpu": {"name": "NVIDIA H200",
                                                       "measured_bf16_peak_tflops": PEAK}}
    kernel_dir = out / artifacts.folder_for("fused")
    ptx, lines = _ptx(source)
    [meta] = artifacts.write([_h200_record(ptx)], kernel_dir, [8, 16, 1024, 64], "bfloat16")
    (kernel_dir / f"{KERNEL}.5.sass").write_text(SASS)  # what cuobjdump gives on the GPU
    results = {"command": "compare", "shape": {"batch": 8, "heads": 16, "seq": 1024,
                                               "head_dim": 64},
               "dtype": "bf16", "device": "cuda", "env": env, "rows": rows,
               "kernel_artifacts": str(kernel_dir.relative_to(out))}
    (out / "results.json").write_text(json.dumps(results))
    bench_rows = [{"shape": [8, 16, s, 64], "kv_heads": 16, "impl": impl, "status": "ok",
                   "tflops": t} for s, impl, t in [(512, "fused", 300.0), (1024, "fused", 400.0),
                                                   (512, "sdpa_flash", 250.0),
                                                   (1024, "sdpa_flash", 350.0)]]
    (out / report.BENCH_FILE).write_text(json.dumps({
        "device": "cuda", "sweep": "seed", "timing": {"timer": "do_bench"},
        "summary": {"fused": {"geomean_ratio_to_best_peer": 1.16, "shapes": 2}},
        "rows": bench_rows}))
    return out, lines, meta


def test_gpu_report(gpu_folder):
    out, lines, meta = gpu_folder
    assert main(["report", str(out)]) == 0
    page = _Html((out / "report.html").read_text())
    table = page.text["table"]
    assert "partial: ampere_bf16_s16816gemm" in table  # naive: GEMMs yes, softmax no
    assert "no (counters)" in table and "yes (sass)" in table
    assert "unavailable: cuDNN too old" in table and "NVIDIA H200" in table
    assert [a["alt"] for a in _images(page, "charts")] == ["time per forward",
                                                          "kernels per forward", "TFLOP/s"]
    assert len(_images(page, "sweep")) == 1 and "1.160 over 2 shapes" in page.text["sweep"]
    for impl in ("naive", "sdpa_math", "fused"):
        assert page.find("timelines", "img", alt=f"timeline of {impl}")
    timelines = page.text["timelines"]
    assert "counters: 0 matrix instructions executed, tensor pipe 2.0% active" in timelines
    assert "sass: 2 HGMMA, 1 FFMA, 1 MUFU.EX2 in 8 instructions" in timelines
    # Source: the two tl.dot lines hot, linked both ways to their PTX; the stage-1 call site
    # counts the two matrix instructions inlined into it.
    hot = page.find("fused", "tr", **{"class": "line hot"})
    assert [a["id"] for a in hot] == [f"src-L{lines['qk']}", f"src-L{lines['pv']}"]
    for key in ("qk", "pv", "exp", "stage1"):
        assert page.find("fused", "li", id=f"ptx-L{lines[key]}")
        assert page.find("fused", "a", href=f"#ptx-L{lines[key]}")
    fused = page.text["fused"]
    assert "call site of inlined code: 2 matrix, 2 exp2" in fused
    assert "registers / thread127" in fused.replace("\n", "")
    assert "shared memory (bytes)57344" in fused.replace("\n", "")
    assert "missing" not in fused
    artifact_links = [a["href"] for a in page.find("fused", "a") if "_attn_fwd." in a["href"]]
    assert artifact_links == [f"fused/kernel/{KERNEL}.{s}"
                              for s in ("0.py", "4.ptx", "5.sass", "meta.json")]
    assert len(_check_links(page, out / "report.html")) == 3


def test_report_of_moved_folder(gpu_folder, tmp_path):
    """Traces are found under the folder when the paths in results.json no longer exist."""
    out, _, _ = gpu_folder
    moved = tmp_path / "moved"
    shutil.move(out, moved)
    assert main(["report", str(moved)]) == 0
    page = _Html((moved / "report.html").read_text())
    assert len(_check_links(page, moved / "report.html")) == 3
    assert page.find("fused", "tr", **{"class": "line hot"})  # artifacts found under the folder


def test_annotated_trace_still_loads(gpu_folder):
    out, _, meta = gpu_folder
    results = json.loads((out / "results.json").read_text())
    fused = next(r for r in results["rows"] if r["impl"] == "fused")
    trace = Path(fused["trace"])
    before = analyze_file(trace)
    assert annotate_kernels(trace, compare._kernel_fields(fused, [meta])) == 2  # both forwards
    assert gzip.decompress(trace.read_bytes())  # still gzipped
    # What analysis reads back: the same figures, and the verdict compare wrote (SASS) where
    # the name alone said unknown.
    after = analyze_file(trace)
    [kernel_row] = after["ranges"]["fused"]["kernels"]
    assert kernel_row["tensor_cores"] == fused["kernels"][0]["tensor_cores"]
    kernel_row["tensor_cores"] = before["ranges"]["fused"]["kernels"][0]["tensor_cores"]
    assert after == before
    kernel = next(e for e in load_events(trace) if e.get("cat") == "kernel")
    args = kernel["args"]
    assert args["registers per thread"] == 96  # Kineto's own args kept
    assert args["attnscope tensor cores"] == "yes"
    assert args["attnscope evidence"].startswith("sass: 2 HGMMA")
    assert args[VERDICT_ARG]["verdict"] == "yes" and args[VERDICT_ARG]["evidence"] == "sass"
    assert args["attnscope source"] == f"{SOURCE_PATH}:213"  # `def _attn_fwd(` in that source
    assert args["attnscope config"] == ("BLOCK_M=64 BLOCK_N=64 num_warps=4 num_stages=3 "
                                        "pipeline=False use_tma=False maxnreg=None")
    assert args["attnscope compiled"] == ("registers/thread 127, spills 0, shared memory "
                                          "57344 B")


def test_compiled_evidence_wins_over_the_name(monkeypatch):
    """Tier-2 wiring: a Triton kernel's SASS verdict replaces its 'unknown' name verdict."""
    seen = []

    def triton_verdicts(names):
        seen.extend(names)
        return {KERNEL: tc.sass_verdict(SASS)}
    monkeypatch.setattr(compiled, "triton_verdicts", triton_verdicts)
    kernels = [{"name": n, "tensor_cores": tc.name_verdict(n)} for n in (KERNEL, SOFTMAX)]
    compare._add_compiled_evidence(kernels)
    assert seen == [KERNEL, SOFTMAX]
    ours, softmax = (k["tensor_cores"] for k in kernels)
    assert (ours["verdict"], ours["evidence"], ours["other"]) == ("yes", "sass",
                                                                  {"name": "unknown"})
    assert (softmax["verdict"], softmax["evidence"]) == ("no", "name")
    assert tc.forward_summary(kernels) == {"verdict": "partial: _attn_fwd",
                                           "evidence": "sass, name"}


def test_instruction_mix_and_line_map():
    mix = artifacts.instruction_mix(SASS, "sass")
    assert (mix["matrix"], mix["exp2"], mix["other special functions"]) == (2, 1, 1)
    assert (mix["global loads"], mix["global stores"], mix["all instructions"]) == (1, 1, 8)
    ptx, lines = _ptx(_h200_record().source)
    ptx_mix = artifacts.instruction_mix(ptx, "ptx")
    assert (ptx_mix["matrix"], ptx_mix["exp2"], ptx_mix["global loads"]) == (2, 2, 1)
    assert ptx_mix["all instructions"] == 9  # ld.param, ld, 2 wgmma, 2 ex2, max, st, ret
    by_line = artifacts.ptx_line_map(ptx, "attention_fwd.py")
    assert by_line[lines["qk"]]["classes"] == {"matrix": 1}
    assert by_line[lines["exp"]]["classes"] == {"exp2": 2}
    assert by_line[lines["stage1"]]["inlined"] == {"matrix": 2, "exp2": 2}
    assert 40 not in by_line  # standard.py's line 40 is not ours
    assert by_line[92]["classes"] == {"other": 1, "global loads": 1}


def test_missing_dependencies_say_what_to_install(gpu_folder, monkeypatch, capsys):
    out, _, _ = gpu_folder
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # find_spec then reports it missing
    assert main(["report", str(out)]) == 2
    assert "needs matplotlib: pip install 'attnscope[report]'" in capsys.readouterr().err
    monkeypatch.setattr(compare, "capture", lambda *a: pytest.fail("profiled anyway"))
    assert main(["compare", *TINY, "--impl", "naive", "--out", str(out / "c"), "--report"]) == 2
    assert "pip install 'attnscope[report]'" in capsys.readouterr().err


def test_report_without_results(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "no results.json in" in capsys.readouterr().err


# --- our compiled kernels come from the registry entry, not from a kernel module ---------------

def test_compare_writes_the_records_an_entry_hands_over(tmp_path, monkeypatch):
    """A stand-in for the fused entry: its compiled_kernels() returns the H200 record; compare
    writes its artifacts from that record (source, PTX, meta) and the report shows them."""
    record = _h200_record()
    monkeypatch.setitem(IMPLEMENTATIONS, "ours", Implementation(
        "ours", "stand-in for the fused entry", "", lambda device: (True, "test"),
        lambda q, k, v: lambda: q * 2, ours=True, compiled_kernels=lambda: [record]))
    out = tmp_path / "out"
    assert main(["compare", *TINY, "--impl", "ours", "--out", str(out), "--report"]) == 0
    run = out / runs.LATEST
    folder = run / artifacts.folder_for("ours")
    assert json.loads((run / runs.RESULTS).read_text())["kernel_artifacts"] == "ours/kernel"
    assert gzip.decompress((H200_KERNEL / f"{KERNEL}.4.ptx.gz").read_bytes()).decode() == (
        folder / f"{KERNEL}.4.ptx").read_text()
    assert (folder / f"{KERNEL}.0.py").read_text() == record.source
    meta = json.loads((folder / f"{KERNEL}.meta.json").read_text())
    assert meta["source"] == f"{SOURCE_PATH}:213" and meta["config"] == record.config
    assert meta["compiled"]["registers_per_thread"] == 127 and meta["compiled"]["spills"] == 0
    # No cuobjdump here, so tier 2 reads the PTX: the real one holds wgmma instructions.
    assert (meta["tensor_cores"]["verdict"], meta["tensor_cores"]["evidence"]) == ("yes", "ptx")
    page = _Html((run / "report.html").read_text())
    assert page.find("fused", "h3", id=f"kernel-{KERNEL}")
    assert page.find("fused", "tr", **{"class": "line hot"})  # real line info: tl.dot lines
    assert "missing" not in page.text["fused"]


def test_a_backward_variant_s_forward_kernels_are_written_once(tmp_path, monkeypatch, capsys):
    """An entry that differs from ours only in the backward (backward_variant_of) hands over the
    same forward kernels: compare --mode fwd_bwd writes them once, under the entry they belong
    to, and its trace's kernels get the same fields. Listed first, the variant still waits."""
    record = _h200_record()
    for name, variant_of in (("ours", None), ("ours_variant", "ours")):
        monkeypatch.setitem(IMPLEMENTATIONS, name, Implementation(
            name, "stand-in", "", lambda device: (True, "test"),
            lambda q, k, v: lambda: q * k.sum() + v.sum(), ours=True,
            compiled_kernels=lambda: [record], backward_variant_of=variant_of))
    out = tmp_path / "out"
    assert main(["compare", *TINY, "--mode", "fwd_bwd", "--impl", "ours_variant", "ours",
                 "--out", str(out)]) == 0
    run = out / runs.LATEST
    assert (run / artifacts.folder_for("ours") / f"{KERNEL}.meta.json").is_file()
    assert not (run / artifacts.folder_for("ours_variant")).exists()
    assert json.loads((run / runs.RESULTS).read_text())["kernel_artifacts"] == "ours/kernel"
    assert "ours_variant: its forward kernels are ours's" in capsys.readouterr().err


def test_compiled_evidence_of_our_entry_comes_from_its_records(monkeypatch):
    monkeypatch.setattr(compiled, "triton_verdicts", lambda names: {})  # nothing found in Triton's
    impl = Implementation("ours", "", "", lambda d: (True, ""), lambda q, k, v: None,
                          ours=True, compiled_kernels=lambda: [_h200_record()])
    kernels = [{"name": KERNEL, "tensor_cores": tc.name_verdict(KERNEL)}]
    compare._add_compiled_evidence(kernels, impl)
    assert (kernels[0]["tensor_cores"]["verdict"], kernels[0]["tensor_cores"]["evidence"]) == (
        "yes", "ptx")


def test_report_says_where_artifacts_are_missing(gpu_folder):
    out, _, _ = gpu_folder
    shutil.rmtree(out / artifacts.folder_for("fused"))
    assert main(["report", str(out)]) == 0
    fused = _Html((out / "report.html").read_text()).text["fused"]
    assert "compiled artifacts missing" in fused and "fused/kernel" in fused


# --- report: refusals, one line each ---------------------------------------------------------

def test_report_output_a_directory_or_unwritable_is_one_line(gpu_folder, tmp_path, capsys):
    out, _, _ = gpu_folder
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    for target, says in ((tmp_path, "is a directory"),
                         (blocker / "r.html", "cannot create the folder of")):
        assert main(["report", str(out), "-o", str(target)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("attnscope report: error: ") and says in err
        assert len(err.splitlines()) == 1


def test_report_output_a_device_or_pipe_is_refused(gpu_folder, tmp_path, capsys):
    # The page is written by replacing the file: -o /dev/null would replace the device (a FIFO
    # stands in for it here).
    import stat
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    assert main(["report", str(gpu_folder[0]), "-o", str(pipe)]) == 2
    assert "is not a regular file" in capsys.readouterr().err
    assert stat.S_ISFIFO(os.stat(pipe).st_mode)


def test_report_of_results_without_rows_is_refused(tmp_path, capsys):
    (tmp_path / runs.RESULTS).write_text(json.dumps({"command": "compare", "rows": []}))
    assert main(["report", str(tmp_path)]) == 2
    assert "holds no rows" in capsys.readouterr().err
    assert not (tmp_path / report.DEFAULT_NAME).exists()


@pytest.mark.parametrize("text, says", [
    (json.dumps({"command": ["bench"], "sweep": "default", "rows": [{"impl": "fused"}]}),
     "is a bench file"),
    (json.dumps({"rows": [1, 2]}), "is not a compare run's results"),
    (json.dumps({"rows": [{"impl": "fused"}]}), "is not a compare run's results"),
    (json.dumps([{"impl": "fused", "status": "ok"}]), "is not a compare run's results"),
    (b"\xff\xfe{".decode("latin-1"), "is not valid JSON"),
])
def test_report_of_a_file_that_is_no_compare_run_is_one_line(text, says, tmp_path, capsys):
    (tmp_path / runs.RESULTS).write_bytes(text.encode("latin-1"))
    assert main(["report", str(tmp_path)]) == 2
    assert says in capsys.readouterr().err


def test_report_says_so_of_a_compare_run_saved_as_its_bench_file(cpu_run, tmp_path):
    out, _ = cpu_run
    folder = tmp_path / "copy"
    shutil.copytree(out.resolve(), folder)
    shutil.copy(folder / runs.RESULTS, folder / report.BENCH_FILE)
    target = tmp_path / "r.html"
    assert main(["report", str(folder), "-o", str(target)]) == 0
    assert "it is a compare run&#x27;s results" in target.read_text()


def test_report_of_an_out_folder_reads_its_latest_run(cpu_run, capsys):
    latest, _ = cpu_run
    out = latest.parent
    assert main(["report", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"report: {latest / report.DEFAULT_NAME}"


def test_the_table_shortens_kernel_names_and_says_what_a_call_ran():
    from attnscope.profile.table import NAME_CHARS, format_table, headers
    long = ("kernel_cutlass_kernel_flash_attncuteflash_bwd_sm90"
            "FlashAttentionBackwardSm90_object_at_0")
    row = {"impl": "fa4", "status": "ok", "kernels_per_forward": 2, "gpu_ops_per_forward": 2,
           "tensor_cores": {"verdict": f"partial: {long}, void at::native::softmax<float>(float*)",
                            "evidence": "counters"},
           "cuda_time_avg_us": 1.0, "cpu_time_avg_us": 2.0, "tflops": 3.0, "pct_of_peak": 4.0,
           "peak_memory_mb": 5.0, "max_abs_error": 1e-3, "launch_apis": ["cuLaunchKernel"]}
    text = format_table([row], "cuda", "fwd_bwd")
    # a CuTe DSL kernel (FA4's) by its class; other names past NAME_CHARS cut
    cell = "partial: FlashAttentionBackwardSm90, at::native::softmax (counters)"
    assert cell in text and long not in text
    row["tensor_cores"]["verdict"] = "partial: " + "x" * 40
    assert f"partial: {'x' * (NAME_CHARS - 3)}... (counters)" in format_table([row], "cuda")
    assert text.splitlines()[0].split()[:3] == ["impl", "kernels/fwd+bwd", "GPU"]
    assert headers()[1] == "kernels/fwd" and headers("fwd_bwd")[4] == "CUDA us/fwd+bwd"
    # A kernel in an anonymous namespace is named by its function, its template arguments gone
    # (the verdict lists short names, so no name of it splits at ", ").
    kernels = [{"name": "void (anonymous namespace)::softmax_warp_forward<c10::BFloat16, float, "
                        "10>(float*, int)", "tensor_cores": {"verdict": "yes", "evidence": "name"}},
               {"name": "void at::native::elementwise_kernel<128, 4>(int)",
                "tensor_cores": {"verdict": "no", "evidence": "name"}}]
    summary = tc.forward_summary(kernels)
    assert summary["verdict"] == "partial: softmax_warp_forward"


def test_report_shows_where_warps_waited_after_ncu_stalls(gpu_folder):
    """A kernel that `ncu --stalls` summed up gets a warp-states cell in its forward's op table;
    the other kernels of that table a "-"; a table without any keeps its columns."""
    from attnscope.profile import stalls

    out, _, _ = gpu_folder
    page = gzip.open(Path(__file__).parent / "data" / "h200_stalls" /
                     "fused_nondeterministic.stalls.csv.gz", "rt").read()
    (summary,) = stalls.summarize(stalls.parse_source_page(page)).values()
    results = json.loads((out / "results.json").read_text())
    for row in results["rows"]:
        if row["impl"] == "fused":
            row["kernels"][0]["stalls"] = summary
    (out / "results.json").write_text(json.dumps(results))
    assert main(["report", str(out)]) == 0
    page = _Html((out / "report.html").read_text())
    timelines = page.text["timelines"]
    assert ("296,367 samples: barrier 28.5%, long_sb 28.3%, wait 9.9%; hottest: NOP 16.5% "
            "(executed 8,192; barrier)") in timelines
    assert timelines.count("warp states (ncu --stalls)") == 1  # the fused table only
