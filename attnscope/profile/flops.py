"""FLOP counts, in one place, for every figure attnscope reports."""

from __future__ import annotations

# Backward work relative to the forward: dV and dP are two matmuls, dQ and dK two more,
# plus recomputing S; 2.5x is the usual convention (FlashAttention papers, tritonbench).
BACKWARD_FACTOR = 2.5


def visible_pairs(q_len: int, kv_len: int, *, causal: bool = True, window=None,
                  causal_alignment: str = "bottom_right") -> int:
    """The (query, key) pairs attention computes, exactly: query i sees key j when
    i + offset - left <= j <= i + offset + right (flash-attn's window_size, -1 unbounded; causal
    sets right to 0), offset 0 top-left or kv_len - q_len bottom-right, 0 <= j < kv_len.

    Counted in closed form, not per query: the keys at or left of x are clamp(x + 1, 0, kv_len),
    and their sum over a run of consecutive x is a difference of `_keys_through` terms."""
    if causal_alignment not in ("top_left", "bottom_right"):
        raise ValueError(f"causal_alignment must be 'top_left' or 'bottom_right', "
                         f"got {causal_alignment!r}")
    left, right = (-1, -1) if window is None else window
    right = 0 if causal else right
    offset = 0 if causal_alignment == "top_left" else kv_len - q_len

    def seen_through(shift):  # sum over queries i of the keys j <= i + shift
        return _keys_through(shift + q_len, kv_len) - _keys_through(shift, kv_len)
    through_right = q_len * kv_len if right < 0 else seen_through(offset + right)
    left_of_window = 0 if left < 0 else seen_through(offset - left - 1)
    return through_right - left_of_window


def _keys_through(m: int, kv_len: int) -> int:
    # sum of min(t, kv_len) over t = 1..m (0 for m <= 0)
    m = max(m, 0)
    n = min(m, kv_len)
    return n * (n + 1) // 2 + (m - n) * kv_len


def attention_flops(batch: int, heads: int, q_len: int, kv_len: int, head_dim: int, *,
                    causal: bool = True, mode: str = "fwd", window=None) -> float:
    """Matmul FLOPs of attention: 2 matmuls of 2*L*S*D each per head over the visible pairs.

    Causal at equal lengths without a window is counted as exactly half, as the peers'
    published numbers do, so TFLOP/s figures stay comparable across implementations. With fewer
    queries than keys (decode, chunked prefill: causal aligned bottom-right) or a sliding window
    (left, right) (flash-attn's window_size, aligned as causal is) the visible pairs are counted
    exactly (visible_pairs): query i of q_len sees kv_len - q_len + i + 1 keys without a window,
    which is kv_len for a single query, where half would halve the figure of a pass that reads
    every key; a window of w keys counts about w per query, not the half square.
    """
    if window is not None or (causal and q_len < kv_len):
        pairs = visible_pairs(q_len, kv_len, causal=causal, window=window)
    else:
        pairs = q_len * kv_len / (2 if causal else 1)
    flops = 4.0 * batch * heads * pairs * head_dim
    factors = {"fwd": 1.0, "bwd": BACKWARD_FACTOR, "fwd_bwd": 1.0 + BACKWARD_FACTOR}
    if mode not in factors:
        raise ValueError(f"mode must be one of {sorted(factors)}, got {mode!r}")
    return flops * factors[mode]


def varlen_flops(seqlens, heads: int, head_dim: int, *, causal: bool = True,
                 mode: str = "fwd", window=None) -> float:
    """attention_flops summed over packed sequences (equal query and key lengths in each)."""
    return sum(attention_flops(1, heads, n, n, head_dim, causal=causal, mode=mode,
                               window=window) for n in seqlens)
