#!/usr/bin/env bash
# Round 16 on the H200: the Gluon kernel's head-group rule (tiles of how many heads run
# together): whole K/V within half of L2 (the round-15 rule), no grouping (the order before),
# and groups of about one wave (132 programs / query blocks per head, capped by L2).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
pip install -e . --no-deps --no-build-isolation > $OUT/pip.txt 2>&1 || tail -5 $OUT/pip.txt
timeout 70 python - <<'PY' 2>&1 | tee $OUT/groups.txt
import math, statistics, torch, triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel
from attnscope.kernels import attention_fwd_hopper as hop
l2 = hop._head_group
rules = {"l2": l2, "none": lambda q, k, n: n,
         "wave": lambda q, k, n: max(1, min(l2(q, k, n), math.ceil(132 / math.ceil(q.shape[2] / 128))))}
for b, h, s in ((8, 16, 1024), (4, 32, 4096)):
    q, k, v = (torch.randn(b, h, s, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out, lse = torch.empty_like(q), torch.empty(b, h, s, device="cuda")
    times = {name: [] for name in [*rules, "cudnn"]}
    for _ in range(2):
        for name, rule in rules.items():
            hop._head_group = rule
            times[name].append(triton.testing.do_bench(lambda: hop.attention_fwd_hopper(
                q, k, v, out, lse, causal=True, scale=0.088, causal_offset=0), warmup=10, rep=50))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            times["cudnn"].append(triton.testing.do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), warmup=10, rep=50))
    print(b, h, s, {n: round(statistics.median(t), 4) for n, t in times.items()},
          {n: r(q, k, b * h) for n, r in rules.items()}, flush=True)
PY
