"""The HTML report, the compiled-artifact readers and the annotated traces, on the CPU.

Two results folders: one from a real CPU `compare --report` run (no GPU columns, interpreter),
and a synthetic GPU-like one (H200 env, GPU kernels in small traces, the fused kernel's
artifacts with PTX line info) whose expected contents are worked out below. The HTML is parsed
with html.parser and checked section by section.
"""

import gzip
import json
import shutil
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

from attnscope.profile import artifacts, compare, report
from attnscope.profile import tensor_cores as tc
from attnscope.profile.cli import main
from attnscope.profile.trace import analyze_file, annotate_kernels, load_events

TINY = ["--device", "cpu", "--batch", "1", "--heads", "2", "--seq", "24", "--head-dim", "16"]
CPU_IMPLS = ["naive", "sdpa_math", "fused"]


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
    return out, dump


def test_cpu_report(cpu_run):
    out, _ = cpu_run
    page = _Html((out / "report.html").read_text())
    # The table: header, one row per implementation, GPU columns n/a, the CPU note.
    headers = [h for h, _, _ in compare.COLUMNS]
    assert "Tensor Cores" in headers
    assert page.text["table"].count("n/a") >= len(CPU_IMPLS) * 5
    for name in CPU_IMPLS:
        assert name in page.text["table"]
    assert compare.CPU_NOTE in page.text["table"]
    assert "none (CPU run)" in page.text["table"]  # env block: no GPU
    # One chart (CPU time) and the n/a note for the GPU-only ones.
    assert len(_images(page, "charts")) == 1
    assert "n/a, this run had no GPU" in page.text["charts"]
    assert "no bench.json" in page.text["sweep"]
    # A timeline image per implementation, drawn from its trace.
    for name in CPU_IMPLS:
        assert page.find("timelines", "h3", id=f"timeline-{name}")
        assert page.find("timelines", "img", alt=f"timeline of {name}")
    # The source is there; the compiled panel says it needs a GPU run.
    source = artifacts.source_file().read_text()
    line = artifacts.def_line(source)
    assert page.find("fused", "tr", id=f"src-L{line}")
    assert f"def {artifacts.KERNEL}(" in page.text["fused"]
    assert "compiled artifacts need a GPU run" in page.text["fused"]
    assert page.find("fused", "tr", **{"class": "line hot"}) == []  # no PTX, no marks
    assert len(_check_links(page, out / "report.html")) == len(CPU_IMPLS)
    assert "Open trace file" in page.text["traces"]


