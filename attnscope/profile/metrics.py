"""The figures every command derives the same way from a time or an output: TFLOP/s, % of the
measured peak, and the error against the float64 reference."""

from __future__ import annotations

import torch

from attnscope.attention.reference import attention_reference

# Dtypes that get a % of peak. The measured peak (env.MEASURED_PEAK_TFLOPS) is a bf16 dense
# matmul's; Hopper's fp16 dense Tensor Core rate is the same, so both 16-bit dtypes compare with
# it. fp32 attention runs on other units (or TF32) at other rates: no %.
PEAK_DTYPES = ("bf16", "fp16")


def tflops(flops: float, seconds: float) -> float:
    return flops / seconds / 1e12


def pct_of_peak(tflops_value: float | None, dtype: str, env: dict) -> float | None:
    """100 x TFLOP/s / the GPU's measured peak, for a 16-bit dtype on a GPU whose peak we
    measured; None otherwise."""
    peak = ((env or {}).get("gpu") or {}).get("measured_bf16_peak_tflops")
    if tflops_value is None or not peak or dtype not in PEAK_DTYPES:
        return None
    return 100.0 * tflops_value / peak


def max_abs_error(output: torch.Tensor, reference: torch.Tensor) -> float:
    """Largest |output - reference|, in float64 on the reference's device (NaN when the output
    holds one: callers check finiteness)."""
    return (output.detach().to(reference.device, torch.float64) - reference).abs().max().item()


# attention_reference keeps about four float64 [rows, S] tensors per head at once (scores, masked
# scores, probabilities, nan_to_num's copy); it gets this fraction of the free memory.
REF_BYTES_PER_SCORE = 4 * 8
REF_MEMORY_FRACTION = 0.25


def reference_output(q, k, v, *, causal: bool, budget_bytes: float, window=(-1, -1),
                     softcap=0.0):
    """Float64 attention for as much of the output as `budget_bytes` allows at a time, under
    a sliding window and a softcap as attention_reference's.

    Computed in chunks of (batch, head) pairs. When one head alone is over budget, only its last
    query rows are compared: they see every key, so the longest reductions are the ones checked;
    "bottom_right" alignment keeps each sliced row's true causal and sliding windows (the
    registry's alignment for q_len <= kv_len, and the only one for which the last rows of a slice
    keep theirs).
    Returns (reference [B, H, rows, D] float64, region) where region records what was compared.
    """
    batch, heads, seq, head_dim = q.shape
    kv_heads = k.shape[1]
    per_row = k.shape[2] * REF_BYTES_PER_SCORE
    rows = int(min(seq, max(1, budget_bytes // per_row)))
    start = seq - rows
    chunk = int(min(batch * heads, max(1, budget_bytes // (rows * per_row))))
    # flat query head i = b * heads + h reads K/V head b * kv_heads + h // group
    flat = torch.arange(batch * heads, device=q.device)
    kv_index = (flat // heads) * kv_heads + (flat % heads) // (heads // kv_heads)
    q_flat, k_flat, v_flat = (t.flatten(0, 1) for t in (q, k, v))
    ref = torch.empty(batch * heads, rows, head_dim, dtype=torch.float64, device=q.device)
    for i in range(0, batch * heads, chunk):
        idx = kv_index[i:i + chunk]
        ref[i:i + chunk] = attention_reference(
            q_flat[i:i + chunk, start:][None], k_flat[idx][None], v_flat[idx][None],
            causal=causal, causal_alignment="bottom_right", window=window, softcap=softcap)[0]
    region = {"batch_heads": batch * heads, "query_rows": [start, seq],
              "chunk_batch_heads": chunk}
    return ref.unflatten(0, (batch, heads)), region
