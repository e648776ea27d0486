"""Which part of the sequence each rank holds, and the helpers that go from a full sequence to
shards and back.

Two orders, for a world of W ranks:

- "none": the sequence cut into W contiguous chunks, rank r holds chunk r. Under causal attention
  rank W-1 does W times the work of rank 0.
- "zigzag": the sequence cut into 2W chunks, rank r holds chunks r and 2W-1-r (a head chunk and
  its mirror tail chunk), so every rank does the same causal work. W=3, chunks 0..5:

      rank 0: [0 | 5]    rank 1: [1 | 4]    rank 2: [2 | 3]

A rank's shard is its chunks concatenated in that order along the sequence dimension.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

LOAD_BALANCES = ("zigzag", "none")
SEQ_DIMS = {"bhsd": 2, "bshd": 1}  # where the sequence is, per layout


def world(group=None) -> tuple[int, int]:
    """(rank, world size) in `group`; (0, 1) when no process group is initialized, so a single
    process can call everything here without setting one up. ValueError on a process that is
    not a member of `group` (torch.distributed gives it rank -1, and its collectives do
    nothing)."""
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialized")
        return 0, 1
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of the "
                         f"group passed: only the group's ranks take part")
    return rank, dist.get_world_size(group)


def rank_range(values: list[int], group, device) -> tuple[list[int], list[int]]:
    """(smallest, largest) of each of `values` over the ranks of `group`: one all-reduce of
    int64s on `device` (the backend's: CUDA for NCCL)."""
    facts = torch.tensor(values, dtype=torch.int64)
    both = torch.cat((facts, -facts)).to(device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    both = both.cpu().tolist()
    n = len(values)
    return [-x for x in both[n:]], both[:n]


def check_load_balance(load_balance) -> None:
    if load_balance not in LOAD_BALANCES:
        raise ValueError(f"load_balance must be one of {LOAD_BALANCES}, got {load_balance!r}")


def seq_dim(x: torch.Tensor, layout: str, dim) -> int:
    """The sequence dimension: `dim` when given (any tensor), else the one `layout` names."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if dim is not None:
        if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
            raise ValueError(f"dim must be an int in [{-x.dim()}, {x.dim()}) for a {x.dim()}-D "
                             f"tensor, got {dim!r}")
        return dim % x.dim()
    if not isinstance(layout, str) or layout not in SEQ_DIMS:
        raise ValueError(f"layout must be one of {sorted(SEQ_DIMS)}, got {layout!r}")
    if x.dim() != 4:
        raise ValueError(f"layout={layout!r} expects a 4-D tensor, got shape {tuple(x.shape)} "
                         f"(pass dim= for other tensors)")
    return SEQ_DIMS[layout]


def chunk_order(world_size: int, load_balance: str) -> list[int]:
    """The chunks of the full sequence in the order the ranks' shards hold them: rank 0's chunks,
    then rank 1's, ... ("zigzag", W=3: [0, 5, 1, 4, 2, 3])."""
    check_load_balance(load_balance)
    if load_balance == "none":
        return list(range(world_size))
    return [c for r in range(world_size) for c in (r, 2 * world_size - 1 - r)]


def _chunks_per_rank(load_balance: str) -> int:
    return 2 if load_balance == "zigzag" else 1


def shard_sequence(x, group=None, *, load_balance="zigzag", layout="bhsd", dim=None):
    """This rank's shard of `x`, the full sequence (the same on every rank).

    The sequence dimension is the one `layout` names ("bhsd": 2, "bshd": 1), or `dim`. Its length
    must be a multiple of W ("none") or 2W ("zigzag"). Returns a view ("none") or a new tensor
    ("zigzag"). Differentiable: the gradient reaches this rank's positions of `x` only (sum it
    over the ranks to get the full sequence's gradient).
    """
    check_load_balance(load_balance)
    d = seq_dim(x, layout, dim)
    rank, size = world(group)
    n_chunks = size * _chunks_per_rank(load_balance)
    if x.shape[d] % n_chunks:
        raise ValueError(f"the sequence length must be a multiple of {n_chunks} for "
                         f"load_balance={load_balance!r} on {size} ranks, got {x.shape[d]} "
                         f"(dim {d} of shape {tuple(x.shape)})")
    chunks = x.chunk(n_chunks, dim=d)
    if load_balance == "none":
        return chunks[rank]
    return torch.cat((chunks[rank], chunks[n_chunks - 1 - rank]), dim=d)


class _Unshard(torch.autograd.Function):
    """All-gather of the shards along `d`, reordered into the full sequence.

    The backward sums the incoming gradients over the ranks (every rank's loss may depend on every
    position) and keeps this rank's shard. It uses all_reduce rather than reduce_scatter, which
    gloo lacks, and makes the gradient contiguous first: collectives need contiguous buffers (the
    CPU build's backward of torch.distributed.nn.functional.all_gather gave wrong gradients for a
    non-contiguous one).
    """

    @staticmethod
    def forward(ctx, x, group, load_balance, d):
        ctx.group, ctx.load_balance, ctx.d = group, load_balance, d
        _, size = world(group)
        if size == 1:
            return x.clone()
        # all_gather takes equal buffers: another rank's shard of another shape or dtype would
        # abort that rank and leave this one's result partly unwritten
        # (a fixed-length summary: the all-reduce itself needs equal sizes on every rank)
        sizes = [*x.shape[:8], *[-1] * (8 - min(x.dim(), 8))]
        smallest, largest = rank_range([x.dim(), x.numel(), *sizes,
                                        zlib.crc32(str(x.dtype).encode())], group, x.device)
        if smallest != largest:
            raise ValueError(f"every rank's shard must have the same shape and dtype; this rank "
                             f"has {tuple(x.shape)} {x.dtype}, another rank another one")
        shards = [torch.empty_like(x, memory_format=torch.contiguous_format)
                  for _ in range(size)]
        dist.all_gather(shards, x.contiguous(), group=group)
        per_rank = _chunks_per_rank(load_balance)
        pieces = [c for s in shards for c in s.chunk(per_rank, dim=d)]  # in chunk_order
        order = chunk_order(size, load_balance)
        return torch.cat([pieces[order.index(c)] for c in range(len(order))], dim=d)

    @staticmethod
    def backward(ctx, grad):
        if world(ctx.group)[1] > 1:
            # a fresh contiguous buffer: all_reduce writes in place, and autograd's gradient
            # must not change under its other consumers
            grad = grad.clone(memory_format=torch.contiguous_format)
            dist.all_reduce(grad, group=ctx.group)
        return shard_sequence(grad, ctx.group, load_balance=ctx.load_balance, dim=ctx.d), \
            None, None, None


def unshard_sequence(x, group=None, *, load_balance="zigzag", layout="bhsd", dim=None):
    """The full sequence from every rank's shard `x` (all-gather, then reorder): the inverse of
    shard_sequence. Every rank's shard must have the same shape and dtype (checked with one
    small all-reduce before the all-gather: a ValueError on every rank otherwise).
    Differentiable: the gradient of a shard is the sum over ranks of the gradients at its
    positions."""
    check_load_balance(load_balance)
    d = seq_dim(x, layout, dim)
    if load_balance == "zigzag" and x.shape[d] % 2:
        raise ValueError(f"a zigzag shard holds two equal chunks, so its length must be even, "
                         f"got {x.shape[d]} (dim {d} of shape {tuple(x.shape)})")
    return _Unshard.apply(x, group, load_balance, d)
