#!/usr/bin/env bash
# Round 11 on the H200: the persistent Gluon kernel with alternating round direction. Its GPU
# tests, persistent against one-program-per-tile in interleaved rounds (Triton kernel pinned to
# its table config, cuDNN), then the forward benchmark of record (README command).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
pip install -e . --no-deps --no-build-isolation > $OUT/pip.txt 2>&1 || tail -5 $OUT/pip.txt
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cudnn', torch.backends.cudnn.version())"; } > $OUT/gpu.txt
timeout 150 python -m pytest -m cuda -q -p no:cacheprovider tests/test_fused_attention.py \
    -k "hopper or gpu_grid" > $OUT/pytest_hopper.txt 2>&1
tail -2 $OUT/pytest_hopper.txt
timeout 150 python benchmarks/hopper_lab.py --time --repeat 3 --out $OUT/lab.jsonl \
    --configs 128,2,1,240,0 --shapes 4,32,4096,128 8,16,1024,128 2,16,16384,128 \
    4,32,4096,128,8 2>&1 | tee $OUT/time.txt | cut -c1-100
mkdir -p results/h200
timeout 280 python -m attnscope.profile bench --sweep default --impl naive naive_inplace sdpa_auto \
    sdpa_math sdpa_flash sdpa_efficient sdpa_cudnn flex fused --json results/h200/bench.json > $OUT/bench.txt 2>&1
cp results/h200/bench.json $OUT/; tail -30 $OUT/bench.txt | cut -c1-150
