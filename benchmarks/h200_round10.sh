#!/usr/bin/env bash
# Round 10 on the H200: the Gluon kernel wired into the op for head_dim 128. The whole GPU test
# suite, then persistent against one-program-per-tile grids in interleaved timing rounds.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
pip install -e . --no-deps --no-build-isolation > $OUT/pip.txt 2>&1 || tail -5 $OUT/pip.txt
timeout 300 python -m pytest -m cuda -q -p no:cacheprovider > $OUT/pytest_cuda.txt 2>&1
tail -4 $OUT/pytest_cuda.txt
timeout 240 python benchmarks/hopper_lab.py --time --repeat 3 --out $OUT/lab.jsonl \
    --configs 128,2,1,240,0 128,3,1,240,1 128,3,1,240,0 --shapes \
    4,32,4096,128 8,16,1024,128 2,16,16384,128 4,32,4096,128,8 2>&1 | tee $OUT/time.txt | cut -c1-100
