"""Lab of the backward (attnscope/kernels/attention_bwd.py): its three launches timed under
the configs given on the command line next to its table's, (--triton-kernels) with the Triton
dK/dV and dQ kernels where the Gluon ones take the call on sm_90, (--nondeterministic) with
deterministic=False (dQ added by the Gluon dK/dV kernel where attention_bwd.fused_dq takes the
call), and (--peers) cuDNN's backward, on one GPU; (--window, --softcap) of a causal call with a
sliding window or a softcap.

For kernel work on the backward (notes/backward.md), not the benchmark of record (that is
`attnscope bench --mode bwd`). A config is attention_bwd.CONFIG_FIELDS: the dK/dV kernel's
BLOCK_M1,BLOCK_N1,warps1,stages1 then the dQ kernel's BLOCK_M2,BLOCK_N2,warps2,stages2. Per
(shape, config): median ms of the three launches (do_bench, L2 cleared, interleaved --repeat
rounds), TFLOP/s (2.5x the forward's FLOPs), registers and spills of the dK/dV and dQ kernels,
and the largest gradient error against SDPA's fp32 backward (memory-efficient kernel) on the same
bf16 inputs (with a window or softcap: attention_reference's fp32 autograd). TFLOP/s count the
pairs a window leaves exactly. One line per row; JSON lines to --out.

    python benchmarks/labs/bwd_lab.py --shapes 4,32,4096,128 4,32,4096,128,8 \\
        --configs 64,128,8,2,128,32,8,2 32,128,8,2,128,64,8,2 --peers --out lab.jsonl
"""

import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import attnscope
from attnscope.attention.reference import attention_reference
from attnscope.kernels import attention_bwd as bwd
from attnscope.kernels import launch
from attnscope.profile.flops import attention_flops

import rounds  # benchmarks/labs/rounds.py, beside this script


def parse_config(text):
    values = tuple(int(x) for x in text.split(","))
    if len(values) != len(bwd.CONFIG_FIELDS):
        raise argparse.ArgumentTypeError(
            f"a config is {','.join(bwd.CONFIG_FIELDS)}, got {text!r}")
    return values


def parse_gluon_config(text):
    try:
        head_dim, dkdv, dq = text.split(":")
        head_dim = int(head_dim)
        dkdv, dq = (tuple(int(x) for x in part.split(",")) for part in (dkdv, dq))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"a Gluon config is HEAD_DIM:STAGES,REGS,BLOCK_M:BLOCK_N,STAGES,REGS, got {text!r}")
    if len(dkdv) != 3 or len(dq) != 3:
        raise argparse.ArgumentTypeError(
            f"a Gluon config is HEAD_DIM:STAGES,REGS,BLOCK_M:BLOCK_N,STAGES,REGS, got {text!r}")
    return head_dim, dkdv, dq


def parse_shape(text):
    values = tuple(int(x) for x in text.split(","))
    if len(values) not in (4, 5):
        raise argparse.ArgumentTypeError(f"a shape is B,H,S,D[,KV_HEADS], got {text!r}")
    return values if len(values) == 5 else (*values, values[1])


def problem(shape, seed=0, layout="bhsd", **call):
    """bf16 q, k, v, dO on the GPU (seeded) and the op's forward output and LSE; with layout
    "bshd", [batch, heads, seq, head_dim] views of [batch, seq, heads, head_dim] tensors (what
    the op's layout="bshd" hands its kernels); `call`: the op's window and softcap."""
    b, h, s, d, hk = shape
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rand(n):
        if layout == "bshd":
            return torch.randn(b, s, n, d, generator=g, device="cuda",
                               dtype=torch.bfloat16).transpose(1, 2)
        return torch.randn(b, n, s, d, generator=g, device="cuda", dtype=torch.bfloat16)
    q, k, v = (rand(n) for n in (h, hk, hk))
    do = rand(h)
    if layout == "bshd":  # the op's own bshd call, so that out is laid out as it would be
        out, lse = attnscope.fused_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                             layout="bshd", return_lse=True, **call)
        return q, k, v, do, out.transpose(1, 2), lse
    out, lse = attnscope.fused_attention(q, k, v, return_lse=True, **call)
    return q, k, v, do, out, lse


