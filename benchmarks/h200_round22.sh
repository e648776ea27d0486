#!/usr/bin/env bash
# Round 22 on the H200: the forward sweep of record again (README command) on the final code;
# round 21's host was noisy (cuDNN read 0.0738 ms through sdpa_cudnn and 0.0423 through sdpa_auto
# at the same shape in one run).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
pip install -e . --no-deps --no-build-isolation > $OUT/pip.txt 2>&1 || tail -5 $OUT/pip.txt
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cudnn', torch.backends.cudnn.version())"; } > $OUT/gpu.txt
mkdir -p results/h200
timeout 150 python -m attnscope.profile bench --sweep default --impl naive naive_inplace sdpa_auto \
    sdpa_math sdpa_flash sdpa_efficient sdpa_cudnn flex fused --json results/h200/bench.json > $OUT/bench.txt 2>&1
cp results/h200/bench.json $OUT/; grep -E "  (fused|sdpa_cudnn|sdpa_auto) |geometric" $OUT/bench.txt | cut -c1-100
