#!/usr/bin/env bash
# H200 runs of record. usage: bash benchmarks/h200_round4.sh A|B
#   A: GPU test suite, forward benchmark sweep (results/h200/bench.json)
#   B: compare + ncu at the seed shape (results/h200/compare), backward sweep (bench_bwd.json)
#   C: forward GPU tests and the tier-2 test, then everything of A's bench and B
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
pip install -e . --no-deps --no-build-isolation > /tmp/pip.txt 2>&1 || tail -5 /tmp/pip.txt
mkdir -p results/h200
if [ "$1" = C ]; then
  timeout 150 python -m pytest -m cuda -q -p no:cacheprovider tests/test_fused_attention.py \
    tests/test_tensor_cores.py > $OUT/pytest_cuda_fwd.txt 2>&1
  tail -3 $OUT/pytest_cuda_fwd.txt
fi
if [ "$1" = A ] || [ "$1" = C ]; then
  { nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv
    python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cudnn', torch.backends.cudnn.version())"; } > $OUT/gpu.txt
  if [ "$1" = A ]; then
    timeout 250 python -m pytest -m cuda -q -p no:cacheprovider > $OUT/pytest_cuda.txt 2>&1
    tail -4 $OUT/pytest_cuda.txt
  fi
  timeout 290 python -m attnscope.profile bench --sweep default --impl naive naive_inplace sdpa_auto \
    sdpa_math sdpa_flash sdpa_efficient sdpa_cudnn flex fused --json results/h200/bench.json > $OUT/bench.txt 2>&1
  cp results/h200/bench.json $OUT/; tail -75 $OUT/bench.txt | cut -c1-160
fi
if [ "$1" = B ] || [ "$1" = C ]; then
  timeout 120 python -m attnscope.profile compare --out results/h200/compare > $OUT/compare.txt 2>&1
  tail -16 $OUT/compare.txt | cut -c1-220
  timeout 170 python -m attnscope.profile ncu --out results/h200/compare > $OUT/ncu.txt 2>&1
  tail -5 $OUT/ncu.txt
  tar czf $OUT/compare.tgz results/h200/compare
  timeout 230 python -m attnscope.profile bench --mode bwd --sweep default --impl sdpa_flash \
    sdpa_efficient sdpa_cudnn fused --json results/h200/bench_bwd.json > $OUT/bench_bwd.txt 2>&1
  cp results/h200/bench_bwd.json $OUT/; tail -40 $OUT/bench_bwd.txt | cut -c1-160
fi
