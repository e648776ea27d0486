"""The driver's serving scenarios (profile/scenarios.py): the masks each entry is given, the FLOP
counts, every CPU entry against the float64 reference on decode, chunked prefill and packed
sequences, and `bench`/`compare` end to end on them. GPU tests (marked cuda) check every peer,
FA4 and flash-attn 2's varlen functions included, on the CUDA presets."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest
import torch

from attnscope.attention import IMPLEMENTATIONS, fused
from attnscope.attention.flex import _bottom_right_causal, _document_mask, _softcap
from attnscope.attention.reference import (attention_reference, attention_reference_varlen,
                                           causal_mask, varlen_mask, window_mask)
from attnscope.profile import bench, metrics, runs, scenarios, sweeps
from attnscope.profile.cli import main
from attnscope.profile.flops import attention_flops, varlen_flops, visible_pairs


@pytest.fixture(autouse=True)
def nan_outputs(monkeypatch):
    """Every output buffer the fused op allocates starts as NaN: an unwritten row cannot pass."""
    monkeypatch.setattr(fused, "_empty", lambda like, shape, dtype: torch.full(
        shape, float("nan"), dtype=dtype, device=like.device))


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


# --- masks and FLOPs ---------------------------------------------------------------------------

@pytest.mark.parametrize("q_lens, k_lens", [
    ((5, 3, 7), (5, 3, 7)),  # self-attention per sequence, as the varlen scenario
    ((2, 0, 4), (6, 3, 4)),  # fewer queries than keys, and an empty sequence in the middle
])
def test_varlen_mask_is_each_sequences_bottom_right_mask(q_lens, k_lens):
    mask = varlen_mask(_cu(q_lens), _cu(k_lens), causal=True)
    expected = torch.block_diag(*(causal_mask(a, b, "bottom_right") for a, b in
                                  zip(q_lens, k_lens))).bool()
    assert torch.equal(mask, expected)
    full = varlen_mask(_cu(q_lens), _cu(k_lens), causal=False)
    assert torch.equal(full, torch.block_diag(*(torch.ones(a, b) for a, b in
                                                zip(q_lens, k_lens))).bool())


def test_flex_masks_are_the_references():
    # The mask_mods flex compiles, evaluated eagerly on every (query, key) pair.
    q_idx, kv_idx = torch.arange(6)[:, None], torch.arange(11)[None, :]
    assert torch.equal(_bottom_right_causal(11 - 6)(0, 0, q_idx, kv_idx),
                       causal_mask(6, 11, "bottom_right"))
    cu = _cu((4, 1, 6))
    q_idx, kv_idx = torch.arange(11)[:, None], torch.arange(11)[None, :]
    for causal in (True, False):
        assert torch.equal(_document_mask(cu, cu, causal)(0, 0, q_idx, kv_idx),
                           varlen_mask(cu, cu, causal))


@pytest.mark.parametrize("q_len, kv_len", [(1, 8192), (8, 1000), (512, 4096), (5, 6)])
def test_bottom_right_flops_count_the_visible_pairs(q_len, kv_len):
    pairs = causal_mask(q_len, kv_len, "bottom_right").sum().item()
    assert attention_flops(2, 3, q_len, kv_len, 64) == 4 * 2 * 3 * 64 * pairs
    assert attention_flops(2, 3, q_len, kv_len, 64, mode="fwd_bwd") == 3.5 * 4 * 2 * 3 * 64 * pairs


def test_equal_lengths_keep_the_half_convention_and_varlen_sums():
    assert attention_flops(1, 1, 100, 100, 64) == 4 * 100 * 100 * 64 / 2
    assert varlen_flops((100, 30), 2, 64) == (attention_flops(1, 2, 100, 100, 64)
                                              + attention_flops(1, 2, 30, 30, 64))
    varlen = sweeps.varlen_case((100, 30), 2, 64)
    assert scenarios.flops(varlen, causal=True) == varlen_flops((100, 30), 2, 64)


def test_reference_slices_keep_bottom_right_rows():
    # A budget of 3 rows per head: the last 3 queries of 7 on 20 keys, with their true windows.
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, n, 16, generator=gen, dtype=torch.float64) for n in (7, 20, 20))
    ref, region = metrics.reference_output(q, k, v, causal=True,
                                           budget_bytes=3 * 20 * metrics.REF_BYTES_PER_SCORE)
    assert region["query_rows"] == [4, 7]
    full = attention_reference(q, k, v, causal_alignment="bottom_right")
    torch.testing.assert_close(ref, full[:, :, 4:])


# --- scenario shapes ---------------------------------------------------------------------------

def test_presets_are_their_scenarios_and_lengths_are_seeded():
    for name in scenarios.SCENARIOS:
        for device in ("cpu", "cuda"):
            assert scenarios.PRESETS[name][device].scenario == name
    assert sweeps.VARLEN_LENGTHS["cpu"] == sweeps.varlen_lengths(4, 64, seed=20)
    assert len(set(sweeps.VARLEN_LENGTHS["cuda"])) > 1  # lengths that differ, or no varlen
    serving = {c.scenario for c in sweeps.SWEEPS["serving"]}
    assert serving == {"decode", "chunked", "varlen", "paged"}
    decode = [c for c in sweeps.SWEEPS["serving"] if c.scenario == "decode"]
    assert {c.seq for c in decode} >= {1, 8} and min(c.keys for c in decode) == 1024
    assert max(c.keys for c in decode) == 131072 and {1, 128} <= {c.batch for c in decode}


@pytest.mark.parametrize("kwargs, says", [
    ({"name": "decode", "q_len": 9}, "q_len 1 to 8"),
    ({"name": "chunked", "q_len": 50, "kv_len": 40}, "--kv-len must be >= --q-len"),
    ({"name": "varlen", "q_len": 4}, "do not apply"),
    ({"name": "prefill", "heads": 4, "kv_heads": 3}, "must divide"),
    ({"name": "prefix"}, "valid: prefill, decode, chunked, varlen, paged"),
    ({"name": "decode", "page_size": 16}, "paged only"),
    ({"name": "paged", "page_size": 0}, ">= 1"),
    # an explicit scenario the lengths contradict is refused, not relabelled
    ({"name": "prefill", "q_len": 4, "kv_len": 300}, "prefill with q_len 4 and kv_len 300 is a "
                                                     "decode call"),
    ({"name": "decode", "q_len": 4, "kv_len": 4}, "is a prefill call"),
    ({"name": "chunked", "kv_len": 24, "q_len": 24}, "is a prefill call"),
    # varlen's heads and head_dim are checked as the others' (0 ran a headless case before)
    ({"name": "varlen", "heads": 0}, "--heads must be >= 1"),
    ({"name": "varlen", "head_dim": 0}, "--head-dim must be >= 1"),
    ({"name": "varlen", "heads": -2}, "--heads must be >= 1"),
])
def test_scenario_flags_are_checked(kwargs, says):
    name = kwargs.pop("name")
    with pytest.raises(ValueError, match=says):
        scenarios.scenario_case(name, "cpu", **kwargs)


@pytest.mark.parametrize("device", ["cpu", "gpu"])
def test_heads_keep_the_scenario_s_grouping(device):
    # Without --kv-heads a case keeps its preset's query heads per K/V head: one for prefill
    # (so --heads 4 is plain multi-head attention, not the preset's K/V count), four for
    # CUDA's decode; where that grouping does not divide --heads, one K/V head each. (The
    # presets alone: "gpu" names CUDA's, no device is used.)
    device = "cuda" if device == "gpu" else device
    varlen = scenarios.PRESETS["varlen"][device]
    for heads in (2, 4, 6, 32, 64):
        assert scenarios.scenario_case(None, device, heads=heads).kv_heads == heads
        group = varlen.heads // varlen.kv_heads
        assert scenarios.scenario_case("varlen", device, heads=heads).kv_heads == (
            heads // group if heads % group == 0 else heads)
    decode = scenarios.PRESETS["decode"][device]
    group = decode.heads // decode.kv_heads
    assert scenarios.scenario_case("decode", device, heads=group * 3).kv_heads == 3
    assert scenarios.scenario_case("decode", device, heads=group * 3 + 1).kv_heads == (
        group * 3 + 1)


def test_explicit_lengths_override_the_preset():
    c = scenarios.scenario_case("chunked", "cpu", q_len=10, kv_len=33)
    assert (c.seq, c.keys, c.scenario) == (10, 33, "chunked")
    assert scenarios.scenario_case(None, "cpu", q_len=40, kv_len=40).scenario == "prefill"


# --- every CPU entry on every scenario ---------------------------------------------------------

CPU_ENTRIES = ["naive", "naive_inplace", "sdpa_auto", "sdpa_math", "sdpa_flash", "fused"]
CASES = {
    # one query on keys that are no multiple of a tile (the fused kernel's masked last block)
    "decode": lambda kv: sweeps.case(2, 2, 1, 32, kv_heads=kv, kv_len=70),
    # a few queries, several key blocks to their left
    "decode8": lambda kv: sweeps.case(1, 2, 8, 32, kv_heads=kv, kv_len=45),
    # a chunk spanning more than one query tile of the interpreter's kernel
    "chunked": lambda kv: sweeps.case(1, 2, 20, 32, kv_heads=kv, kv_len=50),
    # an empty sequence between odd lengths
    "varlen": lambda kv: sweeps.Case(3, 2, 17, 32, kv, None, None, (9, 0, 17)),
    # a few queries on a paged cache whose last page is partly filled (45 = 5 x 8 + 5)
    "paged": lambda kv: sweeps.case(2, 2, 3, 32, kv_heads=kv, kv_len=45, page_size=8),
}


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["mha", "gqa"])
@pytest.mark.parametrize("which", list(CASES))
@pytest.mark.parametrize("name", CPU_ENTRIES)
def test_cpu_entries_match_the_float64_reference(name, which, kv_heads):
    impl = IMPLEMENTATIONS[name]
    c = CASES[which](kv_heads)
    inputs = scenarios.case_inputs(c, torch.float32, "cpu", seed=7)
    cannot = scenarios.unsupported(impl, c)
    if cannot:  # the eager baselines refuse GQA; only the fused entry reads a paged cache
        assert ((name.startswith("naive") and kv_heads == 1 and "gqa" in cannot)
                or (which == "paged" and name != "fused" and "prepare_paged" in cannot)), cannot
        return
    with torch.no_grad():
        out = scenarios.prepare(impl, inputs, causal=True)()
    ref, region = scenarios.reference(inputs, causal=True, budget_bytes=2**30)
    assert out.shape == inputs.qkv[0].shape
    # fp32 sums over at most 70 keys: ~1e-7 per term; 1e-5 is ~10x what any entry shows here.
    assert scenarios.error(out, ref, region) < 1e-5


def test_paged_cache_holds_the_keys_in_a_shuffled_block_table():
    k = torch.randn(2, 3, 45, 8, generator=torch.Generator().manual_seed(0))
    v = k + 1
    k_cache, v_cache, table, lens = scenarios.paged_cache(k, v, 8, seed=5)
    assert k_cache.shape == (12, 8, 3, 8) and table.shape == (2, 6)
    assert table.dtype == lens.dtype == torch.int32 and lens.tolist() == [45, 45]
    assert sorted(table.flatten().tolist()) == list(range(12))  # every page once
    assert table.flatten().tolist() != list(range(12))  # not the identity
    for cache, t in ((k_cache, k), (v_cache, v)):
        rows = cache[table.long()].flatten(1, 2)  # [batch, pages * 8, kv_heads, dim]
        assert torch.equal(rows[:, :45].transpose(1, 2), t)
        assert not rows[:, 45:].any()  # the last page's unused rows are zeros


def test_sdpa_decode_uses_no_mask_and_chunked_an_explicit_one(monkeypatch):
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    for which in ("decode", "chunked"):
        inputs = scenarios.case_inputs(CASES[which](2), torch.float32, "cpu", seed=1)
        scenarios.prepare(IMPLEMENTATIONS["sdpa_auto"], inputs, causal=True)()
    assert "attn_mask" not in calls[0] and calls[0]["is_causal"] is False
    assert calls[1]["attn_mask"].shape == (20, 50) and "is_causal" not in calls[1]
    assert scenarios.note(IMPLEMENTATIONS["sdpa_auto"], CASES["chunked"](2), True)
    assert not scenarios.note(IMPLEMENTATIONS["sdpa_auto"], CASES["decode"](2), True)


# --- the driver end to end ---------------------------------------------------------------------

def _bench(*argv):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return bench.run(parser.parse_args([*argv, "--device", "cpu", "--warmup-ms", "1",
                                        "--rep-ms", "2"]))


@pytest.mark.parametrize("scenario", ["chunked", "varlen"])
def test_bench_scenario_rows(scenario, tmp_path):
    path = tmp_path / "b.json"
    assert _bench("--scenario", scenario, "--impl", "naive", "sdpa_math", "fused",
                  "--json", str(path)) == 0
    result = json.loads(path.read_text())
    rows = {r["impl"]: r for r in result["rows"]}
    c = scenarios.PRESETS[scenario]["cpu"]
    assert result["sweep"] == f"scenario {scenario}"
    for name in ("sdpa_math", "fused"):
        row = rows[name]
        assert row["status"] == "ok" and row["scenario"] == scenario and row["error"] < 1e-5
        assert row["tflops"] == pytest.approx(scenarios.flops(c, True) / row["median_ms"] / 1e9)
    assert rows["sdpa_math"]["note"].startswith(("bottom-right", "packed"))
    # the CPU chunked preset has GQA heads, which the eager baseline refuses
    assert rows["naive"]["status"] == ("unsupported" if scenario == "chunked" else "ok")
    assert (rows["fused"]["seqlens"] is not None) == (scenario == "varlen")


def test_bench_paged_rows(tmp_path):
    path = tmp_path / "b.json"
    assert _bench("--scenario", "paged", "--page-size", "32", "--impl", "sdpa_math", "fused",
                  "--json", str(path)) == 0
    rows = {r["impl"]: r for r in json.loads(path.read_text())["rows"]}
    assert rows["fused"]["status"] == "ok" and rows["fused"]["error"] < 1e-5
    assert rows["fused"]["scenario"] == "paged" and rows["fused"]["page_size"] == 32
    assert rows["sdpa_math"]["status"] == "unsupported"
    assert "prepare_paged" in rows["sdpa_math"]["reason"]
    # forward only: the backward modes refuse it up front
    assert _bench("--scenario", "paged", "--mode", "bwd", "--impl", "fused", "--json",
                  str(path)) == 0
    (row,) = json.loads(path.read_text())["rows"]
    assert row["status"] == "unsupported" and "forward only" in row["reason"]


# --- a backward variant: fused_nondeterministic ---------------------------------------------------

def test_a_backward_variant_is_refused_its_forward():
    impl, base = IMPLEMENTATIONS["fused_nondeterministic"], IMPLEMENTATIONS["fused"]
    assert impl.ours and impl.backward_variant_of == "fused"
    assert (impl.gqa, impl.q_len_differs) == (base.gqa, base.q_len_differs)
    c = sweeps.case(1, 2, 24, 128)
    reason = scenarios.unsupported(impl, c, "fwd")
    assert reason.startswith("its forward is fused's; it differs only in the backward")
    assert "--mode bwd" in reason and "fwd_bwd" in reason
    assert scenarios.unsupported(impl, c, "bwd") is None
    assert scenarios.unsupported(impl, c, "fwd_bwd") is None
    assert scenarios.unsupported(base, c, "fwd") is None  # only the variant: read off the field
    # fused_attention_varlen and fused_attention_with_kvcache take no deterministic argument
    assert "prepare_varlen" in scenarios.unsupported(impl, CASES["varlen"](2), "bwd")
    assert "prepare_paged" in scenarios.unsupported(impl, CASES["paged"](2), "fwd_bwd")


def test_a_backward_variant_names_a_registered_entry():
    from attnscope.attention import registry

    orphan = dataclasses.replace(IMPLEMENTATIONS["fused_nondeterministic"], name="orphan",
                                 backward_variant_of="not_registered")
    with pytest.raises(ValueError, match="'not_registered', which is not registered"):
        registry.register(orphan)
    assert "orphan" not in IMPLEMENTATIONS


def test_bench_times_the_backward_variant_in_the_backward_modes(tmp_path):
    path = tmp_path / "b.json"
    argv = ("--scenario", "prefill", "--q-len", "24", "--dtype", "fp16", "--impl", "fused",
            "fused_nondeterministic", "--json", str(path))
    assert _bench(*argv, "--mode", "bwd") == 0
    rows = {r["impl"]: r for r in json.loads(path.read_text())["rows"]}
    for row in rows.values():
        assert row["status"] == "ok" and row["mode"] == "bwd" and row["median_ms"] > 0
        assert row["error"] < 2e-3  # the forward output's (fp16), the same for both
    assert rows["fused_nondeterministic"]["error"] == rows["fused"]["error"]
    # ours, not a peer: with no peer timed neither has a ratio
    assert rows["fused_nondeterministic"]["ratio_to_best_peer"] is None
    assert _bench(*argv) == 0  # --mode fwd: refused before anything runs
    rows = {r["impl"]: r for r in json.loads(path.read_text())["rows"]}
    assert rows["fused"]["status"] == "ok"
    variant = rows["fused_nondeterministic"]
    assert variant["status"] == "unsupported" and variant["median_ms"] is None
    assert variant["reason"].startswith("its forward is fused's")


def test_backward_variant_gradients_are_fuseds_on_the_cpu():
    # What bench --mode bwd times for each entry, at the shape of the calls fused_dq routes on
    # sm_90 (fp16, head_dim 128, no GQA): on the CPU that route is never taken, so the gradients
    # are fused's bit for bit (the NaN-poisoned buffers make an unwritten element fail).
    c = sweeps.case(1, 2, 24, 128)
    inputs = bench._with_grad(bench._make_inputs(c, torch.float16, torch.device("cpu"), 0))
    grads = {}
    for name in ("fused", "fused_nondeterministic"):
        forward = scenarios.prepare(IMPLEMENTATIONS[name], inputs, causal=True)
        grads[name] = bench._timed_call(forward, inputs.qkv, forward(), "bwd")()
    assert all(torch.equal(a, b) for a, b in zip(grads["fused"], grads["fused_nondeterministic"]))
    # and they are the gradients: within twice fp16 eager attention's error of float64's
    q, k, v = inputs.qkv
    dout = bench._upstream_grad(q)
    ref = torch.autograd.grad(attention_reference(q, k, v), (q, k, v), dout.double())
    low = torch.autograd.grad(attention_reference(q, k, v, dtype=q.dtype), (q, k, v), dout)
    for g, r, lo in zip(grads["fused"], ref, low):
        assert (g.double() - r).abs().max() <= 2 * (lo.double() - r).abs().max() + 1e-3


def test_a_paged_row_is_its_own_case_for_ratios():
    # the serving sweep times the same decode shape contiguous and paged: the best peer of one
    # must not be taken for the other's
    paged = [c for c in sweeps.SWEEPS["serving"] if c.scenario == "paged"]
    assert {c.page_size for c in paged} == {128, 16}
    for case in paged:
        assert dataclasses.replace(case, page_size=None) in sweeps.SWEEPS["serving"]
        row = {"shape": case.shape, "kv_heads": case.kv_heads, "kv_len": case.keys,
               "seqlens": None, "dtype": "bf16", "causal": True, "mode": "fwd"}
        assert bench._case_key({**row, "page_size": case.page_size}) != bench._case_key(row)


def test_bench_refuses_a_sweep_with_a_scenario(capsys):
    assert _bench("--sweep", "cpu", "--scenario", "decode") == 2
    assert "give one" in capsys.readouterr().err


def test_compare_decode_on_cpu(tmp_path):
    out = tmp_path / "out"
    assert main(["compare", "--device", "cpu", "--scenario", "decode", "--impl", "naive",
                 "sdpa_math", "--out", str(out)]) == 0
    result = json.loads((out / runs.LATEST / runs.RESULTS).read_text())
    c = scenarios.PRESETS["decode"]["cpu"]
    assert (result["scenario"], result["kv_len"], result["kv_heads"]) == ("decode", c.keys,
                                                                         c.kv_heads)
    assert result["flops_per_forward"] == attention_flops(c.batch, c.heads, 1, c.keys, c.head_dim)
    rows = {r["impl"]: r for r in result["rows"]}
    assert rows["naive"]["status"] == "unsupported" and "gqa" in rows["naive"]["reason"]
    assert rows["sdpa_math"]["status"] == "ok" and rows["sdpa_math"]["max_abs_error"] < 1e-5


def test_compare_refuses_seq_with_q_len(capsys):
    assert main(["compare", "--device", "cpu", "--seq", "8", "--q-len", "4"]) == 2
    assert "--seq sets both lengths" in capsys.readouterr().err


# --- GPU ---------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("scenario", ["decode", "chunked", "varlen", "paged"])
@pytest.mark.parametrize("name", [n for n in IMPLEMENTATIONS if n != "hub_flash_attn"])
def test_cuda_entries_match_the_reference(name, scenario):
    impl = IMPLEMENTATIONS[name]
    ok, why = impl.available(torch.device("cuda"))
    if not ok:
        pytest.skip(why)
    c = scenarios.PRESETS[scenario]["cuda"]
    if scenario == "varlen":  # a shorter packed batch: the float64 reference is per sequence
        c = sweeps.varlen_case(sweeps.varlen_lengths(6, 700, seed=4), 32, 128, kv_heads=8)
    elif scenario == "decode":
        c = sweeps.case(8, 32, 1, 128, kv_heads=8, kv_len=5000)
    elif scenario == "paged":  # a few queries; the last page partly filled (5000 = 39 x 128 + 8)
        c = sweeps.case(8, 32, 4, 128, kv_heads=8, kv_len=5000, page_size=128)
    cannot = scenarios.unsupported(impl, c)
    if cannot:
        pytest.skip(cannot)
    inputs = scenarios.case_inputs(c, torch.bfloat16, "cuda", seed=11)
    try:
        with torch.no_grad():
            out = scenarios.prepare(impl, inputs, causal=True)()
    except RuntimeError as exc:
        if not (impl.explicit_mask and scenarios.note(impl, c, True)):
            raise
        # SDPA backends that take no explicit mask (flash) refuse: an 'unsupported' row in bench
        pytest.skip(f"{name} refuses the explicit mask: {str(exc).splitlines()[0]}")
    ref, region = scenarios.reference(inputs, causal=True, budget_bytes=2**32)
    q, k, v = inputs.qkv
    if inputs.packing is None:
        low = attention_reference(q, k, v, causal_alignment="bottom_right", dtype=q.dtype)
        low = low[:, :, region["query_rows"][0]:]
    else:
        low = attention_reference_varlen(q, k, v, *inputs.packing[:2], dtype=q.dtype)
    # Twice the error of torch's own bf16 path, plus half a bf16 step at values ~1 (4e-3).
    bound = 2 * scenarios.error(low, ref, region) + 4e-3
    assert scenarios.error(out, ref, region) <= bound


def test_a_pinned_backend_without_a_kernel_refuses_the_call():
    # The CPU build has no memory-efficient kernel: SDPA says it has no backend for the call,
    # which the entry turns into the registry's refusal, an 'unsupported' row in bench and compare.
    from torch.nn.attention import SDPBackend

    from attnscope.attention import sdpa
    from attnscope.profile import compare

    q = torch.randn(1, 2, 8, 16, generator=torch.Generator().manual_seed(3))
    forward = sdpa._call(SDPBackend.EFFICIENT_ATTENTION, q, q, q, is_causal=True)
    with pytest.raises(NotImplementedError, match="EFFICIENT_ATTENTION backend has no kernel") as e:
        forward()
    assert compare._classify(e.value) == "unsupported"


# --- sliding windows and softcaps --------------------------------------------------------------

@pytest.mark.parametrize("q_len, kv_len", [
    (6, 6),  # self-attention: the two alignments agree
    (3, 11),  # fewer queries than keys: bottom-right and top-left differ
    (1, 9),  # one query (decode)
    (9, 4),  # more queries than keys: the first rows see no key bottom-right
])
@pytest.mark.parametrize("causal, window", [
    (True, (2, 0)),  # Mistral-style: 3 keys
    (True, (0, 0)),  # one key: the diagonal only
    (True, (50, 0)),  # a window wider than the sequence: plain causal
    (True, (-1, -1)),  # no window
    (False, (1, 2)),  # two-sided
    (False, (-1, 1)),  # unbounded left
    (False, (3, -1)),  # unbounded right
    (False, (0, 0)),  # one key, not causal
    (False, (40, 40)),  # wider than the sequence both ways: every pair
])
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_visible_pairs_are_the_brute_force_count(q_len, kv_len, causal, window, alignment):
    brute = window_mask(q_len, kv_len, alignment, window, causal).sum().item()
    assert visible_pairs(q_len, kv_len, causal=causal, window=window,
                         causal_alignment=alignment) == brute


def test_windowed_flops_count_the_visible_pairs():
    pairs = window_mask(5, 12, "bottom_right", (3, 0), True).sum().item()
    assert attention_flops(2, 3, 5, 12, 64, window=(3, 0)) == 4 * 2 * 3 * 64 * pairs
    assert attention_flops(1, 1, 100, 100, 64, window=(9, 0)) == 4 * 64 * (100 * 10 - 45)
    assert varlen_flops((7, 30), 2, 64, window=(4, 0)) == (
        attention_flops(1, 2, 7, 7, 64, window=(4, 0))
        + attention_flops(1, 2, 30, 30, 64, window=(4, 0)))
    c = scenarios.with_options(sweeps.case(1, 2, 20, 32, kv_len=50), (6, -1), None, causal=True)
    assert scenarios.flops(c, True) == attention_flops(1, 2, 20, 50, 32, window=(6, 0))


@pytest.mark.parametrize("window, softcap, causal, says", [
    ((3, 2), None, True, r"--window 3,2: .*right size must be 0 or -1"),
    ((-2, 0), None, True, r"--window -2,0: window sizes must be >= 0, or -1"),
    (None, -1.0, True, "--softcap: softcap must be a finite float >= 0"),
    (None, float("inf"), False, "--softcap: softcap must be a finite"),
    (None, float("nan"), True, "--softcap: softcap must be a finite"),
])
def test_window_and_softcap_are_checked(window, softcap, causal, says):
    with pytest.raises(ValueError, match=says):
        scenarios.with_options(sweeps.case(1, 2, 8, 16), window, softcap, causal)


@pytest.mark.parametrize("window, softcap, causal, recorded", [
    ((5, -1), None, True, ((5, 0), None)),  # causal: the right side is 0
    ((-1, -1), 0.0, True, (None, None)),  # nothing set
    ((-1, 0), None, True, (None, None)),  # causal already hides the right
    ((-1, 3), 20, False, ((-1, 3), 20.0)),  # not causal: kept as given
])
def test_options_are_recorded_as_they_run(window, softcap, causal, recorded):
    c = scenarios.with_options(sweeps.case(1, 2, 8, 16), window, softcap, causal)
    assert (c.window, c.softcap) == recorded


def test_flex_window_masks_and_softcap_are_the_references():
    q_idx, kv_idx = torch.arange(6)[:, None], torch.arange(11)[None, :]
    for causal, window in ((True, (2, 0)), (False, (1, 3)), (False, (-1, 0)), (False, (2, -1))):
        assert torch.equal(_bottom_right_causal(5, window, causal)(0, 0, q_idx, kv_idx),
                           window_mask(6, 11, "bottom_right", window, causal))
    assert _bottom_right_causal(5, None, causal=False) is None  # full attention: no block mask
    cu = _cu((4, 1, 6))
    q_idx, kv_idx = torch.arange(11)[:, None], torch.arange(11)[None, :]
    for causal, window in ((True, (1, 0)), (False, (0, 2))):
        assert torch.equal(_document_mask(cu, cu, causal, window)(0, 0, q_idx, kv_idx),
                           varlen_mask(cu, cu, causal, window))
    scores = torch.linspace(-200, 200, 9, dtype=torch.float64)
    torch.testing.assert_close(_softcap(30.0)(scores, 0, 0, 0, 0), 30 * torch.tanh(scores / 30))


def test_varlen_window_mask_is_each_sequences_window_mask():
    q_lens, k_lens = (2, 0, 5), (6, 3, 5)
    mask = varlen_mask(_cu(q_lens), _cu(k_lens), causal=True, window=(2, 0))
    expected = torch.block_diag(*(window_mask(a, b, "bottom_right", (2, 0), True).int()
                                  for a, b in zip(q_lens, k_lens))).bool()
    assert torch.equal(mask, expected)


WINDOWED = {
    # a window that slides inside one chunk of new queries on a longer cache
    "chunked": (sweeps.case(1, 2, 20, 32, kv_len=50), (7, -1), None),
    # a softcap small enough to change the softmax (scores of N(0,1) inputs reach ~10)
    "softcap": (sweeps.case(1, 2, 24, 32), None, 2.0),
    # both, on packed sequences with an empty one
    "varlen": (sweeps.Case(3, 2, 17, 32, 2, None, None, (9, 0, 17)), (4, -1), 3.0),
}


@pytest.mark.parametrize("which", list(WINDOWED))
@pytest.mark.parametrize("name", ["naive", "naive_inplace", "sdpa_math", "fused"])
def test_cpu_entries_match_the_reference_under_windows_and_softcaps(name, which):
    impl = IMPLEMENTATIONS[name]
    c, window, softcap = WINDOWED[which]
    c = scenarios.with_options(c, window, softcap, causal=True)
    cannot = scenarios.unsupported(impl, c)
    if cannot:  # SDPA applies no softcap
        assert name.startswith("sdpa") and c.softcap and "softcap" in cannot, cannot
        return
    inputs = scenarios.case_inputs(c, torch.float32, "cpu", seed=11)
    with torch.no_grad():
        out = scenarios.prepare(impl, inputs, causal=True, **scenarios.options(c))()
    ref, region = scenarios.reference(inputs, True, 2**30, **scenarios.options(c))
    plain, _ = scenarios.reference(inputs, True, 2**30)
    # the options change the answer, so a forward that ignored them could not pass
    assert scenarios.error(plain, ref, region) > 1e-3
    assert scenarios.error(out, ref, region) < 1e-5


def test_bench_window_rows(tmp_path):
    path = tmp_path / "b.json"
    # the chunked preset with one K/V head per query head, so the eager baseline runs too
    assert _bench("--scenario", "chunked", "--kv-heads", "4", "--window", "9,-1", "--impl",
                  "naive", "sdpa_math", "fused", "--json", str(path)) == 0
    result = json.loads(path.read_text())
    c = dataclasses.replace(scenarios.PRESETS["chunked"]["cpu"], kv_heads=4, window=(9, 0))
    assert result["cases"][0]["window"] == [9, 0] and "softcap" not in result["cases"][0]
    for row in result["rows"]:
        assert row["status"] == "ok" and row["error"] < 1e-5, row
        assert row["window"] == [9, 0] and "softcap" not in row
        assert row["tflops"] == pytest.approx(scenarios.flops(c, True) / row["median_ms"] / 1e9)
    sdpa = next(r for r in result["rows"] if r["impl"] == "sdpa_math")
    assert sdpa["note"] == "the sliding window as an explicit boolean mask"


def test_bench_softcap_rows(tmp_path):
    path = tmp_path / "b.json"
    assert _bench("--scenario", "chunked", "--kv-heads", "4", "--softcap", "3", "--impl",
                  "naive", "sdpa_math", "flex", "fused", "--json", str(path)) == 0
    rows = {r["impl"]: r for r in json.loads(path.read_text())["rows"]}
    assert rows["sdpa_math"]["status"] == "unsupported"
    assert "softcap" in rows["sdpa_math"]["reason"]
    for name in ("naive", "flex", "fused"):  # flex: a score_mod on the scaled score
        assert rows[name]["status"] == "ok" and rows[name]["error"] < 1e-5, rows[name]
        assert rows[name]["softcap"] == 3.0 and "window" not in rows[name]


def test_compare_with_window_and_softcap_on_cpu(tmp_path):
    out = tmp_path / "out"
    assert main(["compare", "--device", "cpu", "--batch", "1", "--heads", "2", "--seq", "24",
                 "--head-dim", "16", "--window", "5,-1", "--softcap", "4", "--impl", "naive",
                 "sdpa_math", "fused", "--out", str(out)]) == 0
    result = json.loads((out / runs.LATEST / runs.RESULTS).read_text())
    assert (result["window"], result["softcap"]) == ([5, 0], 4.0)
    assert result["flops_per_forward"] == attention_flops(1, 2, 24, 24, 16, window=(5, 0))
    rows = {r["impl"]: r for r in result["rows"]}
    assert rows["sdpa_math"]["status"] == "unsupported"
    assert "softcap" in rows["sdpa_math"]["reason"]
    for name in ("naive", "fused"):
        assert rows[name]["status"] == "ok" and rows[name]["max_abs_error"] < 1e-5


@pytest.mark.parametrize("argv, says", [
    (["compare", "--window", "4"], "expected LEFT,RIGHT"),
    (["bench", "--window", "a,b"], "expected LEFT,RIGHT"),
    (["bench", "--softcap", "x"], "invalid float value"),
])
def test_unparsable_options_are_usage_errors(argv, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [
    (["compare", "--window", "4,2"], "--window 4,2: "),
    (["compare", "--softcap", "-3"], "--softcap: "),
    (["bench", "--softcap", "inf"], "--softcap: "),
    (["bench", "--window=-3,0"], "--window -3,0: "),  # '=': argparse reads -3,0 as a flag
])
def test_bad_options_are_refused_before_running(argv, says, capsys):
    assert main([*argv, "--device", "cpu"]) == 2
    assert says in capsys.readouterr().err


def test_refusals_are_one_rule_for_bench_and_compare():
    # the registry's errors and a library's refusal message are 'unsupported'; other failures not
    assert scenarios.refuses(NotImplementedError("no GQA"))
    assert scenarios.refuses(ValueError("head_dim must be between 16 and 256"))
    assert scenarios.refuses(AssertionError("paged KV not supported on SM 9.0"))
    assert scenarios.refuses(RuntimeError("No available kernel. Aborting execution."))
    assert not scenarios.refuses(RuntimeError("CUDA error: an illegal memory access"))
    assert not scenarios.refuses(AssertionError("q.stride(-1) == 1"))
    assert not scenarios.refuses(RuntimeError("CUDA error: operation not supported on this GPU"))
