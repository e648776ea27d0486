# Sourced by the h200_*.sh device scripts: the runs of record with the README's commands.
# record_fwd: the forward sweep into results/h200/bench.json; record_bwd: the backward sweep
# into results/h200/bench_bwd.json. Each copies its JSON and log to $OUT and prints the fused
# and cuDNN rows.
record_fwd() {
  mkdir -p results/h200
  timeout 150 python -m attnscope.profile bench --sweep default --impl naive naive_inplace sdpa_auto \
      sdpa_math sdpa_flash sdpa_efficient sdpa_cudnn flex fused --json results/h200/bench.json > $OUT/bench.txt 2>&1
  cp results/h200/bench.json $OUT/; grep -E "  (fused|sdpa_cudnn|sdpa_auto) |geometric" $OUT/bench.txt | cut -c1-100
}
record_bwd() {
  mkdir -p results/h200
  timeout 110 python -m attnscope.profile bench --mode bwd --sweep default --impl sdpa_flash \
      sdpa_efficient sdpa_cudnn fused --json results/h200/bench_bwd.json > $OUT/bench_bwd.txt 2>&1
  cp results/h200/bench_bwd.json $OUT/; grep -E "  (fused|sdpa_cudnn) |geometric" $OUT/bench_bwd.txt | cut -c1-100
}
