"""Result rows shared by every benchmark: each row carries the device name, date and git commit, then
the benchmark's own columns, and is appended to ``<out>/<name>.csv`` (header written once)."""
from __future__ import annotations

import contextlib
import csv
import datetime
import os
import signal
import subprocess
import sys
import threading
import traceback
from typing import Iterator, List, Optional, Sequence

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


#: Where :meth:`ResultRows.finish` appends by default: tracked files that one benchmark of a suite changes
#: before the next one starts, so they do not make a tree dirty.
_RESULTS = os.path.join("bench", "results")


def git_commit() -> str:
    """Short commit of the seqpar checkout this module runs from, with "-dirty" appended when a tracked
    file outside bench/results differs from it (or ``git status`` fails: a clean tree is not shown);
    ``SEQPAR_COMMIT`` overrides; "unknown" for an installed copy: its site-packages may sit inside
    another project's checkout, a venv in the user's repository, whose commit is not seqpar's."""
    if os.environ.get("SEQPAR_COMMIT"):
        return os.environ["SEQPAR_COMMIT"]
    try:
        top, commit = subprocess.check_output(["git", "rev-parse", "--show-toplevel", "--short", "HEAD"], cwd=_REPO,
                                              stderr=subprocess.DEVNULL, text=True).splitlines()
    except Exception:  # noqa: BLE001 - not a checkout
        return "unknown"
    if not os.path.samefile(top, _REPO):
        return "unknown"
    try:
        changed = subprocess.check_output(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", f":(exclude){_RESULTS}"],
            cwd=_REPO, stderr=subprocess.DEVNULL, text=True).strip()
    except Exception:  # noqa: BLE001 - the tree's state is unknown: not shown as clean
        changed = "?"
    return f"{commit}-dirty" if changed else commit


class ResultRows:
    """Rows ``device, date, commit, *columns``; ``add(*values)`` follows ``columns`` (floats as %.6g)."""

    def __init__(self, device: str, name: str,
                 columns: Sequence[str] = ("config", "provider", "metric", "value")):
        self.name, self.columns = name, tuple(columns)
        self.meta = dict(device=device, date=datetime.datetime.now().isoformat(timespec="seconds"),
                         commit=git_commit())
        self.rows: List[dict] = []
        self.interrupted = False
        self.failed = False

    @contextlib.contextmanager
    def sweep(self) -> Iterator["ResultRows"]:
        """The block that measures: a KeyboardInterrupt inside it (Ctrl-C, or ``timeout --signal=INT``,
        which is how bench/gpu_suite.sh ends a step at its time limit) ends the sweep, not the program,
        so the rows measured so far still reach :meth:`write`; ``interrupted`` is then True (a
        benchmark's exit status says so). An error (a CUDA error a provider left behind, a failing
        plan query) ends it the same way, its traceback printed and ``failed`` set: a device run's
        minutes are too scarce to lose the configurations measured before it.

        Only the first SIGINT raises; SIGINT is then ignored until the program ends, so that the rows
        are written. ``timeout`` signals the command and then its whole process group, and on the GPU
        machine the second SIGINT landed in this block's handler and lost a 160 s sweep's rows."""
        with _sigint_raises_once():
            try:
                yield self
            except KeyboardInterrupt:
                self.interrupted = True
                print(f"\n{self.name}: interrupted; keeping the {len(self.rows)} rows measured so far",
                      file=sys.stderr, flush=True)
            except Exception:  # noqa: BLE001 - reported, and the exit status says so
                self.failed = True
                traceback.print_exc()
                print(f"\n{self.name}: failed (above); keeping the {len(self.rows)} rows measured so far",
                      file=sys.stderr, flush=True)

    def add(self, *values) -> None:
        if len(values) != len(self.columns):
            raise ValueError(f"expected {len(self.columns)} values {self.columns}, got {len(values)}")
        cells = [f"{v:.6g}" if isinstance(v, float) else v for v in values]
        self.rows.append(dict(self.meta, **dict(zip(self.columns, cells))))

    def finish(self, out: Optional[str], quick: bool) -> int:
        """The end of a benchmark's main: append the rows to ``out``, by default the checkout's
        bench/results/ (a ``--quick`` smoke run writes only where ``out`` says), and return the exit
        status: 130 after an interrupted :meth:`sweep`, 1 after a failed one, else 0."""
        if out is None and not quick:
            out = os.path.join(_REPO, "bench", "results")
        if out is not None:
            print(f"{len(self.rows)} rows appended to {self.write(out)}")
        return self.exit_status()

    def exit_status(self) -> int:
        """130 after an interrupted :meth:`sweep`, 1 after a failed one, else 0."""
        return 130 if self.interrupted else 1 if self.failed else 0

    def write(self, out: str) -> str:
        """Append to ``out`` (a .csv path, or a folder that gets ``<name>.csv``); returns the path.

        An existing file must have these columns (ValueError naming both headers otherwise: rows of
        another width under its header were appended silently); one that doesn't end its last line
        gets the newline first (the first row was glued onto the last one)."""
        path = out if out.endswith(".csv") else os.path.join(out, f"{self.name}.csv")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fieldnames = ["device", "date", "commit", *self.columns]
        new = not os.path.exists(path) or os.path.getsize(path) == 0
        if not new:
            with open(path, newline="") as f:
                header = next(csv.reader(f), [])
            with open(path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                ends_line = f.read(1) == b"\n"
            if header != fieldnames:
                raise ValueError(f"{path} has the columns {header}, not this benchmark's {fieldnames}: "
                                 "write to another file (--out)")
        with open(path, "a", newline="") as f:
            if not new and not ends_line:
                f.write("\n")
            writer = csv.DictWriter(f, fieldnames=fieldnames)
            if new:
                writer.writeheader()
            writer.writerows(self.rows)
        return path


@contextlib.contextmanager
def _sigint_raises_once() -> Iterator[None]:
    """Inside the block the first SIGINT raises KeyboardInterrupt and every later one is ignored, for
    the rest of the program once one came (the default handler is back otherwise). Does nothing outside
    the main thread or where the program installed its own handler."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    fired = False

    def first_interrupt(signum, frame):
        nonlocal fired
        fired = True
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, first_interrupt)
    try:
        yield
    finally:
        if not fired:
            signal.signal(signal.SIGINT, signal.default_int_handler)
