"""The Gluon kernel's tile schedule: which query tiles each persistent program runs.

The Gluon forward (attention_fwd_hopper.py) runs one program per SM, each walking a list of
tiles. Under a causal mask tiles differ in cost (the last query block of a head sees every key,
the first one block of keys), so the lists are made on the host by list scheduling, as a
dynamic scheduler would hand tiles out, and copied to the GPU once per launch shape.
"""

import heapq

import torch

# A tile's fixed cost in the schedule's model, in K/V blocks: its Q load, first softmax and
# epilogue, which nothing overlaps within the tile. Measured from 0 to 4: 1 is the fastest at
# (4,32,4096,128) (0.9934 ms against 0.9984-1.0214), 1.2-1.7 % behind 0, 2, 3 and 4 at
# (8,16,1024,128), no value ahead at both by more than the rounds' spread (notes/forward.md,
# "The host-made tile schedule").
TILE_OVERHEAD = 1
# Above this many tiles the schedule is round-robin: list scheduling in Python takes 3.5 ms at
# 1024 tiles, 21 ms at 4096 and ~50 ms at 32768 on a shape's first call (the CPU machine).
SCHEDULE_MAX_TILES = 32768

_schedules = {}  # tile_schedule's tables by launch shape


def tile_schedule(device, n_hz, num_m, head_group, n_programs, tile_rows, block_n, kv_len,
                  causal, causal_offset, left_offset=None):
    """Which tiles each persistent program runs: an int32 tensor on `device`, one row per
    program holding its tile count, then its tile numbers (in the launch's tile order, common.
    _grouped_tile) in the order it runs them.

    List scheduling with a cost model: tiles go in the launch's order (which keeps the heads
    that share L2 together in time), each to the program whose assigned work ends first; a tile
    costs its K/V blocks plus TILE_OVERHEAD blocks (`tile_costs`; with `left_offset`, a sliding
    window's left edge as common.visibility gives it, the blocks left of the edge do not
    count). Launches of more than
    SCHEDULE_MAX_TILES tiles hand the tiles out round-robin instead, each round in the opposite
    direction (by the same cost model that leaves the busiest program 17 % above the mean at
    (8,16,1024,128); list scheduling measured 0.0949 against 0.1006 ms there and 1.0099 against
    1.0783 ms at (4,32,4096,128)).

    Made once per launch shape and kept for the life of the process (never evicted: a captured
    CUDA graph, or a kernel still running on another stream, holds its address). The first
    call of a shape may not happen during CUDA-graph capture: warm up outside it, as for any
    first call."""
    tiles = n_hz * num_m
    if tiles <= n_programs:  # at most a tile a program: program p runs tile p, whatever the costs
        key = (device, tiles, n_programs)
    else:
        key = (device, n_hz, num_m, head_group, n_programs, tile_rows, block_n, kv_len, causal,
               causal_offset, left_offset)
    table = _schedules.get(key)
    if table is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "attnscope's Gluon attention kernel meets this launch shape for the first time "
                "during CUDA-graph capture; its tile schedule is copied to the GPU on first use. "
                "Call the op once with these shapes before capturing (a warm-up run).")
        rows = (_list_schedule(n_hz, num_m, head_group, n_programs, tile_rows, block_n, kv_len,
                               causal, causal_offset, left_offset) if tiles <= SCHEDULE_MAX_TILES
                else _round_robin(tiles, n_programs))
        width = 1 + max(len(run) for run in rows)
        host = torch.tensor([[len(run)] + run + [0] * (width - 1 - len(run)) for run in rows],
                            dtype=torch.int32)
        # a blocking copy, once per shape: the table is complete on the GPU before any
        # stream's kernel can read it
        table = _schedules[key] = host.to(device)
    return table


def forget_schedules():
    """Drop every kept table (tests that need a shape to be new)."""
    _schedules.clear()


def tile_costs(n_hz, num_m, head_group, tile_rows, block_n, kv_len, causal, causal_offset,
               left_offset=None):
    """The schedule's cost model: each tile's K/V blocks plus TILE_OVERHEAD, in launch order: the
    blocks from the one holding the first key its first row sees (a window's left edge; 0 where
    left_offset is None) to the one holding the last key its last row sees."""
    t = torch.arange(n_hz * num_m)
    group_tiles = head_group * num_m
    heads = (n_hz - t // group_tiles * head_group).clamp(max=head_group)
    first_row = (num_m - 1 - t % group_tiles // heads) * tile_rows  # _grouped_tile's query block
    hi = (first_row + tile_rows + causal_offset).clamp(0, kv_len) if causal else kv_len
    blocks = (torch.as_tensor(hi) + block_n - 1) // block_n
    if left_offset is not None:  # (the kernel's _tile: no block counts below zero)
        lo = (first_row + left_offset).clamp(0, kv_len) // block_n
        blocks = (blocks - lo).clamp(min=0)
    return (blocks + TILE_OVERHEAD).expand(len(t)).tolist()


def _list_schedule(n_hz, num_m, head_group, n_programs, tile_rows, block_n, kv_len, causal,
                   causal_offset, left_offset):
    cost = tile_costs(n_hz, num_m, head_group, tile_rows, block_n, kv_len, causal, causal_offset,
                      left_offset)
    ends = [(0, p) for p in range(n_programs)]  # (when its work ends, program), a heap
    runs = [[] for _ in range(n_programs)]
    for tile, c in enumerate(cost):
        end, p = ends[0]
        runs[p].append(tile)
        heapq.heapreplace(ends, (end + c, p))
    return runs


def _round_robin(tiles, n_programs):
    rounds = -(-tiles // n_programs)
    r = torch.arange(rounds)[None, :]
    p = torch.arange(n_programs)[:, None]
    order = r * n_programs + torch.where(r % 2 == 0, p, n_programs - 1 - p)
    return [[t for t in row if t < tiles] for row in order.tolist()]
