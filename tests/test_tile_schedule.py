"""The Gluon kernel's tile schedule (attnscope/kernels/tile_schedule.py) against its contract
written out independently: the launch's tile order, the cost model, list scheduling, the
round-robin fallback for many tiles, one table per launch shape. CPU only (the tables are made
on the host).
"""

import pytest
import torch

from attnscope.kernels import tile_schedule

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def fresh_schedules():
    """Tables are kept per launch shape, and these tests change the rule that makes them."""
    tile_schedule.forget_schedules()
    yield
    tile_schedule.forget_schedules()


def _reference_schedule(n_hz, num_m, group, programs, rows, block_n, kv_len, causal, offset,
                        overhead, left=None):
    # tile_schedule's contract written out independently: _grouped_tile's order (groups of
    # `group` heads, the last one smaller; last query tile first), a tile's cost = its K/V
    # blocks (from the one holding the first key its first row sees under a window whose left
    # edge is at row + left, to the one holding the last key its last row sees) + overhead, each
    # tile to the program whose work ends first (lowest program on ties). Returns each
    # program's tiles and the busiest one's cost.
    ends, runs = [0] * programs, [[] for _ in range(programs)]
    for t in range(n_hz * num_m):
        heads = min(group, n_hz - t // (group * num_m) * group)
        m = num_m - 1 - t % (group * num_m) // heads
        hi = min(max(m * rows + rows + offset, 0), kv_len) if causal else kv_len
        lo = 0 if left is None else min(max(m * rows + left, 0), kv_len) // block_n
        p = min(range(programs), key=lambda i: (ends[i], i))
        ends[p] += max(-(-hi // block_n) - lo, 0) + overhead
        runs[p].append(t)
    return runs, max(ends)


def _runs(table):
    return [row[1:1 + row[0]] for row in table.tolist()]


SCHEDULE_CASES = [
    # (n_hz, num_m, head_group, programs, tile_rows, block_n, kv_len, causal, causal_offset)
    (128, 8, 43, 132, 128, 128, 1024, True, 0),      # (8,16,1024,128): three groups of 43
    (10, 3, 4, 4, 128, 128, 384, True, 0),           # a smaller last group
    (7, 1, 3, 3, 128, 128, 128, True, 0),            # one query tile per head
    (6, 5, 2, 4, 128, 64, 640, True, -300),          # rows that see no key, tiles of no block
    (6, 5, 2, 4, 128, 64, 200, True, 900),           # offset past the keys
    (6, 5, 3, 7, 128, 128, 640, False, 0),           # non-causal: equal tiles
    (3, 2, 3, 6, 128, 128, 256, True, 0),            # as many programs as tiles
]


@pytest.mark.parametrize("case", SCHEDULE_CASES)
def test_tile_schedule(case, monkeypatch):
    assert _runs(tile_schedule.tile_schedule(CPU, *case)) == \
        _reference_schedule(*case, tile_schedule.TILE_OVERHEAD)[0]
    # round-robin, past SCHEDULE_MAX_TILES: round r gives program p tile r * programs + p, or the
    # mirror in odd rounds
    tile_schedule.forget_schedules()
    monkeypatch.setattr(tile_schedule, "SCHEDULE_MAX_TILES", 0)
    tiles, programs = case[0] * case[1], case[3]
    expected = [[t for r in range(-(-tiles // programs))
                 for t in [r * programs + (p if r % 2 == 0 else programs - 1 - p)] if t < tiles]
                for p in range(programs)]
    assert _runs(tile_schedule.tile_schedule(CPU, *case)) == expected


WINDOW_CASES = [
    # SCHEDULE_CASES' arguments and a window's left offset (common.visibility's: the causal
    # offset minus the window's left size)
    (16, 8, 8, 13, 128, 128, 1024, True, 0, -300),    # tiles of about three blocks
    (6, 5, 2, 4, 128, 64, 640, True, 0, -64),         # the edge on a block boundary
    (6, 5, 2, 4, 128, 64, 640, True, -300, -310),     # rows that see no key
    (6, 5, 3, 7, 128, 128, 640, True, 100, -1000),    # wider than the keys: causal costs
]


@pytest.mark.parametrize("case", WINDOW_CASES)
def test_tile_schedule_under_a_window(case):
    # a window's tiles cost the blocks from its left edge on; the table is its own
    table = tile_schedule.tile_schedule(CPU, *case)
    assert _runs(table) == _reference_schedule(*case[:-1], tile_schedule.TILE_OVERHEAD,
                                               left=case[-1])[0]
    assert tile_schedule.tile_schedule(CPU, *case[:-1]) is not table


def test_tile_schedule_balances_the_short_head_dim_128_row():
    # (8,16,1024,128) on 132 programs: by the cost model the busiest program carries 17 % more
    # than the mean under round-robin, 3 % under list scheduling (with the overhead of 1)
    overhead = tile_schedule.TILE_OVERHEAD
    busiest = _reference_schedule(*SCHEDULE_CASES[0], overhead)[1]
    mean = 128 * sum(m + 1 + overhead for m in range(8)) / 132
    assert busiest / mean < 1.04


def test_tile_schedule_falls_back_to_round_robin_for_many_tiles(monkeypatch):
    # 30 tiles: list-scheduled up to SCHEDULE_MAX_TILES = 30, round-robin at 29
    args = (CPU, 6, 5, 3, 4, 128, 128, 640, True, 0)
    listed = tile_schedule.tile_schedule(*args)
    tile_schedule.forget_schedules()
    monkeypatch.setattr(tile_schedule, "SCHEDULE_MAX_TILES", 29)
    assert _runs(tile_schedule.tile_schedule(*args)) == tile_schedule._round_robin(30, 4)
    assert not torch.equal(listed, tile_schedule.tile_schedule(*args))


def test_tile_schedule_is_kept_per_launch_shape():
    args = (CPU, 6, 5, 3, 4, 128, 128, 640, True, 0)
    first = tile_schedule.tile_schedule(*args)
    assert tile_schedule.tile_schedule(*args) is first  # made once: its address stays valid
    assert tile_schedule.tile_schedule(*args[:-1], 64) is not first  # another causal offset


def test_the_cost_model_counts_key_blocks_and_the_overhead():
    # (1 head, 2 query tiles of 128 rows, 64-key blocks, causal top-left, 256 keys): the last
    # tile (first in the order) sees 4 blocks, the first 2, each plus the overhead
    costs = tile_schedule.tile_costs(1, 2, 1, 128, 64, 256, True, 0)
    assert costs == [4 + tile_schedule.TILE_OVERHEAD, 2 + tile_schedule.TILE_OVERHEAD]
    # a window's left offset of -100: the last tile's first row (128) sees keys from 28 on, so
    # from block 0 on; of -40, from 88 on, block 1 on; the first tile's first row from 0 on
    costs = tile_schedule.tile_costs(1, 2, 1, 128, 64, 256, True, 0, left_offset=-100)
    assert costs == [4 + tile_schedule.TILE_OVERHEAD, 2 + tile_schedule.TILE_OVERHEAD]
    costs = tile_schedule.tile_costs(1, 2, 1, 128, 64, 256, True, 0, left_offset=-40)
    assert costs == [3 + tile_schedule.TILE_OVERHEAD, 2 + tile_schedule.TILE_OVERHEAD]
