#!/usr/bin/env bash
# Kernel round on the H200: install, then the lab at the given shapes with peers.
# usage: bash benchmarks/h200_lab.sh SHAPE... (B,H,S,D)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
pip install -e . --no-deps --no-build-isolation > $OUT/pip.txt 2>&1 || tail -5 $OUT/pip.txt
timeout 420 python benchmarks/fused_lab.py --peers --shapes "$@" --out $OUT/lab.jsonl 2>&1 | tee $OUT/lab.txt
