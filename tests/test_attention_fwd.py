"""The Triton forward kernel (attnscope/kernels/attention_fwd.py) under configs its tables do not
hold on CPU (tensor descriptors, both loop schedules), its config table's rule, and on the GPU in
a CUDA graph. The op's forward is tested in test_fused_attention.py.
"""

import pytest
import torch

from attnscope.attention import fused
from attnscope.kernels import attention_fwd
# nan_outputs: autouse, poisons every buffer the op allocates
from fused_checks import (CPU, check, kernel_forward, make_qkv, nan_outputs,  # noqa: F401
                          replays_in_a_cuda_graph)


def _config(pipeline=False, use_tma=False):
    # The interpreter's tile sizes: BLOCK_M != BLOCK_N, several blocks and a diagonal band that
    # spans two K blocks at these lengths.
    return (32, 16, 4, 1, pipeline, use_tma)


@pytest.mark.parametrize("pipeline", [False, True])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_tensor_descriptor_path(layout, pipeline):
    # K/V through tensor descriptors (the D=256 class's path on the GPU, pipelined there): ragged
    # length and a head_dim the descriptor's block pads, so the zero fill past both edges is
    # exercised. fp16 floor: one fp16 rounding step at magnitude ~1.
    q, k, v = make_qkv(1, 2, 1, 45, 70, 48, torch.float16, CPU, layout)
    k4, v4 = (fused._as_bhsd(t, layout) for t in (k, v))
    assert attention_fwd.tma_ok(k4) and attention_fwd.tma_ok(v4)  # else pointers are used
    forward = kernel_forward(attention_fwd.attention_fwd_triton, _config(pipeline, True))
    check(q, k, v, 1e-3, 1e-3, forward, layout=layout, causal_alignment="bottom_right")


@pytest.mark.parametrize("causal,alignment,q_len,kv_len", [
    (True, "top_left", 45, 45), (True, "bottom_right", 70, 17), (True, "bottom_right", 17, 70),
    (False, "top_left", 33, 48),
])
@pytest.mark.parametrize("pipeline", [False, True])
def test_both_loop_schedules(pipeline, causal, alignment, q_len, kv_len):
    # The GPU table runs the software-pipelined loop (scores of the next K block issued before
    # this block's p @ V, last block peeled off) at head_dim 256 and the plain loop below; the
    # interpreter runs the pipelined one by default. Both on ragged, bottom-right and non-causal
    # tiles.
    q, k, v = make_qkv(1, 2, 2, q_len, kv_len, 24, torch.float16, CPU)
    forward = kernel_forward(attention_fwd.attention_fwd_triton, _config(pipeline))
    check(q, k, v, 1e-3, 1e-3, forward, causal=causal, causal_alignment=alignment)


def test_a_config_of_the_wrong_shape_is_refused():
    q, k, v = make_qkv(1, 1, 1, 8, 8, 16, torch.float32, CPU)
    with pytest.raises(ValueError, match="config must be a tuple of"):
        kernel_forward(attention_fwd.attention_fwd_triton, (32, 16))(q, k, v)


def test_config_for_short_causal_sequences(monkeypatch):
    # Compiled launches (not the interpreter's one config): causal calls with at most SHORT_SEQ
    # queries take the short-sequence entry where the head_dim class has one.
    monkeypatch.setattr(attention_fwd, "is_interpreted", lambda: False)
    short, long = attention_fwd.SHORT_CONFIGS[64], attention_fwd.CONFIGS[64]
    assert short != long
    assert attention_fwd.config_for(64, 1024, True) == short
    assert attention_fwd.config_for(64, 1024, True, 1024) == short
    assert attention_fwd.config_for(48, attention_fwd.SHORT_SEQ, True) == short
    assert attention_fwd.config_for(64, attention_fwd.SHORT_SEQ + 1, True) == long
    assert attention_fwd.config_for(64, 1024, False) == long
    assert attention_fwd.config_for(64) == long
    assert attention_fwd.config_for(128, 1024, True) == attention_fwd.CONFIGS[128]
    for config in (*attention_fwd.CONFIGS.values(), *attention_fwd.SHORT_CONFIGS.values()):
        assert len(config) == len(attention_fwd.CONFIG_FIELDS)


def test_config_for_few_keys_at_head_dims_up_to_128(monkeypatch):
    # Causal dense calls of at most FEW_KEYS queries and keys at head_dim 65-128 take the
    # 64-row tiles too; more queries or keys, no causal mask, a packed batch (kv_len None) or
    # a wider head keep the table's.
    monkeypatch.setattr(attention_fwd, "is_interpreted", lambda: False)
    few, long = attention_fwd.SHORT_CONFIGS[64], attention_fwd.CONFIGS[128]
    n = attention_fwd.FEW_KEYS
    for head_dim in (80, 96, 128):
        assert attention_fwd.config_for(head_dim, n, True, n) == few
        assert attention_fwd.config_for(head_dim, 1, True, 77) == few
        assert attention_fwd.config_for(head_dim, n + 1, True, n) == long
        assert attention_fwd.config_for(head_dim, n, True, n + 1) == long
        assert attention_fwd.config_for(head_dim, n, False, n) == long
        assert attention_fwd.config_for(head_dim, n, True, None) == long
    assert attention_fwd.config_for(192, 128, True, 128) == attention_fwd.CONFIGS[256]


def test_config_for_few_keys_at_head_dim_64(monkeypatch):
    # At head_dim <= 64 those calls take 32-key blocks on the short rule's 64-row tiles; a
    # longer call, a non-causal one or a packed batch keeps the short rule's or the table's.
    monkeypatch.setattr(attention_fwd, "is_interpreted", lambda: False)
    few, short = attention_fwd.FEW_KEYS_CONFIGS[64], attention_fwd.SHORT_CONFIGS[64]
    n = attention_fwd.FEW_KEYS
    assert few != short and len(few) == len(attention_fwd.CONFIG_FIELDS)
    for head_dim in (32, 64):
        assert attention_fwd.config_for(head_dim, n, True, n) == few
        assert attention_fwd.config_for(head_dim, 1, True, 5) == few
        assert attention_fwd.config_for(head_dim, n + 1, True, n + 1) == short
        assert attention_fwd.config_for(head_dim, n, True, None) == short
        assert attention_fwd.config_for(head_dim, n, False, n) == attention_fwd.CONFIGS[64]


@pytest.mark.cuda
def test_gpu_triton_kernel_in_a_cuda_graph():
    replays_in_a_cuda_graph(*make_qkv(2, 4, 4, 640, 640, 64, torch.bfloat16, "cuda"))
