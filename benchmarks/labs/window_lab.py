"""Lab of the sliding window and the softcap (notes/serving.md): the op's time with each window
and softcap asked for, against the same call without either, one shape at a time; with --peers,
FlashAttention-4's time for the same call where it is installed (its window_size and softcap),
and the largest difference between its output and the op's; with --backward, forward and
backward together (autograd of both, the same upstream gradient), and the largest difference
between the two's gradients.

For kernel work, not the benchmark of record. On a GPU only (do_bench median, bf16); the shape is
q [batch, heads, seq, head_dim] with k/v of kv_heads heads, causal.

    PYTHONPATH=. python benchmarks/labs/window_lab.py --shape 1,32,8,8192,128 \
        --windows 1023 4095 --softcaps 50 [--both] [--peers] [--backward]
"""
import argparse

import torch
import triton

from attnscope import fused_attention
from attnscope.attention.flash_attn import FA4


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="1,32,8,8192,128",
                   help="batch,heads,kv_heads,seq,head_dim (default 1,32,8,8192,128)")
    p.add_argument("--windows", nargs="*", type=int, default=[1023, 4095],
                   help="left window sizes to time (the right side is 0: causal)")
    p.add_argument("--softcaps", nargs="*", type=float, default=[50.0],
                   help="softcap values to time (each without a window)")
    p.add_argument("--both", action="store_true",
                   help="also each window with each softcap (Gemma 2's local layers)")
    p.add_argument("--peers", action="store_true",
                   help="also FlashAttention-4 (flash_attn.cute) on each call, where installed")
    p.add_argument("--backward", action="store_true",
                   help="time forward and backward together (the op's and FA4's autograd)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    batch, heads, kv_heads, seq, head_dim = (int(x) for x in args.shape.split(","))
    g = torch.Generator(device="cuda").manual_seed(args.seed)
    q = torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(batch, kv_heads, seq, head_dim, device="cuda", dtype=torch.bfloat16,
                    generator=g)
    v = torch.randn(k.shape, device="cuda", dtype=torch.bfloat16, generator=g)
    dout = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=g)
    if args.backward:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    calls = [("no window", {})]
    calls += [(f"window ({w}, -1)", {"window": (w, -1)}) for w in args.windows]
    calls += [(f"softcap {c:g}", {"softcap": c}) for c in args.softcaps]
    if args.both:
        calls += [(f"window ({w}, -1) softcap {c:g}", {"window": (w, -1), "softcap": c})
                  for w in args.windows for c in args.softcaps]
    fa4_ok, why = FA4.available(q.device) if args.peers else (False, "")
    if args.peers and not fa4_ok:
        print(f"FlashAttention-4 not timed: {why}")
    def step(forward):
        # the output, or with --backward the gradients of q, k, v from dout
        if not args.backward:
            return (forward(),)
        return torch.autograd.grad(forward(), (q, k, v), dout)

    for label, kwargs in calls:
        ours = lambda kwargs=kwargs: fused_attention(q, k, v, **kwargs)  # noqa: E731
        ms = triton.testing.do_bench(lambda: step(ours), return_mode="median")
        line = f"{label:>28}: {ms:.4f} ms"
        if fa4_ok:  # its window_size is (left, right) with the causal right side 0
            options = dict(softcap=kwargs.get("softcap", 0.0))
            if "window" in kwargs:
                options["window_size"] = (kwargs["window"][0], 0)
            fa4 = FA4.prepare(q, k, v, causal=True, **options)
            try:
                fa4_ms = triton.testing.do_bench(lambda: step(fa4), return_mode="median")
            except Exception as e:  # noqa: BLE001 (a call it does not take: say so, go on)
                print(f"{line}  FA4 failed: {type(e).__name__}: {str(e)[:160]}", flush=True)
                continue
            diff = max((a.float() - b.float()).abs().max().item()
                       for a, b in zip(step(fa4), step(ours)))
            what = "grad" if args.backward else "out"
            line += (f"  FA4 {fa4_ms:.4f} ms (ours / FA4 {ms / fa4_ms:.3f}; max |{what} diff| "
                     f"{diff:.2e})")
        print(line, flush=True)


if __name__ == "__main__":
    main()
