"""Where a kernel's warps wait: Nsight Compute's PC sampling, per SASS instruction.

`ncu --stalls` profiles each implementation a second time with the WarpStateStats and
SourceCounters sections and exports that report's source page (`ncu -i REPORT --page source
--csv --print-source sass`): one row per SASS instruction, with how many times it executed and
its warp-state samples by reason. This module reads the page and sums it up per kernel: each
state's share of the samples, and the instructions that hold the most.

How to read it. A sample is one warp found in one state, not time lost. In a warp-specialized
kernel the producer warps (copy-engine loaders, writers) spend most of their time waiting, at
barriers and mbarriers, while the consumer warps compute, and their samples count as much as
the consumers'. The execution count tells the partitions apart: an instruction in the loop of a
one-warp partition executes once per iteration, one in a consumer warpgroup's loop four times,
one after the kernel's final join once per warp and program. So look at the instructions, not
only at the states: a "barrier" share held by one instruction that idle warps execute once a
program says nothing about the consumers' path.
"""

from __future__ import annotations

import csv

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
REASON_PREFIX = "stall_"
NOT_ISSUED = " (Not Issued)"  # the same reasons counted over not-issued samples only
OTHER = "other"  # samples in states the page has no column for


def parse_source_page(text: str) -> list[dict]:
    """The kernels of `ncu -i REPORT --page source --csv --print-source sass` output, in order:
    [{"kernel": name, "rows": [{"address", "sass", "samples", "executed", "reasons": {reason:
    samples}}]}]. Each profiled launch is a block: a "Kernel Name" line, then the table. Lines
    outside a table (ncu's notes) are skipped; text without one raises ValueError."""
    blocks: list[dict] = []
    lines = [line for line in text.splitlines() if line.startswith('"')]
    i = 0
    while i < len(lines):
        row = next(csv.reader([lines[i]]))
        if row and row[0] == "Kernel Name" and i + 1 < len(lines):
            header = next(csv.reader([lines[i + 1]]))
            if "Source" in header and SAMPLES in header:
                body = []
                i += 2
                while i < len(lines) and not lines[i].startswith('"Kernel Name"'):
                    body.append(lines[i])
                    i += 1
                blocks.append({"kernel": row[1] if len(row) > 1 else "",
                               "rows": _rows(header, body)})
                continue
        i += 1
    if not blocks:
        raise ValueError("no source page found (expected a \"Kernel Name\" line and a table "
                         f"with \"Source\" and \"{SAMPLES}\" columns)")
    return blocks


def _rows(header: list[str], body: list[str]) -> list[dict]:
    col = {name: i for i, name in enumerate(header)}
    reasons = [h for h in header if h.startswith(REASON_PREFIX) and not h.endswith(NOT_ISSUED)]
    rows = []
    for values in csv.reader(body):
        if len(values) != len(header):
            continue
        rows.append({"address": values[col["Address"]] if "Address" in col else str(len(rows)),
                     "sass": " ".join(values[col["Source"]].split()),
                     "samples": _int(values[col[SAMPLES]]),
                     "executed": _int(values[col[EXECUTED]]) if EXECUTED in col else None,
                     "reasons": {r.removeprefix(REASON_PREFIX): _int(values[col[r]])
                                 for r in reasons}})
    return rows


def _int(text: str) -> int:
    try:
        return int(float(text.replace(",", "")))
    except ValueError:
        return 0


def summarize(blocks: list[dict], top: int = 8) -> dict[str, dict]:
    """{kernel: {"profiles", "samples", "by_reason": {reason: share of the samples, "other"
    for the states the page names no column for}, "top":
    [{"sass", "share", "executed", "reasons": {reason: share}}]}}: a kernel profiled in several
    launches has its instructions' samples and executions summed (by address). Shares are
    fractions of all the kernel's samples; `top` lists the instructions with the most, each with
    its two largest reasons."""
    merged: dict[str, dict] = {}
    for block in blocks:
        kernel = merged.setdefault(block["kernel"], {"profiles": 0, "rows": {}})
        kernel["profiles"] += 1
        for row in block["rows"]:
            into = kernel["rows"].setdefault(row["address"], {
                "sass": row["sass"], "samples": 0, "executed": 0, "reasons": {}})
            into["samples"] += row["samples"]
            into["executed"] += row["executed"] or 0
            for reason, n in row["reasons"].items():
                into["reasons"][reason] = into["reasons"].get(reason, 0) + n
    out = {}
    for name, kernel in merged.items():
        rows = list(kernel["rows"].values())
        total = sum(r["samples"] for r in rows)
        by_reason: dict[str, int] = {}
        for r in rows:
            # The page has no column for some states (on the H200's ncu none for gmma, a warp
            # waiting on its wgmma): an instruction's samples past its named ones are "other".
            r["reasons"][OTHER] = r["samples"] - sum(r["reasons"].values())
            for reason, n in r["reasons"].items():
                by_reason[reason] = by_reason.get(reason, 0) + n

        def share(n):
            return n / total if total else 0.0
        hot = sorted(rows, key=lambda r: -r["samples"])[:top]
        out[name] = {
            "profiles": kernel["profiles"], "samples": total,
            "by_reason": {k: share(v) for k, v in sorted(by_reason.items(), key=lambda kv: -kv[1])
                          if v > 0},
            "top": [{"sass": r["sass"], "share": share(r["samples"]), "executed": r["executed"],
                     "reasons": {k: share(v) for k, v in
                                 sorted(r["reasons"].items(), key=lambda kv: -kv[1])[:2]
                                 if v > 0 and share(v) >= 0.001}}
                    for r in hot if r["samples"]]}
    return out


def _states(summary: dict, count: int) -> str:
    """The `count` largest states of a summary with their shares: "barrier 28.5%, ..."."""
    return ", ".join(f"{k} {100 * v:.1f}%" for k, v in list(summary["by_reason"].items())[:count])


def format_summary(name: str, summary: dict, reasons: int = 6) -> list[str]:
    """Console lines for one kernel's summary."""
    states = _states(summary, reasons)
    lines = [f"    stalls of {name}: {summary['samples']:,} samples in {summary['profiles']} "
             f"profiled launch(es): {states or 'none'}"]
    for hot in summary["top"]:
        why = ", ".join(f"{k} {100 * v:.1f}" for k, v in hot["reasons"].items())
        lines.append(f"      {100 * hot['share']:5.1f}%  {hot['sass'][:56]:<56}  "
                     f"executed {hot['executed']:,}  ({why})")
    return lines


def one_line(summary: dict, states: int = 3) -> str:
    """A kernel's summary in one line, for the report's op tables: its largest states and its
    hottest instruction with how often it executed."""
    text = f"{summary['samples']:,} samples: " + _states(summary, states)
    if summary["top"]:
        hot = summary["top"][0]
        why = ", ".join(hot["reasons"])
        text += (f"; hottest: {hot['sass'][:40]} {100 * hot['share']:.1f}% (executed "
                 f"{hot['executed']:,}{'; ' + why if why else ''})")
    return text
