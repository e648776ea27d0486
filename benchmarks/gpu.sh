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
#            TEST_ORDER names (reverse or shuffle, seeded by TEST_ORDER_SEED; default reverse);
#            with TEST_ARGS (pytest arguments, e.g. "tests/test_fused_attention_backward.py -k
#            padded"), those tests once, in file order, instead
#   bench    `attnscope bench --sweep BENCH_SWEEP` (default: default; with BENCH_SHAPES, a
#            list of B,H,S,D[,KV], `--shape BENCH_SHAPES` instead; with BENCH_ARGS, those
#            arguments instead, e.g. "--scenario chunked --q-len 512 --kv-len 4096") forward,
#            backward, and forward+backward (BENCH_MODES) into bench_MODE.json; with BEFORE_TREE
#            (a folder holding an earlier tree of the project, e.g. `git archive REV | tar -x -C
#            build/before`), each mode first runs there too for BEFORE_IMPLS (default: fused),
#            into bench_before_MODE.json, and the fused rows' time ratios (after / before) are
#            printed
#   compare  `attnscope compare` at the seed shape, with its report, into compare/ (COMPARE_ARGS:
#            more arguments, e.g. "--mode fwd_bwd --impl fused fa4")
#   ncu      `attnscope ncu` (hardware counters) into compare/, in the compare run's mode
#            (NCU_ARGS: more arguments, e.g. "--impl fused fa4")
#   host     `benchmarks/host_cost.py`: the op's host time a call by layer (head_dim 64 and 128,
#            with cProfile), and the decode route's at 1 and 8 queries
#   lab      `benchmarks/labs/hopper_lab.py --time` (the Gluon forward launched directly, with
#            the Triton kernel and cuDNN) at LAB_SHAPES (B,H,S,D[,KV] ...) with LAB_ARGS (e.g.
#            "--configs 128,3,240,2" or "--window 4096,0"), LAB_REPEAT rounds
#            (default 2), into lab_after.jsonl; with BEFORE_TREE, interleaved: this tree, the
#            before tree (into lab_before.jsonl), this tree again, then the Gluon rows' ratios
#            (mean of this tree's two runs / before's)
#   bwdlab   `benchmarks/labs/bwd_lab.py` (the backward's launches timed, gradients checked) at
#            BWDLAB_SHAPES (B,H,S,D[,KV] ...) with BWDLAB_ARGS (e.g. --nondeterministic),
#            LAB_REPEAT rounds, into bwdlab_after.jsonl; with BEFORE_TREE, the trees in turn
#            twice (this, before, this, before; before's into bwdlab_before.jsonl), then every
#            row's ratio (mean of this tree's runs / mean of before's)
#            lab and bwdlab take several BEFORE_TREE folders (space-separated, e.g. main's tree
#            and a variant's): each runs where "before" does above, in the order given, into
#            NAME_before_<folder name>.jsonl, and the ratios are this tree's against each
# Environment: OUT; TEST_ORDER, TEST_ORDER_SEED, TEST_ARGS; BENCH_SWEEP, BENCH_SHAPES, BENCH_ARGS,
# BENCH_MODES, BENCH_IMPLS (forward peers), BENCH_BWD_IMPLS (those with a backward), BEFORE_TREE,
# BEFORE_IMPLS; COMPARE_ARGS, NCU_ARGS; LAB_SHAPES, LAB_ARGS, LAB_REPEAT; BWDLAB_SHAPES,
# BWDLAB_ARGS; STEP_TIMEOUT (seconds per command, default 280).
set -uo pipefail
# The scripts under benchmarks/ import this tree's attnscope even where `pip install -e` cannot
# build (no network for an isolated build): the repository root goes on the path.
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
STEP_TIMEOUT=${STEP_TIMEOUT:-280}
BENCH_IMPLS=${BENCH_IMPLS:-naive naive_inplace sdpa_auto sdpa_math sdpa_flash sdpa_efficient sdpa_cudnn flex fa4 flash_attn2 fused}
BENCH_BWD_IMPLS=${BENCH_BWD_IMPLS:-sdpa_flash sdpa_cudnn flex fa4 fa4_deterministic flash_attn2 fused fused_nondeterministic}
BENCH_SWEEP=${BENCH_SWEEP:-default}
SUMMARY=()

