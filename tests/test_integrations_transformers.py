"""attn_implementation="attnscope" in transformers: tiny random-init models (built from configs, no
download) against the same weights under transformers' "sdpa" backend and a float64 copy of it.

Error bounds follow FlashAttention's tests: our error against the float64 model is at most twice
SDPA's own error at the same dtype, plus a floor (stated where used) for the cases where SDPA's
error is near zero. The CPU tests run the Triton interpreter, so models and sequences are tiny;
GPU tests (marked cuda) repeat the checks in bfloat16 at a small realistic size.
"""

import copy
import inspect
import types
import warnings

import pytest
import torch

pytest.importorskip("transformers")
hf = pytest.importorskip("attnscope.integrations.transformers")

from attnscope.attention import fused  # noqa: E402
from fused_checks import nan_empty  # noqa: E402
from transformers import (AutoModelForCausalLM, DynamicCache, LlamaConfig,  # noqa: E402
                          LlamaForCausalLM, MistralConfig, Qwen2Config)
from transformers.masking_utils import (bidirectional_mask_function,  # noqa: E402
                                        causal_mask_function, sdpa_mask,
                                        sliding_window_causal_mask_function)

try:  # Gemma 2 (logit softcapping) arrived in transformers 4.42
    from transformers import Gemma2Config
except ImportError:
    Gemma2Config = None

# The forward's cache argument was renamed (past_key_values -> cache, transformers 5.2x).
_CACHE = ("cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters
          else "past_key_values")

# head_dim 32 with 2 q heads on 1 k/v head (GQA): each op launch is 2 programs per sequence,
# which keeps the interpreter's time small. initializer_range 0.1 (not 0.02) makes attention
# peaked enough that a wrong mask or alignment moves the logits far past the tolerances.
TINY = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
            num_hidden_layers=2, intermediate_size=128, vocab_size=128,
            max_position_embeddings=64, initializer_range=0.1, pad_token_id=0,
            eos_token_id=None, bos_token_id=None)


@pytest.fixture(autouse=True)
def _fresh_state():
    hf.configure(on_unsupported="fallback")
    hf.reset_fallbacks()
    yield
    hf.configure(on_unsupported="fallback")
    hf.reset_fallbacks()


@pytest.fixture
def op_calls(monkeypatch):
    """(q shape, k shape, q data pointer) of every call that reached attnscope's op, q/k in the
    op's bshd view."""
    calls = []
    op = hf.fused_attention

    def spy(q, k, v, **kwargs):
        calls.append((tuple(q.shape), tuple(k.shape), q.data_ptr()))
        return op(q, k, v, **kwargs)

    monkeypatch.setattr(hf, "fused_attention", spy)
    return calls


