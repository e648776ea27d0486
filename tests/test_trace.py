"""Trace analysis on a small synthetic Kineto trace whose answers are worked out by hand below.

Layout of the trace (times in us; CPU thread (100, 100) unless said; GPU pid 0, stream 7):
  ProfilerStep#2      0..1000   the profiler's own range: skipped
  attn #1           100..300    launches: kernel (corr 1), memcpy (2), memset (3),
                                cuLaunchKernelEx kernel (4), a sync that launches nothing (5)
    inner           105..135    nested range holding launches 1..3
  thread (100, 200): a launch at 160 (corr 6), inside attn #1's time but on another thread
  attn #2           500..600    launches: kernel (7), cuLaunchKernelEx kernel (8)
  a launch at 800 (corr 9), inside no range; a kernel (corr 99) whose launch is missing
"""

import gzip
import json

import pytest

from attnscope.profile.cli import main
from attnscope.profile.tensor_cores import name_verdict
from attnscope.profile.trace import (TraceError, analyze_events, analyze_file, forward_events,
                                     load_events)

GEMM = "sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize32x32x8_stage3_warpsize1x2x1_ffma_kernel"
SOFTMAX = "softmax_warp_forward"
CPU, OTHER_THREAD, GPU = (100, 100), (100, 200), (0, 7)


def _x(cat, name, ts, dur, where, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": where[0],
            "tid": where[1], "args": args}


def _launch(name, ts, corr, where=CPU, cat="cuda_runtime"):
    return _x(cat, name, ts, 5, where, correlation=corr, cbid=211)


def _kernel(name, ts, dur, corr, **args):
    return _x("kernel", name, ts, dur, GPU, correlation=corr, stream=7, **args)


GEMM_ARGS = {"registers per thread": 128, "shared memory": 49152, "grid": [8, 16, 1],
             "block": [128, 1, 1], "est. achieved occupancy %": 25}
EVENTS = [
    {"ph": "M", "name": "process_name", "pid": 100, "tid": 0, "args": {"name": "python"}},
    _x("user_annotation", "ProfilerStep#2", 0, 1000, CPU),
    _x("user_annotation", "attn", 100, 200, CPU),
    _x("user_annotation", "inner", 105, 30, CPU),
    _launch("cudaLaunchKernel", 110, 1),
    _launch("cudaMemcpyAsync", 120, 2),
    _launch("cudaMemsetAsync", 130, 3),
    _launch("cuLaunchKernelEx", 140, 4, cat="cuda_driver"),
    _launch("cudaStreamSynchronize", 150, 5),
    _launch("cudaLaunchKernel", 160, 6, where=OTHER_THREAD),
    _kernel(GEMM, 400, 10, 1, **GEMM_ARGS),
    _x("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 411, 2, GPU, correlation=2),
    _x("gpu_memset", "Memset (Device)", 414, 1, GPU, correlation=3),
    _kernel(SOFTMAX, 420, 4, 4, **{"registers per thread": 32, "shared memory": 0}),
    _kernel("other_thread_kernel", 430, 50, 6),
    _x("gpu_user_annotation", "attn", 400, 24, GPU),
    {"ph": "s", "cat": "ac2g", "name": "ac2g", "id": 1, "pid": 100, "tid": 100, "ts": 110},
    {"ph": "f", "cat": "ac2g", "name": "ac2g", "id": 1, "pid": 0, "tid": 7, "ts": 400, "bp": "e"},
    _x("user_annotation", "attn", 500, 100, CPU),
    _launch("cudaLaunchKernel", 510, 7),
    _launch("cuLaunchKernelEx", 520, 8, cat="cuda_driver"),
    _kernel(GEMM, 700, 14, 7, **GEMM_ARGS),
    _kernel(SOFTMAX, 720, 6, 8),
    _x("gpu_user_annotation", "attn", 700, 26, GPU),
    _launch("cudaLaunchKernel", 800, 9),
    _kernel("outside_kernel", 900, 100, 9),
    _kernel("orphan_kernel", 1000, 3, 99),
]


@pytest.fixture
def trace_file(tmp_path):
    path = tmp_path / "trace.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": EVENTS}).encode()))
    return path


