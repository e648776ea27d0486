"""Tier 2's inputs: the Triton kernels compiled in this process, by the name a trace shows.

Ours, FlexAttention's and inductor's kernels are compiled through different paths: ours through
Triton's JIT (its caches hold CompiledKernel objects), inductor's in worker processes whose
results this process launches through inductor's static launcher. `triton_verdicts()` finds
them all and judges each by its SASS (or PTX) with tensor_cores.triton_kernel_verdict.
"""

from __future__ import annotations

import gc
import warnings
from pathlib import Path
from types import SimpleNamespace

from attnscope.profile.tensor_cores import UNKNOWN, triton_kernel_verdict


def _kernels_in_jit_caches(fn) -> list:
    """Compiled kernels a JITFunction holds. Autotuner/Heuristics wrap it in `.fn`; triton 3.x
    keeps `device_caches[device] = (kernel_cache, key_cache, target, backend, binder)`, older
    versions `cache[device] = kernel_cache`. Async compiles leave futures there: skipped."""
    while not hasattr(fn, "device_caches") and not hasattr(fn, "cache") and hasattr(fn, "fn"):
        fn = fn.fn
    per_device = getattr(fn, "device_caches", None) or getattr(fn, "cache", None) or {}
    found = []
    for entry in list(per_device.values()):
        kernel_cache = entry[0] if isinstance(entry, tuple) else entry
        if isinstance(kernel_cache, dict):
            found += [k for k in list(kernel_cache.values()) if hasattr(k, "asm")]
    return found


def compiled_triton_kernels(jit_functions=None) -> dict[str, list]:
    """Compiled Triton kernels of this process by kernel name (the name a trace shows, e.g.
    `_attn_fwd`, `triton_tem_fused_0`). From the given JIT functions' caches, or, without them,
    every CompiledKernel still alive (ours, FlexAttention's and inductor's kernels are compiled
    through different paths, so asking the garbage collector is the one way to see them all).
    Inductor's static CUDA launcher (FlexAttention's and inductor's kernels, compiled in worker
    processes) keeps no CompiledKernel in this one, only a launcher that knows the kernel's name
    and hash: their cubin and PTX are read from Triton's cache, where the compile left them."""
    if jit_functions is not None:
        kernels = [k for fn in jit_functions for k in _kernels_in_jit_caches(fn)]
    else:
        try:
            from triton.compiler import CompiledKernel
        except ImportError:
            return {}
        kernels = []
        with warnings.catch_warnings():
            # Looking at every live object touches deprecated ones, whose warnings (torch's
            # `reduce_op`) say nothing about the run: not kept, not printed.
            warnings.simplefilter("ignore")
            for o in gc.get_objects():
                if _is_instance(o, CompiledKernel):
                    kernels.append(o)
                elif _is_static_launcher(o):
                    kernels.append(_from_triton_cache(o))
        kernels = [k for k in kernels if k is not None]
    by_name: dict[str, list] = {}
    for kernel in kernels:
        name = getattr(kernel, "name", None) or getattr(getattr(kernel, "metadata", None),
                                                        "name", None)
        if name:
            by_name.setdefault(name, []).append(kernel)
    return by_name


def _is_instance(obj, cls):
    # gc's objects include weakref proxies; isinstance on a dead one raises ReferenceError
    # (seen on the H200 with torch 2.11).
    try:
        return isinstance(obj, cls)
    except ReferenceError:
        return False


def triton_verdicts(names, jit_functions=None) -> dict[str, dict]:
    """Tier 2 for each trace kernel name that a Triton kernel compiled here carries. Autotuning
    compiles one variant per config under one name; all must agree, else "unknown"."""
    compiled = compiled_triton_kernels(jit_functions)
    out = {}
    for name in set(names) & set(compiled):
        variants = [triton_kernel_verdict(k) for k in compiled[name]]
        verdicts = {v["verdict"] for v in variants}
        verdict = verdicts.pop() if len(verdicts) == 1 else UNKNOWN
        evidence = "sass" if all(v["evidence"] == "sass" for v in variants) else "ptx"
        counts: dict[str, int] = {}
        for v in variants:
            for key, n in v["counts"].items():
                counts[key] = counts.get(key, 0) + n
        out[name] = {"verdict": verdict, "evidence": evidence, "counts": counts,
                     "variants": len(variants)}
    return out


def _is_static_launcher(obj) -> bool:
    # torch._inductor.runtime.static_triton_launcher.StaticallyLaunched*Kernel, by shape rather
    # than by import: the module moves between torch versions.
    try:
        return (type(obj).__name__.startswith("StaticallyLaunched")
                and isinstance(getattr(obj, "name", None), str)
                and isinstance(getattr(obj, "hash", None), str))
    except ReferenceError:
        return False


def _from_triton_cache(launcher):
    """A stand-in with `name` and `asm` ({"cubin", "ptx"}) for a statically launched kernel:
    the cubin it still holds, else the files Triton's cache keeps under the kernel's hash;
    None when neither is found."""
    asm = {}
    if isinstance(getattr(launcher, "cubin_raw", None), bytes):
        asm["cubin"] = launcher.cubin_raw
    try:
        from torch._inductor.runtime.cache_dir_utils import triton_cache_dir
        from torch._inductor.runtime.runtime_utils import triton_hash_to_path_key

        folder = Path(triton_cache_dir(0)) / triton_hash_to_path_key(launcher.hash)
    except (ImportError, AttributeError, TypeError, ValueError):
        folder = None
    for key, suffix in (("cubin", ".cubin"), ("ptx", ".ptx")):
        path = folder / f"{launcher.name}{suffix}" if folder else None
        if key not in asm and path is not None and path.is_file():
            asm[key] = path.read_bytes() if key == "cubin" else path.read_text()
    return SimpleNamespace(name=launcher.name, asm=asm) if asm else None
