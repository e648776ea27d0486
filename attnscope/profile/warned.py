"""The Python warnings raised while the drivers run one implementation, kept instead of printed.

A peer may warn on every compile (FA4's CuTe DSL warns twice per kernel it builds) and would bury
the drivers' progress lines; a refusal's warnings often name the check that refused (PyTorch's
SDPA backends). `bench` and `compare` keep each row's distinct warnings in the row, print a count
or the first one, and note at the end which entries warned."""

from __future__ import annotations

import contextlib
import warnings

MAX_CHARS = 300  # of one warning kept in a row


@contextlib.contextmanager
def kept_warnings():
    """Inside, warnings are not printed; the yielded list gets each distinct one once, as
    "Category: first line of the message", in the order first raised."""
    kept: list[str] = []

    def keep(message, category, *_):
        lines = str(message).strip().splitlines()
        text = f"{category.__name__}: {lines[0] if lines else ''}"[:MAX_CHARS]
        if text not in kept:
            kept.append(text)
    with warnings.catch_warnings():
        # The filters in force still decide what is shown (DeprecationWarning stays hidden
        # outside __main__, -W flags hold); entering resets which were already shown, so each
        # row gets its own.
        warnings.showwarning = keep
        yield kept


def progress_suffix(row: dict) -> str:
    """What a progress line adds for a row's kept warnings: their count on a row that ran, the
    first on one that did not ("" for none, or a row of a file written before the field)."""
    said = row.get("warnings") or []
    if not said:
        return ""
    if row.get("status") == "ok":
        return f"  ({len(said)} warning{'s' if len(said) > 1 else ''} kept in the row)"
    return f"; warned: {said[0]}" + (f" (+{len(said) - 1} more)" if len(said) > 1 else "")


def notes(rows: list[dict], where: str) -> list[str]:
    """One line per implementation whose rows kept warnings: how many rows, and the first."""
    seen: dict[str, tuple[int, str]] = {}
    for row in rows:
        said = row.get("warnings") or []
        if said:
            n, first = seen.get(row["impl"], (0, said[0]))
            seen[row["impl"]] = (n + 1, first)
    return [f"note: {name} warned on {n} row{'s' if n > 1 else ''} ({where} keep each): {first}"
            for name, (n, first) in seen.items()]
