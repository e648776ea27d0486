#!/usr/bin/env bash
# The one device script: run the named steps, in order, on a GPU machine from the repository
# root, every log and result under $OUT (the GPU runner sets it; default ./gpu-out), each
# step's log tee'd there, and a summary of every step printed last.
#
#   benchmarks/gpu.sh setup test bench      # e.g. the before/after check of a kernel change
#   benchmarks/gpu.sh setup compare ncu     # the profiler's run at the seed shape
#
# Steps:
#   setup    install the project into the machine's torch/triton (pip -e, no deps); GPU and
#            versions into gpu.txt
#   test     the GPU tests (pytest -m cuda) under -n 8 twice: in file order, then in the order
#            TEST_ORDER names (reverse or shuffle, seeded by TEST_ORDER_SEED; default reverse)
#   bench    `attnscope bench --sweep default` forward, backward, and forward+backward into
#            bench_fwd.json, bench_bwd.json, bench_fwd_bwd.json
#   compare  `attnscope compare` at the seed shape, with its report, into compare/
#   ncu      `attnscope ncu` (hardware counters) into compare/
# Environment: OUT; TEST_ORDER, TEST_ORDER_SEED; BENCH_IMPLS (forward peers), BENCH_BWD_IMPLS
# (those with a backward); STEP_TIMEOUT (seconds per command, default 280).
set -uo pipefail
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
STEP_TIMEOUT=${STEP_TIMEOUT:-280}
BENCH_IMPLS=${BENCH_IMPLS:-naive naive_inplace sdpa_auto sdpa_math sdpa_flash sdpa_efficient sdpa_cudnn flex fused}
BENCH_BWD_IMPLS=${BENCH_BWD_IMPLS:-sdpa_flash sdpa_efficient sdpa_cudnn fused}
SUMMARY=()

step_setup() {
  pip install -e . --no-deps --no-build-isolation || return
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv \
    | tee "$OUT/gpu.txt"
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__,
'cudnn', torch.backends.cudnn.version())" | tee -a "$OUT/gpu.txt"
}

step_test() {
  local rc=0 order=${TEST_ORDER:-reverse}
  timeout "$STEP_TIMEOUT" python -m pytest -m cuda -q -p no:cacheprovider -n 8 || rc=$?
  timeout "$STEP_TIMEOUT" python -m pytest -m cuda -q -p no:cacheprovider -n 8 \
    --test-order "$order" --test-order-seed "${TEST_ORDER_SEED:-0}" || rc=$?
  return $rc
}

step_bench() {
  local rc=0 mode impls
  for mode in fwd bwd fwd_bwd; do
    impls=$BENCH_IMPLS; [ "$mode" = fwd ] || impls=$BENCH_BWD_IMPLS
    # shellcheck disable=SC2086  # the implementation names are separate arguments
    timeout "$STEP_TIMEOUT" python -m attnscope.profile bench --sweep default --mode "$mode" \
      --impl $impls --json "$OUT/bench_$mode.json" || rc=$?
  done
  return $rc
}

step_compare() {
  timeout "$STEP_TIMEOUT" python -m attnscope.profile compare --out "$OUT/compare" --report
}

step_ncu() {
  timeout "$STEP_TIMEOUT" python -m attnscope.profile ncu --out "$OUT/compare"
}

# the lines of a step's log that say how it went, for the summary
highlights() {
  case $1 in
    setup) cat "$OUT/gpu.txt" 2>/dev/null ;;
    test) grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed)" "$OUT/test.log" ;;
    bench) grep -E "^\s*(fused|sdpa_cudnn) |geometric" "$OUT/bench.log" ;;
    *) tail -3 "$OUT/$1.log" ;;
  esac
}

[ $# -gt 0 ] || { sed -n '2,23p' "$0"; exit 2; }
for step in "$@"; do
  if ! declare -F "step_$step" > /dev/null; then
    echo "gpu.sh: unknown step '$step' (setup, test, bench, compare, ncu)" >&2
    exit 2
  fi
done
for step in "$@"; do
  start=$SECONDS
  echo "== $step" | tee "$OUT/$step.log"
  "step_$step" 2>&1 | tee -a "$OUT/$step.log"
  rc=${PIPESTATUS[0]}
  SUMMARY+=("$step: rc $rc, $((SECONDS - start)) s, log $OUT/$step.log")
done
echo "== summary"
for i in "${!SUMMARY[@]}"; do
  echo "${SUMMARY[$i]}"
  highlights "${@:$((i + 1)):1}" | cut -c1-140 | head -20 | sed 's/^/  /'
done