step_setup() {
  python -m pip install -e . --no-deps --no-build-isolation > "$OUT/pip.log" 2>&1 \
    || echo "pip install -e failed (pip.log); this tree is imported through PYTHONPATH"
  python -c "import attnscope; print('attnscope from', attnscope.__file__)" || return
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv \
    | tee "$OUT/gpu.txt"
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__,
'cudnn', torch.backends.cudnn.version())" | tee -a "$OUT/gpu.txt"
}

step_test() {
  local rc=0 order=${TEST_ORDER:-reverse}
  if [ -n "${TEST_ARGS:-}" ]; then
    # shellcheck disable=SC2086  # the arguments are separate words
    timeout "$STEP_TIMEOUT" python -m pytest -m cuda -q -p no:cacheprovider -n 8 $TEST_ARGS
    return
  fi
  timeout "$STEP_TIMEOUT" python -m pytest -m cuda -q -p no:cacheprovider -n 8 || rc=$?
  timeout "$STEP_TIMEOUT" python -m pytest -m cuda -q -p no:cacheprovider -n 8 \
    --test-order "$order" --test-order-seed "${TEST_ORDER_SEED:-0}" || rc=$?
  return $rc
}

bench_ratios() {  # BEFORE.json AFTER.json: the fused rows' median time, after / before
  python - "$1" "$2" <<'PY'
import json, sys
before, after = ({(tuple(r["shape"]), r["kv_heads"]): r for r in json.load(open(p))["rows"]
                  if r["impl"] == "fused" and r["status"] == "ok"} for p in sys.argv[1:])
for key in sorted(set(before) & set(after)):
    b, a = before[key]["median_ms"], after[key]["median_ms"]
    print(f"fused {key[0]} kv_heads {key[1]}: before {b:.4f} ms, after {a:.4f} ms, ratio {a / b:.3f}")
PY
}

step_bench() {
  local rc=0 mode impls out shapes
  out=$(cd "$OUT" && pwd)  # absolute: the before-run works in another folder
  shapes=(--sweep "$BENCH_SWEEP")
  # shellcheck disable=SC2206  # the shapes are separate arguments
  [ -z "${BENCH_SHAPES:-}" ] || shapes=(--shape $BENCH_SHAPES)
  # shellcheck disable=SC2206  # so are these
  [ -z "${BENCH_ARGS:-}" ] || shapes=($BENCH_ARGS)
  [ "$(before_count)" -le 1 ] \
    || { echo "bench: BEFORE_TREE is one folder here (lab and bwdlab take several)"; return 2; }
  for mode in ${BENCH_MODES:-fwd bwd fwd_bwd}; do
    impls=$BENCH_IMPLS; [ "$mode" = fwd ] || impls=$BENCH_BWD_IMPLS
    if [ -n "${BEFORE_TREE:-}" ]; then  # python -m imports the current folder's attnscope
      # shellcheck disable=SC2086  # the implementation names are separate arguments
      (cd "$BEFORE_TREE" && timeout "$STEP_TIMEOUT" python -m attnscope.profile bench \
        "${shapes[@]}" --mode "$mode" --impl ${BEFORE_IMPLS:-fused} --json "$out/bench_before_$mode.json") || rc=$?
    fi
    # shellcheck disable=SC2086
    timeout "$STEP_TIMEOUT" python -m attnscope.profile bench "${shapes[@]}" --mode "$mode" \
      --impl $impls --json "$out/bench_$mode.json" || rc=$?
    if [ -n "${BEFORE_TREE:-}" ]; then
      bench_ratios "$out/bench_before_$mode.json" "$out/bench_$mode.json" || rc=$?
    fi
  done
  return $rc
}

