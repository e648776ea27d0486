#!/usr/bin/env bash
# Round 12 on the H200: three consumer warpgroups (192-row tiles) and 64-key blocks in the Gluon
# kernel. Check the new variants against float64, then time head_dim 64 variants against the
# Triton kernel and cuDNN, and 64-key blocks at head_dim 128.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
pip install -e . --no-deps --no-build-isolation > $OUT/pip.txt 2>&1 || tail -5 $OUT/pip.txt
timeout 150 python benchmarks/hopper_lab.py --check --configs 128,2,1,168,1,3 64,3,1,160,1,3 \
    2>&1 | tee $OUT/check.txt | grep -v "^check"
grep -c "nan False" $OUT/check.txt
timeout 200 python benchmarks/hopper_lab.py --time --repeat 3 --out $OUT/lab.jsonl --configs \
    128,3,1,240,1,2 128,2,1,152,1,3 128,2,1,168,1,3 64,3,1,160,1,3 64,3,1,240,1,2 --shapes \
    8,16,1024,64 16,16,512,64 4,32,4096,64 2>&1 | tee $OUT/time64.txt | cut -c1-100
timeout 100 python benchmarks/hopper_lab.py --time --repeat 3 --out $OUT/lab.jsonl --configs \
    64,3,1,240,1,2 64,4,1,240,1,2 128,3,1,240,1,2 --shapes 8,16,1024,128 4,32,4096,128 \
    2>&1 | tee $OUT/time128.txt | cut -c1-100
