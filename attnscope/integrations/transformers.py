"""attnscope as a transformers attention backend: `attn_implementation="attnscope"`.

    import attnscope.integrations.transformers
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="attnscope")

Importing this module registers two functions under the name "attnscope" in transformers' public
registries, and both are needed:

- the attention function (`AttentionInterface`), which runs `attnscope.fused_attention` on a layer
  whose mask is plain causal, and transformers' SDPA function otherwise;
- the mask function (`AttentionMaskInterface`). transformers hands a custom attention function no
  mask at all unless a mask function is registered under the same name, so without it a padded
  batch would attend to its padding, silently.

The contract between the two: the mask function returns None exactly when the layer's mask is
plain causal with the queries being the *last* q_len of the kv_len key positions (bottom-right
alignment, flash-attn's convention, which transformers' flash-attention backends share): prefill,
chunked prefill and KV-cache decode. Anything else gets transformers' own SDPA boolean mask,
materialized and labelled with the reason, and the attention function hands that to SDPA.

What decides "plain causal", and what it costs. The mask function runs once per model forward per
mask kind (full / sliding), not per layer, and decides from Python integers transformers gives it:
query and key lengths and offsets (the queries must end where the keys end), `allow_is_causal_skip`
(False when transformers adds anything to the causal pattern: overlays, packed sequences,
bidirectional masks, compiled static-cache decode), the mask pattern (`causal_mask_function`, or a
sliding window / chunk size `local_size` that cuts no key), and whether the cache offset is a tensor
(a static cache). The one value it reads from the device is the 2-D padding mask, when the caller
passed one (`generate` always does): `.all()` over it, one device sync per forward, which
transformers' SDPA mask path pays too. While torch.compile traces, that mask is not read, and a
given padding mask falls back. The attention function then decides per layer from the mask
(None or not), shapes, dtypes and keyword arguments only: no sync.

Where the op cannot express a call (padding until a varlen path exists, a sliding window that
binds, a static cache's unused slots, a non-causal or custom mask, dropout, a position bias,
attention sinks, head dims the op does not take, bfloat16 on CPU), the call falls back to
transformers' SDPA attention with one warning per reason (`AttnscopeFallbackWarning`) and is
counted in `fallbacks` (reason -> number of attention calls), or raises NotImplementedError after
`configure(on_unsupported="error")`. Logit softcapping is refused in both modes: SDPA cannot do it
either (use attn_implementation="eager").

q, k, v arrive as [batch, heads, seq, head_dim] views; the op reads them through transposed views
(layout "bshd", any strides) and writes its output contiguous as [batch, seq, heads, head_dim],
which is what transformers expects back, so nothing is copied. K/V keep their fewer heads (GQA).
"""

from __future__ import annotations

import warnings
from collections import Counter

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import causal_mask_function, sdpa_mask

from attnscope.attention.fused import DTYPES, MAX_HEAD_DIM, MIN_HEAD_DIM, fused_attention

NAME = "attnscope"

