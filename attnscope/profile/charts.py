"""The report's figures, drawn with matplotlib and returned as inline PNG data URIs.

Figures are built on `matplotlib.figure.Figure` directly (no pyplot): no global backend or
figure registry, so drawing works headless and leaks nothing between calls. The caller imports
this module only after report.require_dependencies() has checked matplotlib is there.
"""

from __future__ import annotations

import base64
import io

from matplotlib.figure import Figure
from matplotlib.patches import Patch

# Tensor Core verdict -> bar colour; other GPU ops (memcpy, memset) get COPY_COLOUR.
VERDICT_COLOURS = {"yes": "#2e7d32", "no": "#9e9e9e", "unknown": "#ef6c00"}
COPY_COLOUR = "#1565c0"
CPU_COLOURS = {"range": "#e3f2fd", "op": "#90caf9", "launch": "#7e57c2"}
LOG_RATIO = 100  # bars spanning more than this factor go on a log axis, or the small vanish


def data_uri(fig: Figure) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def bars(labels, series: dict[str, list], title: str, xlabel: str, *, value_fmt="{:.3g}",
         reference: tuple[float, str] | None = None) -> str:
    """Horizontal bars, one group per label and one bar per series (None values left out);
    `reference` draws a vertical line (e.g. the measured peak) with its label."""
    series = {name: vs for name, vs in series.items() if any(v is not None for v in vs)}
    n = max(1, len(series))  # a series without values (CUDA time on a CPU run) takes no slot
    height = 0.8 / n
    # Constrained layout keeps the legend, placed outside the axes, inside the image.
    fig = Figure(figsize=(6.5, 0.45 * len(labels) * max(1, n * 0.7) + 1.2), layout="constrained")
    ax = fig.add_subplot()
    values = [v for vs in series.values() for v in vs if v]
    for i, (name, vs) in enumerate(series.items()):
        ys = [j + (i - (n - 1) / 2) * height for j in range(len(labels))]
        drawn = [(y, v) for y, v in zip(ys, vs) if v is not None]
        if not drawn:
            continue
        rects = ax.barh([y for y, _ in drawn], [v for _, v in drawn], height=height * 0.9,
                        label=name)
        ax.bar_label(rects, labels=[value_fmt.format(v) for _, v in drawn], padding=3,
                     fontsize=8)
    if reference:
        ax.axvline(reference[0], color="#c62828", linestyle="--", linewidth=1,
                   label=reference[1])
    if values and max(values) / min(values) > LOG_RATIO:
        ax.set_xscale("log")
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()  # first implementation on top, as in the table
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=11)
    ax.margins(x=0.15)
    if n > 1 or reference:
        fig.legend(fontsize=8, loc="outside lower center", ncol=3, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    return data_uri(fig)


def sweep(rows: list[dict], ylabel: str, title: str) -> str:
    """TFLOP/s per shape, one line per implementation (bench.json rows with status ok)."""
    shapes = list(dict.fromkeys(_shape_label(r) for r in rows))
    fig = Figure(figsize=(9, 4.5))
    ax = fig.add_subplot()
    for impl in dict.fromkeys(r["impl"] for r in rows):
        points = {_shape_label(r): r["tflops"] for r in rows
                  if r["impl"] == impl and r["status"] == "ok" and r["tflops"] is not None}
        if points:
            xs = [i for i, s in enumerate(shapes) if s in points]
            ax.plot(xs, [points[shapes[i]] for i in xs], marker="o", label=impl)
    ax.set_xticks(range(len(shapes)), shapes, rotation=30, ha="right", fontsize=8)
    ax.set_xlabel("shape: batch, heads, seq, head_dim (kv heads)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=11)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, bbox_to_anchor=(1.01, 1), loc="upper left")
    return data_uri(fig)


def _shape_label(row) -> str:
    paged = f" paged {row['page_size']}" if row.get("page_size") else ""
    window = f" window {','.join(map(str, row['window']))}" if row.get("window") else ""
    softcap = f" softcap {row['softcap']:g}" if row.get("softcap") else ""
    return ",".join(map(str, row["shape"])) + f" ({row['kv_heads']}){paged}{window}{softcap}"


def timeline(forward: dict, numbered_ops: list[tuple[int, dict, str | None]], title: str) -> str:
    """One forward to scale, in microseconds from the start of its range: top-level CPU ops over
    the range, launch calls, and GPU ops numbered as in the report's kernel table.
    `numbered_ops`: (number, GPU op event, Tensor Core verdict or None for memcpy/memset)."""
    r = forward["range"]
    t0 = r["ts"]
    end = max([r["ts"] + r.get("dur", 0)]
              + [op["ts"] + op.get("dur", 0) for _, op, _ in numbered_ops]) - t0
    fig = Figure(figsize=(12, 2.6))
    ax = fig.add_subplot()
    lanes = {"CPU ops": 2, "CPU launches": 1, "GPU": 0}

    def draw(events, lane, colour, edge=None):
        if events:
            ax.broken_barh([(e["ts"] - t0, e.get("dur", 0)) for e in events], (lane - 0.35, 0.7),
                           facecolors=colour, edgecolors=edge or colour, linewidth=0.6)

    draw([r], lanes["CPU ops"], CPU_COLOURS["range"], "#64b5f6")
    draw(forward["cpu_ops"], lanes["CPU ops"], CPU_COLOURS["op"], "#1e88e5")
    for e in forward["cpu_ops"]:
        if e.get("dur", 0) > end * 0.08:  # a name only where it fits
            ax.text(e["ts"] - t0 + e["dur"] / 2, lanes["CPU ops"], e["name"], ha="center",
                    va="center", fontsize=7, clip_on=True)
    draw(forward["launches"], lanes["CPU launches"], CPU_COLOURS["launch"])
    launch_of = {(e.get("args") or {}).get("correlation"): e for e in forward["launches"]}
    for number, op, verdict in numbered_ops:
        colour = VERDICT_COLOURS.get(verdict, COPY_COLOUR) if verdict else COPY_COLOUR
        draw([op], lanes["GPU"], colour)
        ax.text(op["ts"] - t0 + op.get("dur", 0) / 2, lanes["GPU"] + 0.42, str(number),
                ha="center", va="bottom", fontsize=7)
        launch = launch_of.get((op.get("args") or {}).get("correlation"))
        if launch:  # launch -> execution: how far the GPU runs behind the CPU
            ax.plot([launch["ts"] - t0, op["ts"] - t0], [lanes["CPU launches"] - 0.35,
                                                        lanes["GPU"] + 0.35],
                    color="#bdbdbd", linewidth=0.5, zorder=0)
    if not numbered_ops:
        ax.text(end / 2, lanes["GPU"], "no GPU activity in this trace (CPU run)", ha="center",
                va="center", fontsize=8, color="#757575")
    ax.set_yticks(list(lanes.values()), list(lanes))
    ax.set_ylim(-0.6, 2.6)
    ax.set_xlim(0, end * 1.01 or 1)
    ax.set_xlabel(f"us from the start of the `{r['name']}` range")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    legend = [Patch(color=c, label=f"Tensor Cores: {v}") for v, c in VERDICT_COLOURS.items()]
    legend += [Patch(color=COPY_COLOUR, label="memcpy/memset"),
               Patch(color=CPU_COLOURS["launch"], label="launch call"),
               Patch(color=CPU_COLOURS["op"], label="CPU op")]
    ax.legend(handles=legend, fontsize=7, ncol=6, loc="upper center",
              bbox_to_anchor=(0.5, -0.35), frameon=False)
    return data_uri(fig)
