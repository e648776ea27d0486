"""`bench` on the CPU: sweep definitions, the ratio, the reference slicing, the JSON of a tiny run
with fake implementations registered in place of the real ones, errors, and Ctrl-C."""

from __future__ import annotations

import argparse
import json
import math
import os

import pytest
import torch

from attnscope.attention import registry
from attnscope.attention.reference import attention_reference
from attnscope.profile import bench, bench_table, metrics, sweeps, timing
from attnscope.profile.flops import attention_flops


def _parse(*argv):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(list(argv))


def _eager(q, k, v, causal=True):
    # The framework's low-precision path: close to float64, never equal to it.
    return lambda: attention_reference(q, k, v, causal=causal, dtype=q.dtype)


def _impl(name, prepare, available=lambda device: (True, "runs"), gqa=True):
    # "fused" stands for ours (the ratio's subject); every fake takes GQA inputs unless told not.
    return registry.Implementation(name, f"fake {name}", "", available, prepare,
                                   ours=name == "fused", gqa=gqa)


def _no_gqa(q, k, v):
    if q.shape[1] != k.shape[1]:
        raise NotImplementedError("no GQA")
    return _eager(q, k, v)


def _broadcasting(q, k, v):
    # Eager math without repeating K/V heads: fails on GQA inputs with a RuntimeError.
    return lambda: torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v


def _off_by_a_bit(q, k, v):
    return lambda: attention_reference(q, k, v, dtype=q.dtype) + 0.25


def _nan_output(q, k, v):
    return lambda: torch.full_like(q, float("nan"))


@pytest.fixture
def fakes(monkeypatch):
    impls = {
        "peer_slow": _impl("peer_slow", lambda q, k, v: _sleepy(_eager(q, k, v), 2e-3)),
        "peer_fast": _impl("peer_fast", _eager),
        "peer_no_gqa": _impl("peer_no_gqa", _no_gqa),
        "peer_absent": _impl("peer_absent", _eager, lambda device: (False, "not installed")),
        "peer_wrong": _impl("peer_wrong", _off_by_a_bit),
        "peer_nan": _impl("peer_nan", _nan_output),
        "fused": _impl("fused", _eager),
    }
    monkeypatch.setattr(registry, "IMPLEMENTATIONS", impls)
    return impls


def _sleepy(forward, seconds):
    import time

    def call():
        time.sleep(seconds)
        return forward()
    return call


FAST = ("--device", "cpu", "--warmup-ms", "1", "--rep-ms", "5")


# --- sweeps ---

def test_default_sweep_is_the_issues():
    shapes = [(c.batch, c.heads, c.seq, c.head_dim, c.kv_heads) for c in sweeps.SWEEPS["default"]]
    assert shapes[:6] == [(16, 16, 512, 64, 16), (8, 16, 1024, 64, 16), (4, 32, 4096, 64, 32),
                          (4, 32, 4096, 128, 32), (2, 16, 16384, 128, 16), (8, 16, 1024, 128, 16)]
    gqa = [c for c in sweeps.SWEEPS["default"] if c.kv_heads != c.heads]
    assert len(gqa) == 1 and gqa[0].heads % gqa[0].kv_heads == 0
    assert [c.shape for c in sweeps.SWEEPS["seed"]] == [[8, 16, 1024, 64]]


def test_cpu_sweep_is_small():
    for c in sweeps.SWEEPS["cpu"]:
        assert c.batch * c.heads * c.seq * c.seq <= 2**18  # eager scores stay tiny on 2 cores
        assert c.heads % c.kv_heads == 0


def test_kv_heads_override_replaces_every_shape_and_checks_divisibility():
    cases = sweeps.resolve_sweep("default", 1)
    assert {c.kv_heads for c in cases} == {1}
    # the two (4,32,4096,128) shapes differ only in kv_heads, so the override merges them
    assert len(cases) == len(sweeps.SWEEPS["default"]) - 1
    with pytest.raises(ValueError, match="must divide"):
        sweeps.resolve_sweep("default", 3)


def test_input_sets_exceed_l2():
    l2 = 60 * 10**6
    for set_bytes in (10**6, 48 * 2**20, 200 * 2**20):
        n = timing.input_sets(set_bytes, l2)
        assert (n - 1) * set_bytes >= l2 or n == timing.MAX_INPUT_SETS
    assert timing.input_sets(400 * 2**20, l2) == 2
    assert timing.input_sets(1000, l2) == timing.MAX_INPUT_SETS


def test_memory_skip_only_score_materializers_at_long_sequences():
    free = 140 * 2**30  # an H200
    long, short = sweeps.case(2, 16, 16384, 128), sweeps.case(4, 32, 4096, 128)
    naive, math_, cudnn = map(registry.get, ("naive", "sdpa_math", "sdpa_cudnn"))
    assert "GiB" in bench.score_memory_skip(naive, long, free)
    assert bench.score_memory_skip(math_, short, free) is None
    assert bench.score_memory_skip(cudnn, long, free) is None
    assert bench.score_memory_skip(naive, long, None) is None


# --- ratio ---

def _r(impl, ms, status="ok", shape=(8, 16, 1024, 64)):
    return {"shape": list(shape), "kv_heads": 16, "dtype": "bf16", "causal": True, "mode": "fwd",
            "impl": impl, "status": status, "median_ms": ms}


