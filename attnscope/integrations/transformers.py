"""attnscope as a transformers attention backend: `attn_implementation="attnscope"`.

    import attnscope.integrations.transformers
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="attnscope")

Importing this module registers two functions under the name "attnscope" in transformers' public
registries, and both are needed:

- the attention function (`AttentionInterface`), which runs attnscope's op on a layer whose mask
  the op can express, and transformers' SDPA function otherwise;
- the mask function (`AttentionMaskInterface`). transformers hands a custom attention function no
  mask at all unless a mask function is registered under the same name, so without it a padded
  batch would attend to its padding, silently.

The contract between the two. The mask function returns None exactly when the layer's mask is
causal with the queries being the *last* q_len of the kv_len key positions (bottom-right
alignment, flash-attn's convention, which transformers' flash-attention backends share: prefill,
chunked prefill and KV-cache decode), possibly cut by a sliding window. For a batch with padding
tokens it returns transformers' SDPA boolean mask carrying the packing of the real tokens
(`_Packing`): the attention function gathers those into packed q/k/v, runs
`fused_attention_varlen` and scatters the output back, zeros on padding rows. Anything else gets
the SDPA mask labelled with the reason the op cannot take it, and the attention function hands
that mask to SDPA, or (a mask of None) the causal mask aligned bottom-right it stands for, cut
by the layer's window, since SDPA would read None as top-left causal without a window. The window
itself comes from the layer's `sliding_window` argument (Mistral, Qwen2, Gemma 2 pass it), else
from its config's `layer_types` or its own `sliding_window` attribute (Qwen2-MoE's sliding layers
pass no argument): a window of W keys is the op's window=(W - 1, 0), the query's own key and
W - 1 before it, as transformers' masks count it. (A model that builds sliding masks but says
nothing of the window to its layers, PhiMoE's, runs them unwindowed, as transformers'
flash-attention backends do.)

Why padding + causal is packed causal. Each query sits at one of the last q_len key positions and
sees the real keys at or before it; packing keeps order, and the real keys after a real query are
exactly the real queries after it, so in packed indices that is bottom-right causal per sequence,
whatever the padding pattern. A window counts positions, so it survives packing only when no
padding sits between two real tokens of a row (left or right padding): other patterns fall back.

What decides, and what it costs. The mask function runs once per model forward per mask kind
(full / sliding), not per layer, and decides from Python integers transformers gives it: query
and key lengths and offsets (the queries must end where the keys end), `allow_is_causal_skip`
(False when transformers adds anything to the causal pattern: overlays, packed sequences,
bidirectional masks, compiled static-cache decode), the mask pattern (`causal_mask_function`, or a
`local_size` that is the config's sliding window; Llama-4-style chunked attention falls back
where its chunks cut keys), and whether the cache offset is a tensor (a static cache). The one
value it reads from the device is a few numbers per row of the 2-D padding mask, when the caller
passed one (`generate` always does): one device sync per forward, which transformers' SDPA mask
path pays too. While torch.compile traces, that mask is not read, and a given padding mask falls
back. The attention function then decides per layer from the mask (None, packed or not), shapes,
dtypes and keyword arguments only: no sync.

Where the op cannot express a call (a static cache's unused slots, a non-causal or custom mask,
chunked attention, a window over padding between tokens, dropout, a position bias, head dims
the op does not take, bfloat16 on CPU), the call falls back to transformers' SDPA
attention with one warning per reason (`AttnscopeFallbackWarning`) and is counted in `fallbacks`
(reason -> number of attention calls), or raises NotImplementedError after
`configure(on_unsupported="error")`. Logit softcapping (Gemma 2's `softcap`) runs in the op; a
softcapped call the op cannot take raises in both modes, since SDPA has no softcapping (use
attn_implementation="eager"), as does a call with attention sinks (GPT-OSS's `s_aux`), which
SDPA would silently drop. `output_attentions=True` warns once: no weights are formed, so the
attentions returned are None.

q, k, v arrive as [batch, heads, seq, head_dim] views; without padding the op reads them through
transposed views (layout "bshd", any strides) and writes its output contiguous as [batch, seq,
heads, head_dim], which is what transformers expects back, so nothing is copied. With padding the
real tokens are gathered once per layer (the packed op needs them contiguous in rows). K/V keep
their fewer heads (GQA).
"""

from __future__ import annotations

import itertools
import warnings
from collections import Counter
from typing import NamedTuple

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import causal_mask_function, sdpa_mask

