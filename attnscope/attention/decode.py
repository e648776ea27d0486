"""Attention of new queries against a KV cache, contiguous or paged: the public decode function.

The kernel is attnscope/kernels/attention_decode.py (split-KV, GQA-packed); this module checks
inputs and names the shapes. Forward only: decoding is inference.
"""

from __future__ import annotations

import math

import torch

from attnscope.attention import fused

def _validate(q, k_cache, v_cache, cache_seqlens, block_table, causal, scale):
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D, got shape {tuple(t.shape)}")
    fused._validate_causal_and_scale(causal, scale)
    if q.dtype not in fused.DTYPES:
        raise TypeError(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(f"q, k_cache, v_cache must share one dtype, got {q.dtype}, "
                        f"{k_cache.dtype}, {v_cache.dtype}")
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"q must be a CUDA tensor (or CPU with TRITON_INTERPRET=1), got "
                         f"{q.device}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("cache_seqlens", cache_seqlens),
                    ("block_table", block_table)):
        if isinstance(t, torch.Tensor) and t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape, got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    batch, q_len, heads, head_dim = q.shape
    slots, rows, kv_heads, kv_dim = k_cache.shape
    if kv_dim != head_dim:
        raise ValueError(f"q and the caches must have the same head_dim, got {head_dim} and "
                         f"{kv_dim}")
    if not fused.MIN_HEAD_DIM <= head_dim <= fused.MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be between {fused.MIN_HEAD_DIM} and "
                         f"{fused.MAX_HEAD_DIM}, got {head_dim}")
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"q heads must be a multiple of the caches' kv_heads (GQA/MQA), got "
                         f"{heads} and {kv_heads}")
    if min(batch, q_len, heads, slots, rows) == 0:
        raise ValueError(f"q [batch, q_len, heads, head_dim] and the caches must be non-empty, got "
                         f"q {tuple(q.shape)} and caches {tuple(k_cache.shape)}")
    if block_table is None:
        if slots != batch:
            raise ValueError(f"a contiguous k_cache [batch, max_kv_len, kv_heads, head_dim] must "
                             f"have q's batch {batch}, got {tuple(k_cache.shape)}")
    else:
        if not isinstance(block_table, torch.Tensor):
            raise TypeError(f"block_table must be a torch.Tensor or None, got "
                            f"{type(block_table).__name__}")
        if block_table.dtype != torch.int32 or block_table.dim() != 2 \
                or block_table.shape[0] != batch or block_table.shape[1] == 0:
            raise ValueError(f"block_table must be int32 [batch={batch}, max_blocks >= 1], got "
                             f"{block_table.dtype} {tuple(block_table.shape)}")
        if block_table.stride(1) != 1 and block_table.shape[1] > 1:
            raise ValueError(f"block_table's rows must be contiguous (the kernel reads a "
                             f"sequence's entries one after another), got strides "
                             f"{block_table.stride()}: pass block_table.contiguous()")
    most = fused._decode_kernels().MAX_GROUPS
    if batch * kv_heads > most:
        raise ValueError(f"batch * kv_heads must be at most {most} (the decode kernel's grid), "
                         f"got {batch} x {kv_heads}: split the batch")
    if torch.is_grad_enabled() and (q.requires_grad or k_cache.requires_grad
                                    or v_cache.requires_grad):
        raise ValueError("fused_attention_with_kvcache is forward only (no gradient would reach "
                         "q or the caches): call it under torch.no_grad() or "
                         "torch.inference_mode(), or pass detached tensors; got inputs that "
                         "require grad")
    capacity = _capacity(k_cache, block_table)
    if isinstance(cache_seqlens, torch.Tensor):
        if cache_seqlens.dtype != torch.int32 or tuple(cache_seqlens.shape) != (batch,):
            raise ValueError(f"cache_seqlens must be int32 [batch={batch}], got "
                             f"{cache_seqlens.dtype} {tuple(cache_seqlens.shape)}")
        if cache_seqlens.stride(0) != 1 and batch > 1:
            raise ValueError(f"cache_seqlens must be contiguous (the kernel reads entry b at "
                             f"offset b), got stride {cache_seqlens.stride(0)}: pass "
                             f"cache_seqlens.contiguous()")
    elif isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, int):
        raise TypeError(f"cache_seqlens must be an int32 tensor or an int, got "
                        f"{type(cache_seqlens).__name__}")
    elif not 0 <= cache_seqlens <= capacity:
        raise ValueError(f"cache_seqlens must be between 0 and the cache's capacity {capacity}, "
                         f"got {cache_seqlens}")
    _check_cpu_values(k_cache, cache_seqlens, block_table)