def test_forward_figures():
    r = analyze_events(EVENTS)["ranges"]["attn"]
    assert r["forwards"] == 2
    # fwd 1: GEMM, memcpy, memset, softmax; fwd 2: GEMM, softmax. Not: other thread, outside.
    assert r["kernels_per_forward"] == 2.0
    assert r["gpu_ops_per_forward"] == 3.0
    assert r["memcpy_per_forward"] == 0.5
    assert r["memset_per_forward"] == 0.5
    assert r["cuda_time_avg_us"] == pytest.approx((10 + 2 + 1 + 4 + 14 + 6) / 2)
    assert r["gpu_span_avg_us"] == pytest.approx((24 + 26) / 2)  # 400..424 and 700..726
    assert r["gpu_annotation_avg_us"] == pytest.approx(25)
    assert r["self_cuda_time_total_us"] == pytest.approx(37)
    assert r["cpu_time_avg_us"] == pytest.approx(150)
    assert set(r["launch_apis"][:2]) == {"cudaLaunchKernel", "cuLaunchKernelEx"}
    assert set(r["launch_apis"]) == {"cudaLaunchKernel", "cuLaunchKernelEx", "cudaMemcpyAsync",
                                     "cudaMemsetAsync"}
    assert r["main_kernel"] == GEMM


def test_kernel_rows():
    gemm, softmax = analyze_events(EVENTS)["ranges"]["attn"]["kernels"]
    assert (gemm["name"], softmax["name"]) == (GEMM, SOFTMAX)  # by total time, largest first
    assert gemm["per_forward"] == 1.0 and gemm["avg_us"] == pytest.approx(12)
    assert gemm["total_us"] == pytest.approx(24)
    assert gemm["launch_api"] == "cudaLaunchKernel"
    assert (gemm["registers"], gemm["shared_memory"]) == (128, 49152)
    assert (gemm["grid"], gemm["block"], gemm["occupancy_pct"]) == ([8, 16, 1], [128, 1, 1], 25)
    assert softmax["launch_api"] == "cuLaunchKernelEx"
    assert softmax["avg_us"] == pytest.approx(5)
    assert gemm["tensor_cores"] == name_verdict(GEMM)
    assert gemm["tensor_cores"]["verdict"] == "no"  # an FFMA GEMM: CUDA cores
    assert gemm["tensor_cores"]["evidence"] == "name"


def test_trace_level_and_nested_range():
    result = analyze_events(EVENTS)
    assert set(result["ranges"]) == {"attn", "inner"}  # ProfilerStep#2 skipped
    assert result["gpu"] is True
    assert result["self_cuda_time_total_us"] == pytest.approx(10 + 2 + 1 + 4 + 50 + 14 + 6 + 100
                                                              + 3)
    assert result["unlaunched_gpu_ops"] == 1  # the orphan kernel
    inner = result["ranges"]["inner"]
    assert (inner["forwards"], inner["kernels_per_forward"], inner["gpu_ops_per_forward"]) == (
        1, 1.0, 3.0)


def test_a_backward_on_autograds_device_thread_belongs_to_its_range():
    # compare --mode fwd_bwd: torch.autograd.grad inside the range hands a GPU graph to the
    # engine's device thread, which launches the backward's kernels inside its
    # evaluate_function ops while the range waits. Those launches count, in launch order, and
    # the nodes are drawn with the range's CPU ops; a launch of that thread outside a node, or
    # another thread's, does not count.
    autograd, stranger = (100, 300), (100, 400)
    node = _x("cpu_op", "autograd::engine::evaluate_function: _AttentionBackward", 150, 40,
              autograd)
    events = [
        _x("user_annotation", "step", 100, 200, CPU),
        _x("cpu_op", "aten::mul", 105, 10, CPU),
        _launch("cudaLaunchKernel", 110, 1),
        node,
        _x("cpu_op", "aten::mm", 155, 10, autograd),  # nested inside the node
        _launch("cudaLaunchKernel", 160, 2, where=autograd),
        _launch("cudaLaunchKernel", 170, 3, where=stranger),
        _launch("cudaLaunchKernel", 195, 5, where=autograd),  # between nodes
        _launch("cudaLaunchKernel", 320, 4, where=autograd),  # after the range closed
        _kernel("attn_fwd", 400, 10, 1), _kernel("attn_bwd", 420, 30, 2),
        _kernel("unrelated", 460, 5, 3), _kernel("next_step_bwd", 500, 30, 4),
        _kernel("between_nodes", 540, 5, 5),
    ]
    r = analyze_events(events)["ranges"]["step"]
    assert r["kernels_per_forward"] == 2.0
    assert [k["name"] for k in r["kernels"]] == ["attn_bwd", "attn_fwd"]
    assert r["cuda_time_avg_us"] == pytest.approx(40)
    (forward,) = forward_events(events, "step")
    assert [(e["args"]["correlation"]) for e in forward["launches"]] == [1, 2]
    assert [e["name"] for e in forward["cpu_ops"]] == ["aten::mul", node["name"]]


