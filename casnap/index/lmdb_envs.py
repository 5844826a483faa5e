"""The LMDB environments this process holds open: one per repository and machine.

The one piece of module-level mutable state in casnap (docs/architecture.md):
LMDB forbids opening one path twice in a process and using an environment
across ``fork()``, so open environments are kept per process, whoever opens
them, dropped in a forked child, closed when unused (at most ``_MAX_OPEN``),
deleted and recreated when damaged, and never opened on a network
filesystem. With them, the index folders this process gave up on (a full or
read-only disk), so that it warns once. What an environment holds is
:mod:`casnap.index.lmdb_store`.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import blake3
import lmdb

from casnap.index.lmdb_files import (
    MAX_READERS,
    check_data_file,
    reserve_lock_file,
)
from casnap.settings import index_map_size, index_root

_log = logging.getLogger("casnap.index")  # the logger users configure (docs/index.md)

INDEX_FORMAT = b"casnap-index-1"
_META_FORMAT = b"format"
_SAFE_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
T = TypeVar("T")


def index_path(repo_id: str) -> Path:
    """Where the index of repository ``repo_id`` lives on this machine."""
    root = index_root()
    # The id comes from the store's config.json: never let it name another folder.
    safe = repo_id if _SAFE_ID.match(repo_id) else blake3.blake3(repo_id.encode()).hexdigest()
    return root / safe


class Env:
    """One open LMDB environment (LMDB allows one per path per process)."""

    def __init__(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        map_size = index_map_size()
        self.path = path
        self.broken = False  # damaged: delete the files and start over
        self.stale = False  # unusable as opened (another process grew the map): reopen
        self.off = False  # this process gave up on it (no space, read-only): never reopened
        self.users: weakref.WeakSet[Any] = weakref.WeakSet()  # open handles
        # Transactions begun and not yet ended, by any thread: read in a forked child,
        # where closing an environment a parent thread was using waits forever.
        self.busy = 0
        self._busy_lock = threading.Lock()
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

    @contextmanager
    def begin(self, **kwargs: Any) -> Iterator[Any]:
        """``self.env.begin(**kwargs)``, counted in :attr:`busy` from before it begins
        until after it ended (every transaction of casnap's goes through here). Typed
        ``Any``: the transaction's types follow ``buffers=``, which py-lmdb's overloads
        of ``begin`` resolve and a forwarding ``**kwargs`` cannot."""
        with self._busy_lock:
            self.busy += 1
        try:
            with self.env.begin(**kwargs) as txn:
                yield txn
        finally:
            with self._busy_lock:
                self.busy -= 1


# The one piece of module-level mutable state in casnap (docs/architecture.md):
# LMDB forbids opening one path twice in a process and using an environment
# across fork(), so open environments must be kept per process, whoever opens
# them, and dropped in a forked child. At most _MAX_OPEN stay open (two file descriptors
# each); the least recently used one no RepoIndex refers to is closed first.
_MAX_OPEN = 16
# Errors that mean the files are damaged (delete and rebuild) rather than
# that this process cannot use them right now.
DAMAGED = (
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
TRANSIENT = (
    lmdb.MapResizedError,
    lmdb.ReadersFullError,
    lmdb.TlsFullError,
    lmdb.LockError,
    lmdb.BadRslotError,
)
_registry_lock = threading.Lock()
_registry: dict[str, Env] = {}  # least recently used first
_given_up: dict[str, str] = {}  # index paths this process runs without, and why


# Environments a forked child inherited and has not settled yet: never closed by the
# after-fork hook, which must not wait (closing one a parent thread was writing in
# waits for that thread, which the child does not have). Dropping one is safe:
# py-lmdb's finaliser leaves an environment of another pid alone.
_inherited: list[Env] = []


def _forget_after_fork() -> None:
    """In a forked child: set the parent's environments aside, so this process opens its own.

    Only rebinds module state: no lock is taken, nothing waits, nothing is
    closed (a DataLoader worker that never uses casnap pays nothing). The
    handles made before the fork see their environment off. The first
    :func:`acquire` in the child settles them (:func:`_settle_inherited`).
    """
    global _registry_lock, _registry, _inherited
    _registry_lock = threading.Lock()  # another thread may have held it at the fork
    _inherited = _inherited + list(_registry.values())
    _registry = {}
    for env in _inherited:
        env.off = True


def _settle_inherited() -> None:
    """Close the inherited environments no parent thread was using at the fork (locked).

    py-lmdb refuses to open files that are open "in this process", which the
    inherited copies are, so the child must close them to open its own. That
    is safe for an idle one (closing touches only reader slots of the closing
    pid, none in the child, and releases no lock the parent holds: fcntl
    locks are not inherited). One a parent thread was inside a transaction of
    at the fork is dropped unclosed: this process runs without that index.
    """
    global _inherited
    envs, _inherited = _inherited, []
    for env in envs:
        if env.busy == 0:
            try:
                env.env.close()
            except lmdb.Error:
                pass
            continue
        key = str(env.path)
        if key not in _given_up:
            _given_up[key] = "was in use by another thread when this process was forked"
            _log.info("casnap index at %s: %s; this process runs without it", key, _given_up[key])


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


def acquire(repo_id: str, hold: Callable[[Env], T]) -> T | None:
    """``hold(env)`` of the environment of ``repo_id``, opened (or rebuilt) if needed; None
    when this process runs without it. ``hold`` runs under the registry's lock, so the
    handle it makes holds the environment before another thread may close it."""
    try:
        path = index_path(repo_id)
    except (RuntimeError, OSError) as exc:  # no home directory
        _log.warning("casnap index has no place to live, running without it: %s", exc)
        return None
    key = str(path)
    with _registry_lock:
        if _inherited:
            _settle_inherited()
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
            return hold(env)  # held before the lock is released
        if env is not None:
            del _registry[key]
            env.env.close()
            if env.broken:
                shutil.rmtree(path, ignore_errors=True)
        for attempt in range(2):
            try:
                env = Env(path)
            except DAMAGED as exc:
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
            handle = hold(env)
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


def failed(env: Env, what: str, exc: Exception) -> None:
    """An operation on ``env`` failed: carry on without the index this time; repair it on
    the next open (damaged, or stale), or never reopen it (no space, read-only)."""
    if isinstance(exc, DAMAGED):
        _log.warning(
            "casnap index at %s failed to %s (%s); it will be rebuilt",
            env.path,
            what,
            exc,
        )
        env.broken = True
    elif isinstance(exc, TRANSIENT):
        _log.info("casnap index at %s failed to %s (%s); reopening it", env.path, what, exc)
        env.stale = True
    else:  # no space, read-only, an I/O error: it would fail again, and again say so
        env.off = True
        with _registry_lock:
            if _registry.get(str(env.path)) is not env:
                return  # already replaced or closed; its successor speaks for itself
            _give_up(str(env.path), f"failed to {what} ({exc})")


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
