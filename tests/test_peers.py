"""The pip FlashAttention peers (fa4, flash_attn2) and the kernel-hub row (hub_flash_attn).

On the CPU: availability and its reasons for every way the two `flash_attn` packages can be
installed (fake packages on sys.path, a faked CUDA capability), the BSHD views prepare() passes
and the autograd graph it keeps, the hub row through a `kernels` stand-in (tests/hub_standin),
and the kernel-name fingerprints of the peers' kernels. On the GPU (marker cuda): the real
libraries, where installed, against the float64 reference, and the hub stand-in and FA4 captured
by the driver.
"""

import importlib
import json
import re
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from attnscope.attention import IMPLEMENTATIONS, attention_reference, flash_attn, hub
from attnscope.profile import runs, scenarios
from attnscope.profile import tensor_cores as tc
from attnscope.profile.cli import main

STANDIN = Path(__file__).parent / "hub_standin"
FLASH_MODULES = ("flash_attn", "flash_attn.cute", "flash_attn_2_cuda")
HOPPER = (9, 0)

# A fake flash_attn_func: flash-attn's call on SDPA, recording what it was given.
# RETURN is "out" (flash-attn 2) or "out, None" (FA4 versions that return (out, lse)).
FAKE_FUNC = """
import torch.nn.functional as F
calls = []

def flash_attn_func(q, k, v, causal=False, **options):
    calls.append({{"shape": tuple(q.shape), "kv_shape": tuple(k.shape), "causal": causal,
                   "ptrs": tuple(t.data_ptr() for t in (q, k, v)), "stride": q.stride(),
                   "options": options}})
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=causal, enable_gqa=k.shape[2] != q.shape[2])
    out = out.transpose(1, 2)
    return {ret}
"""


@pytest.fixture
def site(tmp_path, monkeypatch):
    """An empty folder first on sys.path, with no `flash_attn` imported; what a test puts there
    leaves sys.modules with the test."""
    for name in FLASH_MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    yield root
    for name in FLASH_MODULES:
        sys.modules.pop(name, None)


def _write(root: Path, rel: str, text: str = "") -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    importlib.invalidate_caches()  # the path finder caches directory listings


def install(root: Path, *, fa4: bool, fa2: bool) -> None:
    """Fake installs: flash-attn 2 owns flash_attn/__init__.py and the extension module
    flash_attn_2_cuda; flash-attn-4 adds flash_attn/cute (alone: a namespace package)."""
    if fa2:
        _write(root, "flash_attn/__init__.py", FAKE_FUNC.format(ret="out"))
        _write(root, "flash_attn_2_cuda.py", "raise ImportError('a CUDA extension: never "
                                             "imported to decide availability')")
    if fa4:
        _write(root, "flash_attn/cute/__init__.py", FAKE_FUNC.format(ret="out, None"))


@pytest.fixture
def hopper(monkeypatch):
    monkeypatch.setattr(flash_attn, "cuda_capability", lambda device: HOPPER)


CUDA = torch.device("cuda")  # only a device name here: availability reads the faked capability


# --- listing ---------------------------------------------------------------------------------

