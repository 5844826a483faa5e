"""What every casnap command shares: exit codes, tables, sizes, progress, and opening a
:class:`casnap.Repository` (every command works through one)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from casnap.api.repository import Repository
from casnap.cli.naming import resolve_name
from casnap.cli.remote import first_contact
from casnap.errors import ConfigError

EXIT_PROBLEMS, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_INTEGRITY, EXIT_ERROR = 1, 2, 3, 4, 5


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def table(rows: list[list[str]], header: list[str], right: set[int] | None = None) -> str:
    right = right or set()
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]

    def fmt(row: Sequence[str]) -> str:
        cells = [
            str(c).rjust(w) if i in right else str(c).ljust(w)
            for i, (c, w) in enumerate(zip(row, widths))
        ]
        return "  ".join(cells).rstrip()

    return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


class Progress:
    """A one-line progress bar on stderr, shown only on a terminal."""

    def __init__(self, label: str, enabled: bool) -> None:
        self.label = label
        self.enabled = enabled and sys.stderr.isatty()

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or total <= 0:
            return
        width = 30
        filled = int(width * done / total)
        sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def storage_options(args: argparse.Namespace) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    for item in args.storage_option or []:
        key, _, value = item.partition("=")
        if not key or not _:
            raise ConfigError(f"--storage-option wants KEY=VALUE, got {item!r}", "storage_option")
        opts[key] = value
    return opts


def open_repo(args: argparse.Namespace) -> Repository:
    """The repository named by ``args.repo`` (RepositoryNotFoundError if none)."""
    options = storage_options(args)
    return first_contact(args.repo, lambda: Repository(args.repo, options))


def open_snapshot(args: argparse.Namespace, path: str) -> tuple[Repository, str]:
    """The repository holding the snapshot at ``path``, and the snapshot's name
    (``latest`` and tags resolved: casnap/cli/naming.py)."""
    options = storage_options(args)
    repo, name = first_contact(path, lambda: Repository.locate(path, options))
    return repo, resolve_name(repo, name)


def emit(args: argparse.Namespace, data: Any, text: Callable[[], str]) -> None:
    print(json.dumps(data, indent=2, default=str) if args.json else text())


def age(iso: str) -> str:
    try:
        return datetime.fromisoformat(iso).strftime("%Y-%m-%d %H:%M:%S")
    except ValueError:
        return iso
