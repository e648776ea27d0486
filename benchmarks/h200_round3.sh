#!/usr/bin/env bash
# H200 round 3: driver at the seed shape (traces for tests/data), ncu counters, kernel lab sweep.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
W=/tmp/w; mkdir -p $W
pip install -e . --no-deps --no-build-isolation > $W/pip.txt 2>&1 || tail -5 $W/pip.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > $W/gpu.txt
(time timeout 150 python -m attnscope.profile compare --out $W/compare) > $W/compare.log 2>&1; tail -25 $W/compare.log
(ncu --query-metrics --chip gh100 2>&1 | grep -i "tensor\|pipe_fma\|hmma\|gmma\|ffma" > $W/ncu_metrics.txt) || true
timeout 200 python -m attnscope.profile ncu --impl naive sdpa_math sdpa_flash sdpa_efficient sdpa_cudnn flex fused --out $W/compare > $W/ncu.log 2>&1; tail -30 $W/ncu.log
timeout 60 python -m pytest -m cuda tests/test_tensor_cores.py -q > $W/pytest_tc.txt 2>&1; tail -3 $W/pytest_tc.txt
tar czf $OUT/round3.tgz -C $W . 2>/dev/null
timeout 240 python benchmarks/fused_lab.py --peers --shapes 8,16,1024,64 4,32,4096,128 1,16,4096,256 2,16,16384,128 --out $OUT/lab.jsonl > $OUT/lab.txt 2>&1
grep -v "^$" $OUT/lab.txt | cut -c1-150 | tail -45
