"""The Gluon API of the Triton installed, as attention_fwd_hopper.py and
attention_bwd_hopper.py need it.

Gluon (triton.experimental.gluon) is experimental and renames things between releases. The
Hopper kernel was written against Triton 3.6; 3.7 takes it unchanged; 3.9 renamed the TMA copies
(`tma.async_copy_global_to_shared` -> `tma.async_load`, `tma.async_copy_shared_to_global` ->
`tma.async_store`) and kept the old names as stubs that raise when a kernel calls them, so the
new names are chosen wherever they exist. Choices go by what the installed Gluon has, never by
its version string, and `missing()` names what the kernel needs and this Triton lacks, so the
dispatch can keep the Triton kernel (and say why) instead of failing at the first compile.
"""

import inspect

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia import hopper
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
except ImportError:  # no Gluon, or one without the Hopper module: missing() says so
    gluon = gl = hopper = mbarrier = tma = None

if tma is not None and hasattr(tma, "async_load"):  # Triton >= 3.9
    tma_load, tma_store = tma.async_load, tma.async_store
else:  # Triton 3.6, 3.7
    tma_load = getattr(tma, "async_copy_global_to_shared", None)
    tma_store = getattr(tma, "async_copy_shared_to_global", None)

# The copy engine's reduce-add of a shared-memory tile into global memory (the non-deterministic
# fused dQ of attention_bwd_hopper.py): tma.async_atomic_add from Triton 3.9; 3.6 and 3.7 have
# the op (ttng.async_tma_reduce, which tl's descriptor atomic_add lowers to) in their IR builder
# but Gluon does not name it, so it is made there. None where neither is found: the backward
# then keeps its deterministic kernels.
tma_add = getattr(tma, "async_atomic_add", None)
if tma is not None and tma_add is None:
    try:
        from triton._C.libtriton import ir as _ir
        from triton.experimental.gluon.language._core import builtin as _builtin

        _ADD = _ir.DESCRIPTOR_REDUCE_KIND.ADD

        @_builtin
        def tma_add(tensor_desc, coord, src, _semantic=None):
            """Add the shared-memory tile src into global memory at coord by the copy engine
            (cp.reduce.async.bulk.tensor ... add); tma.store_wait waits for it as for a store."""
            coord = _semantic._convert_to_ir_values(coord, require_i64=False)
            _semantic.builder.create_async_tma_reduce(_ADD, tensor_desc.handle, coord,
                                                      src.handle)
    except (ImportError, AttributeError):
        tma_add = None


# A barrier of the calling partition's threads (bar.sync over its warps): gl.thread_barrier in
# Triton 3.6, gl.barrier from 3.7.
partition_barrier = getattr(gl, "barrier", None) or getattr(gl, "thread_barrier", None)


def missing():
    """What the Hopper kernel uses and the installed Triton lacks, as a list of names (empty:
    the kernel can compile here)."""
    if tma is None:
        return ["triton.experimental.gluon.language.nvidia.hopper"]
    needed = {
        "gluon.jit": gluon, "gl.warp_specialize": gl, "gl.NVMMADistributedLayout": gl,
        "gl.NVMMASharedLayout": gl, "gl.DotOperandLayout": gl, "gl.SliceLayout": gl,
        "gl.allocate_shared_memory": gl, "gl.convert_layout": gl, "gl.static_range": gl,
        "gl.BlockedLayout": gl, "gl.SwizzledSharedLayout": gl, "gl.atomic_add": gl,
        "gl.num_programs": gl,
        "hopper.warpgroup_mma": hopper, "hopper.warpgroup_mma_wait": hopper,
        "hopper.fence_async_shared": hopper, "mbarrier.MBarrierLayout": mbarrier,
        "mbarrier.init": mbarrier, "mbarrier.wait": mbarrier, "mbarrier.expect": mbarrier,
        "mbarrier.arrive": mbarrier, "tma.make_tensor_descriptor": tma, "tma.store_wait": tma,
    }
    gone = [name for name, module in needed.items()
            if not hasattr(module, name.split(".", 1)[1])]
    if partition_barrier is None:
        gone.append("gl.barrier (or 3.6's gl.thread_barrier)")
    if tma_load is None or tma_store is None:
        gone.append("tma.async_load/async_store (or 3.6's async_copy_* names)")
    # warp_specialize takes one list of (function, args) pairs, the default partition first,
    # since 3.6; 3.5 took the default partition and the workers as separate arguments.
    if "gl.warp_specialize" not in gone:
        params = list(inspect.signature(_unwrapped(gl.warp_specialize)).parameters)
        if params[:2] != ["functions_and_args", "worker_num_warps"]:
            gone.append("gl.warp_specialize(functions_and_args, worker_num_warps, ...)")
    return gone


def _unwrapped(fn):
    return getattr(fn, "__wrapped__", fn)
