"""What a process remembers from one take to the next: one object, owned by whoever takes.

A :class:`Session` holds

- **lineage**: per repository, the manifest the next take descends from (the
  last take or restore through this session);
- **the last plan**: per repository, the manifest this session committed
  last. The next take whose parent it is takes chunk locations and unchanged
  entries from it instead of reading and validating the manifest again
  (docs/pipeline.md, "Plan reuse");
- **the staging pool**: host buffers of async takes, reused by the next async
  take of the same structure instead of page-faulting fresh memory;
- **the plan cache**: every rank's plan structure from the last distributed
  take, so an unchanged structure is not exchanged again
  (:mod:`casnap.distributed.plan_cache`).

Lifetime: the object's. :class:`casnap.Checkpointer` and
:class:`casnap.Repository` each own one, so their successive takes link as
parent and child and reuse plans and buffers; ``Snapshot.take(...,
session=s)`` and ``Snapshot(path, session=s).restore(...)`` use the one they
are given. A take without a session has no lineage: its parent is the newest
snapshot in its folder, read from the store (:mod:`casnap.take.parent`). A
session's first take has no parent unless it restored one: two sessions
never parent each other's takes.

The one process-wide part is :data:`DETACHED_PLANS`: the :class:`Plans` that
takes without a session leave and reuse, for the last two repositories. It
changes no result, only what a take must rebuild: a plan is found only by the
hash of the parent the take chose from the store, and a manifest's hash names
its bytes, so reusing the remembered one is reading that parent back, minus
the parse (torchsnapshot's loop ``Snapshot.take(f"{root}/step_{n}", app)``
in one process then re-takes as fast as through a session; docs/pipeline.md).
An async take's background thread and the caller may use one session at
once, so every part has its own lock.

Example::

    session = casnap.Session()
    for step in range(0, 1000, 100):
        train(...)
        Snapshot.take(f"/ckpt/run1/step_{step}", app_state, session=session)
"""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

from casnap import settings
from casnap.errors import ConfigError, expect_type
from casnap.format.manifest import Dumped, Manifest
from casnap.index import ParentMemo
from casnap.index.summaries import SummaryMemo
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


class LastPlan:
    """Per repository id: the manifest this session committed or restored last, with its hash.

    Only a manifest that was validated (built by this session, or parsed when
    restored) is kept, one per repository; ``repos``: for at most that many
    repositories, the least recently remembered forgotten first.
    """

    def __init__(self, repos: int | None = None) -> None:
        self._lock = threading.Lock()
        self._by_repo: dict[str, tuple[str, Manifest, Dumped | None]] = {}
        self._repos = repos
        self.parent_chunks = ParentMemo()  # the next take's parent is one of these manifests

    def put(
        self, repo_id: str, manifest_hash: str, manifest: Manifest, dumped: Dumped | None = None
    ) -> None:
        """Remember ``manifest`` (``dumped``: with its JSON form, when it was serialized here)."""
        with self._lock:
            self._by_repo.pop(repo_id, None)  # insertion order is recency
            self._by_repo[repo_id] = (manifest_hash, manifest, dumped)
            while self._repos is not None and len(self._by_repo) > self._repos:
                del self._by_repo[next(iter(self._by_repo))]

    def clear(self) -> None:
        with self._lock:
            self._by_repo.clear()

    def get(self, repo_id: str, manifest_hash: str) -> Manifest | None:
        with self._lock:
            hit = self._by_repo.get(repo_id)
        return hit[1] if hit is not None and hit[0] == manifest_hash else None

    def dumped(self, repo_id: str, manifest_hash: str) -> Dumped | None:
        """The remembered manifest with its JSON form, if it was serialized by this session."""
        with self._lock:
            hit = self._by_repo.get(repo_id)
        return hit[2] if hit is not None and hit[0] == manifest_hash else None


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


class Plans:
    """What a take leaves for the next: per repository, the manifest it committed
    (:class:`LastPlan`), and the parts of that manifest's index summary
    (:class:`~casnap.index.summaries.SummaryMemo`)."""

    def __init__(self, repos: int | None = None) -> None:
        self.last_plan = LastPlan(repos)
        self.summaries = SummaryMemo()  # the index summary of the next commit reuses it


# Takes without a session (see the module docstring): two repositories, so that
# two such loops in one process, each into its own repository, keep theirs.
DETACHED_PLANS = Plans(repos=2)


def plans_of(session: Session | None) -> Plans:
    """The plans a take through ``session`` uses: the session's, else the detached ones."""
    return session.plans if session is not None else DETACHED_PLANS


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
        self.plans = Plans()
        self.staging = StagingPool(idle)
        self.plan_cache: KeyedCache[object, object] = KeyedCache()

    @property
    def last_plan(self) -> LastPlan:
        return self.plans.last_plan

    @property
    def summaries(self) -> SummaryMemo:
        return self.plans.summaries

    def __repr__(self) -> str:
        return f"<casnap.Session staging={self.staging!r}>"