step_compare() {
  # shellcheck disable=SC2086  # COMPARE_ARGS is a list of arguments
  timeout "$STEP_TIMEOUT" python -m attnscope.profile compare --out "$OUT/compare" --report \
    ${COMPARE_ARGS:-}
}

step_ncu() {
  # shellcheck disable=SC2086  # NCU_ARGS is a list of arguments
  timeout "$STEP_TIMEOUT" python -m attnscope.profile ncu --out "$OUT/compare" ${NCU_ARGS:-}
}

step_host() {
  local rc=0 q_len
  timeout "$STEP_TIMEOUT" python benchmarks/host_cost.py --head-dim 64 128 --profile --rounds 3 \
    || rc=$?
  for q_len in 1 8; do
    timeout "$STEP_TIMEOUT" python benchmarks/host_cost.py --decode --q-len "$q_len" --rounds 3 \
      || rc=$?
  done
  return $rc
}

lab_ratios() {  # BEFORE.jsonl AFTER.jsonl (two runs): the Gluon rows, mean after / before
  python - "$1" "$2" <<'PY'
import json, sys
before, after = ([json.loads(line) for line in open(p)] for p in sys.argv[1:])
for b in before:
    if not b["impl"].startswith("gluon"):
        continue
    a = [r["median_ms"] for r in after if (r["shape"], r["kv_heads"], r["impl"]) ==
         (b["shape"], b["kv_heads"], b["impl"])]
    if not a:
        print(f"{b['impl']} {b['shape']} kv_heads {b['kv_heads']}: no run of this tree")
        continue
    print(f"{b['impl']} {b['shape']} kv_heads {b['kv_heads']}: before {b['median_ms']:.4f} ms, "
          f"after {' '.join(f'{t:.4f}' for t in a)}, ratio {sum(a) / len(a) / b['median_ms']:.3f}")
PY
}

