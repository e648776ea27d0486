"""attnscope's fused attention: the public op and its validation.

The kernels are in attnscope/kernels/: `_forward` sends calls of a few queries to the split-KV
decode kernel, and dispatch.py picks the Triton or the Gluon kernel for the others. This module
checks inputs, names the layouts, remembers eager calls' launches (`_repeats`) and registers the
launches as PyTorch custom ops so torch.compile traces them whole. Its registry entry for the
driver is attention/ours.py.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import math

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.autograd import forward_ad
from torch.library import triton_op, wrap_triton


DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LAYOUTS = {"bhsd": "[batch, heads, seq, head_dim]", "bshd": "[batch, seq, heads, head_dim]"}
ALIGNMENTS = ("top_left", "bottom_right")
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
# The largest scale or softcap the kernels take: they compute in float32, with the scores in log2
# units (times log2 e), which must stay finite there.
MAX_SCALE = torch.finfo(torch.float32).max / math.log2(math.e)


_kernel_module = None


def _kernels():
    # Imported on first use: importing the package should not compile-check Triton source, and
    # a process that never calls the op never needs it.
    global _kernel_module
    if _kernel_module is None:
        _kernel_module = importlib.import_module("attnscope.kernels.dispatch")
    return _kernel_module


@functools.cache
def _decode_kernels():
    return importlib.import_module("attnscope.kernels.attention_decode")


def _validate_causal_and_scale(causal, scale):
    # (also the varlen and decode functions', attention/varlen.py and decode.py)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    # (comparisons, not math.isfinite: a float torch.compile made symbolic cannot take it)
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or scale != scale or abs(scale) == math.inf):
        raise TypeError(f"scale must be a finite float or None, got {scale!r}")
    if scale is not None and not 0 <= scale <= MAX_SCALE:
        # The forward kernels take a block's row maximum of the unscaled scores and scale it
        # (as flash-attn's do), which a negative scale would make the row's minimum.
        raise ValueError(f"scale must be >= 0 and at most {MAX_SCALE:.3g} (the kernels scale "
                         f"scores in float32), got {scale!r}")


def _validate(q, k, v, causal, scale, layout, causal_alignment):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.layout is not torch.strided:
            raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {sorted(LAYOUTS)}, got {layout!r}")
    if not isinstance(causal_alignment, str) or causal_alignment not in ALIGNMENTS:
        raise ValueError(f"causal_alignment must be one of {ALIGNMENTS}, got {causal_alignment!r}")
    _validate_causal_and_scale(causal, scale)
    expected = LAYOUTS[layout]
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D {expected} for layout={layout!r}, "
                             f"got shape {tuple(t.shape)}")
    if q.dtype not in DTYPES:
        raise TypeError(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    seq, heads = (2, 1) if layout == "bhsd" else (1, 2)  # dims read in place: no views built
    qb, qh, ql, qd = q.shape[0], q.shape[heads], q.shape[seq], q.shape[3]
    kb, kh, kl, kd = k.shape[0], k.shape[heads], k.shape[seq], k.shape[3]
    if kb != qb:
        raise ValueError(f"q and k/v must have the same batch size, got {qb} and {kb}")
    if kd != qd:
        raise ValueError(f"q and k/v must have the same head_dim, got {qd} and {kd}")
    if not MIN_HEAD_DIM <= qd <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be between {MIN_HEAD_DIM} and {MAX_HEAD_DIM}, got {qd}")
    if kh == 0 or qh % kh:
        raise ValueError(f"q heads must be a multiple of k/v heads (GQA/MQA), got {qh} q heads "
                         f"and {kh} k/v heads")
    if min(qb, qh, ql, kl) == 0:
        raise ValueError(f"batch, heads and sequence lengths must be >= 1, got q "
                         f"{tuple(q.shape)} and k/v {tuple(k.shape)} in layout {layout!r}")
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"q, k, v must be CUDA tensors (or CPU with TRITON_INTERPRET=1), got "
                         f"{q.device}")


def _validate_window_softcap(causal, window, softcap, reach):
    """Checks window=(left, right) and softcap (the three APIs take them); returns the window as
    a tuple of two ints, a side of `reach` keys or more as -1. reach: the call's queries plus its
    keys (a sequence's, at most), past which a side hides nothing; so the kernels' 32-bit offsets
    never meet sizes near 2^31 (INT32_MAX as "unbounded" wrapped there)."""
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or any(isinstance(w, bool) or not isinstance(w, int) for w in window)):
        raise TypeError(f"window must be a (left, right) pair of ints, got {window!r}")
    left, right = window
    if left < -1 or right < -1:
        raise ValueError(f"window sizes must be >= 0, or -1 for unbounded, got {tuple(window)}")
    if causal and right > 0:
        raise ValueError(f"window={tuple(window)} with causal=True: a causal mask hides every key "
                         f"right of the diagonal, so the window's right size must be 0 or -1; "
                         f"pass causal=False for a window that looks {right} keys ahead")
    if (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
            or not 0 <= softcap <= MAX_SCALE):  # (NaN and inf fail the range: no isfinite)
        raise ValueError(f"softcap must be a finite float >= 0 (0: off) and at most "
                         f"{MAX_SCALE:.3g}, got {softcap!r}")
    return tuple(-1 if side >= reach else int(side) for side in (left, right))


def _as_bhsd(t, layout):
    # b s h d -> b h s d, a view (transpose, not einops: a few us less per tensor per call)
    return t if layout == "bhsd" else t.transpose(1, 2)


def _empty(like, shape, dtype):
    """A new uninitialized tensor of `shape` and `dtype` on like's device, contiguous: the one
    place outputs are allocated (tests replace it with a NaN fill to prove that the kernel
    writes every element). For a plain tensor `like`, Python's cheaper ways (side by side on
    the H200 machine's host, two jobs: torch.empty 5.0-8.4 us, Tensor.new_empty 3.6-6.2,
    torch.empty_like 1.8-3.7): empty_like where `like` has that shape and dtype and is
    contiguous, else new_empty. A subclass (a Parameter, a fake tensor while tracing) gets
    torch.empty, whose result is a plain tensor."""
    if type(like) is not torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=like.device)
    if like.dtype == dtype and like.shape == shape and like.is_contiguous():
        return torch.empty_like(like, memory_format=torch.contiguous_format)
    return like.new_empty(shape, dtype=dtype)


def _on_device(device):
    # Triton launches on the current CUDA device; inputs may live on another one. The context
    # only when they do: entering it costs ~2-3 us of host time per call on the H200's host.
    if device.type == "cuda" and device.index != torch._C._cuda_getDevice():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def _shapes_only(kernels, t):
    """True when an interpreted kernel is being traced: the call can then only give shapes.

    wrap_triton elides compiled launches on fake tensors but hands interpreted kernels back
    unwrapped, and those would read fake data pointers. Returning unwritten buffers is right for
    dynamo's shape propagation (backend="eager" then runs the real op), and wrong for AOT tracing
    (aot_eager, inductor), which would bake the buffers into the graph: that case is refused.
    """
    if not (kernels.is_interpreted() and is_fake(t)):
        return False
    if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None:
        raise NotImplementedError(
            "torch.compile with an AOT backend (aot_eager, inductor) cannot trace kernels running "
            "in the Triton interpreter: on CPU use torch.compile(backend='eager'), or use CUDA")
    return True


def _traced(t):
    """True when the op is being traced or intercepted rather than run: dynamo (torch.compile,
    compiled autograd), a dispatch mode (fake, proxy, functionalization, or a user's such as
    FlopCounterMode), a torch.func transform, or fake tensors. Those calls take the custom ops,
    which such machinery sees as one op. (The cheap checks come first: this runs on every
    eager call. The dispatch-mode stack's length counts the infra modes too, fake, proxy and
    functional: tests/test_fused_attention.py checks that it does.)"""
    return (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0
            or torch._C._functorch.peek_interpreter_stack() is not None
            or (type(t) is not torch.Tensor and is_fake(t)))  # fakes are Tensor subclasses


def _values_readable(t):
    """True when the host may read t's values (the CPU checks of lengths and block tables): a
    real tensor outside dynamo, torch.func transforms and the tracing modes (fake, proxy,
    functionalization). A user's dispatch mode (FlopCounterMode) runs on real values, so its
    calls are checked as plain ones."""
    return not (torch.compiler.is_compiling() or is_fake(t)
                or torch._C._functorch.peek_interpreter_stack() is not None
                or any(torch._C._get_dispatch_mode(key) is not None
                       for key in (torch._C._TorchDispatchModeKey.FAKE,
                                   torch._C._TorchDispatchModeKey.PROXY,
                                   torch._C._TorchDispatchModeKey.FUNCTIONAL)))


def _refuse_forward_ad(name, *tensors):
    """Forward-mode AD (torch.func.jvp and jacfwd, torch.autograd.forward_ad's dual tensors)
    has no formula in the ops: a tangent on an input would come out as a zero tangent, so such
    a call raises instead. Cheap where no dual level is open (a module global; every eager call
    runs this)."""
    if getattr(forward_ad, "_current_level", 0) >= 0 and any(
            forward_ad.unpack_dual(t).tangent is not None for t in tensors
            if isinstance(t, torch.Tensor)):
        raise NotImplementedError(
            f"{name} has no forward-mode derivative (torch.func.jvp, jacfwd, "
            f"torch.autograd.forward_ad)")


def _custom_op_call(name, op, *args):
    """op(*args), a custom op of a traced call. torch.func's grad and jacrev cannot
    differentiate it through its tensors (PyTorch runs its registered autograd as an
    autograd.Function without the setup_context those transforms ask for): that call gets a
    NotImplementedError saying so instead of PyTorch's message (a transform over other inputs,
    or vmap, runs as before). Under dynamo the op is called as it is."""
    if torch.compiler.is_compiling():
        return op(*args)
    try:
        return op(*args)
    except RuntimeError as exc:
        if "setup_context" not in str(exc):
            raise
        raise NotImplementedError(
            f"{name} cannot be differentiated by torch.func transforms (grad, jacrev) through "
            f"its tensors: its custom op's autograd is registered for torch.autograd; use "
            f"torch.autograd.grad or .backward() instead") from None


def _launch_wrap(t):
    """wrap_triton while the op body is traced, else None: on real tensors the body launches
    directly, through FastLaunch (Triton's per-call dispatch once per argument signature), and
    may take the Gluon kernel."""
    return wrap_triton if _traced(t) else None


def _check_interpreter(kernels, q):
    # For CPU tensors. Checked in the op body rather than in _validate: this body is not traced
    # by dynamo.
    if not kernels.interpreter_ready():
        raise ValueError("q, k, v are CPU tensors but the Triton interpreter is off: move them to "
                         "a CUDA device, or start Python with TRITON_INTERPRET=1 (Triton reads it "
                         "when it is first imported)")
    if q.dtype == torch.bfloat16:
        raise TypeError("bfloat16 is not supported on CPU: the Triton interpreter's tl.dot is "
                        "wrong for bf16 (it multiplies raw bits; triton issue #11584). Use float16 "
                        "or float32 on CPU, bfloat16 on CUDA")


def _outputs(q, k, v, layout, lse=True, views=True):
    # The output, allocated contiguous in the caller's layout, its fp32 LSE [batch, heads,
    # q_len] (None without `lse`: an inference call that returns none, whose kernel then
    # stores none; one allocation less, ~2-6 us of host time), and with `views` (q, k, v, out)
    # as the [batch, heads, seq, head_dim] views the kernels see, whatever their strides (else
    # None).
    out = _empty(q, q.shape, q.dtype)
    lse_shape = q.shape[:-1] if layout == "bhsd" else (q.shape[0], q.shape[2], q.shape[1])
    if views:
        views = ((q, k, v, out) if layout == "bhsd"  # (no generator: ~0.7 us a call on the CPU)
                 else tuple(_as_bhsd(t, layout) for t in (q, k, v, out)))
    return out, _empty(q, lse_shape, torch.float32) if lse else None, views or None


def _forward(q, k, v, causal, scale, bottom_right, layout, window_left=-1, window_right=-1,
             softcap=0.0, wrap=None, repeat_key=None, lse=True):
    # Eager calls at small shapes are bound by this function's host time (benchmarks/
    # host_cost.py), so it reads the device once. repeat_key: fused_attention's _repeat_key of
    # a validated eager call, under which its launch is remembered (_repeats). lse=False: the
    # call returns no LSE (an eager inference call), so the kernels store none and the
    # returned lse is None (not on the decode route, whose kernel writes one).
    kernels = _kernels()
    device = q.device
    if device.type == "cpu":
        _check_interpreter(kernels, q)
    q_len = q.shape[2] if layout == "bhsd" else q.shape[1]
    # Eager CUDA inference with few queries: the split-KV decode kernel (all q heads of a KV head
    # in one program, keys split over programs) instead of one program per query block and head.
    # Its window is aligned bottom-right: a top-left window (or mask) takes the prefill kernel.
    # (Decided first: these calls are the most host-bound, and never traced.)
    if (wrap is None and device.type == "cuda" and q_len <= _decode_kernels().MAX_Q_LEN
            and (bottom_right or not causal and window_left == window_right == -1)
            and not (q.requires_grad or k.requires_grad or v.requires_grad)
            and k.shape[0] * k.shape[1 if layout == "bhsd" else 2]
            <= _decode_kernels().MAX_GROUPS):
        out, lse, (q4, k4, v4, out4) = _outputs(q, k, v, layout)
        with _on_device(device):
            launched = _decode_kernels().attention_decode(
                q4, k4, v4, out4, lse, causal=causal, scale=scale,
                window=(window_left, window_right), softcap=softcap, kept=repeat_key is not None)
        if repeat_key is not None:  # its kept launch, else (no direct launcher) the call again
            _remember(repeat_key, _repeat(layout, launched[2]) if launched[2] is not None else
                      _repeat(layout, functools.partial(_decode_kernels().attention_decode,
                                                        causal=causal, scale=scale), views=True))
        return out, lse
    out, lse, (q4, k4, v4, out4) = _outputs(q, k, v, layout, lse)
    offset = k4.shape[2] - q_len if bottom_right else 0
    if _shapes_only(kernels, q):
        return out, lse
    with _on_device(device):
        kept = kernels.attention_fwd(q4, k4, v4, out4, lse, causal=causal, scale=scale,
                                     causal_offset=offset, window=(window_left, window_right),
                                     softcap=softcap, wrap=wrap, kept=repeat_key is not None)
    if repeat_key is not None and kept is not None:
        _remember(repeat_key, _repeat(layout, lambda *tensors: kept(tensors), lse is not None))
    return out, lse


# ---- eager repeats --------------------------------------------------------------------------
# An eager call (nothing traced; inference, or training under _EagerAttention) whose
# _repeat_key matches one that passed _validate and launched (`_repeats`) runs that call's
# launch again: its allocations (one, or two with an LSE) and the kept launch, without the
# checks, the dispatch and its launch key (benchmarks/host_cost.py: the public op's host time
# at small shapes, where it bounds the call). Windowed and softcapped
# calls of the op, and any whose inputs are not plain tensors, take the full path every time.
# The table also holds remembered backwards (_backward_key) and fused_attention_with_kvcache
# calls (decode.py's _repeat_key); each kind's keys start differently.

_repeats = None  # key -> its run(...); a launch table (forget_launches clears it), made on use
MAX_REPEATS = 256  # as many as the launch table keeps (launch.FastLaunch.MAX_KEYS)


def _repeat_key(q, k, v, causal, scale, layout, causal_alignment, window, softcap, return_lse):
    """What _validate reads of a call and what fixes its kernel and launch: shapes, strides,
    dtypes, devices, 16-byte alignment, whether an input requires grad (_forward keeps those
    calls off the decode route, with grad mode on or off; they store an LSE for the backward)
    and the arguments (return_lse: whether the call returns the LSE; a call that neither
    returns one nor has inputs that require grad stores none). None for a call
    that takes the full path every time: a window or softcap, a tensor layout other than
    strided, or an argument of a type _validate may refuse (a bool scale equals an int one in a
    key; only the int passes)."""
    if (q.layout is not torch.strided or k.layout is not torch.strided
            or v.layout is not torch.strided  # (a nested tensor's strides raise)
            or type(window) is not tuple or window != (-1, -1) or type(causal) is not bool
            or not (type(softcap) is float or type(softcap) is int) or softcap != 0
            or type(layout) is not str or type(causal_alignment) is not str
            or not (scale is None or type(scale) is float or type(scale) is int)):
        return None
    return (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype,
            v.dtype, q.device, k.device, v.device, q.data_ptr() % 16 == 0,
            k.data_ptr() % 16 == 0, v.data_ptr() % 16 == 0,
            q.requires_grad or k.requires_grad or v.requires_grad, causal, scale, layout,
            causal_alignment, bool(return_lse))


def _remembered(key):
    """The run remembered under `key` (None for a key of None or one not remembered)."""
    return _repeats.get(key) if key is not None and _repeats is not None else None


def _remember(key, run):
    global _repeats
    if _repeats is None:
        _repeats = _kernels().launch_table()
    if len(_repeats) >= MAX_REPEATS:
        _repeats.clear()
    _repeats[key] = run


def _repeat(layout, launch, lse=True, views=False):
    # A remembered call: its outputs allocated as _forward does (the LSE only with `lse`), then
    # launch(q, k, v, out, lse) (out in the LSE's place without one: the kept launch stores
    # none). A kept launch (launch._Bound, or the decode kernel's _repeat_launch) reads its
    # tensors' data pointers only, their strides being the first call's (the key fixes them), so
    # it takes the caller's tensors: no [batch, heads, seq, head_dim] views of bshd ones (~5 us a
    # call of four views on the CPU machine, host_cost.py's stubs). With `views` (the decode
    # kernel's full launch, where no launch was kept) it takes those views.
    def run(q, k, v):
        device = q.device
        out, lse_out, bhsd = _outputs(q, k, v, layout, lse, views)
        with _on_device(device):
            if views:
                launch(*bhsd, bhsd[3] if lse_out is None else lse_out)
            else:
                launch(q, k, v, out, out if lse_out is None else lse_out)
        return out, lse_out
    return run


@triton_op("attnscope::attention_fwd", mutates_args=())
def _attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                   bottom_right: bool, layout: str, window_left: int = -1, window_right: int = -1,
                   softcap: float = 0.0, deterministic: bool = True
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """What torch.compile, dispatch modes and torch.func see (`_traced`). Eager calls skip it:
    inference calls _forward directly and training goes through _EagerAttention, because the
    dispatcher round trip of a Python custom op costs more host time than the seed-shape kernel
    itself (notes/launch.md; notes/backward.md, "The launch path"). `deterministic` is the
    backward's (saved by _setup_context)."""
    return _forward(q, k, v, causal, scale, bottom_right, layout, window_left, window_right,
                    softcap, wrap=_launch_wrap(q))



# ---- autograd: the backward op and its registration on the forward --------------------------
# Gradients flow to q, k, v through `out`; the LSE output is marked non-differentiable (it is
# saved for the backward, not a quantity the formula below differentiates).

def _gradients(dout, q, k, v, out, lse, layout):
    # dq, dk, dv, allocated contiguous in the caller's layout like the forward's output, then
    # the ten tensors the backward kernels take, as [batch, heads, seq, head_dim] views but the
    # LSE and Delta (rowsum(dO * O), scratch).
    dq, dk, dv = _empty(q, q.shape, q.dtype), _empty(k, k.shape, k.dtype), _empty(v, v.shape,
                                                                                 v.dtype)
    q4, k4, v4, out4, dout4, dq4, dk4, dv4 = (_as_bhsd(t, layout)
                                              for t in (q, k, v, out, dout, dq, dk, dv))
    delta = _empty(q, q4.shape[:-1], torch.float32)
    return (dq, dk, dv), (dout4, q4, k4, v4, out4, lse, dq4, dk4, dv4, delta)


def _backward_impl(dout, q, k, v, out, lse, causal, scale, bottom_right, layout, window_left=-1,
                   window_right=-1, softcap=0.0, deterministic=True, repeat_key=None):
    # The backward op's body, also run directly by _EagerAttention. repeat_key: its
    # _backward_key of an eager call, under which its kept launches are remembered. The kernels
    # read the LSE as contiguous: a saved-tensor hook may have handed it back in other strides.
    kernels = _kernels()
    lse = lse.contiguous()
    grads, tensors = _gradients(dout, q, k, v, out, lse, layout)
    q_len, kv_len = tensors[1].shape[2], tensors[2].shape[2]
    if _shapes_only(kernels, q):
        return grads
    with _on_device(q.device):
        kept = kernels.attention_bwd(*tensors, causal=causal, scale=scale,
                                     causal_offset=kv_len - q_len if bottom_right else 0,
                                     window=(window_left, window_right), softcap=softcap,
                                     wrap=_launch_wrap(q), deterministic=deterministic,
                                     kept=repeat_key is not None)
    if repeat_key is not None and kept is not None:
        _remember(repeat_key, _backward_repeat(layout, kept))
    return grads


def _backward_key(dout, q, k, v, out, lse, attention_args):
    """What fixes an eager backward's kernels and launch arguments besides its tensors, as
    _repeat_key does for the forward: the shapes, strides, dtypes, devices and 16-byte alignment
    of dO, q, k, v and of the saved output and LSE (the op's own allocations, unless a
    saved-tensor hook moved them), the call's arguments (scale, alignment, window, softcap and
    deterministic among them), and whether deterministic algorithms are forced. The gradients
    and Delta are allocated here, contiguous and aligned, so q's shape and the layout fix
    theirs; the arguments were checked by the forward. None for a dO that is not a plain
    strided tensor (it takes the full path every time)."""
    if type(dout) is not torch.Tensor or dout.layout is not torch.strided:
        return None
    return ("backward", dout.shape, q.shape, k.shape, v.shape, dout.stride(), q.stride(),
            k.stride(), v.stride(), out.stride(), lse.stride(), dout.dtype, q.dtype, k.dtype,
            v.dtype, out.dtype, dout.device, q.device, k.device, v.device, out.device,
            lse.device, tuple(t.data_ptr() % 16 == 0 for t in (dout, q, k, v, out, lse)),
            attention_args, torch.are_deterministic_algorithms_enabled())


def _backward_repeat(layout, launch):
    # A remembered backward: its gradients and Delta allocated as _backward_impl does, then
    # launch(dO, q, k, v, out, lse, dq, dk, dv, delta). The kept launches read data pointers
    # only, their strides being the first call's (the key fixes them), so they take the
    # caller's tensors: no [batch, heads, seq, head_dim] views of bshd ones (seven a call), but
    # dq's, which the fused-dQ path's tensor ops (its fp32 buffer, the scaling) read as such.
    def run(dout, q, k, v, out, lse):
        lse = lse.contiguous()  # (as _backward_impl: the key holds the saved LSE's strides)
        dq, dk, dv = _empty(q, q.shape, q.dtype), _empty(k, k.shape, k.dtype), _empty(
            v, v.shape, v.dtype)
        delta = _empty(q, lse.shape, torch.float32)
        with _on_device(q.device):
            launch(dout, q, k, v, out, lse, _as_bhsd(dq, layout), dk, dv, delta)
        return dq, dk, dv
    return run


@triton_op("attnscope::attention_bwd", mutates_args=())
def _attention_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float,
                   bottom_right: bool, layout: str, window_left: int = -1,
                   window_right: int = -1, softcap: float = 0.0, deterministic: bool = True
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward_impl(dout, q, k, v, out, lse, causal, scale, bottom_right, layout,
                          window_left, window_right, softcap, deterministic)


def _setup_context(ctx, inputs, output):
    # args: causal, scale, bottom_right, layout[, window_left, window_right, softcap,
    # deterministic]
    q, k, v, *args = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.attention_args = tuple(args)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    # _dlse is zeros or None: lse is non-differentiable.
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _attention_bwd(dout, q, k, v, out, lse, *ctx.attention_args)
    return (dq, dk, dv) + (None,) * len(ctx.attention_args)


_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """Autograd for calls that are run, not traced: the custom ops' forward and backward bodies
    without the dispatcher round trips of two Python custom ops, which cost more host time than
    the kernels at short shapes (notes/backward.md, "The launch path"). Traced calls
    (`_traced`) keep the custom ops, and so does a backward that builds a graph
    (create_graph=True): the backward op has no derivative, so a second backward through it raises
    instead of dropping terms."""

    @staticmethod
    def forward(ctx, q, k, v, args, deterministic, run, repeat_key):
        # (ctx-style forward: with a separate setup_context, Function.apply binds its arguments
        # through inspect.signature on every call, ~60 us on the CPU machine)
        # run: a remembered call's kept launch (fused_attention's repeats), else _forward,
        # which remembers the call under repeat_key.
        output = run(q, k, v) if run is not None else _forward(q, k, v, *args,
                                                               repeat_key=repeat_key)
        _setup_context(ctx, (q, k, v, *args, deterministic), output)
        ctx.set_materialize_grads(False)  # no zeros tensor for the unused LSE gradient
        return output

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:  # no gradient reached `out` (lse has none by construction)
            return (None,) * 7
        q, k, v, out, lse = ctx.saved_tensors
        args = ctx.attention_args
        # Compiled autograd traces this with dynamo, and create_graph=True runs it with grad
        # mode on: both get the op. A plain backward runs with grad mode off; a repeat of one
        # whose launches were kept runs them again (_backward_repeat).
        if torch.compiler.is_compiling() or torch.is_grad_enabled():
            return (*_attention_bwd(dout, q, k, v, out, lse, *args), *(None,) * 4)
        key = _backward_key(dout, q, k, v, out, lse, args) if not _traced(q) else None
        run = _remembered(key)
        grads = (run(dout, q, k, v, out, lse) if run is not None
                 else _backward_impl(dout, q, k, v, out, lse, *args, repeat_key=key))
        return (*grads, *(None,) * 4)


def _call_args(q, causal, scale, causal_alignment, layout, left=-1, right=-1, softcap=0.0):
    # The kernels' arguments after the tensors, of a checked call (a repeat's are the defaults'
    # window and softcap): what _forward, the custom ops and _EagerAttention take, and what the
    # backward is given.
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return (causal, float(scale), causal_alignment == "bottom_right", layout, left, right,
            float(softcap))


def fused_attention(q, k, v, *, causal=True, scale=None, layout="bhsd",
                    causal_alignment="top_left", window=(-1, -1), softcap=0.0, return_lse=False,
                    deterministic=True):
    """Attention softmax(q @ k^T * scale) @ v in one kernel (Triton; Gluon on sm_90; the
    split-KV decode kernel for a few queries: README, "How a call runs").

    Shapes (layout="bhsd", as SDPA):  q [batch, heads, q_len, head_dim],
                                      k, v [batch, kv_heads, kv_len, head_dim]
           (layout="bshd", as flash-attn): q [batch, q_len, heads, head_dim], k/v likewise.
    Any strides; nothing is copied. heads must be a multiple of kv_heads (GQA/MQA).
    The layout is taken as given: bhsd tensors passed with layout="bshd" (or the reverse)
    whose shapes fit both readings cannot be told apart and are computed as the layout says.
    dtypes float16, bfloat16, float32; head_dim 16..256; any lengths >= 1.
    scale >= 0, default 1/sqrt(head_dim) (a negative one is a ValueError: the kernels scale each
    block's row maximum of the unscaled scores, which it would make the minimum).

    causal_alignment, for q_len=2 and kv_len=5 (1 = may attend):
        "top_left" (SDPA is_causal)      "bottom_right" (flash-attn, KV-cache decoding)
            1 0 0 0 0                        1 1 1 1 0
            1 1 0 0 0                        1 1 1 1 1
    With bottom_right and q_len > kv_len the first q_len - kv_len rows see no key: their output
    is 0 and their LSE -inf.

    window=(left, right), flash-attn's window_size: query i sees key j when
    i + offset - left <= j <= i + offset + right, offset being the causal alignment's (0 top-left,
    kv_len - q_len bottom-right) and -1 leaving a side unbounded; with causal=True the right size
    is 0 (a right size > 0 with causal=True is a ValueError). E.g. window=(2, -1), causal, for
    q_len=kv_len=5, top-left (Mistral's sliding window of 3 keys):
            1 0 0 0 0
            1 1 0 0 0
            1 1 1 0 0
            0 1 1 1 0
            0 0 1 1 1
    Key blocks wholly outside a query block's window are skipped, not masked. Rows that see no
    key give zeros and LSE -inf, and zero gradients.

    softcap > 0 caps the logits as Gemma 2 and flash-attn do: each scaled score s becomes
    softcap * tanh(s / softcap) before the softmax (and the LSE is that of the capped logits).

    Returns the output in q's layout and dtype, and with return_lse=True also the float32
    log-sum-exp of the scaled scores (natural log), [batch, heads, q_len].

    Differentiable in q, k, v (attnscope/kernels/attention_bwd.py: Triton kernels, or Gluon ones
    on Hopper where they take the call); the LSE is returned with requires_grad=False, so no
    gradient flows through it. No double backward, and no forward-mode AD (torch.func.jvp and
    jacfwd, dual tensors: NotImplementedError); torch.func.grad and jacrev through q, k, v are
    refused too (its autograd is registered for torch.autograd).

    deterministic=True (the default): every backward gives the same gradients bit for bit.
    deterministic=False lets eager bf16/fp16 head_dim-128 calls on Hopper (sm_90) without GQA
    take a faster backward: one kernel adds dQ from every key block in whatever order its
    programs run, so dQ's last bits may differ between runs (6-8 % faster backward on the
    H200 in the backward record; notes/backward.md, lever 3, "The fused-dQ kernel"); every
    other call computes as with True, as does every call while
    torch.use_deterministic_algorithms(True) is on.
    """
    # Eager calls of plain tensors (nothing traced): a repeat of a validated call runs its kept
    # launch (_repeats), under autograd's Function where gradients are needed; a first call is
    # remembered under its key.
    _refuse_forward_ad("fused_attention", q, k, v)
    traced = _traced(q)
    key = None
    if (not traced and type(q) is torch.Tensor and type(k) is torch.Tensor
            and type(v) is torch.Tensor):
        key = _repeat_key(q, k, v, causal, scale, layout, causal_alignment, window, softcap,
                          return_lse)
        run = _remembered(key)
        if run is not None and (deterministic is True or deterministic is False):
            if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad
                                            or v.requires_grad):  # under autograd's Function
                out, lse = _EagerAttention.apply(
                    q, k, v, _call_args(q, causal, scale, causal_alignment, layout),
                    deterministic, run, None)
            else:
                out, lse = run(q, k, v)
            return (out, lse) if return_lse else out
    _validate(q, k, v, causal, scale, layout, causal_alignment)
    # (the defaults skip the checks: eager calls at small shapes are bound by host time)
    seq = 2 if layout == "bhsd" else 1
    left, right = ((-1, -1) if type(window) is tuple and window == (-1, -1) and softcap == 0
                   else _validate_window_softcap(causal, window, softcap,
                                                 q.shape[seq] + k.shape[seq]))
    if deterministic is not True and deterministic is not False:
        raise TypeError(f"deterministic must be True or False, got {deterministic!r}")
    args = _call_args(q, causal, scale, causal_alignment, layout, left, right, softcap)
    if traced:  # torch.compile, a dispatch mode, torch.func, fake tensors
        out, lse = _custom_op_call("fused_attention", _attention_fwd, q, k, v, *args,
                                   deterministic)
    elif torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out, lse = _EagerAttention.apply(q, k, v, args, deterministic, None, key)
    else:  # (an LSE where returned, or where the key says gradients may follow: _repeat_key)
        out, lse = _forward(q, k, v, *args, repeat_key=key,
                            lse=bool(return_lse) or q.requires_grad or k.requires_grad
                            or v.requires_grad)
    return (out, lse) if return_lse else out