def test_ratio_is_best_peer_time_over_own_time():
    rows = [_r("fused", 0.05), _r("sdpa_cudnn", 0.0618), _r("sdpa_flash", 0.0976),
            _r("naive", None, "skipped"), _r("fused", 0.2, shape=(2, 16, 16384, 128)),
            _r("sdpa_cudnn", None, "failed", shape=(2, 16, 16384, 128))]
    ratios = [r["ratio_to_best_peer"] for r in bench.with_peer_ratios(rows)]
    assert ratios[0] == pytest.approx(0.0618 / 0.05)
    assert ratios[1] == pytest.approx(1.0)
    assert ratios[2] == pytest.approx(0.0618 / 0.0976)
    assert ratios[3] is None
    assert ratios[4] is None  # no peer was timed at that shape
    assert "ratio_to_best_peer" not in rows[0]  # pure: the input is left alone


def test_a_peer_whose_error_says_it_computes_something_else_is_no_best_peer():
    # a peer that dropped a window: bf16 error 0.084 against the shape's least 0.008 (a
    # simulation of one at 8192 keys and a 4095-key window); the next peer sets the ratio
    rows = [{**_r("fused", 0.10), "error": 0.008}, {**_r("sdpa_flash", 0.05), "error": 0.084},
            {**_r("sdpa_cudnn", 0.08), "error": 0.009}]
    out = bench.with_peer_ratios(rows)
    assert out[0]["ratio_to_best_peer"] == pytest.approx(0.08 / 0.10)
    assert "not counted as the best peer" in out[1]["not_a_peer"]
    assert "not_a_peer" not in out[2]
    # rounding-sized differences never exclude one (an fp32 row far below the floor)
    rows = [{**_r("fused", 0.10), "error": 1e-7}, {**_r("sdpa_flash", 0.05), "error": 9e-7}]
    rows = [{**r, "dtype": "fp32"} for r in rows]
    assert bench.with_peer_ratios(rows)[0]["ratio_to_best_peer"] == pytest.approx(0.5)


def test_a_second_ours_entry_is_no_peer():
    # fused_nondeterministic is ours too (the registry's): faster than every peer, it is not the
    # best peer fused is compared with, and each of ours gets its own geometric mean
    rows = [_r("fused", 0.05), _r("fused_nondeterministic", 0.04), _r("sdpa_cudnn", 0.06)]
    ratios = [r["ratio_to_best_peer"] for r in bench.with_peer_ratios(rows)]
    assert ratios == pytest.approx([0.06 / 0.05, 0.06 / 0.04, 1.0])
    summary = bench.geomean_ratios(bench.with_peer_ratios(rows))
    assert sorted(summary) == ["fused", "fused_nondeterministic"]
    assert summary["fused_nondeterministic"]["geomean_ratio_to_best_peer"] == pytest.approx(1.5)


def test_geomean_over_shapes():
    rows = [_r("fused", 1.0), _r("sdpa_cudnn", 2.0),
            _r("fused", 2.0, shape=(1, 1, 64, 64)), _r("sdpa_cudnn", 1.0, shape=(1, 1, 64, 64))]
    summary = bench.geomean_ratios(bench.with_peer_ratios(rows))
    assert summary["fused"]["geomean_ratio_to_best_peer"] == pytest.approx(1.0)
    assert summary["fused"]["shapes"] == 2


def test_summary_sets_host_bound_shapes_apart():
    # Shapes where the faster of fused and its best peer takes under KERNEL_BOUND_MS are
    # host-bound: the all-shape mean keeps them, the kernel-bound one does not; and the shapes
    # below the per-shape floor are counted.
    rows = [_r("fused", 2.0), _r("sdpa_cudnn", 1.8),                              # 0.9, kernels
            _r("fused", 0.2, shape=(1, 1, 64, 64)), _r("fa4", 0.19, shape=(1, 1, 64, 64)),
            _r("fused", 0.01, shape=(1, 1, 32, 64)), _r("fa4", 0.05, shape=(1, 1, 32, 64)),
            _r("fused", 0.5, shape=(1, 1, 16, 64)), _r("fa4", 0.05, shape=(1, 1, 16, 64))]
    s = bench.geomean_ratios(bench.with_peer_ratios(rows))["fused"]
    assert s["shapes"] == 4 and s["kernel_bound_shapes"] == 2
    assert s["geomean_ratio_kernel_bound"] == pytest.approx((0.9 * 0.95) ** 0.5)
    assert s["geomean_ratio_to_best_peer"] == pytest.approx((0.9 * 0.95 * 5 * 0.1) ** 0.25)
    assert s["shapes_below_floor"] == 2  # 0.9 and 0.1; 0.95 is not below
    line = bench_table.summary_line("fused", s)
    assert "over 4 shapes" in line and "over the 2 where both" in line and "2 shapes below" in line
    # a summary written before these fields still reads
    assert bench_table.summary_line("fused", {"geomean_ratio_to_best_peer": 1.0, "shapes": 3}) \
        == "fused: geometric mean ratio to the best peer 1.000 over 3 shapes"


# --- reference ---

