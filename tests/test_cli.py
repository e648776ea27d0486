"""The driver end to end on the CPU, at a tiny shape: list, compare, and its failure modes."""

import gzip
import json

import pytest
import torch

from attnscope.attention import IMPLEMENTATIONS, Implementation
from attnscope.profile import compare
from attnscope.profile.cli import main
from attnscope.profile.trace import analyze_file

TINY = ["--device", "cpu", "--batch", "1", "--heads", "2", "--seq", "24", "--head-dim", "16"]


def _results(out):
    return json.loads((out / "results.json").read_text())


def test_list(capsys):
    assert main(["list", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    for name in IMPLEMENTATIONS:
        assert f"  {name} " in out
    assert "sdpa_cudnn      no   cuDNN attention runs on CUDA only" in out


def test_compare_on_cpu(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["compare", *TINY, "--impl", "naive", "sdpa_cudnn", "sdpa_math",
                 "--out", str(out)]) == 0
    results = _results(out)
    assert results["shape"] == {"batch": 1, "heads": 2, "seq": 24, "head_dim": 16}
    assert results["dtype"] == "fp32" and results["device"] == "cpu"
    assert results["env"]["torch"] == torch.__version__
    assert results["flops_per_forward"] == 2 * 1 * 2 * 24 * 24 * 16  # 4BHLSD halved
    naive, cudnn, math_ = results["rows"]
    assert [r["impl"] for r in results["rows"]] == ["naive", "sdpa_cudnn", "sdpa_math"]
    assert cudnn["status"] == "unavailable" and "CUDA" in cudnn["reason"]
    for row in (naive, math_):
        assert row["status"] == "ok", row["reason"]
        assert row["forwards"] == 3  # the profiler's active steps; warm-up calls stay out
        assert 0 < row["max_abs_error"] < 1e-5
        assert row["cpu_time_avg_us"] > 0
        assert row["kernels_per_forward"] is None and row["tflops"] is None  # no GPU here
    trace = out / "naive" / "1_2_24_16_naive.json.gz"
    assert naive["trace"] == str(trace)
    assert json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    assert analyze_file(trace)["ranges"]["naive"]["forwards"] == 3
    table = (out / "naive" / "1_2_24_16_naive.txt").read_text()
    assert "naive" in table and "Self CPU time total" in table
    printed = capsys.readouterr()
    assert "[1/3] naive ..." in printed.err
    lines = printed.out.splitlines()
    assert lines[0].split()[:3] == ["impl", "kernels/fwd", "GPU"]
    assert lines[2].startswith("naive") and " n/a " in lines[2] and lines[2].endswith("ok")
    assert lines[3].endswith("unavailable: cuDNN attention runs on CUDA only")
    assert compare.CPU_NOTE in printed.out


def _fake(name, prepare):
    return Implementation(name, "test double", "", lambda device: (True, "test"), prepare)


def _raise(exc):
    def prepare(q, k, v):
        raise exc
    return prepare


def test_failing_implementations_become_rows(tmp_path, monkeypatch):
    fakes = {
        "unsupported": _raise(RuntimeError("No available kernel. Aborting execution.")),
        "oom": _raise(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB")),
        "broken": _raise(ValueError("boom\nsecond line")),
        "nan": lambda q, k, v: lambda: torch.full_like(q, float("nan")),
    }
    for name, prepare in fakes.items():
        monkeypatch.setitem(IMPLEMENTATIONS, name, _fake(name, prepare))
    out = tmp_path / "out"
    assert main([*TINY, "--impl", *fakes, "naive", "--out", str(out)]) == 0  # compare: default
    rows = {r["impl"]: r for r in _results(out)["rows"]}
    assert rows["unsupported"]["status"] == "unsupported"
    assert rows["unsupported"]["reason"] == "RuntimeError: No available kernel. Aborting execution."
    assert rows["oom"]["status"] == "oom"
    assert (rows["broken"]["status"], rows["broken"]["reason"]) == ("error", "ValueError: boom")
    assert (rows["nan"]["status"], rows["nan"]["reason"]) == ("error", "output holds NaN or inf")
    assert rows["nan"]["max_abs_error"] is None
    assert rows["naive"]["status"] == "ok"  # the run went on after every failure


def test_unknown_implementation_lists_valid_names(tmp_path, capsys):
    assert main([*TINY, "--impl", "naive", "flash3", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "unknown implementation 'flash3'" in err
    assert "valid names: " + ", ".join(IMPLEMENTATIONS) in err
    assert not (tmp_path / "results.json").exists()


def test_unwritable_out_fails_before_profiling(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(compare, "capture", lambda *a: pytest.fail("profiled anyway"))
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")  # a path under a file cannot be created, even by root
    assert main([*TINY, "--impl", "naive", "--out", str(blocker / "out")]) == 2
    assert "cannot write to --out" in capsys.readouterr().err


def test_ctrl_c_keeps_finished_rows(tmp_path, monkeypatch, capsys):
    real_capture = compare.capture

    def capture(impl, *args):
        if impl.name == "sdpa_math":
            raise KeyboardInterrupt
        return real_capture(impl, *args)
    monkeypatch.setattr(compare, "capture", capture)
    out = tmp_path / "out"
    assert main([*TINY, "--impl", "naive", "sdpa_math", "sdpa_flash", "--out", str(out)]) == 130
    rows = _results(out)["rows"]
    assert [(r["impl"], r["status"]) for r in rows] == [("naive", "ok")]
    assert "interrupted: 1 finished rows kept" in capsys.readouterr().err


def test_compare_fwd_bwd_traces_the_backward(tmp_path, monkeypatch):
    # An implementation without an autograd graph becomes an "unsupported" row, not a crash.
    monkeypatch.setitem(IMPLEMENTATIONS, "no_grad", _fake(
        "no_grad", lambda q, k, v: lambda: (q @ k.transpose(-1, -2)).softmax(-1).detach() @ v.detach()))
    out = tmp_path / "out"
    assert main([*TINY, "--impl", "naive", "no_grad", "--mode", "fwd_bwd", "--out", str(out)]) == 0
    results = _results(out)
    rows = {r["impl"]: r for r in results["rows"]}
    assert results["mode"] == "fwd_bwd"
    assert rows["no_grad"]["status"] == "unsupported"
    assert "no autograd graph" in rows["no_grad"]["reason"]
    naive = rows["naive"]
    assert naive["status"] == "ok" and naive["trace"].endswith("_naive_fwd_bwd.json.gz")
    # The range holds the backward's CPU ops too: autograd's engine ran inside it.
    with gzip.open(naive["trace"], "rt") as f:
        names = {e.get("name", "") for e in json.load(f)["traceEvents"]}
    assert any("Backward" in n for n in names)
