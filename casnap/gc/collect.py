"""gc: delete the manifests, chunks and packs no ref or tag reaches (docs/gc.md).

This module holds the session (:class:`GcSession`: the gc lock, entered once
no take is in flight, the epoch, the sweep) and the one-call API :func:`gc`;
:mod:`casnap.gc.plan` makes the plan. Unreachable manifests go first, made
durable, then chunks and packs, so "a manifest that exists has all its chunks"
holds even if gc dies halfway. Example::

    print(gc(repo, dry_run=True).plan.render())      # what would go
    with GcSession(repo) as session:                  # plan, look, execute
        plan = session.plan(grace_seconds=0)
        if plan.bytes_to_free > 1 << 30:
            session.execute(plan)
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, fields, replace
from types import TracebackType
from typing import Any

from casnap.display import format_size
from casnap.errors import (
    CasnapError,
    GcRefusedError,
    ManifestValidationError,
    ObjectNotFoundError,
)
from casnap.format.json_text import load_json
from casnap.format.names import hash_bytes
from casnap.format.parse import MAX_RECORD_BYTES
from casnap.gc.plan import (
    LEASE_TEMP_MIN_AGE,
    Garbage,
    GcSweep,
    Progress,
    intersect,
    make_sweep,
)
from casnap.index import GC_EPOCH_KEY
from casnap.repo.damage import clear_damage, list_damage
from casnap.repo.gc_lock import acquire_gc_lock
from casnap.repo.lease_record import LeaseRecord, read_gc_lock, read_record
from casnap.repo.leases import Lease, wait_for_leases
from casnap.repo.repository import RepoStorage, chunk_key, now_iso, pack_key
from casnap.settings import Settings
from casnap.store import ObjectStore

__all__ = [
    "DEFAULT_GRACE_SECONDS",
    "DEFAULT_WAIT_SECONDS",
    "LEASE_TEMP_MIN_AGE",
    "Garbage",
    "GcSweep",
    "GcRefusedError",
    "GcResult",
    "GcSession",
    "Progress",
    "execute_gc",
    "gc",
    "gc_in_progress",
    "sweep_list",
    "read_gc_epoch",
]

DEFAULT_GRACE_SECONDS = 3600.0
DEFAULT_WAIT_SECONDS = 60.0


@dataclass(frozen=True)
class GcResult:
    """What a gc did (``dry_run``: what it would have done)."""

    plan: GcSweep
    dry_run: bool
    deleted_manifests: int = 0
    deleted_chunks: int = 0
    deleted_packs: int = 0
    deleted_leases: int = 0
    deleted_temp_files: int = 0
    bytes_freed: int = 0
    skipped: int = 0  # planned deletions dropped: reachable (or gone) by execution time
    waited_for_takes: int = 0  # takes in flight that gc waited for before marking
    epoch: str | None = None  # the gc epoch afterwards
    seconds: float = 0.0

    @property
    def deleted(self) -> int:
        return self.deleted_manifests + self.deleted_chunks + self.deleted_packs

    def render(self) -> str:
        if self.dry_run:
            return self.plan.render() + "\n(dry run: nothing was deleted)"
        text = (
            f"gc of {self.plan.url}: deleted {self.deleted_manifests} manifest(s), "
            f"{self.deleted_chunks} chunk(s), {self.deleted_packs} pack(s), "
            f"{self.deleted_temp_files} temp file(s), {self.deleted_leases} expired lease(s); "
            f"freed {format_size(self.bytes_freed)} in {self.seconds:.2f} s"
        )
        if self.skipped:
            text += f"; {self.skipped} planned deletion(s) skipped (reachable again or gone)"
        kept = [f"  {self.plan.grace_note()}"] if self.plan.young_kept else []
        return "\n".join([text, *kept] + [f"  warning: {w}" for w in self.plan.warnings])

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "plan"}
        return {**out, "plan": self.plan.to_json()}


# -- the gc epoch ----------------------------------------------------------


def read_gc_epoch(repo: RepoStorage) -> str | None:
    """The repository's gc epoch: it changes whenever a gc may have deleted anything.

    None when no gc ever deleted anything. A cache of "object X exists" built
    while the epoch was ``e`` (and no ``gc.lock`` was present, see docs/gc.md)
    is valid only while the epoch is still ``e``.
    """
    try:
        data = repo.store.get(GC_EPOCH_KEY, limit=MAX_RECORD_BYTES)
    except ObjectNotFoundError:
        return None
    try:
        epoch = load_json(data, GC_EPOCH_KEY)["epoch"]
        if isinstance(epoch, str) and epoch:
            return epoch
    except (ManifestValidationError, TypeError, KeyError):
        pass
    return hash_bytes(data)  # not ours, but it still changes when the object does


def gc_in_progress(repo: RepoStorage) -> bool:
    """Whether a ``gc.lock`` exists (live, or left by a gc that may have died mid-sweep)."""
    return read_gc_lock(repo.store) is not None


def _bump_epoch(repo: RepoStorage, session: str, phase: str) -> str:
    epoch = uuid.uuid4().hex
    body = {"epoch": epoch, "gc": session, "phase": phase, "at": now_iso()}
    repo.store.put(GC_EPOCH_KEY, json.dumps(body, sort_keys=True).encode())  # durable
    return epoch


# -- the session -----------------------------------------------------------


class GcSession:
    """Holds ``gc.lock`` with no take in flight; plan and execute inside it.

    Entering writes the lock (waiting up to ``lock_wait_seconds``, default
    ``wait_seconds``, for another gc, else
    :class:`casnap.errors.GcBusyError`) and then waits up to
    ``wait_seconds`` for the takes in flight to finish (else
    :class:`casnap.errors.GcBlockedError`, having deleted nothing). Takes that
    start meanwhile wait for the session to end (the module docstring has an example).
    """

    def __init__(
        self,
        repo: RepoStorage,
        *,
        wait_seconds: float = DEFAULT_WAIT_SECONDS,
        lock_ttl: float | None = None,
        lock_wait_seconds: float | None = None,
    ) -> None:
        self.repo = repo
        self.wait_seconds = wait_seconds
        self.lock_wait_seconds = wait_seconds if lock_wait_seconds is None else lock_wait_seconds
        self.lock_ttl = lock_ttl
        self.waited_for_takes = 0  # takes in flight when the session began
        self._lock: Lease | None = None

    def __enter__(self) -> GcSession:
        lock = acquire_gc_lock(
            self.repo.store, ttl=self.lock_ttl, wait_seconds=self.lock_wait_seconds
        )
        try:
            self.waited_for_takes = wait_for_leases(self.repo.store, self.wait_seconds)
        except BaseException:
            lock.release()
            raise
        self._lock = lock
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    @property
    def lock(self) -> Lease:
        if self._lock is None:
            raise CasnapError("the gc session is not entered (use `with GcSession(repo) as s:`)")
        return self._lock

    def plan(
        self,
        *,
        grace_seconds: float = DEFAULT_GRACE_SECONDS,
        progress: Progress | None = None,
        retired: Sequence[str] | None = None,
    ) -> GcSweep:
        """Mark from refs and tags; list unreachable objects older than ``grace_seconds``.

        ``retired`` narrows the plan to what those manifests (whose refs the caller
        has just deleted) alone reach, with no grace period (``grace_seconds=0``):
        a reclaim (:mod:`casnap.gc.reclaim`). ``progress(count, total)`` is called
        as the reachable manifests are read.
        """
        lock = self.lock
        plan = make_sweep(self.repo, lock.id, grace_seconds, progress, retired)
        lock.check()
        return plan

    def execute(self, plan: GcSweep, *, progress: Progress | None = None) -> GcResult:
        """Delete what ``plan`` lists: manifests (durably) first, then chunks and packs.

        A plan from another session (a dry run earlier, say) is re-checked: only
        what is still garbage now is deleted (``GcResult.skipped`` counts the
        rest). ``progress(count, total)`` is called as objects are deleted.
        """
        started = time.monotonic()
        lock = self.lock
        skipped = 0
        if plan.session != lock.id:
            fresh = self.plan(grace_seconds=plan.grace_seconds, retired=plan.retired)
            plan, skipped = intersect(plan, fresh)
        store = self.repo.store
        total = len(plan.data) + len(plan.dead_leases) + len(plan.temp_files)
        done = [0]

        def tick() -> None:
            done[0] += 1
            if progress is not None:
                progress(done[0], total)

        epoch = read_gc_epoch(self.repo)
        if plan.data:
            # Before the first deletion: a cache built under the old epoch is stale
            # from now on, even if this gc dies halfway.
            lock.check()
            epoch = _bump_epoch(self.repo, lock.id, "sweeping")
        _delete_all(store, lock, [g.key for g in plan.manifests], tick)
        # The manifests' deletions reach the disk before any chunk's: a crash
        # must never leave a manifest that names a deleted chunk.
        store.flush()
        _delete_all(store, lock, [g.key for g in plan.chunks + plan.packs], tick)
        _forget_damage_of(self.repo, {g.key for g in plan.chunks + plan.packs})
        if plan.data:
            # After the last: a cache filled while this gc was sweeping is stale too.
            epoch = _bump_epoch(self.repo, lock.id, "swept")
        leases = 0
        for key in plan.dead_leases:
            record = _still_dead(store, key)
            if record is not None:
                store.delete(key)
                leases += 1
            tick()
        temps = 0
        for g in plan.temp_files:
            temps += store.delete_temporary(g.key)
            tick()
        return GcResult(
            plan=plan,
            dry_run=False,
            deleted_manifests=len(plan.manifests),
            deleted_chunks=len(plan.chunks),
            deleted_packs=len(plan.packs),
            deleted_leases=leases,
            deleted_temp_files=temps,
            bytes_freed=plan.bytes_to_free,
            skipped=skipped,
            epoch=epoch,
            waited_for_takes=self.waited_for_takes,
            seconds=time.monotonic() - started,
        )


def _delete_all(store: ObjectStore, lock: Lease, keys: list[str], tick: Callable[[], None]) -> None:
    """Delete ``keys`` in parallel, checking the lock before each; stop at the first error."""
    if not keys:
        return

    def one(key: str) -> None:
        lock.check()  # a gc that lost its lock must not delete: takes may be running
        store.delete(key)

    workers = Settings.from_env().io_workers
    with ThreadPoolExecutor(workers, thread_name_prefix="casnap-gc") as pool:
        pending: set[Future[None]] = {pool.submit(one, k) for k in keys}
        while pending:
            finished, pending = wait(pending, return_when=FIRST_EXCEPTION)
            for f in finished:
                exc = f.exception()
                if exc is not None:
                    for p in pending:
                        p.cancel()
                    raise exc
                tick()


def _forget_damage_of(repo: RepoStorage, deleted: set[str]) -> None:
    """Drop the damage records of objects this gc deleted: nothing is left to reference.

    A record is never a root: it keeps nothing alive, and gc leaves alone the
    records of objects that are still there (docs/damage.md).
    """
    if not deleted:
        return
    try:
        records = list_damage(repo)
    except CasnapError:
        return  # a stale record only makes a take write a chunk it needs anyway
    gone = [c for c in records if (pack_key(c.pack) if c.pack else chunk_key(c.chunk)) in deleted]
    clear_damage(repo, gone)


def _still_dead(store: ObjectStore, key: str) -> LeaseRecord | None:
    try:
        record = read_record(store, key)
    except CasnapError:
        return None
    return record if record is not None and not record.is_live() else None


# -- one call --------------------------------------------------------------


def sweep_list(
    repo: RepoStorage,
    *,
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
    wait_seconds: float = DEFAULT_WAIT_SECONDS,
    progress: Progress | None = None,
) -> GcSweep:
    """A plan made under the lock, which is released again (a dry run).

    Pass it to :func:`execute_gc` later: only what is still garbage then goes.
    """
    with GcSession(repo, wait_seconds=wait_seconds) as session:
        return session.plan(grace_seconds=grace_seconds, progress=progress)


def execute_gc(
    repo: RepoStorage,
    plan: GcSweep,
    *,
    wait_seconds: float = DEFAULT_WAIT_SECONDS,
    progress: Progress | None = None,
) -> GcResult:
    """Execute a plan from :func:`sweep_list` under a new lock, re-checked first."""
    with GcSession(repo, wait_seconds=wait_seconds) as session:
        return session.execute(plan, progress=progress)


def gc(
    repo: RepoStorage,
    *,
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
    dry_run: bool = False,
    wait_seconds: float = DEFAULT_WAIT_SECONDS,
    progress: Progress | None = None,
) -> GcResult:
    """Delete every manifest, chunk and pack no ref or tag reaches and older than the grace period.

    ``dry_run`` plans and deletes nothing, and writes nothing either (no lock, no
    epoch): it works with read-only access. ``progress(count, total)`` counts
    objects (manifests read while marking, then objects deleted), each phase
    from 0. Raises :class:`casnap.errors.GcBusyError`
    or :class:`casnap.errors.GcBlockedError` (having deleted nothing) when another
    gc or takes in flight keep it out for longer than ``wait_seconds``.

    Example::

        result = gc(RepoStorage.open("/ckpt/run1"), grace_seconds=0)
        print(result.render())
    """
    started = time.monotonic()
    if dry_run:
        # Read only: no lock, no epoch, no lease. The plan may list objects of a take in
        # flight, which is harmless: it deletes nothing, and a plan from outside a session
        # is re-checked under the lock before anything goes (:meth:`GcSession.execute`).
        plan = make_sweep(repo, f"dry-run-{uuid.uuid4().hex}", grace_seconds, progress)
        return GcResult(
            plan=plan, dry_run=True, epoch=read_gc_epoch(repo), seconds=time.monotonic() - started
        )
    with GcSession(repo, wait_seconds=wait_seconds) as session:
        plan = session.plan(grace_seconds=grace_seconds, progress=progress)
        return replace(session.execute(plan, progress=progress), seconds=time.monotonic() - started)
