#!/usr/bin/env bash
# Round 26 on the H200 (v10 on main: masked-band trims, Gluon TMA store): the whole GPU suite
# over 8 processes (compiles dominate it; one process ran out of 230 s in round 25), then a
# config re-sweep now that the trims and the TMA store changed the kernels: the Triton kernel's
# head_dim-64 configs, the Gluon kernel at head_dim 64 with the TMA store, and the Gluon
# configs at the short head_dim-128 shape.
source benchmarks/h200_setup.sh
SECONDS=0
timeout 250 python -m pytest -m cuda -q -p no:cacheprovider -n 8 --durations=8 \
    > $OUT/pytest_cuda.txt 2>&1
tail -14 $OUT/pytest_cuda.txt; echo "pytest ${SECONDS}s"
timeout 130 python benchmarks/fused_lab.py --repeat 3 --shapes 16,16,512,64 8,16,1024,64 \
    4,32,4096,64 --peers --configs 128,64,8,2 128,64,8,4 128,128,8,2 128,128,8,3 64,64,4,3 \
    --out $OUT/d64_triton.jsonl > $OUT/d64_triton.txt 2>&1
cut -c1-100 $OUT/d64_triton.txt; echo "triton d64 ${SECONDS}s"
timeout 100 python benchmarks/hopper_lab.py --time --repeat 3 --out $OUT/gluon.jsonl \
    --shapes 16,16,512,64 8,16,1024,64 --configs 128,2,1,240,1,2 64,3,1,240,1,2 \
    > $OUT/gluon_d64.txt 2>&1
cut -c1-100 $OUT/gluon_d64.txt; echo "gluon d64 ${SECONDS}s"
timeout 100 python benchmarks/hopper_lab.py --time --repeat 3 --out $OUT/gluon.jsonl \
    --shapes 8,16,1024,128 --configs 128,2,1,240,1,2 64,3,1,240,1,2 64,4,1,240,1,2 \
    128,2,0,240,1,2 > $OUT/gluon_d128.txt 2>&1
cut -c1-100 $OUT/gluon_d128.txt; echo "gluon d128 ${SECONDS}s"
