"""Lab of the sliding window and the softcap (notes/serving.md): the op's time with each window
and softcap asked for, against the same call without either, one shape at a time.

For kernel work, not the benchmark of record. On a GPU only (do_bench median, bf16); the shape is
q [batch, heads, seq, head_dim] with k/v of kv_heads heads, causal.

    PYTHONPATH=. python benchmarks/labs/window_lab.py --shape 1,32,8,8192,128 \
        --windows 1023 4095 --softcaps 50
"""
import argparse

import torch
import triton

from attnscope import fused_attention


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="1,32,8,8192,128",
                   help="batch,heads,kv_heads,seq,head_dim (default 1,32,8,8192,128)")
    p.add_argument("--windows", nargs="*", type=int, default=[1023, 4095],
                   help="left window sizes to time (the right side is 0: causal)")
    p.add_argument("--softcaps", nargs="*", type=float, default=[50.0],
                   help="softcap values to time (each without a window)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    batch, heads, kv_heads, seq, head_dim = (int(x) for x in args.shape.split(","))
    g = torch.Generator(device="cuda").manual_seed(args.seed)
    q = torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(batch, kv_heads, seq, head_dim, device="cuda", dtype=torch.bfloat16,
                    generator=g)
    v = torch.randn_like(k)
    calls = [("no window", {})]
    calls += [(f"window ({w}, -1)", {"window": (w, -1)}) for w in args.windows]
    calls += [(f"softcap {c:g}", {"softcap": c}) for c in args.softcaps]
    for label, kwargs in calls:
        ms = triton.testing.do_bench(lambda: fused_attention(q, k, v, **kwargs),
                                     return_mode="median")
        print(f"{label:>20}: {ms:.4f} ms")


if __name__ == "__main__":
    main()
