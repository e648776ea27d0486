#!/usr/bin/env bash
# Round 25 on the H200 (branch v10-lab: both v10 experiments): the whole GPU suite (first GPU
# run of the eager autograd path and the review fixes; the Gluon tests run both store
# variants), the eager op's host cost with a training step, then each experiment's lab switch
# timed interleaved next to cuDNN. Ran at commit 0e600d4; the switch _MASK_TRIMS was removed after
# it (the trims are unconditional), and the GPU suite ran out of its 230 s at 62 % (no failure).
source benchmarks/h200_setup.sh
SECONDS=0
timeout 230 python -m pytest -m cuda -q -p no:cacheprovider > $OUT/pytest_cuda.txt 2>&1
tail -3 $OUT/pytest_cuda.txt; echo "pytest ${SECONDS}s"
timeout 50 python benchmarks/host_cost.py > $OUT/host_cost.txt 2>&1; cat $OUT/host_cost.txt
timeout 120 python benchmarks/order_lab.py --switch attnscope.kernels.attention_fwd._MASK_TRIMS \
    --shapes 16,16,512,64 8,16,1024,64 4,32,4096,64 --repeat 3 --out $OUT/trims.jsonl \
    > $OUT/trims.txt 2>&1
cut -c1-100 $OUT/trims.txt; echo "trims ${SECONDS}s"
timeout 130 python benchmarks/order_lab.py --switch \
    attnscope.kernels.attention_fwd_hopper._TMA_STORE --repeat 3 \
    --shapes 8,16,1024,128 4,32,4096,128 2,16,16384,128 --out $OUT/tma_store.jsonl \
    > $OUT/tma_store.txt 2>&1
cut -c1-100 $OUT/tma_store.txt; echo "tma ${SECONDS}s"
