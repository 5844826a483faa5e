"""gc's mark phase: what the kept manifests reach, and what a plan may delete (docs/gc.md).

:func:`read_roots` reads every ref and tag; :func:`mark` adds what manifests
need to a :class:`Reach`, read whole from the store (a full gc) or from their
summaries (a reclaim: the local index caches them). A :class:`Scope` is what a
plan may delete: every unreachable object (:func:`unreachable`) or what the
manifests retention retired reference (:func:`retired_scope`).
:func:`sort_scope` splits a scope's objects into kept (and why) and garbage.
:mod:`casnap.gc.plan` puts these together into a :class:`~casnap.gc.plan.GcSweep`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from casnap.errors import CasnapError, GcRefusedError, SnapshotNotFoundError
from casnap.index import manifest_summaries
from casnap.repo.damage import list_damage
from casnap.repo.reach import object_refs
from casnap.repo.repository import RepoStorage
from casnap.repo.tags import list_tags
from casnap.store import ObjectInfo

Progress = Callable[[int, int], None]
# One frame a manifest needs: (object digest, offset, length). The digest is the
# pack's id or, for a loose chunk, its hash, as in manifest summaries.
Span = tuple[str, int, int]

_HASH = re.compile(r"^[0-9a-f]{64}$")


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


# -- marking ---------------------------------------------------------------


@dataclass
class Marks:
    """One plan's roots, damage records and warnings, and how it reads kept manifests."""

    summaries: bool  # from their summaries (a reclaim), else whole from the store (a gc)
    roots: dict[str, str] = field(default_factory=dict)  # manifest -> the root naming it
    refs: int = 0
    tags: int = 0
    # (chunk, pack) of damaged frames: their replacement chunks/<h> (`casnap repair`) is kept
    damaged: set[tuple[str, str]] = field(default_factory=set)
    warnings: list[str] = field(default_factory=list)


@dataclass
class Reach:
    """What a group of kept manifests needs: object digests (a pack's id, a loose chunk's
    hash, a repaired frame's replacement chunk) and, when ``frames`` is a set, the frames."""

    digests: set[str] = field(default_factory=set)
    frames: set[Span] | None = None
    read: int = 0  # manifests read


def read_roots(repo: RepoStorage, marks: Marks) -> None:
    """Every ref and tag, and the damage records; refuses the gc if one cannot be read."""
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
    try:
        marks.damaged = {(c.chunk, c.pack) for c in list_damage(repo) if c.pack}
    except CasnapError as exc:  # a replacement we cannot see would be swept
        raise GcRefusedError(
            f"gc cannot list the damage records of {repo.url}; nothing was deleted: {exc}"
        ) from exc


def _frames_of(repo: RepoStorage, m: str, marks: Marks) -> tuple[Iterable[Span], list[str]]:
    """The frames manifest ``m`` needs, and the replacement chunks its reads fall back to."""
    if marks.summaries:
        spans = manifest_summaries(repo, [m])[m].spans
        # A summary does not say which chunk a pack frame holds: keep the replacements
        # of every damaged frame of a pack it reads from.
        packs = {digest for digest, _, _ in spans}
        return spans, [chunk for chunk, pack in marks.damaged if pack in packs]
    frames: list[Span] = []
    replacements: list[str] = []
    for _key, ref in object_refs(repo.read_manifest(m)):  # the reachability copy uses too
        frames.append((ref.pack or ref.hash, ref.offset, ref.length))
        if ref.pack and (ref.hash, ref.pack) in marks.damaged:
            replacements.append(ref.hash)
    return frames, replacements


def mark(
    repo: RepoStorage,
    manifests: Iterable[str],
    marks: Marks,
    reach: Reach,
    progress: Progress | None = None,
) -> Reach:
    """Add what ``manifests`` need to ``reach``. A root that cannot be read refuses the gc;
    any other manifest that cannot be read is kept, with a warning."""
    todo = sorted(manifests)
    for i, m in enumerate(todo):
        root = marks.roots.get(m)
        try:
            frames, replacements = _frames_of(repo, m, marks)
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
        reach.read += 1
        if reach.frames is not None:
            frames = set(frames)
            reach.frames |= frames
        reach.digests.update(digest for digest, _, _ in frames)
        reach.digests.update(replacements)
        if progress is not None:
            progress(i + 1, len(todo))
    return reach


# -- what is in scope ------------------------------------------------------


@dataclass
class Candidate:
    """A chunk object or pack the plan deletes unless a kept manifest needs it."""

    key: str
    digest: str
    size: int | None
    info: ObjectInfo | None = None  # its listing, for its age (None: no grace period)


