#!/usr/bin/env bash
# Round 27 on the H200: round 26 found 64-row tiles of 4 warps (64,64,4,3) faster than the
# table's (128,64,8,3) at head_dim 64 for 512 and 1024 keys and slower at 4096. Its neighbours,
# and a 2048-key shape to place the crossover, next to cuDNN.
source benchmarks/h200_setup.sh
timeout 200 python benchmarks/fused_lab.py --repeat 3 --peers --shapes 16,16,512,64 8,16,1024,64 \
    4,16,2048,64 4,32,4096,64 --configs 64,64,4,2 64,64,4,3 64,64,4,4 64,128,4,2 64,128,4,3 \
    --out $OUT/d64_small_tiles.jsonl > $OUT/d64_small_tiles.txt 2>&1
cut -c1-100 $OUT/d64_small_tiles.txt
