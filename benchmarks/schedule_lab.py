"""Schedule lab: the Gluon kernel's persistent tile schedule under other per-tile costs.

tile_schedule hands tiles to programs by list scheduling with a cost model: a tile costs its
K/V blocks plus TILE_OVERHEAD blocks (its Q load, first softmax and epilogue, which nothing
overlaps within the tile). v12 set it to 1 without measuring others. This times the fused op
(bf16, causal) with each overhead, and with the round-robin order (`_BALANCED` off), in
interleaved rounds, next to cuDNN, and prints for each the busiest program's modelled load
over the mean (under that variant's own model). Lab only: the shipped value is the constant.

    python benchmarks/schedule_lab.py [--shapes 8,16,1024,128 4,32,4096,128,8] [--overheads 0 1 2 4]
"""
import argparse
import json
import statistics

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import attnscope
from attnscope.kernels import attention_fwd as fwd
from fused_lab import inputs, timed  # benchmarks/, the script's own folder


def use(hopper, overhead):
    """Schedule with this per-tile overhead (None: round-robin). tile_schedule keys its tables
    by the overhead; the kept launches, which hold a table, are dropped."""
    hopper._BALANCED = overhead is not None
    hopper.TILE_OVERHEAD = 1 if overhead is None else overhead
    fwd.forget_launches()


def imbalance(hopper, q, k, overhead):
    """The busiest program's modelled load over the mean, for the table `use` made (the model
    with the variant's overhead; round-robin read with the shipped model's)."""
    b, h, s, _ = q.shape
    rows, block_n = 2 * 64, hopper.CONFIGS[128][0]
    num_m, group = -(-s // rows), fwd.head_group(q, k)
    programs = min(b * h * num_m, torch.cuda.get_device_properties(0).multi_processor_count)
    table = hopper.tile_schedule(q.device, b * h, num_m, group, programs, rows, block_n, s, True,
                                 0, overhead is not None).cpu().tolist()
    cost = hopper.tile_costs(b * h, num_m, group, rows, block_n, s, True, 0)
    loads = [sum(cost[t] for t in row[1:1 + row[0]]) for row in table]
    return max(loads) / statistics.mean(loads)


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+",
                   default=["8,16,1024,128", "4,32,4096,128", "4,32,4096,128,8", "2,16,16384,128"],
                   help="B,H,S,D[,kv_heads] (bf16, causal, head_dim 128)")
    p.add_argument("--overheads", nargs="+", type=int, default=[0, 1, 2, 3, 4],
                   help="per-tile overheads to try, in K/V blocks (round-robin is always added)")
    p.add_argument("--repeat", type=int, default=3, help="interleaved timing rounds")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetition time, ms")
    p.add_argument("--out", default=None, help="append JSON lines here")
    args = p.parse_args()
    hopper = fwd._hopper()
    if hopper is None:
        p.error("the Gluon kernel needs Triton 3.6")
    shipped = hopper.TILE_OVERHEAD
    variants = [*args.overheads, None]
    out = open(args.out, "a") if args.out else None
    for text in args.shapes:
        b, h, s, d, *kv = (int(x) for x in text.split(","))
        sets = inputs((b, h, s, d), torch.bfloat16, kv[0] if kv else None)
        times = {v: [] for v in variants}
        times["cudnn"] = []
        for _ in range(args.repeat):
            for v in variants:
                use(hopper, v)
                attnscope.fused_attention(*sets[0])  # the schedule is made on this call
                times[v].append(timed(attnscope.fused_attention, sets, 25, args.rep))

            def cudnn(q, k, v):
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return torch.nn.functional.scaled_dot_product_attention(
                        q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
            times["cudnn"].append(timed(cudnn, sets, 25, args.rep))
        for v, ts in times.items():
            name = "cudnn" if v == "cudnn" else "round-robin" if v is None else f"overhead {v}"
            row = {"shape": text, "variant": name, "median_ms": statistics.median(ts),
                   "rounds_ms": ts}
            if v != "cudnn":
                use(hopper, v)
                row["model_busiest_over_mean"] = imbalance(hopper, *sets[0][:2], v)
            print(f"{text:18s} {name:12s} {row['median_ms']:.4f} ms  rounds "
                  + " ".join(f"{t:.4f}" for t in ts)
                  + (f"  model max/mean {row['model_busiest_over_mean']:.3f}"
                     if "model_busiest_over_mean" in row else ""), flush=True)
            if out:
                out.write(json.dumps(row) + "\n")
    use(hopper, shipped)


if __name__ == "__main__":
    main()
