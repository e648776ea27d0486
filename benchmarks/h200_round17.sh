#!/usr/bin/env bash
# Round 17 on the H200: where the eager op's host time goes on both kernel paths (cProfile), the
# Triton kernel's tile order (heads grouped to share L2) against the old order, forward and
# backward, and the GPU test suite after the Gluon routing fixes and the grouped grids.
source benchmarks/h200_setup.sh
timeout 150 python benchmarks/host_cost.py --profile > $OUT/host_cost.txt 2>&1
grep -E "head_dim|us/call" $OUT/host_cost.txt
timeout 200 python benchmarks/order_lab.py --shapes 16,16,512,64 8,16,1024,64 4,32,4096,64 \
    --backward --out $OUT/order.jsonl > $OUT/order.txt 2>&1
cut -c1-80 $OUT/order.txt
timeout 300 python -m pytest -m cuda -q -p no:cacheprovider -x > $OUT/pytest_cuda.txt 2>&1
tail -3 $OUT/pytest_cuda.txt
