"""The local index's storage layer: LMDB environments and the entries in them.

One LMDB environment per repository and machine, kept open per process
(reopened after fork, closed when unused, deleted and recreated when damaged,
never on a network filesystem), holding chunk locations and manifest
summaries, each value sealed with a short blake3 check. :class:`RepoIndex` is
one process's handle on one repository's index; :func:`open_index` checks the
store's gc epoch before chunk entries may be used. The callers' API is
:mod:`casnap.index`; docs/index.md has the protocol.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import struct
import threading
import weakref
from collections.abc import Iterable, Sequence
from pathlib import Path

import blake3
import lmdb

from casnap.errors import ObjectNotFoundError, StoreError
from casnap.format.codec import HEADER_SIZE, MAX_CHUNK_SIZE
from casnap.format.entries import ChunkRef
from casnap.format.manifest_bytes import trusted_chunk_ref
from casnap.format.names import check_hash
from casnap.format.parse import MAX_RECORD_BYTES
from casnap.index.lmdb_files import (
    MAX_READERS,
    check_data_file,
    reserve_lock_file,
)
from casnap.index.summaries import ManifestSummary, decode_summary, encode_summary
from casnap.repo.repository import RepoStorage
from casnap.settings import index_enabled, index_map_size, index_root

_log = logging.getLogger("casnap.index")  # the logger users configure (docs/index.md)

INDEX_FORMAT = b"casnap-index-1"
GC_EPOCH_KEY = "gc-epoch"  # below .casnap/; written by gc after a sweep that deleted something

_META_FORMAT = b"format"
_META_CHUNKS_FOR = b"chunks-for"  # store URL + gc epoch the chunk entries were recorded under
_CHECK = 8  # bytes of blake3 that guard every value against a damaged page
_LOOSE = struct.Struct("<QQ")  # raw size, frame length
_PACKED = struct.Struct("<QQQ32s")  # raw size, frame length, offset, pack digest
_SAFE_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def enabled() -> bool:
    """Whether takes and history use the index (``CASNAP_INDEX=0`` turns it off)."""
    return index_enabled()


def index_path(repo_id: str) -> Path:
    """Where the index of repository ``repo_id`` lives on this machine."""
    root = index_root()
    # The id comes from the store's config.json: never let it name another folder.
    safe = repo_id if _SAFE_ID.match(repo_id) else blake3.blake3(repo_id.encode()).hexdigest()
    return root / safe


# -- values ------------------------------------------------------------------


def _seal(key: bytes, body: bytes) -> bytes:
    h = blake3.blake3(key)
    h.update(body)
    return body + h.digest(length=_CHECK)


def _unseal(key: bytes, value: bytes) -> bytes | None:
    body = value[:-_CHECK]
    h = blake3.blake3(key)
    h.update(body)
    return body if len(value) > _CHECK and h.digest(length=_CHECK) == value[-_CHECK:] else None


def _encode_chunk(ref: ChunkRef) -> bytes:
    if ref.pack is None:
        return _LOOSE.pack(ref.size, ref.length)
    return _PACKED.pack(ref.size, ref.length, ref.offset, bytes.fromhex(ref.pack))


def _decode_chunk(h: str, body: bytes) -> ChunkRef:
    """The location sealed under ``h``; ValueError (a miss) when it breaks ChunkRef's rules.

    Built without pydantic's validation (20,000 lookups of a re-take spent
    more in it than in LMDB), so the rules that concern a location are
    checked here: a frame no longer than its header plus the raw bytes, no
    larger chunk than a chunk can be. The hash and pack id are hex of fixed-size keys.
    """
    if len(body) == _LOOSE.size:
        size, length = _LOOSE.unpack(body)
        pack, offset = None, 0
    else:
        size, length, offset, raw_pack = _PACKED.unpack(body)
        pack = raw_pack.hex()
    if size > MAX_CHUNK_SIZE or not HEADER_SIZE <= length <= HEADER_SIZE + size:
        raise ValueError(f"index entry of chunk {h} is not a location")
    return trusted_chunk_ref(h, size, pack, offset, length)


# -- environments ------------------------------------------------------------


class _Env:
    """One open LMDB environment (LMDB allows one per path per process)."""

    def __init__(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        map_size = index_map_size()
        self.path = path
        self.broken = False  # damaged: delete the files and start over
        self.stale = False  # unusable as opened (another process grew the map): reopen
        self.off = False  # this process gave up on it (no space, read-only): never reopened
        self.users: weakref.WeakSet[RepoIndex] = weakref.WeakSet()  # open handles
        reserve_lock_file(path / "lock.mdb")
        # metasync=False: a commit is one fsync, not two. LMDB keeps the database
        # intact; a system crash may undo the last commit, which a cache of "this
        # existed" can afford (a take probes what the index does not say).
        self.env = lmdb.open(
            str(path),
            map_size=map_size,
            max_dbs=4,
            subdir=True,
            lock=True,
            max_readers=MAX_READERS,
            writemap=False,
            readahead=False,
            meminit=False,
            metasync=False,
        )
        try:
            check_data_file(self.env, path / "data.mdb")
            # One write transaction for the databases and the format mark: each
            # commit is an fsync, paid by every rank of a take into a new repository.
            with self.env.begin(write=True) as txn:
                self.meta = self.env.open_db(b"meta", txn=txn)
                self.chunks = self.env.open_db(b"chunks", txn=txn)
                self.manifests = self.env.open_db(b"manifests", txn=txn)
                fmt = txn.get(_META_FORMAT, db=self.meta)
                if fmt != INDEX_FORMAT:  # new, or written by another index version
                    txn.drop(self.chunks, delete=False)
                    txn.drop(self.manifests, delete=False)
                    txn.drop(self.meta, delete=False)
                    txn.put(_META_FORMAT, INDEX_FORMAT, db=self.meta)
        except BaseException:
            self.env.close()
            raise

    @property
    def usable(self) -> bool:
        return not (self.broken or self.stale or self.off)


# The one piece of module-level mutable state in casnap (docs/architecture.md):
# LMDB forbids opening one path twice in a process and using an environment
# across fork(), so open environments must be kept per process, whoever opens
# them, and dropped in a forked child. At most _MAX_OPEN stay open (two file descriptors
# each); the least recently used one no RepoIndex refers to is closed first.
_MAX_OPEN = 16
# Errors that mean the files are damaged (delete and rebuild) rather than
# that this process cannot use them right now.
_DAMAGED = (
    lmdb.InvalidError,
    lmdb.CorruptedError,
    lmdb.PageNotFoundError,
    lmdb.PanicError,
    lmdb.VersionMismatchError,
    lmdb.IncompatibleError,
    lmdb.BadChecksumError,
)
# Errors that pass: reopening the environment is the cure. Any other error
# (no space, read-only, I/O error, no address space) turns the index off for
# this process, with one warning, instead of one per take.
_TRANSIENT = (
    lmdb.MapResizedError,
    lmdb.ReadersFullError,
    lmdb.TlsFullError,
    lmdb.LockError,
    lmdb.BadRslotError,
)
_registry_lock = threading.Lock()
_registry: dict[str, _Env] = {}  # least recently used first
_given_up: dict[str, str] = {}  # index paths this process runs without, and why


def _forget_after_fork() -> None:
    """In a forked child: drop the parent's environments, so this process opens its own.

    py-lmdb refuses to open a path that is open "in this process", which the
    child's copies are, so they are closed. That is safe on Linux: closing
    touches only reader slots of the closing pid (none in the child) and
    releases no lock the parent holds (fcntl locks are not inherited).
    """
    global _registry_lock
    _registry_lock = threading.Lock()  # another thread may have held it at the fork
    envs = list(_registry.values())
    _registry.clear()
    for env in envs:
        try:
            env.env.close()
        except lmdb.Error:
            pass


os.register_at_fork(after_in_child=_forget_after_fork)


# LMDB's locks do not work across machines; on these a shared folder would
# let two hosts write one file unsynchronised.
_REMOTE_FS = (
    "nfs",
    "nfs4",
    "cifs",
    "smb3",
    "smbfs",
    "lustre",
    "gpfs",
    "beegfs",
    "ceph",
    "glusterfs",
    "9p",
    "afs",
    "fuse",
)


def _filesystem_type(path: Path) -> str:
    """The type of the filesystem holding ``path`` (the longest matching mount)."""
    target = os.path.realpath(path)
    best, fstype = "", "unknown"
    try:
        with open("/proc/mounts", encoding="utf-8") as fh:
            for line in fh:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mnt = fields[1]
                inside = target == mnt or target.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best):
                    best, fstype = mnt, fields[2]
    except OSError:
        pass
    return fstype


def _handle(repo_id: str) -> RepoIndex | None:
    """A handle on the index of ``repo_id``, opening (or rebuilding) it if needed."""
    try:
        path = index_path(repo_id)
    except (RuntimeError, OSError) as exc:  # no home directory
        _log.warning("casnap index has no place to live, running without it: %s", exc)
        return None
    key = str(path)
    with _registry_lock:
        if key in _given_up:
            return None  # said once already
        if key not in _registry:
            fstype = _filesystem_type(path.parent)
            if fstype.split(".")[0] in _REMOTE_FS:
                _give_up(
                    key,
                    f"{path.parent} is on {fstype}, where LMDB cannot lock "
                    "(set CASNAP_INDEX_DIR to a local disk)",
                )
                return None
        env = _registry.get(key)
        if env is not None and env.usable:
            _registry[key] = _registry.pop(key)
            return RepoIndex(env, None)  # held before the lock is released
        if env is not None:
            del _registry[key]
            env.env.close()
            if env.broken:
                shutil.rmtree(path, ignore_errors=True)
        for attempt in range(2):
            try:
                env = _Env(path)
            except _DAMAGED as exc:
                if attempt:
                    _give_up(key, f"damaged again after a rebuild: {exc}")
                    return None
                _log.warning("casnap index at %s damaged, rebuilding it: %s", path, exc)
                shutil.rmtree(path, ignore_errors=True)
                continue
            except (lmdb.Error, OSError, ValueError) as exc:  # no space, no memory, no access
                _give_up(key, f"cannot be opened: {exc}")
                return None
            _registry[key] = env
            handle = RepoIndex(env, None)
            _close_unused(keep=_MAX_OPEN)
            return handle
    return None


def _give_up(key: str, why: str) -> None:
    """Run without the index at ``key`` in this process from now on; warn once (locked).

    Its environment, if open, is closed; handles still holding it see it off.
    ``close_all`` or ``drop`` forgets this, so the next use tries again.
    """
    env = _registry.pop(key, None)
    if env is not None:
        env.off = True
        env.env.close()  # py-lmdb invalidates the transactions of other threads, safely
    if key not in _given_up:
        _given_up[key] = why
        _log.warning("casnap index at %s %s; this process runs without it", key, why)


def _close_unused(keep: int) -> None:
    """Close least recently used environments nobody holds until ``keep`` remain (locked)."""
    for key, env in list(_registry.items()):
        if len(_registry) <= keep:
            return
        if not env.users:
            del _registry[key]
            env.env.close()


def _store_identity(repo: RepoStorage) -> str:
    url = repo.url.removeprefix("file://")
    return url if "://" in url else os.path.realpath(url)


def read_epoch_bytes(repo: RepoStorage) -> bytes | None:
    """The store's gc epoch object as bytes (None when no gc ever deleted anything)."""
    try:
        return repo.store.get(GC_EPOCH_KEY, limit=MAX_RECORD_BYTES)
    except ObjectNotFoundError:
        return None


