"""Lab for the Gluon Hopper forward (attnscope/kernels/attention_fwd_hopper.py) on one sm_90 GPU.

Two parts, each optional (--loops and --pingpong vary both):
  --check: the kernel against the float64 reference on odd shapes (causal and not, both causal
           alignments, GQA, fp16/bf16, output poisoned with NaN first); prints max errors.
  --time:  median times (triton.testing.do_bench, L2 flushed) of the Gluon kernel under each
           --configs entry (its CONFIG_FIELDS: BLOCK_N,STAGES,consumer registers,consumer
           warpgroups) and under the launch's own choice ("gluonNone": layout_for's, or
           THREE_CONSUMERS' where three_consumers says so), each with layout_for's column parts
           and with each --parts entry, the Triton kernel (its table's config) and cuDNN (not
           under --window or --softcap, which it lacks; --peers leaves either out), in --repeat
           interleaved rounds; JSON lines to --out.
  --loops N ...: the kernel's BLOCK_LOOPS forced (0 none, 1 one loop, 2 two loops; block_loops
           says which the launch picks): --check runs block_loops' choice, then each (0 only on
           cases of one K/V block a tile); --time adds the table's config with each.
  --pingpong 0 1: the kernel's PINGPONG forced the same way on dense calls (pingpong_for says
           which the launch picks: the consumers' turns, or none and O rescaled before P V).

    python benchmarks/labs/hopper_lab.py --check --time --shapes 8,16,1024,128 \
        --configs 128,2,240,2 128,3,232,2 --out lab.jsonl
    python benchmarks/labs/hopper_lab.py --time --shapes 1024,16,128,80,4 --configs 64,2,240,2 \
        --parts 64,16    # head_dim 80 as its two parts, against layout_for's padded part
    python benchmarks/labs/hopper_lab.py --check --time --layout bshd --shapes 4,32,4096,128
        # bshd views (STRIDED) against the Triton kernel on them and the Gluon kernel on copies

With --varlen L1,L2,...: --time times a packed batch of those sequence lengths instead (causal,
bottom-right per sequence; heads, head_dim and KV heads from each --shapes entry, whose batch and
length are ignored): the Gluon kernel persistent (its launch, whatever the op's routing rules
say), the Gluon kernel with one program per tile (the hardware hands tiles out as programs
finish), the Triton kernel, and FA4's varlen kernel where it is installed; and --check also
checks packed batches of those query lengths against float64 (check_varlen: keys as long and
longer, causal and not), under each --loops.

    python benchmarks/labs/hopper_lab.py --check --time --varlen 300,77,1000,129 \
        --shapes 1,8,0,96,2 --loops 1 2    # a packed batch's one loop against two
"""

import argparse
import json
import re
import statistics
import sys
import types

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from attnscope.attention.reference import attention_reference, attention_reference_varlen
from attnscope.kernels import attention_fwd as fwd
from attnscope.kernels import attention_fwd_hopper as hop
from attnscope.attention import registry
from attnscope.attention.varlen import _as_batched
from attnscope.kernels import common
from attnscope.profile.flops import attention_flops, varlen_flops

import rounds  # benchmarks/labs/rounds.py, beside this script