def _capacity(k_cache, block_table):
    # keys a sequence's cache holds: its rows, or its table's pages of block_size rows
    rows = k_cache.shape[1]
    return rows if block_table is None else block_table.shape[1] * rows


def _check_cpu_values(k_cache, cache_seqlens, block_table):
    # The values of a tensor cache_seqlens and of block_table, on CPU only: on CUDA reading them
    # back would synchronise the device on every call (out-of-range values there read outside
    # the cache, as in flash-attn). Also on a remembered call's repeat, which skips _validate.
    if not k_cache.is_cpu or not fused._values_readable(k_cache):
        return
    # (read as lists: a CPU tensor's min and max cost ~3 us each, a short list's ~0.2)
    capacity = _capacity(k_cache, block_table)
    if isinstance(cache_seqlens, torch.Tensor):
        lengths = cache_seqlens.tolist()
        if min(lengths) < 0 or max(lengths) > capacity:
            raise ValueError(f"cache_seqlens must be between 0 and the cache's capacity "
                             f"{capacity}, got {lengths}")
    if block_table is not None:
        slots = k_cache.shape[0]
        entries = block_table.flatten().tolist()
        if min(entries) < 0 or max(entries) >= slots:
            raise ValueError(f"block_table's entries must name cache blocks 0..{slots - 1}, got "
                             f"entries from {min(entries)} to {max(entries)}")


def fused_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, *, block_table=None,
                                 causal=True, scale=None, window=(-1, -1), softcap=0.0,
                                 return_lse=False):
    """Attention of q against the first cache_seqlens[b] keys of each sequence's KV cache
    (split-KV "flash-decoding" kernel; forward only, for inference: no autograd).

    Shapes (flash-attn's flash_attn_with_kvcache convention, sequence before heads):
        q                 [batch, q_len, heads, head_dim]
        k_cache, v_cache  contiguous: [batch, max_kv_len, kv_heads, head_dim]
                          paged:      [num_blocks, block_size, kv_heads, head_dim], with
        block_table       int32 [batch, max_blocks]: sequence b's keys n live in cache block
                          block_table[b, n // block_size], row n % block_size
        cache_seqlens     int32 [batch] (or one int for every sequence): keys held per sequence,
                          0..capacity (max_kv_len, or max_blocks * block_size). A tensor's
                          values, and block_table's (0..num_blocks - 1), are checked on CPU
                          only: on CUDA that would synchronise the device on every call, and
                          values out of range there read outside the cache.
    batch * kv_heads at most 65535 (the kernel's grid; a ValueError otherwise).
    Any strides for q and the caches; cache_seqlens and each row of block_table contiguous (a
    ValueError otherwise). heads must be a multiple of kv_heads (GQA/MQA). dtypes float16,
    bfloat16 (CUDA), float32; head_dim 16..256; scale >= 0, default 1/sqrt(head_dim).

    causal=True aligns the mask bottom-right, as a decoding step needs: query i of q_len sees keys
    j <= kv_len - q_len + i, so the last query sees the whole cache. For q_len=2, kv_len=5:
            1 1 1 1 0
            1 1 1 1 1
    window=(left, right), flash-attn's window_size with the same bottom-right alignment: query i
    sees key j when kv_len - q_len + i - left <= j <= kv_len - q_len + i + right, -1 leaving a
    side unbounded; with causal=True right must be 0 or -1 (Mistral's sliding window: (w - 1, 0)).
    Keys left of every query's window are not read. softcap > 0 caps each scaled score s to
    softcap * tanh(s / softcap) before the softmax (Gemma 2; the LSE is the capped logits').
    Rows that see no key (a sequence with cache_seqlens 0, or q_len > kv_len) return zeros and
    LSE -inf.

    Inputs that require grad, with grad mode on, raise ValueError (no gradient would flow).
    Under torch.compile the call runs eagerly (a graph break; fullgraph=True refuses it): dynamo
    cannot trace its launches.

    Returns the output [batch, q_len, heads, head_dim] in q's dtype, and with return_lse=True
    also the float32 log-sum-exp of the scaled scores (natural log), [batch, heads, q_len].
    """
    fused._refuse_forward_ad("fused_attention_with_kvcache", q, k_cache, v_cache)
    if torch.compiler.is_compiling():
        return _eager_kvcache(q, k_cache, v_cache, cache_seqlens, block_table=block_table,
                              causal=causal, scale=scale, window=window, softcap=softcap,
                              return_lse=return_lse)
    # A repeat of a validated call (same key: _repeat_key) runs the launch kept for it.
    key = _repeat_key(q, k_cache, v_cache, cache_seqlens, block_table, causal, scale, window,
                      softcap)
    run = fused._remembered(key)
    if run is not None:
        if q.is_cpu:
            _check_cpu_values(k_cache, cache_seqlens, block_table)
        out, lse = run(q, k_cache, v_cache, cache_seqlens, block_table)
        return (out, lse) if return_lse else out
    _validate(q, k_cache, v_cache, cache_seqlens, block_table, causal, scale)
    # (the defaults skip the checks, as the fused op's do: decode steps are bound by host time)
    window = ((-1, -1) if type(window) is tuple and window == (-1, -1) and softcap == 0
              else fused._validate_window_softcap(causal, window, softcap,
                                                  q.shape[1] + _capacity(k_cache, block_table)))
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    kernels = fused._decode_kernels()  # imported on first use, like the fused op's
    device = q.device  # (read once: each read builds a torch.device)
    if device.type == "cpu":
        fused._check_interpreter(fused._kernels(), q)
    seqlens = cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else None
    if seqlens is None and block_table is None:
        k_cache, v_cache = k_cache[:, :cache_seqlens], v_cache[:, :cache_seqlens]  # views
    elif seqlens is None:  # one length for every sequence of a paged cache
        seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32, device=device)
    out, lse = _outputs(q)
    if block_table is None:
        k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    with fused._on_device(device):
        launched = kernels.attention_decode(
            q.transpose(1, 2), k_cache, v_cache, out.transpose(1, 2), lse, causal=causal,
            scale=float(scale), seqlens=seqlens, block_table=block_table, window=window,
            softcap=float(softcap), kept=key is not None)
    if key is not None and launched[2] is not None:
        fused._remember(key, _repeat(launched[2]))
    return (out, lse) if return_lse else out


