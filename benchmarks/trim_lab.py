"""Lab for the masked-band trims of the Triton forward (EVEN_N, EMPTY_ROWS; branch
v10-lab-mask-trims): the kernel with and without them, interleaved, next to cuDNN, on one GPU.
Without the trims every masked block checks keys against the key length and guards rows that
saw no key, as before; with them, those checks are compiled out where the launch shows they
cannot matter (key length a multiple of BLOCK_N; causal offset >= 0).

    python benchmarks/trim_lab.py --shapes 16,16,512,64 8,16,1024,64 4,32,4096,64 --out lab.jsonl
"""
import argparse
import json
import statistics
import sys

import torch
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

from attnscope.kernels import attention_fwd as fwd


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["8,16,1024,64"],
                   help="batch,heads,seq,head_dim (bf16, causal; head_dim 64 runs Triton)")
    p.add_argument("--repeat", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--out", default=None, help="JSON lines file")
    args = p.parse_args()
    rows = []
    for spec in args.shapes:
        b, h, s, d = (int(x) for x in spec.split(","))
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        out, lse = torch.empty_like(q), torch.empty(b, h, s, device="cuda")
        call = lambda: fwd.attention_fwd(q, k, v, out, lse, causal=True, scale=d ** -0.5,  # noqa
                                         causal_offset=0)
        times = {"trims": [], "no trims": [], "cudnn": []}
        for _ in range(args.repeat):
            for name in ("trims", "no trims"):
                fwd._MASK_TRIMS = name == "trims"
                times[name].append(triton.testing.do_bench(call, warmup=25, rep=100))
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                times["cudnn"].append(triton.testing.do_bench(
                    lambda: torch.nn.functional.scaled_dot_product_attention(
                        q, k, v, is_causal=True), warmup=25, rep=100))
        fwd._MASK_TRIMS = True
        for name, ts in times.items():
            row = dict(shape=[b, h, s, d], variant=name, median_ms=statistics.median(ts), runs=ts)
            rows.append(row)
            print(f"{spec:>16s} {name:9s} {row['median_ms']:.4f} ms  runs "
                  f"{' '.join(f'{t:.4f}' for t in ts)}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
