#!/usr/bin/env bash
# Round 34 on the H200: round 33's `ncu` (README command) ran past its 150 s limit at flex (a
# torch.compile'd kernel, slow under the profiler), so the counters of record are redone on
# round 33's compare output (in the working tree) with room. Also the backward's host time
# before v14 (build/old, carried) and after, in one job: v14's direct launch is the backward's
# too, and round 33's backward sweep read both ours and cuDNN's short rows ~20 % slower than
# round 28's machine.
source benchmarks/h200_setup.sh
SECONDS=0
timeout 420 python -m attnscope.profile ncu --out results/h200/compare > $OUT/ncu.txt 2>&1
echo "ncu rc $? ${SECONDS}s"; tail -8 $OUT/ncu.txt | cut -c1-160
tar czf $OUT/compare.tgz results/h200/compare
for tree in old new; do
  path=$PWD; [ $tree = old ] && path=$PWD/build/old
  PYTHONPATH=$path timeout 40 python benchmarks/host_cost.py > $OUT/host_cost_$tree.txt 2>&1
  echo $tree; grep -E "backward|public" $OUT/host_cost_$tree.txt
done
echo "done ${SECONDS}s"
