#!/usr/bin/env bash
# Round 8 on the H200: first run of the Gluon Hopper forward (attention_fwd_hopper.py).
# Correctness against float64 first (under a timeout: a barrier protocol bug hangs), then
# timing against the Triton kernel and cuDNN over the default sweep's shapes.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
pip install -e . --no-deps --no-build-isolation > $OUT/pip.txt 2>&1 || tail -5 $OUT/pip.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
timeout 240 python benchmarks/hopper_lab.py --check --configs 128,2,0,240 2>&1 | tee $OUT/check.txt
echo "check rc ${PIPESTATUS[0]}"
timeout 300 python benchmarks/hopper_lab.py --time --repeat 2 --out $OUT/lab.jsonl \
    --configs 128,2,1,240 128,3,1,240 128,2,0,240 --shapes \
    8,16,1024,64 16,16,512,64 4,32,4096,64 4,32,4096,128 8,16,1024,128 2,16,16384,128 \
    4,32,4096,128,8 2>&1 | tee $OUT/time.txt | cut -c1-100
echo "time rc ${PIPESTATUS[0]}"
