"""What a process remembers from one take to the next: one object, owned by whoever takes.

A :class:`Session` holds

- **lineage**: per repository, the manifest the next take descends from (the
  last take or restore through this session), the second step of the parent
  rule (:mod:`casnap.take.parent`);
- **the staging pool**: host buffers of async takes, reused by the next async
  take of the same structure instead of page-faulting fresh memory (takes
  without a session share one pool per process instead, :data:`SHARED_STAGING`);
- **the plan cache**: every rank's plan structure from the last distributed
  take, so an unchanged structure is not exchanged again
  (:mod:`casnap.distributed.plan_cache`).

Lifetime: the object's. :class:`casnap.Checkpointer` and
:class:`casnap.Repository` each own one, so their successive takes link as
parent and child and reuse buffers; ``Snapshot.take(..., session=s)`` and
``Snapshot(path, session=s).restore(...)`` use the one they are given. A
take without a session has no lineage: its parent is the newest snapshot in
its folder, read from the store (:mod:`casnap.take.parent`). A session's
first take has no parent unless it restored one: two sessions never parent
each other's takes. What a take reuses from its parent (entries, their
JSON, chunk locations, summary parts) is not the session's: it is cached
per parent manifest hash for every take alike (:mod:`casnap.take.reuse`).
An async take's background thread and the caller may use one session at
once, so every part has its own lock.

Example::

    session = casnap.Session()
    for step in range(0, 1000, 100):
        train(...)
        Snapshot.take(f"/ckpt/run1/step_{step}", app_state, session=session)
"""

from __future__ import annotations

import os
import threading
from typing import Generic, TypeVar

from casnap import settings
from casnap.errors import ConfigError, expect_type
from casnap.torch_io.staging import StagingPool

K = TypeVar("K")
V = TypeVar("V")


class Lineage:
    """Per repository id: the manifest the next take descends from."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[str, str] = {}

    def parent(self, repo_id: str) -> str | None:
        with self._lock:
            return self._last.get(repo_id)

    def record(self, repo_id: str, manifest: str) -> None:
        with self._lock:
            self._last[repo_id] = manifest


class KeyedCache(Generic[K, V]):
    """A locked mapping, plus what the last use reported (``last``, for tests and benchmarks)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[K, V] = {}
        self.last: object = None

    def get(self, key: K) -> V | None:
        with self._lock:
            return self._entries.get(key)

    def put(self, key: K, value: V) -> None:
        with self._lock:
            self._entries[key] = value


class Session:
    """The state successive takes and restores share (see the module docstring).

    ``staging_cache_bytes`` bounds the idle staging buffers kept for the next
    async take (default ``CASNAP_STAGING_CACHE``, else the memory budget).
    """

    def __init__(self, *, staging_cache_bytes: int | None = None) -> None:
        idle = staging_cache_bytes
        if idle is not None:
            expect_type(idle, int, "staging_cache_bytes", "a number of bytes (int) or None")
            if idle < 0:
                raise ConfigError(
                    f"staging_cache_bytes must not be negative, got {idle}", "staging_cache_bytes"
                )
        if idle is None:
            idle = settings.staging_cache_bytes()
        self.lineage = Lineage()
        self.staging = StagingPool(idle)
        self.plan_cache: KeyedCache[object, object] = KeyedCache()

    def __repr__(self) -> str:
        return f"<casnap.Session staging={self.staging!r}>"


class SharedStaging:
    """The staging pool of every take without a session: one per process, made on first use.

    A torchsnapshot loop (``Snapshot.async_take(f"{root}/step_{n}", state)``
    every N steps) would otherwise stage each take into fresh buffers and
    page-fault the whole state every time. These takes share this pool as a
    session's takes share its own: a take's buffers go back only once its
    background write is done with them (:meth:`casnap.take.job.TakeJob.run`),
    and the buffers of one take still writing count against the next one's
    staging share. Idle buffers kept: ``CASNAP_STAGING_CACHE``, read at every
    take (unset: the memory budget; 0 keeps none). A forked child starts with
    none: the buffers its parent's writes hold would never come back there.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: StagingPool | None = None

    def pool(self) -> StagingPool:
        """The pool, its idle buffers cut to the setting's bound now."""
        idle = settings.staging_cache_bytes()
        with self._lock:
            if self._pool is None:
                self._pool = StagingPool(idle)
            pool = self._pool
        pool.limit_idle(idle)
        return pool

    def clear(self) -> None:
        """Forget the pool and its idle buffers (as a new process would start)."""
        with self._lock:
            self._pool = None

    def _forked(self) -> None:
        self._lock = threading.Lock()  # a parent's thread may have held it at the fork
        self._pool = None


SHARED_STAGING = SharedStaging()
os.register_at_fork(after_in_child=SHARED_STAGING._forked)


def staging_of(session: Session | None) -> StagingPool:
    """The pool a take stages into: its session's, else the process's (:data:`SHARED_STAGING`)."""
    return session.staging if session is not None else SHARED_STAGING.pool()