def test_list_shows_peers_with_reasons_on_cpu(capsys):
    assert main(["list", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^  fa4 +no +FlashAttention-4 runs on CUDA only", out, re.M), out
    assert re.search(r"^  flash_attn2 +no +flash-attn 2 runs on CUDA only", out, re.M), out


@pytest.mark.parametrize("fa4, fa2", [
    (True, True),    # both: flash-attn 2's __init__ next to flash-attn-4's cute/
    (True, False),   # flash-attn-4 alone: flash_attn is a namespace package
    (False, True),   # flash-attn 2 alone: a flash_attn without .cute
    (False, False),  # nothing
])
def test_availability_follows_what_is_installed(site, hopper, fa4, fa2):
    install(site, fa4=fa4, fa2=fa2)
    for name, installed, label in (("fa4", fa4, "FlashAttention-4"),
                                   ("flash_attn2", fa2, "flash-attn 2")):
        ok, reason = IMPLEMENTATIONS[name].available(CUDA)
        assert ok == installed, reason
        if installed:
            assert reason.startswith(label)
        else:
            assert reason.startswith(f"{label} is not installed (")
    # Deciding never imported the CUDA extension (the fake one raises on import).
    assert "flash_attn_2_cuda" not in sys.modules


def test_a_flash_attn_that_is_neither_is_not_taken_for_either(site, hopper):
    _write(site, "flash_attn/__init__.py", "flash_attn_func = None  # some other package")
    for name in ("fa4", "flash_attn2"):
        ok, reason = IMPLEMENTATIONS[name].available(CUDA)
        assert not ok and "is not installed" in reason


def test_cpu_reason_says_what_is_missing(site):
    install(site, fa4=True, fa2=False)
    assert IMPLEMENTATIONS["fa4"].available(torch.device("cpu")) == (
        False, "FlashAttention-4 runs on CUDA only")
    ok, reason = IMPLEMENTATIONS["flash_attn2"].available(torch.device("cpu"))
    assert not ok and "CUDA only; not installed here either (a CUDA source build: pip install "\
        "flash-attn --no-build-isolation)" in reason


@pytest.mark.parametrize("capability, fa4_ok, fa2_ok", [
    ((7, 5), False, False),  # Turing: neither
    ((8, 0), False, True),   # A100: flash-attn 2 only
    ((9, 0), True, True),    # H100/H200
    ((10, 0), True, True),   # B200
])
def test_availability_follows_the_gpu(site, monkeypatch, capability, fa4_ok, fa2_ok):
    install(site, fa4=True, fa2=True)
    monkeypatch.setattr(flash_attn, "cuda_capability", lambda device: capability)
    for name, expected in (("fa4", fa4_ok), ("flash_attn2", fa2_ok)):
        ok, reason = IMPLEMENTATIONS[name].available(CUDA)
        assert ok == expected, reason
        if not ok:
            assert reason.endswith(f"this GPU is sm_{capability[0]}{capability[1]}")


def test_no_cuda_device(site, monkeypatch):
    install(site, fa4=True, fa2=True)
    monkeypatch.setattr(flash_attn, "cuda_capability", lambda device: None)
    assert IMPLEMENTATIONS["fa4"].available(CUDA) == (False, "no CUDA device")


def test_an_import_that_fails_is_a_reason_not_an_exception(site, hopper):
    # What importing the CuTe DSL can do on a machine it does not fit: not an ImportError.
    _write(site, "flash_attn/cute/__init__.py", "raise RuntimeError('cuInit failed: no driver')")
    ok, reason = IMPLEMENTATIONS["fa4"].available(CUDA)
    assert not ok
    assert reason == ("flash_attn.cute is installed but does not import (RuntimeError: cuInit "
                      "failed: no driver)")
    with pytest.raises(RuntimeError, match="does not import"):
        IMPLEMENTATIONS["fa4"].prepare(*(torch.randn(1, 2, 8, 16, dtype=torch.float16)
                                         for _ in range(3)))


# --- prepare: layout, no copies, autograd ----------------------------------------------------

# fp16: the peers take 16-bit inputs only. The fakes run SDPA's math path in fp16 on the CPU, so
# their error against float64 is fp16 rounding of O(1) values through two matmuls and a softmax:
# bounded, as in flash-attn's tests, by twice the error of the framework's own fp16 path
# (attention_reference in fp16) plus one fp16 ulp at 1 (2**-10) for rounding-order differences.
def _qkv(heads, kv_heads, seq=37, head_dim=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    # seq 37: no multiple of a block size, so the causal mask's diagonal and edges both matter.
    return tuple(torch.randn(2, h, seq, head_dim, generator=gen, dtype=torch.float32)
                 .to(torch.float16).requires_grad_() for h in (heads, kv_heads, kv_heads))


def _bound(low, ref):
    return 2 * (low.double() - ref).abs().max().item() + 2.0 ** -10


@pytest.mark.parametrize("name, module, options", [
    ("fa4", "flash_attn.cute", {}),
    ("fa4_deterministic", "flash_attn.cute", {"deterministic": True}),
    ("flash_attn2", "flash_attn", {}),
])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2)])  # MHA, and GQA with 2 q per k/v
def test_prepare_passes_bshd_views_and_keeps_the_graph(site, name, module, options, heads,
                                                       kv_heads):
    install(site, fa4=True, fa2=True)
    q, k, v = _qkv(heads, kv_heads)
    forward = IMPLEMENTATIONS[name].prepare(q, k, v)
    out = forward()
    calls = importlib.import_module(module).calls
    b, h, s, d = q.shape
    assert calls == [{"shape": (b, s, h, d), "kv_shape": (b, s, kv_heads, d), "causal": True,
                      # the caller's storage, seen through a transpose: no copy was made
                      "ptrs": tuple(t.data_ptr() for t in (q, k, v)),
                      "stride": q.transpose(1, 2).stride(), "options": options}]
    assert out.shape == q.shape and out.dtype == torch.float16

    ref = attention_reference(q.detach(), k.detach(), v.detach())
    low = attention_reference(q.detach(), k.detach(), v.detach(), dtype=torch.float16)
    assert (out.double() - ref).abs().max().item() <= _bound(low, ref)

    # The graph reaches the caller's q, k, v, which is what bench's bwd modes differentiate.
    gen = torch.Generator().manual_seed(1)
    dout = torch.randn(q.shape, generator=gen).to(torch.float16)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_grads = torch.autograd.grad(attention_reference(*leaves), leaves, dout.double())
    low_leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    low_grads = torch.autograd.grad(attention_reference(*low_leaves, dtype=torch.float16),
                                    low_leaves, dout)
    for got, want, low_g in zip(grads, ref_grads, low_grads):
        assert got.shape == want.shape
        assert (got.double() - want).abs().max().item() <= _bound(low_g, want)


