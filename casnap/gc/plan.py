"""gc's plan: mark from the roots, then list what is garbage (docs/gc.md).

Marking reads every ref and tag (the roots) and the manifests they name; a
root that cannot be read refuses the whole gc (:class:`GcRefusedError`). The
plan then lists the unreachable manifests, chunks and packs older than the
grace period, the expired leases of crashed takes and old temp files. A
:class:`GcPlan` is a value: print it, test it, dry-run it. It is made and
executed inside a :class:`casnap.gc.collect.GcSession`, which holds the gc lock.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields, replace
from typing import Any

from casnap.display import format_size
from casnap.errors import (
    CasnapError,
    ConfigError,
    GcRefusedError,
    SnapshotNotFoundError,
    expect_type,
)
from casnap.repo.damage import list_damage
from casnap.repo.lease_record import GC_CLAIMS, GC_LOCK_KEY, LEASES
from casnap.repo.leases import scan_leases
from casnap.repo.reach import object_refs
from casnap.repo.repository import CONFIG_KEY, RepoStorage, chunk_key, now_iso
from casnap.repo.tags import list_tags
from casnap.store import ObjectInfo

# Temp files of unfinished puts. gc runs only once no take holds a lease, and
# takes write chunks, packs, manifests, refs and tags only under one, so a temp
# file there belongs to a dead writer and goes once older than the grace period
# (which protects writers that hold no lease). A lease record is written before
# its take holds anything: its temp file may be a take starting right now.
LEASE_TEMP_MIN_AGE = 600.0

Progress = Callable[[int, int], None]

_HASH = re.compile(r"^[0-9a-f]{64}$")
_SWEPT = ("manifests", "chunks", "packs")


def _may_be_live(temp_key: str) -> bool:
    """Whether a temp file's writer may be alive while gc holds its lock (see above)."""
    stem = temp_key.rpartition("~tmp-")[0]
    return stem.startswith((LEASES + "/", GC_CLAIMS + "/")) or stem in (GC_LOCK_KEY, CONFIG_KEY)


# -- what the plan deletes -------------------------------------------------


@dataclass(frozen=True)
class Garbage:
    """One object the plan deletes; ``size`` is None when the store cannot say."""

    key: str
    size: int | None


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

    def render(self) -> str:
        lines = [
            f"gc plan for {self.url} (grace period {self.grace_seconds:g} s)",
            f"  roots: {self.refs} ref(s), {self.tags} tag(s) -> {self.reachable_manifests} "
            f"manifest(s), {self.reachable_objects} chunk object(s)/pack(s) kept",
            f"  delete: {len(self.manifests)} manifest(s), {len(self.chunks)} chunk(s), "
            f"{len(self.packs)} pack(s), {len(self.temp_files)} temp file(s): "
            f"{format_size(self.bytes_to_free)}",
        ]
        if self.young_kept:
            lines.append("  " + self.grace_note())
        if self.dead_leases:
            lines.append(f"  remove: {len(self.dead_leases)} expired lease(s) of crashed takes")
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)

    def grace_note(self) -> str:
        """What the grace period kept, and how to free it (empty when it kept nothing)."""
        if not self.young_kept:
            return ""
        return (
            f"kept: {self.young_kept} unreachable object(s) ({format_size(self.young_kept_bytes)}) "
            f"younger than the grace period ({self.grace_seconds:g} s) or needed by such a "
            "manifest; a later gc deletes them, or now `casnap gc --grace 0` when every process "
            "writing this repository is a current casnap (takes hold leases; docs/gc.md)"
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in ("manifests", "chunks", "packs", "temp_files"):
            out[name] = [g.key for g in out[name]]
        out.update(dead_leases=list(self.dead_leases), warnings=list(self.warnings))
        return {**out, "bytes_to_free": self.bytes_to_free}


# -- marking ---------------------------------------------------------------


@dataclass
class _Marks:
    roots: dict[str, str] = field(default_factory=dict)  # manifest -> the root naming it
    refs: int = 0
    tags: int = 0
    objects: set[str] = field(default_factory=set)  # chunk/pack keys kept manifests need
    # (chunk, pack) of damaged frames: their replacement chunks/<h> (`casnap repair`) is kept
    damaged_frames: set[tuple[str, str]] = field(default_factory=set)
    warnings: list[str] = field(default_factory=list)


def _read_roots(repo: RepoStorage, marks: _Marks) -> None:
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
    repo: RepoStorage, manifests: Iterable[str], marks: _Marks, progress: Progress | None
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
        for key, ref in object_refs(manifest):  # the reachability copy uses too
            marks.objects.add(key)
            if ref.pack and (ref.hash, ref.pack) in marks.damaged_frames:
                marks.objects.add(chunk_key(ref.hash))  # the replacement reads fall back to
        if progress is not None:
            progress(i + 1, len(todo))
    return read


def make_plan(
    repo: RepoStorage, session: str, grace_seconds: float, progress: Progress | None
) -> GcPlan:
    """The plan of gc session ``session`` (see :meth:`casnap.gc.collect.GcSession.plan`)."""
    expect_type(grace_seconds, (int, float), "grace_seconds", "a number of seconds")
    if not grace_seconds >= 0:
        message = f"grace_seconds must not be negative, got {grace_seconds}"
        raise ConfigError(message, "grace_seconds")
    now = time.time()
    marks = _Marks()
    _read_roots(repo, marks)
    try:
        marks.damaged_frames = {(c.chunk, c.pack) for c in list_damage(repo) if c.pack}
    except CasnapError as exc:  # a replacement we cannot see would be swept
        raise GcRefusedError(
            f"gc cannot list the damage records of {repo.url}; nothing was deleted: {exc}"
        ) from exc
    store = repo.store
    listed = {kind: list(store.list_info(kind)) for kind in _SWEPT}
    temps = list(store.list_temporary())  # every folder and the top (a dead gc's gc-epoch)
    unknown_age = 0

    def young(obj: ObjectInfo) -> bool:
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

    def stale(t: ObjectInfo) -> bool:
        if t.mtime is None:
            return False
        min_age = LEASE_TEMP_MIN_AGE if _may_be_live(t.key) else 0
        return now - t.mtime >= max(grace_seconds, min_age)

    old_temps = [Garbage(t.key, t.size) for t in temps if stale(t)]
    # Expired leases of crashed takes, and expired claims of crashed gcs.
    dead = tuple(k for f in (LEASES, GC_CLAIMS) for k, _ in scan_leases(repo.store, now, f).dead)
    return GcPlan(
        url=repo.url,
        session=session,
        made_at=now_iso(),
        grace_seconds=grace_seconds,
        refs=marks.refs,
        tags=marks.tags,
        reachable_manifests=reachable,
        reachable_objects=len(from_roots),
        young_kept=young_kept,
        young_kept_bytes=young_bytes,
        manifests=tuple(sorted(doomed_manifests, key=lambda g: g.key)),
        chunks=tuple(sorted(doomed["chunks"], key=lambda g: g.key)),
        packs=tuple(sorted(doomed["packs"], key=lambda g: g.key)),
        dead_leases=dead,
        temp_files=tuple(sorted(old_temps, key=lambda g: g.key)),
        warnings=tuple(marks.warnings),
    )


def intersect(old: GcPlan, fresh: GcPlan) -> tuple[GcPlan, int]:
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
