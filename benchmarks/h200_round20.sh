#!/usr/bin/env bash
# Round 20 on the H200: the Gluon kernel at head_dim 64 again, now that its launch costs ~23 us
# of host time instead of ~120 (the v8 head_dim-64 rounds timed it with the host in the loop),
# and its head_dim-128 variants at the short shape; correctness of the head_dim-64 configs first.
source benchmarks/h200_setup.sh
timeout 120 python benchmarks/hopper_lab.py --check --configs 128,2,1,240,1,2 64,3,1,240,1,2 \
    > $OUT/check.txt 2>&1
grep -E "==|worst" $OUT/check.txt
timeout 300 python benchmarks/hopper_lab.py --time --repeat 3 --out $OUT/d64.jsonl \
    --shapes 16,16,512,64 8,16,1024,64 4,32,4096,64 --configs 128,2,1,240,1,2 128,3,1,240,1,2 \
    64,3,1,240,1,2 128,2,0,240,1,2 128,2,1,240,0,2 > $OUT/d64.txt 2>&1
cut -c1-90 $OUT/d64.txt
timeout 120 python benchmarks/hopper_lab.py --time --repeat 3 --out $OUT/d128.jsonl \
    --shapes 8,16,1024,128 --configs 128,2,1,240,0,2 64,3,1,240,1,2 128,3,1,240,1,2 > $OUT/d128.txt 2>&1
cut -c1-90 $OUT/d128.txt