def test_full_attention_when_asked(site):
    install(site, fa4=True, fa2=False)
    q, k, v = (t.detach() for t in _qkv(2, 2))
    out = IMPLEMENTATIONS["fa4"].prepare(q, k, v, causal=False)()
    assert importlib.import_module("flash_attn.cute").calls[0]["causal"] is False
    ref = attention_reference(q, k, v, causal=False)
    low = attention_reference(q, k, v, causal=False, dtype=torch.float16)
    assert (out.double() - ref).abs().max().item() <= _bound(low, ref)


@pytest.mark.parametrize("name", ["fa4", "flash_attn2"])
def test_fp32_is_refused_before_running(name):
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(TypeError, match="takes float16 or bfloat16 inputs; got torch.float32"):
        IMPLEMENTATIONS[name].prepare(q, q, q)


# --- the hub row through the `kernels` stand-in ----------------------------------------------

@pytest.fixture
def standin(monkeypatch, tmp_path):
    """tests/hub_standin first on sys.path, and a fake kernel cache holding one snapshot, found
    the way hub.find_local_kernel looks (KERNELS_CACHE, no ATTNSCOPE_HUB_KERNEL_DIR)."""
    for var in (hub.LOCAL_DIR_ENV, "HF_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    cache = tmp_path / "kernels_cache"
    snapshot = cache / "models--kernels-community--flash-attn" / "snapshots" / "0123abc"
    (snapshot / "build").mkdir(parents=True)
    monkeypatch.setenv("KERNELS_CACHE", str(cache))
    for name in ("kernels", "kernels.flash_attn"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.syspath_prepend(str(STANDIN))
    yield snapshot
    for name in ("kernels", "kernels.flash_attn"):
        sys.modules.pop(name, None)


def test_hub_row_through_the_standin(standin):
    impl = IMPLEMENTATIONS["hub_flash_attn"]
    ok, reason = impl.available(CUDA)
    assert ok and reason == f"{hub.REPO_ID} from {standin}"
    assert impl.available(torch.device("cpu"))[0] is False  # the real hub runs on CUDA only

    # fp32 on the CPU: the stand-in runs SDPA's math path, exact to fp32 rounding (2e-5 covers
    # O(1) outputs through two matmuls of length <= 37 and a softmax, as the CPU suite does).
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, h, 37, 16, generator=gen).requires_grad_() for h in (4, 2, 2))
    out = impl.prepare(q, k, v)()
    assert out.shape == q.shape
    ref = attention_reference(q.detach(), k.detach(), v.detach())
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)

    kernels = importlib.import_module("kernels")
    calls = importlib.import_module("kernels.flash_attn").calls
    b, h, s, d = q.shape
    # 04_d's layout, contiguous: prepare copied once, outside the forward.
    assert calls == [((b, s, h, d), (s * h * d, h * d, d, 1), True)]
    assert kernels.loaded == [(standin, hub.PACKAGE)] and kernels.downloads == []

    # The copies stay in the inputs' graph: bench's bwd modes reach q, k, v.
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    dout = torch.randn(q.shape, generator=gen)
    want = torch.autograd.grad(attention_reference(*leaves), leaves, dout.double())
    got = torch.autograd.grad(out, (q, k, v), dout)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, atol=2e-5, rtol=2e-5)


