"""FlashAttention from the Hugging Face kernel hub (04_d), loaded only from the local cache.

04_d calls `kernels.get_kernel("kernels-community/flash-attn")`, which downloads on first use.
attnscope never downloads: it looks for the kernel repo already in the cache `kernels` uses
(KERNELS_CACHE, else huggingface_hub's) and imports it with `kernels.get_local_kernel`, which
picks the build variant for this torch and CUDA. ATTNSCOPE_HUB_KERNEL_DIR names a kernel
directory directly (an unpacked repo, or a local build) and wins over the cache.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from pathlib import Path

import torch

from attnscope.attention.registry import Implementation, register

REPO_ID = "kernels-community/flash-attn"
PACKAGE = "flash_attn"  # what kernels derives from the repo name: last part, "-" -> "_"
LOCAL_DIR_ENV = "ATTNSCOPE_HUB_KERNEL_DIR"


def _cache_roots() -> list[Path]:
    roots = [os.environ.get("KERNELS_CACHE"), os.environ.get("HF_HUB_CACHE")]
    hf_home = os.environ.get("HF_HOME", os.path.join(os.path.expanduser("~"), ".cache",
                                                     "huggingface"))
    roots.append(os.path.join(hf_home, "hub"))
    return [Path(r) for r in roots if r]


def find_local_kernel() -> Path | None:
    """The newest cached snapshot of REPO_ID holding builds, or the LOCAL_DIR_ENV directory."""
    override = os.environ.get(LOCAL_DIR_ENV)
    if override:
        return Path(override) if Path(override).is_dir() else None
    # huggingface_hub names a repo's cache folder "<type>s--<org>--<name>"; kernel repos were
    # "model" repos before the hub had a "kernel" type, so caches may hold either.
    folder = REPO_ID.replace("/", "--")
    snapshots = [s for root in _cache_roots() for kind in ("kernels", "models")
                 for s in (root / f"{kind}--{folder}" / "snapshots").glob("*")
                 if (s / "build").is_dir()]
    return max(snapshots, key=lambda s: s.stat().st_mtime, default=None)


def _available(device):
    if torch.device(device).type != "cuda":
        return False, "FlashAttention from the kernel hub runs on CUDA only"
    if importlib.util.find_spec("kernels") is None:
        return False, "the Hugging Face `kernels` package is not installed (pip install kernels)"
    path = find_local_kernel()
    if path is None:
        where = f"${LOCAL_DIR_ENV}" if os.environ.get(LOCAL_DIR_ENV) else "the local cache"
        return False, (f"{REPO_ID} is not in {where} and attnscope never downloads; fetch it "
                       f"once where the hub is reachable: kernels.get_kernel({REPO_ID!r})")
    return True, f"{REPO_ID} from {path}"


@functools.cache
def _load(path: Path):
    return importlib.import_module("kernels").get_local_kernel(path, PACKAGE)


def _prepare(q, k, v):
    path = find_local_kernel()
    if path is None:
        raise RuntimeError(_available(q.device)[1])
    flash = _load(path)
    # 04_d builds its inputs as [batch, seq, heads, dim]; copying here, outside the forward, gives
    # the kernel that layout contiguous, as there, instead of strided views.
    q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))

    def forward():
        out = flash.flash_attn_func(q, k, v, causal=True)
        # Some builds return (out, softmax_lse, ...); the output is always first.
        out = out[0] if isinstance(out, tuple) else out
        return out.transpose(1, 2)  # back to [batch, heads, seq, dim], a view
    return forward


register(Implementation(
    name="hub_flash_attn",
    description="FlashAttention from the Hugging Face kernel hub, layout [batch, seq, heads, dim]",
    seed_script="04_d_kernels_attention.py",
    available=_available,
    prepare=_prepare,
    gqa=True,  # flash_attn_func reads k/v heads per group of q heads
))
