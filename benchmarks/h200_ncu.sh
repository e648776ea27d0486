# Sourced by the h200_*.sh device scripts. ncu_vs_cudnn HEAD_DIM "B,H,S ..." OUTFILE: hardware
# counters (each of the two calls per shape profiled, the first compiles and warms up; clocks
# not locked) of the fused forward and cuDNN's: duration, tensor / XU (MUFU) / FMA pipe activity, issue activity, warps
# active, L2 hit rate, DRAM throughput.
ncu_vs_cudnn() {
  local head_dim=$1 shapes=$2 out=$3
  cat > /tmp/ncu_shapes.py <<PY
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
import attnscope
for b, h, s in [tuple(int(x) for x in t.split(",")) for t in "$shapes".split()]:
    q, k, v = (torch.randn(b, h, s, $head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for _ in range(2):
        attnscope.fused_attention(q, k, v)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
torch.cuda.synchronize()
PY
  local n=$(( $(echo $shapes | wc -w) * 4 ))
  timeout 200 ncu --clock-control none -k regex:"attn_fwd|sdpa|fprop|flash|cudnn" --launch-count $n \
    --metrics gpu__time_duration.sum,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active,lts__t_sector_hit_rate.pct,dram__throughput.avg.pct_of_peak_sustained_elapsed \
    python /tmp/ncu_shapes.py > $out 2>&1
  grep -E "attn_fwd|cudnn|sdpa|fprop|flash|pct|duration" $out | cut -c1-120 | head -80
}