from attnscope.attention.fused import DTYPES, MAX_HEAD_DIM, MIN_HEAD_DIM, fused_attention
from attnscope.attention.reference import window_mask
from attnscope.attention.varlen import fused_attention_varlen

NAME = "attnscope"

# Why a call cannot take the op: reason -> what the warning says.
REASONS = {
    "padding": "the padding mask cannot be packed here (shorter than the keys or the queries, "
               "or inside torch.compile)",
    "window_gaps": "a sliding window over a batch with padding between tokens (a window counts "
                   "positions, packing removes them)",
    "chunked_attention": "chunked attention (attention_chunk_size) cuts keys off",
    "static_cache": "the keys do not end at the last query (a static cache's unused slots or "
                    "offset on the device, or a mask longer than the sequence)",
    "mask_pattern": "transformers builds a mask beyond causal + sliding window here "
                    "(bidirectional, an overlay, packed sequences, or compiled static-cache "
                    "decode)",
    "user_mask": "the model was given a ready-made attention mask",
    "dropout": "attention dropout is on",
    "position_bias": "the model adds a position bias to the scores",
    "head_dim": f"the head dims are outside the op's range (q, k, v equal, {MIN_HEAD_DIM}.."
                f"{MAX_HEAD_DIM})",
    "dtype_device": "the dtype or device is not one the op runs (fp16/bf16/fp32 on CUDA; "
                    "fp16/fp32 on CPU)",
}
_MODES = ("fallback", "error")

fallbacks: Counter = Counter()  # reason -> attention calls that fell back; read it, clear it
_warned: set = set()
_settings = {"on_unsupported": "fallback"}


class AttnscopeFallbackWarning(UserWarning):
    """An attention call ran transformers' SDPA instead of attnscope's op (once per reason)."""


def configure(*, on_unsupported: str = "fallback") -> None:
    """Choose what a call the op cannot express does: "fallback" runs transformers' SDPA attention
    (one warning per reason, counted in `fallbacks`), "error" raises NotImplementedError."""
    if on_unsupported not in _MODES:
        raise ValueError(f"on_unsupported must be one of {_MODES}, got {on_unsupported!r}")
    _settings["on_unsupported"] = on_unsupported


def reset_fallbacks() -> None:
    """Zero the counters and warn again for every reason."""
    fallbacks.clear()
    _warned.clear()


# ---- the mask function: once per forward, per mask kind ---------------------------------------

class _Packing(NamedTuple):
    """Where a padded batch's real tokens sit, for fused_attention_varlen: (batch, position)
    index pairs of the real queries and keys, row-major as packed, and the cumulative lengths."""
    q_rows: tuple[torch.Tensor, torch.Tensor]
    k_rows: tuple[torch.Tensor, torch.Tensor]
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


def _is_chunked(local_size, config):
    # create_sliding_window_causal_mask and create_chunked_causal_mask both hand the mask
    # function a local_size; only the config says which one it is.
    return (getattr(config, "sliding_window", None) != local_size
            or getattr(config, "attention_chunk_size", None) == local_size)


def _packing(padding, q_length, windowed):
    """The packing of a [batch, kv_len] padding mask whose last q_length columns are the
    queries'; None when nothing is padded, "window_gaps" when a window cannot be packed."""
    batch, kv_length = padding.shape
    positions = torch.arange(kv_length, device=padding.device)
    k_lengths = padding.sum(1)
    q_lengths = padding[:, kv_length - q_length:].sum(1)
    first = torch.where(padding, positions, kv_length).amin(1)
    last = torch.where(padding, positions, -1).amax(1)
    # The one device read of the forward: four numbers per row.
    k_lengths, q_lengths, first, last = torch.stack([k_lengths, q_lengths, first, last]).tolist()
    if min(k_lengths) == kv_length:
        return None
    if windowed and any(n and b - a + 1 != n for n, a, b in zip(k_lengths, first, last)):
        return "window_gaps"
    q_padding = padding[:, kv_length - q_length:]
    total_q, total_k = sum(q_lengths), sum(k_lengths)
    # nonzero_static: the sizes are known on the host, so no second device read.
    q_rows = q_padding.nonzero_static(size=total_q).unbind(1)
    k_rows = padding.nonzero_static(size=total_k).unbind(1)
    cu = [torch.tensor([0, *itertools.accumulate(n)], dtype=torch.int32, device=padding.device)
          for n in (q_lengths, k_lengths)]
    return _Packing(q_rows, k_rows, *cu, max(q_lengths), max(k_lengths))


