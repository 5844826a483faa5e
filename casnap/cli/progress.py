"""Progress bars for the long commands: bytes (or objects), rate, elapsed time and ETA.

Drawn by :mod:`rich` on stderr, and only when a person watches: stderr is a
terminal and neither ``--json`` nor ``-q`` was given. The bar is the
``progress(done, total)`` callable the Python API takes (``Repository.verify``,
``export``, ``repair``, ``gc``; ``Snapshot.take`` and ``restore``), so the command
line shows exactly what the API reports.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
from typing import Any

from casnap.display import format_size


def progress_bar(
    args: argparse.Namespace, label: str, unit: str = "bytes"
) -> contextlib.AbstractContextManager[ProgressBar | None]:
    """A progress bar for a command, or None where none is wanted.

    ``unit`` is ``"bytes"`` (sizes and a rate in MiB/s) or a thing counted
    (``"objects"``)::

        with progress_bar(args, "verify") as bar:
            repo.verify(read_data=True, progress=bar)
    """
    wanted = not args.json and not getattr(args, "quiet", False) and sys.stderr.isatty()
    if not wanted:
        return contextlib.nullcontext(None)
    return ProgressBar(label, unit)


def _rate(task: Any, unit: str) -> str:
    # rich's own speed needs two samples in its window; a phase that finished in
    # one step still has a rate: what it did over the time it took.
    speed = task.speed
    if speed is None and task.finished and task.elapsed:
        speed = task.completed / task.elapsed
    if speed is None:
        return "?"
    return f"{format_size(speed)}/s" if unit == "bytes" else f"{speed:,.0f} {unit}/s"


class ProgressBar:
    """A ``progress(done, total)`` callable that draws itself on stderr.

    Thread-safe (export and take report from worker threads). Drawing starts
    with the first report, so a command that reports nothing draws nothing. A
    report whose ``total`` differs from the last one's, or whose ``done`` goes
    back, starts the next phase on a new line (gc marks, then deletes; repair
    re-hashes, then plans, then writes).
    """

    def __init__(self, label: str, unit: str = "bytes") -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            MofNCompleteColumn,
            Progress,
            ProgressColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        from rich.text import Text

        class Rate(ProgressColumn):
            def render(self, task: Any) -> Text:
                return Text(_rate(task, unit), style="progress.data.speed")

        amount = DownloadColumn(binary_units=True) if unit == "bytes" else MofNCompleteColumn()
        self._bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            amount,
            Rate(),
            TextColumn("elapsed"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=Console(stderr=True),
        )
        self._label = label
        self._lock = threading.Lock()
        self._task: Any = None
        self._last = (0, -1)
        self._phase = 0

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            if self._task is not None:
                self._bar.stop()

    def __call__(self, done: int, total: int) -> None:
        with self._lock:
            if self._task is None:
                self._bar.start()
            if self._task is None or total != self._last[1] or done < self._last[0]:
                self._phase += 1
                name = self._label if self._phase == 1 else f"{self._label} ({self._phase})"
                self._task = self._bar.add_task(name, total=max(total, 0))
            self._last = (done, total)
            self._bar.update(self._task, completed=done)
