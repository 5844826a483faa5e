"""gc's plan: mark from the roots, then list what is garbage (docs/gc.md).

Marking reads every ref and tag (the roots) and the manifests they name; a
root that cannot be read refuses the whole gc (:class:`GcRefusedError`). What
the plan may delete is its scope:

- a full gc's (``retired=None``): the unreachable manifests, chunks and packs
  older than the grace period, the expired leases of crashed takes and old
  temp files;
- a reclaim's (``retired``: the manifests whose refs retention just deleted):
  those manifests no root names again and the objects only they reference,
  with no grace period. It lists neither ``chunks/`` nor ``packs/`` and reads
  the manifests it keeps from their summaries (the local index caches them).

Either way every manifest the plan keeps is marked, so a manifest that exists
after the sweep is whole. A :class:`GcSweep` is a value: print it, test it,
dry-run it. It is made and executed inside a
:class:`casnap.gc.collect.GcSession`, which holds the gc lock.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from casnap.display import format_size
from casnap.errors import ConfigError, expect_type
from casnap.gc.mark import (
    Ages,
    Garbage,
    Marks,
    Progress,
    Reach,
    listing,
    mark,
    read_roots,
    retired_scope,
    sort_scope,
    unreachable,
)
from casnap.repo.lease_record import GC_CLAIMS, GC_LOCK_KEY, LEASES
from casnap.repo.leases import scan_leases
from casnap.repo.repository import CONFIG_KEY, RepoStorage, now_iso
from casnap.store import ObjectInfo

__all__ = ["LEASE_TEMP_MIN_AGE", "Garbage", "GcSweep", "Progress", "intersect", "make_sweep"]

# Temp files of unfinished puts. gc runs only once no take holds a lease, and
# takes write chunks, packs, manifests, refs and tags only under one, so a temp
# file there belongs to a dead writer and goes once older than the grace period
# (which protects writers that hold no lease). A lease record is written before
# its take holds anything: its temp file may be a take starting right now.
LEASE_TEMP_MIN_AGE = 600.0


def _may_be_live(temp_key: str) -> bool:
    """Whether a temp file's writer may be alive while gc holds its lock (see above)."""
    stem = temp_key.rpartition("~tmp-")[0]
    return stem.startswith((LEASES + "/", GC_CLAIMS + "/")) or stem in (GC_LOCK_KEY, CONFIG_KEY)


# -- the plan --------------------------------------------------------------


