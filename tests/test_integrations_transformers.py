"""attn_implementation="attnscope" in transformers: tiny random-init models (built from configs, no
download) against the same weights under transformers' "sdpa" backend and a float64 copy of it.

Error bounds follow FlashAttention's tests: our error against the float64 model is at most twice
SDPA's own error at the same dtype, plus a floor (stated where used) for the cases where SDPA's
error is near zero. The CPU tests run the Triton interpreter, so models and sequences are tiny;
GPU tests (marked cuda) repeat the checks in bfloat16 at a small realistic size.
"""

import copy
import inspect
import warnings

import pytest
import torch

pytest.importorskip("transformers")
hf = pytest.importorskip("attnscope.integrations.transformers")

from transformers import (AutoModelForCausalLM, DynamicCache, LlamaConfig,  # noqa: E402
                          LlamaForCausalLM, MistralConfig, Qwen2Config)
from transformers.masking_utils import (bidirectional_mask_function,  # noqa: E402
                                        causal_mask_function, sdpa_mask)

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


def _gradients(models, ids):
    """All parameter gradients of each model's language-model loss, flattened into one vector."""
    grads = []
    for model in models:
        model.train()  # attention_dropout is 0.0: training mode changes nothing in attention
        model.zero_grad()
        model(ids, labels=ids).loss.backward()
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


def test_padded_batch_falls_back_to_sdpa_with_one_warning(op_calls):
    sdpa, ours, _ = _models(LlamaConfig)
    ids = _tokens(2, 7)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding on the first sequence only
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [ours(ids, attention_mask=mask).logits for _ in range(2)]
        expected = sdpa(ids, attention_mask=mask).logits
    # Same weights and, through the fallback, the same attention function: equal on real tokens.
    for logits in got:
        torch.testing.assert_close(logits[0, 3:], expected[0, 3:], rtol=0, atol=1e-6)
        torch.testing.assert_close(logits[1], expected[1], rtol=0, atol=1e-6)
    fallback_warnings = [w for w in caught if issubclass(w.category, hf.AttnscopeFallbackWarning)]
    assert len(fallback_warnings) == 1 and "padding" in str(fallback_warnings[0].message)
    assert hf.fallbacks == {"padding": 2 * TINY["num_hidden_layers"]} and not op_calls
    # An all-ones mask is no padding: the op runs.
    with torch.no_grad():
        ours(ids, attention_mask=torch.ones_like(ids))
    assert len(op_calls) == TINY["num_hidden_layers"]


def test_on_unsupported_error_raises_instead_of_falling_back():
    _, ours, _ = _models(LlamaConfig)
    ids = _tokens(2, 5)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    hf.configure(on_unsupported="error")
    with pytest.raises(NotImplementedError, match="padding"), torch.no_grad():
        ours(ids, attention_mask=mask)
    assert not hf.fallbacks
    with pytest.raises(ValueError, match="on_unsupported must be one of"):
        hf.configure(on_unsupported="ignore")


def test_gradients_match_sdpa(op_calls):
    sdpa, ours, reference = _models(LlamaConfig)
    # Floor: 1e-6 on gradients of magnitude ~1e-1, a few fp32 ulps; a wrong backward is ~1e-2 off.
    _assert_within(*_gradients((ours, sdpa, reference), _tokens(2, 7)), floor=1e-6)
    assert len(op_calls) == TINY["num_hidden_layers"] and not hf.fallbacks


def test_qwen2_logits_and_generation(op_calls):
    sdpa, ours, reference = _models(Qwen2Config)
    ids = _tokens(1, 6)
    with torch.no_grad():
        _assert_within(ours(ids).logits, sdpa(ids).logits, reference(ids).logits, 1e-5)
    expected = sdpa.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(ours.generate(ids, max_new_tokens=4, do_sample=False), expected)
    assert op_calls and not hf.fallbacks


