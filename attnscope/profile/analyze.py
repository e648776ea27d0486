"""`analyze TRACE`: the per-forward analysis of any Kineto trace, attnscope's or anyone's."""

from __future__ import annotations

import json
import sys

from attnscope.profile.trace import TraceError, analyze_file

HELP = ("analyse an existing Kineto trace (.json or .json.gz): kernels, GPU ops, CUDA/CPU time "
        "and launch APIs per forward range")
NAME_WIDTH = 72  # kernel names run to hundreds of characters; --json has them whole


def add_arguments(p):
    p.add_argument("trace", metavar="TRACE", help="a Kineto/Chrome trace file, .json or .json.gz")
    p.add_argument("--range", action="append", metavar="NAME", dest="ranges",
                   help="analyse only this record_function range (repeatable; default: every "
                        "user range except ProfilerStep#*)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object instead of tables (the fields of "
                        "trace.analyze_file's result)")


def _num(value, spec):
    return "n/a" if value is None else format(value, spec)


def format_range(name, r) -> str:
    lines = [f"range {name!r}: {r['forwards']} forwards, "
             f"{_num(r['kernels_per_forward'], 'g')} kernels/fwd, "
             f"{_num(r['gpu_ops_per_forward'], 'g')} GPU ops/fwd "
             f"({_num(r['memcpy_per_forward'], 'g')} memcpy, "
             f"{_num(r['memset_per_forward'], 'g')} memset)",
             f"  CUDA {_num(r['cuda_time_avg_us'], '.1f')} us/fwd busy, "
             f"{_num(r['gpu_span_avg_us'], '.1f')} us/fwd span; "
             f"Self CUDA total {_num(r['self_cuda_time_total_us'], '.1f')} us; "
             f"CPU {_num(r['cpu_time_avg_us'], '.1f')} us/fwd; "
             f"launch: {', '.join(r['launch_apis']) or '-'}"]
    if r["kernels"]:
        lines.append(f"  {'kernel':<{NAME_WIDTH}} {'/fwd':>5} {'avg us':>9} {'regs':>5} "
                     f"{'smem':>7} {'grid':>14} {'block':>13} {'occ%':>5}  launch API  "
                     f"tensor cores (evidence)")
    for k in r["kernels"]:
        short = k["name"] if len(k["name"]) <= NAME_WIDTH else k["name"][:NAME_WIDTH - 3] + "..."
        tc = k["tensor_cores"]
        lines.append(f"  {short:<{NAME_WIDTH}} {k['per_forward']:>5g} {k['avg_us']:>9.1f} "
                     f"{_num(k['registers'], 'd'):>5} {_num(k['shared_memory'], 'd'):>7} "
                     f"{str(k['grid'] or '-'):>14} {str(k['block'] or '-'):>13} "
                     f"{_num(k['occupancy_pct'], 'g'):>5}  {k['launch_api']}  "
                     f"{tc['verdict']} ({tc['evidence']})")
    return "\n".join(lines)


def run(args) -> int:
    try:
        result = analyze_file(args.trace, args.ranges)
    except TraceError as e:
        print(f"attnscope analyze: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"trace {result['trace']}: "
          + (f"Self CUDA time total {result['self_cuda_time_total_us']:.1f} us"
             if result["gpu"] else "no GPU activity (CPU-only profile)"))
    if result["unlaunched_gpu_ops"]:
        print(f"warning: {result['unlaunched_gpu_ops']} GPU ops have no launch event in the "
              f"trace and belong to no range")
    for name, r in result["ranges"].items():
        print(format_range(name, r))
    if not result["ranges"]:
        print("no user ranges (record_function) in this trace")
    return 0
