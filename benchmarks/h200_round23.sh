#!/usr/bin/env bash
# Round 23 on the H200 (branch v10-lab-mask-trims): the masked-band trims of the Triton forward
# against the kernel without them, interleaved, with cuDNN, at the head_dim-64 shapes; the GPU
# forward tests; the eager op's host cost including a training step (first run of the eager
# autograd path on the GPU).
source benchmarks/h200_setup.sh
timeout 200 python -m pytest -m cuda -q -p no:cacheprovider tests/test_fused_attention.py \
    tests/test_fused_attention_backward.py > $OUT/pytest_cuda.txt 2>&1
tail -2 $OUT/pytest_cuda.txt
timeout 60 python benchmarks/host_cost.py > $OUT/host_cost.txt 2>&1; cat $OUT/host_cost.txt
timeout 200 python benchmarks/order_lab.py --switch attnscope.kernels.attention_fwd._MASK_TRIMS \
    --shapes 16,16,512,64 8,16,1024,64 4,32,4096,64 --repeat 5 --out $OUT/trims.jsonl \
    > $OUT/trims.txt 2>&1
cut -c1-90 $OUT/trims.txt
