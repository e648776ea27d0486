"""Interleaved timing rounds, shared by the labs: each round times every candidate once with
do_bench (L2 cleared before each call), round after round, so drift of the machine between
candidates (clocks, temperature; up to 8 % between runs of one config) hits all alike. The labs
report each candidate's median over the rounds."""

import triton.testing


def add_arguments(p, repeat=3):
    """The labs' timing flags: --warmup, --rep, --repeat, --out."""
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms (default 25)")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetition time, ms (default 100)")
    p.add_argument("--repeat", type=int, default=repeat,
                   help=f"timing rounds over all candidates; the median is reported "
                        f"(default {repeat})")
    p.add_argument("--out", default=None, help="append JSON lines here")


def interleaved(timers, repeat, warmup=25, rep=100, return_mode="median", label=""):
    """{name: [ms per round]} for the zero-argument calls in `timers`. A candidate that raises
    while timed (a config that does not compile or launch) is dropped from the result, with one
    line saying why: one bad candidate must not end the sweep."""
    times = {name: [] for name in timers}
    live = dict(timers)
    for _ in range(repeat):
        for name, fn in list(live.items()):
            try:
                times[name].append(triton.testing.do_bench(fn, warmup=warmup, rep=rep,
                                                           return_mode=return_mode))
            except Exception as e:  # noqa: BLE001
                print(f"{label} {name}: FAILED while timed: {type(e).__name__}: {str(e)[:200]}",
                      flush=True)
                del live[name], times[name]
    return times