CHECK_CASES = [  # (batch, heads, kv_heads, q_len, kv_len, head_dim, causal, bottom_right, dtype)
    (2, 3, 3, 1000, 1000, 64, True, False, torch.bfloat16),
    (2, 3, 3, 1000, 1000, 128, True, False, torch.bfloat16),
    (1, 4, 2, 333, 333, 64, True, False, torch.float16),
    (1, 2, 2, 77, 300, 128, True, True, torch.bfloat16),
    (1, 2, 2, 300, 77, 64, True, True, torch.bfloat16),  # rows that see no key
    (1, 2, 2, 300, 77, 64, True, False, torch.float16),
    (2, 2, 1, 257, 513, 128, False, False, torch.bfloat16),
    (1, 1, 1, 1, 1, 64, True, False, torch.bfloat16),
    (1, 2, 2, 4096, 4096, 128, True, False, torch.bfloat16),
    (1, 2, 2, 128, 128, 64, True, False, torch.bfloat16),
    (1, 8, 2, 3000, 3000, 128, True, False, torch.bfloat16),  # GQA, ragged last K/V block
    (2, 2, 2, 129, 129, 128, True, False, torch.float16),     # a 1-key last block
    (1, 3, 3, 200, 77, 128, False, False, torch.bfloat16),    # non-causal, ragged keys
    (1, 2, 2, 1, 1000, 128, True, True, torch.bfloat16),      # decoding, ragged cache
    (2, 3, 3, 1000, 1000, 80, True, False, torch.bfloat16),   # tiles padded to 128 columns
    (1, 8, 2, 3000, 3000, 96, True, False, torch.float16),
    (1, 2, 2, 300, 77, 96, True, True, torch.bfloat16),       # rows that see no key
    (2, 2, 1, 700, 1536, 112, False, False, torch.bfloat16),
    (2, 3, 3, 1000, 1000, 256, True, False, torch.bfloat16),  # 64-key blocks, O staged in Q's
    (1, 8, 2, 3000, 3000, 256, True, False, torch.float16),
    (1, 2, 2, 300, 77, 256, True, True, torch.bfloat16),
    (2, 2, 1, 700, 1500, 192, False, False, torch.bfloat16),  # padded to 256 columns
    (1, 4, 4, 2048, 2048, 192, True, False, torch.float16),
]


def _inputs(b, h, hkv, lq, lk, d, dtype, layout="bhsd"):
    # q, k, v as [batch, heads, seq, head_dim]; for layout "bshd", views of [batch, seq, heads,
    # head_dim] tensors (flash-attn's layout: not contiguous, the kernel's STRIDED views)
    def rand(heads, n):
        if layout == "bshd":
            return torch.randn(b, n, heads, d, device="cuda", dtype=dtype).transpose(1, 2)
        return torch.randn(b, heads, n, d, device="cuda", dtype=dtype)
    return rand(h, lq), rand(hkv, lk), rand(hkv, lk)


def _run(q, k, v, causal, bottom_right, config=None, loops=None, pingpong=None):
    b, h, lq, d = q.shape
    out = torch.full_like(q, float("nan"))
    lse = torch.full((b, h, lq), float("nan"), device="cuda")
    offset = k.shape[2] - lq if bottom_right else 0
    hop.attention_fwd_hopper(q, k, v, out, lse, causal=causal, scale=d ** -0.5,
                             causal_offset=offset, config=config, loops=loops, pingpong=pingpong)
    return out, lse


def _one_block(config, d, kv_len):
    # whether every tile of a dense call holds one K/V block (where loops 0 may be forced), by
    # the shorter of layout_for's blocks (many tiles or few)
    return kv_len <= (config or hop.layout_for(d, kv_len, True)[1])[0]


def check(config, layout="bhsd", loops=None, pingpong=None):
    worst, skipped = 0.0, 0
    for b, h, hkv, lq, lk, d, causal, br, dtype in CHECK_CASES:
        if config is None and not hop.table_config(d):
            continue  # the table has no config for this head_dim
        if loops == 0 and not _one_block(config, d, lk):
            continue
        torch.manual_seed(lq * 7 + d)
        q, k, v = _inputs(b, h, hkv, lq, lk, d, dtype, layout)
        try:
            out, lse = _run(q, k, v, causal, br, config, loops, pingpong)
        except Exception as e:  # a lab's config whose buffers or registers this head_dim's
            # do not fit (the launch's check, or ptxas: "Insufficient registers"); the table's
            # configs must run
            why = next((line for line in str(e).splitlines()
                        if "shared memory" in line or "Insufficient registers" in line), None)
            if config is None or why is None:
                raise
            print(f"check {b},{h},{hkv},{lq},{lk},{d}: skipped ({why.strip()})", flush=True)
            skipped += 1
            continue
        torch.cuda.synchronize()
        ref, ref_lse = attention_reference(q.double(), k.double(), v.double(), causal=causal,
                                           causal_alignment="bottom_right" if br else "top_left",
                                           return_lse=True)
        err = (out.double() - ref).abs().max().item()
        finite = torch.isfinite(ref_lse)
        lse_err = ((lse.double() - ref_lse).abs()[finite].max().item() if finite.any() else 0.0)
        lse_inf_ok = bool((lse[~finite] == float("-inf")).all())
        nan = bool(out.isnan().any())
        print(f"check {b},{h},{hkv},{lq},{lk},{d} causal={causal} br={br} {str(dtype)[6:]}: "
              f"max|err| {err:.2e} lse {lse_err:.2e} -inf-ok {lse_inf_ok} nan {nan}", flush=True)
        worst = max(worst, err if not nan else float("inf"))
    if skipped:
        print(f"{skipped} of {len(CHECK_CASES)} cases skipped", flush=True)
    return worst


