"""Reclaim: delete what only the snapshots retention just retired reached.

Under the gc lock and with no grace period, :func:`reclaim` deletes each
retired manifest no ref or tag names again and each chunk object or pack only
such manifests reference; everything else is left to ``gc``. It never lists
``chunks/`` or ``packs/``. One that cannot get the lock, or whose takes in
flight outlast ``wait_seconds``, deletes nothing and says so
(:attr:`ReclaimResult.deferred`, :attr:`ReclaimResult.pending`).
docs/gc.md, "Reclaim after retention", has the argument.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, fields, replace
from typing import Any

from casnap.display import format_size
from casnap.errors import CasnapError, GcBlockedError, GcBusyError, GcRefusedError
from casnap.gc.collect import GcResult, GcSession
from casnap.gc.plan import Garbage, GcPlan, _Marks, _read_roots
from casnap.index import manifest_summaries
from casnap.repo.damage import list_damage
from casnap.repo.reach import object_refs
from casnap.repo.repository import RepoStorage, chunk_key, manifest_key, now_iso

__all__ = ["RECLAIM_WAIT_SECONDS", "ReclaimResult", "reclaim"]

# How long a reclaim waits for takes in flight before it leaves the garbage to
# the next one: short, because the Checkpointer runs it on the training thread.
RECLAIM_WAIT_SECONDS = 1.0

Span = tuple[str, int, int]  # (object digest, offset, frame length), as in manifest summaries


@dataclass(frozen=True)
class ReclaimResult:
    """What one reclaim did with the manifests it was given, and what it kept and why.

    ``retired`` are the manifests it was asked about. ``deferred`` is why it
    deleted nothing (another gc held the lock, takes stayed in flight, a root
    was unreadable), and then ``pending`` lists the manifests to pass to the
    next reclaim. Kept, by reason: ``still_rooted`` retired manifests a ref or
    tag names again; ``shared_*`` chunk objects and packs a kept snapshot (a
    ref or tag) still uses; ``held_*`` those another manifest still in the
    store uses (a crashed take's, or one gc's grace period keeps);
    ``partial_packs``/``dead_pack_bytes`` the kept packs that hold frames only
    retired manifests used, and those frames' bytes (freed when the pack's
    last user goes). Sizes come from the manifests' frame extents.
    """

    retired: tuple[str, ...]
    deleted_manifests: int = 0
    deleted_chunks: int = 0
    deleted_packs: int = 0
    bytes_freed: int = 0
    still_rooted: int = 0
    shared_objects: int = 0
    shared_bytes: int = 0
    held_objects: int = 0
    held_bytes: int = 0
    partial_packs: int = 0
    dead_pack_bytes: int = 0
    pending: tuple[str, ...] = ()
    deferred: str | None = None
    waited_for_takes: int = 0
    seconds: float = 0.0
    warnings: tuple[str, ...] = ()
    gc: GcResult | None = None  # the sweep that deleted them (its plan lists the keys)

    @property
    def deleted(self) -> int:
        return self.deleted_manifests + self.deleted_chunks + self.deleted_packs

    def render(self) -> str:
        if self.deferred is not None:
            return (
                f"reclaim of {len(self.retired)} retired snapshot(s) deferred, nothing deleted: "
                f"{self.deferred}"
            )
        lines = [
            f"reclaimed {format_size(self.bytes_freed)} of {len(self.retired)} retired "
            f"snapshot(s): {self.deleted_manifests} manifest(s), {self.deleted_chunks} "
            f"chunk(s), {self.deleted_packs} pack(s) in {self.seconds:.2f} s"
        ]
        if self.shared_objects:
            size = format_size(self.shared_bytes)
            lines.append(
                f"  kept {self.shared_objects} object(s) ({size}) that kept snapshots still use"
            )
        if self.partial_packs:
            lines.append(
                f"  of those, {self.partial_packs} pack(s) hold "
                f"{format_size(self.dead_pack_bytes)} of frames only retired snapshots "
                "used, freed with the pack's last user"
            )
        if self.held_objects:
            lines.append(
                f"  kept {self.held_objects} object(s) ({format_size(self.held_bytes)}) "
                "that other unreferenced manifests use (left to gc)"
            )
        if self.still_rooted:
            lines.append(f"  kept {self.still_rooted} manifest(s) a ref or tag names again")
        return "\n".join(lines + [f"  warning: {w}" for w in self.warnings])

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "gc"}
        out.update(
            retired=list(self.retired), pending=list(self.pending), warnings=list(self.warnings)
        )
        return out


def reclaim(
    repo: RepoStorage,
    retired: Iterable[str],
    *,
    wait_seconds: float = RECLAIM_WAIT_SECONDS,
) -> ReclaimResult:
    """Delete the ``retired`` manifests and what only they reference, at once.

    ``retired`` are manifest hashes whose refs the caller has just deleted
    (:attr:`casnap.ops.retention.RetentionResult.retired_manifests`). Another gc
    holding the lock, or takes in flight past ``wait_seconds``, make it delete
    nothing and return ``deferred`` with ``pending`` set; store errors during the
    sweep propagate (the module docstring and docs/gc.md have the rules).

    Example::

        result = reclaim(repo, ["3f2a..."])
        assert result.deferred is None, result.deferred
        print(result.bytes_freed)
    """
    asked = tuple(dict.fromkeys(retired))
    if not asked:
        return ReclaimResult(retired=())
    started = time.monotonic()
    try:
        # Another gc holding the lock will delete unreachable objects anyway, but
        # with its grace period: retry ours at the next reclaim rather than wait.
        with GcSession(repo, wait_seconds=wait_seconds, lock_wait_seconds=0.0) as session:
            plan, kept = _plan(repo, session.lock.id, asked)
            session.lock.check()
            swept = session.execute(plan) if plan.data else None
            waited = session.waited_for_takes
    except (GcBusyError, GcBlockedError, GcRefusedError) as exc:  # nothing was deleted
        return ReclaimResult(
            retired=asked, pending=asked, deferred=str(exc), seconds=time.monotonic() - started
        )
    return replace(
        kept,
        deleted_manifests=len(plan.manifests),
        deleted_chunks=len(plan.chunks),
        deleted_packs=len(plan.packs),
        bytes_freed=plan.bytes_to_free,
        gc=swept,
        waited_for_takes=waited,
        seconds=time.monotonic() - started,
    )


def _plan(
    repo: RepoStorage, session: str, retired: tuple[str, ...]
) -> tuple[GcPlan, ReclaimResult]:
    marks = _Marks()
    _read_roots(repo, marks)  # GcRefusedError if a ref or tag is unreadable
    listed = {}
    for obj in repo.store.list_info("manifests"):
        h = obj.key.rsplit("/", 1)[-1]
        if obj.key == manifest_key(h):
            listed[h] = obj
    warnings: list[str] = []
    still_rooted = sum(1 for m in retired if m in marks.roots and m in listed)
    doomed = [m for m in retired if m in listed and m not in marks.roots]
    # Every manifest that stays must stay whole: roots and all the others.
    roots = [m for m in marks.roots if m in listed]
    warnings += [
        f"{why} names manifest {m}, which is missing"
        for m, why in marks.roots.items()
        if m not in listed
    ]
    try:
        root_spans = _spans(repo, roots, strict=True, warnings=warnings)
    except CasnapError as exc:
        raise GcRefusedError(
            f"reclaim cannot read a manifest a ref or tag names, so it cannot tell which chunks "
            f"are reachable; nothing was deleted (run `casnap verify`): {exc}"
        ) from exc
    # The retired manifests' objects and frames (read whole: a summary does not say
    # which digests are packs and which are loose chunks).
    objects: dict[str, tuple[str, str]] = {}  # key -> (kind, digest)
    spans: set[Span] = set()
    deletable: list[str] = []
    for m in doomed:
        try:
            manifest = repo.read_manifest(m)
        except CasnapError as exc:
            warnings.append(f"retired manifest {m} unreadable, left to gc: {type(exc).__name__}")
            continue
        deletable.append(m)
        for key, ref in object_refs(manifest):
            digest = ref.pack or ref.hash
            objects[key] = ("packs" if ref.pack else "chunks", digest)
            spans.add((digest, ref.offset, ref.length))
    going = set(deletable)
    others = [m for m in listed if m not in marks.roots and m not in going]
    other_spans = _spans(repo, others, strict=False, warnings=warnings)
    shared = {s[0] for s in root_spans}
    held = {s[0] for s in other_spans} - shared
    try:  # a damaged frame's replacement chunks/<h> (`casnap repair`) serves its pack's readers
        damaged = [(c.chunk, c.pack) for c in list_damage(repo) if c.pack]
    except CasnapError as exc:
        raise GcRefusedError(f"reclaim cannot list the damage records: {exc}") from exc
    replacements = {chunk_key(c) for c, p in damaged if p in shared or p in held}
    extent: dict[str, int] = {}
    for digest, offset, length in spans:
        extent[digest] = max(extent.get(digest, 0), offset + length)
    remaining = root_spans | other_spans
    dead_frames: dict[str, int] = {}
    for digest, _offset, length in spans - remaining:
        dead_frames[digest] = dead_frames.get(digest, 0) + length

    garbage: dict[str, list[Garbage]] = {"chunks": [], "packs": []}
    counts = {"shared": [0, 0], "held": [0, 0], "partial": [0, 0]}
    for key, (kind, digest) in sorted(objects.items()):
        size = extent[digest]
        if digest in shared or key in replacements:
            reason = "shared"
        elif digest in held:
            reason = "held"
        else:
            garbage[kind].append(Garbage(key, size))
            continue
        counts[reason][0] += 1
        counts[reason][1] += size
        if kind == "packs" and dead_frames.get(digest):
            counts["partial"][0] += 1
            counts["partial"][1] += dead_frames[digest]
    plan = GcPlan(
        url=repo.url,
        session=session,
        made_at=now_iso(),
        grace_seconds=0.0,
        refs=marks.refs,
        tags=marks.tags,
        reachable_manifests=len(roots),
        reachable_objects=len(shared),
        young_kept=0,
        young_kept_bytes=0,
        manifests=tuple(Garbage(manifest_key(m), listed[m].size) for m in sorted(deletable)),
        chunks=tuple(garbage["chunks"]),
        packs=tuple(garbage["packs"]),
        warnings=tuple(warnings),
    )
    kept = ReclaimResult(
        retired=retired,
        still_rooted=still_rooted,
        shared_objects=counts["shared"][0],
        shared_bytes=counts["shared"][1],
        held_objects=counts["held"][0],
        held_bytes=counts["held"][1],
        partial_packs=counts["partial"][0],
        dead_pack_bytes=counts["partial"][1],
        warnings=tuple(warnings),
    )
    return plan, kept


def _spans(
    repo: RepoStorage, manifests: list[str], *, strict: bool, warnings: list[str]
) -> set[Span]:
    """Every frame ``manifests`` reference, from their summaries (the index caches them).

    ``strict``: an unreadable manifest raises; else it is skipped with a warning,
    as gc does for unreachable manifests it cannot read.
    """
    if strict:
        sums = manifest_summaries(repo, manifests, missing_ok=True)
        return {s for summary in sums.values() for s in summary.spans}
    out: set[Span] = set()
    for m in manifests:
        try:
            sums = manifest_summaries(repo, [m], missing_ok=True)
        except CasnapError as exc:
            warnings.append(f"unreadable unreachable manifest {m} kept: {type(exc).__name__}")
            continue
        out |= {s for summary in sums.values() for s in summary.spans}
    return out
