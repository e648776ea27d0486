#!/usr/bin/env bash
# Round 36 on the H200 (the session's last ~5 device minutes): the GPU tests of v14's kept
# launches added after a review (new scale/alignment, new thread, side stream, inputs not kept,
# direct launches and launch hooks, the Triton kernel in a CUDA graph) and the ones they sit with.
source benchmarks/h200_setup.sh
timeout 200 python -m pytest -m cuda -q -p no:cacheprovider -n 8 tests/test_fused_attention.py \
    -k "kept or cuda_graph or repeated or hopper_kernel_in" > $OUT/pytest_cuda.txt 2>&1
tail -3 $OUT/pytest_cuda.txt; grep -E "^(FAILED|ERROR)" $OUT/pytest_cuda.txt | head; grep -B5 -A30 "Error\|assert" $OUT/pytest_cuda.txt | head -60
