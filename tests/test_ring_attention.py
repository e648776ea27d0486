"""ring_attention and the sharding helpers against float64 attention on the unsharded sequence.

CPU: 2 and 3 gloo ranks in spawned processes (the kernels through the Triton interpreter, fp32
and fp16), both load balances, GQA, head_dim 40, both layouts; world size 1 in this process.
Each rank draws the same seeded full q, k, v and upstream gradient, takes its shard, runs the
ring forward and backward, and checks its shard of out, dq, dk, dv. GPU (`cuda`): world size 1
in bf16, and 2-4 GPUs over NCCL in bf16 where the machine has them.

Tolerance rule, as the fused op's tests: max abs error against float64 autograd of
attention_reference at most twice the error of the same reference computed in the input dtype,
plus a floor (fp32 1e-5: a few fp32 roundings of O(1) values summed over <= 48 keys; fp16 2e-3:
each ring step rounds its block's output and dk/dv to fp16 once before the fp32 merge, up to three
steps per element here). In fp32 that is "exact up to fp32 rounding": the LSE merge adds a few
roundings, not an approximation. Every buffer the ops allocate starts as NaN.
"""

import socket
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from attnscope.attention import fused
from attnscope.attention.reference import attention_reference
from attnscope.parallel import chunk_order, ring_attention, shard_sequence, unshard_sequence

FLOORS = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 4e-3}
SPAWN_TIMEOUT_S = 240  # a hung collective fails the test instead of blocking CI


def _poison(like, shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device=like.device)


def _full_inputs(layout, heads, kv_heads, seq, head_dim, dtype, seed):
    """The full sequence's q, k, v and upstream gradient, the same on every rank."""
    g = torch.Generator().manual_seed(seed)

    def rand(h):
        shape = (1, h, seq, head_dim) if layout == "bhsd" else (1, seq, h, head_dim)
        return torch.randn(shape, generator=g).to(dtype)
    return rand(heads), rand(kv_heads), rand(kv_heads), rand(heads)


def _grads(fn, tensors, dout):
    leaves = [t.detach().requires_grad_() for t in tensors]
    out = fn(*leaves)
    return (out.detach(), *torch.autograd.grad(out, leaves, dout))


def check_ring(layout, load_balance, dtype, heads, kv_heads, chunk, head_dim, causal=True,
               seed=0, group=None):
    """Assert the tolerance rule on this rank's shard of out, dq, dk, dv (on this rank's GPU
    under NCCL)."""
    size = dist.get_world_size(group) if dist.is_initialized() else 1
    seq = chunk * size * (2 if load_balance == "zigzag" else 1)
    device = "cuda" if dist.is_initialized() and dist.get_backend(group) == "nccl" else "cpu"
    q, k, v, dout = (t.to(device) for t in _full_inputs(layout, heads, kv_heads, seq, head_dim,
                                                        dtype, seed))
    kwargs = dict(causal=causal, layout=layout)
    refs = _grads(lambda *t: attention_reference(*t, **kwargs), (q.double(), k.double(),
                  v.double()), dout.double())
    lows = _grads(lambda *t: attention_reference(*t, dtype=dtype, **kwargs), (q, k, v), dout)

    def shard(x):
        return shard_sequence(x, group, load_balance=load_balance, layout=layout)
    ours = _grads(lambda *t: ring_attention(*t, group=group, load_balance=load_balance, **kwargs),
                  [shard(t) for t in (q, k, v)], shard(dout))
    for name, got, ref, low in zip(("out", "dq", "dk", "dv"), ours, refs, lows):
        ref, low = shard(ref), shard(low)
        assert got.shape == ref.shape and got.dtype == dtype, name
        assert not got.isnan().any(), f"{name} has NaN"
        err = (got.double() - ref).abs().max().item()
        torch_err = (low.double() - ref).abs().max().item()
        assert err <= 2 * torch_err + FLOORS[dtype], (
            f"{name} ({layout}, {load_balance}, {dtype}): error {err:.3g} > 2 x torch's "
            f"{torch_err:.3g} + {FLOORS[dtype]}")
    # the gathered output is the full sequence's, in order
    full = unshard_sequence(ours[0], group, load_balance=load_balance, layout=layout)
    assert torch.equal(shard(full), ours[0])
    assert (full.double() - refs[0]).abs().max().item() <= 2 * (
        (lows[0].double() - refs[0]).abs().max().item()) + FLOORS[dtype]


