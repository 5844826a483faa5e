"""The every-N-steps loop helper: take, async take, retention, resume from the latest.

Example::

    from casnap.api.checkpointer import Checkpointer
    from casnap.ops.retention import KeepBest, KeepLast, RetentionPolicy

    app_state = {"model": model, "optim": optimizer}
    with Checkpointer(
        "/ckpt/run1", every_n_steps=500, async_take=True,
        retention=RetentionPolicy(KeepLast(3), KeepBest(1, "loss")),
    ) as ckpt:
        start = ckpt.restore_latest(app_state)  # None on a fresh run
        for step in range(0 if start is None else start + 1, total_steps):
            loss = train_step()
            ckpt.maybe_take(step, app_state, metrics={"loss": loss})

A Checkpointer's snapshots are those whose name is ``name_format`` applied to
their ``metadata["step"]``; listing, resuming and retention see only those, so
other snapshots in the same repository (a base model, another run's
checkpoints under another name format) are never touched.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from datetime import datetime
from types import TracebackType
from typing import Any

from casnap.api.snapshot import PendingSnapshot, Snapshot
from casnap.errors import CasnapError, ConfigError, as_names, as_path, expect_type
from casnap.format.names import check_ref_name
from casnap.gc.reclaim import RECLAIM_WAIT_SECONDS
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
from casnap.settings import Settings
from casnap.take.session import Session

_TAKE_ONLY_OPTIONS = ("chunk_size", "compression")


class _KeepNames(RetentionRule):
    """Keeps the given snapshots: the checkpointer never retires its newest one."""

    def __init__(self, names: Iterable[str], reason: str) -> None:
        self.names = frozenset(names)
        self.reason = reason

    def select(self, snapshots: Sequence[SnapshotInfo], now: datetime) -> dict[str, str]:
        return {s.name: self.reason for s in snapshots if s.name in self.names}


def _plain(value: Any) -> Any:
    """Metric values as JSON: a 0-d tensor or numpy scalar becomes its Python number."""
    item = getattr(value, "item", None)
    return item() if callable(item) else value


class Checkpointer:
    """Takes a snapshot every ``every_n_steps`` steps into the repository at ``repo_url``.

    - ``retention``: a :class:`~casnap.ops.retention.RetentionPolicy` applied to this
      checkpointer's snapshots after each commit, which also deletes what only
      the retired snapshots reached (:func:`casnap.gc.reclaim.reclaim`; set
      ``ckpt.reclaim = False`` to leave that to ``gc``). The newest snapshot
      is always kept.
    - ``async_take``: write in the background; a new take first waits for the
      previous one. The state is copied before ``maybe_take`` returns.
    - ``name_format``: the snapshot name, formatted with ``step=``.
    - ``storage_options``: as for :meth:`Snapshot.take` (fsspec options,
      ``chunk_size``, ``compression``, or ``repository``: a
      :class:`~casnap.Repository` to use instead of opening ``repo_url``).
    - ``tags``: stored in every snapshot's ``metadata["tags"]``.

    Each take's parent is the previous take of this checkpointer, or the
    snapshot :meth:`restore_latest` restored: the checkpointer owns a
    :class:`casnap.Session` (or uses ``session``), which also lets each take
    reuse the previous one's plan and staging buffers. Use it as a context manager (or
    call :meth:`close`) so the last async take is committed.
    """

    def __init__(
        self,
        repo_url: str,
        every_n_steps: int,
        *,
        retention: RetentionPolicy | None = None,
        async_take: bool = False,
        name_format: str = "step_{step:09d}",
        storage_options: dict[str, Any] | None = None,
        tags: Iterable[str] | None = None,
        session: Session | None = None,
    ) -> None:
        repo_url = as_path(repo_url, "repo_url")
        expect_type(every_n_steps, int, "every_n_steps", "an int")
        if isinstance(retention, RetentionRule):
            retention = RetentionPolicy(retention)
        if retention is not None:
            expect_type(retention, RetentionPolicy, "retention", "a casnap.RetentionPolicy or None")
        expect_type(name_format, str, "name_format", "a format string like 'step_{step:09d}'")
        tags = as_names(tags, "tags")
        if every_n_steps < 1:
            raise ConfigError(
                f"every_n_steps must be at least 1, got {every_n_steps}", "every_n_steps"
            )
        self.every_n_steps = every_n_steps
        self.retention = retention
        self.async_take = async_take
        self.name_format = name_format
        self.tags = [check_ref_name(t) for t in (tags or [])]
        try:  # a bad format fails here, not at the first take
            check_ref_name(self._name(0))
        except (KeyError, IndexError, ValueError, TypeError) as exc:
            if isinstance(exc, CasnapError):
                raise
            raise ConfigError(
                f"name_format {name_format!r} must name snapshots from {{step}}: {exc!r}",
                "name_format",
            ) from exc
        options = dict(storage_options or {})
        explicit = options.pop("repository", None)
        self._repo: RepoStorage | None = explicit if isinstance(explicit, RepoStorage) else None
        self._url: str = explicit if isinstance(explicit, str) else repo_url
        self._take_options = options
        self._store_options = {k: v for k, v in options.items() if k not in _TAKE_ONLY_OPTIONS}
        # Lineage, plan reuse and staging buffers from one take to the next.
        self.session = session if session is not None else Session()
        self._steps: set[int] = set()  # steps taken (or being taken) by this checkpointer
        self._pending: PendingSnapshot | None = None
        self._pending_step: int | None = None
        self._summaries: SummaryCache = {}
        self.last_retention: RetentionResult | None = None

    # -- taking ------------------------------------------------------------
    def maybe_take(
        self,
        step: int,
        app_state: dict[str, Any],
        metrics: Mapping[str, Any] | None = None,
        *,
        tags: Iterable[str] | None = None,
    ) -> Snapshot | PendingSnapshot | None:
        """Take a snapshot if ``step`` is a multiple of ``every_n_steps`` and has not
        been taken yet (by this checkpointer or, under this name, by anyone).

        Returns the :class:`Snapshot` (or, with ``async_take``, the
        :class:`PendingSnapshot`), else ``None``. ``metrics`` (JSON numbers) and
        ``tags`` (on top of the checkpointer's) go into the manifest metadata.
        A finished async take is committed and retention applied here, and its
        failure, if any, is raised here.

        Example: ``ckpt.maybe_take(step, app_state, metrics={"loss": loss})``.
        """
        expect_type(step, int, "step", "an int")
        if step < 0:
            raise ConfigError(f"step must not be negative, got {step}", "step")
        expect_type(app_state, Mapping, "app_state", "a dict of stateful objects")
        if metrics is not None:
            expect_type(metrics, Mapping, "metrics", "a dict of JSON numbers or None")
        tags = as_names(tags, "tags")
        self._poll()
        if step % self.every_n_steps != 0 or step in self._steps:
            return None
        name = self._name(step)
        repo = self._open(create=True)
        assert repo is not None
        if repo.has_ref(name):  # e.g. resuming at the step that was restored
            self._steps.add(step)
            return None
        extra = [check_ref_name(t) for t in (tags or [])]
        metadata = {
            "step": step,
            "metrics": {str(k): _plain(v) for k, v in (metrics or {}).items()},
            "tags": self.tags + [t for t in extra if t not in self.tags],
        }
        if self.async_take:
            self.wait()  # the previous take's manifest is this one's parent
        path = f"{repo.url.rstrip('/')}/{name}"
        options = {**self._take_options, "repository": repo}
        self._steps.add(step)
        try:
            if self.async_take:
                pending = Snapshot.async_take(
                    path, app_state, storage_options=options, metadata=metadata,
                    session=self.session,
                )  # fmt: skip
                self._pending, self._pending_step = pending, step
                return pending
            snap = Snapshot.take(
                path, app_state, storage_options=options, metadata=metadata,
                session=self.session,
            )  # fmt: skip
        except BaseException:
            self._steps.discard(step)
            raise
        self._committed(snap, name)
        return snap

    def wait(self) -> Snapshot | None:
        """Wait for the pending async take, commit it, apply retention and return it
        (``None`` if nothing is pending). A background failure is raised here."""
        pending, step = self._pending, self._pending_step
        if pending is None:
            return None
        self._pending = self._pending_step = None
        try:
            snap = pending.wait()
        except BaseException:
            if step is not None:
                self._steps.discard(step)
            raise
        assert step is not None
        self._committed(snap, self._name(step))
        return snap

    def close(self) -> None:
        """Wait for the pending take (if any). The checkpointer can still be used after."""
        self.wait()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _poll(self) -> None:
        if self._pending is not None and self._pending.done():
            self.wait()

    # Reclaim after retention (docs/retention.md): on by default; the wait for
    # other processes' takes in flight is short because it blocks training.
    reclaim: bool = True
    reclaim_wait_seconds: float = RECLAIM_WAIT_SECONDS

    def _committed(self, snap: Snapshot, name: str) -> None:
        """Apply retention, then reclaim what only the retired snapshots reached.

        A reclaim that is deferred (takes of other processes stayed in flight
        past ``reclaim_wait_seconds``, or another gc holds the lock) leaves its
        manifests in ``last_retention.reclaimed.pending``; the next commit's
        reclaim takes them along.
        """
        if self.retention is None:
            return
        repo = snap.repository
        mine = {s.name for s in self._mine(repo)}
        policy = RetentionPolicy(*self.retention.rules, _KeepNames([name], "newest checkpoint"))
        plan = plan_retention(repo, policy, names=mine, cache=self._summaries)
        result = execute_retention(repo, plan)
        earlier = self.last_retention.reclaimed if self.last_retention is not None else None
        retired = (earlier.pending if earlier is not None else ()) + result.retired_manifests
        if self.reclaim and retired:
            freed = reclaim_retired(repo, retired, wait_seconds=self.reclaim_wait_seconds)
            result = replace(result, reclaimed=freed)
        self.last_retention = result

    # -- resuming and listing ------------------------------------------------
    def restore_latest(self, app_state: dict[str, Any], **restore_kwargs: Any) -> int | None:
        """Restore the newest snapshot of this checkpointer and return its step, or
        ``None`` when there is none (or no repository at all).

        Newest is the highest ``metadata["step"]``, ties broken by creation
        time. Refs are written only at commit, so a take killed halfway is
        never chosen. The next take's parent is the restored snapshot.
        ``restore_kwargs`` go to :meth:`Snapshot.restore` (``strict``, ...).

        Example: ``start = ckpt.restore_latest(app_state) or 0``.
        """
        expect_type(app_state, Mapping, "app_state", "a dict of stateful objects")
        self.wait()
        repo = self._open(create=False)
        if repo is None:
            return None
        mine = self._mine(repo)
        if not mine:
            return None
        newest = mine[-1]
        assert newest.step is not None
        snap = Snapshot(
            f"{repo.url.rstrip('/')}/{newest.name}",
            storage_options={**self._take_options, "repository": repo},
            session=self.session,
        )
        snap.restore(app_state, **restore_kwargs)  # the session's next parent
        self._steps.add(newest.step)
        return newest.step

    def latest(self) -> str | None:
        """The name of this checkpointer's newest committed snapshot, or ``None``."""
        mine = self.snapshot_infos()
        return mine[-1].name if mine else None

    def snapshots(self) -> list[str]:
        """This checkpointer's committed snapshots, oldest first (by step)."""
        return [s.name for s in self.snapshot_infos()]

    def snapshot_infos(self) -> list[SnapshotInfo]:
        """Like :meth:`snapshots`, with step, metadata and tags."""
        repo = self._open(create=False)
        return self._mine(repo) if repo is not None else []

    # -- internals -----------------------------------------------------------
    def _name(self, step: int) -> str:
        return self.name_format.format(step=step)

    def _mine(self, repo: RepoStorage) -> list[SnapshotInfo]:
        """Snapshots named by this checkpointer's format for their own step, oldest first."""
        infos, _ = read_snapshots(repo, cache=self._summaries)
        return [s for s in infos if s.step is not None and s.name == self._name(s.step)]

    def _open(self, *, create: bool) -> RepoStorage | None:
        if self._repo is None:
            if create:
                chunk = self._take_options.get("chunk_size", Settings.from_env().chunk_size)
                self._repo = RepoStorage.open_or_create(
                    self._url, self._store_options, chunk_size=int(chunk)
                )
            elif RepoStorage.exists_at(self._url, self._store_options):
                self._repo = RepoStorage.open(self._url, self._store_options)
        return self._repo

    def __repr__(self) -> str:
        return f"Checkpointer({self._url!r}, every_n_steps={self.every_n_steps})"
