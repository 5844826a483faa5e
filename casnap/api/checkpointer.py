"""The training-loop helper: take every N steps or T seconds, on request, at the end and
on preemption; async takes; retention; a mirror; resume from the newest snapshot that
restores (docs/retention.md, "The Checkpointer"). Its options and the parts that need no
Checkpointer are in :mod:`casnap.api.checkpointer_parts`."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from datetime import UTC, datetime
from types import FrameType, TracebackType
from typing import Any, Literal

from casnap.api.checkpointer_parts import (
    CheckpointerOptions,
    Mirror,
    as_policy,
    preemption_signals,
    resume,
    retain,
)
from casnap.api.repository import Repository
from casnap.api.snapshot import PendingSnapshot, Snapshot
from casnap.distributed.group import any_rank
from casnap.errors import ConfigError, SnapshotNotFoundError, as_names, as_path, expect_type
from casnap.format.names import check_ref_name
from casnap.ops.retention import (
    KeepBest,
    KeepNames,
    RetentionResult,
    SnapshotInfo,
    SummaryCache,
    encode_metric,
    read_snapshots,
)
from casnap.repo.repository import RepoStorage
from casnap.take.session import Session

__all__ = ["Checkpointer", "CheckpointerOptions"]  # the options' public home is here
_Call = tuple[int, dict[str, Any], Mapping[str, Any] | None, list[str]]  # maybe_take's
log = logging.getLogger("casnap.checkpointer")


class PreemptionGuard:
    """Records preemption signals (Python runs handlers in the main thread only) until the
    checkpointer took its snapshot: the loop may be inside a step or a collective. Then
    :meth:`honour` hands the signal to the previous handler (by default, it ends)."""

    def __init__(self, signals: tuple[signal.Signals, ...]) -> None:
        self.signals = signals
        self.received: int | None = None
        self._previous: dict[int, Callable[[int, FrameType | None], Any] | int | None] = {}

    def install(self) -> None:
        if self._previous:
            return
        if threading.current_thread() is not threading.main_thread():
            raise ConfigError(
                "take_on_preemption needs the checkpointer to be used from the main thread "
                "(Python delivers signals there only)",
                "take_on_preemption",
            )
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._record)

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum

    def uninstall(self, *, dropping: bool = False) -> None:
        """Put the previous handlers back; ``dropping``: forget (saying so) a signal not
        handed on, leaving with an exception that a kill would hide."""
        if dropping and self.received is not None:
            log.warning(
                "casnap: signal %s was received; not handed on while leaving with an exception",
                self.received,
            )
            self.received = None
        previous, self._previous = self._previous, {}
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)

    def honour(self) -> None:
        """Give the recorded signal to the handler that was installed before this guard."""
        signum, self.received = self.received, None
        if signum is None:
            return
        previous = self._previous.get(signum)
        self.uninstall()
        if previous is None or previous == signal.SIG_DFL:
            signal.raise_signal(signum)  # the default action; for SIGTERM the process ends here
        elif previous != signal.SIG_IGN and callable(previous):
            previous(signum, None)
        self.install()  # still running: keep guarding


class Checkpointer:
    """Takes snapshots of a training loop into the repository at ``repo_url`` (or into
    an open :class:`casnap.Repository`).

    :meth:`maybe_take` takes when ``every_n_steps`` or ``every_seconds`` (from the end of
    the last take) says so, with ``force=True``, after a SIGTERM (``take_on_preemption``)
    and at :meth:`close` (``take_on_close``); never twice for one step; without an
    interval, it only resumes and lists. Its snapshots are those ``name_format`` names
    for their ``metadata["step"]``. Under a process group every rank makes the same
    calls. The options are the fields of :class:`CheckpointerOptions`::

        with Checkpointer("/ckpt/run1", every_n_steps=500, async_take=True) as ckpt:
            start = ckpt.restore_latest(app_state)  # None on a fresh run
            for step in range(0 if start is None else start + 1, total_steps):
                ckpt.maybe_take(step, app_state, metrics={"loss": train_step()})
    """

    def __init__(
        self,
        repo_url: str | Repository | RepoStorage,
        every_n_steps: int | None = None,
        *,
        options: CheckpointerOptions | None = None,
        **keywords: Any,
    ) -> None:
        opened = repo_url.storage if isinstance(repo_url, Repository) else repo_url
        repo_url = opened.url if isinstance(opened, RepoStorage) else as_path(repo_url, "repo_url")
        if every_n_steps is not None:
            keywords["every_n_steps"] = every_n_steps
        opts = replace(options, **keywords) if options else CheckpointerOptions(**keywords)
        self.options = opts
        self.every_n_steps = opts.every_n_steps
        self.every_seconds: float | None = opts.every_seconds  # type: ignore[assignment]
        self._clock = opts.clock
        self._since = self._clock()  # the time interval counts from the end of the last take
        self.retention = as_policy(opts.retention, "retention")  # a policy already
        self.async_take = opts.async_take
        self.name_format = opts.name_format
        self.take_on_close = opts.take_on_close
        self.reclaim = opts.reclaim
        self.reclaim_wait_seconds = float(opts.reclaim_wait_seconds)
        self.tags = list(opts.tags or ())
        self._repo: RepoStorage | None = opened if isinstance(opened, RepoStorage) else None
        self._url: str = repo_url
        self._store_options = dict(opts.storage_options or {})
        # Lineage, plan reuse and staging buffers from one take to the next.
        self.session = opts.session if opts.session is not None else Session()
        self._steps: set[int] = set()  # steps taken (or being taken) by this checkpointer
        self._pending: tuple[PendingSnapshot, int] | None = None  # an async take and its step
        self._summaries: SummaryCache = {}
        self._last_call: _Call | None = None  # for the take on close
        self.last_retention: RetentionResult | None = None
        # The last commit whose retention kept snapshots the mirror was still owed.
        self._kept_for_mirror: tuple[RepoStorage, str] | None = None
        has_mirror = opts.mirror is not None
        self.mirror = Mirror(opts, self.retention, self._is_mine) if has_mirror else None
        signals = preemption_signals(opts.take_on_preemption)
        self._guard = PreemptionGuard(signals) if signals else None
        if self._guard is not None:
            self._guard.install()

    def should_take(self, step: int) -> bool:
        """Whether :meth:`maybe_take` would take ``step`` now by the intervals alone, e.g.
        to compute costly metrics only then (this process's clock: ranks may differ)."""
        self._need_interval("should_take")
        return step not in self._steps and (self._step_due(step) or self._time_due())

    def _step_due(self, step: int) -> bool:
        return self.every_n_steps is not None and step % self.every_n_steps == 0

    def _time_due(self) -> bool:  # differs between ranks: agreed in maybe_take
        every = self.every_seconds
        return every is not None and self._clock() - self._since >= every

    def _need_interval(self, method: str) -> None:
        if self.every_n_steps is None and self.every_seconds is None:
            raise ConfigError(
                f"{method} needs an interval: this Checkpointer was made without "
                "every_n_steps or every_seconds (give Checkpointer(..., every_n_steps=N) or "
                "every_seconds=T, or force=True to take now); without one it only resumes",
                "every_n_steps",
            )

    def maybe_take(
        self,
        step: int,
        app_state: dict[str, Any],
        metrics: Mapping[str, Any] | None = None,
        *,
        tags: Iterable[str] | None = None,
        force: bool = False,
    ) -> Snapshot | PendingSnapshot | None:
        """Take ``step`` if a trigger (or ``force``) says so and no snapshot has its name;
        return the :class:`Snapshot` (:class:`PendingSnapshot` with ``async_take``) or
        ``None``. ``metrics`` (numbers or 0-d tensors) and ``tags`` go into its metadata.
        A finished async take is committed here, and its failure raised here. After a
        preemption signal it takes, waits for the commit, then hands the signal on.

        Example: ``ckpt.maybe_take(step, app_state, metrics={"loss": loss})``.
        """
        expect_type(step, int, "step", "an int")
        if step < 0:
            raise ConfigError(f"step must not be negative, got {step}", "step")
        expect_type(app_state, Mapping, "app_state", "a dict of stateful objects")
        if metrics is not None:
            expect_type(metrics, Mapping, "metrics", "a dict of numbers or None")
        expect_type(force, bool, "force", "True or False")
        if not force:
            self._need_interval("maybe_take")
        extra = [check_ref_name(t) for t in (as_names(tags, "tags") or [])]
        if self._pending is not None and self._pending[0].done():
            self._wait_take()
        if self._guard is not None:
            self._guard.install()  # again, after a close()
        self._last_call = (step, app_state, metrics, extra)
        preempted = self._guard is not None and self._guard.received is not None
        due = self._step_due(step) or force
        if self.every_seconds is not None or self._guard is not None:
            due = any_rank(due or preempted or self._time_due(), "the take decision")
        snap = self._take(step, app_state, metrics, extra) if due else None
        if preempted:
            assert self._guard is not None
            log.warning(
                "casnap: signal %s received; step %d taken, handing the signal on",
                self._guard.received,
                step,
            )
            self._wait_take()  # committed before the process may end (the mirror may lag)
            self._guard.honour()
        return snap

    def _take(
        self,
        step: int,
        app_state: dict[str, Any],
        metrics: Mapping[str, Any] | None,
        extra: list[str],
    ) -> Snapshot | PendingSnapshot | None:
        if step in self._steps:
            return None
        name = self._name(step)
        metadata = {
            "step": step,
            "metrics": {str(k): encode_metric(v, k) for k, v in (metrics or {}).items()},
            "tags": self.tags + [t for t in extra if t not in self.tags],
        }
        if self.async_take:
            self._wait_take()  # the previous take's manifest is this one's parent
        repo = self._open()
        if repo is not None and repo.has_ref(name):  # e.g. resuming at the restored step
            self._steps.add(step)
            return None
        # Without a repository, the take creates it once its input is checked.
        url = repo.url if repo is not None else self._url
        self._steps.add(step)
        start = Snapshot.async_take if self.async_take else Snapshot.take
        try:
            snap = start(
                f"{url.rstrip('/')}/{name}",
                app_state,
                storage_options=self._store_options,
                settings=self.options.settings,
                repository=repo if repo is not None else url,
                metadata=metadata,
                session=self.session,
            )
        except BaseException:
            self._steps.discard(step)
            raise
        self._since = self._clock()  # from the end: a slow take cannot make every step one
        if isinstance(snap, PendingSnapshot):
            self._pending = (snap, step)
            return snap
        if self._repo is None:
            self._repo = snap.repository.storage
        self._committed(snap.repository.storage, name)
        return snap

    def wait(self) -> Snapshot | None:
        """Wait for the pending async take, commit it and return it (``None`` if none; a
        failure is raised here), then for the mirror (what failed: ``mirror.unmirrored``)."""
        snap = self._wait_take()
        if self.mirror is not None:
            self.mirror.flush()
            self._retain_after_mirror()
        return snap

    def _wait_take(self) -> Snapshot | None:
        if self._pending is None:
            return None
        (pending, step), self._pending = self._pending, None
        try:
            snap = pending.wait()
        except BaseException:
            self._steps.discard(step)
            raise
        self._committed(snap.repository.storage, self._name(step))
        return snap

    def close(self) -> None:
        """Take the last step if ``take_on_close`` (or a signal is pending), wait for the
        pending take and the mirror, put the signal handlers back, hand a signal on."""
        self._close(failed=False)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Leaving with an exception takes nothing: the state may be mid-step.
        self._close(failed=exc_type is not None)

    def _close(self, *, failed: bool) -> None:
        guard = self._guard
        preempted = guard is not None and guard.received is not None
        try:
            want = self.take_on_close or preempted
            if guard is not None and not failed:
                want = any_rank(want, "the take decision")  # a signal may reach some ranks only
            if want and not failed and self._last_call is not None:
                self._take(*self._last_call)
            self._wait_take()
            if self.mirror is not None:
                self.mirror.close()  # logs what could not be copied
                self._retain_after_mirror()
            if guard is not None and preempted and not failed:
                guard.honour()  # by default the process ends here
        finally:
            if guard is not None:
                guard.uninstall(dropping=True)

    def _committed(self, repo: RepoStorage, name: str) -> None:
        """Retention and reclaim (what a reclaim deferred goes with the next), then the mirror."""
        self._retain(repo, name)
        if self.mirror is not None:
            self.mirror.submit(repo, name)

    def _retain(self, repo: RepoStorage, name: str) -> None:
        if self.retention is None:
            return
        mine = {s.name for s in self._mine(repo)}
        owed = self.mirror.owed_here(mine - {name}) if self.mirror is not None else []
        if owed is None:
            return
        self.last_retention = retain(
            repo,
            self.retention,
            mine,
            KeepNames([name], "newest checkpoint"),
            *([KeepNames(owed, "not yet copied to the mirror")] if owed else []),
            cache=self._summaries,
            last=self.last_retention,
            reclaim_wait_seconds=self.reclaim_wait_seconds if self.reclaim else None,
        )
        self._kept_for_mirror = (repo, name) if owed else None

    def _retain_after_mirror(self) -> None:
        """Once the mirror caught up, apply the retention that waited for it."""
        kept, self._kept_for_mirror = self._kept_for_mirror, None
        if kept is not None:
            self._retain(*kept)

    def _open(self) -> RepoStorage | None:
        """The repository, or None while there is none (the first take creates it)."""
        if self._repo is None and RepoStorage.exists_at(self._url, self._store_options):
            self._repo = RepoStorage.open(self._url, self._store_options)
        return self._repo

    def _name(self, step: int) -> str:
        return self.name_format.format(step=step)

    def _is_mine(self, info: SnapshotInfo) -> bool:
        return info.step is not None and info.name == self._name(info.step)

    def _mine(self, repo: RepoStorage) -> list[SnapshotInfo]:
        """Snapshots named by this checkpointer's format for their own step, oldest first."""
        infos, _ = read_snapshots(repo, cache=self._summaries)
        return [s for s in infos if self._is_mine(s)]

    def snapshots(self) -> list[str]:
        """This checkpointer's committed snapshots, oldest first (by step)."""
        return [s.name for s in self.snapshot_infos()]

    def snapshot_infos(self) -> list[SnapshotInfo]:
        """Like :meth:`snapshots`, with step, metadata and tags."""
        repo = self._open()
        return self._mine(repo) if repo is not None else []

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
        """The name of the best snapshot by ``metric`` (default: the retention's first
        ``KeepBest`` rule's) and ``mode`` (that rule's, else ``"min"``), ranked as
        ``KeepBest`` does; ``None`` if none has a finite value.

        Example: ``ckpt.best("accuracy", "max")``."""
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
        best = [r for r in rules if isinstance(r, KeepBest) and metric in (None, r.metric)]
        rule = best[0] if best else None
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
        infos = self.snapshot_infos()
        picked = KeepBest(1, metric, mode).select(infos, datetime.now(UTC))  # type: ignore[arg-type]
        return next((s for s in infos if s.name in picked), None)

    def _snapshot(self, repo: RepoStorage, name: str) -> Snapshot:
        path, options = f"{repo.url.rstrip('/')}/{name}", self._store_options
        return Snapshot(path, storage_options=options, session=self.session, repository=repo)

    def restore_latest(self, app_state: dict[str, Any], **restore_kwargs: Any) -> int | None:
        """Restore this checkpointer's newest snapshot that restores whole and return its
        step (``None``: there is none). A damaged one is skipped with a logged reason;
        other errors are raised (docs/retention.md, "Resuming"). ``restore_kwargs`` go
        to :meth:`Snapshot.restore`.

        Example: ``start = ckpt.restore_latest(app_state) or 0``.
        """
        expect_type(app_state, Mapping, "app_state", "a dict of stateful objects")
        self._wait_take()
        repo = self._open()
        if repo is None:
            return None
        infos, unreadable = read_snapshots(repo, cache=self._summaries)

        def restore_one(name: str) -> None:
            self._snapshot(repo, name).restore(app_state, **restore_kwargs)

        chosen = resume(repo, [s for s in infos if self._is_mine(s)], unreadable, restore_one)
        if chosen is None or chosen.step is None:
            return None
        self._steps.add(chosen.step)
        return chosen.step

    def restore(self, app_state: dict[str, Any], step: int, **restore_kwargs: Any) -> Snapshot:
        """Restore this checkpointer's snapshot of ``step`` and return it; no fallback
        (:class:`SnapshotNotFoundError` when there is none).

        Example: ``ckpt.restore(app_state, step=ckpt.best_step())``.
        """
        expect_type(app_state, Mapping, "app_state", "a dict of stateful objects")
        expect_type(step, int, "step", "an int")
        self._wait_take()
        repo = self._open()
        mine = self._mine(repo) if repo is not None else []
        info = next((s for s in mine if s.step == step), None)
        if repo is None or info is None:
            steps = [s.step for s in mine]
            shown = ", ".join(map(str, steps[-8:])) + (" ..." if len(steps) > 8 else "")
            raise SnapshotNotFoundError(
                f"no snapshot of step {step} by this checkpointer in {self._url} "
                f"(its steps: {shown or 'none'})",
                self._name(step),
            )
        snap = self._snapshot(repo, info.name)
        snap.restore(app_state, **restore_kwargs)
        self._steps.add(step)
        return snap

    def __repr__(self) -> str:
        every = f"every_n_steps={self.every_n_steps}"
        if self.every_seconds is not None:
            every += f", every_seconds={self.every_seconds:g}"
        return f"Checkpointer({self._url!r}, {every})"
