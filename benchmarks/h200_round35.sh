#!/usr/bin/env bash
# Round 35 on the H200: a replicate of the forward sweep of record (README command, same code as
# round 32's run of record plus v15's refactor of the schedule's cost model, same value) on a
# fresh machine, to show how far the geomean moves between machines. Rule fixed before the
# run: it is written to $OUT only and kept in notes/lab; round 32's JSON stays the run of record.
source benchmarks/h200_setup.sh
SECONDS=0
timeout 200 python -m attnscope.profile bench --sweep default --impl naive naive_inplace sdpa_auto \
    sdpa_math sdpa_flash sdpa_efficient sdpa_cudnn flex fused --json $OUT/bench_replicate.json \
    > $OUT/bench_replicate.txt 2>&1
grep -E "  (fused|sdpa_cudnn|sdpa_auto) |geometric" $OUT/bench_replicate.txt | cut -c1-100
timeout 90 python benchmarks/host_vs_gpu.py > $OUT/host_vs_gpu.txt 2>&1; cat $OUT/host_vs_gpu.txt
echo "done ${SECONDS}s"
