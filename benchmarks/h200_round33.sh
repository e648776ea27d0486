#!/usr/bin/env bash
# Round 33 on the H200, after v14's run of record (round 32).
# 1. schedule_lab.py: the Gluon kernel's tile schedule with other per-tile overheads in its cost
#    model (v12 set 1 unmeasured) and round-robin, next to cuDNN. A lab: nothing shipped changes.
# 2. The profile of record at the seed shape (compare + ncu, README command) on v14's code: the
#    one of record was made at 04:38 UTC, before v9-v14.
# 3. The backward sweep of record (README command): the one of record predates v12 and v14
#    (v14's direct launch is also the backward's).
source benchmarks/h200_setup.sh
SECONDS=0
timeout 150 python benchmarks/schedule_lab.py --out $OUT/schedule_lab.jsonl > $OUT/schedule_lab.txt 2>&1
cat $OUT/schedule_lab.txt | cut -c1-150; echo "lab ${SECONDS}s"
timeout 120 python -m attnscope.profile compare --out results/h200/compare > $OUT/compare.txt 2>&1
tail -16 $OUT/compare.txt | cut -c1-220
timeout 150 python -m attnscope.profile ncu --out results/h200/compare > $OUT/ncu.txt 2>&1
tail -5 $OUT/ncu.txt; echo "compare ${SECONDS}s"
tar czf $OUT/compare.tgz results/h200/compare
source benchmarks/h200_record.sh
record_bwd
echo "done ${SECONDS}s"
