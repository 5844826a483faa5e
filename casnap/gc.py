"""gc: delete the manifests, chunks and packs no ref or tag reaches (docs/gc.md).

gc runs as a session holding ``.casnap/gc.lock``, entered only once no take
is in flight (:mod:`casnap.leases`), so nothing decides dedup while gc marks
and sweeps. Inside the session it first *plans* (mark from the roots, list
what is unreachable and older than the grace period) and then *executes*
the plan: unreachable manifests first, made durable, then chunks and packs,
so "a manifest that exists has all its chunks" holds even if gc dies halfway.
The gc epoch (``.casnap/gc-epoch``) is replaced before the first deletion and
after the last, which is how local caches learn that objects may be gone.

Example::

    from casnap.gc import GcSession, gc

    print(gc(repo, dry_run=True).plan.render())      # what would go
    result = gc(repo, grace_seconds=3600)             # sweep

    with GcSession(repo) as session:                  # plan, look, execute
        plan = session.plan(grace_seconds=0)
        if plan.bytes_to_free > 1 << 30:
            session.execute(plan)
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, fields, replace
from datetime import datetime
from types import TracebackType
from typing import Any

from casnap.errors import CasnapError, ObjectNotFoundError, SnapshotNotFoundError
from casnap.index import GC_EPOCH_KEY
from casnap.leases import (
    Lease,
    LeaseRecord,
    acquire_gc_lock,
    parse_time,
    read_gc_lock,
    read_record,
    scan_leases,
    wait_for_leases,
)
from casnap.names import hash_bytes
from casnap.repository import Repository, chunk_key, now_iso, pack_key
from casnap.settings import Settings
from casnap.store import CountingStore, FsspecStore, LocalStore, ObjectStore, PrefixStore
from casnap.store.local import _TMP_MARK
from casnap.tags import list_tags

DEFAULT_GRACE_SECONDS = 3600.0
DEFAULT_WAIT_SECONDS = 60.0
# A temp file of a put is removed only once it is at least this old, whatever
# the grace period: nothing legitimate keeps one open for an hour.
TEMP_MIN_AGE = 3600.0

Progress = Callable[[int, int], None]

_HASH = re.compile(r"^[0-9a-f]{64}$")
_SWEPT = ("manifests", "chunks", "packs")
_SMALL = ("refs", "tags", "leases")


class GcRefusedError(CasnapError, RuntimeError):
    """gc cannot tell what is reachable (a root is unreadable), so it deletes nothing."""


# -- what is in the store --------------------------------------------------


@dataclass(frozen=True)
class Garbage:
    """One object the plan deletes; ``size`` is None when the store cannot say."""

    key: str
    size: int | None


@dataclass(frozen=True)
class _Listed:
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


def _scan(store: ObjectStore, prefix: str) -> tuple[list[_Listed], list[_Listed]]:
    """Objects below ``prefix`` with size and age, and (local only) leftover temp files."""
    base, folder = _unwrap(store)
    if isinstance(base, LocalStore):
        return _scan_local(base, folder, prefix)
    if isinstance(base, FsspecStore):
        return _scan_fsspec(base, folder, prefix), []
    return [_Listed(k, None, None) for k in store.list(prefix)], []


def _scan_local(base: LocalStore, folder: str, prefix: str) -> tuple[list[_Listed], list[_Listed]]:
    view = _local_path(base, folder, "")
    top = os.path.join(view, *prefix.split("/"))
    objects: list[_Listed] = []
    temps: list[_Listed] = []

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
            item = _Listed(f"{rel}/{name}", st.st_size, st.st_mtime)
            (temps if _TMP_MARK in name else objects).append(item)
    return objects, temps


def _scan_fsspec(base: FsspecStore, folder: str, prefix: str) -> list[_Listed]:
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
            out.append(_Listed(p[len(view) :], int(size) if size is not None else None,
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


def _hash_of(key: str, kind: str) -> str | None:
    """The hash an object key of ``kind`` names, or None for a key casnap did not write."""
    parts = key.split("/")
    if len(parts) == 3 and parts[0] == kind and _HASH.match(parts[2]) and parts[2][:2] == parts[1]:
        return parts[2]
    return None


# -- the plan --------------------------------------------------------------


@dataclass(frozen=True)
class GcPlan:
    """What one gc would delete, made under the lock of session ``session``.

    Only valid while that session holds the lock; :meth:`GcSession.execute`
    re-plans and deletes only what is still garbage when given an older plan.
    """

    url: str
    session: str
    made_at: str
    grace_seconds: float
    refs: int
    tags: int
    reachable_manifests: int
    reachable_objects: int  # chunk objects and packs the roots reach
    young_kept: int  # unreachable objects kept because they are within the grace period
    young_kept_bytes: int
    manifests: tuple[Garbage, ...] = ()
    chunks: tuple[Garbage, ...] = ()
    packs: tuple[Garbage, ...] = ()
    dead_leases: tuple[str, ...] = ()
    temp_files: tuple[Garbage, ...] = ()
    warnings: tuple[str, ...] = ()

    @property
    def data(self) -> tuple[Garbage, ...]:
        return self.manifests + self.chunks + self.packs

    @property
    def bytes_to_free(self) -> int:
        return sum(g.size or 0 for g in self.data + self.temp_files)

    @property
    def empty(self) -> bool:
        return not (self.data or self.dead_leases or self.temp_files)

    def render(self, verbose: bool = False) -> str:
        lines = [
            f"gc plan for {self.url} (grace period {self.grace_seconds:g} s)",
            f"  roots: {self.refs} ref(s), {self.tags} tag(s) -> {self.reachable_manifests} "
            f"manifest(s), {self.reachable_objects} chunk object(s)/pack(s) kept",
            f"  delete: {len(self.manifests)} manifest(s), {len(self.chunks)} chunk(s), "
            f"{len(self.packs)} pack(s), {len(self.temp_files)} temp file(s): "
            f"{human_bytes(self.bytes_to_free)}",
        ]
        if self.young_kept:
            lines.append(f"  keep: {self.young_kept} unreachable object(s) younger than the "
                         f"grace period ({human_bytes(self.young_kept_bytes)})")  # fmt: skip
        if self.dead_leases:
            lines.append(f"  remove: {len(self.dead_leases)} expired lease(s) of crashed takes")
        lines += [f"  warning: {w}" for w in self.warnings]
        if verbose:
            lines += [f"  - {g.key}" for g in self.data + self.temp_files]
            lines += [f"  - {k}" for k in self.dead_leases]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in ("manifests", "chunks", "packs", "temp_files"):
            out[name] = [g.key for g in out[name]]
        out.update(dead_leases=list(self.dead_leases), warnings=list(self.warnings))
        return {**out, "bytes_to_free": self.bytes_to_free}


@dataclass(frozen=True)
class GcResult:
    """What a gc did (``dry_run``: what it would have done)."""

    plan: GcPlan
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
            f"freed {human_bytes(self.bytes_freed)} in {self.seconds:.2f} s"
        )
        if self.skipped:
            text += f"; {self.skipped} planned deletion(s) skipped (reachable again or gone)"
        return "\n".join([text] + [f"  warning: {w}" for w in self.plan.warnings])

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "plan"}
        return {**out, "plan": self.plan.to_json()}


def human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


# -- marking ---------------------------------------------------------------


@dataclass
class _Marks:
    roots: dict[str, str] = field(default_factory=dict)  # manifest -> the root naming it
    refs: int = 0
    tags: int = 0
    objects: set[str] = field(default_factory=set)  # chunk/pack keys kept manifests need
    warnings: list[str] = field(default_factory=list)


def _read_roots(repo: Repository, marks: _Marks) -> None:
    try:
        for name in repo.list_snapshots():
            try:
                ref = repo.read_ref(name)
            except SnapshotNotFoundError:
                continue  # deleted while listing (retention may run concurrently)
            marks.refs += 1
            marks.roots.setdefault(ref.manifest, f"snapshot {name!r}")
        for tag, info in list_tags(repo).items():
            marks.tags += 1
            marks.roots.setdefault(info.manifest, f"tag {tag!r}")
    except CasnapError as exc:  # a root we cannot read may protect anything
        raise GcRefusedError(
            f"gc cannot read every ref and tag of {repo.url}; nothing was deleted: {exc}"
        ) from exc


def _mark(
    repo: Repository, manifests: Iterable[str], marks: _Marks, progress: Progress | None
) -> int:
    """Mark the objects of ``manifests``; returns how many of them could be read."""
    todo = sorted(manifests)
    read = 0
    for i, m in enumerate(todo):
        root = marks.roots.get(m)
        try:
            manifest = repo.read_manifest(m)
        except SnapshotNotFoundError:
            if root is not None:
                marks.warnings.append(f"{root} names manifest {m}, which is missing")
            continue
        except CasnapError as exc:
            if root is not None:
                raise GcRefusedError(
                    f"gc cannot read manifest {m} of {root}, so it cannot tell which chunks "
                    f"are reachable; nothing was deleted (run `casnap verify`): {exc}"
                ) from exc
            marks.warnings.append(f"unreadable unreachable manifest {m} kept: {exc}")
            continue
        read += 1
        for ref in manifest.chunk_refs():
            marks.objects.add(pack_key(ref.pack) if ref.pack else chunk_key(ref.hash))
        if progress is not None:
            progress(i + 1, len(todo))
    return read


def _make_plan(
    repo: Repository, session: str, grace_seconds: float, progress: Progress | None
) -> GcPlan:
    if grace_seconds < 0:
        raise ValueError(f"grace_seconds must not be negative, got {grace_seconds}")
    now = time.time()
    marks = _Marks()
    _read_roots(repo, marks)
    listed: dict[str, list[_Listed]] = {}
    temps: list[_Listed] = []
    for kind in _SWEPT:
        listed[kind], t = _scan(repo.store, kind)
        temps += t
    for kind in _SMALL:  # only for leftover temp files (heartbeats write leases often)
        temps += _scan(repo.store, kind)[1]
    unknown_age = 0

    def young(obj: _Listed) -> bool:
        nonlocal unknown_age
        if grace_seconds == 0:
            return obj.mtime is not None and obj.mtime > now  # a clock ahead of ours: keep
        if obj.mtime is None:
            unknown_age += 1
            return True
        return now - obj.mtime < grace_seconds

    # Unreachable manifests within the grace period stay, so their chunks stay too:
    # every manifest that exists after gc must be whole.
    keep: set[str] = set(marks.roots)
    doomed_manifests: list[Garbage] = []
    young_kept = young_bytes = 0
    for obj in listed["manifests"]:
        h = _hash_of(obj.key, "manifests")
        if h is None:
            marks.warnings.append(f"unexpected object {obj.key} left alone")
        elif h in marks.roots:
            continue
        elif young(obj):
            keep.add(h)
            young_kept, young_bytes = young_kept + 1, young_bytes + (obj.size or 0)
        else:
            doomed_manifests.append(Garbage(obj.key, obj.size))
    reachable = _mark(repo, marks.roots, marks, progress)
    from_roots = set(marks.objects)
    _mark(repo, keep - set(marks.roots), marks, None)

    doomed: dict[str, list[Garbage]] = {"chunks": [], "packs": []}
    for kind in ("chunks", "packs"):
        for obj in listed[kind]:
            if _hash_of(obj.key, kind) is None:
                marks.warnings.append(f"unexpected object {obj.key} left alone")
            elif obj.key in from_roots:
                continue
            elif obj.key in marks.objects or young(obj):  # a young manifest needs it, or young
                young_kept, young_bytes = young_kept + 1, young_bytes + (obj.size or 0)
            else:
                doomed[kind].append(Garbage(obj.key, obj.size))
    if unknown_age:
        marks.warnings.append(
            f"the store does not report object ages: {unknown_age} unreachable object(s) "
            "kept; pass grace_seconds=0 to sweep them"
        )
    temp_age = max(grace_seconds, TEMP_MIN_AGE)
    old_temps = [Garbage(t.key, t.size) for t in temps
                 if t.mtime is not None and now - t.mtime >= temp_age]  # fmt: skip
    dead = tuple(k for k, _ in scan_leases(repo.store, now).dead)
    return GcPlan(
        url=repo.url, session=session, made_at=now_iso(), grace_seconds=grace_seconds,
        refs=marks.refs, tags=marks.tags, reachable_manifests=reachable,
        reachable_objects=len(from_roots), young_kept=young_kept, young_kept_bytes=young_bytes,
        manifests=tuple(sorted(doomed_manifests, key=lambda g: g.key)),
        chunks=tuple(sorted(doomed["chunks"], key=lambda g: g.key)),
        packs=tuple(sorted(doomed["packs"], key=lambda g: g.key)),
        dead_leases=dead, temp_files=tuple(sorted(old_temps, key=lambda g: g.key)),
        warnings=tuple(marks.warnings),
    )  # fmt: skip


def _intersect(old: GcPlan, fresh: GcPlan) -> tuple[GcPlan, int]:
    """``old`` restricted to what ``fresh`` (made under the current lock) still deletes."""

    def both(a: tuple[Garbage, ...], b: tuple[Garbage, ...]) -> tuple[Garbage, ...]:
        wanted = {g.key for g in a}
        return tuple(g for g in b if g.key in wanted)

    plan = replace(
        fresh,
        manifests=both(old.manifests, fresh.manifests),
        chunks=both(old.chunks, fresh.chunks),
        packs=both(old.packs, fresh.packs),
        temp_files=both(old.temp_files, fresh.temp_files),
        dead_leases=tuple(k for k in fresh.dead_leases if k in set(old.dead_leases)),
    )
    before = len(old.data) + len(old.temp_files) + len(old.dead_leases)
    after = len(plan.data) + len(plan.temp_files) + len(plan.dead_leases)
    return plan, before - after


# -- the gc epoch ----------------------------------------------------------


def read_gc_epoch(repo: Repository) -> str | None:
    """The repository's gc epoch: it changes whenever a gc may have deleted anything.

    None when no gc ever deleted anything. A cache of "object X exists" built
    while the epoch was ``e`` (and no ``gc.lock`` was present, see docs/gc.md)
    is valid only while the epoch is still ``e``.
    """
    try:
        data = repo.store.get(GC_EPOCH_KEY)
    except ObjectNotFoundError:
        return None
    try:
        epoch = json.loads(data)["epoch"]
        if isinstance(epoch, str) and epoch:
            return epoch
    except (ValueError, TypeError, KeyError):
        pass
    return hash_bytes(data)  # not ours, but it still changes when the object does


def gc_in_progress(repo: Repository) -> bool:
    """Whether a ``gc.lock`` exists (live, or left by a gc that may have died mid-sweep)."""
    return read_gc_lock(repo.store) is not None


def _bump_epoch(repo: Repository, session: str, phase: str) -> str:
    epoch = uuid.uuid4().hex
    body = {"epoch": epoch, "gc": session, "phase": phase, "at": now_iso()}
    repo.store.put(GC_EPOCH_KEY, json.dumps(body, sort_keys=True).encode())  # durable
    return epoch


# -- the session -----------------------------------------------------------


class GcSession:
    """Holds ``gc.lock`` with no take in flight; plan and execute inside it.

    Entering writes the lock (waiting up to ``wait_seconds`` for another gc,
    else :class:`casnap.leases.GcBusyError`) and then waits up to
    ``wait_seconds`` for the takes in flight to finish (else
    :class:`casnap.leases.GcBlockedError`, having deleted nothing). Takes that
    start meanwhile wait for the session to end.

    Example::

        with GcSession(repo, wait_seconds=30) as session:
            plan = session.plan(grace_seconds=3600)
            print(plan.render())
            session.execute(plan)
    """

    def __init__(
        self,
        repo: Repository,
        *,
        wait_seconds: float = DEFAULT_WAIT_SECONDS,
        lock_ttl: float | None = None,
    ) -> None:
        self.repo = repo
        self.wait_seconds = wait_seconds
        self.lock_ttl = lock_ttl
        self.waited_for_takes = 0  # takes in flight when the session began
        self._lock: Lease | None = None

    def __enter__(self) -> GcSession:
        lock = acquire_gc_lock(self.repo.store, ttl=self.lock_ttl, wait_seconds=self.wait_seconds)
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
        self, *, grace_seconds: float = DEFAULT_GRACE_SECONDS, progress: Progress | None = None
    ) -> GcPlan:
        """Mark from refs and tags; list unreachable objects older than ``grace_seconds``.

        ``progress(count, total)`` is called as the reachable manifests are read.
        """
        lock = self.lock
        plan = _make_plan(self.repo, lock.id, grace_seconds, progress)
        lock.check()
        return plan

    def execute(self, plan: GcPlan, *, progress: Progress | None = None) -> GcResult:
        """Delete what ``plan`` lists: manifests (durably) first, then chunks and packs.

        A plan from another session (a dry run earlier, say) is re-checked: only
        what is still garbage now is deleted (``GcResult.skipped`` counts the
        rest). ``progress(count, total)`` is called as objects are deleted.
        """
        started = time.monotonic()
        lock = self.lock
        skipped = 0
        if plan.session != lock.id:
            plan, skipped = _intersect(plan, self.plan(grace_seconds=plan.grace_seconds))
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
        _sync_folders(store, [g.key for g in plan.manifests])
        _delete_all(store, lock, [g.key for g in plan.chunks + plan.packs], tick)
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
            temps += _delete_temp(store, g.key)
            tick()
        return GcResult(
            plan=plan, dry_run=False, deleted_manifests=len(plan.manifests),
            deleted_chunks=len(plan.chunks), deleted_packs=len(plan.packs),
            deleted_leases=leases, deleted_temp_files=temps,
            bytes_freed=plan.bytes_to_free, skipped=skipped, epoch=epoch,
            waited_for_takes=self.waited_for_takes, seconds=time.monotonic() - started,
        )  # fmt: skip


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


def _sync_folders(store: ObjectStore, keys: list[str]) -> None:
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


def _still_dead(store: ObjectStore, key: str) -> LeaseRecord | None:
    try:
        record = read_record(store, key)
    except CasnapError:
        return None
    return record if record is not None and not record.is_live() else None


def _delete_temp(store: ObjectStore, key: str) -> int:
    base, folder = _unwrap(store)
    if not isinstance(base, LocalStore):
        return 0
    try:
        os.unlink(_local_path(base, folder, key))
    except FileNotFoundError:
        return 0
    return 1


# -- one call --------------------------------------------------------------


def plan_gc(
    repo: Repository,
    *,
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
    wait_seconds: float = DEFAULT_WAIT_SECONDS,
    progress: Progress | None = None,
) -> GcPlan:
    """A plan made under the lock, which is released again (a dry run).

    Pass it to :func:`execute_gc` later: only what is still garbage then goes.
    """
    with GcSession(repo, wait_seconds=wait_seconds) as session:
        return session.plan(grace_seconds=grace_seconds, progress=progress)


def execute_gc(
    repo: Repository,
    plan: GcPlan,
    *,
    wait_seconds: float = DEFAULT_WAIT_SECONDS,
    progress: Progress | None = None,
) -> GcResult:
    """Execute a plan from :func:`plan_gc` under a new lock, re-checked first."""
    with GcSession(repo, wait_seconds=wait_seconds) as session:
        return session.execute(plan, progress=progress)


def gc(
    repo: Repository,
    *,
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
    dry_run: bool = False,
    wait_seconds: float = DEFAULT_WAIT_SECONDS,
    progress: Progress | None = None,
) -> GcResult:
    """Delete every manifest, chunk and pack no ref or tag reaches and older than the grace period.

    ``dry_run`` plans and deletes nothing. ``progress(count, total)`` is called
    while marking and again while deleting. Raises :class:`casnap.leases.GcBusyError`
    or :class:`casnap.leases.GcBlockedError` (having deleted nothing) when another
    gc or takes in flight keep it out for longer than ``wait_seconds``.

    Example::

        result = gc(Repository.open("/ckpt/run1"), grace_seconds=0)
        print(result.render())
    """
    started = time.monotonic()
    with GcSession(repo, wait_seconds=wait_seconds) as session:
        plan = session.plan(grace_seconds=grace_seconds, progress=progress)
        if dry_run:
            return GcResult(plan=plan, dry_run=True, epoch=read_gc_epoch(repo),
                            waited_for_takes=session.waited_for_takes,
                            seconds=time.monotonic() - started)  # fmt: skip
        return replace(session.execute(plan, progress=progress),
                       seconds=time.monotonic() - started)  # fmt: skip