@pytest.mark.parametrize("budget, rows, chunk", [
    (3 * 40 * metrics.REF_BYTES_PER_SCORE, 3, 1),  # one head is over budget: its last 3 rows
    (3 * 40 * 40 * metrics.REF_BYTES_PER_SCORE, 40, 3),  # 3 whole heads at a time, 8 = 3+3+2
])
def test_reference_slices_and_chunks_exactly(budget, rows, chunk):
    torch.manual_seed(0)
    # GQA (4 query heads on 2 K/V heads) so the K/V head of every flattened query head is checked
    q = torch.randn(2, 4, 40, 16)
    k, v = torch.randn(2, 2, 40, 16), torch.randn(2, 2, 40, 16)
    ref, region = metrics.reference_output(q, k, v, causal=True, budget_bytes=budget)
    assert region == {"batch_heads": 8, "query_rows": [40 - rows, 40], "chunk_batch_heads": chunk}
    full = attention_reference(q, k, v, causal=True)
    torch.testing.assert_close(ref, full[:, :, 40 - rows:], rtol=0, atol=1e-12)


# --- runs ---

def test_cpu_run_writes_rows_with_the_schema(fakes, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench.run(_parse("--sweep", "cpu", "--json", str(out), *FAST)) == 0
    doc = json.loads(out.read_text())
    assert {"env", "command", "sweep", "rows", "timing", "first_call"} <= set(doc)
    assert doc["sweep"] == "cpu" and doc["complete"] is True
    assert "CPU wall time" in doc["timing"]["timer"]
    rows = doc["rows"]
    assert len(rows) == len(sweeps.SWEEPS["cpu"]) * len(fakes)
    by = {(r["impl"], r["kv_heads"] != r["shape"][1]): r for r in rows}
    for gqa in (False, True):
        fused, slow = by["fused", gqa], by["peer_slow", gqa]
        b, h, s, d = fused["shape"]
        assert fused["status"] == "ok" and fused["dtype"] == "fp32" and fused["causal"] is True
        assert fused["tflops"] == pytest.approx(
            attention_flops(b, h, s, s, d) / (fused["median_ms"] * 1e-3) / 1e12)
        assert 0 < fused["error"] < 0.05  # bf16 eager against float64
        assert fused["error_compared"]["query_rows"] == [0, s]
        assert fused["first_call_ms"] > 0
        assert slow["median_ms"] > 2.0  # it sleeps 2 ms per call
        # the best peer: the fastest ok one whose error is not far off (peer_wrong's is)
        best = min(r["median_ms"] for r in rows if r["status"] == "ok" and r["impl"] != "fused"
                   and r["shape"] == fused["shape"] and r["kv_heads"] == fused["kv_heads"]
                   and r["impl"] != "peer_wrong")
        assert fused["ratio_to_best_peer"] == pytest.approx(best / fused["median_ms"])
        assert by["peer_absent", gqa]["status"] == "unavailable"
        assert by["peer_absent", gqa]["reason"] == "not installed"
        assert by["peer_wrong", gqa]["error"] == pytest.approx(0.25, abs=0.05)
        assert "not counted as the best peer" in by["peer_wrong", gqa]["not_a_peer"]
        assert by["peer_nan", gqa]["status"] == "failed"
        assert by["peer_nan", gqa]["ratio_to_best_peer"] is None  # never the "best peer"
    assert by["peer_no_gqa", False]["status"] == "ok"
    assert by["peer_no_gqa", True]["status"] == "unsupported"
    assert "no GQA" in by["peer_no_gqa", True]["reason"]
    printed = capsys.readouterr()
    assert "CPU wall ms" in printed.out and "peer_no_gqa" in printed.out
    assert printed.err.count("[") >= len(rows)  # one progress line per row


def test_no_causal_needs_a_causal_argument(fakes, tmp_path):
    fakes["fused"] = _impl("fused", _eager)  # prepare(q, k, v, causal=True)
    fakes["peer_fast"] = _impl("peer_fast", lambda q, k, v: _eager(q, k, v))
    out = tmp_path / "b.json"
    args = _parse("--sweep", "cpu", "--no-causal", "--impl", "fused", "peer_fast",
                  "--json", str(out), *FAST)
    assert bench.run(args) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["impl"]: r["status"] for r in rows} == {"fused": "ok", "peer_fast": "unsupported"}
    fused = next(r for r in rows if r["impl"] == "fused")
    assert fused["causal"] is False and 0 < fused["error"] < 0.05  # compared with full attention


def test_gqa_is_unsupported_without_the_field_and_a_failure_where_claimed(fakes, tmp_path):
    # The registry's gqa field decides, not the name: an entry that claims GQA and breaks on it
    # failed; one that does not claim it is never called with GQA inputs.
    fakes["fused"] = _impl("fused", _broadcasting)
    fakes["peer_broadcast"] = _impl("peer_broadcast", _broadcasting, gqa=False)
    out = tmp_path / "b.json"
    args = _parse("--sweep", "cpu", "--impl", "peer_broadcast", "fused", "--json", str(out), *FAST)
    assert bench.run(args) == 0
    gqa = [r for r in json.loads(out.read_text())["rows"] if r["kv_heads"] != r["shape"][1]]
    assert [(r["impl"], r["status"]) for r in gqa] == [("peer_broadcast", "unsupported"),
                                                       ("fused", "failed")]
    assert "gqa field" in gqa[0]["reason"] and "RuntimeError" in gqa[1]["reason"]


