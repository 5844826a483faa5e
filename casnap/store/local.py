"""A local directory as an object store: temp file, fsync, rename."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import stat
import threading
import uuid
from collections.abc import Callable, Iterator

from casnap.errors import (
    InvalidNameError,
    ObjectExistsError,
    ObjectNotFoundError,
    ObjectRefusedError,
    StoreError,
)
from casnap.store.base import (
    Buffer,
    Capabilities,
    Data,
    Deferral,
    ObjectInfo,
    ObjectStore,
    as_parts,
    changed,
    check_key,
    check_limit,
)
from casnap.store.local_errors import (
    NOT_AN_OBJECT,
    refuse_special,
    refused,
    translate,
    walk_error,
)
from casnap.store.local_sync import (
    DeferredFiles,
    Unsynced,
    sync_all,
    write_parts,
    write_unsynced,
)

# "~" is outside the key alphabet (see check_key), so no key can look like a
# temp file and list can skip temp files without hiding a real object.
_TMP_MARK = "~tmp-"
# Opening an object never follows a symbolic link (the last path segment) and
# never blocks: a FIFO opens at once and is then refused by its type.
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
# What opening a symbolic link (O_NOFOLLOW), a socket or a dead device answers.
_REFUSED_OPEN = (errno.ELOOP, errno.ENXIO, errno.ENODEV, errno.EOPNOTSUPP)
_READ_STEP = 1 << 20  # bytes per read() of a limited get
# See _prime.
_FIRST_READ = 4096
_RAMP_FROM = 256 << 10
# A mapping is read-only and is not populated when it is made: the reader's first
# pass (the digest) faults it in, which cost a warm in-place restore of 1 GiB
# 167 ms against 197 ms with MAP_POPULATE and a cold one 0.37-0.40 s against
# 0.58-0.62 s (benchmarks/read_workers.py). Without MAP_SHARED/PROT_READ (Windows)
# no mapping.
_MAP_FLAGS = getattr(mmap, "MAP_SHARED", 0)
# A private (copy-on-write) mapping is not populated: populating a writable private
# mapping copies every page, where only the pages written should be.
_PRIVATE_FLAGS = getattr(mmap, "MAP_PRIVATE", 0)
_WRITABLE = getattr(mmap, "PROT_READ", 0) | getattr(mmap, "PROT_WRITE", 0)
_CAN_MAP = hasattr(mmap, "MAP_SHARED") and hasattr(mmap, "PROT_READ")


class LocalStore(ObjectStore):
    """Objects are files below ``root``; every put is durable before it returns.

    Only regular files are objects. A read opens the key's file without
    following a symbolic link and without blocking, then checks on the open
    descriptor that it is a regular file: a FIFO, a device, a socket or a
    symbolic link at a key raises :class:`ObjectRefusedError` (folders on the
    way may be links, like the repository root itself often is).

    A put writes ``<key>~tmp-<random>``, fsyncs it, then renames it into place
    (``os.link`` for create-only, which fails atomically if the key exists) and
    fsyncs the directory, so a crash leaves either the old state or the whole
    object, plus at most a temp file that ``list`` ignores and
    ``list_temporary`` reports. A non-durable put, and every delete, defers the
    directory fsync to the next durable put or ``flush()``.

    Within :meth:`deferring`, a non-durable put defers the file's fsync and
    rename too, to the next durable put or ``flush()`` (:mod:`.local_sync`).

    ``replace`` holds an exclusive ``flock`` on the key's folder while it
    compares the object with what is expected and renames the new one into
    place: replacers in any process on this machine take turns. (A network
    file system may not share flock between machines; where it refuses the
    lock the replace fails rather than race.)
    """

    capabilities = Capabilities(
        atomic_create=True, local=True, conditional_replace=True, deferred_sync=True
    )

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(os.path.expanduser(root))
        self.url = self.root
        # Folders holding renames not yet fsynced (non-durable puts).
        self._pending_dirs: set[str] = set()
        self._pending_lock = threading.Lock()
        # Flushes take turns: one that finds the queues empty may be behind another
        # still syncing its files (which it took from the queues with its own).
        self._flush_lock = threading.Lock()
        self._pid = os.getpid()
        # Files of deferred puts, not yet synced nor renamed into place (deferring()).
        self._unsynced = DeferredFiles(self._defer)
        self._thread = threading.local()

    def _forked(self) -> None:
        """In a forked child: fresh locks (a parent thread may have held one at the fork)."""
        if self._pid != os.getpid():
            self._pending_lock, self._flush_lock = threading.Lock(), threading.Lock()
            self._pid = os.getpid()  # last: another thread of the child checks it first

    def deferral(self) -> Deferral:
        """A writer's :class:`Deferral` for :meth:`deferring`: its errors come as ``flush``
        raises them (a :class:`StoreError`)."""

        def as_store_error(exc: BaseException) -> BaseException:
            return translate(exc, "", writing=True) if isinstance(exc, OSError) else exc

        return Deferral(as_store_error)

    @contextlib.contextmanager
    def deferring(self, owner: Deferral | None = None) -> Iterator[None]:
        """Within: this thread's non-durable puts defer their file sync and rename to the
        next ``flush()`` or durable put; the object is not visible until then.

        For content-addressed keys only: a create-only put whose key is taken
        by then is dropped (the object there holds the same bytes). ``owner``
        hears of each of these files that fails, whichever flush settles it."""
        before = getattr(self._thread, "deferring", None)
        self._thread.deferring = (owner,)
        try:
            yield
        finally:
            self._thread.deferring = before

    def _defer(self, folder: str) -> None:
        self._forked()
        with self._pending_lock:
            self._pending_dirs.add(folder)

    def flush(self) -> None:
        """Every put and delete made before the call is durable when it returns, whoever
        queued it and whichever flush syncs it: flushes take turns."""
        self._forked()
        with self._flush_lock:
            try:
                self._unsynced.settle_all()  # their renames add folders to _pending_dirs
            except OSError as exc:
                raise translate(exc, "", writing=True) from exc
            with self._pending_lock:
                pending, self._pending_dirs = self._pending_dirs, set()
            try:
                sync_all(fsync_dir, sorted(pending))
            except BaseException as exc:  # also a thread that could not start: retried next
                with self._pending_lock:
                    self._pending_dirs |= pending
                if isinstance(exc, OSError):
                    raise translate(exc, "", writing=True) from exc
                raise

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *check_key(key).split("/"))

    def _open(self, key: str) -> tuple[int, int]:
        """A read-only descriptor of the regular file at ``key``, and its size."""
        path = self._path(key)
        try:
            fd = os.open(path, _OPEN_FLAGS)
        except OSError as exc:
            if exc.errno in _REFUSED_OPEN:
                refuse_special(path, key, exc)
            raise translate(exc, key) from exc
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise ObjectNotFoundError(f"object {key!r} not found", key)  # a folder of keys
            if not stat.S_ISREG(st.st_mode):
                raise refused(key, st.st_mode)
        except OSError as exc:
            os.close(fd)
            if isinstance(exc, StoreError):
                raise
            raise translate(exc, key) from exc
        return fd, st.st_size

    def get(self, key: str, *, limit: int | None = None) -> bytes:
        fd, size = self._open(key)
        try:
            check_limit(key, size, limit)  # before reading a byte
            _prime(fd, size)
            if limit is None:
                with open(fd, "rb", closefd=False) as fh:
                    return fh.read()
            # The size was checked; reading at most limit + 1 bytes also stops
            # a file that grows meanwhile from filling memory.
            parts, total = [], 0
            while total <= limit:
                part = os.read(fd, min(_READ_STEP, limit + 1 - total))
                if not part:
                    break
                parts.append(part)
                total += len(part)
            check_limit(key, total, limit)
            return b"".join(parts)
        except OSError as exc:
            if isinstance(exc, StoreError):
                raise
            raise translate(exc, key) from exc
        finally:
            os.close(fd)

    def read_into(self, key: str, buffers: list[memoryview]) -> int:
        fd, size = self._open(key)
        try:
            _prime(fd, size)
            total, want = 0, sum(len(b) for b in buffers)
            views = list(buffers)
            while total < want:
                n = os.preadv(fd, views, total)
                if n == 0:
                    break  # the file is shorter: the caller's checks report it
                total += n
                views = _advance(views, n)
            return total
        except OSError as exc:
            raise translate(exc, key) from exc
        finally:
            os.close(fd)

    def map(self, key: str, limit: int, *, private: bool = False) -> Buffer | None:
        """The first ``limit`` bytes (at most) of the file at ``key``, mapped read-only
        (``private``: writable, copy on write; see :meth:`ObjectStore.map`).

        The file is opened as by ``get`` (a regular file, never through a link).
        A file that shrank once mapped is not mapped (``None``): reading it would
        raise SIGBUS (docs/pipeline.md, "A failed restore").
        """
        if not _CAN_MAP:
            return None
        fd, size = self._open(key)
        try:
            length = min(size, limit)  # a longer file: its first bytes, as read_into reads them
            if length <= 0:
                return b""  # mmap refuses an empty range; nothing to map
            _prime(fd, length)  # faulting the mapping in is readahead too
            try:
                if private:
                    mapped = mmap.mmap(fd, length, flags=_PRIVATE_FLAGS, prot=_WRITABLE)
                else:
                    mapped = mmap.mmap(fd, length, flags=_MAP_FLAGS, prot=mmap.PROT_READ)
            except (OSError, ValueError):
                return None  # a file system that cannot map: the caller reads instead
            if os.fstat(fd).st_size < length:
                mapped.close()
                return None
            return memoryview(mapped)
        except OSError as exc:
            if isinstance(exc, StoreError):
                raise
            raise translate(exc, key) from exc
        finally:
            os.close(fd)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        if start < 0 or end < start:
            raise ValueError(f"bad range [{start}, {end}) for {key}")
        fd, size = self._open(key)
        try:
            # Never more than the file holds: a range read from a hostile
            # manifest must not allocate what the file does not have.
            want = max(0, min(end, size) - start)
            parts, pos = [], start
            while want > 0:
                part = os.pread(fd, min(want, 1 << 30), pos)
                if not part:
                    break
                parts.append(part)
                pos += len(part)
                want -= len(part)
            return parts[0] if len(parts) == 1 else b"".join(parts)
        except OSError as exc:
            raise translate(exc, key) from exc
        finally:
            os.close(fd)

    def put(self, key: str, data: Data, *, create_only: bool = False, durable: bool = True) -> None:
        path = self._path(key)
        folder = os.path.dirname(path)
        tmp = f"{path}{_TMP_MARK}{uuid.uuid4().hex}"
        deferring = getattr(self._thread, "deferring", None)
        if not durable and deferring is not None:
            self._put_deferred(key, data, path, tmp, create_only, deferring[0])
            return
        if durable:
            # Earlier non-durable objects (chunks) become durable before this one
            # (a manifest, a ref) can even appear: the commit order holds across crashes.
            self.flush()
        try:
            _make_folders(folder, fsync_dir if durable else self._defer)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                write_parts(fd, as_parts(data))
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
            if durable:
                fsync_dir(folder)
            else:
                self._defer(folder)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise translate(exc, key, writing=True) from exc

    def _put_deferred(
        self, key: str, data: Data, path: str, tmp: str, create_only: bool, owner: Deferral | None
    ) -> None:
        """Write the temp file and start its writeback; synced and renamed at ``flush()``."""
        if create_only and os.path.lexists(path):
            raise ObjectExistsError(f"object {key!r} already exists", key)
        try:
            _make_folders(os.path.dirname(path), self._defer)
            fd = write_unsynced(tmp, as_parts(data))
        except OSError as exc:
            raise translate(exc, key, writing=True) from exc
        self._unsynced.add(Unsynced(fd, tmp, path, create_only, owner))

    def replace(self, key: str, data: Data, *, expected: bytes | None) -> None:
        if expected is None:  # create-only is already atomic (os.link)
            try:
                self.put(key, data, create_only=True)
            except ObjectExistsError as exc:
                raise changed(key) from exc
            return
        folder = os.path.dirname(self._path(key))
        try:
            fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except OSError as exc:
            if exc.errno in NOT_AN_OBJECT:
                raise changed(key) from exc  # no folder, no object
            raise translate(exc, key, writing=True) from exc
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # released when fd is closed
            except OSError as exc:
                raise translate(exc, key, writing=True) from exc
            try:
                current: bytes | None = self.get(key, limit=len(expected))
            except (ObjectNotFoundError, ObjectRefusedError):
                current = None  # gone, or larger than expected: either way changed
            if current != expected:
                raise changed(key)
            self.put(key, data)
        finally:
            os.close(fd)

    def exists(self, key: str) -> bool:
        # Not os.path.isfile: it reads every error (EACCES, EIO) as "missing".
        # Anything but a folder occupies the key (a FIFO, a link: lstat, never
        # followed), so that a reader goes on to read it and is told what is wrong.
        try:
            return not stat.S_ISDIR(os.lstat(self._path(key)).st_mode)
        except OSError as exc:
            if exc.errno in NOT_AN_OBJECT:
                return False
            raise translate(exc, key) from exc

    def list(self, prefix: str = "") -> Iterator[str]:
        for key, _path in self._walk(prefix, temporary=False):
            yield key

    def list_info(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return self._infos(prefix, temporary=False)

    def list_temporary(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return self._infos(prefix, temporary=True)

    def _infos(self, prefix: str, *, temporary: bool) -> Iterator[ObjectInfo]:
        for key, path in self._walk(prefix, temporary=temporary):
            try:
                st = os.lstat(path)  # the entry itself: never follow a link out of the root
            except FileNotFoundError:
                continue  # deleted (or renamed into place) while listing
            except OSError as exc:
                raise translate(exc, key) from exc
            yield ObjectInfo(key, st.st_size, st.st_mtime)

    def _walk(self, prefix: str, *, temporary: bool) -> Iterator[tuple[str, str]]:
        """(key, path) of the objects, or of the temp files, below ``prefix``."""
        base = self._path(prefix) if prefix else self.root
        if not os.path.isdir(base):
            return
        # os.walk skips unreadable folders silently; a listing that quietly
        # misses refs would let gc delete what they reference.
        try:
            for folder, _dirs, files in os.walk(base, onerror=walk_error):
                rel = os.path.relpath(folder, self.root)
                for name in files:
                    if (_TMP_MARK in name) != temporary:
                        continue
                    key = name if rel == "." else f"{rel.replace(os.sep, '/')}/{name}"
                    yield key, os.path.join(folder, name)
        except OSError as exc:
            raise translate(exc, prefix) from exc

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            os.unlink(path)
        except OSError as exc:
            if exc.errno in NOT_AN_OBJECT:
                return
            raise translate(exc, key) from exc
        self._defer(os.path.dirname(path))

    def delete_temporary(self, key: str) -> bool:
        # A temp file's name is an object key plus the mark and a random tail:
        # anything else (an object, a path out of the root) is refused.
        stem, mark, tail = key.rpartition(_TMP_MARK)
        if not mark or not tail.isalnum():
            raise InvalidNameError(f"{key!r} is not a temporary object of this store")
        path = self._path(stem) + mark + tail
        try:
            os.unlink(path)
        except OSError as exc:
            if exc.errno in NOT_AN_OBJECT:
                return False
            raise translate(exc, key) from exc
        self._defer(os.path.dirname(path))
        return True


def _make_folders(folder: str, sync: Callable[[str], None]) -> None:
    """``os.makedirs``, calling ``sync`` on each new folder's parent (the entry must survive)."""
    if os.path.isdir(folder):
        return
    _make_folders(os.path.dirname(folder), sync)
    try:
        os.mkdir(folder)
    except FileExistsError:
        return  # a concurrent put made it (and synced its parent)
    sync(os.path.dirname(folder))


def _prime(fd: int, size: int) -> None:
    """Read a large file's first page alone before reading or mapping the file: the rest
    of a cold file then enters the page cache in large folios, not 4 KiB ones, which a
    whole 4 MiB chunk file read or mapped at once got (docs/pipeline.md)."""
    if size > _RAMP_FROM:
        os.pread(fd, _FIRST_READ, 0)


def _advance(views: list[memoryview], n: int) -> list[memoryview]:
    """The buffers still to fill after ``n`` more bytes were read into ``views``."""
    out = []
    for v in views:
        if n >= len(v):
            n -= len(v)
            continue
        out.append(v[n:])
        n = 0
    return out


def fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
