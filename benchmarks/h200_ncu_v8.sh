#!/usr/bin/env bash
# Hardware counters of the Gluon forward and cuDNN's at two head_dim-128 shapes (one launch
# each, clocks not locked): tensor-pipe activity, L2 hit rate, DRAM throughput, duration.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
pip install -e . --no-deps --no-build-isolation > $OUT/pip.txt 2>&1 || tail -5 $OUT/pip.txt
cat > /tmp/ncu_v8.py <<'PY'
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
import attnscope
for b, h, s in ((4, 32, 4096), (8, 16, 1024)):
    q, k, v = (torch.randn(b, h, s, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for _ in range(2):
        attnscope.fused_attention(q, k, v)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
torch.cuda.synchronize()
PY
timeout 200 ncu --clock-control none -k regex:"attn_fwd_hopper|sdpa|fprop|flash" --launch-skip 0 \
  --launch-count 8 --metrics sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active,lts__t_sector_hit_rate.pct,dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum,sm__warps_active.avg.pct_of_peak_sustained_active \
  python /tmp/ncu_v8.py > $OUT/ncu.txt 2>&1
grep -E "attn_fwd_hopper|cudnn|sdpa|fprop|Block Size|Grid Size|pct|duration|\.pct" $OUT/ncu.txt | cut -c1-140 | head -60
