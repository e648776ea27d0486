"""FLOP counts, in one place, for every figure attnscope reports."""

from __future__ import annotations

# Backward work relative to the forward: dV and dP are two matmuls, dQ and dK two more,
# plus recomputing S; 2.5x is the usual convention (FlashAttention papers, tritonbench).
BACKWARD_FACTOR = 2.5


def attention_flops(batch: int, heads: int, q_len: int, kv_len: int, head_dim: int, *,
                    causal: bool = True, mode: str = "fwd") -> float:
    """Matmul FLOPs of attention: 2 matmuls of 2*L*S*D each per head; causal halves them.

    Causal is counted as exactly half, as the peers' published numbers do, even for unequal
    lengths, so TFLOP/s figures stay comparable across implementations.
    """
    flops = 4.0 * batch * heads * q_len * kv_len * head_dim
    if causal:
        flops /= 2
    factors = {"fwd": 1.0, "bwd": BACKWARD_FACTOR, "fwd_bwd": 1.0 + BACKWARD_FACTOR}
    if mode not in factors:
        raise ValueError(f"mode must be one of {sorted(factors)}, got {mode!r}")
    return flops * factors[mode]