def _packed_inputs(q_lengths, k_lengths, h, hkv, d):
    # packed bf16 q [total_q, h, d], k and v [total_k, hkv, d] (random, from the caller's seed)
    # and the cumulative lengths
    cu_q, cu_k = (torch.tensor([0, *n], device="cuda").cumsum(0).to(torch.int32)
                  for n in (q_lengths, k_lengths))
    q = torch.randn(sum(q_lengths), h, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(k_lengths), hkv, d, device="cuda", dtype=torch.bfloat16)
    return q, k, torch.randn_like(k), cu_q, cu_k


def check_varlen(lengths, shapes, loops=None):
    """Packed batches of these query lengths through the Gluon kernel's launch under `loops`,
    against float64 (outputs and LSE, both poisoned with NaN first): causal with keys as long as
    the queries, causal with longer keys (bottom-right: each sequence's diagonal offset by its
    extra keys) and not causal; heads, head_dim and KV heads from each shape. Returns the
    largest output error (inf on a NaN), NaN where no shape has a packed head_dim."""
    worst, checked = 0.0, False
    extra = [(i * 37) % 100 for i in range(len(lengths))]  # the longer keys' surplus
    for _, h, _, d, hkv in shapes:
        if d not in hop.PACKED_HEAD_DIMS:
            print(f"check varlen head_dim {d}: not a packed head_dim of the kernel "
                  f"({sorted(hop.PACKED_HEAD_DIMS)})", flush=True)
            continue
        for causal, k_lengths in ((True, lengths), (True, [n + e for n, e in zip(lengths, extra)]),
                                  (False, lengths)):
            torch.manual_seed(d * 13 + h + sum(k_lengths))
            q, k, v, cu_q, cu_k = _packed_inputs(lengths, k_lengths, h, hkv, d)
            out = torch.full_like(q, float("nan"))
            lse = torch.full((h, q.shape[0]), float("nan"), device="cuda")
            views = [_as_batched(t, len(lengths)) for t in (q, k, v, out)]
            hop.attention_fwd_hopper(*views, lse, causal=causal, scale=d ** -0.5,
                                     causal_offset=0, loops=loops,
                                     varlen=(cu_q, cu_k, max(lengths), max(k_lengths)))
            torch.cuda.synchronize()
            ref, ref_lse = attention_reference_varlen(q.double(), k.double(), v.double(), cu_q,
                                                      cu_k, causal=causal, return_lse=True)
            err = (out.double() - ref).abs().max().item()
            finite = torch.isfinite(ref_lse)
            lse_err = ((lse.double() - ref_lse).abs()[finite].max().item()
                       if finite.any() else 0.0)
            nan = bool(out.isnan().any() or lse.isnan().any())
            print(f"check varlen x{len(lengths)} {h},{d} kv{hkv} causal={causal} keys "
                  f"{'+' if k_lengths is not lengths else '='} loops {loops}: max|err| {err:.2e} "
                  f"lse {lse_err:.2e} nan {nan}", flush=True)
            worst = max(worst, err if not nan else float("inf"))
            checked = True
    return worst if checked else float("nan")


def _window_flops(b, h, s, d, left):
    # matmul FLOPs of a causal call of s queries and keys under a window (left, -1): query i
    # sees min(i, left) + 1 keys
    seen = min(s, left + 1)
    pairs = seen * (seen + 1) / 2 + (s - seen) * (left + 1)
    return 4.0 * b * h * pairs * d


