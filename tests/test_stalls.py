"""`ncu --stalls`: the source page of a PC-sampling report read and summed up per kernel
(attnscope/profile/stalls.py), on two real H200 pages (tests/data/h200_stalls/README.md), and
the ncu command's second run with ncu faked."""

import dataclasses
import gzip
import json
import subprocess
import types
from pathlib import Path

import pytest
import torch

from attnscope.profile import stalls

DATA = Path(__file__).parent / "data"
PAGES = DATA / "h200_stalls"


def _page(name: str) -> str:
    return gzip.open(PAGES / f"{name}.stalls.csv.gz", "rt").read()


def test_real_pages_sum_up_as_ncu_counted_them():
    ours = stalls.summarize(stalls.parse_source_page(_page("fused_nondeterministic")))
    (summary,) = ours.values()
    assert list(ours) == ["_attn_bwd_dkdv_hopper"]
    assert summary["samples"] == 296367 and summary["profiles"] == 1
    assert list(summary["by_reason"])[:2] == ["barrier", "long_sb"]
    assert summary["by_reason"]["barrier"] == pytest.approx(0.285, abs=0.001)
    # The largest barrier share is one instruction after the partitions' join, executed once a
    # program by the two worker warps: idle warps, as the module's docstring warns.
    first = summary["top"][0]
    assert (first["sass"], first["executed"]) == ("NOP", 8192)
    assert first["share"] == pytest.approx(0.165, abs=0.001)
    assert list(first["reasons"]) == ["barrier"]
    assert len(summary["top"]) == 8
    # The not-issued columns are not counted twice, and states without a column (gmma on this
    # ncu) are "other": the shares add up.
    assert sum(summary["by_reason"].values()) == pytest.approx(1.0)
    assert summary["by_reason"]["other"] == pytest.approx(0.062, abs=0.001)

    (fa4,) = stalls.summarize(stalls.parse_source_page(_page("fa4")), top=3).values()
    assert fa4["samples"] == 225882 and len(fa4["top"]) == 3
    assert list(fa4["by_reason"])[0] == "long_sb"
    assert fa4["top"][0]["sass"].startswith("@P0 BRA") and fa4["top"][0]["executed"] == 1081344


def _block(kernel: str, rows: list[tuple[str, str, int, int, int, int]]) -> str:
    header = ('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed",'
              '"stall_barrier","stall_wait","stall_barrier (Not Issued)"')
    lines = [f'"Kernel Name","{kernel}"', header]
    lines += [f'"{a}","{s}","{n}","{e}","{b}","{w}","{b}"' for a, s, n, e, b, w in rows]
    return "\n".join(lines)


def test_launches_of_one_kernel_are_summed_by_address():
    text = "\n".join([
        "==PROF== Connected to process 1",
        _block("k", [("0x10", "BAR.SYNC 0x0", 6, 4, 6, 0), ("0x20", "FFMA R1, R2, R3, R4", 2, 4,
                                                              0, 2)]),
        _block("k", [("0x10", "BAR.SYNC 0x0", 2, 4, 2, 0), ("0x20", "FFMA R1, R2, R3, R4", 2, 4,
                                                              0, 2)]),
        _block("other", [("0x10", "NOP", 0, 1, 0, 0)]),
    ])
    summary = stalls.summarize(stalls.parse_source_page(text))
    assert summary["k"]["profiles"] == 2 and summary["k"]["samples"] == 12
    assert summary["k"]["by_reason"] == {"barrier": pytest.approx(8 / 12),
                                         "wait": pytest.approx(4 / 12)}
    assert [(h["sass"], h["executed"]) for h in summary["k"]["top"]] == [
        ("BAR.SYNC 0x0", 8), ("FFMA R1, R2, R3, R4", 8)]
    assert summary["other"]["samples"] == 0 and summary["other"]["top"] == []
    lines = stalls.format_summary("k", summary["k"])
    assert lines[0] == ("    stalls of k: 12 samples in 2 profiled launch(es): barrier 66.7%, "
                        "wait 33.3%")
    assert "BAR.SYNC 0x0" in lines[1] and "executed 8" in lines[1] and "(barrier 66.7)" in lines[1]


def test_text_without_a_source_page_is_refused():
    with pytest.raises(ValueError, match="no source page"):
        stalls.parse_source_page('==ERROR== something\n"ID","Kernel Name"\n"1","k"')


@pytest.fixture
def faked_ncu(tmp_path, monkeypatch):
    """The ncu subcommand on a compare run's results.json in tmp_path, `fused` available, ncu
    faked: every command is recorded in `commands`; the counters' run writes the recorded CSV,
    every other command gets what the test's `answer(command)` returns."""
    from attnscope.attention import registry
    from attnscope.profile import ncu
    from test_tensor_cores import NCU, _compare_output, _ncu_args

    env = types.SimpleNamespace(ncu=ncu, args=_ncu_args, path=_compare_output(tmp_path),
                                commands=[], answer=None)
    monkeypatch.setattr(ncu, "find_ncu", lambda explicit: "ncu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(registry.IMPLEMENTATIONS, "fused", dataclasses.replace(
        registry.IMPLEMENTATIONS["fused"], available=lambda device: (True, "")))

    def fake_ncu(command, **kwargs):
        env.commands.append(command)
        if "--log-file" in command:  # the counters
            Path(command[command.index("--log-file") + 1]).write_text(
                (NCU / "fused.csv").read_text())
            return subprocess.CompletedProcess(command, 0, stdout="")
        return env.answer(command)

    monkeypatch.setattr(ncu.subprocess, "run", fake_ncu)
    return env