@torch.compiler.disable
def _eager_kvcache(*args, **kwargs):
    # What torch.compile runs of a call: the op outside the graph (a graph break)
    return fused_attention_with_kvcache(*args, **kwargs)


def _outputs(q):
    # The output in q's [batch, q_len, heads, head_dim] and its fp32 LSE [batch, heads, q_len]
    out = fused._empty(q, q.shape, q.dtype)
    batch, q_len, heads, _ = q.shape
    return out, fused._empty(q, (batch, heads, q_len), torch.float32)


def _repeat_key(q, k_cache, v_cache, cache_seqlens, block_table, causal, scale, window,
                softcap):
    """What _validate reads of a call and what fixes its launch, for calls whose lengths are a
    tensor (`cache_seqlens`: the kernel reads them, so a decode loop's steps share one key):
    the shapes, strides, dtypes, devices and 16-byte alignment of q, the caches, the lengths
    and the block table, and the arguments, only of the exact types the checks accept. None
    for a call that takes the full path every time: an int cache_seqlens (its keys change
    every step), inputs that require grad (refused under grad mode) or that are not plain
    tensors."""
    tensors = (q, k_cache, v_cache, cache_seqlens) + (() if block_table is None
                                                     else (block_table,))
    if (any(type(t) is not torch.Tensor for t in tensors)
            or q.requires_grad or k_cache.requires_grad or v_cache.requires_grad
            or type(causal) is not bool
            or not (scale is None or type(scale) is float or type(scale) is int)
            or type(window) is not tuple or len(window) != 2
            or type(window[0]) is not int or type(window[1]) is not int
            or not (type(softcap) is float or type(softcap) is int)):
        return None
    return ("kvcache", block_table is None,
            *((t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0) for t in tensors),
            causal, scale, window, softcap)


def _repeat(launch):
    # A remembered call: its outputs allocated as the first call's, then its kept launch. That
    # reads its tensors' data pointers only (their strides, the first call's, are in the launch:
    # the key fixes them), so q, the output and the caches go as the caller's tensors, not as
    # the kernel's [batch, heads, seq, head_dim] views of the first call (~0.5 us a view).
    def run(q, k_cache, v_cache, seqlens, block_table):
        out, lse = _outputs(q)
        with fused._on_device(q.device):
            launch(q, k_cache, v_cache, out, lse, seqlens, block_table)
        return out, lse
    return run
