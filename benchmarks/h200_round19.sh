#!/usr/bin/env bash
# Round 19 on the H200, runs of record for v9 (grouped tile order, FastLaunch, device-made TMA
# descriptors): the forward sweep and the backward sweep with the README's commands.
source benchmarks/h200_setup.sh
source benchmarks/h200_record.sh
record_fwd
record_bwd
