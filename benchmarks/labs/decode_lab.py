"""Decode lab: the split-KV decode kernel against SDPA's backends and FlashAttention, on one GPU.

For kernel work on the decode kernel (notes/serving.md), not the benchmark of record (that is
`attnscope bench`). Per shape (batch, q heads, kv heads, q_len, kv_len, head_dim; causal,
bottom-right): the fused op (which routes short q_len to attnscope/kernels/attention_decode.py),
the kernel at pinned split counts, the paged cache at chosen page sizes, and the peers. Every
time is do_bench's median with L2 flushed between calls, so K/V come from HBM as in a real
decode step. Printed per row: ms, the HBM floor (bytes of K and V read / 4.24 TB/s, the H200's
peak) and the % of it reached, the ratio to the best peer, and the max abs error against float32
SDPA.

    python benchmarks/labs/decode_lab.py --shapes 64,32,8,1,8192,128 8,32,8,1,32768,128 \\
        --splits 1 2 4 8 16 --configs 16,64,8,3 16,64,4,2 --page-sizes 16 256 --out lab.jsonl
"""

import argparse
import json
import math
import sys

import torch
import torch.nn.functional as F
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

import attnscope
from attnscope.kernels import attention_decode as decode

HBM_BYTES_PER_S = 4.24e12  # H200 HBM3e peak


def sdpa_peer(backend, q, k, v):
    """SDPA with `backend`, bottom-right causal (q_len 1 needs no mask: the query sees every
    key), GQA through enable_gqa."""
    q_len, kv_len = q.shape[2], k.shape[2]
    mask = None if q_len == 1 else causal_lower_right(q_len, kv_len)

    def run():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                  enable_gqa=k.shape[1] != q.shape[1])
    return run


def flash_peers(q, k, v):
    """FA4 (flash_attn.cute) and FlashAttention 2's flash_attn_with_kvcache where installed:
    {name: zero-argument call or the reason it is missing}. Both take [batch, seq, heads, d]
    and align causal bottom-right."""
    qs, ks, vs = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    peers = {}
    try:
        from flash_attn.cute import flash_attn_func as fa4
        peers["fa4"] = lambda: fa4(qs, ks, vs, causal=True)
    except Exception as e:  # not installed, or built for another GPU
        peers["fa4"] = f"unavailable: {type(e).__name__}: {str(e)[:80]}"
    try:
        from flash_attn import flash_attn_with_kvcache
        peers["flash_attn2_kvcache"] = lambda: flash_attn_with_kvcache(qs, ks, vs, causal=True)
    except Exception as e:
        peers["flash_attn2_kvcache"] = f"unavailable: {type(e).__name__}: {str(e)[:80]}"
    return peers


def as_bhsd(fn):
    """A bshd peer's call returning its output in bhsd, for the error column (FA4 returns
    (out, lse))."""
    def run():
        result = fn()
        return (result[0] if isinstance(result, tuple) else result).transpose(1, 2)
    return run