@pytest.fixture
def varlen_calls(monkeypatch):
    """(packed q shape, packed k shape, cu_seqlens_q, cu_seqlens_k, window) of every call that
    reached the packed op."""
    calls = []
    op = hf.fused_attention_varlen

    def spy(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
        calls.append((tuple(q.shape), tuple(k.shape), cu_q.tolist(), cu_k.tolist(),
                      kwargs["window"]))
        return op(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)

    monkeypatch.setattr(hf, "fused_attention_varlen", spy)
    return calls


@pytest.fixture
def no_fallback():
    """Turns a fallback warning into an error: the test's calls must all take the op."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", hf.AttnscopeFallbackWarning)
        yield


def _models(config_cls, dtype=torch.float32, device="cpu", **overrides):
    """(sdpa, attnscope, float64 sdpa reference) models with one set of random weights."""
    config = config_cls(**{**TINY, **overrides})
    torch.manual_seed(0)
    # Each model gets its own config: transformers writes the attention implementation into it,
    # and a shared one would switch both models to the last one set.
    sdpa = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa")
    ours = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="attnscope")
    ours.load_state_dict(sdpa.state_dict())
    reference = copy.deepcopy(sdpa).to(device, torch.float64).eval()
    return sdpa.to(device, dtype).eval(), ours.to(device, dtype).eval(), reference


def _chunked_prefill(model, ids, split):
    """Logits of ids[:, split:] run on a cache that holds ids[:, :split]."""
    cache = DynamicCache()
    with torch.no_grad():
        model(ids[:, :split], use_cache=True, **{_CACHE: cache})
        return model(ids[:, split:], use_cache=True, **{_CACHE: cache}).logits


def _gradients(models, ids, mask=None):
    """All parameter gradients of each model's language-model loss, flattened into one vector.
    With a padding `mask`, the padding tokens carry no loss (label -100)."""
    labels = ids if mask is None else ids.masked_fill(mask == 0, -100)
    grads = []
    for model in models:
        model.train()  # attention_dropout is 0.0: training mode changes nothing in attention
        model.zero_grad()
        model(ids, attention_mask=mask, labels=labels).loss.backward()
        grads.append(torch.cat([p.grad.double().flatten() for p in model.parameters()]))
    return grads


def _tokens(batch, length, seed=1):
    return torch.randint(1, TINY["vocab_size"], (batch, length),
                         generator=torch.Generator().manual_seed(seed))


def _assert_within(ours, sdpa, reference, floor):
    err_ours = (ours.double() - reference).abs().max().item()
    err_sdpa = (sdpa.double() - reference).abs().max().item()
    assert err_ours <= 2 * err_sdpa + floor, (err_ours, err_sdpa)


# fp32: both paths round differently from float64 by ~1e-7 relative; the floor 1e-5 is a few
# ulps of fp32 logits of magnitude ~10 and stays far below the ~1e-1 a wrong mask causes.
# fp16: SDPA's own error is the scale (~1e-3); the floor 2e-3 is one fp16 ulp at magnitude ~4.
@pytest.mark.parametrize("dtype, floor", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_llama_prefill_logits_match_sdpa(dtype, floor, op_calls):
    sdpa, ours, reference = _models(LlamaConfig, dtype, num_attention_heads=4,
                                    num_key_value_heads=2)
    ids = _tokens(2, 9)  # 9: not a multiple of any block size
    with torch.no_grad():
        _assert_within(ours(ids).logits, sdpa(ids).logits, reference(ids).logits, floor)
    assert len(op_calls) == TINY["num_hidden_layers"] and not hf.fallbacks
    # GQA reaches the op unrepeated: 4 q heads, 2 k/v heads (bshd view).
    assert op_calls[0][:2] == ((2, 9, 4, 32), (2, 9, 2, 32))


def test_llama_greedy_generation_is_identical(op_calls):
    sdpa, ours, _ = _models(LlamaConfig)
    ids = _tokens(1, 5)
    expected = sdpa.generate(ids, max_new_tokens=6, do_sample=False)
    got = ours.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, expected)
    assert not hf.fallbacks
    # Decode steps took the op with one query on a longer cache: bottom-right alignment.
    assert ((1, 1, 2, 32), (1, 10, 1, 32)) in [call[:2] for call in op_calls]


def test_chunked_prefill_takes_the_op_bottom_right(op_calls):
    sdpa, ours, reference = _models(LlamaConfig)
    ids = _tokens(1, 9)
    logits = [_chunked_prefill(model, ids, 5) for model in (ours, sdpa, reference)]
    _assert_within(*logits, floor=1e-5)  # floor as in the prefill test
    assert ((1, 4, 2, 32), (1, 9, 1, 32)) in [call[:2] for call in op_calls]
    assert not hf.fallbacks


def _padding(ids, side, pads=(3, 1)):
    """A padding mask over ids: row r padded by pads[r] on `side` (by default row 0 by 3, row 1
    by 1), the rows after them not at all."""
    mask = torch.ones_like(ids)
    for row, pad in enumerate(pads):
        if side == "left":
            mask[row, :pad] = 0
        else:
            mask[row, mask.shape[1] - pad:] = 0
    return mask


# Floors as in the prefill test.
@pytest.mark.parametrize("dtype, floor", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_takes_the_packed_op(dtype, floor, side, op_calls, varlen_calls,
                                          no_fallback):
    sdpa, ours, reference = _models(LlamaConfig, dtype)
    ids = _tokens(3, 9)
    mask = _padding(ids, side)
    real = mask.bool()
    with torch.no_grad():
        logits = [model(ids, attention_mask=mask).logits[real]
                  for model in (ours, sdpa, reference)]
    _assert_within(*logits, floor)
    assert not hf.fallbacks and not op_calls
    # Only the real tokens reached the op: 6 + 8 + 9, packed, GQA unrepeated.
    assert varlen_calls[0][:4] == ((23, 2, 32), (23, 1, 32), [0, 6, 14, 23], [0, 6, 14, 23])
    assert len(varlen_calls) == TINY["num_hidden_layers"]
    # An all-ones mask is no padding: the batched op runs.
    with torch.no_grad():
        ours(ids, attention_mask=torch.ones_like(ids))
    assert len(op_calls) == TINY["num_hidden_layers"]


def test_padded_greedy_generation_is_identical(varlen_calls, no_fallback):
    sdpa, ours, _ = _models(LlamaConfig)
    ids = _tokens(3, 6)
    mask = _padding(ids, "left")  # generation pads on the left: new tokens follow real ones
    kwargs = dict(attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert torch.equal(ours.generate(ids, **kwargs), sdpa.generate(ids, **kwargs))
    assert not hf.fallbacks
    # Decode steps packed one query per row on each row's real keys (cache + new tokens).
    assert ((3, 2, 32), (3 * 10 - 4, 1, 32), [0, 1, 2, 3], [0, 7, 16, 26], (-1, -1)) in \
        varlen_calls


def test_padded_gradients_match_sdpa(varlen_calls, no_fallback):
    sdpa, ours, reference = _models(LlamaConfig)
    ids = _tokens(3, 7)
    # Right padding: SDPA's padding rows then see real keys and stay finite (left-padded ones see
    # none); no loss on them, and no real token attends to them, so the gradients must agree.
    mask = _padding(ids, "right")
    grads = _gradients((ours, sdpa, reference), ids, mask)
    _assert_within(*grads, floor=1e-6)  # floor as in test_gradients_match_sdpa
    assert varlen_calls and not hf.fallbacks


def test_on_unsupported_error_raises_instead_of_falling_back():
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 4, 32, generator=gen) for _ in range(3))
    hf.configure(on_unsupported="error")
    with pytest.raises(NotImplementedError, match="dropout"):
        hf.attention_forward(_Layer(), q, k, v, None, dropout=0.5)
    assert not hf.fallbacks
    with pytest.raises(ValueError, match="on_unsupported must be one of"):
        hf.configure(on_unsupported="ignore")


def test_gradients_match_sdpa(op_calls):
    sdpa, ours, reference = _models(LlamaConfig)
    # Floor: 1e-6 on gradients of magnitude ~1e-1, a few fp32 ulps; a wrong backward is ~1e-2 off.
    _assert_within(*_gradients((ours, sdpa, reference), _tokens(2, 7)), floor=1e-6)
    assert len(op_calls) == TINY["num_hidden_layers"] and not hf.fallbacks


@pytest.mark.parametrize("overrides", [
    {},
    # layer 1 (from max_window_layers on) slides a window of 4 over the 6 + 4 tokens
    dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),
], ids=["full", "sliding_layer"])
def test_qwen2_logits_and_generation(overrides, op_calls):
    sdpa, ours, reference = _models(Qwen2Config, **overrides)
    ids = _tokens(1, 6)
    with torch.no_grad():
        _assert_within(ours(ids).logits, sdpa(ids).logits, reference(ids).logits, 1e-5)
    expected = sdpa.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(ours.generate(ids, max_new_tokens=4, do_sample=False), expected)
    assert op_calls and not hf.fallbacks


def test_mistral_sliding_window_takes_the_op(op_calls, varlen_calls, no_fallback):
    # A window of 4 keys over 9 tokens cuts keys off, in prefill and in every decode step.
    sdpa, ours, reference = _models(MistralConfig, sliding_window=4)
    ids = _tokens(2, 9)
    with torch.no_grad():
        _assert_within(ours(ids).logits, sdpa(ids).logits, reference(ids).logits, 1e-5)
    assert len(op_calls) == TINY["num_hidden_layers"]
    # Left-padded generation: the window and the packing together.
    mask = _padding(ids, "left")[:2]
    kwargs = dict(attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(ours.generate(ids, **kwargs), sdpa.generate(ids, **kwargs))
    assert varlen_calls and {call[4] for call in varlen_calls} == {(3, 0)}
    assert not hf.fallbacks


def test_window_with_padding_between_tokens_falls_back():
    # Padding inside a row moves positions apart, and a window counts positions: SDPA runs it.
    sdpa, ours, _ = _models(MistralConfig, sliding_window=3)
    ids = _tokens(2, 7)
    mask = torch.ones_like(ids)
    mask[0, 2:4] = 0
    with torch.no_grad(), pytest.warns(hf.AttnscopeFallbackWarning, match="padding between"):
        got = ours(ids, attention_mask=mask).logits
        expected = sdpa(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], rtol=0, atol=1e-6)  # same SDPA call
    assert hf.fallbacks == {"window_gaps": TINY["num_hidden_layers"]}


@pytest.mark.skipif(Gemma2Config is None, reason="this transformers has no Gemma 2")
def test_gemma2_softcap_and_local_layers_match_eager(op_calls, no_fallback):
    # Gemma 2 alternates sliding (window 4 here) and full layers and caps the logits; SDPA has no
    # softcap, so transformers' eager attention is the peer. softcap 1.0 (Gemma 2 uses 50.0) caps
    # the scores hard at this scale: without it the logits move by ~0.5.
    config = Gemma2Config(**TINY, sliding_window=4, attn_logit_softcapping=1.0,
                          query_pre_attn_scalar=32)
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager")
    ours = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="attnscope")
    ours.load_state_dict(eager.state_dict())
    reference = copy.deepcopy(eager).double().eval()
    ids = _tokens(2, 9)
    with torch.no_grad():
        logits = [model.eval()(ids).logits for model in (ours, eager, reference)]
    _assert_within(*logits, floor=1e-5)  # floor as in the prefill test
    assert len(op_calls) == TINY["num_hidden_layers"] and not hf.fallbacks


def test_static_cache_generation_falls_back_and_matches():
    sdpa, ours, _ = _models(LlamaConfig)
    ids = _tokens(1, 5)
    kwargs = dict(max_new_tokens=3, do_sample=False, cache_implementation="static")
    expected = sdpa.generate(ids, **kwargs)
    with pytest.warns(hf.AttnscopeFallbackWarning):
        got = ours.generate(ids, **kwargs)
    assert torch.equal(got, expected)
    assert hf.fallbacks["static_cache"] > 0


@pytest.mark.parametrize("overrides, run", [
    (dict(config_cls=LlamaConfig), "chunked"),  # 4 queries on 9 keys: bottom-right
    (dict(config_cls=MistralConfig, sliding_window=4), "prefill"),  # the window cuts keys
])
def test_fallback_keeps_bottom_right_alignment_and_the_window(overrides, run):
    # head_dim 8 is below the op's range: every layer falls back to SDPA with the mask of None
    # the mask function gave, which SDPA alone would read as top-left causal without a window.
    sdpa, ours, reference = _models(**{**overrides, "head_dim": 8})
    ids = _tokens(1, 9)
    if run == "chunked":
        logits = [_chunked_prefill(model, ids, 5) for model in (ours, sdpa, reference)]
    else:
        with torch.no_grad():
            logits = [model(ids).logits for model in (ours, sdpa, reference)]
    _assert_within(*logits, floor=1e-5)
    assert hf.fallbacks["head_dim"] > 0


# ---- the mask function alone (no kernel) ---------------------------------------------------------

def _mask(**kwargs):
    args = dict(batch_size=2, q_length=4, kv_length=9, q_offset=5, kv_offset=0,
                mask_function=causal_mask_function, attention_mask=None, local_size=None,
                allow_is_causal_skip=True, device="cpu")
    return hf.create_mask(**{**args, **kwargs})


@pytest.mark.parametrize("kwargs", [
    {},  # chunked prefill: 4 queries ending where the 9 keys end
    dict(q_length=1, kv_length=9, q_offset=8),  # decode
    dict(q_length=9, q_offset=0),  # prefill
    dict(attention_mask=torch.ones(2, 9, dtype=torch.bool)),  # a mask without padding
    dict(local_size=9),  # a window (or chunk) as long as the keys cuts nothing
    dict(local_size=4, config=MistralConfig(sliding_window=4)),  # the layer passes the window
], ids=["chunked", "decode", "prefill", "no_padding", "window_cuts_nothing", "window"])
def test_mask_function_returns_none_for_plain_bottom_right_causal(kwargs):
    assert _mask(**kwargs) is None


@pytest.mark.parametrize("kwargs, reason", [
    (dict(kv_length=16), "static_cache"),  # 7 unused slots past the last query
    (dict(q_offset=torch.tensor(5)), "static_cache"),  # offset kept on the device
    (dict(local_size=8), "chunked_attention"),  # no config saying it is a sliding window
    (dict(local_size=4, config=MistralConfig(sliding_window=3)), "chunked_attention"),
    (dict(allow_is_causal_skip=False), "mask_pattern"),
    (dict(mask_function=bidirectional_mask_function), "mask_pattern"),
    (dict(attention_mask=torch.ones(2, 7, dtype=torch.bool)), "padding"),  # shorter than keys
    (dict(attention_mask=torch.tensor([[1] * 9, [1, 0] + [1] * 7], dtype=torch.bool),
          local_size=4, config=MistralConfig(sliding_window=4)), "window_gaps"),
], ids=["unused_slots", "tensor_offset", "chunk", "chunk_not_window", "no_skip", "bidirectional",
        "short_padding", "window_gaps"])
def test_mask_function_materializes_and_labels_what_the_op_cannot_express(kwargs, reason):
    mask = _mask(**kwargs)
    assert mask._attnscope_reason == reason
    args = dict(batch_size=2, q_length=4, kv_length=9, q_offset=5, kv_offset=0,
                mask_function=causal_mask_function, attention_mask=None, device="cpu")
    args.update({k: v for k, v in kwargs.items() if k != "allow_is_causal_skip"})
    torch.testing.assert_close(mask, sdpa_mask(allow_is_causal_skip=False, **args))


# ---- the attention function alone ----------------------------------------------------------------

class _Layer(torch.nn.Module):
    is_causal = True


def test_attention_function_reads_views_and_returns_bshd(op_calls):
    gen = torch.Generator().manual_seed(2)
    # q_len 3 on 8 keys (a chunk after a cache), 4 q heads on 2 k/v heads, head_dim 48 (not a
    # power of two), q built as transformers does: a projection viewed and transposed.
    q = torch.randn(2, 3, 4 * 48, generator=gen).view(2, 3, 4, 48).transpose(1, 2)
    k, v = (torch.randn(2, 2, 8, 48, generator=gen) for _ in range(2))
    out, weights = hf.attention_forward(_Layer(), q, k, v, None, scaling=0.2)
    assert weights is None and out.shape == (2, 3, 4, 48) and out.is_contiguous()
    keep = torch.ones(3, 8, dtype=torch.bool).tril(diagonal=8 - 3)  # bottom-right causal
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1),
        attn_mask=keep, scale=0.2).transpose(1, 2)
    # fp32 through online softmax: ~1e-6 from float64 at these magnitudes.
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-5)
    # The op read q where transformers left it: a transposed view, not a copy.
    assert op_calls == [((2, 3, 4, 48), (2, 8, 2, 48), q.data_ptr())]


def _qkv(seed, batch=2, q_len=3, kv_len=8):
    """q as transformers builds it (a projection viewed and transposed), k/v as a cache holds
    them: 4 q heads on 2 k/v heads, head_dim 32."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_len, 4 * 32, generator=gen).view(batch, q_len, 4, 32).transpose(1, 2)
    k, v = (torch.randn(batch, 2, kv_len, 32, generator=gen) for _ in range(2))
    return q, k, v


def _sdpa_reference(q, k, v, keep, scale=None):
    """float64 SDPA under a boolean mask, in transformers' output layout."""
    return torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1),
        attn_mask=keep, scale=scale).transpose(1, 2)


