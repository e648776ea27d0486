"""Whether a bench case fits in memory: the skip rule for entries that build the scores."""

from __future__ import annotations

import os

import torch

from attnscope.profile.sweeps import Case

# Entries that materialize the [B, H, q_len, kv_len] scores (the registry's `materializes_scores`).
# Budgeted at three live fp32 score tensors (scores, masked scores, probabilities; sdpa_math
# upcasts bf16 to fp32, the eager ones hold fewer bytes, so it is an upper bound). Such an entry
# is skipped when that exceeds half the free memory; the other half holds inputs, rotation sets,
# the reference and allocator slack.
SCORE_BYTES = 3 * 4
SCORE_MEMORY_FRACTION = 0.5
# A backward keeps the forward's saved scores/probabilities and builds their gradients next to
# them: score materializers are budgeted at twice the forward's score memory in those modes.
BACKWARD_SCORE_FACTOR = 2


def score_memory_skip(impl, case: Case, free_bytes: int | None,
                      mode: str = "fwd") -> str | None:
    """Why `impl` is skipped at `case` (the memory estimate above), or None to run it."""
    if not impl.materializes_scores or free_bytes is None:
        return None
    copies = 3 if mode == "fwd" else 3 * BACKWARD_SCORE_FACTOR
    need = case.score_elements * SCORE_BYTES // 3 * copies
    if need <= SCORE_MEMORY_FRACTION * free_bytes:
        return None
    return (f"materializes [B,H,S,S] scores: estimated {need / 2**30:.1f} GiB ({copies} fp32 "
            f"copies) > {SCORE_MEMORY_FRACTION:.0%} of {free_bytes / 2**30:.1f} GiB free")


def out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` says memory ran out: CUDA's allocator raises OutOfMemoryError, the CPU's a
    RuntimeError saying so, and a size past what any allocation can address a RuntimeError of
    its own (the storage size overflowed)."""
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and ("can't allocate memory" in str(exc)
                                           or "Storage size calculation overflowed" in str(exc)))


def free_memory(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not Linux: no estimate, nothing skipped
        return None
