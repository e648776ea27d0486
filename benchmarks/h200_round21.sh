#!/usr/bin/env bash
# Round 21 on the H200, runs of record for v9 after autograd's launches went direct (no
# wrap_triton outside tracing): the GPU test suite, the eager op's host cost, the forward and
# backward sweeps (README commands), and counters of the head_dim-64 Triton kernel against
# cuDNN's at the two short head_dim-64 shapes.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
pip install -e . --no-deps --no-build-isolation > $OUT/pip.txt 2>&1 || tail -5 $OUT/pip.txt
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cudnn', torch.backends.cudnn.version())"; } > $OUT/gpu.txt
timeout 250 python -m pytest -m cuda -q -p no:cacheprovider > $OUT/pytest_cuda.txt 2>&1
tail -2 $OUT/pytest_cuda.txt
timeout 40 python benchmarks/host_cost.py > $OUT/host_cost.txt 2>&1; cat $OUT/host_cost.txt
mkdir -p results/h200
timeout 150 python -m attnscope.profile bench --sweep default --impl naive naive_inplace sdpa_auto \
    sdpa_math sdpa_flash sdpa_efficient sdpa_cudnn flex fused --json results/h200/bench.json > $OUT/bench.txt 2>&1
cp results/h200/bench.json $OUT/; grep -E "  (fused|sdpa_cudnn) |geometric" $OUT/bench.txt | cut -c1-100
timeout 110 python -m attnscope.profile bench --mode bwd --sweep default --impl sdpa_flash \
    sdpa_efficient sdpa_cudnn fused --json results/h200/bench_bwd.json > $OUT/bench_bwd.txt 2>&1
cp results/h200/bench_bwd.json $OUT/; grep -E "  (fused|sdpa_cudnn) |geometric" $OUT/bench_bwd.txt | cut -c1-100
cat > /tmp/ncu_v9.py <<'PY'
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
import attnscope
for b, h, s in ((8, 16, 1024), (16, 16, 512)):
    q, k, v = (torch.randn(b, h, s, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for _ in range(2):
        attnscope.fused_attention(q, k, v)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
torch.cuda.synchronize()
PY
timeout 80 ncu --clock-control none -k regex:"attn_fwd|sdpa|fprop|flash|cudnn" --launch-count 8 \
  --metrics gpu__time_duration.sum,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,lts__t_sector_hit_rate.pct,sm__warps_active.avg.pct_of_peak_sustained_active \
  python /tmp/ncu_v9.py > $OUT/ncu.txt 2>&1
grep -E "attn_fwd|cudnn|sdpa|fprop|flash|pct|duration" $OUT/ncu.txt | cut -c1-120 | head -70
