"""Readable eager attention: the oracle for tests, the driver's error column and the benchmark.

`attention_reference` computes in float64 by default. Called with `dtype=q.dtype` it is the
framework's own low-precision path (matmuls and softmax in that dtype), whose error against
float64 sets the tolerance for the fused kernel.
"""

from __future__ import annotations

import math

import torch
from einops import rearrange


def causal_mask(q_len: int, kv_len: int, alignment: str, device=None) -> torch.Tensor:
    """Boolean [q_len, kv_len], True where query i may see key j.

    "top_left" (SDPA's is_causal): j <= i.  "bottom_right" (flash-attn): j <= i + kv_len - q_len,
    so the last query sees every key; with q_len > kv_len the first q_len - kv_len rows see none.
    """
    if alignment not in ("top_left", "bottom_right"):
        raise ValueError(f"causal_alignment must be 'top_left' or 'bottom_right', "
                         f"got {alignment!r}")
    offset = 0 if alignment == "top_left" else kv_len - q_len
    i = torch.arange(q_len, device=device)[:, None]
    j = torch.arange(kv_len, device=device)[None, :]
    return j <= i + offset


def within_window(diagonal, key, left: int, right: int):
    """Whether key positions lie in a sliding window around each query's diagonal key
    (tensors, broadcast against each other): diagonal - left <= key <= diagonal + right, -1
    leaving a side unbounded; None where both are (nothing is hidden). The one window rule of
    window_mask, varlen_mask and flex's mask_mod."""
    if left < 0 and right < 0:
        return None
    if left < 0:
        return key <= diagonal + right
    if right < 0:
        return key >= diagonal - left
    return (key >= diagonal - left) & (key <= diagonal + right)


def varlen_mask(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, causal: bool,
                window=None) -> torch.Tensor:
    """Boolean [total_q, total_k] over packed sequences, True where query row i may see key row j:
    both in one sequence, and (causal) j at or left of i's bottom-right-aligned diagonal, and
    within a sliding window (left, right) from that diagonal as window_mask's. What an
    implementation without a packed-sequence API is given as its mask."""
    device = cu_seqlens_q.device
    lengths_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    lengths_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).long()
    seqs = torch.arange(lengths_q.numel(), device=device)
    seq_q = seqs.repeat_interleave(lengths_q)
    seq_k = seqs.repeat_interleave(lengths_k)
    visible = seq_q[:, None] == seq_k[None, :]
    left, right = (-1, -1) if window is None else window
    right = 0 if causal else right
    if left >= 0 or right >= 0:
        # position within its sequence, shifted so that each sequence's last query is at its
        # last key (bottom-right)
        pos_q = (torch.arange(seq_q.numel(), device=device) - cu_seqlens_q[:-1].long()[seq_q]
                 + (lengths_k - lengths_q)[seq_q])[:, None]
        pos_k = (torch.arange(seq_k.numel(), device=device)
                 - cu_seqlens_k[:-1].long()[seq_k])[None, :]
        visible &= within_window(pos_q, pos_k, left, right)
    return visible


def window_mask(q_len: int, kv_len: int, alignment: str, window, causal: bool,
                device=None) -> torch.Tensor:
    """Boolean [q_len, kv_len], True where query i may see key j under a causal flag and a
    window (left, right) in flash-attn's convention: i + offset - left <= j <= i + offset + right,
    offset the alignment's (0 top-left, kv_len - q_len bottom-right), -1 = unbounded, and
    causal setting right = 0."""
    left, right = window
    if causal:
        right = 0
    offset = 0 if alignment == "top_left" else kv_len - q_len
    i = torch.arange(q_len, device=device)[:, None]
    j = torch.arange(kv_len, device=device)[None, :]
    visible = within_window(i + offset, j, left, right)
    if visible is None:
        return torch.ones(q_len, kv_len, dtype=torch.bool, device=device)
    return visible


def attention_reference(q, k, v, *, causal=True, scale=None, layout="bhsd",
                        causal_alignment="top_left", window=(-1, -1), softcap=0.0,
                        return_lse=False, dtype=torch.float64):
    """Attention computed step by step in `dtype`; same arguments and result as fused_attention.

    GQA is handled by repeating k/v heads (this is the oracle; it may copy). Rows that see no
    key give zeros and LSE -inf. softcap > 0 replaces each scaled score s by
    softcap * tanh(s / softcap). The output comes back in `dtype`, the LSE in float64.
    """
    if layout == "bshd":
        q, k, v = (rearrange(t, "b s h d -> b h s d") for t in (q, k, v))
    elif layout != "bhsd":
        raise ValueError(f"layout must be 'bhsd' or 'bshd', got {layout!r}")
    if causal_alignment not in ("top_left", "bottom_right"):
        raise ValueError(f"causal_alignment must be 'top_left' or 'bottom_right', "
                         f"got {causal_alignment!r}")
    q, k, v = (t.to(dtype) for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if causal or tuple(window) != (-1, -1):
        visible = window_mask(q.shape[2], k.shape[2], causal_alignment, window, causal,
                              device=q.device)
        scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores.double(), dim=-1)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row of all -inf softmaxes to NaN
    out = probs @ v
    if layout == "bshd":
        out = rearrange(out, "b h s d -> b s h d")
    return (out, lse) if return_lse else out


def attention_reference_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=True, scale=None,
                               window=(-1, -1), softcap=0.0, return_lse=False,
                               dtype=torch.float64):
    """fused_attention_varlen's oracle: attention_reference on each packed sequence (causal
    aligned bottom-right), the outputs concatenated [total_q, heads, head_dim], the LSE
    [heads, total_q]. Empty sequences give empty pieces."""
    outs, lses = [], []
    bounds = zip(cu_seqlens_q.tolist(), cu_seqlens_q[1:].tolist(), cu_seqlens_k.tolist(),
                 cu_seqlens_k[1:].tolist())
    for q0, q1, k0, k1 in bounds:
        qs, ks, vs = (rearrange(t[a:b], "s h d -> 1 h s d")
                      for t, a, b in ((q, q0, q1), (k, k0, k1), (v, k0, k1)))
        if q1 == q0:
            continue
        if k1 == k0:  # no key: zeros and LSE -inf (softmax over nothing)
            outs.append(torch.zeros(q1 - q0, q.shape[1], q.shape[2], dtype=dtype,
                                    device=q.device) + 0 * qs.sum())
            lses.append(torch.full((q.shape[1], q1 - q0), float("-inf"), dtype=torch.float64,
                                   device=q.device))
            continue
        out, lse = attention_reference(qs, ks, vs, causal=causal, scale=scale,
                                       causal_alignment="bottom_right", window=window,
                                       softcap=softcap, return_lse=True, dtype=dtype)
        outs.append(rearrange(out, "1 h s d -> s h d"))
        lses.append(lse[0])
    out = torch.cat(outs) if outs else torch.zeros(0, *q.shape[1:], dtype=dtype, device=q.device)
    lse = (torch.cat(lses, dim=1) if lses
           else torch.zeros(q.shape[1], 0, dtype=torch.float64, device=q.device))
    return (out, lse) if return_lse else out
