#!/usr/bin/env bash
# Kernel round 6 on the H200: polynomial exp2 share and pipelined loop with deeper prefetch,
# three timing rounds per candidate with cuDNN in the rounds; then the forward GPU tests.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
pip install -e . --no-deps --no-build-isolation > $OUT/pip.txt 2>&1 || tail -5 $OUT/pip.txt
timeout 400 python benchmarks/fused_lab.py --peers --repeat 3 --out $OUT/lab.jsonl --shapes \
    8,16,1024,64 4,32,4096,64 16,16,512,64 4,32,4096,128 8,16,1024,128 2,16,16384,128 \
    1,16,4096,256 2>&1 | tee $OUT/lab.txt | cut -c1-120
timeout 150 python -m pytest -m cuda -x -q tests/test_fused_attention.py 2>&1 \
    | tee $OUT/pytest_fwd.txt | tail -3
