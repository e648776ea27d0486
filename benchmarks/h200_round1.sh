#!/usr/bin/env bash
# First H200 round: install, GPU tests of the fused op, kernel lab at three shapes with peers.
set -uo pipefail
export PYTHONUNBUFFERED=1
pip install -e . --no-deps --no-build-isolation -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee $OUT/gpu.txt
python -c "import torch, triton; print(torch.__version__, triton.__version__, torch.backends.cudnn.version())" | tee -a $OUT/gpu.txt
timeout 330 python -m pytest -m cuda tests/test_fused_attention.py -q -x 2>&1 | tee $OUT/pytest_cuda.txt | tail -15
timeout 200 python benchmarks/fused_lab.py --peers --shapes 8,16,1024,64 2,16,16384,128 \
  --out $OUT/lab.jsonl 2>&1 | tee $OUT/lab.txt