def _mask_plan(q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
               local_size, allow_is_causal_skip, config):
    """(reason, packing): reason None when the op can take the mask, else why not; packing
    None without padding, else the real tokens' _Packing."""
    if isinstance(q_offset, torch.Tensor):
        return "static_cache", None  # a static cache keeps its offset on the device: not read
    if not allow_is_causal_skip:
        return "mask_pattern", None
    if local_size is None and mask_function is not causal_mask_function:
        return "mask_pattern", None
    # Query i sits at position q_offset + i and sees keys kv_offset .. q_offset + i: bottom-right
    # alignment needs the last query and the last key at the same position.
    if q_offset + q_length != kv_offset + kv_length:
        return "static_cache", None
    windowed = local_size is not None and (kv_offset != 0 or kv_length > local_size)
    # Chunks cut nothing when every position sits in chunk 0.
    if windowed and _is_chunked(local_size, config):
        return "chunked_attention", None
    if attention_mask is None:
        return None, None
    padding = attention_mask[:, kv_offset:kv_offset + kv_length]
    if (padding.shape[-1] < kv_length or q_length > kv_length
            or torch.compiler.is_compiling()):
        # Shorter than the keys, queries without keys of their own (no padding for them), or
        # not readable while tracing.
        return "padding", None
    packing = _packing(padding.bool(), q_length, windowed)
    if packing == "window_gaps":
        return packing, None
    return None, packing


def create_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0,
                mask_function=causal_mask_function, attention_mask=None, local_size=None,
                allow_is_causal_skip=True, **kwargs):
    """transformers' mask interface for "attnscope": None for a causal mask aligned bottom-right
    (the attention function then runs the op), else SDPA's boolean mask [batch, 1, q, kv],
    carrying the packing of a padded batch or labelled with why the op cannot take it."""
    reason, packing = _mask_plan(q_length, kv_length, q_offset, kv_offset, mask_function,
                                 attention_mask, local_size, allow_is_causal_skip,
                                 kwargs.get("config"))
    if reason is None and packing is None:
        return None
    # Both skips off: SDPA must get the mask itself, since a None would read as plain causal.
    # A packed batch gets it too: a layer the op cannot take falls back with it.
    kwargs.pop("allow_is_bidirectional_skip", None)
    mask = sdpa_mask(batch_size, q_length, kv_length, q_offset=q_offset, kv_offset=kv_offset,
                     mask_function=mask_function, attention_mask=attention_mask,
                     local_size=local_size, allow_is_causal_skip=False,
                     allow_is_bidirectional_skip=False, **kwargs)
    if mask is not None:  # the label travels with the tensor to every layer that gets it
        mask._attnscope_reason = reason
        mask._attnscope_packing = packing
    return mask


# ---- the attention function: per layer ----------------------------------------------------------

def _layer_window(module, kwargs):
    """The layer's sliding window in keys (None: none): its `sliding_window` argument where the
    layer passes one (Mistral, Qwen2, Gemma 2), else what its config's `layer_types` says of it
    (a "sliding_attention" layer gets the sliding mask transformers built for that kind), else
    the layer's own `sliding_window` attribute (Qwen2-MoE sets it on its sliding layers only)."""
    if "sliding_window" in kwargs:
        return kwargs["sliding_window"]
    config = getattr(module, "config", None)
    layer_types = getattr(config, "layer_types", None)
    index = getattr(module, "layer_idx", None)
    if layer_types and isinstance(index, int) and 0 <= index < len(layer_types):
        if layer_types[index] == "sliding_attention":
            return getattr(config, "sliding_window", None)
        return None
    return getattr(module, "sliding_window", None)


def _call_reason(query, key, value, attention_mask, dropout, causal, window, kwargs):
    """None when the op can run this call, else the reason it cannot. No device reads."""
    if attention_mask is not None:
        reason = getattr(attention_mask, "_attnscope_reason", "user_mask")
        if reason is not None:
            return reason
    if window is not None and not causal:
        return "mask_pattern"  # a bidirectional window: transformers counts it another way
    if dropout:
        return "dropout"
    if kwargs.get("position_bias") is not None:
        return "position_bias"
    dims = {query.shape[-1], key.shape[-1], value.shape[-1]}
    if len(dims) != 1 or not MIN_HEAD_DIM <= dims.pop() <= MAX_HEAD_DIM:
        return "head_dim"
    device = query.device.type
    if (query.dtype not in DTYPES or device not in ("cuda", "cpu")
            or (device == "cpu" and query.dtype == torch.bfloat16)):
        return "dtype_device"
    return None


