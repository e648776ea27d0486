#!/usr/bin/env bash
# Round 29 on the H200 (v12: the Gluon kernel's tiles handed out by list scheduling on the host
# instead of round-robin): the whole GPU suite (the Gluon tests run the v9 and current
# variants), the lab switch _BALANCED off and on interleaved next to cuDNN at the head_dim-128
# shapes, then the forward sweep with the README command.
source benchmarks/h200_setup.sh
SECONDS=0
timeout 200 python -m pytest -m cuda -q -p no:cacheprovider -n 8 > $OUT/pytest_cuda.txt 2>&1
tail -2 $OUT/pytest_cuda.txt; grep -E "^FAILED|Error" $OUT/pytest_cuda.txt | head -5; echo "pytest ${SECONDS}s"
timeout 150 python benchmarks/order_lab.py --switch \
    attnscope.kernels.attention_fwd_hopper._BALANCED --repeat 3 \
    --shapes 8,16,1024,128 4,32,4096,128 2,16,16384,128 --out $OUT/balanced.jsonl \
    > $OUT/balanced.txt 2>&1
cut -c1-100 $OUT/balanced.txt; echo "lab ${SECONDS}s"
source benchmarks/h200_record.sh
record_fwd
echo "done ${SECONDS}s"