@dataclass
class Scope:
    """The manifests the plan deletes and the objects it may delete with them."""

    manifests: list[str] = field(default_factory=list)
    objects: list[Candidate] = field(default_factory=list)
    frames: set[Span] = field(default_factory=set)  # a reclaim's: the deleted manifests' frames
    young: int = 0  # unreachable manifests kept by the grace period
    young_bytes: int = 0


@dataclass
class Ages:
    """Whether a listed object is within the grace period."""

    now: float
    grace_seconds: float
    unknown: int = 0  # objects kept because the store cannot tell their age

    def young(self, obj: ObjectInfo | None) -> bool:
        if obj is None:
            return False
        if self.grace_seconds == 0:
            return obj.mtime is not None and obj.mtime > self.now  # a clock ahead of ours: keep
        if obj.mtime is None:
            self.unknown += 1
            return True
        return self.now - obj.mtime < self.grace_seconds


def listing(repo: RepoStorage, kind: str, marks: Marks) -> dict[str, ObjectInfo]:
    """The objects of ``kind`` by hash; keys of a shape casnap never writes are reported."""
    out: dict[str, ObjectInfo] = {}
    for obj in repo.store.list_info(kind):
        h = _hash_of(obj.key, kind)
        if h is None:
            marks.warnings.append(f"unexpected object {obj.key} left alone")
        else:
            out[h] = obj
    return out


def unreachable(
    repo: RepoStorage, manifests: dict[str, ObjectInfo], marks: Marks, ages: Ages
) -> Scope:
    """A full gc's scope: every object no root names, manifests past the grace period."""
    scope = Scope()
    for kind in ("chunks", "packs"):
        for h, obj in listing(repo, kind, marks).items():
            scope.objects.append(Candidate(obj.key, h, obj.size, obj))
    # Unreachable manifests within the grace period stay, so their chunks stay too.
    for h, obj in manifests.items():
        if h in marks.roots:
            continue
        if ages.young(obj):
            scope.young, scope.young_bytes = scope.young + 1, scope.young_bytes + (obj.size or 0)
        else:
            scope.manifests.append(h)
    return scope


def retired_scope(repo: RepoStorage, doomed: Iterable[str], marks: Marks) -> Scope:
    """A reclaim's scope: the retired manifests no root names and the objects they
    reference, read whole (a summary does not say which digests are packs and which
    loose chunks). One that cannot be read stays, for gc."""
    scope = Scope()
    objects: dict[str, str] = {}  # key -> digest
    for m in doomed:
        try:
            manifest = repo.read_manifest(m)
        except CasnapError as exc:
            marks.warnings.append(
                f"retired manifest {m} unreadable, left to gc: {type(exc).__name__}"
            )
            continue
        scope.manifests.append(m)
        for key, ref in object_refs(manifest):
            objects[key] = ref.pack or ref.hash
            scope.frames.add((objects[key], ref.offset, ref.length))
    extent: dict[str, int] = {}
    for digest, offset, length in scope.frames:
        extent[digest] = max(extent.get(digest, 0), offset + length)
    # Sizes from the frames: exact for a loose chunk, a pack up to its last referenced frame.
    scope.objects = [Candidate(key, d, extent[d]) for key, d in objects.items()]
    return scope


@dataclass(frozen=True)
class Kept:
    """The objects in scope a plan keeps, by why (sizes as :class:`Candidate` has them)."""

    shared: int = 0  # a root reaches it
    shared_bytes: int = 0
    young: int = 0  # young, or a kept manifest no root names needs it
    young_bytes: int = 0
    partial_packs: int = 0  # kept packs holding frames only the deleted manifests used
    dead_pack_bytes: int = 0  # those frames' bytes (when the reaches have frames)


def sort_scope(scope: Scope, roots: Reach, held: Reach, ages: Ages) -> tuple[Kept, list[Garbage]]:
    """Split ``scope``'s objects into those kept and the garbage, by key."""
    dead: dict[str, int] = {}  # per object, bytes of frames only the deleted manifests used
    if roots.frames is not None and held.frames is not None:
        for digest, _offset, length in scope.frames - roots.frames - held.frames:
            dead[digest] = dead.get(digest, 0) + length
    counts = {"shared": [0, 0], "young": [scope.young, scope.young_bytes], "partial": [0, 0]}
    garbage: list[Garbage] = []
    for c in sorted(scope.objects, key=lambda c: c.key):
        if c.digest in roots.digests:
            why = "shared"
        elif c.digest in held.digests or ages.young(c.info):  # a kept manifest needs it
            why = "young"
        else:
            garbage.append(Garbage(c.key, c.size))
            continue
        counts[why][0] += 1
        counts[why][1] += c.size or 0
        if c.key.startswith("packs/") and dead.get(c.digest):
            counts["partial"][0] += 1
            counts["partial"][1] += dead[c.digest]
    kept = Kept(*counts["shared"], *counts["young"], *counts["partial"])
    return kept, garbage
