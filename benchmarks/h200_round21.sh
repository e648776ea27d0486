#!/usr/bin/env bash
# Round 21 on the H200, runs of record for v9 after autograd's launches went direct (no
# wrap_triton outside tracing): the GPU test suite, the eager op's host cost, the forward and
# backward sweeps (README commands), and counters of the head_dim-64 Triton kernel against
# cuDNN's at the two short head_dim-64 shapes.
source benchmarks/h200_setup.sh
timeout 250 python -m pytest -m cuda -q -p no:cacheprovider > $OUT/pytest_cuda.txt 2>&1
tail -2 $OUT/pytest_cuda.txt
timeout 40 python benchmarks/host_cost.py > $OUT/host_cost.txt 2>&1; cat $OUT/host_cost.txt
source benchmarks/h200_record.sh
record_fwd
record_bwd
source benchmarks/h200_ncu.sh
ncu_vs_cudnn 64 "8,16,1024 16,16,512" $OUT/ncu.txt