@pytest.mark.parametrize("window", [1, 3, 6])  # 1: the query's own key only; 6 cuts 2 of 8
def test_attention_function_window_counts_keys_as_transformers(window):
    q, k, v = _qkv(5)  # 3 queries after 5 cached keys: the window counted bottom-right
    keep = sdpa_mask(batch_size=1, q_length=3, kv_length=8, q_offset=5,
                     mask_function=sliding_window_causal_mask_function(window),
                     allow_is_causal_skip=False, device="cpu")
    out, _ = hf.attention_forward(_Layer(), q, k, v, None, sliding_window=window)
    # fp32 through online softmax: ~1e-6 from float64 at these magnitudes.
    torch.testing.assert_close(out.double(), _sdpa_reference(q, k, v, keep), rtol=0, atol=1e-5)


class _TypedLayer(torch.nn.Module):
    """A layer that passes no sliding_window argument, as Qwen2-MoE's: its config's layer_types
    say which kind of mask it gets."""
    is_causal = True

    def __init__(self, layer_idx, window=3):
        super().__init__()
        self.layer_idx = layer_idx
        self.config = types.SimpleNamespace(
            sliding_window=window, layer_types=["sliding_attention", "full_attention"])


@pytest.mark.parametrize("layer_idx, window", [(0, 3), (1, None)])
def test_attention_function_takes_the_window_of_the_layer_type(layer_idx, window):
    q, k, v = _qkv(8)  # 3 queries after 5 cached keys
    mask_function = (causal_mask_function if window is None
                     else sliding_window_causal_mask_function(window))
    keep = sdpa_mask(batch_size=1, q_length=3, kv_length=8, q_offset=5,
                     mask_function=mask_function, allow_is_causal_skip=False, device="cpu")
    out, _ = hf.attention_forward(_TypedLayer(layer_idx), q, k, v, None)
    torch.testing.assert_close(out.double(), _sdpa_reference(q, k, v, keep), rtol=0, atol=1e-5)


