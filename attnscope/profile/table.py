"""The comparison table: its columns, its cells and the one-line evidence of a verdict.

`compare` prints it, `report` renders it as HTML, `analyze` and `bench` format numbers the same
way (`fmt`); one module, so the three agree and neither imports the other.
"""

from __future__ import annotations

from attnscope.profile import tensor_cores as tc

CPU_NOTE = ("note: running on the CPU (no CUDA device requested or present): GPU columns are n/a, "
            "and the fused kernel runs through the Triton interpreter, so its CPU time is the "
            "interpreter's.")


def evidence_text(verdict: dict) -> str:
    """One line saying how a kernel's Tensor Core verdict is known, with its figures."""
    evidence = verdict.get("evidence", "name")
    if evidence == "counters":
        metrics = verdict.get("metrics", {})
        text = (f"counters: {fmt(metrics.get('matrix_instructions'), ',.0f')} matrix "
                f"instructions executed, tensor pipe {fmt(metrics.get(tc.TENSOR_PIPE_PCT), '.1f')}"
                f"% active")
        if (verdict.get("launches") or 1) > 1:  # a mean: say so, and the launches' range
            low, high = verdict.get("matrix_instructions_range") or (None, None)
            text += (f" (mean of {verdict['launches']} launches"
                     + (f"; {low:,.0f} to {high:,.0f} each" if low != high else "") + ")")
    elif evidence in ("sass", "ptx"):
        counts = {k: n for k, n in verdict.get("counts", {}).items() if n and k != "instructions"}
        text = (f"{evidence}: " + (", ".join(f"{n} {k}" for k, n in counts.items()) or "none")
                + f" in {verdict.get('counts', {}).get('instructions', 0)} instructions")
    else:
        text = f"name: {verdict.get('reason', 'no evidence')}"
    weaker = ", ".join(f"{tier}: {v}" for tier, v in (verdict.get("other") or {}).items())
    return text + (f" (weaker tiers: {weaker})" if weaker else "")


def fmt(value, spec):
    """A table cell: the number formatted, or "-" when there is none."""
    return "-" if value is None else format(value, spec)


NAME_CHARS = 32  # a kernel name in the table's verdict cell; results.json keeps the whole name


def _short(kernel_name: str) -> str:
    name = tc.display_name(kernel_name)
    return name if len(name) <= NAME_CHARS else name[:NAME_CHARS - 3] + "..."


def _verdict_cell(summary):
    # Rows from before the column existed have no summary; ncu's merge writes the same shape.
    # "partial: <kernels>" names each kernel shortened (library kernels' names run to 200
    # characters and would widen every row).
    if not summary:
        return "-"
    verdict = summary["verdict"]
    if verdict.startswith("partial: "):
        verdict = "partial: " + ", ".join(
            _short(n) for n in verdict.removeprefix("partial: ").split(", "))
    unknown = summary.get("unknown")
    return (f"{verdict} ({summary['evidence']}"
            + (f"; {unknown} kernel{'s' * (unknown > 1)} cannot tell" if unknown else "") + ")")


# (header, value of an "ok" row, GPU-only?). GPU-only columns read "n/a" on a CPU run.
COLUMNS = (
    ("impl", lambda r: r["impl"], False),
    ("kernels/fwd", lambda r: fmt(r["kernels_per_forward"], "g"), True),
    ("GPU ops/fwd", lambda r: fmt(r["gpu_ops_per_forward"], "g"), True),
    ("Tensor Cores", lambda r: _verdict_cell(r.get("tensor_cores")), True),
    ("CUDA us/fwd", lambda r: fmt(r["cuda_time_avg_us"], ".1f"), True),
    ("CPU us/fwd", lambda r: fmt(r["cpu_time_avg_us"], ".1f"), False),
    ("TFLOP/s", lambda r: fmt(r["tflops"], ".1f"), True),
    ("% peak", lambda r: fmt(r["pct_of_peak"], ".0f"), True),
    ("peak MB", lambda r: fmt(r["peak_memory_mb"], ".0f"), True),
    ("max abs err", lambda r: fmt(r["max_abs_error"], ".1e"), False),
    ("launch API", lambda r: ",".join(r["launch_apis"]) or "-", True),
    ("status", lambda r: r["status"] + (f": {r['reason']}" if r["status"] != "ok" else ""),
     False),
)


def _cell(row, header, value, gpu_only, device):
    if header in ("impl", "status"):
        return value(row)
    if gpu_only and device == "cpu":
        return "n/a"
    return value(row) if row["status"] == "ok" else "-"


def headers(mode: str = "fwd") -> list[str]:
    """The column headers. Per-call columns say what a call ran: a forward ("/fwd"), or under
    `--mode fwd_bwd` a forward and its backward ("/fwd+bwd")."""
    unit = "fwd+bwd" if mode == "fwd_bwd" else "fwd"
    return [header.replace("/fwd", f"/{unit}") for header, _, _ in COLUMNS]


def table_cells(rows, device) -> list[list[str]]:
    """The comparison table as text cells, one list per row (no header)."""
    return [[_cell(r, *column, device) for column in COLUMNS] for r in rows]


def format_table(rows, device, mode: str = "fwd") -> str:
    cells = [headers(mode)] + table_cells(rows, device)
    # Every column but the last (status, free text) is padded; numbers right-aligned.
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS) - 1)]
    lines = ["  ".join([line[0].ljust(widths[0])] + [c.rjust(w) for c, w in
                                                      zip(line[1:-1], widths[1:])] + [line[-1]])
             for line in cells]
    lines.insert(1, "-" * max(map(len, lines)))
    return "\n".join(lines)
