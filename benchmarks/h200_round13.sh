#!/usr/bin/env bash
# Round 13 on the H200, runs of record for the final code: the whole GPU test suite, then the
# forward benchmark sweep (README command) into results/h200/bench.json.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
pip install -e . --no-deps --no-build-isolation > $OUT/pip.txt 2>&1 || tail -5 $OUT/pip.txt
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cudnn', torch.backends.cudnn.version())"; } > $OUT/gpu.txt
timeout 290 python -m pytest -m cuda -q -p no:cacheprovider > $OUT/pytest_cuda.txt 2>&1
tail -2 $OUT/pytest_cuda.txt
mkdir -p results/h200
timeout 250 python -m attnscope.profile bench --sweep default --impl naive naive_inplace sdpa_auto \
    sdpa_math sdpa_flash sdpa_efficient sdpa_cudnn flex fused --json results/h200/bench.json > $OUT/bench.txt 2>&1
cp results/h200/bench.json $OUT/; grep -E "  (fused|sdpa_cudnn|sdpa_auto) |geometric" $OUT/bench.txt | cut -c1-130