def test_attention_sinks_raise_and_output_attentions_warns():
    q, k, v = _qkv(9)
    # SDPA would drop the sinks: neither path can run the call
    with pytest.raises(NotImplementedError, match="sinks"):
        hf.attention_forward(_Layer(), q, k, v, None, s_aux=torch.zeros(4))
    with pytest.warns(UserWarning, match="output_attentions"):
        out, weights = hf.attention_forward(_Layer(), q, k, v, None, output_attentions=True)
    assert weights is None and out.shape == (2, 3, 4, 32)


def test_attention_function_softcap():
    q, k, v = _qkv(6, q_len=5, kv_len=5)
    q = q * 4  # scores of several units, so that softcap 2.0 changes them
    out, _ = hf.attention_forward(_Layer(), q, k, v, None, scaling=0.5, softcap=2.0)
    scores = q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2) * 0.5
    scores = (2.0 * torch.tanh(scores / 2.0)).masked_fill(
        ~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf"))
    expected = (scores.softmax(-1) @ v.double().repeat_interleave(2, 1)).transpose(1, 2)
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-5)  # fp32, as above
    # A softcapped call the op cannot take has nowhere to go: SDPA has no softcap.
    with pytest.raises(NotImplementedError, match="softcap"):
        hf.attention_forward(_Layer(), q, k, v, None, softcap=2.0, dropout=0.5)