def test_hub_local_dir_wins_over_the_cache(standin, monkeypatch, tmp_path):
    local = tmp_path / "my-flash-attn-build"
    local.mkdir()
    monkeypatch.setenv(hub.LOCAL_DIR_ENV, str(local))
    assert hub.find_local_kernel() == local
    ok, reason = IMPLEMENTATIONS["hub_flash_attn"].available(CUDA)
    assert ok and reason == f"{hub.REPO_ID} from {local}"


# --- Tensor Core fingerprints of the peers' kernels ------------------------------------------

# FA4's CuTe DSL names follow kernel_cutlass_kernel_<module path without dots><class>_object_at_
# <argument layouts>; the sm100 forward's name below is as published traces show it, the sm90
# ones are built on that pattern from the classes in flash_attn/cute (flash_fwd, flash_bwd_sm90,
# flash_bwd_preprocess, flash_bwd_postprocess). The GPU test below checks the names FA4 launches.
FA4_ARGS = "_object_at__tensorptrbf16gmemalign16oi64div81i64div8_tensorptrbf16gmemalign16o_None_0"


@pytest.mark.parametrize("name, verdict, family", [
    ("kernel_cutlass_kernel_flash_attncuteflash_fwd_sm100FlashAttentionForwardSm100_object_at__"
     "tensor0000o11101213_tensor0000o11101213_tensor0000o10111213_None_None_None_Non_0",
     "yes", "fa4"),
    ("kernel_cutlass_kernel_flash_attncuteflash_fwdFlashAttentionForwardSm90" + FA4_ARGS,
     "yes", "fa4"),
    ("kernel_cutlass_kernel_flash_attncuteflash_bwd_sm90FlashAttentionBackwardSm90" + FA4_ARGS,
     "yes", "fa4"),
    ("kernel_cutlass_kernel_flash_attncuteflash_bwd_preprocessFlashAttentionBackwardPreprocess"
     + FA4_ARGS, "no", "fa4_helpers"),
    ("kernel_cutlass_kernel_flash_attncuteflash_bwd_postprocessFlashAttentionBackward"
     "Postprocess" + FA4_ARGS, "no", "fa4_helpers"),
    ("kernel_cutlass_kernel_flash_attncuteflash_fwd_combineFlashAttentionForwardCombine"
     + FA4_ARGS, "no", "fa4_helpers"),
    # flash-attn 2 (global namespace since 2.5) and PyTorch's copy of it
    ("void flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, "
     "cutlass::bfloat16_t, Flash_kernel_traits<128, 128, 64, 4, cutlass::bfloat16_t> >, false, "
     "true, false, false, true, true, false, false>(Flash_fwd_params)", "yes", "flash_attn"),
    ("void flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128, 64, 128, 8, "
     "2, 4, 2, false, false, cutlass::bfloat16_t>, false, true, false, false, true, true, "
     "false>(Flash_bwd_params)", "yes", "flash_attn"),
    ("void flash_bwd_dot_do_o_kernel<true, Flash_bwd_kernel_traits<128, 64, 128, 8, 2, 4, 2, "
     "false, false, cutlass::bfloat16_t> >(Flash_bwd_params)", "no", "flash_bwd_helpers"),
    ("void flash_bwd_convert_dq_kernel<Flash_bwd_kernel_traits<128, 64, 128, 8, 2, 4, 2, false, "
     "false, cutlass::bfloat16_t> >(Flash_bwd_params, int)", "no", "flash_bwd_helpers"),
    ("void pytorch_flash::flash_bwd_convert_dkv_kernel<Flash_bwd_kernel_traits<64, 128, 128, 8, "
     "4, 2, 2, false, false, cutlass::bfloat16_t> >(pytorch_flash::Flash_bwd_params)", "no",
     "flash_bwd_helpers"),
    ("void flash_bwd_clear_dkvaccum_kernel<Flash_bwd_kernel_traits<128, 64, 128, 8, 2, 4, 2, "
     "false, false, cutlass::bfloat16_t> >(Flash_bwd_params)", "no", "flash_bwd_helpers"),
])
def test_peer_kernel_fingerprints(name, verdict, family):
    got = tc.name_verdict(name)
    assert (got["verdict"], got["evidence"], got["family"]) == (verdict, "name", family)


