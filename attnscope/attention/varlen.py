"""Packed variable-length sequences: `fused_attention_varlen`, flash-attn's varlen interface on
attnscope's fused kernels.

A batch of sequences of different lengths is passed packed, without padding: their rows one
after another in q [total_q, heads, head_dim] and k/v [total_k, kv_heads, head_dim], sequence b
being rows cu_seqlens[b]:cu_seqlens[b + 1]. The same Triton kernels as fused_attention's run it
(their VARLEN constexpr): one program per (sequence, head, query block) of the longest sequence,
each reading its sequence's bounds from the cumulative lengths; programs past a sequence's end
exit at once. The launches are custom ops, as fused.py's, so torch.compile traces them whole.
"""

from __future__ import annotations

import math

import torch
from einops import rearrange
from torch.library import triton_op

from attnscope.attention import fused

INT32_MAX = 2 ** 31 - 1


def _validate_cu_seqlens(name, cu, total, max_seqlen, device):
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must be a 1-D int32 tensor of batch + 1 >= 2 cumulative lengths, "
                         f"got {cu.dtype} of shape {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name} must be on q's device {device}, got {cu.device}")
    if cu.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous (the kernels read sequence b's bounds at "
                         f"offsets b and b + 1), got stride {cu.stride(0)}: pass "
                         f"{name}.contiguous()")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int):
        raise TypeError(f"max_seqlen for {name} must be an int, got {max_seqlen!r}")
    if not 0 <= max_seqlen <= INT32_MAX:
        raise ValueError(f"max_seqlen for {name} must be between 0 and {INT32_MAX} (the "
                         f"cumulative lengths are int32), got {max_seqlen}")
    if cu.device.type != "cpu" or not fused._values_readable(cu):
        # Reading the lengths back would synchronize with the GPU on every call (and traced
        # values cannot be read); as flash-attn, their values are the caller's contract there.
        return
    lengths = cu[1:] - cu[:-1]
    if cu[0] != 0 or cu[-1] != total or (lengths < 0).any():
        raise ValueError(f"{name} must start at 0, not decrease and end at the packed length "
                         f"{total}, got {cu.tolist()}")
    longest = lengths.max().item()  # (an int: a Python int compared with the tensor wraps)
    if longest > max_seqlen:
        raise ValueError(f"max_seqlen for {name} is {max_seqlen}, but a sequence has "
                         f"{longest} rows")


def _validate(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D packed [total, heads, head_dim], got shape "
                             f"{tuple(t.shape)}")
    fused._validate_causal_and_scale(causal, scale)
    if q.dtype not in fused.DTYPES:
        raise TypeError(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.device.type not in ("cpu", "cuda") or k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must be on one CUDA device (or CPU with TRITON_INTERPRET=1), "
                         f"got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"q and k/v must have the same head_dim, got {q.shape[2]} and "
                         f"{k.shape[2]}")
    if not fused.MIN_HEAD_DIM <= q.shape[2] <= fused.MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be between {fused.MIN_HEAD_DIM} and "
                         f"{fused.MAX_HEAD_DIM}, got {q.shape[2]}")
    if k.shape[1] == 0 or q.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"q heads must be a multiple of k/v heads (GQA/MQA), got {q.shape[1]} q "
                         f"heads and {k.shape[1]} k/v heads")
    _validate_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, q.device)
    _validate_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k, q.device)
    if cu_seqlens_k.shape != cu_seqlens_q.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), "
                         f"got {cu_seqlens_q.numel()} and {cu_seqlens_k.numel()}")


def _as_batched(t, batch):
    # The kernels' [batch, heads, seq, head_dim] view of a packed [total, heads, head_dim]: every
    # sequence sees the whole packed tensor (batch stride 0) and starts at its cu_seqlens row.
    return rearrange(t, "t h d -> 1 h t d").expand(batch, -1, -1, -1)


@triton_op("attnscope::attention_varlen_fwd", mutates_args=())
def _varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                scale: float, window_left: int, window_right: int, softcap: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    kernels = fused._kernels()
    if q.device.type == "cpu":
        fused._check_interpreter(kernels, q)
    out = fused._empty(q, q.shape, q.dtype)
    lse = fused._empty(q, (q.shape[1], q.shape[0]), torch.float32)  # flash-attn's layout
    if fused._shapes_only(kernels, q) or q.shape[0] == 0:
        return out, lse
    batch = cu_seqlens_q.shape[0] - 1
    q4, k4, v4, out4 = (_as_batched(t, batch) for t in (q, k, v, out))
    with fused._on_device(q.device):
        kernels.attention_fwd(q4, k4, v4, out4, lse, causal=causal, scale=scale, causal_offset=0,
                              window=(window_left, window_right), softcap=softcap,
                              varlen=(cu_seqlens_q, cu_seqlens_k, max(max_seqlen_q, 1),
                                      max(max_seqlen_k, 1)),
                              wrap=fused._launch_wrap(q))
    return out, lse