def test_attention_function_packs_a_padded_decode_and_zeroes_padding_rows(monkeypatch):
    monkeypatch.setattr(fused, "_empty", nan_empty)  # an element the kernel skips would show
    q, k, v = _qkv(7, batch=3, q_len=2, kv_len=8)
    # Row 0 left-padded by 3, row 1 right-padded (its last query is padding), row 2 all padding.
    padding = torch.tensor([[0] * 3 + [1] * 5, [1] * 7 + [0], [0] * 8], dtype=torch.bool)
    mask = hf.create_mask(3, 2, 8, q_offset=6, attention_mask=padding, device="cpu")
    assert mask._attnscope_reason is None and mask._attnscope_packing.max_seqlen_k == 7
    out, _ = hf.attention_forward(_Layer(), q, k, v, mask)
    real_q = padding[:, 6:]
    assert (out[~real_q] == 0).all()
    keep = mask & real_q[:, None, :, None]  # SDPA's rows for padding queries are not compared
    expected = _sdpa_reference(q, k, v, keep).nan_to_num()
    torch.testing.assert_close(out.double()[real_q], expected[real_q], rtol=0, atol=1e-5)


# ---- GPU: bfloat16 at a small realistic size ----------------------------------------------------

# Llama-like proportions at 4 layers: head_dim 128 (the Hopper kernel's), 16 q heads on 4 k/v heads
# (initializer_range stays TINY's 0.1: peaked attention, so a wrong mask moves logits by O(1)).
GPU = dict(hidden_size=1024, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
           num_hidden_layers=4, intermediate_size=2816, vocab_size=1024,
           max_position_embeddings=2048)


