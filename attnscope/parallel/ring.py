r"""Ring attention: exact causal attention over a sequence sharded across the ranks of a
torch.distributed group, built on attnscope's custom ops.

Each rank keeps its queries; the K/V shards travel around the ring (rank r sends to r+1 and
receives from r-1), so at step s rank r holds the K/V of rank (r - s) mod W. The transfer of the
next step's block is posted before this step's attention runs, so it overlaps the compute. Each
step's partial output and log-sum-exp merge into fp32 accumulators through the LSE:

    lse = logaddexp(lse_a, lse_b),   out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

which is exact (softmax over the union of the key sets) and stable (every weight is <= 1). A row
that has seen no key yet has lse -inf; its weights are taken as 0, not NaN.

The backward runs the ring again. It gives attnscope::attention_bwd the final (merged) output and
LSE, with which each block's call returns that block's exact share of dq and the block's dk, dv: no
merge is recomputed. dq accumulates locally; dk, dv accumulate in fp32 buffers that travel with the
K/V and reach their owner after a full turn of the ring.

Which blocks a step computes (causal): let a rank's shard hold chunks of the sequence in increasing
order. A block from the same rank is the diagonal: causal, top-left aligned (equal lengths). A
block from earlier positions is fully visible (causal=False); one from later positions is skipped.
With load_balance="zigzag", rank r holds chunks a = r and b = 2W-1-r; the K/V of rank src holds
chunks src and 2W-1-src. Per step, on the chunk grid (\ causal, # full, . nothing):

      src == r (step 0)          src < r                    src > r
           k: a   b                   k: src  tail               k: src  tail
     q: a   [ \   . ]         q: a   [  #     .  ]        q: a   [  .     .  ]
        b   [ #   \ ]            b   [  #     .  ]           b   [  #     #  ]
     one causal call on     all queries x the head     the tail queries x all
     the whole shard        chunk of k/v, full         of k/v, full

(src < r: chunk src precedes both of r's chunks, chunk 2W-1-src follows both. src > r: chunk a
precedes both of src's chunks, chunk b follows both.) Every off-diagonal step is c x 2c of full
attention on every rank (c the chunk length), and the diagonal 2c x 2c causal the same work, so
the ranks stay in step. With load_balance="none" rank r computes its diagonal and r full blocks
and skips the rest: the ring runs at the pace of rank W-1.
"""

from __future__ import annotations

import math
import struct
import warnings

import torch
import torch.distributed as dist

# fused.py registers torch.ops.attnscope.*; its checks are the ops' contract (shapes, dtypes,
# head_dim, GQA), which the ops themselves do not repeat
from attnscope.attention.fused import DTYPES, _validate as _validate_attention
from attnscope.parallel.sharding import (LOAD_BALANCES, SEQ_DIMS, check_load_balance, rank_range,
                                        world)

_checked_calls = set()  # (group, shard shapes, dtypes, arguments) already checked on every rank


