"""The one dispatch of the fused attention kernels: which kernel runs a call, and its launch.

`attention_fwd` runs the Gluon kernel (attention_fwd_hopper.py) where `uses_hopper_kernel` says
so and the Triton kernel (attention_fwd.py) everywhere else; `attention_bwd` is the backward
(attention_bwd.py: its Triton kernels, or the Gluon ones of attention_bwd_hopper.py where they
take the call). `launched_forward_kernels` lists the compiled forward kernels the
eager calls ran, for the registry's `fused` entry. attention/fused.py is this module's only
caller; everything else calls the op. The decode route (attention_decode.py) is chosen before
this module, in fused.py's `_forward`, and a remembered eager call (fused.py's `_repeats`) runs
its kept launch without coming here.
"""

import functools
import importlib.util
import os
import warnings

import triton

from attnscope.kernels import attention_fwd as triton_fwd
from attnscope.kernels.attention_bwd import attention_bwd
from attnscope.kernels.common import device_properties, interpreter_ready, is_interpreted
from attnscope.kernels.launch import FORWARD_LAUNCHES, forget_launches, launch_table, launched

__all__ = ["attention_fwd", "attention_bwd", "uses_hopper_kernel", "launched_forward_kernels",
           "forget_launches", "launch_table", "interpreter_ready", "is_interpreted"]

# The forward kernels launched_forward_kernels lists, and the modules that define them.
KERNEL_MODULES = {"_attn_fwd": "attnscope.kernels.attention_fwd",
                  "_attn_fwd_hopper": "attnscope.kernels.attention_fwd_hopper"}


@functools.cache
def _hopper():
    # The Gluon kernel module, or None where this Triton's Gluon lacks what it uses (Gluon is
    # experimental and its API changes between releases; gluon_compat maps the renames known):
    # then the Triton kernel runs, and the first sm_90 call says once what was lost.
    from attnscope.kernels import gluon_compat
    lacking = gluon_compat.missing()
    if not lacking:
        try:
            from attnscope.kernels import attention_fwd_hopper
            return attention_fwd_hopper
        except Exception as e:  # noqa: BLE001 (any failure: keep the Triton kernel)
            lacking = [f"{type(e).__name__}: {e}"]
    warnings.warn(f"attnscope: Triton {triton.__version__}'s Gluon lacks {', '.join(lacking)}; "
                  "the Hopper (sm_90) attention forward falls back to the Triton kernel (~30 % "
                  "slower at head_dim 128 on the H200)", RuntimeWarning)
    return None


def uses_hopper_kernel(q, k, v, out, scale, window=(-1, -1), softcap=0.0, varlen=None):
    """True when an eager forward of these tensors runs the Gluon Hopper kernel
    (attention_fwd_hopper.py) instead of the Triton one: an sm_90 GPU, a Triton whose Gluon has
    what that kernel uses (gluon_compat), a positive scale (that kernel masks before scaling)
    and the inputs it takes (its `supports`, packed sequences included: `varlen` as
    attention_fwd's); sliding windows and softcaps too (`window` and `softcap` as
    attention_fwd's), which the kernel takes as the Triton one does."""
    if (not q.is_cuda or is_interpreted() or not scale > 0
            or device_properties(q.device).major != 9):
        return False
    hopper = _hopper()
    return hopper is not None and hopper.supports(q, k, v, out, varlen)


def attention_fwd(q, k, v, out, lse, *, causal, scale, causal_offset, window=(-1, -1),
                  softcap=0.0, varlen=None, wrap=None, kept=False):
    """Launch the forward. q, out: [batch, heads, q_len, head_dim] views with any strides;
    k, v: [batch, kv_heads, kv_len, head_dim]; lse: contiguous fp32 [batch, heads, q_len], or
    None where the call wants no LSE (the kernels then store none; an eager inference call).
    `window`, `softcap` and `varlen` (packed sequences) as attention_fwd.attention_fwd_triton's.
    `wrap` lets the custom op pass torch.library.wrap_triton so torch.compile sees the launch
    (always the Triton kernel).
    Returns what the launch returns (the compiled kernel, when called eagerly); with kept=True
    (an eager call) the launch kept under the call's key instead (launch._Bound: called with the
    five tensors of a call with the same shapes, strides, dtypes and alignment, it launches this
    call's kernel with every other argument), or None where none was kept (the interpreter, a
    Triton whose launcher the direct call does not fit): the op remembers it (fused._repeats).

    An eager call is looked up first by what fixes the kernel, its config and every argument
    but the five tensors: a repeat launches at once (launch._Bound), skipping the choice of
    kernel and the argument building. (Not a packed batch the Gluon kernel runs: each of its
    launches takes a fresh tile counter, so it goes through attention_fwd_hopper every call,
    whose own kept launch then skips Triton's dispatch.) Call it with q's device current (the
    op makes it so): a kept launch belongs to the device that was current at its first call."""
    if wrap is not None:
        return triton_fwd.attention_fwd_triton(q, k, v, out, lse, causal=causal, scale=scale,
                                               causal_offset=causal_offset, window=window,
                                               softcap=softcap, varlen=varlen, wrap=wrap)
    key = triton_fwd.launch_key(q, k, v, out, lse, causal, causal_offset, scale, window, softcap,
                                varlen)
    bound = FORWARD_LAUNCHES.get(key)
    if bound is not None:
        lse_arg = out if lse is None else lse  # (the kernels' Lse: never written without one)
        result = bound((q, k, v, out, lse_arg) if varlen is None else
                       (q, k, v, out, lse_arg, *varlen[:2]))
    elif uses_hopper_kernel(q, k, v, out, scale, window, softcap, varlen):
        result = _hopper().attention_fwd_hopper(q, k, v, out, lse, causal=causal, scale=scale,
                                                causal_offset=causal_offset, window=window,
                                                softcap=softcap, varlen=varlen, key=key)
    else:
        result = triton_fwd.attention_fwd_triton(q, k, v, out, lse, causal=causal, scale=scale,
                                                 causal_offset=causal_offset, window=window,
                                                 softcap=softcap, varlen=varlen, key=key)
    return FORWARD_LAUNCHES.get(key) if kept else result


def launched_forward_kernels():
    """The compiled forward kernels (the Triton `_attn_fwd`, the Gluon `_attn_fwd_hopper`) the
    eager launches ran in this process, the most recently used first, each as a dict: name,
    source_path (relative to the repository root), source (that file's text), config (the
    launch config, named), compiled (Triton's compiled kernel object). Empty in the
    interpreter, which compiles nothing. Kernels launched under torch.compile are inductor's
    and are not listed."""
    records = []
    for name, compiled, config in launched():
        if name not in KERNEL_MODULES:
            continue
        path = _source_file(name)
        records.append(dict(name=name, source_path=_repository_path(path),
                            source=_read(path), config=dict(config or {}), compiled=compiled))
    return records


def _source_file(name):
    # The file that defines the kernel, found without importing it (the Gluon module is not
    # imported on a Triton it was not written for).
    return importlib.util.find_spec(KERNEL_MODULES[name]).origin


def _repository_path(path):
    # attnscope/kernels/x.py, as a reader finds it in the repository
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.path.relpath(path, package_root).replace(os.sep, "/")


@functools.cache
def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()