@pytest.mark.parametrize("argv, names", [
    (("--sweep", "nope"), ["default", "seed", "cpu"]),
    (("--impl", "fused", "nope"), ["peer_fast", "fused"]),
])
def test_unknown_names_list_the_valid_ones(fakes, capsys, argv, names):
    assert bench.run(_parse(*argv, *FAST)) == 2
    err = capsys.readouterr().err
    assert "'nope'" in err and all(n in err for n in names)


def test_shape_times_the_listed_prefill_shapes(fakes, tmp_path):
    out = tmp_path / "b.json"
    args = _parse("--shape", "1,2,24,16", "1,4,20,8,2", "1,2,24,16", "--impl", "fused",
                  "peer_fast", "--json", str(out), *FAST)
    assert bench.run(args) == 0
    doc = json.loads(out.read_text())
    assert doc["sweep"] == "shapes"
    assert [(c["batch"], c["heads"], c["seq"], c["head_dim"], c["kv_heads"]) for c in
            doc["cases"]] == [(1, 2, 24, 16, 2), (1, 4, 20, 8, 2)]  # repeats once
    assert [(r["shape"], r["kv_heads"], r["scenario"], r["status"]) for r in doc["rows"]] == [
        ([1, 2, 24, 16], 2, "prefill", "ok"), ([1, 2, 24, 16], 2, "prefill", "ok"),
        ([1, 4, 20, 8], 2, "prefill", "ok"), ([1, 4, 20, 8], 2, "prefill", "ok")]
    args = _parse("--shape", "1,4,20,8", "--kv-heads", "1", "--impl", "fused", *FAST)
    assert bench._resolve(args)[2][0].kv_heads == 1  # --kv-heads replaces every shape's


def test_lengths_without_a_scenario_name_the_scenario_they_make():
    # --q-len 4 --kv-len 100 is a decode call: the run is labelled so, not prefill
    _, sweep, cases, _, _ = bench._resolve(_parse("--q-len", "4", "--kv-len", "100", "--impl",
                                                  "fused", *FAST))
    assert (sweep, cases[0].scenario) == ("scenario decode", "decode")


@pytest.mark.parametrize("argv, says", [
    (("--shape", "1,2,64"), "expected B,H,S,D or B,H,S,D,KV"),
    (("--shape", "1,2,0,32"), "positive integers"),
    (("--shape", "1,2,x,32"), "positive integers"),
    (("--shape", "1,3,64,32,2"), "K/V heads 2 must divide the query heads 3"),
    (("--shape", "1,4,64,32", "--kv-heads", "3"), "K/V heads 3 must divide the query heads 4"),
    (("--shape", "1,2,64,32", "--sweep", "cpu"), "--sweep and --shape: give one"),
    (("--shape", "1,2,64,32", "--q-len", "4"), "--shape and --scenario/--q-len"),
])
def test_bad_shapes_are_refused(fakes, capsys, argv, says):
    assert bench.run(_parse(*argv, *FAST)) == 2
    assert says in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_cuda_requested_without_cuda_is_an_error(fakes, capsys):
    assert bench.run(_parse("--device", "cuda")) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_ctrl_c_keeps_finished_rows(fakes, tmp_path, capsys):
    calls = {"n": 0}

    def interrupted_on_second_shape(q, k, v):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return _eager(q, k, v)

    fakes["fused"] = _impl("fused", interrupted_on_second_shape)
    out = tmp_path / "b.json"
    with pytest.raises(KeyboardInterrupt):
        bench.run(_parse("--sweep", "cpu", "--impl", "peer_fast", "fused",
                         "--json", str(out), *FAST))
    err = capsys.readouterr().err
    assert "bench: 3 of " in err and f"rows kept in {out}; the same command with --resume" in err
    doc = json.loads(out.read_text())
    assert doc["complete"] is False
    assert [(r["impl"], r["status"]) for r in doc["rows"]] == [
        ("peer_fast", "ok"), ("fused", "ok"), ("peer_fast", "ok")]
    assert math.isfinite(doc["rows"][1]["ratio_to_best_peer"])


# --- modes ---