def test_cute_dsl_kernels_are_shown_by_their_class():
    # Tables and console lines name FA4's kernels by class (results.json's kernels keep the
    # whole name); the backward's is the start of the name an H200 run's ncu printed
    # (2026-12-03). A free function named `kernel` with an object among its arguments has no
    # class: its argument text is not taken for one.
    h200 = ("kernel_cutlass_kernel_flash_attncuteflash_bwd_sm90FlashAttentionBackwardSm90_object_"
            "at__tensor0000o11101213_tensor0000o11101213_tensor0000o11101213_tensor0000o1110121")
    assert tc.display_name(h200) == "FlashAttentionBackwardSm90"
    assert tc.display_name("kernel_cutlass_kernel_flash_attncuteflash_bwd_postprocessFlash"
                           "AttentionBackwardPostprocess" + FA4_ARGS) == (
        "FlashAttentionBackwardPostprocess")
    assert tc.display_name("kernel_cutlass_kernel_no_class") == "kernel_cutlass_kernel_no_class"
    free = "kernel_cutlass_kernel_tensor0000o11101213_tensorptrf32_gmem_o_AuxData_object_at__0"
    assert tc.display_name(free) == free


# --- GPU: the real libraries, and captures by the driver -------------------------------------

def _require(name):
    ok, reason = IMPLEMENTATIONS[name].available(CUDA)
    if not ok:
        pytest.skip(f"{name}: {reason}")


