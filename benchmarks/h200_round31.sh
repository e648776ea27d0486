#!/usr/bin/env bash
# Round 31 on the H200: round 30's run of record read the fused op at (16,16,512,64) at 0.0603
# ms where rounds 28-29 read 0.0445-0.0451 with the same kernel, and equal to its seed-shape
# time: a floor. Is that row host-bound? host_vs_gpu.py times the short rows as bench does and
# as a CUDA graph (the host out of it); host_cost.py gives this machine's host time per layer.
# Not run yet: session 2026-11-30 ran out of device time before it. First the GPU suite: the
# Gluon tile schedule's cache changed after round 30 (never evicted, keyed by what it depends on,
# refused during CUDA-graph capture), with new GPU tests (CUDA graph, strided out).
source benchmarks/h200_setup.sh
timeout 200 python -m pytest -m cuda -q -p no:cacheprovider -n 8 > $OUT/pytest_cuda.txt 2>&1
tail -1 $OUT/pytest_cuda.txt; grep -E "^FAILED" $OUT/pytest_cuda.txt | head -5
timeout 120 python benchmarks/host_vs_gpu.py > $OUT/host_vs_gpu.txt 2>&1; cat $OUT/host_vs_gpu.txt
timeout 120 python benchmarks/host_cost.py --head-dim 64 128 --profile > $OUT/host_cost.txt 2>&1; cat $OUT/host_cost.txt
