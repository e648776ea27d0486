"""Lab: where a Gluon forward call's time goes inside the kernel, from global-timer stamps.

With lab commit's PHASES (attention_fwd_hopper.py: `phases=` an int64 [programs, 16] buffer), the
loader warp stamps %globaltimer (ns) at its start (0), after making its TMA descriptors (1), after
issuing its first tile's Q (2) and at its end (3); consumer warpgroup 0 at its start (4), after
making the output's descriptors (5), when its first tile's Q has landed (6), when that tile's first
S = Q K^T is done (7), after its block loops (8), when the last V block has landed (11), when the
last P V product is done (12), after the LSE's store (13), after its epilogue's store is issued (9)
and at its exit, once the store has read shared memory (10); for its second tile, if any, after
the block loops (14) and after the store is issued (15). Per call (L2 cleared first, as
do_bench does) the script prints each phase's median and largest span over the programs, and the
kernel's span (first stamp to last) next to do_bench's time of the same call, stamped and not.

    python benchmarks/labs/fwd_phases.py --q-len 512 --kv-len 1024 4096 16384 --heads 32 \
        --kv-heads 8 --head-dim 128
"""
import argparse
import statistics

import torch
import triton

from attnscope.kernels import attention_fwd_hopper as hopper

PHASES = [  # (name, from stamp, to stamp)
    ("loader: descriptors", 0, 1),
    ("loader: start to first Q issued", 0, 2),
    ("consumer: start after loader start", 0, 4),
    ("consumer: output descriptors", 4, 5),
    ("consumer: start to Q landed", 4, 6),
    ("consumer: Q landed to first S", 6, 7),
    ("consumer: first S to loops' end", 7, 8),
    ("consumer: last P V and epilogue", 8, 9),
    ("  loops' end to last V landed", 8, 11),
    ("  last V landed to last P V done", 11, 12),
    ("  last P V done to LSE stored", 12, 13),
    ("  LSE stored to store issued", 13, 9),
    ("second tile: last P V and epilogue", 14, 15),
    ("consumer: store wait to exit", 9, 10),
]


def run(q, k, v, out, lse, offset, stamps):
    hopper.attention_fwd_hopper(q, k, v, out, lse, causal=True, scale=q.shape[-1] ** -0.5,
                                causal_offset=offset, phases=stamps)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=1, help="sequences (default 1)")
    p.add_argument("--heads", type=int, default=32, help="query heads (default 32)")
    p.add_argument("--kv-heads", type=int, default=8, help="K/V heads (default 8)")
    p.add_argument("--head-dim", type=int, default=128, help="head_dim (default 128)")
    p.add_argument("--q-len", type=int, default=512, help="queries per sequence (default 512)")
    p.add_argument("--kv-len", type=int, nargs="+", default=[4096],
                   help="keys per sequence, one call each, >= --q-len (bottom-right causal)")
    p.add_argument("--calls", type=int, default=20, help="stamped calls per length (default 20)")
    args = p.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    gen = torch.Generator(device=dev).manual_seed(0)
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device=dev)
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}, triton "
          f"{triton.__version__}; batch {args.batch}, heads {args.heads}/{args.kv_heads}, "
          f"head_dim {args.head_dim}, {args.q_len} queries, bf16, causal bottom-right")
    for kv_len in args.kv_len:
        if kv_len < args.q_len:
            raise SystemExit(f"--kv-len {kv_len} < --q-len {args.q_len}")
        q = torch.randn(args.batch, args.heads, args.q_len, args.head_dim, device=dev,
                        dtype=torch.bfloat16, generator=gen)
        k, v = (torch.randn(args.batch, args.kv_heads, kv_len, args.head_dim, device=dev,
                            dtype=torch.bfloat16, generator=gen) for _ in range(2))
        out = torch.full_like(q, float("nan"))
        lse = torch.empty(args.batch, args.heads, args.q_len, device=dev)
        stamps = torch.zeros(sms, 16, dtype=torch.int64, device=dev)
        offset = kv_len - args.q_len
        run(q, k, v, out, lse, offset, stamps)  # compile
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.float(), k.float().repeat_interleave(args.heads // args.kv_heads, 1),
            v.float().repeat_interleave(args.heads // args.kv_heads, 1),
            attn_mask=torch.ones(args.q_len, kv_len, dtype=torch.bool, device=dev).tril(offset))
        err = (out.float() - ref).abs().max().item()
        spans, per_phase = [], {name: [] for name, _, _ in PHASES}
        for _ in range(args.calls):
            stamps.zero_()
            flush.zero_()
            run(q, k, v, out, lse, offset, stamps)
            torch.cuda.synchronize()
            s = stamps[stamps[:, 0] > 0].cpu().double()
            first = s[:, [0, 4]].min().item()
            spans.append((s[:, [3, 10]].max().item() - first) / 1e3)
            for name, a, b in PHASES:
                both = (s[:, a] > 0) & (s[:, b] > 0)  # (a program of one tile has no 14, 15)
                if not both.any():
                    continue
                d = (s[both, b] - s[both, a]) / 1e3
                per_phase[name].append((d.median().item(), d.max().item()))
        ms = triton.testing.do_bench(lambda: run(q, k, v, out, lse, offset, stamps), warmup=25,
                                     rep=100, return_mode="median")
        plain = triton.testing.do_bench(lambda: run(q, k, v, out, lse, offset, None), warmup=25,
                                        rep=100, return_mode="median")
        print(f"\n{kv_len} keys ({-(-kv_len // 128)} blocks of 128 a tile at most), "
              f"{len(s)} programs, max error {err:.2e}: do_bench {ms * 1e3:.1f} us "
              f"({plain * 1e3:.1f} without stamps), stamped span "
              f"{statistics.median(spans):.1f} us (median of {args.calls} calls)")
        for name, _, _ in PHASES:
            if not per_phase[name]:
                continue
            med = statistics.median(x[0] for x in per_phase[name])
            mx = statistics.median(x[1] for x in per_phase[name])
            print(f"  {name:38s} median over programs {med:7.2f} us, largest {mx:7.2f} us")


if __name__ == "__main__":
    main()