def reference_grads(q, k, v, do, **call):
    """SDPA's fp32 backward (memory-efficient kernel, GQA by repeating K/V) of the bf16 inputs;
    with a window or softcap (`call`), attention_reference's fp32 autograd."""
    if call:
        q32, k32, v32 = (t.float().requires_grad_() for t in (q, k, v))
        out = attention_reference(q32, k32, v32, dtype=torch.float32, **call)
        return torch.autograd.grad(out, (q32, k32, v32), do.float())
    rep = q.shape[1] // k.shape[1]
    q32, k32, v32 = (t.float().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        out = F.scaled_dot_product_attention(q32, k32.repeat_interleave(rep, 1),
                                             v32.repeat_interleave(rep, 1), is_causal=True)
    return torch.autograd.grad(out, (q32, k32, v32), do.float())


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", nargs="+", type=parse_shape, default=[(8, 16, 1024, 64, 16)],
                   help="B,H,S,D[,KV_HEADS] (bf16, causal); default 8,16,1024,64")
    p.add_argument("--configs", nargs="*", type=parse_config, default=[],
                   help=f"{','.join(bwd.CONFIG_FIELDS)} configs to time next to the table's "
                        "(of the Triton kernels: where the Gluon ones take the call on sm_90 a "
                        "config changes only the preprocess; see --triton-kernels)")
    p.add_argument("--peers", action="store_true", help="also time cuDNN's backward")
    p.add_argument("--nondeterministic", action="store_true",
                   help="also time the table's config with deterministic=False")
    p.add_argument("--triton-kernels", action="store_true",
                   help="also time the table's config with the Triton dK/dV and dQ kernels where "
                        "the Gluon ones (attention_bwd_hopper.py) take the call")
    p.add_argument("--gluon-config", type=parse_gluon_config, default=None,
                   metavar="HEAD_DIM:STAGES,REGS,BLOCK_M:BLOCK_N,STAGES,REGS",
                   help="put this entry into the Gluon kernels' tables (attention_bwd_hopper's "
                        "CONFIGS and DQ_CONFIGS, at the head_dim's TILE: 128's for 80-112) for "
                        "the whole run and lift that head_dim's "
                        "MIN_QUERIES bound, so every call of that head_dim takes them (e.g. "
                        "64:2,240,128:128,2,240); with --triton-kernels the Triton pair runs "
                        "beside them. --nondeterministic fuses dQ only where the entry allows "
                        "it (attention_bwd_hopper.fuses_dq: head_dim 128, 64-row blocks)")
    p.add_argument("--layout", choices=("bhsd", "bshd"), default="bhsd",
                   help="bshd: every tensor a [batch, heads, seq, head_dim] view of a [batch, "
                        "seq, heads, head_dim] one, as the op's layout=\"bshd\" (the "
                        "transformers backend) passes them; the gradients are allocated alike "
                        "(default: bhsd, contiguous)")
    p.add_argument("--window", type=int, default=-1, metavar="LEFT",
                   help="a sliding window of LEFT keys left of the diagonal (window=(LEFT, -1); "
                        "default -1: none)")
    p.add_argument("--softcap", type=float, default=0.0,
                   help="a softcap (logits softcap * tanh(s / softcap)); default 0: none")
    rounds.add_arguments(p)
    args = p.parse_args()
    if args.window < -1 or args.softcap < 0:
        p.error("--window takes -1 or a size >= 0, --softcap a value >= 0")
    call = {}
    if args.window >= 0:
        call["window"] = (args.window, -1)
    if args.softcap > 0:
        call["softcap"] = args.softcap
    if call and args.peers:
        p.error("--peers (cuDNN through SDPA) takes neither --window nor --softcap")
    if args.gluon_config is not None:
        hop = bwd._hopper()
        if hop is None:
            p.error("--gluon-config: this Triton's Gluon lacks what the Gluon backward uses "
                    "(attnscope.kernels.gluon_compat.missing())")
        head_dim, dkdv, dq = args.gluon_config
        # the entry of the head_dim's tile (TILE: 80-112 run on 128's); a head_dim the table
        # lacks becomes a tile of its own
        tile = hop.TILE.setdefault(head_dim, head_dim)
        hop.CONFIGS[tile], hop.DQ_CONFIGS[tile] = dkdv, dq
        hop.MIN_QUERIES.pop(head_dim, None)
    out_file = open(args.out, "a") if args.out else None
    for shape in args.shapes:
        b, h, s, d, hk = shape
        # 2.5x the forward's, over the pairs a window leaves (counted exactly)
        flops = attention_flops(b, h, s, s, d, causal=True, mode="bwd", window=call.get("window"))
        q, k, v, do, out, lse = problem(shape, layout=args.layout, **call)
        refs = reference_grads(q, k, v, do, **call)
        table = bwd.config_for(d)
        # (config, Triton kernels where the Gluon ones take the call, deterministic)
        configs = [(table, False, True)] + [(c, False, True) for c in args.configs if c != table]
        if args.triton_kernels:
            configs.append((table, True, True))
        if args.nondeterministic:
            configs.append((table, False, False))
        timers, rows = {}, {}
        for config, triton_kernels, deterministic in configs:
            name = (("table" if config == table else ",".join(map(str, config)))
                    + (" triton-kernels" if triton_kernels else "")
                    + ("" if deterministic else " nondeterministic"))
            grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
            delta = torch.empty_like(lse)

            def run(config=config, grads=grads, delta=delta, triton_kernels=triton_kernels,
                    deterministic=deterministic):
                gluon = bwd._hopper
                if triton_kernels:  # the launch key tells the two paths apart
                    bwd._hopper = lambda: None
                try:
                    bwd.attention_bwd(do, q, k, v, out, lse, *grads, delta, causal=True,
                                      scale=d ** -0.5, causal_offset=0, config=config,
                                      deterministic=deterministic, **call)
                finally:
                    bwd._hopper = gluon
            launch.forget_launches()
            try:
                run()
                torch.cuda.synchronize()
            except Exception as e:  # one config that does not fit must not end the sweep
                print(f"{shape} {name}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            kernels = {kname: (getattr(c, "n_regs", None), getattr(c, "n_spills", None))
                       for kname, c, _ in launch.launched()}
            errors = [(g.float() - r).abs().max().item() for g, r in zip(grads, refs)]
            timers[name] = run
            rows[name] = {"shape": shape, "impl": name, "config": config,
                          "gluon_config": args.gluon_config, "layout": args.layout, **call,
                          "err_dq_dk_dv": errors, "regs_spills": kernels}
        if args.peers:
            rep = h // hk
            qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
            try:
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True,
                                                       enable_gqa=rep > 1)

                def cudnn():
                    torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True)
                cudnn()
                timers["cudnn"] = cudnn
                rows["cudnn"] = {"shape": shape, "impl": "cudnn"}
            except RuntimeError as e:  # e.g. a cuDNN without this GQA shape
                print(f"{shape} cudnn: FAILED {str(e)[:200]}", flush=True)
        times = rounds.interleaved(timers, args.repeat, args.warmup, args.rep, label=str(shape))
        for name, row in rows.items():
            if name not in times:
                continue
            row["ms"] = statistics.median(times[name])
            row["tflops"] = flops / row["ms"] / 1e9
            row["rounds_ms"] = times[name]
            extra = (f" err {max(row['err_dq_dk_dv']):.3g} regs/spills {row['regs_spills']}"
                     if "err_dq_dk_dv" in row else "")
            print(f"{shape} {name:>24}: {row['ms']:.4f} ms {row['tflops']:.0f} TFLOP/s{extra}",
                  flush=True)
            if out_file:
                out_file.write(json.dumps(row) + "\n")
                out_file.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
