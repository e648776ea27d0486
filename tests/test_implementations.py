"""Every registered implementation on the CPU: matches the float64 reference, or says why not."""

import os
import sys
import textwrap

import pytest
import torch

from attnscope.attention import IMPLEMENTATIONS, attention_reference, flex, hub
from attnscope.profile.inputs import make_inputs

# seq 37: not a multiple of any block size, so partial blocks and the diagonal both get masked.
SHAPE = (1, 2, 37, 16)
CUDA_ONLY = {"sdpa_efficient", "sdpa_cudnn", "fa4", "fa4_deterministic", "flash_attn2"}
# Compiled FlexAttention takes ~30 s to build on CPU; its wiring (block mask, call) is the same
# eager, so the test hands it the uncompiled flex_attention. naive_compiled compiles for real
# (a few seconds).


@pytest.fixture
def qkv():
    return make_inputs(*SHAPE, torch.float32, "cpu")


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("name", [n for n in IMPLEMENTATIONS if n != "hub_flash_attn"])
def test_matches_reference_or_explains(name, qkv, monkeypatch):
    impl = IMPLEMENTATIONS[name]
    ok, reason = impl.available(torch.device("cpu"))
    assert isinstance(reason, str) and reason
    if name in CUDA_ONLY:
        assert not ok and "CUDA" in reason
        return
    assert ok, reason
    if name == "flex":
        monkeypatch.setattr(flex, "_compiled", flex.flex_attention)
    with torch.no_grad():
        out = impl.prepare(*qkv)()
    assert out.shape == SHAPE and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), attention_reference(*qkv), atol=2e-5, rtol=2e-5)


def test_fp32_inputs_are_not_degenerate(qkv):
    # Random inputs with distinct q, k, v: a kernel ignoring one of them or the mask would fail.
    q, k, v = qkv
    assert not torch.equal(q, k) and q.std() > 0.5
    masked = attention_reference(q, k, v)
    unmasked = attention_reference(q, k, v, causal=False)
    assert (masked - unmasked).abs().max() > 0.1


@pytest.fixture
def clean_hub_env(monkeypatch, tmp_path):
    for var in (hub.LOCAL_DIR_ENV, "KERNELS_CACHE", "HF_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))


@pytest.fixture
def fake_kernels_package(tmp_path, monkeypatch):
    """A stand-in for Hugging Face `kernels`: loads a local directory, refuses to download."""
    root = tmp_path / "site"
    (root / "kernels").mkdir(parents=True)
    (root / "kernels" / "__init__.py").write_text(textwrap.dedent("""
        import importlib.util
        loaded = []

        def get_local_kernel(repo_path, package_name):
            spec = importlib.util.spec_from_file_location(package_name,
                                                          repo_path / "__init__.py")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            loaded.append((repo_path, package_name))
            return module

        def get_kernel(*args, **kwargs):
            raise AssertionError("attnscope must never download a kernel")
    """))
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delitem(sys.modules, "kernels", raising=False)
    return root


FAKE_FLASH = textwrap.dedent("""
    import torch.nn.functional as F
    calls = []

    def flash_attn_func(q, k, v, causal=False):
        # flash-attn's layout is [batch, seq, heads, dim]; record what the adapter passed.
        calls.append((tuple(q.shape), q.is_contiguous(), causal))
        out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                             is_causal=causal)
        return out.transpose(1, 2), None  # some builds return (out, lse)
""")


def test_hub_without_kernels_package(clean_hub_env, monkeypatch):
    monkeypatch.setattr(hub.importlib.util, "find_spec", lambda name: None)
    ok, reason = hub._available(torch.device("cuda"))
    assert not ok and "`kernels` package is not installed" in reason


def test_hub_not_cached_never_downloads(clean_hub_env, fake_kernels_package):
    ok, reason = hub._available(torch.device("cuda"))
    assert not ok and "never downloads" in reason and hub.REPO_ID in reason


def test_hub_finds_newest_cached_snapshot(clean_hub_env, fake_kernels_package, tmp_path,
                                          monkeypatch):
    cache = tmp_path / "kcache"
    monkeypatch.setenv("KERNELS_CACHE", str(cache))
    snapshots = cache / "models--kernels-community--flash-attn" / "snapshots"
    (snapshots / "old" / "build").mkdir(parents=True)
    (snapshots / "no_build").mkdir()  # an interrupted download: skipped
    os.utime(snapshots / "old", (1, 1))  # older than `new`, whatever the file system's clock
    newest = cache / "kernels--kernels-community--flash-attn" / "snapshots" / "new"
    (newest / "build").mkdir(parents=True)
    assert hub.find_local_kernel() == newest
    ok, reason = hub._available(torch.device("cuda"))
    assert ok and str(newest) in reason


def test_hub_adapter_with_local_kernel(clean_hub_env, fake_kernels_package, tmp_path,
                                       monkeypatch, qkv):
    kernel_dir = tmp_path / "flash-attn"
    kernel_dir.mkdir()
    (kernel_dir / "__init__.py").write_text(FAKE_FLASH)
    monkeypatch.setenv(hub.LOCAL_DIR_ENV, str(kernel_dir))
    impl = IMPLEMENTATIONS["hub_flash_attn"]
    assert impl.available(torch.device("cuda"))[0]
    assert impl.available(torch.device("cpu")) == (False, "FlashAttention from the kernel hub "
                                                          "runs on CUDA only")
    out = impl.prepare(*qkv)()  # the adapter itself runs anywhere the fake kernel does
    assert out.shape == SHAPE  # back in [batch, heads, seq, dim]
    torch.testing.assert_close(out.double(), attention_reference(*qkv), atol=2e-5, rtol=2e-5)
    flash = hub._load(kernel_dir)
    b, h, s, d = SHAPE
    assert flash.calls == [((b, s, h, d), True, True)]


@pytest.mark.parametrize("name", ["sdpa_auto", "sdpa_math", "sdpa_flash", "fused"])
def test_gqa_inputs_run_where_the_backend_supports_them(name):
    # 4 query heads sharing 2 k/v heads: SDPA gets enable_gqa, the fused op reads k/v per group.
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, h, 16, 16, generator=gen) for h in (4, 2, 2))
    out = IMPLEMENTATIONS[name].prepare(q, k, v)()
    assert (out.double() - attention_reference(q, k, v)).abs().max().item() < 1e-5


@pytest.mark.parametrize("name", ["naive", "naive_inplace"])
def test_naive_entries_take_full_attention(name, qkv):
    # causal=False (bench --no-causal): the same five ops on a mask that hides nothing
    out = IMPLEMENTATIONS[name].prepare(*qkv, causal=False)()
    torch.testing.assert_close(out.double(), attention_reference(*qkv, causal=False), atol=2e-5,
                               rtol=2e-5)


def test_naive_refuses_gqa_instead_of_timing_a_copy():
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, h, 16, 16, generator=gen) for h in (4, 2, 2))
    with pytest.raises(NotImplementedError, match="4 q heads, 2 k/v heads"):
        IMPLEMENTATIONS["naive"].prepare(q, k, v)