class RepoIndex:
    """The index of one repository, as seen by this process.

    Chunk methods work only on an index opened with the gc epoch checked
    (``open_index(repo)``); summaries work on any.
    """

    def __init__(self, env: _Env, chunks_for: bytes | None) -> None:
        self._env = env
        self._chunks_for = chunks_for
        env.users.add(self)

    @property
    def path(self) -> Path:
        return self._env.path

    def _failed(self, what: str, exc: Exception) -> None:
        """Carry on without the index this time; repair it on the next open."""
        if isinstance(exc, _DAMAGED):
            _log.warning(
                "casnap index at %s failed to %s (%s); it will be rebuilt",
                self._env.path,
                what,
                exc,
            )
            self._env.broken = True
        elif isinstance(exc, _TRANSIENT):
            _log.info(
                "casnap index at %s failed to %s (%s); reopening it", self._env.path, what, exc
            )
            self._env.stale = True
        else:  # no space, read-only, an I/O error: it would fail again, and again say so
            self._env.off = True
            with _registry_lock:
                if _registry.get(str(self._env.path)) is not self._env:
                    return  # already replaced or closed; its successor speaks for itself
                _give_up(str(self._env.path), f"failed to {what} ({exc})")

    def lookup_chunk(self, h: str, size: int) -> ChunkRef | None:
        """Where chunk ``h`` of ``size`` raw bytes is stored, if the index knows it."""
        if self._chunks_for is None or not self._env.usable:
            return None
        key = bytes.fromhex(h)
        try:
            with self._env.env.begin(db=self._env.chunks, buffers=False) as txn:
                value = txn.get(key)
            if value is None:
                return None
            body = _unseal(key, value)
            ref = _decode_chunk(h, body) if body is not None else None
        except lmdb.Error as exc:
            self._failed("read", exc)
            return None
        except (ValueError, struct.error):
            return None  # a damaged entry is a miss, never a location
        return ref if ref is not None and ref.size == size else None

    def lookup_chunks(self, wanted: Sequence[tuple[str, int]]) -> list[ChunkRef | None]:
        """:meth:`lookup_chunk` of each ``(hash, size)``, in one read transaction."""
        out: list[ChunkRef | None] = [None] * len(wanted)
        if self._chunks_for is None or not self._env.usable or not wanted:
            return out
        try:
            with self._env.env.begin(db=self._env.chunks, buffers=False) as txn:
                for i, (h, size) in enumerate(wanted):
                    key = bytes.fromhex(h)
                    value = txn.get(key)
                    if value is None:
                        continue
                    try:
                        body = _unseal(key, value)
                        ref = _decode_chunk(h, body) if body is not None else None
                    except (ValueError, struct.error):
                        continue  # a damaged entry is a miss, never a location
                    if ref is not None and ref.size == size:
                        out[i] = ref
        except lmdb.Error as exc:
            self._failed("read", exc)
            return [None] * len(wanted)
        return out

    def record_chunks(self, refs: Iterable[ChunkRef]) -> int:
        """Record chunks known to exist now; refused if a gc happened since ``open_index``."""
        if self._chunks_for is None or not self._env.usable:
            return 0
        items = list(refs)  # encoded one at a time: no (key, body) pair kept per chunk
        if not items:
            return 0
        e = self._env
        try:
            with e.env.begin(write=True) as txn:
                if txn.get(_META_CHUNKS_FOR, db=e.meta) != self._chunks_for:
                    return 0  # a gc ran since this take looked: these facts may be old
                for r in items:
                    key = bytes.fromhex(r.hash)
                    txn.put(key, _seal(key, _encode_chunk(r)), db=e.chunks)
        except lmdb.MapFullError:
            self._evict()
            return 0
        except lmdb.Error as exc:
            self._failed("record chunks", exc)
            return 0
        return len(items)

    def forget_chunks(self, hashes: Iterable[str]) -> int:
        """Drop the entries of ``hashes`` (a read found their stored copy damaged).

        Works on any handle, epoch checked or not: forgetting is always safe,
        a take then probes or writes the chunk again (docs/damage.md).
        """
        if not self._env.usable:
            return 0
        keys = [bytes.fromhex(h) for h in hashes]
        forgotten = 0
        try:
            with self._env.env.begin(write=True, db=self._env.chunks) as txn:
                for key in keys:
                    forgotten += bool(txn.delete(key))
        except lmdb.Error as exc:
            self._failed("forget chunks", exc)
            return 0
        return forgotten

    def chunk_count(self) -> int:
        if self._chunks_for is None or not self._env.usable:
            return 0
        try:
            with self._env.env.begin() as txn:
                return int(txn.stat(self._env.chunks)["entries"])
        except lmdb.Error as exc:
            self._failed("read", exc)
            return 0

    def summary(self, manifest_hash: str) -> ManifestSummary | None:
        if not self._env.usable:
            return None
        key = bytes.fromhex(check_hash(manifest_hash, "manifest name"))
        try:
            with self._env.env.begin(db=self._env.manifests) as txn:
                value = txn.get(key)
            body = _unseal(key, value) if value is not None else None
            return decode_summary(manifest_hash, body) if body is not None else None
        except lmdb.Error as exc:
            self._failed("read", exc)
        except (ValueError, KeyError, TypeError, struct.error):
            pass  # a damaged entry is a miss
        return None

    def record_summaries(self, summaries: Iterable[ManifestSummary]) -> None:
        if not self._env.usable:
            return
        items = [(bytes.fromhex(s.manifest), encode_summary(s)) for s in summaries]
        try:
            with self._env.env.begin(write=True, db=self._env.manifests) as txn:
                for key, body in items:
                    txn.put(key, _seal(key, body))
        except lmdb.MapFullError:
            self._evict()
        except lmdb.Error as exc:
            self._failed("record summaries", exc)

    def _evict(self) -> None:
        """The map is full: a cache may forget everything (CASNAP_INDEX_MAP_SIZE raises it)."""
        _log.warning("casnap index at %s is full; clearing it", self._env.path)
        e = self._env
        try:
            with e.env.begin(write=True) as txn:
                txn.drop(e.chunks, delete=False)
                txn.drop(e.manifests, delete=False)
        except lmdb.Error as exc:
            self._failed("clear", exc)


