#!/usr/bin/env bash
# Round 14 on the H200: double-buffered Q tiles in the Gluon kernel (Q_BUFS=2). Check against
# float64, time against the table config, and dump the compiled artifacts of both kernels.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
pip install -e . --no-deps --no-build-isolation > $OUT/pip.txt 2>&1 || tail -5 $OUT/pip.txt
timeout 120 python benchmarks/hopper_lab.py --check --configs 128,2,1,240,1,2,2 \
    2>&1 | tee $OUT/check.txt | grep -v "^check"
grep -c "nan False" $OUT/check.txt
timeout 150 python benchmarks/hopper_lab.py --time --repeat 3 --out $OUT/lab.jsonl --configs \
    128,2,1,240,1,2,2 64,3,1,240,1,2,2 --shapes 8,16,1024,128 4,32,4096,128 2,16,16384,128 \
    4,32,4096,128,8 2>&1 | tee $OUT/time.txt | cut -c1-100
timeout 60 python - <<'PY' 2>&1 | tail -4
import json, os, torch
from attnscope.profile import artifacts
for d in (64, 128):
    q = torch.randn(8, 16, 1024, d, device="cuda", dtype=torch.bfloat16)
    written = artifacts.dump(q, q, q, f"{os.environ['OUT']}/art{d}")
    meta = json.loads(written[-1].read_text())
    print(d, meta["kernel"], meta["source"], meta["config"], meta["compiled"]["registers_per_thread"],
          meta["tensor_cores"]["verdict"], [p.name for p in written])
PY