def test_cpu_dump_kernel_needs_gpu(cpu_run, capsys):
    _, dump = cpu_run
    assert not dump.exists()
    assert main(["compare", *TINY, "--impl", "naive", "--out", str(dump.parent / "again"),
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
    source = artifacts.source_file().read_text()
    counters = tc.counter_verdict({tc.GMMA: 0, tc.HMMA: 4e6, tc.HFMA2_MMA: 4e6, tc.IMMA: 0,
                                   tc.DMMA: 0, tc.TENSOR_PIPE_PCT: 2.0})
    sass_yes = tc.sass_verdict(SASS)
    impls = {"naive": [(GEMM, tc.name_verdict(GEMM)), (SOFTMAX, tc.name_verdict(SOFTMAX)),
                       (GEMM, None)],
             "sdpa_math": [(SGEMM, tc.combine(counters, tc.name_verdict(SGEMM)))],
             "fused": [(artifacts.KERNEL, tc.combine(sass_yes, tc.name_verdict("_attn_fwd")))]}
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
    kernel_dir = out / compare.KERNEL_DIR
    kernel_dir.mkdir(parents=True)
    ptx, lines = _ptx(source)
    (kernel_dir / f"{artifacts.KERNEL}.0.py").write_text(source)
    (kernel_dir / f"{artifacts.KERNEL}.4.ptx").write_text(ptx)
    (kernel_dir / f"{artifacts.KERNEL}.5.sass").write_text(SASS)
    meta = {"kernel": artifacts.KERNEL, "source": artifacts.source_location(source),
            "shape": [8, 16, 1024, 64], "dtype": "bfloat16",
            "config": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3,
                       "warp_specialize": False},
            "compiled": {"num_warps": 8, "num_stages": 3, "shared_memory_bytes": 24576,
                         "registers_per_thread": 168, "spills": 0, "target": "cuda:90"},
            "sass": True, "tensor_cores": sass_yes}
    (kernel_dir / f"{artifacts.KERNEL}.meta.json").write_text(json.dumps(meta))
    results = {"command": "compare", "shape": {"batch": 8, "heads": 16, "seq": 1024,
                                               "head_dim": 64},
               "dtype": "bf16", "device": "cuda", "env": env, "rows": rows,
               "kernel_artifacts": str(kernel_dir)}
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
    assert "registers / thread168" in fused.replace("\n", "")
    assert "shared memory (bytes)24576" in fused.replace("\n", "")
    assert "need a GPU run" not in fused
    artifact_links = [a["href"] for a in page.find("fused", "a") if "_attn_fwd." in a["href"]]
    assert artifact_links == [f"fused/kernel/{artifacts.KERNEL}.{s}"
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
    assert annotate_kernels(trace, compare._kernel_fields(fused, meta)) == 2  # both forwards
    assert gzip.decompress(trace.read_bytes())  # still gzipped
    assert analyze_file(trace) == before
    kernel = next(e for e in load_events(trace) if e.get("cat") == "kernel")
    args = kernel["args"]
    assert args["registers per thread"] == 96  # Kineto's own args kept
    assert args["attnscope tensor cores"] == "yes"
    assert args["attnscope evidence"].startswith("sass: 2 HGMMA")
    assert args["attnscope source"] == artifacts.source_location()
    assert args["attnscope source"].endswith(
        f":{artifacts.def_line(artifacts.source_file().read_text())}")
    assert args["attnscope config"] == ("BLOCK_M=128 BLOCK_N=64 num_warps=8 num_stages=3 "
                                        "warp_specialize=False")
    assert args["attnscope compiled"] == ("registers/thread 168, spills 0, shared memory "
                                          "24576 B")


def test_compiled_evidence_wins_over_the_name(monkeypatch):
    """Tier-2 wiring: a Triton kernel's SASS verdict replaces its 'unknown' name verdict."""
    seen = []

    def triton_verdicts(names):
        seen.extend(names)
        return {artifacts.KERNEL: tc.sass_verdict(SASS)}
    monkeypatch.setattr(tc, "triton_verdicts", triton_verdicts)
    kernels = [{"name": n, "tensor_cores": tc.name_verdict(n)} for n in (artifacts.KERNEL,
                                                                        SOFTMAX)]
    compare._add_compiled_evidence(kernels)
    assert seen == [artifacts.KERNEL, SOFTMAX]
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
    source = artifacts.source_file().read_text()
    ptx, lines = _ptx(source)
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


def test_compile_for_names_every_config_field(monkeypatch):
    # The artifact meta must follow the kernel's config tuple as it grows (a 5-field unpack broke
    # the H200 run when use_tma was added).
    from attnscope.kernels import attention_fwd as kernels
    from attnscope.profile import artifacts

    monkeypatch.setattr(kernels, "is_interpreted", lambda: False)
    monkeypatch.setattr(kernels, "attention_fwd", lambda *a, **kw: "compiled")
    q = torch.randn(1, 2, 8, 16)
    kernel, config, origin = artifacts.compile_for(q, q, q)
    assert kernel == "compiled"
    assert list(config) == list(kernels.CONFIG_FIELDS)
    assert tuple(config.values()) == kernels.SHORT_CONFIGS[64]  # the causal launch of 8 queries
    assert origin == (artifacts.MODULE, artifacts.SOURCE_PATH, artifacts.KERNEL)
    long = torch.randn(1, 2, kernels.SHORT_SEQ + 1, 16)
    assert tuple(artifacts.compile_for(long, long, long)[1].values()) == kernels.CONFIGS[64]


def test_compile_for_names_the_gluon_kernel_where_the_op_runs_it(monkeypatch):
    # Where the op takes the Gluon kernel, the artifacts must carry its source, name and config,
    # not the Triton kernel's.
    from attnscope.kernels import attention_fwd as kernels
    from attnscope.kernels import attention_fwd_hopper as hopper
    from attnscope.profile import artifacts

    monkeypatch.setattr(kernels, "is_interpreted", lambda: False)
    monkeypatch.setattr(kernels, "uses_hopper_kernel", lambda *a: True)
    monkeypatch.setattr(kernels, "attention_fwd", lambda *a, **kw: "compiled")
    q = torch.randn(1, 2, 8, 128)
    kernel, config, origin = artifacts.compile_for(q, q, q)
    assert origin == (artifacts.HOPPER_MODULE, artifacts.HOPPER_SOURCE_PATH,
                      artifacts.HOPPER_KERNEL)
    assert list(config) == list(hopper.CONFIG_FIELDS)
    assert tuple(config.values()) == hopper.CONFIGS[128]
    source = artifacts.source_file(origin[0]).read_text()
    assert f"def {artifacts.HOPPER_KERNEL}(" in source
    assert artifacts.source_location(source, *origin[1:]).startswith(artifacts.HOPPER_SOURCE_PATH)
