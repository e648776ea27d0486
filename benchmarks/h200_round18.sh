#!/usr/bin/env bash
# Round 18 on the H200: the GPU test suite with the launch that skips Triton's dispatch on
# repeats (FastLaunch), the Gluon kernel's device-made TMA descriptors and the balanced head
# groups; the eager op's host cost on both kernel paths; the head-group rules, forward (both
# kernels) and backward.
source benchmarks/h200_setup.sh
timeout 270 python -m pytest -m cuda -q -p no:cacheprovider -x > $OUT/pytest_cuda.txt 2>&1
tail -3 $OUT/pytest_cuda.txt
timeout 100 python benchmarks/host_cost.py --profile > $OUT/host_cost.txt 2>&1
grep -E "head_dim|us/call" $OUT/host_cost.txt
timeout 200 python benchmarks/order_lab.py --shapes 16,16,512,64 8,16,1024,64 4,32,4096,64 \
    8,16,1024,128 4,32,4096,128 --backward --repeat 2 --out $OUT/order.jsonl > $OUT/order.txt 2>&1
cut -c1-76 $OUT/order.txt
