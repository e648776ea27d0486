"""FlashAttention as users install it from pip: FlashAttention-4 (`fa4`) and flash-attn 2
(`flash_attn2`), the peers a Hopper user would pick instead of ours.

Both take [batch, seq, heads, dim] (BSHD) and K/V with fewer heads than Q (GQA/MQA) natively.
The registry hands [batch, heads, seq, dim] tensors; each forward passes BSHD *views* of them
(`q.transpose(1, 2)`). Both libraries need only the last dimension contiguous (they copy an input
only when its stride(-1) != 1) and read the other strides, so no copy runs, inside the timed
forward or outside it, and the output's autograd graph reaches the caller's q, k, v: bench's
`bwd`/`fwd_bwd` modes differentiate exactly the library's backward, nothing else.

Both packages install under the top-level name `flash_attn`. flash-attn 2 owns
`flash_attn/__init__.py`, which loads its CUDA extension (the top-level module
`flash_attn_2_cuda`); flash-attn-4 adds the subpackage `flash_attn.cute` (installed alone,
`flash_attn` is a namespace package). So whether each is installed is read off the file system
(`find_spec` of top-level names, never of `flash_attn.cute`, which would run flash-attn 2's
`__init__`), and the libraries are imported only on a CUDA machine whose GPU they support, when
`available` or `prepare` is called: importing them elsewhere can fail in ways other than
ImportError (no driver, a CUDA extension built for another torch), and is slow (FA4 loads the
CuTe DSL compiler). `available` never raises.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
from dataclasses import dataclass
from typing import Callable

import torch

from attnscope.attention.registry import Implementation, register

INSTALL_FA4 = "pip install attnscope[peers]"
# flash-attn 2 publishes no wheel on PyPI for every torch/CUDA pair; pip builds it from source
# against the torch already installed, which needs nvcc and the flag below.
INSTALL_FA2 = "a CUDA source build: pip install flash-attn --no-build-isolation"


def _spec(name: str):
    """importlib's spec for a top-level module, or None; never raises (a stand-in module in
    sys.modules without a __spec__ makes find_spec raise ValueError)."""
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None


def fa4_installed() -> bool:
    """Whether `flash_attn.cute` exists, found without importing `flash_attn`."""
    spec = _spec("flash_attn")
    locations = (spec.submodule_search_locations or ()) if spec else ()
    return any(os.path.isfile(os.path.join(loc, "cute", "__init__.py")) for loc in locations)


def fa2_installed() -> bool:
    """Whether flash-attn 2 is: a regular `flash_attn` package (flash-attn-4 alone leaves a
    namespace package, whose spec has no origin file) next to its extension `flash_attn_2_cuda`."""
    spec = _spec("flash_attn")
    regular = spec is not None and (spec.origin or "").endswith("__init__.py")
    return regular and _spec("flash_attn_2_cuda") is not None


def cuda_capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) of the CUDA device, or None without one."""
    try:
        if not torch.cuda.is_available():
            return None
        return torch.cuda.get_device_capability(device)
    except (RuntimeError, AssertionError):  # a driver that torch cannot talk to
        return None


def _version(distributions: tuple[str, ...]) -> str:
    for dist in distributions:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "(version unknown)"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def load(module: str):
    """`module.flash_attn_func`, or the reason it cannot be had. Import errors of every kind are
    reasons: a broken CUDA extension or compiler install must not end a listing or a sweep."""
    try:
        return importlib.import_module(module).flash_attn_func, None
    except Exception as exc:  # noqa: BLE001 -- see the docstring
        return None, f"{module} is installed but does not import ({_first_line(exc)})"


