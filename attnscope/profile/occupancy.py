"""Occupancy of a kernel launch worked out from its resources, where Kineto's figure is missing.

Kineto's `est. achieved occupancy %` is the CUDA occupancy calculator's active blocks per SM,
capped by the grid's blocks per SM, times threads per block over the SM's thread limit. It calls
the calculator without the shared-memory opt-in, so every kernel with more than 48 KiB of shared
memory per block fails there and reads 0, although it runs with hundreds of blocks on the GPU.
`estimate` repeats the same calculation with the opt-in limits of the trace's `deviceProperties`,
the way the occupancy calculator (cuda_occupancy.h) allocates:
- registers: per warp, rounded up to 256; each of the SM's 4 sub-partitions holds
  regsPerMultiprocessor / 4 of them, so whole warps fit per sub-partition;
- shared memory: the block's static + dynamic bytes plus the 1 KiB the system reserves per block
  on sm 8.x and newer, rounded up to 128 B, out of sharedMemPerMultiprocessor (the largest
  carveout; a block may use at most sharedMemPerBlockOptin);
- warps: maxThreadsPerMultiprocessor / warpSize; blocks: the SM's resident-block limit.
It is an estimate: the driver's carveout choice and limits the trace does not record (cluster
launches, partitioned graphics contexts) are left out.
"""

from __future__ import annotations

import math

KINETO_SMEM_LIMIT = 48 * 1024  # above this, Kineto's calculator call fails and it writes 0
SOURCE = "estimate: registers, shared memory and block vs the trace's deviceProperties"
REG_ALLOC_UNIT = 256  # registers are allocated per warp, in units of 256
SMEM_ALLOC_UNIT = 128
SMEM_RESERVED_PER_BLOCK = 1024  # sm 8.x and newer
# Resident blocks per SM by compute capability (CUDA C++ Programming Guide, "Compute
# Capabilities"); deviceProperties carries maxBlocksPerMultiProcessor only in some versions.
MAX_BLOCKS_PER_SM = {(7, 0): 32, (7, 2): 32, (7, 5): 16, (8, 0): 32, (8, 6): 16, (8, 7): 16,
                     (8, 9): 24, (9, 0): 32, (10, 0): 32, (12, 0): 32}


def device_limits(props: dict) -> dict | None:
    """The limits `estimate` needs from one deviceProperties entry; None when some are missing."""
    try:
        cc = (int(props["computeMajor"]), int(props["computeMinor"]))
        limits = {
            "warp_size": int(props.get("warpSize", 32)),
            "regs_per_sm": int(props["regsPerMultiprocessor"]),
            "regs_per_block": int(props.get("regsPerBlock", props["regsPerMultiprocessor"])),
            "smem_per_sm": int(props["sharedMemPerMultiprocessor"]),
            "smem_per_block": int(props.get("sharedMemPerBlockOptin")
                                  or props["sharedMemPerBlock"]),
            "threads_per_sm": int(props["maxThreadsPerMultiprocessor"]),
            "max_blocks_per_sm": int(props.get("maxBlocksPerMultiProcessor")
                                     or MAX_BLOCKS_PER_SM[cc]),
            "num_sms": props.get("numSms"),
        }
    except (KeyError, TypeError, ValueError):
        return None
    limits["sub_partitions"] = 4 if cc[0] >= 7 else 2
    limits["smem_reserved"] = SMEM_RESERVED_PER_BLOCK if cc[0] >= 8 else 0
    return limits


def active_blocks(limits: dict, registers: int, shared_memory: int, threads: int) -> dict:
    """Resident blocks per SM allowed by each resource, and the smallest of them."""
    warps = math.ceil(threads / limits["warp_size"])
    by = {"warps": limits["threads_per_sm"] // limits["warp_size"] // warps,
          "blocks": limits["max_blocks_per_sm"]}
    if registers:
        per_warp = math.ceil(registers * limits["warp_size"] / REG_ALLOC_UNIT) * REG_ALLOC_UNIT
        if per_warp * warps > limits["regs_per_block"]:
            by["registers"] = 0
        else:
            per_part = limits["regs_per_sm"] // limits["sub_partitions"] // per_warp
            by["registers"] = per_part * limits["sub_partitions"] // warps
    smem = shared_memory + limits["smem_reserved"]
    smem = math.ceil(smem / SMEM_ALLOC_UNIT) * SMEM_ALLOC_UNIT
    by["shared memory"] = (0 if shared_memory > limits["smem_per_block"]
                           else limits["smem_per_sm"] // smem)
    return {"blocks": min(by.values()), "by": by}


def estimate(props: dict | None, args: dict) -> float | None:
    """Estimated occupancy in % for a kernel event's args (Kineto's definition: active blocks per
    SM, capped by the grid's blocks per SM, x threads per block / max threads per SM); None when
    the device's limits or the kernel's block are unknown."""
    limits = device_limits(props) if props else None
    block = args.get("block")
    if not limits or not block:
        return None
    threads = math.prod(block)
    if threads <= 0:
        return None
    blocks = active_blocks(limits, args.get("registers per thread") or 0,
                           args.get("shared memory") or 0, threads)["blocks"]
    grid = args.get("grid")
    if grid and limits["num_sms"]:
        blocks = min(blocks, math.prod(grid) / limits["num_sms"])
    elif args.get("blocks per SM") is not None:
        blocks = min(blocks, args["blocks per SM"])
    return round(100 * blocks * threads / limits["threads_per_sm"], 2)