def _check_equal_shards(q, k, group, size, causal, scale, layout, load_balance, refused=None):
    """Every rank's call must be the same one: shards of one shape (the ring's receive buffers
    are sized from this rank's, and the causal structure assumes equal chunks), of one dtype (a
    rank receiving another dtype's bytes reads garbage or aborts) and with the same causal, scale,
    layout and load_balance (else a rank computes other blocks than its neighbours send, with no
    error). Checked with one all-reduce the first time a group sees such a call on this rank: on
    GPUs it stalls the host until the GPU catches up, which a training loop should pay once, not
    per layer. `refused`: this rank's own checks' error, which it raises after telling the other
    ranks, so that they raise too instead of waiting for it in a collective (where they have
    checked their call before they are in the ring's transfers instead: every rank then waits
    until the group's timeout, and the refused rank, which warned of its reason at once, raises
    it). A later call that differs between ranks but that every rank has checked before is not
    caught: each rank then computes with its own arguments (a wrong result, no error), or with
    other shapes the transfers fail or wait."""
    if size == 1:
        if refused is not None:
            raise refused
        return
    if refused is None:
        args = (causal, scale, layout, load_balance)
        key = (group, size, tuple(q.shape), tuple(k.shape), q.dtype, k.dtype, args)
        if key in _checked_calls:
            return
        facts = [0, *q.shape, *k.shape, DTYPES.index(q.dtype), DTYPES.index(k.dtype), int(causal),
                 struct.unpack("<q", struct.pack("<d", scale))[0], sorted(SEQ_DIMS).index(layout),
                 LOAD_BALANCES.index(load_balance)]
        device = q.device
    else:  # (this rank's values may not even be tensors: a summary that only says "refused")
        # Said at once: where the other ranks have checked their call before, they are not in
        # this all-reduce but in the ring's transfers, and every rank waits until the timeout.
        warnings.warn(f"ring_attention: this rank's call is refused ({refused}); telling the "
                      f"other ranks", stacklevel=3)
        facts = [1, *[0] * (4 + 4 + 6)]  # as many as a call's: q's and k's dims, 2 dtypes, 4 args
        device = (q.device if isinstance(q, torch.Tensor) else
                  torch.device("cuda", torch.cuda.current_device())
                  if "nccl" in str(dist.get_backend(group)) else torch.device("cpu"))
    try:
        smallest, largest = rank_range(facts, group, device)
    except Exception:  # noqa: BLE001 (a timed-out or broken collective: this rank's reason)
        if refused is not None:
            raise refused from None
        raise
    if largest[0]:
        if refused is not None:
            raise refused
        raise ValueError("another rank's ring_attention call was refused by its checks (its "
                         "error says why); every rank stops")
    smallest, largest = smallest[1:], largest[1:]
    if smallest[:8] != largest[:8]:
        raise ValueError(f"every rank's shards must have the same shape; this rank has q "
                         f"{tuple(q.shape)} and k/v {tuple(k.shape)}, and the ranks' shapes range "
                         f"from {smallest[:8]} to {largest[:8]} (q dims then k dims)")
    if smallest[8:10] != largest[8:10]:
        raise ValueError(f"every rank's q and k/v must have the same dtypes; this rank has "
                         f"{q.dtype} and {k.dtype}, another rank other ones")
    if smallest != largest:
        raise ValueError(f"every rank must call ring_attention with the same causal, scale, "
                         f"layout and load_balance; this rank has causal={causal}, "
                         f"scale={scale!r}, layout={layout!r}, load_balance={load_balance!r}, "
                         f"another rank other ones")
    _checked_calls.add(key)


def _block(step, rank, size, causal, load_balance, length):
    """What step `step` computes: None to skip, else (q_start, q_len, kv_start, kv_len, causal)
    along the sequence dimension of this rank's queries and of the K/V block it holds."""
    src = (rank - step) % size
    if not causal:
        return 0, length, 0, length, False
    if src == rank:
        return 0, length, 0, length, True
    half = length // 2
    if load_balance == "none":
        return (0, length, 0, length, False) if src < rank else None
    if src < rank:
        return 0, length, 0, half, False  # all queries x the K/V head chunk
    return half, half, 0, length, False  # the tail queries x all of the K/V


def _pass_on(tensors, group, rank, size, tag):
    """Post sends of `tensors` to the next rank and receives of the same shapes from the previous
    one; returns the receive buffers and the requests to wait on."""
    def global_rank(r):
        return r if group is None else dist.get_global_rank(group, r)

    nxt, prv = global_rank((rank + 1) % size), global_rank((rank - 1) % size)
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, nxt, group, tag + i) for i, t in enumerate(tensors)]
    ops += [dist.P2POp(dist.irecv, t, prv, group, tag + i) for i, t in enumerate(received)]
    return received, dist.batch_isend_irecv(ops)


def _wait(requests):
    for request in requests:
        request.wait()


def _lse_as_out(lse, layout):
    """[batch, heads, seq] LSE (or weight) viewed to broadcast against an output in `layout`."""
    return (lse if layout == "bhsd" else lse.transpose(1, 2)).unsqueeze(-1)


def _merge(out, lse, block_out, block_lse, layout):
    """Fold one block's (out, lse) into the fp32 accumulators `out`, `lse` (views, in place)."""
    merged = torch.logaddexp(lse, block_lse)
    # Rows no block has reached: both LSEs -inf, so exp(-inf - -inf) would be NaN. Measured from
    # 0 instead, both weights are exp(-inf) = 0 and the row stays 0.
    base = merged.masked_fill(merged == -math.inf, 0.0)
    out.mul_(_lse_as_out(torch.exp(lse - base), layout))
    out.add_(block_out.float() * _lse_as_out(torch.exp(block_lse - base), layout))
    lse.copy_(merged)


def _ring_forward(q, k, v, causal, scale, layout, load_balance, group, rank, size):
    d = SEQ_DIMS[layout]
    length = q.shape[d]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((q.shape[0], q.shape[3 - d], length), -math.inf, device=q.device)
    kv = (k.contiguous(), v.contiguous())  # collectives send contiguous buffers
    for step in range(size):
        if step + 1 < size:  # the next block's transfer runs under this block's attention
            kv_next, requests = _pass_on(kv, group, rank, size, tag=0)
        block = _block(step, rank, size, causal, load_balance, length)
        if block is not None:
            q0, qn, k0, kn, block_causal = block
            block_out, block_lse = torch.ops.attnscope.attention_fwd(
                q.narrow(d, q0, qn), kv[0].narrow(d, k0, kn), kv[1].narrow(d, k0, kn),
                block_causal, scale, False, layout)
            _merge(out.narrow(d, q0, qn), lse.narrow(2, q0, qn), block_out, block_lse, layout)
        if step + 1 < size:
            _wait(requests)
            kv = kv_next
    return out.to(q.dtype), lse


