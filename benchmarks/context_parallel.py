"""Context-parallel causal attention over several GPUs: attnscope's ring_attention against
PyTorch's context_parallel (torch.distributed.tensor.experimental, SDPA under it), and a model
of the several-GPU time built from kernel times measured on one GPU.

Measured (one process per GPU; N = 1 also works without torchrun):

    torchrun --nproc-per-node N benchmarks/context_parallel.py [--seqs 65536 1048576]

  per global sequence length, implementation and mode (fwd; fwd+bwd): median step time (the
  slowest rank's), peak memory per GPU (the largest rank's), TFLOP/s per GPU, and the largest
  difference between the two implementations' outputs. Both shard the sequence the same way
  (head-tail: rank r holds chunks r and 2N-1-r of 2N). With --baseline (the N=1 file) each row
  gets its strong-scaling efficiency T1 / (N * TN). Writes results/h200x<N>/bench_cp.json.

Model (one GPU, one process):

    python benchmarks/context_parallel.py --model [--ranks 2 4 8] [--seqs 131072 1048576]

  times the blocks each rank computes per ring step at N ranks (the diagonal block, causal
  2c x 2c; the off-diagonal blocks, full 2c x c and c x 2c; c = seq / 2N) forward and backward,
  plus the LSE merge, and the whole sequence on one GPU; the K/V (and, backward, fp32 dK/dV)
  transfer of a step takes latency + bytes / (link bandwidth x efficiency). A step lasts the
  longer of its compute and the transfer under it. Writes results/h200x1/bench_cp_model.json.
  notes/context_parallel.md explains the model and its limits.

--device cpu runs either mode on CPU (gloo, the Triton interpreter, fp32, PyTorch's context
parallelism left out: its SDPA dispatch covers the CUDA kernels only), to try the script itself.
"""

import argparse
import contextlib
import json
import math
import os
import statistics
import time
from datetime import timedelta
from pathlib import Path

# Before NCCL starts: NVLink SHARP (multicast) stays off on the machines this runs on.
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from attnscope.parallel import ring_attention  # noqa: E402
from attnscope.parallel.ring import _merge  # noqa: E402  (the model times the merge alone)
from attnscope.profile.env import collect_env  # noqa: E402
from attnscope.profile.flops import attention_flops  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# H200 NVLink 4: 18 links x 25 GB/s = 450 GB/s per direction (900 GB/s bidirectional). A ring
# step moves data one way, rank r to r+1.
NVLINK_GBPS_PER_DIRECTION = 450.0


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", type=int, nargs="+", default=[16384, 65536, 262144, 1048576],
                   help="global sequence lengths (each a multiple of 2 x ranks)")
    p.add_argument("--batch", type=int, default=1, help="batch size")
    p.add_argument("--heads", type=int, default=16, help="query heads")
    p.add_argument("--kv-heads", type=int, default=None, help="k/v heads (default: --heads)")
    p.add_argument("--head-dim", type=int, default=128, help="head dimension")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                   help="input dtype (CPU runs use fp32)")
    p.add_argument("--iters", type=int, default=5, help="timed iterations per row (median)")
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations first")
    p.add_argument("--modes", nargs="+", choices=["fwd", "fwd_bwd"], default=["fwd", "fwd_bwd"],
                   help="forward only, and forward + backward")
    p.add_argument("--impls", nargs="+", choices=["ring", "torch_cp"],
                   default=["ring", "torch_cp"], help="implementations to run")
    p.add_argument("--torch-rotate", choices=["allgather", "alltoall"], default="allgather",
                   help="how PyTorch's context parallelism moves K/V (its set_rotate_method)")
    p.add_argument("--baseline", type=Path, default=None,
                   help="a 1-GPU bench_cp.json: rows get scaling efficiency T1 / (N * TN)")
    p.add_argument("--out", type=Path, default=None,
                   help="output JSON (default results/h200x<N>/bench_cp.json, or "
                        "results/h200x1/bench_cp_model.json with --model)")
    p.add_argument("--model", action="store_true",
                   help="predict N-rank step times from one GPU's block times (no torchrun)")
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8],
                   help="--model: rank counts to predict")
    p.add_argument("--link-gbps", type=float, default=NVLINK_GBPS_PER_DIRECTION,
                   help="--model: link bandwidth per direction, GB/s (H200 NVLink 4: 450)")
    p.add_argument("--link-efficiency", type=float, default=0.8,
                   help="--model: share of --link-gbps a point-to-point transfer reaches")
    p.add_argument("--latency-us", type=float, default=10.0,
                   help="--model: fixed cost of one ring transfer, us")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: gloo and the Triton interpreter, to try the script without GPUs")
    return p.parse_args()