def check_unshard_backward(load_balance, group=None):
    """unshard_sequence's backward sums the ranks' gradients, also a non-contiguous one."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    g = torch.Generator().manual_seed(7)
    full = torch.randn(2, 3, 4 * size, 5, generator=g, dtype=torch.float64)
    weights = [torch.randn(2, 3, 5, 4 * size, generator=g, dtype=torch.float64)
               for _ in range(size)]
    x = shard_sequence(full, group, load_balance=load_balance).requires_grad_()
    gathered = unshard_sequence(x, group, load_balance=load_balance)
    assert torch.equal(gathered, full)
    # Each rank's loss differs. Multiplying by a transposed weight hands the backward a
    # non-contiguous gradient.
    (gathered.transpose(2, 3) * weights[rank]).sum().backward()
    expected = shard_sequence(sum(weights).transpose(2, 3), group, load_balance=load_balance)
    assert torch.allclose(x.grad, expected, rtol=1e-12, atol=1e-12)


def check_unequal_shards_refused(group=None):
    # shapes, dtypes or arguments that differ between ranks: a ValueError on every rank (no
    # hang, no garbage)
    rank = dist.get_rank(group)
    q = torch.randn(1, 2, 4 + 2 * rank, 16, generator=torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match="same shape"):
        ring_attention(q, q, q, group=group)
    q = torch.randn(1, 2, 8, 16, generator=torch.Generator().manual_seed(4))
    with pytest.raises(ValueError, match="same dtypes"):
        x = q.half() if rank == 0 else q
        ring_attention(x, x, x, group=group)
    with pytest.raises(ValueError, match="same causal, scale"):
        ring_attention(q, q, q, group=group, causal=rank == 0)
    with pytest.raises(ValueError, match="same causal, scale"):
        ring_attention(q, q, q, group=group, scale=0.5 + rank)
    with pytest.raises(ValueError, match="same causal, scale"):  # -0.0: its bits are INT64_MIN
        ring_attention(q, q, q, group=group, scale=-0.0 if rank == 0 else 0.25)
    # one rank's own checks refuse its call (an odd zigzag shard): that rank raises its error,
    # the others hear of it, instead of waiting for it in the check's all-reduce
    x = q[:, :, :5] if rank == 0 else q[:, :, :4]
    with pytest.raises(ValueError, match="must be even" if rank == 0 else "another rank's"):
        ring_attention(x, x, x, group=group)
    # unshard_sequence's all-gather takes equal shards: another shape or dtype is refused on
    # every rank (gloo aborted a rank before, and left the other's result partly unwritten)
    with pytest.raises(ValueError, match="same shape and dtype"):
        unshard_sequence(q[:, :, :6 if rank == 0 else 4], group, load_balance="none")
    with pytest.raises(ValueError, match="same shape and dtype"):
        unshard_sequence(q.half() if rank == 0 else q, group, load_balance="none")


def check_non_members_refused():
    # a group of ranks 0 and 1: the others are no members, and get an error rather than the
    # zeros of collectives that do nothing on them
    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    if rank >= 2:
        q = torch.randn(1, 2, 8, 16, generator=torch.Generator().manual_seed(8))
        for call in (lambda: ring_attention(q, q, q, group=group),
                     lambda: shard_sequence(q, group), lambda: unshard_sequence(q, group)):
            with pytest.raises(ValueError, match="not a member of the group"):
                call()


# ---- spawned gloo ranks ---------------------------------------------------------------------

def _rank_main(rank, size, port, cases, backend):
    torch.set_num_threads(1)  # the CPU ranks share two cores
    fused._empty = _poison  # this process only: every op output starts as NaN
    device = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = {"device_id": torch.device("cuda", rank)}
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size, timeout=timedelta(seconds=SPAWN_TIMEOUT_S // 2),
                            **device)
    try:
        for fn, kwargs in cases:
            fn(**kwargs)
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(size, cases, monkeypatch, backend="gloo"):
    """Run `cases` on `size` ranks (gloo on CPU, or NCCL with a GPU each); a failure on a rank
    fails the test with its traceback."""
    if backend == "gloo":
        # The children import triton fresh: the interpreter must be on there even where this
        # process has a GPU and runs compiled kernels.
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")  # multicast stays off on the lent machines
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    context = mp.start_processes(_rank_main, args=(size, _free_port(), cases, backend),
                                 nprocs=size, join=False, start_method="spawn")
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"{size} ranks did not finish in {SPAWN_TIMEOUT_S} s")


def _case(fn, **kwargs):
    return fn, kwargs


# GQA (4 q heads on 2 k/v heads) and head_dim 40 (pads to 64) in the fp32 cases; fp16 in the
# other layout. Chunks of 8 keep the interpreter quick while the off-diagonal blocks differ.
CASES = [
    _case(check_ring, layout="bhsd", load_balance="zigzag", dtype=torch.float32, heads=4,
          kv_heads=2, chunk=8, head_dim=40),
    _case(check_ring, layout="bhsd", load_balance="none", dtype=torch.float32, heads=4,
          kv_heads=2, chunk=8, head_dim=40, seed=1),
    _case(check_ring, layout="bshd", load_balance="zigzag", dtype=torch.float16, heads=2,
          kv_heads=2, chunk=8, head_dim=32, seed=2),
    _case(check_ring, layout="bshd", load_balance="none", dtype=torch.float16, heads=2,
          kv_heads=1, chunk=8, head_dim=32, seed=3),
    _case(check_unshard_backward, load_balance="zigzag"),
    _case(check_unshard_backward, load_balance="none"),
    _case(check_unequal_shards_refused),
]


def test_two_ranks(monkeypatch):
    spawn(2, CASES, monkeypatch)


def test_three_ranks(monkeypatch):
    # full attention (causal=False) once: every step computes, no diagonal
    spawn(3, CASES + [_case(check_ring, layout="bhsd", load_balance="zigzag",
                            dtype=torch.float32, heads=2, kv_heads=2, chunk=4, head_dim=16,
                            causal=False, seed=4), _case(check_non_members_refused)],
          monkeypatch)


# ---- one process: world size 1, helpers, validation ----------------------------------------

@pytest.fixture
def nan_outputs(monkeypatch):
    monkeypatch.setattr(fused, "_empty", _poison)


@pytest.mark.parametrize("load_balance", ["zigzag", "none"])
def test_world_size_one(load_balance, nan_outputs):
    # no process group: one rank holds the whole sequence; odd length 2 x 13 under zigzag
    check_ring("bhsd", load_balance, torch.float32, heads=4, kv_heads=2, chunk=13, head_dim=40)


def test_chunk_order():
    assert chunk_order(3, "zigzag") == [0, 5, 1, 4, 2, 3]
    assert chunk_order(3, "none") == [0, 1, 2]


def _qkv(shape=(1, 2, 8, 16)):
    g = torch.Generator().manual_seed(5)
    return [torch.randn(shape, generator=g) for _ in range(3)]


@pytest.mark.parametrize("args,kwargs,error,match", [
    (_qkv(), {"load_balance": "ring"}, ValueError, "load_balance must be one of"),
    (_qkv(), {"layout": "sbhd"}, ValueError, "layout must be one of"),
    (_qkv((1, 2, 7, 16)), {}, ValueError, "length must be even, got 7"),
    (_qkv()[:1] + _qkv((1, 2, 6, 16))[1:], {}, ValueError, "one length"),
    (_qkv()[:2] + [None], {}, TypeError, "v must be a torch.Tensor"),
    (_qkv(), {"layout": ["bhsd"]}, ValueError, "layout must be one of"),
])
def test_validation(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        ring_attention(*args, **kwargs)


def test_shard_validation():
    x = torch.randn(1, 2, 7, 16, generator=torch.Generator().manual_seed(6))
    with pytest.raises(ValueError, match="multiple of 2"):
        shard_sequence(x, load_balance="zigzag")
    with pytest.raises(ValueError, match="dim must be an int"):
        shard_sequence(x, dim=4)
    with pytest.raises(ValueError, match="4-D tensor"):
        shard_sequence(x[0])
    with pytest.raises(ValueError, match="layout must be one of"):  # (was: unhashable type)
        shard_sequence(x, layout=["bhsd"])
    assert torch.equal(shard_sequence(x[0], dim=1, load_balance="none"), x[0])


# ---- GPU ------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("load_balance", ["zigzag", "none"])
def test_world_size_one_cuda_bf16(load_balance):
    """One GPU, bf16, a realistic length: the ring's single step is the fused op plus the merge."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, 2048, 128, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    dout = torch.randn_like(q)
    grads = _grads(lambda *t: ring_attention(*t, load_balance=load_balance), (q, k, v), dout)
    refs = _grads(attention_reference, (q.double(), k.double(), v.double()), dout.double())
    lows = _grads(lambda *t: attention_reference(*t, dtype=torch.bfloat16), (q, k, v), dout)
    for name, got, ref, low in zip(("out", "dq", "dk", "dv"), grads, refs, lows):
        err = (got.double() - ref).abs().max().item()
        torch_err = (low.double() - ref).abs().max().item()
        assert err <= 2 * torch_err + 4e-3, f"{name}: {err:.3g} > 2 x {torch_err:.3g} + 4e-3"


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("load_balance", ["zigzag", "none"])
def test_gpus_nccl_bf16(load_balance, monkeypatch):
    """Up to 4 GPUs over NCCL, bf16, GQA: the ring with compiled kernels and real overlap. The
    bf16 floor also covers each step's block dk/dv rounded to bf16 before the fp32 sum."""
    spawn(min(4, torch.cuda.device_count()), [_case(
        check_ring, layout="bhsd", load_balance=load_balance, dtype=torch.bfloat16, heads=8,
        kv_heads=2, chunk=512, head_dim=128)], monkeypatch, backend="nccl")
