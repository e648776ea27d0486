"""Lab of the Triton forward (attnscope/kernels/attention_fwd.py): its launch timed under the
configs given on the command line, next to its table's config, the public op, and (--peers)
cuDNN and flash, on one GPU.

For kernel work (notes/forward.md), not the benchmark of record (that is `attnscope bench`).
Prints one line per (shape, variant) and writes JSON lines to --out. Also counts the matrix
instructions in the SASS of each compiled config (cuobjdump), so a slow config that fell off
wgmma shows as such.

    python benchmarks/labs/fused_lab.py --shapes 8,16,1024,64 2,16,16384,128 \
        --configs 128,64,8,3 64,64,4,3,1,0 --out lab.jsonl
"""

import argparse
import itertools
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import attnscope
from attnscope.kernels import attention_fwd as fwd
from attnscope.profile.flops import attention_flops

import rounds  # benchmarks/labs/rounds.py, beside this script


def parse_config(text):
    """BM,BN,warps,stages[,pipeline[,tma]] -> a config tuple named by fwd.CONFIG_FIELDS."""
    values = [int(x) for x in text.split(",")]
    if not 4 <= len(values) <= 6:
        raise ValueError(f"a config is BM,BN,warps,stages[,pipeline[,tma]], got {text!r}")
    values += [0] * (6 - len(values))
    return (*values[:4], bool(values[4]), bool(values[5]))


def sass_counts(compiled):
    """HGMMA/HMMA/FFMA/MUFU counts in a compiled kernel's SASS (None without cuobjdump)."""
    exe = shutil.which("cuobjdump")
    if exe is None or "cubin" not in compiled.asm:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([exe, "-sass", f.name], capture_output=True, text=True).stdout
    ops = re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(?:\.|\s|;)",
                     sass, re.M)
    wanted = ("HGMMA", "HMMA", "FFMA", "MUFU", "LDGSTS", "UTMALDG", "LDG", "STG", "LDL", "STL",
              "BAR", "WARPGROUP")
    return {op: sum(1 for o in ops if o.startswith(op)) for op in wanted}


def inputs(shape, dtype, kv_heads=None):
    b, h, s, d = shape
    hk = kv_heads or h
    # Enough copies that one pass over them exceeds the 60 MB L2, so every call reads cold data.
    one = 2 * (b * h * s * d + 2 * b * hk * s * d) * 2
    copies = max(1, min(8, -(-200_000_000 // one)))
    return [tuple(torch.randn(b, hh, s, d, dtype=dtype, device="cuda") for hh in (h, hk, hk))
            for _ in range(copies)]


def cycled(fn_per_set, sets):
    """A zero-argument call of fn_per_set on the next input set each time (cold data in L2)."""
    it = itertools.cycle(range(len(sets)))
    return lambda: fn_per_set(*sets[next(it)])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["8,16,1024,64"], help="B,H,S,D (bf16, causal)")
    p.add_argument("--configs", nargs="*", default=[],
                   help="BM,BN,warps,stages[,pipeline[,tma]] configs to time next to the table's "
                   "(pipeline=1: software-pipelined loop, tma=1: K/V through tensor "
                   "descriptors); default: the table's alone")
    p.add_argument("--peers", action="store_true", help="also time SDPA cuDNN and flash")
    rounds.add_arguments(p)
    args = p.parse_args()
    out = open(args.out, "a") if args.out else None
    for text in args.shapes:
        shape = tuple(int(x) for x in text.split(","))
        b, h, s, d = shape
        flops = attention_flops(b, h, s, s, d, causal=True)
        sets = inputs(shape, torch.bfloat16)
        q, k, v = sets[0]
        ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                               is_causal=True)
        configs = [parse_config(c) for c in args.configs]
        variants = [(f"triton{c}", c) for c in configs] + [("triton-table", None)]
        timers, rows = {}, {}
        for name, config in variants:
            def run(q, k, v, config=config):
                o = torch.empty_like(q)
                lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
                compiled = fwd.attention_fwd_triton(q, k, v, o, lse, causal=True,
                                                    scale=d ** -0.5, causal_offset=0,
                                                    config=config)
                return o, compiled
            try:
                o, compiled = run(q, k, v)
                torch.cuda.synchronize()
            except Exception as e:  # one bad config must not end the sweep
                print(f"{shape} {name}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            timers[name] = lambda *t, run=run: run(*t)[0]
            rows[name] = {"shape": shape, "impl": name, "err": (o.float() - ref).abs().max().item(),
                          "regs": getattr(compiled, "n_regs", None),
                          "spills": getattr(compiled, "n_spills", None),
                          "smem": getattr(getattr(compiled, "metadata", None), "shared", None),
                          "sass": sass_counts(compiled)}
        # The public op (validation, dispatch, launch; the Gluon kernel where it takes the call):
        # at the Triton kernel's shapes its time minus triton-table's is what the Python around
        # the kernel costs when the GPU waits for it.
        timers["fused_attention (public op)"] = lambda q, k, v: attnscope.fused_attention(q, k, v)
        rows["fused_attention (public op)"] = {"shape": shape, "impl": "fused_attention"}
        if args.peers:
            for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
                def peer(q, k, v, backend=backend):
                    with sdpa_kernel(backend):
                        return torch.nn.functional.scaled_dot_product_attention(q, k, v,
                                                                                is_causal=True)
                timers[backend.name] = peer
                rows[backend.name] = {"shape": shape, "impl": backend.name}
        times = rounds.interleaved({name: cycled(fn, sets) for name, fn in timers.items()},
                                   args.repeat, args.warmup, args.rep, label=str(shape))
        for name, row in rows.items():
            if name not in times:  # dropped while timed
                continue
            ts = sorted(times[name])
            ms = statistics.median(ts)
            row.update(ms=ms, ms_all=ts, tflops=flops / ms / 1e9)
            extra = "".join(f" {key} {row[key]}" for key in ("regs", "spills", "smem", "sass")
                            if key in row)
            err = f" err {row['err']:.2e}" if "err" in row else ""
            print(f"{shape} {name:32s} {ms:8.4f} ms (min {ts[0]:.4f} max {ts[-1]:.4f}) "
                  f"{flops / ms / 1e9:7.1f} TFLOP/s{err}{extra}", flush=True)
            if out:
                out.write(json.dumps(row) + "\n")
                out.flush()
        del sets, ref
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
