#!/usr/bin/env bash
# Round 9 on the H200: the Gluon Hopper forward made persistent (one program per SM walking
# tiles longest first, next tile's Q prefetched during the epilogue). Check, then time.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
pip install -e . --no-deps --no-build-isolation > $OUT/pip.txt 2>&1 || tail -5 $OUT/pip.txt
timeout 200 python benchmarks/hopper_lab.py --check 2>&1 | tee $OUT/check.txt | grep -v "^check" 
grep -c "nan False" $OUT/check.txt
echo "check rc ${PIPESTATUS[0]}"
timeout 330 python benchmarks/hopper_lab.py --time --repeat 2 --out $OUT/lab.jsonl \
    --configs 128,2,0,240 128,3,1,240 128,2,1,240 --shapes \
    8,16,1024,64 16,16,512,64 4,32,4096,64 4,32,4096,128 8,16,1024,128 2,16,16384,128 \
    4,32,4096,128,8 2>&1 | tee $OUT/time.txt | cut -c1-100