def test_mistral_sliding_window(op_calls):
    ids = _tokens(1, 7)
    # A window of 4 over 7 tokens cuts keys off: SDPA runs it, with its windowed mask.
    sdpa, ours, _ = _models(MistralConfig, sliding_window=4)
    with torch.no_grad(), pytest.warns(hf.AttnscopeFallbackWarning, match="sliding window"):
        got = ours(ids).logits
        expected = sdpa(ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert hf.fallbacks == {"sliding_window": TINY["num_hidden_layers"]} and not op_calls
    # A window of 16 over 7 tokens cuts nothing: the op runs.
    hf.reset_fallbacks()
    sdpa, ours, reference = _models(MistralConfig, sliding_window=16)
    with torch.no_grad():
        _assert_within(ours(ids).logits, sdpa(ids).logits, reference(ids).logits, 1e-5)
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
    dict(local_size=9),  # a window as long as the keys cuts nothing
], ids=["chunked", "decode", "prefill", "no_padding", "window_cuts_nothing"])
def test_mask_function_returns_none_for_plain_bottom_right_causal(kwargs):
    assert _mask(**kwargs) is None


@pytest.mark.parametrize("kwargs, reason", [
    (dict(kv_length=16), "static_cache"),  # 7 unused slots past the last query
    (dict(q_offset=torch.tensor(5)), "static_cache"),  # offset kept on the device
    (dict(local_size=8), "sliding_window"),
    (dict(allow_is_causal_skip=False), "mask_pattern"),
    (dict(mask_function=bidirectional_mask_function), "mask_pattern"),
    (dict(attention_mask=torch.tensor([[1] * 9, [0] * 2 + [1] * 7], dtype=torch.bool)),
     "padding"),
], ids=["unused_slots", "tensor_offset", "window", "no_skip", "bidirectional", "padding"])
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


def test_attention_function_refuses_softcap_and_falls_back_on_dropout():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 4, 32, generator=gen) for _ in range(3))
    with pytest.raises(NotImplementedError, match="softcap"):
        hf.attention_forward(_Layer(), q, k, v, None, softcap=30.0)
    with pytest.warns(hf.AttnscopeFallbackWarning, match="dropout"):
        out, _ = hf.attention_forward(_Layer(), q, k, v, None, dropout=0.5)
    assert out.shape == (1, 4, 2, 32) and hf.fallbacks == {"dropout": 1}


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


@pytest.mark.cuda
def test_gpu_bf16_greedy_generation():
    sdpa, ours, reference = _gpu_models(LlamaConfig)
    ids = _tokens(2, 64).cuda()
    kwargs = dict(max_new_tokens=32, do_sample=False)
    expected, got = sdpa.generate(ids, **kwargs), ours.generate(ids, **kwargs)
    assert not hf.fallbacks
    if torch.equal(got, expected):
        return
    # bf16 rounding may flip a near tie. Then, at the first step where the two differ, the two
    # picks must be tied in the float64 model's logits within twice SDPA's own bf16 error there.
    row, step = next((r, s) for r in range(got.shape[0]) for s in range(got.shape[1])
                     if got[r, s] != expected[r, s])
    with torch.no_grad():
        prefix = got[row:row + 1, :step]
        exact = reference(prefix).logits[0, -1]
        sdpa_error = (sdpa(prefix).logits[0, -1].double() - exact).abs().max()
    assert (exact[expected[row, step]] - exact[got[row, step]]).abs() <= 2 * sdpa_error


@pytest.mark.cuda
def test_gpu_bf16_gradients():
    sdpa, ours, reference = _gpu_models(LlamaConfig)
    # Floor: 1e-3, a guard only; SDPA's own bf16 gradient error sets the scale.
    _assert_within(*_gradients((ours, sdpa, reference), _tokens(2, 256).cuda()), floor=1e-3)
    assert not hf.fallbacks


@pytest.mark.cuda
def test_gpu_bf16_padded_batch_falls_back():
    sdpa, ours, _ = _gpu_models(LlamaConfig)
    ids = _tokens(2, 128).cuda()
    mask = torch.ones_like(ids)
    mask[0, :40] = 0
    with torch.no_grad(), pytest.warns(hf.AttnscopeFallbackWarning, match="padding"):
        got = ours(ids, attention_mask=mask).logits
    with torch.no_grad():
        expected = sdpa(ids, attention_mask=mask).logits
    # The fallback runs SDPA on the same weights: bf16's default tolerance is ample.
    torch.testing.assert_close(got[0, 40:], expected[0, 40:])
    torch.testing.assert_close(got[1], expected[1])
    assert hf.fallbacks == {"padding": GPU["num_hidden_layers"]}