@triton_op("attnscope::attention_varlen_bwd", mutates_args=())
def _varlen_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                out: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: torch.Tensor,
                cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                scale: float, window_left: int, window_right: int, softcap: float
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    kernels = fused._kernels()
    dq = fused._empty(q, q.shape, q.dtype)
    dk = fused._empty(k, k.shape, k.dtype)
    dv = fused._empty(v, v.shape, v.dtype)
    lse = lse.contiguous()  # (a saved-tensor hook may hand it back in other strides)
    delta = fused._empty(q, lse.shape, torch.float32)  # rowsum(dO * O), scratch
    if fused._shapes_only(kernels, q):
        return dq, dk, dv
    if q.shape[0] == 0:  # no query: no key is seen
        return dq, dk.zero_(), dv.zero_()
    batch = cu_seqlens_q.shape[0] - 1
    views = [_as_batched(t, batch) for t in (dout, q, k, v, out, dq, dk, dv)]
    with fused._on_device(q.device):
        kernels.attention_bwd(*views[:5], lse, *views[5:], delta, causal=causal, scale=scale,
                              causal_offset=0, window=(window_left, window_right),
                              softcap=softcap,
                              varlen=(cu_seqlens_q, cu_seqlens_k, max(max_seqlen_q, 1),
                                      max(max_seqlen_k, 1)),
                              wrap=fused._launch_wrap(q))
    return dq, dk, dv


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, *args = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
    ctx.attention_args = tuple(args)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    dq, dk, dv = _varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                             *ctx.attention_args)
    return (dq, dk, dv, None, None) + (None,) * len(ctx.attention_args)


_varlen_fwd.register_autograd(_backward, setup_context=_setup_context)


def fused_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                           causal=True, scale=None, window=(-1, -1), softcap=0.0,
                           return_lse=False):
    """Attention over a batch of packed sequences of different lengths (flash-attn's
    flash_attn_varlen_func), in the fused kernels.

    Shapes: q [total_q, heads, head_dim], k/v [total_k, kv_heads, head_dim] (heads a multiple
    of kv_heads: GQA/MQA; any strides), cu_seqlens_q/k int32 [batch + 1] on q's device:
    sequence b is q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]] attending to
    k/v[cu_seqlens_k[b]:cu_seqlens_k[b + 1]]. max_seqlen_q/k: the longest sequence's lengths
    (they size the grid); cu_seqlens contiguous (a ValueError otherwise). Sequences may be
    empty (length 0 in q or k). On CPU the cumulative
    lengths are checked (start 0, non-decreasing, end at total, maxima); on CUDA they are not,
    as in flash-attn, since that needs a read back from the device on every call: lengths that
    break those rules there give undefined results (the sm_90 kernel may not return).
    On sm_90 a packed block reads on into the next sequence's rows, masked: an inf or NaN in
    one sequence's v can reach the output of the sequence before it (notes/serving.md).

    causal aligns each sequence bottom-right, as flash-attn's varlen: with q_len 2 and kv_len 5
    its query rows see keys 0-3 and 0-4; rows of a sequence with more queries than keys that
    see no key give zeros and LSE -inf. `scale` (>= 0, default 1/sqrt(head_dim)), `window` and
    `softcap` as fused_attention's, the window counted from the same alignment.

    Returns the output [total_q, heads, head_dim] in q's dtype, and with return_lse=True also
    the float32 log-sum-exp of the (capped) scaled scores, [heads, total_q] (flash-attn's
    layout). Differentiable in q, k, v by torch.autograd (not by torch.func's transforms, nor in
    forward mode: NotImplementedError); the LSE carries no gradient.
    """
    fused._refuse_forward_ad("fused_attention_varlen", q, k, v)
    _validate(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale)
    left, right = fused._validate_window_softcap(causal, window, softcap,
                                                 int(max_seqlen_q) + int(max_seqlen_k))
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    out, lse = fused._custom_op_call(
        "fused_attention_varlen", _varlen_fwd, q, k, v, cu_seqlens_q, cu_seqlens_k,
        int(max_seqlen_q), int(max_seqlen_k), causal, float(scale), left, right, float(softcap))
    return (out, lse) if return_lse else out
