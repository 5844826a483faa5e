"""The Checkpointer's own snapshots (listing, best) and its retention after a commit.

Split from :mod:`casnap.api.checkpointer`: :class:`Listing` is what the
Checkpointer inherits to list its snapshots (those named by its
``name_format`` for their own step), and :func:`retain_after_commit` is the
retention and reclaim each commit runs (docs/retention.md, "The Checkpointer").
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import replace
from datetime import datetime
from typing import Any, Literal

from casnap.api.checkpointer_mirror import Mirror, is_rank_zero
from casnap.api.checkpointer_resume import pick_best
from casnap.api.snapshot import Snapshot
from casnap.errors import StoreError
from casnap.gc.reclaim import ReclaimResult
from casnap.gc.reclaim import reclaim as reclaim_retired
from casnap.ops.retention import (
    RetentionPolicy,
    RetentionResult,
    RetentionRule,
    SnapshotInfo,
    SummaryCache,
    execute_retention,
    plan_retention,
    read_snapshots,
)
from casnap.repo.repository import RepoStorage
from casnap.take.session import Session

log = logging.getLogger("casnap.checkpointer")


class KeepNames(RetentionRule):
    """Keeps the given snapshots: the checkpointer never retires its newest one."""

    def __init__(self, names: Iterable[str], reason: str) -> None:
        self.names = frozenset(names)
        self.reason = reason

    def select(self, snapshots: Sequence[SnapshotInfo], now: datetime) -> dict[str, str]:
        return {s.name: self.reason for s in snapshots if s.name in self.names}


def retain_after_commit(
    repo: RepoStorage,
    name: str,
    retention: RetentionPolicy,
    mine: set[str],
    mirror: Mirror | None,
    summaries: SummaryCache,
    last: RetentionResult | None,
    reclaim_wait_seconds: float | None,
) -> tuple[RetentionResult, list[str]] | None:
    """Apply ``retention`` to the checkpointer's snapshots ``mine`` after committing ``name``.

    Keeps ``name``, and with a mirror of its own policy what the mirror does
    not hold yet (only rank 0, which runs the copier, knows that: other ranks
    return None, doing nothing). Then reclaims, unless ``reclaim_wait_seconds``
    is None, what the retired snapshots and ``last``'s deferred reclaim reached.
    Returns the result and the names kept for the mirror.
    """
    keep: list[RetentionRule] = [KeepNames([name], "newest checkpoint")]
    owed: list[str] = []
    if mirror is not None and not mirror.same_retention:
        # The mirror keeps its own policy: a snapshot it may keep is not deleted here
        # before it was copied there. Rank 0 runs the copier, so it alone knows that.
        if not is_rank_zero():
            return None
        owed = list(mirror.owed_of(sorted(mine - {name})))
        keep.append(KeepNames(owed, "not yet copied to the mirror"))
        if owed and mirror.failing:
            log.warning(
                "casnap: %d snapshot(s) kept here until the mirror %s has them "
                "(its last copy failed: %s)",
                len(owed),
                mirror.url,
                mirror.last_error,
            )
    policy = RetentionPolicy(*retention.rules, *keep)
    plan = plan_retention(repo, policy, names=mine, cache=summaries)
    result = execute_retention(repo, plan)
    earlier = last.reclaimed if last is not None else None
    retired = (earlier.pending if earlier is not None else ()) + result.retired_manifests
    if reclaim_wait_seconds is not None and retired:
        try:
            freed = reclaim_retired(repo, retired, wait_seconds=reclaim_wait_seconds)
        except (StoreError, OSError) as exc:
            # The snapshot is committed; freeing space is housekeeping, and what
            # a sweep cut short deleted is consistent (manifests before chunks).
            # Try again at the next commit rather than stop the training loop.
            log.warning("casnap: reclaim after retention failed, retried next commit: %s", exc)
            freed = ReclaimResult(retired, pending=retired, deferred=f"failed: {exc}")
        result = replace(result, reclaimed=freed)
    return result, owed


class Listing:
    """The Checkpointer's listing: its snapshots are those ``name_format`` names for their step."""

    name_format: str
    retention: RetentionPolicy | None
    session: Session | None
    _summaries: SummaryCache
    _repo: RepoStorage | None
    _url: str
    _take_options: dict[str, Any]
    _store_options: dict[str, Any]

    def _snapshot(self, repo: RepoStorage, name: str) -> Snapshot:
        return Snapshot(
            f"{repo.url.rstrip('/')}/{name}",
            storage_options={**self._take_options, "repository": repo},
            session=self.session,
        )

    def _open(self) -> RepoStorage | None:
        """The repository, or None while there is none (the first take creates it)."""
        if self._repo is None and RepoStorage.exists_at(self._url, self._store_options):
            self._repo = RepoStorage.open(self._url, self._store_options)
        return self._repo

    def latest(self) -> str | None:
        """The name of this checkpointer's newest committed snapshot, or ``None``."""
        mine = self.snapshot_infos()
        return mine[-1].name if mine else None

    def latest_step(self) -> int | None:
        """The step of this checkpointer's newest committed snapshot, or ``None``."""
        mine = self.snapshot_infos()
        return mine[-1].step if mine else None

    def best(
        self, metric: str | None = None, mode: Literal["min", "max"] | None = None
    ) -> str | None:
        """The name of the best snapshot by ``metric``, or ``None`` if none has a finite value.

        Without ``metric``, the retention's first ``KeepBest`` rule decides the
        metric and mode; ``mode`` defaults to that rule's for its metric, else
        ``"min"``. As in ``KeepBest``: NaN and infinite values are never best,
        ties go to the newer snapshot. Example: ``ckpt.best("accuracy", "max")``.
        """
        info = self._best(metric, mode)
        return info.name if info is not None else None

    def best_step(
        self, metric: str | None = None, mode: Literal["min", "max"] | None = None
    ) -> int | None:
        """The step of :meth:`best` (Orbax's ``best_step()``), or ``None``."""
        info = self._best(metric, mode)
        return info.step if info is not None else None

    def _best(self, metric: str | None, mode: str | None) -> SnapshotInfo | None:
        rules = self.retention.rules if self.retention is not None else ()
        return pick_best(self.snapshot_infos(), rules, metric, mode)

    def snapshots(self) -> list[str]:
        """This checkpointer's committed snapshots, oldest first (by step)."""
        return [s.name for s in self.snapshot_infos()]

    def snapshot_infos(self) -> list[SnapshotInfo]:
        """Like :meth:`snapshots`, with step, metadata and tags."""
        repo = self._open()
        return self._mine(repo) if repo is not None else []

    def _name(self, step: int) -> str:
        return self.name_format.format(step=step)

    def _is_mine(self, info: SnapshotInfo) -> bool:
        return info.step is not None and info.name == self._name(info.step)

    def _mine(self, repo: RepoStorage) -> list[SnapshotInfo]:
        """Snapshots named by this checkpointer's format for their own step, oldest first."""
        infos, _ = read_snapshots(repo, cache=self._summaries)
        return [s for s in infos if self._is_mine(s)]
