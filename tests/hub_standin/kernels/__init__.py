"""A stand-in for Hugging Face `kernels`, for tests and for GPU runs without hub access.

`get_kernel` and `get_local_kernel` both return `kernels.flash_attn`, whose `flash_attn_func` is a
real flash kernel (SDPA's FlashAttention backend on CUDA). attnscope only ever calls
`get_local_kernel`; `get_kernel` (what the seed's 04_d script calls, and what would download)
records its calls in `downloads` so a test can check that none happened.

Use: put this folder first on PYTHONPATH and point ATTNSCOPE_HUB_KERNEL_DIR at any existing
directory (the local kernel folder attnscope looks for), e.g.
    PYTHONPATH=tests/hub_standin ATTNSCOPE_HUB_KERNEL_DIR=$(mktemp -d) \\
        python -m attnscope.profile compare --impl hub_flash_attn fused
"""

import importlib
from pathlib import Path

downloads = []  # repo ids passed to get_kernel
loaded = []  # (path, package) passed to get_local_kernel


def get_local_kernel(repo_path, package_name):
    if not Path(repo_path).is_dir():
        raise FileNotFoundError(f"no kernel directory at {repo_path}")
    loaded.append((Path(repo_path), package_name))
    return importlib.import_module(f"{__name__}.flash_attn")


def get_kernel(repo_id, *args, **kwargs):
    downloads.append(repo_id)
    return importlib.import_module(f"{__name__}.flash_attn")
