"""What every casnap command shares: exit codes, tables, sizes, progress, and opening a
:class:`casnap.Repository` (every command works through one).

Sizes, times and floats are shown through :mod:`casnap.display`, the one
place that formats them for people (and parses sizes typed by them)."""

from __future__ import annotations

import argparse
import base64
import json
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

from casnap.api.repository import Repository
from casnap.cli.remote import first_contact
from casnap.display import format_float, format_size, format_time, parse_size
from casnap.format.entries import PrimitiveEntry
from casnap.ops.naming import resolve_name

EXIT_PROBLEMS, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_INTEGRITY, EXIT_ERROR = 1, 2, 3, 4, 5
# Bytes (``1.5 MiB``) and recorded times (local, with the offset) as shown everywhere.
human, age = format_size, format_time


def usage(message: str) -> int:
    """Bad usage found by casnap (not argparse): one line, ``casnap: error: <message>``,
    exit 2 (docs/repository.md: every error is one line in that form)."""
    print(f"casnap: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def cannot_write(path: str, exc: OSError) -> int:
    """A picture that could not be written: one error line, exit 5."""
    print(f"casnap: error: cannot write {path}: {exc}", file=sys.stderr)
    return EXIT_ERROR


def note(message: str) -> None:
    """A line for the person at the terminal, kept off stdout so ``--json`` stays parseable."""
    print(f"casnap: {message}", file=sys.stderr)


def size(text: str) -> int:
    """An argparse type: bytes from ``4194304``, ``4MiB`` or ``1.5GB`` (pydantic.ByteSize)."""
    try:
        value = parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size like 4194304, 4MiB or 1.5GB"
        ) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be positive")
    return value


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


def key_value(text: str) -> str:
    """An argparse type: an fsspec option as ``KEY=VALUE``, returned as given."""
    key, sep, _ = text.partition("=")
    if not key or not sep:
        raise argparse.ArgumentTypeError(f"wants KEY=VALUE, got {text!r}")
    return text


def options_of(items: list[str] | None) -> dict[str, Any]:
    """Options parsed by :func:`key_value` as a dict (a later KEY wins)."""
    return dict(item.split("=", 1) for item in items or [])


def storage_options(args: argparse.Namespace) -> dict[str, Any]:
    return options_of(args.storage_option)


def open_repo(args: argparse.Namespace) -> Repository:
    """The repository named by ``args.repo`` (RepositoryNotFoundError if none)."""
    options = storage_options(args)
    return first_contact(args.repo, lambda: Repository(args.repo, options))


def open_snapshot(args: argparse.Namespace, path: str) -> tuple[Repository, str]:
    """The repository holding the snapshot at ``path``, and the snapshot's name
    (``latest`` and tags resolved: casnap/ops/naming.py)."""
    options = storage_options(args)
    repo, name = first_contact(path, lambda: Repository.locate(path, options, must_exist=False))
    return repo, resolve_name(repo.storage, name)


def emit(args: argparse.Namespace, data: Any, text: Callable[[], str]) -> None:
    print(json.dumps(data, indent=2, default=str) if args.json else text())


def _float_of(stored: str) -> float:
    """A stored float (exact ``float.hex`` text, or ``nan:<bits>``) as a float."""
    return math.nan if stored.startswith("nan:") else float.fromhex(stored)


def _json_number(x: float) -> float | str:
    # JSON has no inf or nan: those become strings Python's float() reads back.
    return x if math.isfinite(x) else repr(x)


def primitive_value(e: PrimitiveEntry) -> tuple[Any, str]:
    """A primitive entry's value for ``--json`` and as shown to people.

    Floats are stored as exact ``float.hex`` text; they are shown and given
    to JSON as decimals (``repr``: the shortest text that reads back to the
    same float), so JSON keeps them exactly. Bytes stay base64 in JSON.
    """
    v = e.value
    try:
        if e.type == "float" and isinstance(v, str):
            x = _float_of(v)
            return _json_number(x), format_float(x)
        if e.type == "complex" and isinstance(v, list) and len(v) == 2:
            z = complex(_float_of(v[0]), _float_of(v[1]))
            return [_json_number(z.real), _json_number(z.imag)], repr(z)
        if e.type == "bytes" and isinstance(v, str):
            return v, repr(base64.b64decode(v))
    except (ValueError, TypeError):  # malformed: show what is stored
        pass
    return v, str(v)


def parent_label(parent: str, names: dict[str, str], absent: Sequence[str]) -> str:
    """A parent as ``log`` shows it: its snapshot's name; else its manifest hash and why
    no name: ``(deleted)`` while its manifest is still stored, ``(not in this repository)``
    when it is not (collected by gc since, or never here: a copy brings no parents along)."""
    if parent in names:
        return names[parent]
    return f"{parent[:12]} ({'not in this repository' if parent in absent else 'deleted'})"
