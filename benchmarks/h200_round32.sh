#!/usr/bin/env bash
# Round 32 on the H200 (v14: the eager forward's host path). Round 31 measured the
# (16,16,512,64) row host-bound under do_bench: 30.9 us of GPU wait counted for the fused op,
# 19.1 for cuDNN, while their kernels took 42.4 and 41.5 us in a CUDA graph. v14 looks an eager
# call up once by its launch key and calls Triton's C launcher directly on repeats.
# 1. GPU suite. 2. host_cost.py on the code before v14 (build/old, carried: `git archive` of
# the parent commit's attnscope/) and on v14, same machine. 3. host_vs_gpu.py. 4. If the suite
# passed: the forward sweep of record.
source benchmarks/h200_setup.sh
SECONDS=0
timeout 170 python -m pytest -m cuda -q -p no:cacheprovider -n 8 > $OUT/pytest_cuda.txt 2>&1
tail -1 $OUT/pytest_cuda.txt; grep -E "^FAILED" $OUT/pytest_cuda.txt | head -5; echo "pytest ${SECONDS}s"
passed=$(grep -cE "^(FAILED|ERROR)|[0-9]+ (failed|error)" $OUT/pytest_cuda.txt)
if [ -d build/old/attnscope ]; then
  PYTHONPATH=$PWD/build/old timeout 60 python benchmarks/host_cost.py > $OUT/host_cost_old.txt 2>&1
  cat $OUT/host_cost_old.txt
fi
timeout 60 python benchmarks/host_cost.py > $OUT/host_cost.txt 2>&1; cat $OUT/host_cost.txt
timeout 60 python benchmarks/host_cost.py --head-dim 64 --profile > $OUT/host_profile.txt 2>&1
timeout 90 python benchmarks/host_vs_gpu.py > $OUT/host_vs_gpu.txt 2>&1; cat $OUT/host_vs_gpu.txt
echo "host ${SECONDS}s"
if [ "$passed" = "0" ]; then
  source benchmarks/h200_record.sh
  record_fwd
fi
echo "done ${SECONDS}s"