def open_index(repo: RepoStorage, *, chunks: bool = True) -> RepoIndex | None:
    """The index of ``repo``, or None when disabled or unusable (never an error).

    With ``chunks=True`` (what a take uses) the store's gc epoch is read first
    (one small get) and chunk entries recorded under another epoch or URL are
    dropped, so chunk lookups only return entries no gc may have invalidated.
    A take must call this inside its gc-exclusion window (docs/index.md).
    """
    if not enabled():
        return None
    index = _handle(repo.config.repo_id)
    if index is None or not chunks:
        return index
    env = index._env
    try:
        epoch = read_epoch_bytes(repo)
    except StoreError:
        return index  # cannot tell what gc did: no chunk facts this time
    marker = b"-" if epoch is None else blake3.blake3(epoch).hexdigest().encode()
    chunks_for = _store_identity(repo).encode() + b"\n" + marker
    try:
        with env.env.begin(db=env.meta) as txn:
            current = txn.get(_META_CHUNKS_FOR)
        if current != chunks_for:
            with env.env.begin(write=True) as txn:
                if txn.get(_META_CHUNKS_FOR, db=env.meta) != chunks_for:
                    txn.drop(env.chunks, delete=False)
                    txn.put(_META_CHUNKS_FOR, chunks_for, db=env.meta)
    except lmdb.Error as exc:
        index._failed("check the gc epoch", exc)
        return None
    index._chunks_for = chunks_for
    return index


def drop(repo_id: str) -> None:
    """Delete the index of repository ``repo_id`` on this machine (it is rebuilt on use)."""
    path = index_path(repo_id)
    with _registry_lock:
        _given_up.pop(str(path), None)
        env = _registry.pop(str(path), None)
        if env is not None:
            env.env.close()
        shutil.rmtree(path, ignore_errors=True)


def close_all() -> None:
    """Close every index this process opened (the next use reopens it)."""
    with _registry_lock:
        envs = list(_registry.values())
        _registry.clear()
        _given_up.clear()
    for env in envs:
        env.env.close()
