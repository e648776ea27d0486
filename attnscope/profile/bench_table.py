"""How `bench` prints its rows: the progress line per row and the final table."""

from __future__ import annotations

from attnscope.profile import warned
from attnscope.profile.table import fmt


def progress_line(i: int, total: int, row: dict) -> str:
    shape = "x".join(map(str, row["shape"]))
    if row["status"] == "ok":
        what = (f"{row['median_ms']:.4f} ms  {row['tflops']:.1f} TFLOP/s  "
                f"err {fmt(row['error'], '.2e')}  first call {row['first_call_ms']:.1f} ms")
    else:
        what = f"{row['status']}: {row['reason']}"
    what += warned.progress_suffix(row)
    return (f"[{i}/{total}] {row['scenario']} {shape} keys {row['kv_len']} kv{row['kv_heads']} "
            f"{row['impl']}: {what}")


def format_table(rows: list[dict], time_label: str) -> str:
    """One line per row; "keys" is the KV length per sequence ("packed": the row's seqlens)."""
    head = ["scenario", "shape B,H,S,D", "keys", "kv", "impl", "status", time_label, "TFLOP/s",
            "% peak", "x best peer", "max err", "1st call ms"]
    body = [[r.get("scenario", "prefill"), ",".join(map(str, r["shape"])),
             "packed" if r.get("seqlens") else str(r.get("kv_len", r["shape"][2])),
             str(r["kv_heads"]), r["impl"], r["status"],
             *(fmt(r[key], spec) for key, spec in (
                 ("median_ms", ".4f"), ("tflops", ".1f"), ("pct_of_peak", ".1f"),
                 ("ratio_to_best_peer", ".3f"), ("error", ".2e"), ("first_call_ms", ".1f")))]
            for r in rows]
    widths = [max(len(line[i]) for line in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in [head, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def summary_text(s: dict) -> str:
    """One of geomean_ratios' entries in words (the report's sweep table; summary_line names
    whose it is)."""
    text = f"{s['geomean_ratio_to_best_peer']:.3f} over {s['shapes']} shapes"
    if s.get("geomean_ratio_kernel_bound") is not None:  # (files written before these fields)
        text += (f"; {s['geomean_ratio_kernel_bound']:.3f} over the {s['kernel_bound_shapes']}"
                 f" where both it and the best peer take >= {s['kernel_bound_ms']} ms (faster"
                 f" ones are host-bound)")
    if "shapes_below_floor" in s:
        text += f"; {s['shapes_below_floor']} shapes below {s['floor']}"
    return text


def summary_line(name: str, s: dict) -> str:
    """bench's last lines: summary_text after the name of the implementation it is of."""
    return f"{name}: geometric mean ratio to the best peer {summary_text(s)}"
