"""The report's kernel source pane: the source highlighted line by line, each line marked with
what the compiler's PTX line info ties to it (matrix, exp2, memory instructions), and the list
of lines that became matrix or exp2 instructions with their PTX."""

from __future__ import annotations

import html
import re

MAX_PTX_SHOWN = 40  # instructions listed per source line; the .4.ptx file has them all


def _e(value) -> str:
    return html.escape(str(value))


def _note(text) -> str:
    return f'<p class="note">{_e(text)}</p>'


def _badges(entry) -> str:
    if not entry:
        return ""
    classes, inlined = entry["classes"], entry["inlined"]
    shown = [(classes.get("matrix"), "mma", "b-mma"), (classes.get("exp2"), "ex2", "b-exp"),
             (classes.get("global loads"), "ld", "b-mem"),
             (classes.get("global stores"), "st", "b-mem"),
             (inlined.get("matrix"), "mma inlined", "b-call")]
    return "".join(f'<span class="badge {css}">{n} {label}</span>' for n, label, css in shown if n)


def source_html(source: str, lines: dict) -> str:
    """The source, highlighted line by line, with an anchor per line and the PTX badges.
    HtmlFormatter closes its spans at each line end, so its output splits into lines."""
    from pygments import highlight
    from pygments.formatters import HtmlFormatter
    from pygments.lexers import PythonLexer

    code = highlight(source, PythonLexer(), HtmlFormatter(nowrap=True)).split("\n")
    # From the first jit function on (@triton.jit, or @gluon.jit in the Hopper kernel): the
    # module docstring and imports compile to nothing.
    first = next((i for i, line in enumerate(source.splitlines())
                  if re.match(r"@(triton|gluon)\.jit", line)), 0)
    rows = []
    for number, text in enumerate(code[first:source.count("\n") + 1], first + 1):
        entry = lines.get(number)
        hot = " hot" if entry and entry["classes"].get("matrix") else ""
        badges = _badges(entry)
        if badges:
            badges = f'<a href="#ptx-L{number}">{badges}</a>'
        rows.append(f'<tr id="src-L{number}" class="line{hot}"><td class="ln">{number}</td>'
                    f'<td class="bd">{badges}</td><td class="code">{text}</td></tr>')
    return f'<table class="src">{"".join(rows)}</table>'


def line_list(lines: dict) -> str:
    """Source lines that became matrix or exp2 instructions, or call inlined code that did,
    each with the PTX attributed to it."""
    picked = [(n, e) for n, e in sorted(lines.items())
              if e["classes"].get("matrix") or e["classes"].get("exp2")
              or e["inlined"].get("matrix")]
    if not picked:
        return _note("the PTX carries no line info for this source file (TRITON_DISABLE_LINE_INFO "
                     "set?), or none of its lines became matrix or exp2 instructions")
    items = []
    for number, entry in picked:
        what = "; ".join(filter(None, (
            ", ".join(f"{n} {cls}" for cls, n in entry["classes"].most_common()),
            "call site of inlined code: " + ", ".join(
                f"{n} {cls}" for cls, n in entry["inlined"].most_common())
            if entry["inlined"] else "")))
        shown = entry["instructions"][:MAX_PTX_SHOWN]
        more = len(entry["instructions"]) - len(shown)
        listing = _e("\n".join(shown) + (f"\n... {more} more" if more > 0 else ""))
        items.append(f'<li id="ptx-L{number}"><a href="#src-L{number}">line {number}</a>: '
                     f"{_e(what)}"
                     + (f"<details><summary>PTX</summary><pre>{listing}</pre></details>"
                        if shown else "") + "</li>")
    return f'<ul class="lines">{"".join(items)}</ul>'
