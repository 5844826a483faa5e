"""Which snapshot a :class:`~casnap.api.checkpointer.Checkpointer` resumes from, and which
is best: the newest one that restores whole, skipping damage with a logged reason.

A candidate is checked cheaply first (:func:`casnap.ops.verify.check_snapshot`),
then restored. Only damage (:class:`IntegrityError`, a missing manifest) moves
on to an older snapshot, whose restore overwrites what the failed attempt
filled; a store timeout or a key mismatch is raised as it is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime

from casnap.distributed.group import all_gather, resolve_group
from casnap.errors import ConfigError, IntegrityError, SnapshotNotFoundError, expect_type
from casnap.ops.retention import KeepBest, RetentionRule, SnapshotInfo
from casnap.ops.verify import check_snapshot
from casnap.repo.repository import RepoStorage

log = logging.getLogger("casnap.checkpointer")


def try_restore(repo: RepoStorage, name: str, restore: Callable[[str], object]) -> str | None:
    """Check snapshot ``name`` and restore it with ``restore(name)``: ``None`` on success,
    else why it cannot be resumed from. Under a process group every rank calls this for
    the same candidates in the same order; one rank's failure counts for all, so
    every rank moves on to the same older snapshot."""
    report = check_snapshot(repo, name)
    reason = "; ".join(p.detail for p in report.problems) or None
    if reason is None:
        try:
            restore(name)
        except (IntegrityError, SnapshotNotFoundError) as exc:
            reason = f"restore failed ({type(exc).__name__}: {exc})"
    group = resolve_group(None)
    if group.distributed:
        reasons = all_gather(group, reason, "resuming")
        failed = [(rank, r) for rank, r in enumerate(reasons) if r is not None]
        if failed and reason is None:
            reason = f"failed on rank {failed[0][0]}: {failed[0][1]}"
    return reason


def resume(
    candidates: Sequence[SnapshotInfo],
    unreadable: Mapping[str, str],
    attempt: Callable[[str], str | None],
    where: str,
    tensors_of: Callable[[str], set[str]],
) -> SnapshotInfo | None:
    """The newest of ``candidates`` (oldest first) for which ``attempt(name)`` succeeds.

    Logs every snapshot skipped and why (``unreadable``: snapshots whose
    manifest cannot be read, so whose step is unknown). ``None`` when there
    was nothing to try; :class:`IntegrityError` listing every attempt when
    nothing restored. ``tensors_of(name)`` (the tensor entry keys of a
    snapshot) lets the log name the tensors a failed attempt may have filled
    that the chosen snapshot does not overwrite.
    """
    tried = [f"{name}: {reason}" for name, reason in sorted(unreadable.items())]
    for line in tried:
        log.warning("casnap: snapshot %s; it cannot be resumed from", line)
    attempted: list[str] = []
    for info in reversed(candidates):
        reason = attempt(info.name)
        if reason is None:
            if tried:
                log.warning(
                    "casnap: resumed from %s (step %s) after skipping: %s. The skipped "
                    "snapshots keep their names, so their steps are not taken again",
                    info.name,
                    info.step,
                    "; ".join(tried),
                )
            _warn_leftovers(info.name, attempted, tensors_of)
            return info
        log.warning("casnap: skipping snapshot %s (step %s): %s", info.name, info.step, reason)
        tried.append(f"{info.name}: {reason}")
        attempted.append(info.name)
    if tried:
        raise IntegrityError(
            f"no snapshot in {where} could be restored; tried, newest first: "
            + "; ".join(tried)
            + " (app_state may hold tensors of these attempts; run `casnap verify`)"
        )
    return None


def _warn_leftovers(
    chosen: str, attempted: Sequence[str], tensors_of: Callable[[str], set[str]]
) -> None:
    """A failed attempt may have filled tensors (each whole) before it met damage; the
    chosen snapshot's restore overwrites those it holds. Name the others."""
    if not attempted:
        return
    try:
        filled = set().union(*(tensors_of(name) for name in attempted))
        left = sorted(filled - tensors_of(chosen))
    except Exception as exc:  # manifests read a moment ago; a log line is not worth failing
        log.warning("casnap: could not compare the skipped snapshots' entries: %r", exc)
        return
    if left:
        shown = ", ".join(left[:10]) + (f" and {len(left) - 10} more" if len(left) > 10 else "")
        log.warning(
            "casnap: %s does not hold %s; if the app_state has them, they may hold the "
            "values of a skipped snapshot",
            chosen,
            shown,
        )


def pick_best(
    infos: Sequence[SnapshotInfo],
    rules: Sequence[RetentionRule],
    metric: str | None,
    mode: str | None,
) -> SnapshotInfo | None:
    """The best of ``infos`` by ``metric`` and ``mode`` as :class:`KeepBest` ranks them
    (non-finite values never best; ties to the newer). Without ``metric``, the first
    ``KeepBest`` of ``rules`` gives it; ``mode`` defaults to that rule's, else ``"min"``."""
    rule = next(
        (r for r in rules if isinstance(r, KeepBest) and (metric is None or r.metric == metric)),
        None,
    )
    if metric is None:
        if rule is None:
            raise ConfigError(
                "best() needs a metric: pass metric=..., or give the retention a KeepBest rule",
                "metric",
            )
        metric = rule.metric
    expect_type(metric, str, "metric", "a metric name")
    if mode is None:
        mode = rule.mode if rule is not None else "min"
    picker = KeepBest(1, metric, mode)  # type: ignore[arg-type]  # a bad mode: RetentionError
    picked = picker.select(infos, datetime.now(UTC))
    return next((s for s in infos if s.name in picked), None)
