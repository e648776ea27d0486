"""Where results go, so that no run ever destroys an earlier complete one.

An `--out` folder holds one folder per run and a pointer to the last complete one:

    OUT/runs/20261201-140512/   results.json, <impl>/ traces and tables, fused/kernel/, report.html
    OUT/latest -> runs/20261201-140512   swapped in one step (os.replace of a symlink), and only
                                         once a run has finished, so it always names a complete,
                                         self-consistent run
    OUT/.lock                   {"pid", "host", "started", "command"} of the run in progress

A run that is interrupted or fails (Ctrl-C, an exception, a full disk, an out folder that turns
unwritable) leaves `latest` where it was; its own finished rows stay in its run folder, in a
results.json marked `"complete": false`. A second run into the same folder while one holds the
lock is refused with the holder's pid, start time and command; a lock whose holder is no longer
alive (same host, pid gone) is taken over.

Readers (`report`, `ncu`) call `resolve()`: `OUT/latest` when there is one, else OUT itself, so
the flat folders written before run folders existed (tests/data, results/h200/compare) still read.

`write_bytes()`, `write_text()` and `write_json()` are the package's one atomic write: the new
content goes to a temporary file beside the target, then replaces it in one step, so an
interrupted write leaves the previous file whole.
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

RUNS = "runs"
LATEST = "latest"
LOCK = ".lock"
RESULTS = "results.json"


class RunError(RuntimeError):
    """The run folder cannot be used; the message says why (and, for a lock, who holds it)."""


def write_bytes(path, data: bytes) -> None:
    """Replace `path` with `data` in one step; the parent folder must exist. A path that
    exists and is no regular file (/dev/null, a pipe) is refused: the replace would put a
    regular file in its place."""
    path = Path(path)
    if not_a_file(path):
        raise OSError(errno.EINVAL, f"{path} exists and is not a regular file; not replaced")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk must not leave a half file behind
        raise


def not_a_file(path) -> bool:
    """Whether `path` exists as something other than a regular file or a folder (a device such
    as /dev/null, a pipe, a socket): a place results must never be written by replacing it."""
    path = Path(path)
    return path.exists() and not path.is_file() and not path.is_dir()


def compare_rows(data):
    """The rows of a compare run's results.json (its "rows", or an older file's flat list), or
    None where `data` is no compare run's: a bench file (it names a sweep), or rows that are not
    objects naming an implementation. `report` and `ncu` read a run through this."""
    if isinstance(data, dict) and "sweep" not in data:
        rows = data.get("rows", [])
    elif isinstance(data, list):
        rows = data
    else:
        return None
    if not isinstance(rows, list) or any(not isinstance(r, dict) or "impl" not in r
                                         for r in rows):
        return None
    return rows


def write_text(path, text: str) -> None:
    write_bytes(path, text.encode())


def write_json(path, data, indent: int = 1) -> None:
    write_text(path, json.dumps(data, indent=indent) + "\n")


# An OSError with one of these means the disk or the folder refuses writes, not that a profiled
# implementation failed (a missing kernel file, say, is the implementation's ENOENT).
_UNWRITABLE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})


def cannot_write(exc: OSError, folder) -> bool:
    """Whether `exc` means `folder` can no longer be written: an errno of a full disk, a quota,
    a read-only or forbidden place, or a folder where an empty file can no longer be made."""
    if exc.errno in _UNWRITABLE:
        return True
    try:
        with tempfile.TemporaryFile(dir=folder):
            return False
    except OSError:
        return True


def resolve(folder) -> Path:
    """The folder a reader should read: OUT/latest where a run completed there, else OUT."""
    folder = Path(folder)
    latest = folder / LATEST
    return latest if (latest / RESULTS).is_file() else folder


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


class Run:
    """One run into an --out folder: its lock, its own folder, and the swap of `latest`.

    Use as `with Run(out) as run:`; leaving the block releases the lock whatever happened.
    `run.folder` is where this run writes; `run.complete()` points `latest` at it."""

    def __init__(self, out, command: list[str] | None = None):
        self.out = Path(out)
        self.command = list(sys.argv if command is None else command)
        self.folder: Path | None = None
        self._locked = False

    def __enter__(self) -> "Run":
        if self.out.exists() and not self.out.is_dir():
            raise RunError(f"--out {self.out} is a file, not a folder: pass a folder's name")
        latest = self.out / LATEST
        if latest.exists() and not latest.is_symlink():  # a copy that resolved the link
            raise RunError(f"{latest} is a {'folder' if latest.is_dir() else 'file'}, not the "
                           f"link a run points at its folder (a copy made with cp -rL or scp -r "
                           f"turns it into one): rename or remove it, or use another --out")
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            self._lock()
            self.folder = self._new_folder()
        except OSError as e:
            self._unlock()
            raise RunError(f"cannot write to --out {self.out}: {e.strerror or e}") from None
        except BaseException:
            self._unlock()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._unlock()

    def _lock(self) -> None:
        lock = self.out / LOCK
        holder = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                  "command": " ".join(self.command)}
        for _ in range(2):  # the second try follows the removal of a dead holder's lock
            try:
                fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                other = _read_lock(lock)
                if other and other.get("host") == holder["host"] and not _alive(other["pid"]):
                    lock.unlink(missing_ok=True)  # its holder died without releasing it
                    continue
                who = (f"pid {other.get('pid')} on {other.get('host')}, started "
                       f"{other.get('started')}: {other.get('command')}") if other else \
                    "a holder that left no readable record"
                raise RunError(f"another run is writing to {self.out} ({who}); wait for it, "
                               f"use another --out, or remove {lock} if that run is gone") from None
            with os.fdopen(fd, "w") as f:
                json.dump(holder, f)
            self._locked = True
            return
        raise RunError(f"cannot take the lock {lock}: it reappeared after a stale one was removed")

    def _unlock(self) -> None:
        if self._locked:
            (self.out / LOCK).unlink(missing_ok=True)
            self._locked = False

    def _new_folder(self) -> Path:
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
        runs = self.out / RUNS
        runs.mkdir(exist_ok=True)
        for n in range(1, 1000):  # two runs within one second get -2, -3, ...
            folder = runs / (stamp if n == 1 else f"{stamp}-{n}")
            try:
                folder.mkdir()
                return folder
            except FileExistsError:
                continue
        raise OSError(errno.EEXIST, f"no free run folder name under {runs}")

    def complete(self) -> Path:
        """Point OUT/latest at this run (one atomic replace of a relative symlink)."""
        link = self.out / LATEST
        tmp = self.out / f".{LATEST}.{os.getpid()}.tmp"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(Path(RUNS, self.folder.name), target_is_directory=True)
        os.replace(tmp, link)
        return link


def _read_lock(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("pid"), int) else None
