"""A local directory as an object store: temp file, fsync, rename."""

from __future__ import annotations

import contextlib
import errno
import os
import uuid
from collections.abc import Iterator

from casnap.errors import ObjectExistsError, ObjectNotFoundError, StoreError
from casnap.store.base import Capabilities, Data, ObjectStore, as_parts, check_key

_TMP_MARK = ".tmp-"


class LocalStore(ObjectStore):
    """Objects are files below ``root``; every put is durable before it returns.

    A put writes ``<key>.tmp-<random>``, fsyncs it, then renames it into place
    (``os.link`` for create-only, which fails atomically if the key exists) and
    fsyncs the directory, so a crash leaves either the old state or the whole
    object, plus at most a temp file that ``list`` ignores.
    """

    capabilities = Capabilities(atomic_create=True, local=True)

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(os.path.expanduser(root))
        self.url = self.root

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *check_key(key).split("/"))

    def get(self, key: str) -> bytes:
        try:
            with open(self._path(key), "rb") as fh:
                return fh.read()
        except OSError as exc:
            raise _translate(exc, key) from exc

    def get_range(self, key: str, start: int, end: int) -> bytes:
        if start < 0 or end < start:
            raise ValueError(f"bad range [{start}, {end}) for {key}")
        try:
            with open(self._path(key), "rb") as fh:
                fh.seek(start)
                return fh.read(end - start)
        except OSError as exc:
            raise _translate(exc, key) from exc

    def put(self, key: str, data: Data, *, create_only: bool = False) -> None:
        path = self._path(key)
        folder = os.path.dirname(path)
        tmp = f"{path}{_TMP_MARK}{uuid.uuid4().hex}"
        try:
            os.makedirs(folder, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                for part in as_parts(data):
                    view = memoryview(part).cast("B")
                    while view:
                        written = os.write(fd, view)
                        view = view[written:]
                os.fsync(fd)
            finally:
                os.close(fd)
            if create_only:
                try:
                    os.link(tmp, path)
                finally:
                    os.unlink(tmp)
            else:
                os.replace(tmp, path)
            _fsync_dir(folder)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise _translate(exc, key) from exc

    def exists(self, key: str) -> bool:
        return os.path.isfile(self._path(key))

    def list(self, prefix: str = "") -> Iterator[str]:
        base = self._path(prefix) if prefix else self.root
        if not os.path.isdir(base):
            return
        for folder, _dirs, files in os.walk(base):
            rel = os.path.relpath(folder, self.root)
            for name in files:
                if _TMP_MARK in name:
                    continue
                yield name if rel == "." else f"{rel.replace(os.sep, '/')}/{name}"

    def delete(self, key: str) -> None:
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            return
        except OSError as exc:
            raise _translate(exc, key) from exc


def _fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _translate(exc: OSError, key: str) -> StoreError:
    if isinstance(exc, FileNotFoundError):
        return ObjectNotFoundError(f"object {key!r} not found", key)
    if isinstance(exc, FileExistsError):
        return ObjectExistsError(f"object {key!r} already exists", key)
    if exc.errno == errno.ENOSPC:
        return StoreError(f"no space left on device while writing {key!r}", key)
    return StoreError(f"{exc.strerror or exc} ({key!r})", key)
