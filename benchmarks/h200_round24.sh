#!/usr/bin/env bash
# Round 24 on the H200 (branch v10-lab-gluon-tma-store): the Gluon kernel's output through the
# copy engine. First correctness (the Gluon GPU tests run both store variants), then the two
# variants interleaved next to cuDNN at the head_dim-128 shapes.
source benchmarks/h200_setup.sh
timeout 200 python -m pytest -m cuda -q -p no:cacheprovider tests/test_fused_attention.py -k hopper \
    > $OUT/pytest_hopper.txt 2>&1
tail -2 $OUT/pytest_hopper.txt
timeout 200 python benchmarks/order_lab.py --switch \
    attnscope.kernels.attention_fwd_hopper._TMA_STORE --repeat 5 \
    --shapes 8,16,1024,128 4,32,4096,128 2,16,16384,128 --out $OUT/tma_store.jsonl \
    > $OUT/tma_store.txt 2>&1
cut -c1-90 $OUT/tma_store.txt