@dataclass(frozen=True)
class Peer:
    label: str  # how reasons name it
    module: str  # the module holding flash_attn_func
    distributions: tuple[str, ...]  # pip distribution names, for the version in the reason
    install: str  # how to install it
    installed: Callable[[], bool]
    gpus: str  # the GPUs it runs on, in words
    supports: Callable[[tuple[int, int]], bool]  # on (major, minor)
    # Its paged KV-cache call: the function, its (block table, per-sequence lengths) keyword
    # names, and the multiple of keys its pages must hold
    paged_func: str
    paged_args: tuple[str, str]
    page_multiple: int = 1
    # How its window_size says "unbounded" (flash-attn 2: -1; FA4: None, where a -1 would be a
    # bound)
    unbounded: int | None = -1

    def _options(self, causal, window, softcap) -> dict:
        """window_size= and softcap= keywords for a sliding window (left, right) in the
        registry's convention (-1 unbounded) and a softcap, those set only; with causal the
        right side is 0, which both libraries take."""
        options = {}
        if window is not None:
            left, right = window[0], 0 if causal else window[1]
            options["window_size"] = tuple(self.unbounded if w < 0 else w for w in (left, right))
        if softcap is not None:
            options["softcap"] = softcap
        return options

    def available(self, device) -> tuple[bool, str]:
        device = torch.device(device)
        installed = self.installed()
        if device.type != "cuda":
            extra = "" if installed else f"; not installed here either ({self.install})"
            return False, f"{self.label} runs on CUDA only{extra}"
        if not installed:
            return False, f"{self.label} is not installed ({self.install})"
        capability = cuda_capability(device)
        if capability is None:
            return False, "no CUDA device"
        if not self.supports(capability):
            major, minor = capability
            return False, f"{self.label} runs on {self.gpus}; this GPU is sm_{major}{minor}"
        func, why = load(self.module)
        if func is None:
            return False, why
        return True, f"{self.label} {_version(self.distributions)} ({self.module})"

    def _loaded(self, q):
        """flash_attn_func of a library that imports, for inputs it takes."""
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"{self.label} takes float16 or bfloat16 inputs; got {q.dtype}")
        func, why = load(self.module)
        if func is None:
            raise RuntimeError(why)
        return func

    def prepare(self, q, k, v, causal=True, window=None, softcap=None, **options):
        # causal=True is aligned bottom-right in both libraries when q_len < kv_len, and so is a
        # window; other options go to flash_attn_func as they are (fa4_deterministic's
        # deterministic=True).
        func = self._loaded(q)
        options.update(self._options(causal, window, softcap))

        def forward():
            # BSHD views, no copy (see the module docstring).
            out = func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal,
                       **options)
            return _output(out).transpose(1, 2)  # back to [batch, heads, seq, dim], a view
        return forward

    def prepare_varlen(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       causal=True, window=None, softcap=None):
        # Both libraries' flash_attn_varlen_func take (q, k, v, cu_seqlens_q, cu_seqlens_k,
        # max_seqlen_q, max_seqlen_k, ..., causal=, window_size=, softcap=) with the packed
        # layout the registry hands.
        func = self._function(q, "flash_attn_varlen_func")
        options = self._options(causal, window, softcap)
        return lambda: _output(func(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                    max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                    causal=causal, **options))

    def prepare_paged(self, q, k_cache, v_cache, block_table, cache_seqlens, causal=True,
                      window=None, softcap=None):
        # The registry's cache layout [num_blocks, page_size, kv_heads, head_dim] is both
        # libraries' (paged_func, paged_args); q as a BSHD view, the output back.
        func = self._function(q, self.paged_func)
        if k_cache.shape[1] % self.page_multiple:
            raise NotImplementedError(f"{self.label} takes pages of a multiple of "
                                      f"{self.page_multiple} keys, got {k_cache.shape[1]}")
        q_bshd = q.transpose(1, 2)
        paging = dict(zip(self.paged_args, (block_table, cache_seqlens)))
        paging.update(self._options(causal, window, softcap))
        return lambda: _output(func(q_bshd, k_cache, v_cache, causal=causal,
                                    **paging)).transpose(1, 2)

    def _function(self, q, name):
        """The library's function `name`, after _loaded's checks (the module imports)."""
        self._loaded(q)
        func = getattr(importlib.import_module(self.module), name, None)
        if func is None:
            raise NotImplementedError(f"this version of {self.module} has no {name}")
        return func


def _output(result):
    # FA4 returns (out, lse) in some versions, out in others; the output comes first.
    return result[0] if isinstance(result, tuple) else result


FA4 = Peer(
    label="FlashAttention-4", module="flash_attn.cute",
    distributions=("flash-attn-4", "flash-attn-cute"), install=INSTALL_FA4,
    installed=fa4_installed,
    # Its CuTe kernels exist for Hopper (FlashAttentionForwardSm90/BackwardSm90) and Blackwell
    # (Sm100); its interface refuses other architectures.
    gpus="Hopper (sm_90) and Blackwell (sm_100) GPUs", supports=lambda cap: cap[0] in (9, 10),
    # its varlen function takes a batch-shaped q with a page table
    paged_func="flash_attn_varlen_func", paged_args=("page_table", "seqused_k"),
    unbounded=None)

FA2 = Peer(
    label="flash-attn 2", module="flash_attn",
    distributions=("flash-attn", "flash_attn"), install=INSTALL_FA2,
    installed=fa2_installed,
    gpus="Ampere or newer GPUs (sm_80+)", supports=lambda cap: cap[0] >= 8,
    paged_func="flash_attn_with_kvcache", paged_args=("block_table", "cache_seqlens"),
    page_multiple=256)

for _name, _peer, _description in (
    ("fa4", FA4, "FlashAttention-4 (pip flash-attn-4): CuTe DSL kernels, compiled on the first "
     "call per configuration; layout [batch, seq, heads, dim]"),
    ("flash_attn2", FA2, "flash-attn 2 (pip flash-attn): CUTLASS kernels on mma.sync; layout "
     "[batch, seq, heads, dim]"),
):
    register(Implementation(
        name=_name,
        description=_description,
        seed_script="",  # the blog has no script for either
        available=_peer.available,
        prepare=_peer.prepare,
        gqa=True,
        q_len_differs=True,
        prepare_varlen=_peer.prepare_varlen,
        prepare_paged=_peer.prepare_paged,
        # window_size= and softcap= of every function above, in both libraries
        sliding_window=True,
        softcap=True,
    ))


def _prepare_fa4_deterministic(q, k, v, causal=True, window=None, softcap=None):
    return FA4.prepare(q, k, v, causal=causal, window=window, softcap=softcap,
                       deterministic=True)


# FA4's backward adds dQ in whatever order its programs run unless deterministic=True (then its
# dQ writer waits its turn on a semaphore, and under GQA dK/dV too): the peer to read beside our
# deterministic default. Its forward is fa4's (backward_variant_of); no packed or paged form.
register(Implementation(
    name="fa4_deterministic",
    description="FlashAttention-4 with deterministic=True: the same forward; a backward "
                "reproducible bit for bit (dQ, and under GQA dK/dV, added in a fixed order)",
    seed_script="",
    available=FA4.available,
    prepare=_prepare_fa4_deterministic,
    backward_variant_of="fa4",
    gqa=True,
    q_len_differs=True,
    sliding_window=True,
    softcap=True,
))
