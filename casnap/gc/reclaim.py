"""Reclaim: delete what only the snapshots retention just retired reached.

A reclaim is a gc whose plan is narrowed to the retired manifests
(:meth:`casnap.gc.collect.GcSession.plan` with ``retired``): under the gc lock
and with no grace period it deletes each retired manifest no ref or tag names
again and each chunk object or pack only such manifests reference; everything
else is left to ``gc``. This module adds what a caller on the training thread
needs: it takes the lock only if no other gc holds it, waits briefly for takes
in flight, and otherwise deletes nothing and says so
(:attr:`ReclaimResult.deferred`, :attr:`ReclaimResult.pending`).
docs/gc.md, "Reclaim after retention", has the argument.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any

from casnap.display import format_size
from casnap.errors import GcBlockedError, GcBusyError, GcRefusedError
from casnap.gc.collect import GcResult, GcSession
from casnap.repo.repository import RepoStorage

__all__ = ["RECLAIM_WAIT_SECONDS", "ReclaimResult", "reclaim"]

# How long a reclaim waits for takes in flight before it leaves the garbage to
# the next one: short, because the Checkpointer runs it on the training thread.
RECLAIM_WAIT_SECONDS = 1.0


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
            plan = session.plan(grace_seconds=0, retired=asked)
            swept = session.execute(plan) if plan.data else None
            waited = session.waited_for_takes
    except (GcBusyError, GcBlockedError, GcRefusedError) as exc:  # nothing was deleted
        return ReclaimResult(
            retired=asked, pending=asked, deferred=str(exc), seconds=time.monotonic() - started
        )
    return ReclaimResult(
        retired=asked,
        deleted_manifests=len(plan.manifests),
        deleted_chunks=len(plan.chunks),
        deleted_packs=len(plan.packs),
        bytes_freed=plan.bytes_to_free,
        still_rooted=plan.still_rooted,
        shared_objects=plan.shared_kept,
        shared_bytes=plan.shared_kept_bytes,
        held_objects=plan.young_kept,
        held_bytes=plan.young_kept_bytes,
        partial_packs=plan.partial_packs,
        dead_pack_bytes=plan.dead_pack_bytes,
        waited_for_takes=waited,
        seconds=time.monotonic() - started,
        warnings=plan.warnings,
        gc=swept,
    )