def _fall_back(reason, module, query, key, value, attention_mask, dropout, scaling, is_causal,
               causal, window, kwargs):
    what = REASONS[reason]
    if kwargs.get("softcap") is not None:
        raise NotImplementedError(
            f"attn_implementation='attnscope' cannot run this softcapped attention call ({what}), "
            f"and transformers' SDPA attention has no softcapping: use "
            f"attn_implementation='eager'")
    if _settings["on_unsupported"] == "error":
        raise NotImplementedError(
            f"attn_implementation='attnscope' cannot run this attention call: {what}. "
            f"configure(on_unsupported='fallback') runs transformers' SDPA attention instead")
    fallbacks[reason] += 1
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"attnscope: {what}; these calls run transformers' SDPA attention "
                      f"(counted in attnscope.integrations.transformers.fallbacks[{reason!r}])",
                      AttnscopeFallbackWarning, stacklevel=3)
    if attention_mask is None and causal and (window is not None
                                              or 1 < query.shape[2] != key.shape[2]):
        # SDPA reads no mask as causal from the top left and knows no window (one query with
        # none sees every key there, as bottom-right: no mask, so SDPA keeps its fused kernels):
        # the mask a None stands for here (the mask function's contract), [1, 1, q, kv]
        attention_mask = window_mask(query.shape[2], key.shape[2], "bottom_right",
                                     (-1 if window is None else window - 1, 0), causal=True,
                                     device=query.device)[None, None]
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, is_causal=is_causal, **kwargs)


def _packed_attention(packing, query, key, value, **op_kwargs):
    """The op on a padded batch: gather the real tokens, run the packed op, scatter back."""
    # [batch, seq, heads, head_dim] views, indexed by (batch, position) pairs: one gather each.
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    packed = fused_attention_varlen(q[packing.q_rows], k[packing.k_rows], v[packing.k_rows],
                                    packing.cu_seqlens_q, packing.cu_seqlens_k,
                                    packing.max_seqlen_q, packing.max_seqlen_k, **op_kwargs)
    out = q.new_zeros(q.shape)  # padding rows: zeros
    return out.index_put(packing.q_rows, packed)


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      is_causal=None, **kwargs):
    """transformers' attention interface for "attnscope". q [batch, heads, q_len, head_dim],
    k/v [batch, kv_heads, kv_len, head_dim]; returns ([batch, q_len, heads, head_dim], None).

    A None mask means causal aligned bottom-right, a mask carrying a packing a padded batch, any
    other mask one the op cannot express (see the module docstring). The window (W keys, the
    query's own included) is _layer_window's; `softcap` comes from the layer's keyword
    arguments."""
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise NotImplementedError(
            "attn_implementation='attnscope' cannot run attention with sinks (the model's "
            "s_aux / sinks), and transformers' SDPA attention would drop them: use "
            "attn_implementation='eager'")
    if kwargs.get("output_attentions") and "output_attentions" not in _warned:
        _warned.add("output_attentions")
        warnings.warn("attnscope: output_attentions=True is not supported (the op never forms "
                      "the attention weights); the attentions returned are None",
                      UserWarning, stacklevel=2)
    # As SDPA: the call's flag first, then the layer's (an encoder layer says False).
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    window = _layer_window(module, kwargs)
    reason = _call_reason(query, key, value, attention_mask, dropout, causal, window, kwargs)
    if reason is not None:
        return _fall_back(reason, module, query, key, value, attention_mask, dropout, scaling,
                          is_causal, causal, window, kwargs)
    softcap = kwargs.get("softcap")
    op_kwargs = dict(causal=causal, scale=scaling,
                     window=(-1, -1) if window is None else (window - 1, 0),
                     softcap=float(softcap or 0.0))
    packing = getattr(attention_mask, "_attnscope_packing", None)
    if packing is not None:
        return _packed_attention(packing, query, key, value, **op_kwargs), None
    out = fused_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                          layout="bshd", causal_alignment="bottom_right", **op_kwargs)
    return out, None


AttentionInterface.register(NAME, attention_forward)
AttentionMaskInterface.register(NAME, create_mask)
