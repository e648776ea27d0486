#!/usr/bin/env bash
# Round 31 on the H200: round 30's run of record read the fused op at (16,16,512,64) at 0.0603
# ms where rounds 28-29 read 0.0445-0.0451 with the same kernel, and equal to its seed-shape
# time: a floor. Is that row host-bound? host_floor.py times it as bench does and as a CUDA
# graph (the host out of it); host_cost.py gives this machine's host time per layer.
source benchmarks/h200_setup.sh
timeout 90 python benchmarks/host_floor.py --shape 16,16,512,64 > $OUT/host_floor.txt 2>&1
timeout 60 python benchmarks/host_floor.py --shape 8,16,1024,64 >> $OUT/host_floor.txt 2>&1
cat $OUT/host_floor.txt
timeout 60 python benchmarks/host_cost.py --head-dim 64 > $OUT/host_cost.txt 2>&1; cat $OUT/host_cost.txt
