"""The driver end to end on the CPU, at a tiny shape: list, compare, and its failure modes."""

import errno
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnscope.attention import IMPLEMENTATIONS, Implementation
from attnscope.profile import cli, compare, runs
from attnscope.profile.cli import main
from attnscope.profile.table import CPU_NOTE
from attnscope.profile.trace import analyze_file

TINY = ["--device", "cpu", "--batch", "1", "--heads", "2", "--seq", "24", "--head-dim", "16"]


def _results(out):
    """The last complete run's results (what `report` and `ncu` read)."""
    return json.loads((out / runs.LATEST / runs.RESULTS).read_text())


def _runs(out):
    """Every run folder's results, oldest first."""
    return [json.loads((f / runs.RESULTS).read_text())
            for f in sorted((out / runs.RUNS).iterdir())]


def test_list(capsys):
    assert main(["list", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    for name in IMPLEMENTATIONS:
        assert f"  {name} " in out
    width = len("fused_nondeterministic")  # the longest name sets the column
    assert max(map(len, IMPLEMENTATIONS)) == width
    assert f"  {'sdpa_cudnn':<{width}}  no   cuDNN attention runs on CUDA only" in out
    # the backward variant runs wherever fused does, and says what differs
    status = {line.split()[0]: line[width + 2:] for line in out.splitlines()[1::2]}
    assert list(status) == list(IMPLEMENTATIONS)  # a name line, then its description
    assert status["fused_nondeterministic"] == status["fused"]
    assert "fused with deterministic=False: the same forward" in out


@pytest.mark.parametrize("command", list(cli.SUBCOMMANDS))
def test_every_subcommand_has_help(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    assert f"usage: attnscope {command}" in capsys.readouterr().out


def test_ncu_takes_compares_case_flags_with_their_help():
    """ncu re-runs a compare run's case: its case flags are compare's, meaning and help alike."""
    import argparse

    from attnscope.profile import ncu

    def flags(module):
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        return {a.option_strings[0]: (a.help, a.choices, a.type, a.default)
                for a in parser._actions if a.option_strings}

    case = ["--batch", "--heads", "--seq", "--head-dim", "--scenario", "--q-len", "--kv-len",
            "--kv-heads", "--page-size", "--window", "--softcap", "--dtype"]
    compare_flags, ncu_flags = flags(compare), flags(ncu)
    for flag in case:
        assert ncu_flags[flag] == compare_flags[flag], flag


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
    assert results["complete"] is True and len(_runs(out)) == 1
    trace = out / runs.LATEST / "naive" / "1_2_24_16_naive.json.gz"
    assert Path(naive["trace"]).resolve() == trace.resolve()
    assert json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    assert analyze_file(trace)["ranges"]["naive"]["forwards"] == 3
    table = (out / runs.LATEST / "naive" / "1_2_24_16_naive.txt").read_text()
    assert "naive" in table and "Self CPU time total" in table
    printed = capsys.readouterr()
    assert "[1/3] naive ..." in printed.err
    lines = printed.out.splitlines()
    assert lines[0].split()[:3] == ["impl", "kernels/fwd", "GPU"]
    assert lines[2].startswith("naive") and " n/a " in lines[2] and lines[2].endswith("ok")
    assert lines[3].endswith("unavailable: cuDNN attention runs on CUDA only")
    assert CPU_NOTE in printed.out


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
        "broken": _raise(RuntimeError("boom\nsecond line")),
        "refuses": _raise(ValueError("head_dim must be between 16 and 256, got 300")),
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
    assert (rows["broken"]["status"], rows["broken"]["reason"]) == ("error", "RuntimeError: boom")
    # an entry's ValueError or TypeError refuses its input, as bench counts it
    assert rows["refuses"]["status"] == "unsupported"
    assert (rows["nan"]["status"], rows["nan"]["reason"]) == ("error", "output holds NaN or inf")
    assert rows["nan"]["max_abs_error"] is None
    assert rows["naive"]["status"] == "ok"  # the run went on after every failure


def test_compare_inputs_that_do_not_fit_are_one_line(tmp_path, monkeypatch, capsys):
    from attnscope.profile import compare

    def no_memory(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 4 TB")
    monkeypatch.setattr(compare.scenarios, "case_inputs", no_memory)
    assert main([*TINY, "--impl", "naive", "--out", str(tmp_path / "out")]) == 1
    assert "do not fit in cpu memory" in capsys.readouterr().err


def test_compare_shapes_past_any_allocation_are_one_line(tmp_path, capsys):
    # Sizes whose storage overflows (no allocation could hold them) are inputs that do not fit.
    huge = ["compare", "--impl", "naive", "--batch", "4000000000", "--heads", "4000000000",
            "--seq", "4000000000", "--out", str(tmp_path / "out")]
    assert main(huge) == 1
    assert "do not fit in cpu memory" in capsys.readouterr().err


def test_compare_a_reference_that_does_not_fit_leaves_the_error_column_empty(
        tmp_path, monkeypatch, capsys):
    from attnscope.profile import compare

    def no_memory(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate "
                           "80 GB")
    monkeypatch.setattr(compare, "attention_reference", no_memory)
    assert main([*TINY, "--impl", "naive", "--out", str(tmp_path / "out")]) == 0
    assert "reference does not fit in cpu memory" in capsys.readouterr().err
    row, = json.loads((tmp_path / "out" / "latest" / "results.json").read_text())["rows"]
    assert row["status"] == "ok" and row["max_abs_error"] is None


def test_compare_names_the_seq_flag(tmp_path, capsys):
    assert main(["compare", "--seq", "0", "--out", str(tmp_path / "out")]) == 2
    assert "--seq must be >= 1, got 0" in capsys.readouterr().err


def _warns(q, k, v):
    import warnings

    def call():
        warnings.warn("argument aux_data cannot be converted\nsecond line", UserWarning)
        return q * 2
    return call


def _warns_then_refuses(q, k, v):
    import warnings
    warnings.warn("Flash attention kernel not used because: head_dim", UserWarning)
    raise NotImplementedError("no kernel for this call")


def test_compare_keeps_warnings_in_rows(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(IMPLEMENTATIONS, "warns", _fake("warns", _warns))
    monkeypatch.setitem(IMPLEMENTATIONS, "refuses", _fake("refuses", _warns_then_refuses))
    out = tmp_path / "out"
    assert main([*TINY, "--impl", "warns", "refuses", "naive", "--out", str(out)]) == 0
    rows = {r["impl"]: r for r in _results(out)["rows"]}
    assert rows["warns"]["status"] == "ok"  # every profiled call warned: kept once
    assert rows["warns"]["warnings"] == ["UserWarning: argument aux_data cannot be converted"]
    assert rows["refuses"]["status"] == "unsupported"
    assert rows["refuses"]["warnings"] == [
        "UserWarning: Flash attention kernel not used because: head_dim"]
    assert rows["naive"]["warnings"] == []
    printed = capsys.readouterr()
    assert "aux_data" not in printed.err  # the progress line counts it
    assert "[1/3] warns: ok  (1 warning kept in the row)" in printed.err
    assert "warned: UserWarning: Flash attention kernel not used" in printed.err
    assert ("note: warns warned on 1 row (results.json's rows' \"warnings\" keep each): "
            "UserWarning: argument aux_data cannot be converted") in printed.out


def test_a_mistyped_command_is_named(capsys):
    assert main(["benhc", "--shape", "1,1,16,16"]) == 2
    assert "unknown command 'benhc'; the commands: compare, analyze, bench" in \
        capsys.readouterr().err


def test_unknown_implementation_lists_valid_names(tmp_path, capsys):
    assert main([*TINY, "--impl", "naive", "flash3", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "unknown implementation 'flash3'" in err
    assert "valid names: " + ", ".join(IMPLEMENTATIONS) in err
    assert not (tmp_path / runs.RUNS).exists()


def test_unwritable_out_fails_before_profiling(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(compare, "capture", lambda *a: pytest.fail("profiled anyway"))
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")  # a path under a file cannot be created, even by root
    assert main([*TINY, "--impl", "naive", "--out", str(blocker / "out")]) == 2
    assert "cannot write to --out" in capsys.readouterr().err


def test_an_out_that_is_a_file_or_a_copied_latest_is_refused_before_profiling(
        tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(compare, "capture", lambda *a: pytest.fail("profiled anyway"))
    afile = tmp_path / "a_file"
    afile.write_text("not a folder")
    assert main([*TINY, "--impl", "naive", "--out", str(afile)]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err
    copied = tmp_path / "copied"  # as cp -rL leaves an --out folder: latest a real folder
    (copied / "latest").mkdir(parents=True)
    assert main([*TINY, "--impl", "naive", "--out", str(copied)]) == 2
    assert "latest is a folder, not the link" in capsys.readouterr().err


def test_ctrl_c_keeps_finished_rows(tmp_path, monkeypatch, capsys):
    real_capture = compare.capture

    def capture(impl, *args):
        if impl.name == "sdpa_math":
            raise KeyboardInterrupt
        return real_capture(impl, *args)
    monkeypatch.setattr(compare, "capture", capture)
    out = tmp_path / "out"
    assert main([*TINY, "--impl", "naive", "sdpa_math", "sdpa_flash", "--out", str(out)]) == 130
    [partial] = _runs(out)
    assert [(r["impl"], r["status"]) for r in partial["rows"]] == [("naive", "ok")]
    assert partial["complete"] is False
    assert not (out / runs.LATEST).exists()  # no complete run yet: nothing to point at
    assert not (out / runs.LOCK).exists()  # released on the way out
    err = capsys.readouterr().err
    assert "interrupted: 1 finished rows kept" in err and "marked incomplete" in err
    # report points at the interrupted run, and reports it (marked incomplete) when given it.
    assert main(["report", str(out)]) == 2
    assert "no complete run in" in capsys.readouterr().err
    [folder] = (out / runs.RUNS).iterdir()
    assert main(["report", str(folder)]) == 0
    assert "incomplete run: 1 rows" in (folder / "report.html").read_text()


def test_compare_fwd_bwd_traces_the_backward(tmp_path, monkeypatch, capsys):
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
    # The table's per-call columns say a call ran the forward and its backward.
    header = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("impl"))
    assert header.split()[:3] == ["impl", "kernels/fwd+bwd", "GPU"]


# --- an earlier complete run is never lost ------------------------------------------------------

@pytest.fixture
def complete_run(tmp_path, monkeypatch):
    """An --out folder holding one complete run of the cheap fake `quick` (and its report)."""
    monkeypatch.setitem(IMPLEMENTATIONS, "quick", _fake("quick", lambda q, k, v: lambda: q * 2))
    out = tmp_path / "out"
    assert main([*TINY, "--impl", "quick", "--out", str(out), "--report"]) == 0
    first = (out / runs.LATEST).resolve()
    return out, first, (first / runs.RESULTS).read_text(), (first / "report.html").read_text()


def _assert_untouched(out, first, results, page):
    """`latest` still names the first run, whose results, report and trace are as written."""
    assert (out / runs.LATEST).resolve() == first
    assert (first / runs.RESULTS).read_text() == results
    assert (first / "report.html").read_text() == page
    [row] = json.loads(results)["rows"]
    assert analyze_file(row["trace"])["ranges"]["quick"]["forwards"] == 3


def test_interrupted_rerun_keeps_the_complete_run(complete_run, monkeypatch, capsys):
    out, *before = complete_run
    real_capture = compare.capture

    def capture(impl, *args):
        if impl.name == "naive":
            raise KeyboardInterrupt  # Ctrl-C during the second implementation
        return real_capture(impl, *args)
    monkeypatch.setattr(compare, "capture", capture)
    assert main([*TINY, "--impl", "quick", "naive", "--out", str(out), "--report"]) == 130
    _assert_untouched(out, *before)
    first, partial = _runs(out)
    assert [r["impl"] for r in partial["rows"]] == ["quick"] and partial["complete"] is False
    assert "still names the last complete run" in capsys.readouterr().err


@pytest.mark.parametrize("where, error", [
    ("results", OSError(errno.ENOSPC, "No space left on device")),  # a full disk
    ("trace", PermissionError(errno.EACCES, "Permission denied")),  # the folder turned read-only
])
def test_failed_write_mid_run_is_one_line_and_keeps_the_complete_run(
        complete_run, monkeypatch, capsys, where, error):
    out, *before = complete_run
    if where == "results":
        real_write, calls = runs.write_json, []

        def write_json(path, data, indent=1):
            calls.append(path)
            if len(calls) == 2:  # the header went out; the first row's write fails
                raise error
            real_write(path, data, indent)
        monkeypatch.setattr(runs, "write_json", write_json)
    else:
        def capture(*args):
            raise error
        monkeypatch.setattr(compare, "capture", capture)
    capsys.readouterr()
    assert main([*TINY, "--impl", "quick", "--out", str(out), "--report"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) >= 1 and err[-1].startswith("attnscope compare: error: cannot write")
    assert error.strerror in err[-1] and "Traceback" not in "\n".join(err)
    _assert_untouched(out, *before)
    assert not (out / runs.LOCK).exists()


def test_a_second_run_into_a_busy_folder_is_refused(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    holder = {"pid": os.getpid(), "host": os.uname().nodename, "started": "2026-12-01T14:00:00",
              "command": "attnscope compare --out out"}
    (out / runs.LOCK).write_text(json.dumps(holder))  # this very process: alive
    assert main([*TINY, "--impl", "naive", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"pid {os.getpid()}" in err and "2026-12-01T14:00:00" in err
    assert "attnscope compare --out out" in err
    assert not (out / runs.RUNS).exists()


def test_a_dead_holder_does_not_keep_the_lock(tmp_path, monkeypatch):
    monkeypatch.setitem(IMPLEMENTATIONS, "quick", _fake("quick", lambda q, k, v: lambda: q * 2))
    out = tmp_path / "out"
    out.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    (out / runs.LOCK).write_text(json.dumps({"pid": int(dead.stdout), "host": os.uname().nodename,
                                             "started": "x", "command": "killed"}))
    assert main([*TINY, "--impl", "quick", "--out", str(out)]) == 0
    assert _results(out)["complete"] is True and not (out / runs.LOCK).exists()


def test_runs_in_one_second_get_their_own_folders(tmp_path, monkeypatch):
    monkeypatch.setitem(IMPLEMENTATIONS, "quick", _fake("quick", lambda q, k, v: lambda: q * 2))
    out = tmp_path / "out"
    folders = []
    for _ in range(2):
        with runs.Run(out, ["test"]) as run:
            folders.append(run.folder)
    assert len(set(folders)) == 2 and all(f.is_dir() for f in folders)


def test_an_implementation_named_twice_runs_once(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(IMPLEMENTATIONS, "quick", _fake("quick", lambda q, k, v: lambda: q * 2))
    out = tmp_path / "out"
    assert main([*TINY, "--impl", "quick", "naive", "quick", "--out", str(out)]) == 0
    assert [r["impl"] for r in _results(out)["rows"]] == ["quick", "naive"]
    assert "--impl names quick 2 times; it runs once" in capsys.readouterr().err


def test_ctrl_c_during_start_up_is_one_line(monkeypatch, capsys):
    def interrupted():
        raise KeyboardInterrupt  # as if Ctrl-C landed while the subcommands import torch
    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert main(["compare"]) == 130
    assert capsys.readouterr().err == "interrupted\n"


@pytest.mark.cuda
def test_plain_compare_judges_flex_by_its_compiled_code_and_analyze_agrees(tmp_path, capsys):
    """On the GPU: FlexAttention's Triton kernel gets SASS/PTX evidence in a plain compare (no
    ncu), and `analyze` on the trace compare wrote gives the same verdict and evidence."""
    out = tmp_path / "out"
    assert main(["compare", "--device", "cuda", "--impl", "flex", "naive", "--out", str(out)]) == 0
    rows = {r["impl"]: r for r in _results(out)["rows"]}
    assert rows["flex"]["status"] == "ok", rows["flex"]["reason"]
    flex = next(k for k in rows["flex"]["kernels"] if "flex_attention" in k["name"])
    assert flex["tensor_cores"]["evidence"] in ("sass", "ptx"), flex["tensor_cores"]
    assert flex["tensor_cores"]["verdict"] == "yes"
    for impl in ("flex", "naive"):
        analysed = analyze_file(rows[impl]["trace"])["ranges"][impl]["kernels"]
        assert [k["tensor_cores"] for k in analysed] == [
            k["tensor_cores"] for k in rows[impl]["kernels"]], impl


def test_an_implementations_own_os_error_is_its_row(tmp_path, monkeypatch):
    # A missing file of the implementation's own (ENOENT) is not the out folder failing.
    monkeypatch.setitem(IMPLEMENTATIONS, "lost", _fake("lost", _raise(
        FileNotFoundError(errno.ENOENT, "No such file or directory", "/nowhere/kernel.so"))))
    monkeypatch.setitem(IMPLEMENTATIONS, "quick", _fake("quick", lambda q, k, v: lambda: q * 2))
    out = tmp_path / "out"
    assert main([*TINY, "--impl", "lost", "quick", "--out", str(out)]) == 0
    rows = {r["impl"]: r for r in _results(out)["rows"]}
    assert rows["lost"]["status"] == "error" and "FileNotFoundError" in rows["lost"]["reason"]
    assert rows["quick"]["status"] == "ok"


def _start_with_ctrl_c(tmp_path, *command):
    # A `torch` whose import is interrupted stands first on the path: Ctrl-C lands while
    # attnscope's own package imports it, before any of the driver's code runs.
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise KeyboardInterrupt\n")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(root)])}
    return subprocess.run([sys.executable, *command], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=120)


def test_ctrl_c_while_the_package_imports_torch_is_one_line_and_130(tmp_path):
    done = _start_with_ctrl_c(tmp_path, "-m", "attnscope.profile", "list")
    assert done.returncode == 130, done.stderr
    assert done.stderr == "interrupted\n" and done.stdout == ""


def test_output_into_a_closed_pipe_is_no_traceback(tmp_path):
    # `attnscope list | head -1`: the reader is gone before the listing is written (its end of
    # the pipe is closed before the driver has imported torch).
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.Popen([sys.executable, "-m", "attnscope.profile", "list"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141 and "Traceback" not in err, err


def test_ctrl_c_while_a_program_imports_the_library_stays_its_own(tmp_path):
    # Outside the driver the caller's Ctrl-C handling applies: KeyboardInterrupt propagates.
    done = _start_with_ctrl_c(tmp_path, "-c", "import attnscope")
    assert done.returncode != 0 and "KeyboardInterrupt" in done.stderr
