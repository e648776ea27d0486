"""Variant lab: the kernels' launches under each variant, next to cuDNN, on one GPU.

Variants are the head-group rules (`attention_fwd.head_group`, how many heads' tiles run
together so that their K/V stay in L2): "l2" (the shipped one: equal groups of heads whose K/V
fit in half of L2), "l2full" (the same within all of L2) and "all" (one group of every head:
each running program on its own head's K/V). With --switch MODULE.ATTR they are instead a
module-level lab switch (a boolean such as a branch's `_TMA_STORE`) off and on. The forward is
`attention_fwd` (the Gluon kernel where the op would use it, else Triton); --backward also
times `attention_bwd` (its dQ kernel walks the same order). Median ms (do_bench, L2 flushed) in
--repeat interleaved rounds; JSON lines to --out.

    python benchmarks/order_lab.py --shapes 8,16,1024,64 4,32,4096,64 --backward --out lab.jsonl
    python benchmarks/order_lab.py --switch attnscope.kernels.attention_fwd_hopper._TMA_STORE \
        --shapes 8,16,1024,128
"""
import argparse
import importlib
import json
import statistics
import sys

import torch
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

from attnscope.kernels import attention_bwd as bwd
from attnscope.kernels import attention_fwd as fwd
from attnscope.profile.flops import attention_flops

SHIPPED = fwd.head_group
RULES = {"l2": SHIPPED, "l2full": lambda q, k: SHIPPED(q, k, 1.0),
         "all": lambda q, k: q.shape[0] * q.shape[1]}


def use_rule(rule):
    # Every module that launches a grouped grid looks head_group up in its own namespace. The
    # launch keys do not hold the group size (the shipped rule derives it from the shapes), so
    # the kept launches are dropped: their arguments hold it, and Triton specializes on its value.
    hopper = fwd._hopper()
    for module in [fwd, bwd] + ([hopper] if hopper is not None else []):
        module.head_group = rule
    fwd.forget_launches()


def variants(switch):
    """name -> (setup, the head-group rule or None): the rules, or the switch's shipped value
    and the other one."""
    if switch is None:
        return {name: ((lambda rule=rule: use_rule(rule)), rule) for name, rule in RULES.items()}
    module_name, _, attr = switch.rpartition(".")
    module = importlib.import_module(module_name)
    if not isinstance(getattr(module, attr, None), bool):
        raise SystemExit(f"--switch {switch}: not a boolean attribute of {module_name}")

    def setting(value):
        def setup():
            use_rule(SHIPPED)
            setattr(module, attr, value)
            fwd.forget_launches()  # the kept launches hold the switch's old effect
        return setup
    shipped = getattr(module, attr)  # first, so that the rounds end on it
    return {f"{attr}={value}": (setting(value), None) for value in (shipped, not shipped)}


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["8,16,1024,64", "4,32,4096,64"],
                   help="batch,heads,seq,head_dim (bf16, causal)")
    p.add_argument("--backward", action="store_true", help="also time attention_bwd")
    p.add_argument("--switch", default=None, metavar="MODULE.ATTR",
                   help="compare a module-level boolean lab switch off and on instead of the "
                        "head-group rules")
    p.add_argument("--repeat", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--out", default=None, help="JSON lines file")
    args = p.parse_args()
    chosen = variants(args.switch)
    lines = []
    for spec in args.shapes:
        b, h, s, d = (int(x) for x in spec.split(","))
        q, k, v, do = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
                       for _ in range(4))
        out, dq, dk, dv = (torch.empty_like(q) for _ in range(4))
        lse, delta = (torch.empty(b, h, s, device="cuda") for _ in range(2))
        scale = d ** -0.5
        fwd_call = lambda: fwd.attention_fwd(q, k, v, out, lse, causal=True, scale=scale,  # noqa
                                             causal_offset=0)
        bwd_call = lambda: bwd.attention_bwd(do, q, k, v, out, lse, dq, dk, dv, delta,  # noqa
                                             causal=True, scale=scale, causal_offset=0)
        calls = {"fwd": fwd_call, **({"bwd": bwd_call} if args.backward else {})}
        times = {}
        for _ in range(args.repeat):
            for name, (setup, _) in chosen.items():
                setup()
                for part, call in calls.items():
                    times.setdefault((part, name), []).append(
                        triton.testing.do_bench(call, warmup=25, rep=100))
            chosen[next(iter(chosen))][0]()  # back to the first variant (the shipped one)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                times.setdefault(("fwd", "cudnn"), []).append(triton.testing.do_bench(
                    lambda: torch.nn.functional.scaled_dot_product_attention(
                        q, k, v, is_causal=True), warmup=25, rep=100))
        for (part, name), ts in times.items():
            ms = statistics.median(ts)
            rule = chosen[name][1] if name in chosen else None
            group = rule(q, k) if rule is not None else None
            row = dict(shape=[b, h, s, d], part=part, rule=name, head_group=group, median_ms=ms,
                       runs=ts, tflops=attention_flops(b, h, s, s, d, mode=part) / ms * 1e-9)
            lines.append(row)
            print(f"{spec:>16s} {part} {name:10s} group {str(group):>4s} {ms:8.4f} ms "
                  f"{row['tflops']:6.1f} TFLOP/s  runs {[round(t, 4) for t in ts]}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
