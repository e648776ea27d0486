#!/usr/bin/env bash
# Kernel round 5 on the H200: the software-pipelined loop against the plain one (lab sweep with
# peers at every default-sweep head dim), then the forward GPU tests on the new table.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
pip install -e . --no-deps --no-build-isolation > $OUT/pip.txt 2>&1 || tail -5 $OUT/pip.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
timeout 340 python benchmarks/fused_lab.py --peers --out $OUT/lab.jsonl --shapes \
    8,16,1024,64 4,32,4096,128 2,16,16384,128 8,16,1024,128 4,32,4096,64 16,16,512,64 \
    1,16,4096,256 2>&1 | tee $OUT/lab.txt
timeout 200 python -m pytest -m cuda -x -q tests/test_fused_attention.py 2>&1 \
    | tee $OUT/pytest_fwd.txt | tail -5
