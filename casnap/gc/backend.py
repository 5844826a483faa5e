"""What gc needs from the backend below the object-store contract.

The contract's ``list`` gives keys only; gc also needs each object's size and
age (to honour the grace period and report what it frees), the temp files a
crashed local put left behind, and, on a local disk, an fsync of the folders
it deleted manifests from and a way to remove those temp files. This module
looks through :class:`~casnap.store.PrefixStore` views and
:class:`~casnap.store.CountingStore` wrappers to the backend to do that. Used
by :mod:`casnap.gc.plan` (listing) and :mod:`casnap.gc.collect` (deleting).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from casnap.repo.leases import parse_time
from casnap.store import CountingStore, FsspecStore, LocalStore, ObjectStore, PrefixStore
from casnap.store.local import _TMP_MARK


@dataclass(frozen=True)
class Listed:
    """One object (or temp file) found below a prefix."""

    key: str
    size: int | None
    mtime: float | None  # None: the store cannot say how old it is


def _unwrap(store: ObjectStore) -> tuple[ObjectStore, str]:
    """The backend below views and wrappers, and the folder the view is rooted at."""
    parts: list[str] = []
    while True:
        if isinstance(store, PrefixStore):
            parts.insert(0, store.prefix)
            store = store.inner
        elif isinstance(store, CountingStore):
            store = store.inner
        else:
            return store, "/".join(parts)


def _local_path(store: LocalStore, folder: str, key: str) -> str:
    return os.path.join(store.root, *[p for p in f"{folder}/{key}".split("/") if p])


def scan(store: ObjectStore, prefix: str) -> tuple[list[Listed], list[Listed]]:
    """Objects below ``prefix`` with size and age, and (local only) leftover temp files."""
    base, folder = _unwrap(store)
    if isinstance(base, LocalStore):
        return _scan_local(base, folder, prefix)
    if isinstance(base, FsspecStore):
        return _scan_fsspec(base, folder, prefix), []
    return [Listed(k, None, None) for k in store.list(prefix)], []


def _scan_local(base: LocalStore, folder: str, prefix: str) -> tuple[list[Listed], list[Listed]]:
    view = _local_path(base, folder, "")
    top = os.path.join(view, *prefix.split("/"))
    objects: list[Listed] = []
    temps: list[Listed] = []

    def fail(exc: OSError) -> None:
        if not isinstance(exc, FileNotFoundError):
            raise exc  # a folder we cannot read may hold live objects: stop

    for path, _dirs, files in os.walk(top, onerror=fail):
        rel = os.path.relpath(path, view).replace(os.sep, "/")
        for name in files:
            try:
                st = os.stat(os.path.join(path, name))
            except FileNotFoundError:
                continue
            item = Listed(f"{rel}/{name}", st.st_size, st.st_mtime)
            (temps if _TMP_MARK in name else objects).append(item)
    return objects, temps


def _scan_fsspec(base: FsspecStore, folder: str, prefix: str) -> list[Listed]:
    # One listing with details (sizes, times) instead of one info() per object.
    sub = f"{folder}/{prefix}" if folder else prefix
    try:
        found = base.fs.find(base._path(sub), detail=True)
    except FileNotFoundError:
        return []
    strip = base.fs._strip_protocol
    root = strip(base._path("x"))[:-1]  # the root as listings spell it (see FsspecStore.list)
    view = f"{root}{folder}/" if folder else root
    below = f"{view}{prefix}/"
    out = []
    for path, info in found.items():
        p = strip(path)
        if info.get("type", "file") == "file" and p.startswith(below):
            size = info.get("size")
            out.append(Listed(p[len(view) :], int(size) if size is not None else None,
                               _mtime_of(info)))  # fmt: skip
    return out


def _mtime_of(info: dict[str, Any]) -> float | None:
    for name in ("mtime", "updated", "LastModified", "last_modified", "created", "timeCreated"):
        value = info.get(name)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return parse_time(value)
            except ValueError:
                continue
    return None


def sync_folders(store: ObjectStore, keys: list[str]) -> None:
    """Make deletions on a local disk durable (an object store's delete already is)."""
    base, folder = _unwrap(store)
    if not isinstance(base, LocalStore) or not keys:
        return
    for path in sorted({os.path.dirname(_local_path(base, folder, k)) for k in keys}):
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def delete_temp_file(store: ObjectStore, key: str) -> int:
    """Remove a leftover temp file (local disk only); returns 1 if one was removed."""
    base, folder = _unwrap(store)
    if not isinstance(base, LocalStore):
        return 0
    try:
        os.unlink(_local_path(base, folder, key))
    except FileNotFoundError:
        return 0
    return 1
