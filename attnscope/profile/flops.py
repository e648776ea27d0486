"""FLOP counts, in one place, for every figure attnscope reports."""

from __future__ import annotations

# Backward work relative to the forward: dV and dP are two matmuls, dQ and dK two more,
# plus recomputing S; 2.5x is the usual convention (FlashAttention papers, tritonbench).
BACKWARD_FACTOR = 2.5


def attention_flops(batch: int, heads: int, q_len: int, kv_len: int, head_dim: int, *,
                    causal: bool = True, mode: str = "fwd") -> float:
    """Matmul FLOPs of attention: 2 matmuls of 2*L*S*D each per head over the visible pairs.

    Causal at equal lengths is counted as exactly half, as the peers' published numbers do, so
    TFLOP/s figures stay comparable across implementations. With fewer queries than keys
    (decode, chunked prefill: causal aligned bottom-right) the visible pairs are counted exactly:
    query i of q_len sees kv_len - q_len + i + 1 keys, which is kv_len for a single query, where
    half would halve the figure of a pass that reads every key.
    """
    if causal and q_len < kv_len:
        pairs = q_len * (kv_len - q_len) + q_len * (q_len + 1) / 2
    else:
        pairs = q_len * kv_len / (2 if causal else 1)
    flops = 4.0 * batch * heads * pairs * head_dim
    factors = {"fwd": 1.0, "bwd": BACKWARD_FACTOR, "fwd_bwd": 1.0 + BACKWARD_FACTOR}
    if mode not in factors:
        raise ValueError(f"mode must be one of {sorted(factors)}, got {mode!r}")
    return flops * factors[mode]


def varlen_flops(seqlens, heads: int, head_dim: int, *, causal: bool = True,
                 mode: str = "fwd") -> float:
    """attention_flops summed over packed sequences (equal query and key lengths in each)."""
    return sum(attention_flops(1, heads, n, n, head_dim, causal=causal, mode=mode)
               for n in seqlens)