def _gpu_models(config_cls):
    return _models(config_cls, torch.bfloat16, "cuda", **GPU)


@pytest.mark.cuda
@pytest.mark.parametrize("config_cls", [LlamaConfig, Qwen2Config, MistralConfig])
def test_gpu_bf16_logits_and_chunked_prefill(config_cls, op_calls):
    sdpa, ours, reference = _gpu_models(config_cls)
    ids = _tokens(4, 300).cuda()  # 300: not a multiple of the kernels' blocks
    # SDPA's own bf16 error (rounding through 4 layers) sets the scale; the floor 1e-2 only
    # guards a case where it happens to be tiny.
    with torch.no_grad():
        _assert_within(ours(ids).logits, sdpa(ids).logits, reference(ids).logits, 1e-2)
    logits = [_chunked_prefill(model, ids, 200) for model in (ours, sdpa, reference)]
    _assert_within(*logits, floor=1e-2)
    assert op_calls and not hf.fallbacks


def _assert_greedy_agrees(sdpa, ours, reference, ids, mask=None, **kwargs):
    """Greedy tokens identical to SDPA's, or a near tie flipped by bf16 rounding: then, at the
    first step where the two differ, the two picks must be tied in the float64 model's logits
    within twice SDPA's own bf16 error there."""
    kwargs = dict(do_sample=False, attention_mask=mask, **kwargs)
    expected, got = sdpa.generate(ids, **kwargs), ours.generate(ids, **kwargs)
    if torch.equal(got, expected):
        return
    row, step = next((r, s) for r in range(got.shape[0]) for s in range(got.shape[1])
                     if got[r, s] != expected[r, s])
    prefix = got[row:row + 1, :step]
    prefix_mask = None if mask is None else torch.nn.functional.pad(
        mask[row:row + 1], (0, step - mask.shape[1]), value=1)
    with torch.no_grad():
        exact = reference(prefix, attention_mask=prefix_mask).logits[0, -1]
        sdpa_error = (sdpa(prefix, attention_mask=prefix_mask).logits[0, -1].double()
                      - exact).abs().max()
    assert (exact[expected[row, step]] - exact[got[row, step]]).abs() <= 2 * sdpa_error