# Why a call cannot take the op: reason -> what the warning says.
REASONS = {
    "padding": "the batch has padding tokens (the op has no packed-sequence path yet)",
    "sliding_window": "the sliding window (or attention chunk) cuts keys off",
    "static_cache": "the cache holds slots past the last query (a static cache)",
    "mask_pattern": "transformers builds a mask beyond plain causal here (bidirectional, an "
                    "overlay, packed sequences, or compiled static-cache decode)",
    "user_mask": "the model was given a ready-made attention mask",
    "dropout": "attention dropout is on",
    "position_bias": "the model adds a position bias to the scores",
    "attention_sinks": "the model uses attention sinks",
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

def _mask_reason(q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                 local_size, allow_is_causal_skip):
    """None when the mask is plain causal aligned bottom-right, else the reason it is not."""
    if isinstance(q_offset, torch.Tensor):
        return "static_cache"  # a static cache keeps its offset on the device: not read
    if not allow_is_causal_skip:
        return "mask_pattern"
    if local_size is None and mask_function is not causal_mask_function:
        return "mask_pattern"
    # Query i sits at position q_offset + i and sees keys kv_offset .. q_offset + i: bottom-right
    # alignment needs the last query and the last key at the same position.
    if q_offset + q_length != kv_offset + kv_length:
        return "static_cache"
    # A window of local_size cuts nothing when every key position is within it of every query
    # (the largest distance is kv_length - 1) and, for chunks, when all positions sit in chunk 0.
    if local_size is not None and (kv_offset != 0 or kv_length > local_size):
        return "sliding_window"
    if attention_mask is not None:
        window = attention_mask[:, kv_offset:kv_offset + kv_length]
        if window.shape[-1] < kv_length or torch.compiler.is_compiling():
            return "padding"  # shorter than the keys, or not readable while tracing
        if not bool(window.all()):  # the one device read: once per forward, not per layer
            return "padding"
    return None


def create_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0,
                mask_function=causal_mask_function, attention_mask=None, local_size=None,
                allow_is_causal_skip=True, **kwargs):
    """transformers' mask interface for "attnscope": None for a plain bottom-right causal mask
    (the attention function then runs the op), else SDPA's boolean mask [batch, 1, q, kv],
    labelled with why the op cannot take it."""
    reason = _mask_reason(q_length, kv_length, q_offset, kv_offset, mask_function,
                          attention_mask, local_size, allow_is_causal_skip)
    if reason is None:
        return None
    # Both skips off: SDPA must get the mask itself, since a None would read as plain causal.
    kwargs.pop("allow_is_bidirectional_skip", None)
    mask = sdpa_mask(batch_size, q_length, kv_length, q_offset=q_offset, kv_offset=kv_offset,
                     mask_function=mask_function, attention_mask=attention_mask,
                     local_size=local_size, allow_is_causal_skip=False,
                     allow_is_bidirectional_skip=False, **kwargs)
    if mask is not None:  # the label travels with the tensor to every layer that gets it
        mask._attnscope_reason = reason
    return mask


# ---- the attention function: per layer ----------------------------------------------------------

def _call_reason(query, key, value, attention_mask, dropout, kwargs):
    """None when the op can run this call, else the reason it cannot. No device reads."""
    if attention_mask is not None:
        return getattr(attention_mask, "_attnscope_reason", "user_mask")
    if dropout:
        return "dropout"
    if kwargs.get("position_bias") is not None:
        return "position_bias"
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        return "attention_sinks"
    dims = {query.shape[-1], key.shape[-1], value.shape[-1]}
    if len(dims) != 1 or not MIN_HEAD_DIM <= dims.pop() <= MAX_HEAD_DIM:
        return "head_dim"
    device = query.device.type
    if (query.dtype not in DTYPES or device not in ("cuda", "cpu")
            or (device == "cpu" and query.dtype == torch.bfloat16)):
        return "dtype_device"
    return None


def _fall_back(reason, module, query, key, value, attention_mask, dropout, scaling, is_causal,
               kwargs):
    what = REASONS[reason]
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
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, is_causal=is_causal, **kwargs)


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      is_causal=None, **kwargs):
    """transformers' attention interface for "attnscope". q [batch, heads, q_len, head_dim],
    k/v [batch, kv_heads, kv_len, head_dim]; returns ([batch, q_len, heads, head_dim], None).

    A None mask means plain causal aligned bottom-right (see the module docstring); a mask means
    the op cannot express it."""
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("attn_implementation='attnscope' has no logit softcapping, and "
                                  "transformers' SDPA attention has none either: use "
                                  "attn_implementation='eager'")
    reason = _call_reason(query, key, value, attention_mask, dropout, kwargs)
    if reason is not None:
        return _fall_back(reason, module, query, key, value, attention_mask, dropout, scaling,
                          is_causal, kwargs)
    # As SDPA: the call's flag first, then the layer's (an encoder layer says False).
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    out = fused_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                          causal=bool(causal), scale=scaling, layout="bshd",
                          causal_alignment="bottom_right")
    return out, None


AttentionInterface.register(NAME, attention_forward)
AttentionMaskInterface.register(NAME, create_mask)
