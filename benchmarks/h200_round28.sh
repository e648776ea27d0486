#!/usr/bin/env bash
# Round 28 on the H200 (v11: 64-row tiles for causal head_dim-64 calls up to 2048 queries): the
# whole GPU suite over 8 processes, the eager op's host cost, then the runs of record (forward
# and backward sweeps, README commands).
source benchmarks/h200_setup.sh
SECONDS=0
timeout 230 python -m pytest -m cuda -q -p no:cacheprovider -n 8 > $OUT/pytest_cuda.txt 2>&1
tail -2 $OUT/pytest_cuda.txt; echo "pytest ${SECONDS}s"
timeout 50 python benchmarks/host_cost.py > $OUT/host_cost.txt 2>&1; grep -E "public|autograd|sdpa" $OUT/host_cost.txt
source benchmarks/h200_record.sh
record_fwd
record_bwd
echo "done ${SECONDS}s"