@pytest.mark.cuda
def test_gpu_bf16_greedy_generation():
    sdpa, ours, reference = _gpu_models(LlamaConfig)
    _assert_greedy_agrees(sdpa, ours, reference, _tokens(2, 64).cuda(), max_new_tokens=32)
    assert not hf.fallbacks


@pytest.mark.cuda
def test_gpu_bf16_gradients():
    sdpa, ours, reference = _gpu_models(LlamaConfig)
    # Floor: 1e-3, a guard only; SDPA's own bf16 gradient error sets the scale.
    _assert_within(*_gradients((ours, sdpa, reference), _tokens(2, 256).cuda()), floor=1e-3)
    assert not hf.fallbacks


def _gpu_padding(ids, side):
    """Row 0 padded by 40 on `side`, row 1 by 1 (one block boundary off), the rest not at all."""
    return _padding(ids, side, pads=(40, 1))


@pytest.mark.cuda
@pytest.mark.parametrize("side", ["left", "right"])
def test_gpu_bf16_padded_batch_takes_the_packed_op(side, varlen_calls, no_fallback):
    sdpa, ours, reference = _gpu_models(LlamaConfig)
    ids = _tokens(4, 300).cuda()
    mask = _gpu_padding(ids, side)
    real = mask.bool()
    with torch.no_grad():
        logits = [model(ids, attention_mask=mask).logits[real]
                  for model in (ours, sdpa, reference)]
    _assert_within(*logits, floor=1e-2)  # floor as in test_gpu_bf16_logits_and_chunked_prefill
    assert len(varlen_calls) == GPU["num_hidden_layers"] and not hf.fallbacks