class _SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps: a backward that costs a known time."""
    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        import time

        _SlowBackward.calls += 1
        time.sleep(SLEEP_S)
        return grad


SLEEP_S = 20e-3  # far above what the cheap fakes below compute, on any CPU


def _cheap(q, k, v):
    # Differentiable in q, k and v, and microseconds either way.
    return lambda: q + 0.0 * (k.sum() + v.sum())


def _slow_forward(q, k, v):
    return _sleepy(_cheap(q, k, v), SLEEP_S)


def _slow_backward(q, k, v):
    forward = _cheap(q, k, v)
    return lambda: _SlowBackward.apply(forward())


def _no_graph(q, k, v):
    forward = _eager(q, k, v)
    return lambda: forward().detach()


@pytest.mark.parametrize("mode", ["bwd", "fwd_bwd"])
def test_backward_modes_time_the_pass_they_name(fakes, tmp_path, mode):
    fakes.update(peer_slow_fwd=_impl("peer_slow_fwd", _slow_forward),
                 peer_slow_bwd=_impl("peer_slow_bwd", _slow_backward),
                 peer_no_graph=_impl("peer_no_graph", _no_graph))
    out = tmp_path / "b.json"
    _SlowBackward.calls = 0
    args = _parse("--sweep", "cpu", "--mode", mode, "--dtype", "fp32", "--impl", "peer_slow_fwd",
                  "peer_slow_bwd", "peer_no_graph", "fused", "--json", str(out), *FAST)
    assert bench.run(args) == 0
    doc = json.loads(out.read_text())
    assert doc["mode"] == mode and "autograd.grad" in doc["timed"]
    rows = {(r["impl"], tuple(r["shape"])): r for r in doc["rows"]}
    sleep_ms = SLEEP_S * 1e3
    for case in sweeps.SWEEPS["cpu"]:
        shape = tuple(case.shape)
        slow_fwd, slow_bwd, fused = (rows[name, shape] for name in ("peer_slow_fwd",
                                                                     "peer_slow_bwd", "fused"))
        assert all(r["mode"] == mode and r["status"] == "ok" for r in (slow_fwd, slow_bwd, fused))
        # the forward's sleep is timed in fwd_bwd only; the backward's in both
        if mode == "bwd":
            assert slow_fwd["median_ms"] < sleep_ms / 2
        else:
            assert slow_fwd["median_ms"] > sleep_ms
        assert slow_bwd["median_ms"] > sleep_ms
        b, h, s, d = fused["shape"]
        assert fused["tflops"] == pytest.approx(
            attention_flops(b, h, s, s, d, mode=mode) / (fused["median_ms"] * 1e-3) / 1e12)
        assert 0 < fused["error"] < 1e-5  # the forward output's error (fp32), in every mode
        no_graph = rows["peer_no_graph", shape]
        assert no_graph["status"] == "unsupported" and "autograd graph" in no_graph["reason"]
    # every timed call ran a backward: first call, warm-up and >= MIN_CPU_REPEATS per shape
    assert _SlowBackward.calls >= len(sweeps.SWEEPS["cpu"]) * (timing.MIN_CPU_REPEATS + 2)


def test_backward_gradients_are_the_references():
    # What "bwd" times returns the gradients of the prepared forward on its own inputs.
    q, k, v = bench._with_grad(bench._make_inputs(sweeps.case(1, 2, 16, 16), torch.float32,
                                                  torch.device("cpu"), 0)).qkv
    forward = _eager(q, k, v)
    out = forward()
    grads = bench._timed_call(forward, (q, k, v), out, "bwd")()
    again = bench._timed_call(forward, (q, k, v), out, "bwd")()  # the graph is retained
    dout = bench._upstream_grad(q)
    expected = torch.autograd.grad(attention_reference(q, k, v, dtype=q.dtype), (q, k, v), dout)
    for g, a, e in zip(grads, again, expected):
        torch.testing.assert_close(g, e)
        torch.testing.assert_close(a, e)
    assert q.grad is None  # autograd.grad: nothing accumulates into .grad


def test_backward_modes_budget_more_score_memory():
    case, free = sweeps.case(4, 32, 4096, 128), 64 * 2**30
    naive, flash = registry.get("naive"), registry.get("sdpa_flash")
    assert bench.score_memory_skip(naive, case, free, "fwd") is None
    assert "6 fp32 copies" in bench.score_memory_skip(naive, case, free, "bwd")
    assert bench.score_memory_skip(flash, case, free, "bwd") is None


def test_unknown_mode_is_refused():
    with pytest.raises(SystemExit):
        _parse("--mode", "backward")


@pytest.mark.parametrize("causal", [True, False])
def test_real_entries_on_cpu(tmp_path, causal):
    # The registered fused and SDPA entries, not fakes: the CPU default dtype must be one the
    # interpreter gets right (fp32), and --no-causal must reach their prepare().
    out = tmp_path / "b.json"
    argv = ["--sweep", "cpu", "--impl", "sdpa_math", "fused", "--json", str(out), *FAST]
    assert bench.run(_parse(*argv, *([] if causal else ["--no-causal"]))) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["dtype"] for r in rows} == {"fp32"}
    assert all(r["status"] == "ok" and r["causal"] is causal for r in rows)
    assert all(r["error"] < 1e-5 for r in rows)


# --- refusals before any timing -----------------------------------------------------------------

@pytest.mark.parametrize("argv, says", [
    (("--warmup-ms", "-5", "--rep-ms", "-1"), "--warmup-ms must be finite and >= 0"),
    (("--rep-ms", "0"), "--rep-ms finite and > 0"),
])
def test_negative_or_zero_timing_is_refused(fakes, capsys, argv, says):
    assert bench.run(_parse("--device", "cpu", *argv)) == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("where", ["directory", "under_a_file"])
def test_unwritable_json_is_refused_before_timing(fakes, tmp_path, capsys, monkeypatch, where):
    monkeypatch.setattr(bench, "_case_rows", lambda *a: pytest.fail("timed anyway"))
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")  # a path under a file cannot be created, even by root
    path = tmp_path if where == "directory" else blocker / "bench.json"
    assert bench.run(_parse("--sweep", "cpu", "--json", str(path), *FAST)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("bench: error: ") and len(err.splitlines()) == 1
    assert ("is a directory" if where == "directory" else "cannot write --json") in err


def test_json_unwritable_mid_run_is_one_line(fakes, tmp_path, capsys, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(bench.runs, "write_text", full)
    out = tmp_path / "b.json"
    assert bench.run(_parse("--sweep", "cpu", "--impl", "peer_fast", "--json", str(out),
                            *FAST)) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"bench: error: cannot write --json {out}: No space left")


def test_rows_record_the_versions(fakes, tmp_path):
    out = tmp_path / "b.json"
    assert bench.run(_parse("--sweep", "cpu", "--impl", "peer_fast", "--json", str(out),
                            *FAST)) == 0
    doc = json.loads(out.read_text())
    import triton
    assert (doc["env"]["torch"], doc["env"]["triton"]) == (torch.__version__, triton.__version__)
    assert all((r["torch"], r["triton"]) == (torch.__version__, triton.__version__)
               for r in doc["rows"])


# --- the wide sweep -----------------------------------------------------------------------------

def test_wide_sweep_deals_every_axis_by_rule():
    wide = sweeps.SWEEPS["wide"]
    assert len(wide) == 60  # 6 head_dims x 10 lengths, each once
    assert {(c.head_dim, c.seq) for c in wide} == {
        (d, s) for d in sweeps.WIDE_HEAD_DIMS for s in sweeps.WIDE_LENGTHS}
    assert any(s % 128 for s in sweeps.WIDE_LENGTHS) and max(sweeps.WIDE_LENGTHS) == 16384

    def fill(c):  # "under": fewer query tiles of 128 than 132 SMs, where the length allows it
        return "under" if c.batch * c.heads == 8 else "over"
    axes = {"d": lambda c: c.head_dim, "seq": lambda c: c.seq,
            "ratio": lambda c: c.heads // c.kv_heads, "fill": fill, "dtype": lambda c: c.dtype}
    values = {name: {f(c) for c in wide} for name, f in axes.items()}
    assert values["ratio"] == {1, 4, 8} and values["dtype"] == {"bf16", "fp16"}
    # Every pair of axes that the rule promises meets in every combination.
    for a, b in [("d", "ratio"), ("d", "fill"), ("d", "dtype"), ("seq", "fill"),
                 ("seq", "dtype"), ("ratio", "fill"), ("ratio", "dtype"), ("fill", "dtype")]:
        met = {(axes[a](c), axes[b](c)) for c in wide}
        assert len(met) == len(values[a]) * len(values[b]), (a, b)
    for c in wide:
        assert c.heads % c.kv_heads == 0
        if fill(c) == "under" and c.seq <= 2048:
            assert c.batch * c.heads * -(-c.seq // 128) < 132  # fewer tiles than SMs
        assert c.batch * c.heads * c.seq <= sweeps.WIDE_TOKENS  # q of 1 GiB at most (d 256)


def test_a_case_dtype_wins_over_the_flag(fakes, tmp_path, monkeypatch):
    monkeypatch.setitem(sweeps.SWEEPS, "typed", (sweeps.case(1, 2, 16, 16, dtype="fp16"),
                                                 sweeps.case(1, 2, 16, 16)))
    out = tmp_path / "b.json"
    assert bench.run(_parse("--sweep", "typed", "--impl", "peer_fast", "--dtype", "fp32",
                            "--json", str(out), *FAST)) == 0
    doc = json.loads(out.read_text())
    assert [r["dtype"] for r in doc["rows"]] == ["fp16", "fp32"]
    assert [c["dtype"] for c in doc["cases"]] == ["fp16", None]


# --- --resume -----------------------------------------------------------------------------

def test_resume_times_only_the_missing_rows(fakes, tmp_path, monkeypatch):
    # A run cut short after 3 of its rows, then the same command with --resume: the kept rows are
    # the file's (same values), only the rest are timed, and the file ends complete, in order.
    out = tmp_path / "b.json"
    argv = ("--sweep", "cpu", "--impl", "peer_fast", "fused", "--json", str(out), *FAST)
    assert bench.run(_parse(*argv)) == 0
    full = json.loads(out.read_text())
    cut = dict(full, complete=False, rows=full["rows"][:3])
    out.write_text(json.dumps(cut))
    timed = []
    real = bench.bench_one
    monkeypatch.setattr(bench, "bench_one", lambda ctx, case, impl, *a: timed.append(
        (case.shape, impl.name)) or real(ctx, case, impl, *a))
    assert bench.run(_parse(*argv, "--resume")) == 0
    resumed = json.loads(out.read_text())
    assert resumed["complete"] is True
    measured = [{k: v for k, v in r.items() if k != "ratio_to_best_peer"}  # recomputed
                for r in resumed["rows"][:3] + cut["rows"]]
    assert measured[:3] == measured[3:]
    assert [(r["shape"], r["impl"]) for r in resumed["rows"]] == \
        [(r["shape"], r["impl"]) for r in full["rows"]]
    assert timed == [(r["shape"], r["impl"]) for r in full["rows"][3:]]


def test_resume_without_a_file_starts_afresh(fakes, tmp_path):
    out = tmp_path / "new.json"
    assert bench.run(_parse("--sweep", "cpu", "--impl", "fused", "--json", str(out), "--resume",
                            *FAST)) == 0
    assert json.loads(out.read_text())["complete"] is True


@pytest.mark.parametrize("change, says", [
    (("--mode", "fwd_bwd"), "has mode"),
    (("--impl", "fused", "peer_fast"), "row 0"),
    (("--no-causal",), "full fwd"),
    (("--rep-ms", "3"), "has timing rep_ms"),  # the same rows, timed another way
])
def test_resume_refuses_another_commands_file(fakes, tmp_path, capsys, change, says):
    out = tmp_path / "b.json"
    base = ("--sweep", "cpu", "--json", str(out), *FAST)
    assert bench.run(_parse(*base, "--impl", "peer_fast", "fused")) == 0
    before = out.read_text()
    impl = () if "--impl" in change else ("--impl", "peer_fast", "fused")
    assert bench.run(_parse(*base, *impl, *change, "--resume")) == 2
    assert says in capsys.readouterr().err
    assert out.read_text() == before  # nothing overwritten


def test_resume_keeps_the_first_command_and_lists_each_resume(fakes, tmp_path):
    out = tmp_path / "b.json"
    argv = ("--sweep", "cpu", "--impl", "peer_fast", "fused", "--json", str(out), *FAST)
    assert bench.run(_parse(*argv)) == 0
    full = json.loads(out.read_text())
    first = dict(full, complete=False, rows=full["rows"][:1], command=["first", "run"])
    out.write_text(json.dumps(first))
    assert bench.run(_parse(*argv, "--resume")) == 0
    resumed = json.loads(out.read_text())
    assert resumed["command"] == ["first", "run"] and resumed["env"] == full["env"]
    assert [r["from_row"] for r in resumed["resumed"]] == [1]


@pytest.mark.parametrize("edit, says", [
    (lambda doc: doc["env"].update(gpu={"name": "NVIDIA H100"}), "timed on NVIDIA H100"),
    (lambda doc: doc.update(rows=[5]), "rows are not a list of objects"),
    (lambda doc: doc.update(rows=5), "rows are not a list of objects"),
    (lambda doc: doc.update(command="compare"), "it is a compare run's results.json"),
    (lambda doc: doc.pop("sweep"), "it has no sweep field"),
    # a case that differs in one field names that field, not two cut-off objects
    (lambda doc: doc["cases"][0].update(softcap=5.0), "has cases case 0: softcap 5.0 where this "
                                                      "run has null"),
])
def test_resume_refuses_another_gpus_or_a_malformed_file(fakes, tmp_path, capsys, edit, says):
    out = tmp_path / "b.json"
    argv = ("--sweep", "cpu", "--impl", "fused", "--json", str(out), *FAST)
    assert bench.run(_parse(*argv)) == 0
    doc = json.loads(out.read_text())
    edit(doc)
    out.write_text(json.dumps(doc))
    assert bench.run(_parse(*argv, "--resume")) == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--rep-ms", "--warmup-ms"])
@pytest.mark.parametrize("value", ["inf", "nan"])
def test_timing_settings_must_be_finite(fakes, capsys, flag, value):
    assert bench.run(_parse("--sweep", "cpu", "--impl", "fused", flag, value)) == 2
    assert "must be finite" in capsys.readouterr().err


def test_a_shape_whose_inputs_do_not_fit_gives_oom_rows(fakes, monkeypatch, tmp_path):
    # the CPU allocator's RuntimeError (CUDA's is OutOfMemoryError) while making one shape's
    # inputs: every entry's row at that shape says oom, and the sweep goes on
    real = bench._make_inputs

    def make(case, *args):
        if case.seq == 64:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:121] DefaultCPUAllocator: can't "
                               "allocate memory: you tried to allocate 4 TB")
        return real(case, *args)
    monkeypatch.setattr(bench, "_make_inputs", make)
    out = tmp_path / "b.json"
    assert bench.run(_parse("--shape", "1,2,64,16", "1,2,32,16", "--impl", "peer_fast",
                            "peer_absent", "fused", "--json", str(out), *FAST)) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["shape"][2], r["status"]) for r in rows] == [  # an entry absent here says so
        (64, "oom"), (64, "unavailable"), (64, "oom"), (32, "ok"), (32, "unavailable"),
        (32, "ok")]
    assert "can't allocate memory" in rows[0]["reason"]


def test_an_existing_json_is_overwritten_with_a_note(fakes, tmp_path, capsys):
    out = tmp_path / "b.json"
    out.write_text("{}")
    assert bench.run(_parse("--sweep", "cpu", "--impl", "fused", "--json", str(out), *FAST)) == 0
    assert "exists and is overwritten" in capsys.readouterr().err
    assert json.loads(out.read_text())["complete"] is True


def test_resume_refuses_a_json_list(fakes, tmp_path, capsys):
    out = tmp_path / "b.json"
    out.write_text("[1, 2]")
    assert bench.run(_parse("--sweep", "cpu", "--impl", "fused", "--json", str(out), "--resume",
                            *FAST)) == 2
    assert "a JSON list, not an object" in capsys.readouterr().err


def test_a_json_path_under_a_file_names_the_file(fakes, tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("")
    for under in (afile / "x.json", afile / "sub" / "x.json"):
        assert bench.run(_parse("--sweep", "cpu", "--impl", "fused", "--json", str(under),
                                *FAST)) == 2
        assert f"{afile} is a file, not a folder" in capsys.readouterr().err


def test_a_json_path_that_is_a_device_or_pipe_is_refused(fakes, tmp_path, capsys):
    # The file is rewritten by replacing it: a --json of /dev/null would replace the device (a
    # FIFO stands in for it here; the real one is never touched by a test).
    import stat
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    assert bench.run(_parse("--sweep", "cpu", "--impl", "fused", "--json", str(pipe),
                            *FAST)) == 2
    assert "is not a regular file" in capsys.readouterr().err
    assert stat.S_ISFIFO(os.stat(pipe).st_mode)
    with pytest.raises(OSError, match="not a regular file"):
        bench.runs.write_text(pipe, "x")
    assert stat.S_ISFIFO(os.stat(pipe).st_mode)


def test_resume_needs_json(fakes, capsys):
    assert bench.run(_parse("--sweep", "cpu", "--resume", *FAST)) == 2
    assert "give --json PATH" in capsys.readouterr().err


def test_bwd_mode_runs_without_donated_buffers_and_restores_them(monkeypatch):
    # A compiled entry's backward is timed again and again on one retained graph, which AOT
    # autograd's donated buffers refuse: off for a --mode bwd run, as before after it.
    import torch._functorch.config as functorch_config
    seen = []
    monkeypatch.setattr(bench, "_run", lambda args: seen.append(functorch_config.donated_buffer))
    before = functorch_config.donated_buffer
    for mode in ("bwd", "fwd_bwd"):
        bench.run(_parse("--sweep", "cpu", "--mode", mode))
    assert seen == [False, before] and functorch_config.donated_buffer == before


def _warning(q, k, v):
    # A peer that warns on every call, as some JIT-compiled ones do on every compile.
    import warnings

    def call():
        warnings.warn("argument aux_data cannot be converted\nsecond line", UserWarning)
        return attention_reference(q, k, v, dtype=q.dtype)
    return call


def _warning_refusal(q, k, v):
    import warnings
    warnings.warn("Memory efficient kernel not used because: head_dim", UserWarning)
    raise NotImplementedError("no kernel for this call")


def test_warnings_are_kept_in_the_row_not_printed(fakes, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(registry.IMPLEMENTATIONS, "peer_warns", _impl("peer_warns", _warning))
    monkeypatch.setitem(registry.IMPLEMENTATIONS, "peer_refuses",
                        _impl("peer_refuses", _warning_refusal))
    out = tmp_path / "bench.json"
    argv = ("--sweep", "cpu", "--impl", "peer_warns", "peer_refuses", "fused", "--json", str(out))
    assert bench.run(_parse(*argv, *FAST)) == 0
    doc = json.loads(out.read_text())
    assert "warnings" in doc
    for row in doc["rows"]:
        if row["impl"] == "peer_warns":  # every timed call warned: one entry, its first line
            assert row["status"] == "ok"
            assert row["warnings"] == ["UserWarning: argument aux_data cannot be converted"]
        elif row["impl"] == "peer_refuses":
            assert row["status"] == "unsupported"
            assert row["warnings"] == ["UserWarning: Memory efficient kernel not used because: "
                                       "head_dim"]
        else:
            assert row["warnings"] == []
    printed = capsys.readouterr()
    assert "aux_data" not in printed.err  # not printed: the ok rows count theirs
    assert "(1 warning kept in the row)" in printed.err
    assert "warned: UserWarning: Memory efficient kernel not used" in printed.err
    n = len(sweeps.SWEEPS["cpu"])
    assert (f"note: peer_warns warned on {n} rows (the JSON rows' \"warnings\" keep each): "
            "UserWarning: argument aux_data cannot be converted") in printed.out


def test_progress_line_reads_rows_without_warnings():
    # rows of a file written before the field (a resumed run prints them)
    row = {"shape": [1, 2, 16, 16], "status": "ok", "median_ms": 1.0, "tflops": 1.0,
           "error": None, "first_call_ms": 2.0, "scenario": "prefill", "kv_len": 16,
           "kv_heads": 2, "impl": "fused"}
    assert "warning" not in bench_table.progress_line(1, 1, row)


def test_a_window_is_unsupported_without_the_field_and_recorded_where_set(fakes, tmp_path):
    # The registry's sliding_window field decides: the fakes without it are never called with
    # a window; one that has it gets the window and is compared with the windowed reference.
    def windowed(q, k, v, window=(-1, -1)):
        return lambda: attention_reference(q, k, v, causal_alignment="bottom_right",
                                           window=window, dtype=q.dtype)
    fakes["fused"] = registry.Implementation("fused", "fake fused", "", lambda d: (True, "runs"),
                                             windowed, ours=True, gqa=True, sliding_window=True)
    out = tmp_path / "b.json"
    args = _parse("--sweep", "cpu", "--window", "15,0", "--impl", "fused", "peer_fast",
                  "--json", str(out), *FAST)
    assert bench.run(args) == 0
    doc = json.loads(out.read_text())
    assert all(c["window"] == [15, 0] for c in doc["cases"])
    for row in doc["rows"]:
        assert row["window"] == [15, 0] and "softcap" not in row
        if row["impl"] == "peer_fast":
            assert row["status"] == "unsupported" and "sliding_window" in row["reason"]
        else:
            b, h, s, d = row["shape"]
            assert row["status"] == "ok" and 0 < row["error"] < 1e-5
            assert row["tflops"] == pytest.approx(attention_flops(
                b, h, s, s, d, window=(15, 0)) / (row["median_ms"] * 1e-3) / 1e12)
    # without the flags, nothing about them is written
    assert bench.run(_parse("--sweep", "cpu", "--impl", "fused", "--json", str(out), *FAST)) == 0
    doc = json.loads(out.read_text())
    assert not any({"window", "softcap"} & set(r) for r in doc["rows"] + doc["cases"])