def paged(k, v, page_size):
    """[batch, kv_heads, kv_len, d] caches as a shuffled block pool and its block table."""
    batch, kv_heads, kv_len, d = k.shape
    per_seq = -(-kv_len // page_size)
    pad = per_seq * page_size - kv_len
    order = torch.randperm(batch * per_seq, device=k.device)
    pools = []
    for t in (k, v):
        t = F.pad(t.transpose(1, 2), (0, 0, 0, 0, 0, pad))  # [batch, padded kv_len, kv_heads, d]
        pool = torch.empty_like(t).reshape(batch * per_seq, page_size, kv_heads, d)
        pool[order] = t.reshape(batch * per_seq, page_size, kv_heads, d)
        pools.append(pool)
    return pools[0], pools[1], order.reshape(batch, per_seq).to(torch.int32)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["64,32,8,1,8192,128", "8,32,8,1,32768,128"],
                   help="batch,heads,kv_heads,q_len,kv_len,head_dim per shape (default: issue "
                   "20's two decode shapes)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"],
                   help="input dtype")
    p.add_argument("--splits", nargs="*", type=int, default=[],
                   help="also time the kernel pinned to these split counts (the op's row uses "
                   "the split rule)")
    p.add_argument("--configs", nargs="*", default=[],
                   help="also time the kernel pinned to these BLOCK_M,BLOCK_N,num_warps,num_stages "
                   "configs (split rule's count; e.g. 16,64,8,3)")
    p.add_argument("--page-sizes", nargs="*", type=int, default=[],
                   help="also time fused_attention_with_kvcache on a paged copy of the cache "
                   "with these block sizes (and the kernel on it at each --configs entry)")
    p.add_argument("--no-peers", action="store_true", help="skip SDPA, FA4 and FlashAttention 2")
    p.add_argument("--rep", type=int, default=200, help="do_bench repetition time, ms")
    p.add_argument("--out", default=None, help="append one JSON line per row here")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    out_file = open(args.out, "a") if args.out else None
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for text in args.shapes:
        batch, heads, kv_heads, q_len, kv_len, d = (int(x) for x in text.split(","))
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(batch, h, n, d, dtype=dtype, device="cuda", generator=g)
                   for h, n in ((heads, q_len), (kv_heads, kv_len), (kv_heads, kv_len)))
        ref = sdpa_peer(SDPBackend.MATH, q.float(), k.float(), v.float())()
        floor_ms = 2 * k.numel() * k.element_size() / HBM_BYTES_PER_S * 1e3
        scale = 1 / math.sqrt(d)
        rows = {"fused_attention (op)": lambda: attnscope.fused_attention(
            q, k, v, causal_alignment="bottom_right")}
        def pinned(k, v, **pin):
            # the kernel itself on caches k, v, with what `pin` fixes
            def run():
                o = torch.empty_like(q)
                lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
                decode.attention_decode(q, k, v, o, lse, causal=True, scale=scale, **pin)
                return o
            return run
        configs = {c: tuple(int(x) for x in c.split(",")) for c in args.configs}
        for n in args.splits:
            rows[f"decode splits={n}"] = pinned(k, v, num_splits=n)
        for c, config in configs.items():
            rows[f"decode config={c}"] = pinned(k, v, config=config)
        for size in args.page_sizes:
            k_pool, v_pool, table = paged(k, v, size)
            seqlens = torch.full((batch,), kv_len, dtype=torch.int32, device="cuda")
            qs = q.transpose(1, 2)
            rows[f"paged block_size={size}"] = (
                lambda k_pool=k_pool, v_pool=v_pool, table=table, seqlens=seqlens:
                attnscope.fused_attention_with_kvcache(qs, k_pool, v_pool, seqlens,
                                                       block_table=table).transpose(1, 2))
            for c, config in configs.items():  # the paged kernel at each pinned config too
                rows[f"paged block_size={size} config={c}"] = pinned(
                    k_pool, v_pool, seqlens=seqlens, block_table=table, config=config)
        peers = {}
        if not args.no_peers:
            for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                            SDPBackend.EFFICIENT_ATTENTION):
                peers[f"sdpa_{backend.name.lower()}"] = sdpa_peer(backend, q, k, v)
            for name, fn in flash_peers(q, k, v).items():
                if isinstance(fn, str):
                    print(f"{text} {name}: {fn}", flush=True)
                else:
                    peers[name] = as_bhsd(fn)
        times, errors = {}, {}
        for name, fn in {**rows, **peers}.items():
            try:
                errors[name] = (fn().float() - ref).abs().max().item()
                times[name] = triton.testing.do_bench(fn, rep=args.rep, return_mode="median")
            except Exception as e:  # one failing candidate must not end the sweep
                print(f"{text} {name}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
        best_peer = min((times[n] for n in peers if n in times), default=None)
        o, lse = torch.empty_like(q), torch.empty(q.shape[:3], device="cuda")
        # The op's choice: split count and key tile (split_rule: long_config_for's where its
        # chunks are LONG_CHUNK keys or more), next to the pinned configs above.
        splits, block_n = decode.attention_decode(q, k, v, o, lse, causal=True, scale=scale)
        rows_per_kv_head = q_len * heads // kv_heads
        short = decode.config_for(d, rows_per_kv_head, dtype)
        long = decode.long_config_for(d, rows_per_kv_head, dtype)
        block_m, _, _, warps, stages = short if block_n == short[1] else long
        print(f"{text} ({args.dtype}, {sms} SMs): HBM floor {floor_ms:.4f} ms; split rule: "
              f"{splits} splits; tiles {block_m}x{block_n} "
              f"({'long' if block_n != short[1] else 'short'}: the long tile where its chunks "
              f"hold {decode.LONG_CHUNK} keys or more), {warps} warps, {stages} stages; "
              f"best peer {best_peer and round(best_peer, 4)} ms", flush=True)
        for name, ms in times.items():
            vs_peer = f" {best_peer / ms:5.2f}x best peer" if best_peer else ""
            print(f"  {name:28s} {ms:8.4f} ms  {100 * floor_ms / ms:5.1f} % of HBM floor"
                  f"{vs_peer}  err {errors[name]:.2e}", flush=True)
            if out_file:
                out_file.write(json.dumps({
                    "shape": text, "dtype": args.dtype, "impl": name, "ms": ms,
                    "hbm_floor_ms": floor_ms, "floor_pct": 100 * floor_ms / ms,
                    "vs_best_peer": best_peer / ms if best_peer else None,
                    "err": errors[name]}) + "\n")
                out_file.flush()
        del q, k, v, ref, rows, peers
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
