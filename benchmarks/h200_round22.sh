#!/usr/bin/env bash
# Round 22 on the H200: the forward sweep of record again (README command) on the final code;
# round 21's host was noisy (cuDNN read 0.0738 ms through sdpa_cudnn and 0.0423 through sdpa_auto
# at the same shape in one run).
source benchmarks/h200_setup.sh
source benchmarks/h200_record.sh
record_fwd