# ---- timing -------------------------------------------------------------------------------

def timed_ms(fn, iters, warmup, device):
    """Median time of `fn` over `iters` runs, ms (CUDA events on the GPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def step(fn, q, k, v, dout, mode):
    """One call: forward without autograd, or forward + backward into fresh leaves."""
    if mode == "fwd":
        with torch.no_grad():
            return fn(q, k, v)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    out.backward(dout)
    return out.detach()


# ---- measured mode ------------------------------------------------------------------------

def init(device):
    """The process group (torchrun's environment, or a single process) and this rank's device."""
    if "RANK" not in os.environ:  # python benchmarks/context_parallel.py: one rank
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29511"))
    local = int(os.environ["LOCAL_RANK"])
    if device == "cuda":
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=dev, timeout=timedelta(minutes=10))
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timedelta(minutes=10))
    return dev


def torch_cp(args, seq, dev):
    """PyTorch's context parallelism: (context factory, attention). SDPA runs inside its
    context_parallel, which shards a token buffer of the full length in place (the context picks
    its load balance from that length: head-tail for causal SDPA, as ours) and runs a ring inside
    SDPA. A context is entered once per row, so its sharding stays out of the step time; q, k,
    v are already the local shards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    set_rotate_method(args.torch_rotate)
    mesh = init_device_mesh(dev.type, (dist.get_world_size(),))
    tokens = torch.arange(seq, device=dev).expand(args.batch, seq).contiguous()
    gqa = {"enable_gqa": True} if args.kv_heads not in (None, args.heads) else {}

    def attention(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)
    return lambda: context_parallel(mesh, buffers=[tokens], buffer_seq_dims=[1]), attention


def ring(args, seq, dev):
    return contextlib.nullcontext, lambda q, k, v: ring_attention(q, k, v,
                                                                   load_balance="zigzag")


def measure(args, dev, dtype):
    size = dist.get_world_size()
    for seq in args.seqs:  # checked first: a bad length should not wait for the others' runs
        if seq % (2 * size):
            raise ValueError(f"--seqs: {seq} is not a multiple of 2 x {size} ranks")
    return [row for seq in args.seqs for row in measure_seq(args, dev, dtype, seq)]


def measure_seq(args, dev, dtype, seq):
    """The rows of one global length; its tensors are freed on return."""
    rank, size = dist.get_rank(), dist.get_world_size()
    kv_heads = args.kv_heads or args.heads
    rows = []
    shard = seq // size
    g = torch.Generator(device=dev).manual_seed(1000 + rank)  # each rank its own shard

    def rand(h):
        return torch.randn(args.batch, h, shard, args.head_dim, generator=g, device=dev,
                           dtype=torch.float32).to(dtype)
    q, k, v, dout = rand(args.heads), rand(kv_heads), rand(kv_heads), rand(args.heads)
    outputs = {}
    for impl in args.impls:
        if impl == "torch_cp" and dev.type != "cuda":
            rows.append(dict(seq=seq, impl=impl, skipped="PyTorch's context parallelism "
                             "dispatches CUDA SDPA kernels only"))
            continue
        context, attention = (ring if impl == "ring" else torch_cp)(args, seq, dev)
        for mode in args.modes:
            row = dict(seq=seq, impl=impl, mode=mode, ranks=size)
            try:
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(dev)
                with context():
                    ms = timed_ms(lambda: step(attention, q, k, v, dout, mode), args.iters,
                                  args.warmup, dev)
                    if mode == "fwd":
                        outputs[impl] = step(attention, q, k, v, dout, mode)
                peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else 0
                error = None
            except Exception as e:  # noqa: BLE001  (out of memory, or a peer's failure): a row
                ms, peak, error = 0.0, 0, f"{type(e).__name__}: {e}"[:300]
            # the slowest rank sets the step time; a rank that failed fails the row
            stats = torch.tensor([ms, peak / 2**30, error is not None], device=dev,
                                 dtype=torch.float64)
            dist.all_reduce(stats, op=dist.ReduceOp.MAX)
            ms, peak_gib, failed = stats.tolist()
            if failed:
                row["error"] = error or "failed on another rank"
                outputs.pop(impl, None)  # every rank then agrees on the comparison below
            else:
                flops = attention_flops(args.batch, args.heads, seq, seq, args.head_dim,
                                        causal=True, mode=mode)
                row.update(time_ms=ms, peak_gib_per_gpu=peak_gib,
                           tflops_per_gpu=flops / (ms * 1e-3) / size / 1e12)
            rows.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
    if len(outputs) == 2:  # same inputs, same sharding: the outputs should agree
        diff = (outputs["ring"].float() - outputs["torch_cp"].float()).abs().max()
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
        for row in rows:
            if row["seq"] == seq and row.get("mode") == "fwd":
                row["max_abs_diff_ring_vs_torch_cp"] = diff.item()
    return rows


def add_efficiency(rows, baseline_path):
    base = json.loads(baseline_path.read_text())
    t1 = {(r["seq"], r["impl"], r["mode"]): r["time_ms"] for r in base["rows"] if "time_ms" in r}
    for row in rows:
        key = (row["seq"], row["impl"], row.get("mode"))
        if key in t1 and "time_ms" in row:
            row["scaling_efficiency"] = t1[key] / (row["ranks"] * row["time_ms"])


# ---- model mode ---------------------------------------------------------------------------

def block_times(args, dev, dtype, q_len, kv_len, causal, merge=True):
    """(forward ms, backward ms) of one block, the forward including the LSE merge a ring step
    does (`merge`; one GPU's whole sequence has none)."""
    g = torch.Generator(device=dev).manual_seed(q_len + kv_len)
    kv_heads = args.kv_heads or args.heads

    def rand(h, n):
        return torch.randn(args.batch, h, n, args.head_dim, generator=g, device=dev,
                           dtype=torch.float32).to(dtype)
    q, k, v, dout = rand(args.heads, q_len), rand(kv_heads, kv_len), rand(kv_heads, kv_len), \
        rand(args.heads, q_len)
    scale = 1.0 / math.sqrt(args.head_dim)
    acc = torch.zeros(q.shape, device=dev)
    acc_lse = torch.randn(q.shape[:3], generator=g, device=dev)
    out, lse = torch.ops.attnscope.attention_fwd(q, k, v, causal, scale, False, "bhsd")

    def forward():
        o, l = torch.ops.attnscope.attention_fwd(q, k, v, causal, scale, False, "bhsd")
        if merge:
            _merge(acc, acc_lse.clone(), o, l, "bhsd")
    fwd = timed_ms(forward, args.iters, args.warmup, dev)
    bwd = timed_ms(lambda: torch.ops.attnscope.attention_bwd(dout, q, k, v, out, lse, causal,
                                                             scale, False, "bhsd"),
                   args.iters, args.warmup, dev)
    return fwd, bwd


def ring_time(steps_compute, comm_under, tail=0.0):
    """A ring pass: each step lasts the longer of its compute and the transfer posted under it."""
    return sum(max(c, t) for c, t in zip(steps_compute, comm_under)) + tail


def predict(args, dev, dtype):
    kv_heads = args.kv_heads or args.heads
    item = torch.tensor([], dtype=dtype).element_size()
    bandwidth = args.link_gbps * args.link_efficiency * 1e9  # bytes/s
    rows = []
    for seq in args.seqs:
        one_fwd, one_bwd = block_times(args, dev, dtype, seq, seq, True, merge=False)
        for n in args.ranks:
            if seq % (2 * n):
                raise ValueError(f"--seqs: {seq} is not a multiple of 2 x {n} ranks")
            c = seq // (2 * n)
            diag = block_times(args, dev, dtype, 2 * c, 2 * c, True)
            head = block_times(args, dev, dtype, 2 * c, c, False)  # from an earlier rank
            tail = block_times(args, dev, dtype, c, 2 * c, False)  # from a later rank
            kv_bytes = 2 * args.batch * kv_heads * 2 * c * args.head_dim * item
            t_kv = (args.latency_us * 1e-6 + kv_bytes / bandwidth) * 1e3
            t_dkv = (args.latency_us * 1e-6 + kv_bytes * 4 / item / bandwidth) * 1e3  # fp32
            fwd_ranks, bwd_ranks = [], []
            for r in range(n):
                # step s holds the block of rank r - s: earlier ranks' blocks for s <= r
                blocks = [diag] + [head if s <= r else tail for s in range(1, n)]
                kv_under = [t_kv] * (n - 1) + [0.0]
                fwd_ranks.append(ring_time([b[0] for b in blocks], kv_under))
                # backward: the next K/V and the previous step's dK/dV share the link
                under = [k + (t_dkv if s else 0.0) for s, k in enumerate(kv_under)]
                bwd_ranks.append(ring_time([b[1] for b in blocks], under, tail=t_dkv))
            fwd, bwd = max(fwd_ranks), max(bwd_ranks)
            compute_fwd = max(diag[0] + r * head[0] + (n - 1 - r) * tail[0] for r in range(n))
            for mode, t_n, t_1, compute in (("fwd", fwd, one_fwd, compute_fwd),
                                            ("fwd_bwd", fwd + bwd, one_fwd + one_bwd, None)):
                row = dict(seq=seq, ranks=n, mode=mode, chunk=c, predicted_ms=t_n,
                           one_gpu_ms=t_1, scaling_efficiency=t_1 / (n * t_n),
                           kv_transfer_ms=t_kv, block_ms=dict(diag=diag, head=head, tail=tail))
                if compute is not None:
                    row["comm_exposed_ms"] = fwd - compute
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "block_ms"}), flush=True)
    return rows, dict(link_gbps_per_direction=args.link_gbps,
                      link_efficiency=args.link_efficiency, latency_us=args.latency_us)