def test_a_backward_on_the_ranges_own_thread_counts_once():
    # On the CPU the engine runs the backward on the calling thread: its nodes are the range's
    # own ops, and their launches count once
    events = [
        _x("user_annotation", "step", 100, 200, CPU),
        _launch("cudaLaunchKernel", 110, 1),
        _x("cpu_op", "autograd::engine::evaluate_function: MulBackward0", 150, 40, CPU),
        _launch("cudaLaunchKernel", 160, 2),
        _kernel("fwd", 400, 10, 1), _kernel("bwd", 420, 30, 2),
    ]
    assert analyze_events(events)["ranges"]["step"]["kernels_per_forward"] == 2.0


def test_cpu_only_trace_has_no_gpu_figures():
    events = [e for e in EVENTS if e.get("cat") == "user_annotation"]
    r = analyze_events(events)["ranges"]["attn"]
    assert r["kernels_per_forward"] is None and r["cuda_time_avg_us"] is None
    assert r["cpu_time_avg_us"] == pytest.approx(150)
    assert r["kernels"] == []


def test_json_and_gz_read_alike(tmp_path, trace_file):
    plain = tmp_path / "trace.json"
    plain.write_text(json.dumps({"traceEvents": EVENTS}))
    assert load_events(plain) == load_events(trace_file) == EVENTS
    assert analyze_file(plain)["ranges"] == analyze_file(trace_file)["ranges"]


def test_unknown_range_lists_found_ones(trace_file):
    with pytest.raises(TraceError, match="'nope'.*ranges found: attn, inner"):
        analyze_file(trace_file, ["nope"])


@pytest.mark.parametrize("content, message", [
    (None, "truncated or corrupt gzip"),  # filled in from a real gzip, cut in half
    (b'{"traceEvents": [{"ph": "X",', "not valid JSON"),
    (b'{"schemaVersion": 1}', "no traceEvents"),
    (b"\xff\xfe\x00binary", "neither JSON nor gzipped JSON"),
])
def test_bad_files(tmp_path, trace_file, content, message):
    if content is None:
        content = trace_file.read_bytes()[: len(trace_file.read_bytes()) // 2]
    bad = tmp_path / "bad.json.gz"
    bad.write_bytes(content)
    with pytest.raises(TraceError, match=message):
        load_events(bad)


def test_missing_file(tmp_path):
    with pytest.raises(TraceError, match="cannot read trace"):
        load_events(tmp_path / "absent.json")


def test_analyze_command_json(trace_file, capsys):
    assert main(["analyze", str(trace_file), "--range", "attn", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["trace"] == str(trace_file) and list(out["ranges"]) == ["attn"]
    r = out["ranges"]["attn"]
    assert (r["forwards"], r["kernels_per_forward"], r["gpu_ops_per_forward"]) == (2, 2.0, 3.0)
    assert r["kernels"][0]["registers"] == 128
    assert r["kernels"][0]["tensor_cores"]["verdict"] in ("yes", "no", "unknown")


def test_analyze_command_text_and_errors(tmp_path, trace_file, capsys):
    assert main(["analyze", str(trace_file)]) == 0
    out = capsys.readouterr().out
    assert "range 'attn': 2 forwards, 2 kernels/fwd, 3 GPU ops/fwd (0.5 memcpy" in out
    assert "warning: 1 GPU ops have no launch event" in out
    bad = tmp_path / "cut.json.gz"
    bad.write_bytes(trace_file.read_bytes()[:40])
    assert main(["analyze", str(bad)]) == 2
    assert "truncated" in capsys.readouterr().err


@pytest.mark.parametrize("field, value", [("dur", "x"), ("ts", None), ("dur", True)])
def test_non_numeric_time_field_is_one_line(tmp_path, trace_file, capsys, field, value):
    doc = json.loads(gzip.decompress(trace_file.read_bytes()))
    kernel = next(e for e in doc["traceEvents"] if e.get("cat") == "kernel")
    kernel[field] = value
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(TraceError, match=f"non-numeric '{field}'"):
        analyze_file(bad)
    assert main(["analyze", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("attnscope analyze: error: trace event") and len(err.splitlines()) == 1
