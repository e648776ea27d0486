"""The stand-in hub kernel: flash-attn's `flash_attn_func` call on SDPA.

Layout [batch, seq, heads, dim] in and out, as the hub's flash-attn. On CUDA it pins SDPA's
FlashAttention backend, so a trace shows one real flash kernel (pytorch_flash::flash_fwd_kernel);
on the CPU it pins the math backend, the one SDPA backend every CPU build has for every dtype.
"""

import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

calls = []  # (q shape, q strides, causal) of each call, for tests


def flash_attn_func(q, k, v, causal=False):
    calls.append((tuple(q.shape), q.stride(), causal))
    backend = SDPBackend.FLASH_ATTENTION if q.is_cuda else SDPBackend.MATH
    gqa = {"enable_gqa": True} if k.shape[2] != q.shape[2] else {}
    with sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=causal, **gqa)
    # SDPA's flash kernel writes its output as [batch, seq, heads, dim] in memory, so this view is
    # contiguous, as flash-attn's output is; no copy kernel joins the trace.
    return out.transpose(1, 2)