@dataclass(frozen=True)
class GcSweep:
    """What one gc would delete (its sweep list), made under the lock of session ``session``.

    Only valid while that session holds the lock; :meth:`GcSession.execute`
    re-plans (in the same scope) and deletes only what is still garbage when
    given an older plan. ``retired`` is a reclaim's scope (None: a full gc).
    """

    url: str
    session: str
    made_at: str
    grace_seconds: float
    refs: int
    tags: int
    reachable_manifests: int
    reachable_objects: int  # chunk objects and packs the roots reach
    # Objects in scope that no root reaches but that the plan keeps: within the grace
    # period, or needed by a kept manifest no root names (young, or out of a reclaim's scope).
    young_kept: int
    young_kept_bytes: int
    manifests: tuple[Garbage, ...] = ()
    chunks: tuple[Garbage, ...] = ()
    packs: tuple[Garbage, ...] = ()
    dead_leases: tuple[str, ...] = ()
    temp_files: tuple[Garbage, ...] = ()
    warnings: tuple[str, ...] = ()
    retired: tuple[str, ...] | None = None
    still_rooted: int = 0  # retired manifests a ref or tag names again
    shared_kept: int = 0  # objects in scope a root reaches
    shared_kept_bytes: int = 0
    # Kept packs holding frames only the deleted manifests used, and those frames' bytes
    # (a reclaim's scope only: a full gc does not read the manifests it deletes).
    partial_packs: int = 0
    dead_pack_bytes: int = 0

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
        if self.retired is None:
            head = f"gc plan for {self.url} (grace period {self.grace_seconds:g} s)"
        else:
            head = f"reclaim plan for {self.url} ({len(self.retired)} retired manifest(s))"
        lines = [
            head,
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
        size = format_size(self.young_kept_bytes)
        if self.retired is not None:
            return (
                f"kept: {self.young_kept} object(s) ({size}) that other unreferenced "
                "manifests use (left to gc)"
            )
        return (
            f"kept: {self.young_kept} unreachable object(s) ({size}) "
            f"younger than the grace period ({self.grace_seconds:g} s) or needed by such a "
            "manifest; a later gc deletes them, or now `casnap gc --grace 0` when every process "
            "writing this repository is a current casnap (takes hold leases; docs/gc.md)"
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in ("manifests", "chunks", "packs", "temp_files"):
            out[name] = [g.key for g in out[name]]
        out.update(dead_leases=list(self.dead_leases), warnings=list(self.warnings))
        if self.retired is not None:
            out["retired"] = list(self.retired)
        return {**out, "bytes_to_free": self.bytes_to_free}


def make_sweep(
    repo: RepoStorage,
    session: str,
    grace_seconds: float,
    progress: Progress | None,
    retired: Sequence[str] | None = None,
) -> GcSweep:
    """The plan of gc session ``session`` (see :meth:`casnap.gc.collect.GcSession.plan`)."""
    expect_type(grace_seconds, (int, float), "grace_seconds", "a number of seconds")
    if not grace_seconds >= 0:
        message = f"grace_seconds must not be negative, got {grace_seconds}"
        raise ConfigError(message, "grace_seconds")
    if retired is not None and grace_seconds != 0:
        message = f"a reclaim has no grace period: pass grace_seconds=0, not {grace_seconds}"
        raise ConfigError(message, "grace_seconds")
    now = time.time()
    asked = None if retired is None else tuple(dict.fromkeys(retired))
    marks = Marks(summaries=asked is not None)
    read_roots(repo, marks)
    manifests = listing(repo, "manifests", marks)
    ages = Ages(now, grace_seconds)
    if asked is None:
        scope = unreachable(repo, manifests, marks, ages)
        temps = _old_temps(repo, now, grace_seconds)
    else:
        doomed = (m for m in asked if m in manifests and m not in marks.roots)
        scope, temps = retired_scope(repo, doomed, marks), ()
    # Every manifest that stays must stay whole: mark the roots', then all the others'.
    for m, root in marks.roots.items():
        if m not in manifests:
            marks.warnings.append(f"{root} names manifest {m}, which is missing")
    present = (m for m in marks.roots if m in manifests)
    counting = asked is not None  # a reclaim reports the dead frames of the packs it keeps
    roots = mark(repo, present, marks, Reach(frames=set() if counting else None), progress)
    going = set(scope.manifests)
    others = (m for m in manifests if m not in going and m not in marks.roots)
    held = mark(repo, others, marks, Reach(frames=set() if counting else None))
    kept, garbage = sort_scope(scope, roots, held, ages)
    if ages.unknown:
        marks.warnings.append(
            f"the store does not report object ages: {ages.unknown} unreachable object(s) "
            "kept; pass grace_seconds=0 to sweep them"
        )
    return GcSweep(
        url=repo.url,
        session=session,
        made_at=now_iso(),
        grace_seconds=grace_seconds,
        refs=marks.refs,
        tags=marks.tags,
        reachable_manifests=roots.read,
        reachable_objects=len(roots.digests),
        young_kept=kept.young,
        young_kept_bytes=kept.young_bytes,
        manifests=tuple(Garbage(manifests[m].key, manifests[m].size) for m in sorted(going)),
        chunks=tuple(g for g in garbage if g.key.startswith("chunks/")),
        packs=tuple(g for g in garbage if g.key.startswith("packs/")),
        dead_leases=_dead_leases(repo, now) if asked is None else (),
        temp_files=temps,
        warnings=tuple(marks.warnings),
        retired=asked,
        still_rooted=sum(m in marks.roots and m in manifests for m in asked or ()),
        shared_kept=kept.shared,
        shared_kept_bytes=kept.shared_bytes,
        partial_packs=kept.partial_packs,
        dead_pack_bytes=kept.dead_pack_bytes,
    )


def _old_temps(repo: RepoStorage, now: float, grace_seconds: float) -> tuple[Garbage, ...]:
    """Temp files of dead writers' puts (a full gc's)."""

    def stale(t: ObjectInfo) -> bool:
        if t.mtime is None:
            return False
        min_age = LEASE_TEMP_MIN_AGE if _may_be_live(t.key) else 0
        return now - t.mtime >= max(grace_seconds, min_age)

    temps = repo.store.list_temporary()  # every folder and the top (a dead gc's gc-epoch)
    return tuple(sorted((Garbage(t.key, t.size) for t in temps if stale(t)), key=lambda g: g.key))


def _dead_leases(repo: RepoStorage, now: float) -> tuple[str, ...]:
    """Expired leases of crashed takes, and expired claims of crashed gcs (a full gc's)."""
    return tuple(k for f in (LEASES, GC_CLAIMS) for k, _ in scan_leases(repo.store, now, f).dead)


def intersect(old: GcSweep, fresh: GcSweep) -> tuple[GcSweep, int]:
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
