"""A local store's deferred file syncs: written now, fsynced and renamed into place later.

A deferred put writes its temp file and starts its writeback; :class:`DeferredFiles`
fsyncs many at once (they share journal commits) and renames each file only once its
fsync succeeded. Why and how: docs/pipeline.md, "Writing chunk files on a local disk".
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TypeVar

from casnap.store.base import Buffer, Deferral

T = TypeVar("T")
# Bytes per write(): on the 2-core VM's kernel (6.18, ext4) writes of 1 to 4 MiB into
# the page cache cost 2-3 times the CPU of 256 KiB writes of the same bytes, and
# varied from run to run by as much (larger page-cache folios to allocate).
WRITE_STEP = 256 << 10
# Files written and not yet synced; past this, a put settles the oldest half.
WINDOW = 64
SYNC_THREADS = 16  # fsyncs at once: concurrent ones share the journal's commits
_SYNC_FILE_RANGE_WRITE = 2  # start writeback of dirty pages, do not wait for it


def _writeback_starter() -> Callable[[int], None]:
    """``start(fd)``: ask the kernel to start writing the file's dirty pages back.

    Only a hint (the fsync in :meth:`DeferredFiles.settle` is what counts):
    where ``sync_file_range`` is missing (not Linux) it does nothing, and its
    errors are ignored."""
    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError, TypeError):
        return lambda fd: None
    call.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    call.restype = ctypes.c_int

    def start(fd: int) -> None:
        call(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)

    return start


start_writeback = _writeback_starter()

_pool_lock = threading.Lock()
_pools: dict[str, tuple[int, ThreadPoolExecutor]] = {}


def _new_pool_lock() -> None:
    """In a forked child: a lock of its own (a parent thread may have held it at the fork)."""
    global _pool_lock
    _pool_lock = threading.Lock()


os.register_at_fork(after_in_child=_new_pool_lock)


def _process_pool(name: str, threads: int) -> ThreadPoolExecutor:
    """The process's pool ``name``, started as needed and kept; a forked child makes its own."""
    with _pool_lock:
        pool = _pools.get(name)
        if pool is None or pool[0] != os.getpid():
            pool = _pools[name] = (os.getpid(), ThreadPoolExecutor(threads, name))
        return pool[1]


def sync_pool() -> ThreadPoolExecutor:
    """The threads for fsyncs (files and folders): a take settles its files in several
    batches, and starting 16 threads for each cost milliseconds on a loaded 2-core machine."""
    return _process_pool("casnap-sync", SYNC_THREADS)


def settler() -> ThreadPoolExecutor:
    """The one thread that settles batches of deferred files (its fsyncs run on
    :func:`sync_pool`'s threads; never on its own, which could wait for itself)."""
    return _process_pool("casnap-settle", 1)


def run_all(
    call: Callable[[T], BaseException | None], items: list[T]
) -> list[BaseException | None]:
    """``call`` of each item, on the sync threads (in this thread for one item)."""
    if len(items) == 1:
        return [call(items[0])]
    return list(sync_pool().map(call, items))


_fsync = os.fsync  # a module global: the tests make it fail


def write_parts(fd: int, parts: list[Buffer]) -> None:
    """Write ``parts`` in order, at most :data:`WRITE_STEP` bytes per ``write``."""
    for part in parts:
        view = memoryview(part).cast("B")
        while view:
            view = view[os.write(fd, view[:WRITE_STEP]) :]