@pytest.mark.cuda
def test_gpu_bf16_padded_generation_and_gradients(varlen_calls, no_fallback):
    sdpa, ours, reference = _gpu_models(LlamaConfig)
    ids = _tokens(4, 64).cuda()
    _assert_greedy_agrees(sdpa, ours, reference, ids, _gpu_padding(ids, "left"),
                          max_new_tokens=32)
    # Right padding, no loss on padding (see test_padded_gradients_match_sdpa); floor as in
    # test_gpu_bf16_gradients.
    ids = _tokens(2, 256).cuda()
    mask = _gpu_padding(ids, "right")
    grads = _gradients((ours, sdpa, reference), ids, mask)
    _assert_within(*grads, floor=1e-3)
    assert varlen_calls and not hf.fallbacks


@pytest.mark.cuda
def test_gpu_bf16_mistral_sliding_window(op_calls, varlen_calls, no_fallback):
    # A window of 100 keys over 300 tokens: cuts across the kernels' blocks.
    sdpa, ours, reference = _models(MistralConfig, torch.bfloat16, "cuda",
                                    **{**GPU, "sliding_window": 100})
    ids = _tokens(2, 300).cuda()
    with torch.no_grad():
        _assert_within(ours(ids).logits, sdpa(ids).logits, reference(ids).logits, 1e-2)
    _assert_greedy_agrees(sdpa, ours, reference, ids, _gpu_padding(ids, "left"),
                          max_new_tokens=16)
    assert op_calls and varlen_calls and not hf.fallbacks


@pytest.mark.cuda
@pytest.mark.skipif(Gemma2Config is None, reason="this transformers has no Gemma 2")
def test_gpu_bf16_gemma2_softcap(op_calls, no_fallback):
    # Gemma 2's own softcap (50.0) and a window of 100 on every other layer, against eager.
    config = Gemma2Config(**{**TINY, **GPU}, sliding_window=100, attn_logit_softcapping=50.0,
                          query_pre_attn_scalar=128)
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager")
    ours = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="attnscope")
    ours.load_state_dict(eager.state_dict())
    reference = copy.deepcopy(eager).to("cuda", torch.float64).eval()
    eager, ours = (m.to("cuda", torch.bfloat16).eval() for m in (eager, ours))
    ids = _tokens(2, 300).cuda()
    with torch.no_grad():
        logits = [model(ids).logits for model in (ours, eager, reference)]
    _assert_within(*logits, floor=1e-2)  # floor as in test_gpu_bf16_logits_and_chunked_prefill
    assert len(op_calls) == GPU["num_hidden_layers"] and not hf.fallbacks
