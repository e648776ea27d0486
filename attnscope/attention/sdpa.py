"""PyTorch's scaled_dot_product_attention, free to choose (`sdpa_auto`) or pinned to one backend
with `sdpa_kernel` (04_c --backend math|flash|efficient|cudnn).

A pinned backend that has no kernel for the call (a dtype, a shape, or an explicit mask, which
the CUDA flash kernel does not take) raises NotImplementedError at the first call; the driver
shows that as an "unsupported" row. Pinning costs CPU time: entering and leaving `sdpa_kernel` is
Python (about 15 us on a 2-core dev box), inside each pinned forward; `sdpa_auto` has none of it.

A sliding window becomes an explicit boolean mask as well; a softcap cannot be expressed: SDPA
applies its softmax to the scaled scores as they are (no hook between the two).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from attnscope.attention.reference import causal_mask, varlen_mask, window_mask
from attnscope.attention.registry import Implementation, register


def _needs_cuda(what):
    def available(device):
        device = torch.device(device)
        if device.type != "cuda":
            return False, f"{what} runs on CUDA only"
        if not torch.cuda.is_available():
            return False, "no CUDA device"
        if what == "cuDNN attention" and not torch.backends.cudnn.is_available():
            return False, "this PyTorch build has no cuDNN"
        return True, what
    return available


def _anywhere(what):
    def available(device):
        return True, f"{what} on {torch.device(device).type}"
    return available


# How SDPA says a pinned backend has no kernel for a call (CUDA builds; CPU builds).
_NO_KERNEL = ("No available kernel", "No viable backend")


def _call(backend, q, k, v, **kwargs):
    """The zero-argument SDPA forward, pinned to `backend` unless it is None."""
    # GQA/MQA inputs (fewer k/v heads) need enable_gqa; equal heads keep the blog's exact call.
    if k.shape[1] != q.shape[1]:
        kwargs["enable_gqa"] = True
    if backend is None:
        return lambda: F.scaled_dot_product_attention(q, k, v, **kwargs)

    def forward():
        with sdpa_kernel(backend):
            try:
                return F.scaled_dot_product_attention(q, k, v, **kwargs)
            except RuntimeError as exc:
                # A pinned backend with no kernel for these inputs (the CUDA flash kernel and an
                # explicit mask, a dtype, a head_dim): a refusal, which the driver shows as an
                # 'unsupported' row, not a failure. PyTorch's warnings name the check.
                if not any(m in str(exc) for m in _NO_KERNEL):
                    raise
                raise NotImplementedError(
                    f"SDPA's {backend.name} backend has no kernel for this call "
                    f"({_described(q, k, kwargs)}); PyTorch's warnings say which of its checks "
                    "refused it") from exc
    return forward


def _described(q, k, kwargs):
    what = ("an explicit mask" if kwargs.get("attn_mask") is not None
            else f"is_causal={kwargs.get('is_causal', False)}")
    return f"{q.dtype}, q {list(q.shape)}, k {list(k.shape)}, {what}"


def _preparer(backend):
    def prepare(q, k, v, causal=True, window=None):
        q_len, kv_len = q.shape[2], k.shape[2]
        if window is not None:
            return _call(backend, q, k, v, attn_mask=window_mask(
                q_len, kv_len, "bottom_right", window, causal, device=q.device))
        if causal and q_len != kv_len and q_len > 1:
            # is_causal aligns top-left; bottom-right (the registry's alignment for q_len < kv_len)
            # needs an explicit [q_len, kv_len] mask, which the flash backend does not take.
            return _call(backend, q, k, v,
                         attn_mask=causal_mask(q_len, kv_len, "bottom_right", device=q.device))
        # One query against kv_len keys sees every key bottom-right: no mask at all.
        return _call(backend, q, k, v, is_causal=causal and q_len == kv_len)
    return prepare


def _varlen_preparer(backend):
    def prepare_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       causal=True, window=None):
        # SDPA has no packed-sequence API: one [1, heads, total, head_dim] batch under a dense
        # [total_q, total_k] mask keeping each sequence to itself (causal bottom-right within).
        mask = varlen_mask(cu_seqlens_q, cu_seqlens_k, causal, window)
        q4, k4, v4 = (t.transpose(0, 1)[None] for t in (q, k, v))  # views, no copy
        forward = _call(backend, q4, k4, v4, attn_mask=mask)
        return lambda: forward()[0].transpose(0, 1)
    return prepare_varlen


# name, backend (None: PyTorch picks), availability, description
_ENTRIES = (
    ("sdpa_auto", None, _anywhere("PyTorch's choice of backend"),
     "SDPA with every backend enabled: what a user gets by default"),
    ("sdpa_math", SDPBackend.MATH, _anywhere("the math (composite) backend"),
     "SDPA math backend: the unfused composite of matmuls and softmax"),
    ("sdpa_flash", SDPBackend.FLASH_ATTENTION, _anywhere("the FlashAttention backend"),
     "SDPA FlashAttention-2 backend: one fused kernel"),
    ("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION, _needs_cuda("memory-efficient attention"),
     "SDPA memory-efficient (xFormers/CUTLASS) backend: one fused kernel"),
    ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION, _needs_cuda("cuDNN attention"),
     "SDPA cuDNN backend: one fused kernel, launched with cuLaunchKernelEx"),
)

for _name, _backend, _available, _description in _ENTRIES:
    register(Implementation(
        name=_name,
        description=_description,
        # The blog pins a backend in every 04_c run; the unpinned row has no seed script.
        seed_script="" if _backend is None else
        f"04_c_sdpa_attention.py --backend {_name.removeprefix('sdpa_')}",
        available=_available,
        prepare=_preparer(_backend),
        prepare_varlen=_varlen_preparer(_backend),
        q_len_differs=True,
        explicit_mask=True,
        sliding_window=True,  # as its explicit mask
        # The math backend builds the scores (fp32 for 16-bit inputs).
        materializes_scores=_backend is SDPBackend.MATH,
        # enable_gqa (torch >= 2.5); the memory-efficient kernel refuses fewer K/V heads ("both
        # fused kernels require query, key and value to have the same num_heads", torch 2.11 on
        # the H200), so its GQA rows are 'unsupported', not 'failed'.
        gqa=_backend is not SDPBackend.EFFICIENT_ATTENTION,
    ))