def main():
    args = parse_args()
    dtype = torch.float32 if args.device == "cpu" else DTYPES[args.dtype]
    shape = dict(batch=args.batch, heads=args.heads, kv_heads=args.kv_heads or args.heads,
                 head_dim=args.head_dim, dtype=str(dtype), causal=True)
    if args.model:
        dev = torch.device(args.device)
        rows, assumptions = predict(args, dev, dtype)
        result = dict(kind="model", shape=shape, assumptions=assumptions, rows=rows)
        out = args.out or Path("results/h200x1/bench_cp_model.json")
    else:
        dev = init(args.device)
        rows = measure(args, dev, dtype)
        result = dict(kind="measured", ranks=dist.get_world_size(), shape=shape,
                      torch_rotate=args.torch_rotate, load_balance="zigzag (head-tail)", rows=rows)
        if args.baseline is not None:
            add_efficiency(rows, args.baseline)
        out = args.out or Path(f"results/h200x{dist.get_world_size()}/bench_cp.json")
        rank = dist.get_rank()
        dist.destroy_process_group()
        if rank:
            return
    result["env"] = collect_env()
    if torch.cuda.is_available():
        result["env"]["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    result["env"].update({k: os.environ[k] for k in ("NCCL_NVLS_ENABLE",
                                                     "TORCH_SYMM_MEM_DISABLE_MULTICAST")})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
