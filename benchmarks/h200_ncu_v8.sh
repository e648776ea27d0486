#!/usr/bin/env bash
# Hardware counters of the Gluon forward and cuDNN's at two head_dim-128 shapes (h200_ncu.sh:
# one launch each after a warm-up, clocks not locked). v8 read tensor-pipe activity, L2 hit rate,
# DRAM throughput, duration and warps active; the shared script now reads more.
source benchmarks/h200_setup.sh
source benchmarks/h200_ncu.sh
ncu_vs_cudnn 128 "4,32,4096 8,16,1024" $OUT/ncu.txt