def _sampled(command):
    """The PC-sampling run, faked: it writes its report."""
    Path(command[command.index("-o") + 1]).write_bytes(b"report")
    return subprocess.CompletedProcess(command, 0, stdout="==PROF== Report: ...")


def test_ncu_stalls_runs_a_second_profile_and_merges_each_kernels_stalls(tmp_path, faked_ncu,
                                                                          capsys):
    """--stalls: after the counters, a PC-sampling run into ncu/<impl>.stalls.ncu-rep, its source
    page exported into <impl>.stalls.csv, and the summary printed and attached to the kernel of
    the compare run's row (ncu faked: the recorded counters, and a real source page renamed to
    the seed run's fused kernel)."""
    ncu, path, commands = faked_ncu.ncu, faked_ncu.path, faked_ncu.commands
    page = _page("fused_nondeterministic").replace('"_attn_bwd_dkdv_hopper"', '"_attn_fwd"')

    def answer(command):
        if "-o" in command:
            return _sampled(command)
        assert command[command.index("-i") + 1].endswith("fused.stalls.ncu-rep")
        return subprocess.CompletedProcess(command, 0, stdout=page)

    faked_ncu.answer = answer
    args = faked_ncu.args("--out", str(tmp_path), "--impl", "fused", "--stalls",
                          "--stall-lines", "3")
    assert ncu.run(args) == 0
    sampling = commands[1]
    assert sampling[sampling.index("--nvtx-include") + 1] == ncu.RANGE + "/"  # fwd: push/pop
    assert "SourceCounters" in sampling and sampling[sampling.index("--target") + 1] == "fused"
    assert commands[2][-5:] == ["--page", "source", "--csv", "--print-source", "sass"]
    assert (tmp_path / "ncu" / "fused.stalls.csv").read_text() == page
    err = capsys.readouterr().err
    assert "stalls of _attn_fwd: 296,367 samples in 1 profiled launch(es): barrier 28.5%" in err
    rows = {row["impl"]: row for row in json.loads(path.read_text())["rows"]}
    (kernel,) = rows["fused"]["kernels"]
    assert kernel["tensor_cores"]["evidence"] == "counters"
    assert kernel["stalls"]["samples"] == 296367 and len(kernel["stalls"]["top"]) == 3
    assert (kernel["stalls"]["ncu_kernel"], kernel["stalls"]["matched_by"]) == (
        "_attn_fwd", "the counters' match")
    # A later run replaces the figures, and a kernel no summary matches loses the old ones.
    assert ncu.merge_stalls_into_results(path, "fused", {"other_kernel": kernel["stalls"]}) == [
        "other_kernel"]
    (kernel,) = {r["impl"]: r for r in json.loads(path.read_text())["rows"]}["fused"]["kernels"]
    assert "stalls" not in kernel


def test_ncu_stalls_failure_is_one_line_and_keeps_the_counters(tmp_path, faked_ncu, capsys):
    ncu = faked_ncu.ncu
    faked_ncu.answer = lambda command: subprocess.CompletedProcess(
        command, 1, stdout="==ERROR== ERR_NVGPUCTRPERM")
    older = [tmp_path / "ncu" / f"fused.stalls.{ext}" for ext in ("ncu-rep", "csv")]
    for f in older:  # an earlier run's files must not pass for this run's
        f.parent.mkdir(exist_ok=True)
        f.write_text("older")
    assert ncu.run(faked_ncu.args("--out", str(tmp_path), "--impl", "fused", "--stalls")) == 1
    err = capsys.readouterr().err
    assert "stalls: failed (exit 1): no permission for GPU counters" in err
    assert "--stalls gave nothing for 1 implementation(s)" in err
    assert not any(f.exists() for f in older)
    rows = {r["impl"]: r for r in json.loads(faked_ncu.path.read_text())["rows"]}
    (kernel,) = rows["fused"]["kernels"]
    assert kernel["tensor_cores"]["evidence"] == "counters" and "stalls" not in kernel
    assert ncu.run(faked_ncu.args("--out", str(tmp_path), "--stall-lines", "0")) == 2


def test_ncu_stalls_without_a_source_page_and_in_fwd_bwd(tmp_path, faked_ncu, capsys):
    """The report is written but `ncu -i` prints no page: one line, no stalls. Under --mode
    fwd_bwd the sampling run takes the start/end range, as the counters' run does."""
    ncu = faked_ncu.ncu
    faked_ncu.answer = lambda command: _sampled(command) if "-o" in command else (
        subprocess.CompletedProcess(command, 1, stdout="==ERROR== unknown option"))
    assert ncu.run(faked_ncu.args("--out", str(tmp_path / "fwd_bwd"), "--impl", "fused",
                                  "--stalls", "--mode", "fwd_bwd")) == 1
    assert "stalls: no source page from" in capsys.readouterr().err
    sampling = faked_ncu.commands[1]
    assert sampling[sampling.index("--nvtx-include") + 1] == ncu.RANGE  # start/end
    assert sampling[sampling.index("--mode") + 1] == "fwd_bwd"