def write_unsynced(tmp: str, parts: list[Buffer]) -> int:
    """Create ``tmp``, write ``parts`` and start its writeback; its open descriptor.
    On an error the file is closed and removed."""
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        write_parts(fd, parts)
        start_writeback(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return fd


def sync_all(sync: Callable[[str], None], folders: list[str]) -> None:
    """``sync`` of every folder, several at once: a take's chunks land in up to 256
    fan-out folders, and each fsync waits for a journal commit that concurrent ones
    share (one at a time, they were a sixth of a 1 GiB first take). The first error
    is raised once every folder was tried."""

    def attempt(folder: str) -> BaseException | None:
        try:
            sync(folder)
        except BaseException as exc:
            return exc
        return None

    errors = [e for e in run_all(attempt, folders) if e is not None] if folders else []
    if errors:
        raise errors[0]


@dataclass(slots=True)
class Unsynced:
    """A temp file written whole, its descriptor still open, waiting for its fsync."""

    fd: int
    tmp: str
    path: str  # where it goes once synced
    create_only: bool  # os.link (an object there already stays), else os.replace
    owner: Deferral | None = None  # told if the file fails


class DeferredFiles:
    """The files a local store's deferred puts wrote and did not sync yet.

    ``add`` queues one; past :data:`WINDOW` files, the oldest half is handed
    to the settling thread (fsyncs on the sync threads, then renames) while
    the writer goes on, and the writer waits only if an earlier batch is still
    being settled. ``settle_all`` waits for every batch handed over, settles
    the rest, and raises the first error of any of them: no file is still
    being synced when a flush (a manifest put) returns. Its callers take
    turns (the store's flush lock): a second caller, whose files the first
    may have taken, returns only once the first's settling is over. Each
    failed file's error also goes to its owner. ``placed(folder)`` is called
    for each folder a rename went into (its entry is durable only once the
    folder is fsynced: the store defers that).
    """

    def __init__(self, placed: Callable[[str], None]) -> None:
        self._placed = placed
        self._files: list[Unsynced] = []
        self._batches: list[Future[None]] = []  # handed to the settling thread
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def _forked(self) -> None:
        """In a forked child (checked before taking ``_lock``, which a parent thread may
        have held at the fork): the files and batches are the parent's, which settles
        them; the child's settling thread does not exist to finish them."""
        if self._pid != os.getpid():
            self._lock = threading.Lock()
            self._files, self._batches = [], []
            self._pid = os.getpid()  # last: another thread of the child checks it first

    def add(self, file: Unsynced) -> None:
        self._forked()
        with self._lock:
            self._files.append(file)
            if len(self._files) <= WINDOW:
                return
            half = len(self._files) // 2
            oldest, self._files = self._files[:half], self._files[half:]
            self._batches.append(settler().submit(self._settle, oldest))
            earlier = self._batches[-2] if len(self._batches) > 1 else None
        if earlier is not None:
            wait([earlier])  # at most two batches out: the writer waits for the settler

    def settle_all(self) -> None:
        self._forked()
        with self._lock:
            files, self._files = self._files, []
            batches, self._batches = self._batches, []
        errors = [b.exception() for b in batches]  # waits for each
        try:
            self._settle(files)
        except BaseException as exc:
            errors.append(exc)
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first

    def _settle(self, files: list[Unsynced]) -> None:
        """fsync every file (several at once), then rename each one whose fsync succeeded.

        A file whose fsync failed is removed, never renamed (after a failed
        fsync its pages may be marked clean without being on disk); the first
        error is raised once every file was tried.
        """
        if not files:
            return
        errors = run_all(_sync, files)
        first: BaseException | None = None
        for file, error in zip(files, errors, strict=True):
            if error is None:
                error = _place(file)
                if error is None:
                    self._placed(os.path.dirname(file.path))
                    continue
            with contextlib.suppress(OSError):
                os.unlink(file.tmp)
            if file.owner is not None:
                file.owner.failed(error)
            first = first or error
        if first is not None:
            raise first


def _sync(file: Unsynced) -> BaseException | None:
    """fsync and close the file; the error, if any (never raised: every file is tried)."""
    try:
        _fsync(file.fd)
    except BaseException as exc:
        return exc
    finally:
        with contextlib.suppress(OSError):
            os.close(file.fd)
    return None


def _place(file: Unsynced) -> OSError | None:
    """Rename the synced file into place; with ``create_only``, an object already there
    stays (deferred puts are of content-addressed keys: it holds the same bytes)."""
    try:
        if file.create_only:
            with contextlib.suppress(FileExistsError):
                os.link(file.tmp, file.path)
        else:
            os.replace(file.tmp, file.path)
    except OSError as exc:
        return exc
    if file.create_only:
        with contextlib.suppress(OSError):
            os.unlink(file.tmp)
    return None
