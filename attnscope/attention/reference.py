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


def attention_reference(q, k, v, *, causal=True, scale=None, layout="bhsd",
                        causal_alignment="top_left", return_lse=False, dtype=torch.float64):
    """Attention computed step by step in `dtype`; same arguments and result as fused_attention.

    GQA is handled by repeating k/v heads (this is the oracle; it may copy). Rows that see no
    key give zeros and LSE -inf. The output comes back in `dtype`, the LSE in float64.
    """
    if layout == "bshd":
        q, k, v = (rearrange(t, "b s h d -> b h s d") for t in (q, k, v))
    elif layout != "bhsd":
        raise ValueError(f"layout must be 'bhsd' or 'bshd', got {layout!r}")
    q, k, v = (t.to(dtype) for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale
    if causal:
        visible = causal_mask(q.shape[2], k.shape[2], causal_alignment, device=q.device)
        scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores.double(), dim=-1)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row of all -inf softmaxes to NaN
    out = probs @ v
    if layout == "bshd":
        out = rearrange(out, "b h s d -> b s h d")
    return (out, lse) if return_lse else out