# What --time runs beside the Gluon kernel (all by default): the Triton kernel, cuDNN (dense
# calls without a window or softcap), FA4's varlen kernel (packed batches, where installed)
PEERS = ("triton", "cudnn", "fa4")


def time_shapes(shapes, configs, repeat, out_path, parts=(), layout="bhsd", loops=(),
                window=(-1, -1), softcap=0.0, peers=PEERS, pingpongs=()):
    rows = []
    vis = dict(window=window, softcap=softcap)
    tag = (f" window{window}" if window != (-1, -1) else "") + (
        f" softcap{softcap:g}" if softcap else "")
    for b, h, s, d, hkv in shapes:
        q, k, v = _inputs(b, h, hkv, s, s, d, torch.bfloat16, layout)
        flops = (attention_flops(b, h, s, s, d, causal=True) if window[0] < 0
                 else _window_flops(b, h, s, d, window[0]))
        out = torch.empty_like(q)  # (in q's layout)
        lse = torch.empty(b, h, s, device="cuda")
        cands = {f"gluon{c}" + (f" parts{p}" if p else ""): (
            lambda c=c, p=p: hop.attention_fwd_hopper(
                q, k, v, out, lse, causal=True, scale=d ** -0.5, causal_offset=0, config=c,
                parts=p, **vis))
            for c in configs if c is not None or hop.table_config(d) for p in (None, *parts)}
        for n in loops if hop.table_config(d) else ():  # the table's config, BLOCK_LOOPS forced
            if n == 0 and not _one_block(None, d, s):
                print(f"{b},{h},{s},{d}: loops 0 skipped (tiles of more than one K/V block)",
                      flush=True)
                continue
            cands[f"gluon loops{n}"] = lambda n=n: hop.attention_fwd_hopper(
                q, k, v, out, lse, causal=True, scale=d ** -0.5, causal_offset=0, loops=n, **vis)
        for n in pingpongs if hop.table_config(d) else ():  # the table's config, PINGPONG forced
            cands[f"gluon pingpong{n}"] = lambda n=n: hop.attention_fwd_hopper(
                q, k, v, out, lse, causal=True, scale=d ** -0.5, causal_offset=0,
                pingpong=bool(n), **vis)

        def triton_kernel():  # its launch, directly: the op would take the Gluon kernel
            return fwd.attention_fwd_triton(q, k, v, out, lse, causal=True, scale=d ** -0.5,
                                            causal_offset=0, **vis)
        if "triton" in peers:
            cands["triton"] = triton_kernel
        if layout == "bshd":  # the table's Gluon kernel on contiguous copies: what strides cost
            qc, kc, vc, oc = (t.contiguous() for t in (q, k, v, out))
            cands["gluon-contiguous"] = lambda: hop.attention_fwd_hopper(
                qc, kc, vc, oc, lse, causal=True, scale=d ** -0.5, causal_offset=0, **vis)
        kr, vr = (k.repeat_interleave(h // hkv, 1), v.repeat_interleave(h // hkv, 1))

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, kr, vr, is_causal=True)
        if not tag and "cudnn" in peers:
            cands["cudnn"] = cudnn
        rows += _time(cands, repeat, flops, f"{b},{h},{s},{d} kv{hkv}{tag}", shape=[b, h, s, d],
                      kv_heads=hkv, window=list(window), softcap=softcap)
    _append(rows, out_path)


def _time(cands, repeat, flops, label, **fields):
    """Rows (`fields`, then impl, median_ms, rounds, tflops) of the candidates timed in
    interleaved rounds: do_bench's mean per round (its default), the median over the rounds;
    each printed after `label`."""
    rows = []
    for name, t in rounds.interleaved(cands, repeat, return_mode="mean", label=" ").items():
        ms = statistics.median(t)
        rows.append(dict(fields, impl=name, median_ms=ms, rounds=t, tflops=flops / ms / 1e9))
        print(f"{label} {name:28s} {ms:.4f} ms {rows[-1]['tflops']:6.1f} TFLOP/s "
              f"rounds {' '.join(f'{x:.4f}' for x in t)}", flush=True)
    return rows


def _append(rows, out_path):
    if out_path:
        with open(out_path, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


def time_varlen(lengths, shapes, repeat, out_path, loops=(), peers=PEERS):
    rows = []
    for _, h, _, d, hkv in shapes:
        torch.manual_seed(d)
        q, k, v, cu, _ = _packed_inputs(lengths, lengths, h, hkv, d)
        varlen = (cu, cu, max(lengths), max(lengths))
        out = torch.empty_like(q)
        lse = torch.empty(h, q.shape[0], device="cuda")
        views = [_as_batched(t, len(lengths)) for t in (q, k, v, out)]
        kw = dict(causal=True, scale=d ** -0.5, causal_offset=0, varlen=varlen)
        real = hop.device_properties(q.device)
        one_per_tile = types.SimpleNamespace(major=9, multi_processor_count=1 << 30,
                                             L2_cache_size=real.L2_cache_size)

        def gluon_per_tile():  # grid = tiles: the launch's min(tiles, SMs) lifted
            hop.device_properties = lambda device: one_per_tile
            try:
                return hop.attention_fwd_hopper(*views, lse, **kw)
            finally:
                hop.device_properties = common.device_properties
        cands = {"gluon": lambda: hop.attention_fwd_hopper(*views, lse, **kw),
                 "gluon-per-tile": gluon_per_tile}
        if "triton" in peers:
            cands["triton"] = lambda: fwd.attention_fwd_triton(*views, lse, **kw)
        for n in loops:  # BLOCK_LOOPS forced (0 takes no packed batch)
            if n:
                cands[f"gluon loops{n}"] = lambda n=n: hop.attention_fwd_hopper(
                    *views, lse, **kw, loops=n)
        fa4 = registry.get("fa4")
        ok, why = fa4.available(q.device) if "fa4" in peers else (False, "not in --peers")
        if ok:
            cands["fa4"] = fa4.prepare_varlen(q, k, v, cu, cu, max(lengths), max(lengths))
        else:
            print(f"fa4 not timed: {why}", flush=True)
        rows += _time(cands, repeat, varlen_flops(lengths, h, d, causal=True),
                      f"varlen x{len(lengths)} {h},{d} kv{hkv}", varlen=list(lengths), heads=h,
                      head_dim=d, kv_heads=hkv)
    _append(rows, out_path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--check", action="store_true", help="correctness against float64")
    p.add_argument("--time", action="store_true", help="time against the Triton kernel, cuDNN")
    p.add_argument("--shapes", nargs="+", default=["8,16,1024,64"],
                   help="B,H,S,D[,KV_HEADS] causal bf16 shapes to time")
    p.add_argument("--configs", nargs="*", default=[],
                   help="Gluon configs BLOCK_N,STAGES,REGS,CONSUMERS (consumer warpgroups: 2, or 3 "
                        "for 192-row tiles) to run next to the table's")
    p.add_argument("--parts", nargs="*", default=[],
                   help="with --time: column parts D0,D1 (powers of two from 16 to 256, D0 >= D1, "
                        "D1 may be 0, covering head_dim) to time each config with besides "
                        "layout_for's")
    p.add_argument("--layout", choices=["bhsd", "bshd"], default="bhsd",
                   help="bshd: q, k, v (and out) as views of [batch, seq, heads, head_dim] "
                        "tensors, which the Gluon kernel reads at their strides; --time then "
                        "also times its table's config on contiguous copies")
    p.add_argument("--window", default=None,
                   help="with --time, dense calls: a sliding window LEFT,-1 or LEFT,0 "
                        "(fused_attention's; the calls are causal), e.g. 4096,-1")
    p.add_argument("--softcap", type=float, default=0.0,
                   help="with --time, dense calls: a softcap (logits softcap * tanh(s / "
                        "softcap)), e.g. 50")
    p.add_argument("--repeat", type=int, default=2, help="interleaved timing rounds")
    p.add_argument("--peers", nargs="*", choices=PEERS, default=list(PEERS),
                   help="what --time runs beside the Gluon kernel (default: all that apply; "
                        "none: the Gluon kernel alone, e.g. to compare trees of it in one job)")
    p.add_argument("--out", help="append JSON lines here")
    p.add_argument("--varlen", default=None,
                   help="L1,L2,...: --time (and --check) a packed batch of these lengths (see "
                        "above)")
    p.add_argument("--loops", nargs="*", type=int, default=[], choices=[0, 1, 2],
                   help="the kernel's BLOCK_LOOPS to force besides block_loops' choice: --check "
                        "runs each, --time adds the table's config with each (0: no block loop, "
                        "only where every tile holds one K/V block; not for packed batches)")
    p.add_argument("--pingpong", nargs="*", type=int, default=[], choices=[0, 1],
                   help="dense calls: the kernel's PINGPONG (1: the consumers take turns; 0: "
                        "none, O rescaled before the P V product) to force besides "
                        "pingpong_for's choice: --check runs each, --time adds the table's "
                        "config with each")
    a = p.parse_args(argv)
    configs = [None] + [tuple(int(x) for x in c.split(",")) for c in a.configs]
    for c in configs[1:]:
        if len(c) != len(hop.CONFIG_FIELDS):
            p.error(f"a Gluon config is {','.join(hop.CONFIG_FIELDS)}, got {c}")
    if a.layout == "bshd" and a.varlen:
        p.error("--layout bshd goes with dense calls, not --varlen")
    if a.parts and (a.varlen or not a.time):
        p.error("--parts goes with --time, on dense calls (a packed batch's parts are "
                "column_parts')")
    for pp in a.parts:
        if not re.fullmatch(r"\d+,\d+", pp):
            p.error(f"--parts takes D0,D1 (e.g. 128,0), got {pp!r}")
    if (a.window or a.softcap) and (a.varlen or not a.time):
        p.error("--window and --softcap go with --time, on dense calls")
    if a.window and not re.fullmatch(r"\d+,(-1|0)", a.window):
        p.error(f"--window takes LEFT,-1 or LEFT,0 (a causal call's window: its right side is "
                f"0 either way), got {a.window!r}")
    if a.softcap < 0:
        p.error(f"--softcap must be positive (0: none), got {a.softcap}")
    if a.varlen and a.pingpong:
        p.error("--pingpong goes with dense calls (a packed batch takes pingpong_for's)")
    if a.varlen and 0 in a.loops:
        p.error("--loops 0 takes no packed batch (its tiles may hold many K/V blocks)")
    if a.varlen and not re.fullmatch(r"\d+(,\d+)*", a.varlen):
        p.error(f"--varlen takes lengths L1,L2,..., got {a.varlen!r}")
    shapes = []
    for s in a.shapes:
        vals = [int(x) for x in s.split(",")]
        if len(vals) not in (4, 5):
            p.error(f"a shape is B,H,S,D[,KV_HEADS], got {s!r}")
        shapes.append(tuple(vals[:4]) + (vals[4] if len(vals) > 4 else vals[1],))
    loops = [None] + a.loops
    lengths = [int(x) for x in a.varlen.split(",")] if a.varlen else None
    if a.check:
        for c in configs:
            for n in loops:
                print(f"== check config {c or 'table'}" + (f" loops {n}" if n is not None else ""),
                      flush=True)
                worst = check(c, a.layout, n)
                print(f"worst {worst:.2e}", flush=True)
            for n in a.pingpong:
                print(f"== check config {c or 'table'} pingpong {n}", flush=True)
                print(f"worst {check(c, a.layout, None, bool(n)):.2e}", flush=True)
        if a.varlen:  # (the table's configs: a packed batch takes no other)
            for n in loops:
                print("== check varlen" + (f" loops {n}" if n is not None else ""), flush=True)
                worst = check_varlen(lengths, shapes, n)
                print(f"worst {worst:.2e}", flush=True)
    if a.time:
        if a.varlen:
            time_varlen(lengths, shapes, a.repeat, a.out, a.loops, a.peers)
        else:
            time_shapes(shapes, configs, a.repeat, a.out,
                        [tuple(int(x) for x in pp.split(",")) for pp in a.parts], a.layout,
                        a.loops, tuple(int(x) for x in a.window.split(",")) if a.window
                        else (-1, -1), a.softcap, a.peers, a.pingpong)
    return 0


if __name__ == "__main__":
    sys.exit(main())