before_count() {  # how many folders BEFORE_TREE lists
  # shellcheck disable=SC2206  # the trees are separate words
  local trees=(${BEFORE_TREE:-})
  echo ${#trees[@]}
}

side_file() {  # TREE: an earlier tree's name in the lab files: "before" where BEFORE_TREE is one
  # folder, "before_<folder name>" where it lists several
  if [ "$(before_count)" -gt 1 ]; then echo "before_$(basename "$1")"; else echo before; fi
}

labs_in_turn() {  # NAME "SIDES" SCRIPT ARGS...: benchmarks/labs/SCRIPT ARGS in the trees SIDES
  # lists, in turn ("after": this tree; else a folder of BEFORE_TREE), each tree's JSON lines
  # into $OUT/NAME_after.jsonl or NAME_<side_file>.jsonl (the step's files emptied first)
  local name=$1 sides=$2 script=$3 rc=0 out side tree file
  shift 3
  out=$(cd "$OUT" && pwd)
  rm -f "$out/${name}_after.jsonl" "$out/${name}"_before*.jsonl
  for side in $sides; do
    tree=$PWD file=after
    if [ "$side" != after ]; then
      tree=$(cd "$side" && pwd) || { rc=2; continue; }
      file=$(side_file "$side")
    fi
    echo "-- $file: $tree"
    (cd "$tree/benchmarks/labs" && PYTHONPATH=$tree timeout "$STEP_TIMEOUT" python "$script" "$@" \
      --out "$out/${name}_$file.jsonl") || rc=$?
  done
  return $rc
}

each_before() {  # NAME RATIOS: the function RATIOS (BEFORE.jsonl AFTER.jsonl) against each tree
  # of BEFORE_TREE
  local name=$1 ratios=$2 rc=0 tree before
  for tree in $BEFORE_TREE; do
    echo "-- this tree against $tree"
    before=$OUT/${name}_$(side_file "$tree").jsonl
    [ -s "$before" ] || { echo "no run of $tree to compare with"; rc=1; continue; }
    "$ratios" "$before" "$OUT/${name}_after.jsonl" || rc=$?
  done
  return $rc
}

step_lab() {
  local rc=0
  [ -n "${LAB_SHAPES:-}" ] || { echo "lab: set LAB_SHAPES (B,H,S,D[,KV] ...)"; return 2; }
  # shellcheck disable=SC2086  # the shapes are separate arguments
  labs_in_turn lab "after ${BEFORE_TREE:+$BEFORE_TREE after}" hopper_lab.py --time \
    ${LAB_ARGS:-} --repeat "${LAB_REPEAT:-2}" --shapes $LAB_SHAPES || rc=$?
  [ -z "${BEFORE_TREE:-}" ] || each_before lab lab_ratios || rc=$?
  return $rc
}

step_bwdlab() {
  local rc=0
  [ -n "${BWDLAB_SHAPES:-}" ] || { echo "bwdlab: set BWDLAB_SHAPES (B,H,S,D[,KV] ...)"; return 2; }
  # shellcheck disable=SC2086  # the shapes and arguments are separate words
  labs_in_turn bwdlab "after ${BEFORE_TREE:+$BEFORE_TREE after $BEFORE_TREE}" bwd_lab.py \
    ${BWDLAB_ARGS:-} --repeat "${LAB_REPEAT:-2}" --shapes $BWDLAB_SHAPES || rc=$?
  [ -z "${BEFORE_TREE:-}" ] || each_before bwdlab bwdlab_ratios || rc=$?
  return $rc
}

bwdlab_ratios() {  # BEFORE.jsonl AFTER.jsonl: every (shape, row) of bwd_lab, mean after / before
  python - "$1" "$2" <<'PY'
import json, statistics, sys
before, after = ([json.loads(line) for line in open(p)] for p in sys.argv[1:])
def key(row):
    return tuple(row["shape"]), row["impl"]
for k in dict.fromkeys(key(r) for r in after):
    a = [r["ms"] for r in after if key(r) == k]
    b = [r["ms"] for r in before if key(r) == k]
    if not b:
        print(f"{k[1]} {list(k[0])}: no run of the before tree")
        continue
    ratio = statistics.mean(a) / statistics.mean(b)
    print(f"{k[1]} {list(k[0])}: after {' '.join(f'{t:.4f}' for t in a)} ms, before "
          f"{' '.join(f'{t:.4f}' for t in b)} ms, ratio {ratio:.3f}")
PY
}

# the lines of a step's log that say how it went, for the summary
highlights() {
  case $1 in
    setup) cat "$OUT/gpu.txt" 2>/dev/null ;;
    test) grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed)" "$OUT/test.log" ;;
    bench) grep -E "^\s*(fused|sdpa_cudnn) |geometric|ratio" "$OUT/bench.log" ;;
    host) grep -E "^(head_dim|decode)|public op|autograd|sdpa" "$OUT/host.log" ;;
    lab) grep -E "ratio|against|no run" "$OUT/lab.log" ;;
    bwdlab) grep -E "ratio|against|no run" "$OUT/bwdlab.log" ;;
    *) tail -3 "$OUT/$1.log" ;;
  esac
}

[ $# -gt 0 ] || { sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 2; }
for step in "$@"; do
  if ! declare -F "step_$step" > /dev/null; then
    echo "gpu.sh: unknown step '$step' (setup, test, bench, compare, ncu, host, lab, bwdlab)" >&2
    exit 2
  fi
done
status=0
for step in "$@"; do
  start=$SECONDS
  echo "== $step" | tee "$OUT/$step.log"
  "step_$step" 2>&1 | tee -a "$OUT/$step.log"
  rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || status=1
  SUMMARY+=("$step: rc $rc, $((SECONDS - start)) s, log $OUT/$step.log")
done
echo "== summary"
for i in "${!SUMMARY[@]}"; do
  echo "${SUMMARY[$i]}"
  highlights "${@:$((i + 1)):1}" | cut -c1-140 | head -20 | sed 's/^/  /'
done
exit $status
