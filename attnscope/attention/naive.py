"""The blog's eager baselines: attention written as five PyTorch ops (04_a, 04_b), and the same
function under torch.compile.

Each op is a kernel launch and each intermediate a [batch, heads, seq, seq] tensor in memory;
that is the cost the fused implementations remove, and what their traces show.
"""

from __future__ import annotations

import math

import torch

from attnscope.attention.reference import varlen_mask, window_mask
from attnscope.attention.registry import Implementation, inductor_available, register


def _causal_fill_mask(q, k, window, causal=True):
    # True where a key is in the future of its query (causal) or outside its sliding window:
    # those scores become -inf. Built once in prepare, as 04_a does, so the profiled forward
    # holds no mask construction. Bottom-right: the registry's alignment for q_len < kv_len (the
    # same mask as 04_a's at equal lengths). Without causal or a window it masks nothing, and
    # the forward still runs the blog's five ops.
    return ~window_mask(q.shape[2], k.shape[2], "bottom_right", window, causal=causal,
                        device=q.device)


def naive_attention(q, k, v, mask, scale, softcap=0.0):
    scores = (q @ k.transpose(-2, -1)) * scale
    if softcap:  # Gemma 2's logit cap: two more elementwise kernels
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def naive_attention_inplace(q, k, v, mask, scale, softcap=0.0):
    scores = (q @ k.transpose(-2, -1)) * scale
    if softcap:
        scores.div_(softcap).tanh_().mul_(softcap)
    scores.masked_fill_(mask, float("-inf"))  # 04_b: reuse the scores buffer, one tensor fewer
    return torch.softmax(scores, dim=-1) @ v


def _always(device):
    return True, f"eager PyTorch ops on {torch.device(device).type}"


def _compile_available(device):
    return inductor_available(device, "torch.compile", "inductor-generated C++ (CPU)")


def _check_heads(q, k, heads_dim):
    if k.shape[heads_dim] != q.shape[heads_dim]:
        # The blog's scripts have one k/v head per query head; repeating k/v would time a copy.
        raise NotImplementedError(f"GQA/MQA not supported: {q.shape[heads_dim]} q heads, "
                                  f"{k.shape[heads_dim]} k/v heads")


def _preparer(fn, compile_it=False):
    def prepare(q, k, v, causal=True, window=(-1, -1), softcap=0.0):
        _check_heads(q, k, 1)
        mask = _causal_fill_mask(q, k, window, causal)
        scale = 1.0 / math.sqrt(q.shape[-1])
        f = torch.compile(fn) if compile_it else fn
        return lambda: f(q, k, v, mask, scale, softcap)
    return prepare


def _varlen_preparer(fn, compile_it=False):
    def prepare_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       causal=True, window=(-1, -1), softcap=0.0):
        # The packed sequences as one [1, heads, total, head_dim] batch whose mask keeps each
        # sequence to itself: every score of every pair of sequences is computed, then masked.
        _check_heads(q, k, 1)
        mask = ~varlen_mask(cu_seqlens_q, cu_seqlens_k, causal, window)
        scale = 1.0 / math.sqrt(q.shape[-1])
        q4, k4, v4 = (t.transpose(0, 1)[None] for t in (q, k, v))  # views, no copy
        f = torch.compile(fn) if compile_it else fn
        return lambda: f(q4, k4, v4, mask, scale, softcap)[0].transpose(0, 1)
    return prepare_varlen


register(Implementation(
    name="naive",
    description="matmul, scale, masked_fill, softmax, matmul: one kernel and one S x S tensor each",
    seed_script="04_a_naive_attention.py",
    available=_always,
    prepare=_preparer(naive_attention),
    materializes_scores=True,
    q_len_differs=True,
    sliding_window=True,  # in its mask
    softcap=True,
    prepare_varlen=_varlen_preparer(naive_attention),
))
register(Implementation(
    name="naive_inplace",
    description="naive with masked_fill_ in place: one S x S allocation fewer",
    seed_script="04_b_inplace_ops_attention.py",
    available=_always,
    prepare=_preparer(naive_attention_inplace),
    materializes_scores=True,
    q_len_differs=True,
    sliding_window=True,  # in its mask
    softcap=True,
    prepare_varlen=_varlen_preparer(naive_attention_inplace),
))
register(Implementation(
    name="naive_compiled",
    description="torch.compile of naive: inductor fuses the elementwise ops and the softmax",
    seed_script="",
    available=_compile_available,
    prepare=_preparer(naive_attention, compile_it=True),
    materializes_scores=True,
    q_len_differs=True,
    sliding_window=True,  # in its mask
    softcap=True,
    prepare_varlen=_varlen_preparer(naive_attention, compile_it=True),
))
