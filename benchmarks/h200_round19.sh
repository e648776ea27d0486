#!/usr/bin/env bash
# Round 19 on the H200, runs of record for v9 (grouped tile order, FastLaunch, device-made TMA
# descriptors): the forward sweep and the backward sweep with the README's commands.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
pip install -e . --no-deps --no-build-isolation > $OUT/pip.txt 2>&1 || tail -5 $OUT/pip.txt
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cudnn', torch.backends.cudnn.version())"; } > $OUT/gpu.txt
mkdir -p results/h200
timeout 280 python -m attnscope.profile bench --sweep default --impl naive naive_inplace sdpa_auto \
    sdpa_math sdpa_flash sdpa_efficient sdpa_cudnn flex fused --json results/h200/bench.json > $OUT/bench.txt 2>&1
cp results/h200/bench.json $OUT/; grep -E "  (fused|sdpa_cudnn|sdpa_auto) |geometric" $OUT/bench.txt | cut -c1-130
timeout 200 python -m attnscope.profile bench --mode bwd --sweep default --impl sdpa_flash \
    sdpa_efficient sdpa_cudnn fused --json results/h200/bench_bwd.json > $OUT/bench_bwd.txt 2>&1
cp results/h200/bench_bwd.json $OUT/; grep -E "  (fused|sdpa_cudnn) |geometric" $OUT/bench_bwd.txt | cut -c1-130