def _ring_backward(dout, q, k, v, out, lse, causal, scale, layout, load_balance, group, rank,
                   size):
    d = SEQ_DIMS[layout]
    length = q.shape[d]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = (k.contiguous(), v.contiguous())
    # dk, dv of the block held at this step: they travel one step behind the K/V
    dkv = tuple(torch.zeros(k.shape, dtype=torch.float32, device=k.device) for _ in range(2))
    dkv_requests = []
    for step in range(size):
        if step + 1 < size:
            kv_next, kv_requests = _pass_on(kv, group, rank, size, tag=0)
        block = _block(step, rank, size, causal, load_balance, length)
        if block is not None:
            q0, qn, k0, kn, block_causal = block
            block_dq, block_dk, block_dv = torch.ops.attnscope.attention_bwd(
                dout.narrow(d, q0, qn), q.narrow(d, q0, qn), kv[0].narrow(d, k0, kn),
                kv[1].narrow(d, k0, kn), out.narrow(d, q0, qn),
                lse.narrow(2, q0, qn).contiguous(),  # the kernels read a contiguous LSE
                block_causal, scale, False, layout)
            dq.narrow(d, q0, qn).add_(block_dq)
        _wait(dkv_requests)  # this block's accumulators, from the previous rank (after compute)
        if block is not None:
            dkv[0].narrow(d, k0, kn).add_(block_dk)
            dkv[1].narrow(d, k0, kn).add_(block_dv)
        if size > 1:  # after the last step this send takes each accumulator home
            dkv, dkv_requests = _pass_on(dkv, group, rank, size, tag=2)
        if step + 1 < size:
            _wait(kv_requests)
            kv = kv_next
    _wait(dkv_requests)
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, layout, load_balance, group):
        rank, size = world(group)
        out, lse = _ring_forward(q, k, v, causal, scale, layout, load_balance, group, rank, size)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (causal, scale, layout, load_balance, group, rank, size)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        return (*_ring_backward(dout, q, k, v, out, lse, *ctx.args), None, None, None, None, None)


def ring_attention(q, k, v, *, group=None, causal=True, layout="bhsd", load_balance="zigzag",
                   scale=None):
    """Attention over a sequence sharded across the ranks of `group` (the default group when
    None; without an initialized process group, one rank holding the whole sequence).

    q, k, v: this rank's shards, [batch, heads, shard_len, head_dim] (layout="bhsd") or
    [batch, shard_len, heads, head_dim] ("bshd"), as shard_sequence cuts them with the same
    `load_balance`: "zigzag" (rank r holds chunks r and 2W-1-r of 2W; balances causal work) or
    "none" (chunk r of W). Every rank's shards have one shape; q and k/v have the same length (self
    attention), even under "zigzag"; q heads a multiple of k/v heads (GQA). dtypes and head_dim as
    fused_attention; `scale` defaults to 1/sqrt(head_dim). `causal` is causal attention over the
    full sequence (top-left aligned); causal=False attends to every key.

    Returns this rank's shard of the output, in q's layout and dtype. Differentiable in q, k, v.
    Every rank must call it (the K/V pass through every rank).
    """
    _, size = world(group)
    refused = None
    try:  # this rank's own checks; a refusal is shared with the other ranks before it is raised
        _validate_attention(q, k, v, causal, scale, layout, "top_left")
        check_load_balance(load_balance)
        d = SEQ_DIMS[layout]
        if q.shape[d] != k.shape[d]:
            raise ValueError(f"ring attention needs q and k/v shards of one length (self "
                             f"attention), got {q.shape[d]} and {k.shape[d]}")
        if load_balance == "zigzag" and q.shape[d] % 2:
            raise ValueError(f"a zigzag shard holds two equal chunks, so its length must be even, "
                             f"got {q.shape[d]}")
        if scale is None:
            scale = 1.0 / math.sqrt(q.shape[-1])
    except (ValueError, TypeError) as exc:
        refused = exc
    # (+ 0.0: -0.0 as 0.0, whose bits the check's negation would overflow)
    _check_equal_shards(q, k, group, size, bool(causal),
                        None if refused else float(scale) + 0.0, layout, load_balance, refused)
    return _RingAttention.apply(q, k, v, causal, float(scale), layout, load_balance, group)