def _poison_allocator(nbytes: int) -> None:
    # The libraries allocate their outputs themselves; filling a freed block of the caching
    # allocator with NaN makes an element a kernel never writes show up as NaN.
    torch.full((nbytes // 4,), float("nan"), device="cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["fa4", "fa4_deterministic", "flash_attn2"])
@pytest.mark.parametrize("heads, kv_heads, seq, head_dim", [
    (4, 4, 1000, 128),  # 1000: no multiple of a tile, so the last tiles are partial
    (8, 2, 777, 64),    # GQA, 4 q heads per k/v head; odd length
])
def test_peer_matches_reference_on_gpu(name, heads, kv_heads, seq, head_dim):
    _require(name)
    gen = torch.Generator().manual_seed(seq)
    q, k, v = (torch.randn(2, h, seq, head_dim, generator=gen).to("cuda", torch.bfloat16)
               .requires_grad_() for h in (heads, kv_heads, kv_heads))
    dout = torch.randn(q.shape, generator=gen).to("cuda", torch.bfloat16)
    _poison_allocator(8 * q.numel() * 2)
    out = IMPLEMENTATIONS[name].prepare(q, k, v)()
    grads = torch.autograd.grad(out, (q, k, v), dout)

    # Bound: twice the error of the framework's own bf16 path against float64, plus one bf16
    # ulp at 1 (2**-7) for accumulation-order differences, as flash-attn's own tests do.
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = attention_reference(*leaves)
    ref_grads = torch.autograd.grad(ref, leaves, dout.double())
    low_leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    low = attention_reference(*low_leaves, dtype=torch.bfloat16)
    low_grads = torch.autograd.grad(low, low_leaves, dout)
    for what, got, want, base in (("out", out, ref, low), *zip(("dq", "dk", "dv"), grads,
                                                               ref_grads, low_grads)):
        assert not got.isnan().any(), f"{name} {what}: NaN (an unwritten element)"
        err = (got.double() - want).abs().max().item()
        bound = 2 * (base.double() - want).abs().max().item() + 2.0 ** -7
        assert err <= bound, f"{name} {what}: error {err:.3e} > {bound:.3e}"


@pytest.mark.cuda
@pytest.mark.parametrize("kv_heads", [8, 2])  # and GQA, where FA4 orders dK/dV's adds too
def test_fa4_deterministic_backward_repeats_bit_for_bit(kv_heads):
    _require("fa4_deterministic")
    gen = torch.Generator().manual_seed(kv_heads)
    q, k, v = (torch.randn(2, h, 1000, 128, generator=gen).to("cuda", torch.bfloat16)
               .requires_grad_() for h in (8, kv_heads, kv_heads))
    dout = torch.randn(q.shape, generator=gen).to("cuda", torch.bfloat16)
    forward = IMPLEMENTATIONS["fa4_deterministic"].prepare(q, k, v)
    first, second = (torch.autograd.grad(forward(), (q, k, v), dout) for _ in range(2))
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["fwd", "fwd_bwd"])
@pytest.mark.parametrize("name, main_kernel", [("fa4", "FlashAttentionForwardSm"),
                                               ("flash_attn2", "flash_fwd_kernel")])
def test_peer_captured_by_the_driver(tmp_path, name, main_kernel, mode):
    _require(name)
    out = tmp_path / "out"
    assert main(["compare", "--impl", name, "--mode", mode, "--out", str(out)]) == 0
    row, = json.loads((runs.resolve(out) / "results.json").read_text())["rows"]
    assert row["status"] == "ok", row.get("reason")
    names = [k["name"] for k in row["kernels"]]
    assert any(main_kernel in n for n in names), names
    # Every kernel the peer launches (forward, and backward with its helpers) has a fingerprint.
    assert {k["name"]: k["tensor_cores"]["verdict"] for k in row["kernels"]
            if k["tensor_cores"]["verdict"] == "unknown"} == {}
    assert row["tensor_cores"]["verdict"] == "yes"


@pytest.mark.cuda
def test_hub_standin_captured_by_the_driver(standin, tmp_path):
    out = tmp_path / "out"
    assert main(["compare", "--impl", "hub_flash_attn", "fused", "--out", str(out)]) == 0
    results = json.loads((runs.resolve(out) / "results.json").read_text())
    rows = {r["impl"]: r for r in results["rows"]}
    hub_row = rows["hub_flash_attn"]
    assert hub_row["status"] == "ok", hub_row.get("reason")
    names = [k["name"] for k in hub_row["kernels"]]
    assert len(names) == 1 and "flash_fwd_kernel" in names[0], names  # one fused kernel
    assert hub_row["tensor_cores"]["verdict"] == "yes"
    assert rows["fused"]["status"] == "ok"


# --- prepare_paged: each library's paged KV-cache call ----------------------------------------

# The fakes gather each sequence's pages back into a contiguous cache and run the float64
# reference on it (bottom-right causal), recording what they were given. FA4 takes the paged
# cache through flash_attn_varlen_func (page_table, seqused_k); flash-attn 2 through
# flash_attn_with_kvcache (block_table, cache_seqlens).
PAGED_FAKES = """
import torch
from attnscope.attention.reference import attention_reference
calls = []

def _paged(q, k_cache, v_cache, table, lens, causal):
    n = int(lens[0])
    k, v = (c[table.long()].flatten(1, 2)[:, :n].transpose(1, 2) for c in (k_cache, v_cache))
    out = attention_reference(q.transpose(1, 2), k, v, causal=causal,
                              causal_alignment="bottom_right")
    return out.to(q.dtype).transpose(1, 2)
"""
FA4_PAGED = PAGED_FAKES + """
def flash_attn_func(*args, **kwargs):
    raise AssertionError("the paged path must not call flash_attn_func")

def flash_attn_varlen_func(q, k, v, page_table=None, seqused_k=None, causal=False):
    calls.append({"table": page_table, "lens": seqused_k, "causal": causal, "q": q.shape})
    return _paged(q, k, v, page_table, seqused_k, causal), None
"""
FA2_PAGED = PAGED_FAKES + """
def flash_attn_func(*args, **kwargs):
    raise AssertionError("the paged path must not call flash_attn_func")

def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=None, block_table=None,
                            causal=False):
    calls.append({"table": block_table, "lens": cache_seqlens, "causal": causal, "q": q.shape})
    return _paged(q, k_cache, v_cache, block_table, cache_seqlens, causal)
"""


@pytest.mark.parametrize("name, module, text, page_size", [
    ("fa4", "flash_attn.cute", FA4_PAGED, 8),
    ("flash_attn2", "flash_attn", FA2_PAGED, 256),  # its pages: multiples of 256 keys
])
def test_prepare_paged_passes_the_block_table(site, name, module, text, page_size):
    _write(site, f"{module.replace('.', '/')}/__init__.py", text)
    if module == "flash_attn.cute":  # flash-attn-4 alone: flash_attn a namespace package
        assert not (site / "flash_attn" / "__init__.py").exists()
    q, k, v = (t.detach() for t in _qkv(4, 2, seq=37))
    q = q[:, :, -3:].contiguous()  # three new queries on 37 cached keys
    paging = scenarios.paged_cache(k, v, page_size, seed=2)
    out = IMPLEMENTATIONS[name].prepare_paged(q, *paging)()
    (call,) = importlib.import_module(module).calls
    assert call["table"] is paging[2] and call["lens"] is paging[3] and call["causal"] is True
    assert call["q"] == (2, 3, 4, 16)  # [batch, q_len, heads, dim]
    assert out.shape == q.shape
    ref = attention_reference(q, k, v, causal_alignment="bottom_right")
    low = attention_reference(q, k, v, causal_alignment="bottom_right", dtype=torch.float16)
    assert (out.double() - ref).abs().max().item() <= _bound(low, ref)


def test_flash_attn2_refuses_pages_it_cannot_take(site):
    _write(site, "flash_attn/__init__.py", FA2_PAGED)
    q, k, v = (t.detach() for t in _qkv(4, 2, seq=37))
    with pytest.raises(NotImplementedError, match="multiple of 256"):
        IMPLEMENTATIONS["flash_attn2"].prepare_paged(q, *scenarios.paged_cache(k, v, 128, seed=2))


@pytest.mark.parametrize("name, module, causal, window, sent", [
    ("fa4", "flash_attn.cute", True, (5, -1), (5, 0)),  # causal: the right side is 0
    ("fa4", "flash_attn.cute", False, (5, -1), (5, None)),  # FA4 says unbounded with None
    ("fa4_deterministic", "flash_attn.cute", False, (-1, 2), (None, 2)),
    ("flash_attn2", "flash_attn", False, (-1, 3), (-1, 3)),  # flash-attn 2's -1 as it is
])
def test_prepare_passes_the_window_and_softcap(site, name, module, causal, window, sent):
    install(site, fa4=True, fa2=True)
    q, k, v = (t.detach() for t in _qkv(2, 2))
    IMPLEMENTATIONS[name].prepare(q, k, v, causal=causal, window=window, softcap=20.0)()
    (call,) = importlib.import_module(module).calls
    assert call["causal"] is causal
    assert {k: call["options"][k] for k in ("window_size", "softcap")} == {
        "window_size": sent, "softcap": 20.0}
