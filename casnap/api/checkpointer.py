"""The training-loop helper: take every N steps or T seconds, on request, at the end
and on preemption; async takes; retention; resume from the newest snapshot that restores.

A Checkpointer's snapshots are those whose name is ``name_format`` applied to
their ``metadata["step"]``; listing, resuming and retention see only those.
Its decisions (the take on close and on SIGTERM are opt-in, a non-finite metric
is never best, ``restore_latest`` skips damage and logs why) and an example are
in docs/retention.md, "The Checkpointer".
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import replace
from types import TracebackType
from typing import Any, Unpack

from casnap.api.checkpointer_listing import KeepNames, Listing, retain_after_commit
from casnap.api.checkpointer_mirror import is_rank_zero, make_mirror
from casnap.api.checkpointer_options import CheckpointerKeywords, CheckpointerOptions, plain_metric
from casnap.api.checkpointer_resume import resume, try_restore
from casnap.api.checkpointer_triggers import (
    PreemptionGuard,
    Schedule,
    any_rank,
    preemption_signals,
)
from casnap.api.repository import Repository
from casnap.api.snapshot import PendingSnapshot, Snapshot
from casnap.errors import (
    ConfigError,
    SnapshotNotFoundError,
    as_names,
    as_path,
    expect_type,
)
from casnap.format.entries import TensorEntry
from casnap.format.names import check_ref_name
from casnap.ops.retention import (
    RetentionPolicy,
    RetentionResult,
    SummaryCache,
    read_snapshots,
)
from casnap.repo.repository import RepoStorage
from casnap.take.session import Session

_TAKE_ONLY_OPTIONS = ("chunk_size", "compression")
log = logging.getLogger("casnap.checkpointer")


class Checkpointer(Listing):
    """Takes snapshots of a training loop into the repository at ``repo_url``.

    :meth:`maybe_take` takes when ``every_n_steps`` or ``every_seconds`` (on a
    monotonic ``clock``, from the end of the last take) says so, with
    ``force=True``, after a SIGTERM (``take_on_preemption``) and at :meth:`close`
    (``take_on_close``); never twice for one step. Without an interval it only
    resumes (:meth:`restore_latest`, :meth:`restore`) and lists. The other
    options are the fields of
    :class:`~casnap.api.checkpointer_options.CheckpointerOptions`, given as
    keyword arguments or as ``options=`` (keyword arguments override its fields).
    Takes share a :class:`casnap.Session` (``session``): each descends from the
    previous take or the restored snapshot. Under a process group every rank
    makes the same calls. docs/retention.md, "The Checkpointer", has the
    triggers, preemption, resuming and retention in full::

        with Checkpointer("/ckpt/run1", every_n_steps=500, async_take=True) as ckpt:
            start = ckpt.restore_latest(app_state)  # None on a fresh run
            for step in range(0 if start is None else start + 1, total_steps):
                ckpt.maybe_take(step, app_state, metrics={"loss": train_step()})
    """

    def __init__(
        self,
        repo_url: str,
        every_n_steps: int | None = None,
        *,
        options: CheckpointerOptions | None = None,
        **keywords: Unpack[CheckpointerKeywords],
    ) -> None:
        repo_url = as_path(repo_url, "repo_url")
        fields: dict[str, Any] = dict(keywords)
        if every_n_steps is not None:
            fields["every_n_steps"] = every_n_steps
        opts = replace(options, **fields) if options is not None else CheckpointerOptions(**fields)
        self.options = opts
        retention = opts.retention
        assert retention is None or isinstance(retention, RetentionPolicy)  # made so when checked
        self.schedule = Schedule(opts.every_n_steps, opts.every_seconds, opts.clock)
        self.every_n_steps = opts.every_n_steps
        self.every_seconds = self.schedule.every_seconds
        self.retention = retention
        self.async_take = opts.async_take
        self.name_format = opts.name_format
        self.take_on_close = opts.take_on_close
        # Reclaim after retention (docs/retention.md): on by default; the wait for
        # other processes' takes in flight is short because it blocks training.
        self.reclaim = opts.reclaim
        self.reclaim_wait_seconds = float(opts.reclaim_wait_seconds)
        self.tags = list(opts.tags or ())
        signals = preemption_signals(opts.take_on_preemption)
        take_options = dict(opts.storage_options or {})
        explicit = take_options.pop("repository", None)
        if isinstance(explicit, Repository):
            explicit = explicit.storage
        self._repo: RepoStorage | None = explicit if isinstance(explicit, RepoStorage) else None
        self._url: str = explicit if isinstance(explicit, str) else repo_url
        self._take_options = take_options
        self._store_options = {k: v for k, v in take_options.items() if k not in _TAKE_ONLY_OPTIONS}
        # Lineage, plan reuse and staging buffers from one take to the next.
        self.session = opts.session if opts.session is not None else Session()
        self._steps: set[int] = set()  # steps taken (or being taken) by this checkpointer
        self._pending: PendingSnapshot | None = None
        self._pending_step: int | None = None
        self._summaries: SummaryCache = {}
        self._last_call: tuple[int, dict[str, Any], Mapping[str, Any] | None, list[str]] | None
        self._last_call = None  # the last maybe_take's arguments, for the take on close
        self.last_retention: RetentionResult | None = None
        # The last commit whose retention kept snapshots the mirror was still owed.
        self._kept_for_mirror: tuple[Snapshot, str] | None = None
        self.mirror = make_mirror(
            opts.mirror.storage if isinstance(opts.mirror, Repository) else opts.mirror,
            opts.mirror_storage_options,
            retention,
            opts.mirror_retention,
            self._is_mine,
            queue_size=opts.mirror_queue,
            reclaim=opts.reclaim,
        )
        self._guard = PreemptionGuard(signals) if signals else None
        if self._guard is not None:
            self._guard.install()

    # -- taking ------------------------------------------------------------
    def should_take(self, step: int) -> bool:
        """Whether :meth:`maybe_take` would take ``step`` now by the intervals alone (not
        counting ``force`` or a signal); e.g. to compute costly metrics only then.
        One process only: under a process group the time trigger is agreed in
        ``maybe_take``."""
        self._need_interval("should_take")
        schedule = self.schedule
        return step not in self._steps and (schedule.step_due(step) or schedule.time_due())

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
        """Take a snapshot of ``step`` if a trigger says so (see the class docstring)
        and it has not been taken yet (by this checkpointer or, under this name, by anyone).

        ``force=True`` takes regardless of the intervals. Returns the
        :class:`Snapshot` (or, with ``async_take``, the :class:`PendingSnapshot`),
        else ``None``. ``metrics`` (numbers or 0-d tensors; NaN and infinity are
        stored as strings) and ``tags`` (on top of the checkpointer's) go into
        the manifest metadata. A finished async take is committed and
        retention applied here, and its failure, if any, is raised here.

        After a preemption signal this takes the step, waits until it is
        committed, then honours the signal (by default the process ends here).

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
        self._poll()
        if self._guard is not None:
            self._guard.install()  # again, after a close()
        self._last_call = (step, app_state, metrics, extra)
        preempted = self._guard is not None and self._guard.received is not None
        due = self.schedule.step_due(step) or force
        if self.every_seconds is not None or self._guard is not None:
            due = any_rank(due or preempted or self.schedule.time_due())
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
            "metrics": {str(k): plain_metric(k, v) for k, v in (metrics or {}).items()},
            "tags": self.tags + [t for t in extra if t not in self.tags],
        }
        if self.async_take:
            self._wait_take()  # the previous take's manifest is this one's parent
        repo = self._open()
        if repo is not None and repo.has_ref(name):  # e.g. resuming at the restored step
            self._steps.add(step)
            return None
        # Without a repository yet, the take creates it at this checkpointer's URL,
        # and only once app_state and metadata are checked: bad input creates nothing.
        url = repo.url if repo is not None else self._url
        path = f"{url.rstrip('/')}/{name}"
        options = {**self._take_options, "repository": repo if repo is not None else url}
        self._steps.add(step)
        start = Snapshot.async_take if self.async_take else Snapshot.take
        try:
            snap = start(
                path, app_state, storage_options=options, metadata=metadata, session=self.session
            )
        except BaseException:
            self._steps.discard(step)
            raise
        self.schedule.restart()
        if isinstance(snap, PendingSnapshot):
            self._pending, self._pending_step = snap, step
            return snap
        if self._repo is None:
            self._repo = snap.repository.storage
        self._committed(snap, name)
        return snap

    def wait(self) -> Snapshot | None:
        """Wait for the pending async take, commit it, apply retention and return it
        (``None`` if nothing is pending). A background failure is raised here.
        With a ``mirror``, then wait until every committed snapshot was copied
        there (what still failed is logged and in ``mirror.unmirrored``)."""
        snap = self._wait_take()
        if self.mirror is not None:
            self.mirror.flush()
            self._retain_after_mirror()
        return snap

    def _retain_after_mirror(self) -> None:
        """Once the mirror caught up, apply the retention that waited for it."""
        kept, self._kept_for_mirror = self._kept_for_mirror, None
        if kept is not None:
            self._retain(*kept)

    def _wait_take(self) -> Snapshot | None:
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
        """Take the last step if ``take_on_close`` (or a preemption signal is pending) and
        it was not taken, wait for the pending take, put the signal handlers back,
        then hand on a pending signal. The checkpointer can still be used after."""
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
                want = any_rank(want)  # a signal may have reached only some ranks
            if want and not failed and self._last_call is not None:
                step, app_state, metrics, extra = self._last_call
                self._take(step, app_state, metrics, extra)
            self._wait_take()
            if self.mirror is not None:
                self.mirror.close()  # logs what could not be copied
                self._retain_after_mirror()
            if guard is not None and preempted and not failed:
                guard.honour()  # by default the process ends here
        finally:
            if guard is not None:
                if guard.received is not None:  # an error must not be hidden by a kill
                    log.warning(
                        "casnap: signal %s was received; not handed on while "
                        "leaving with an exception",
                        guard.received,
                    )
                    guard.received = None
                guard.uninstall()

    def _poll(self) -> None:
        if self._pending is not None and self._pending.done():
            self._wait_take()

    def _committed(self, snap: Snapshot, name: str) -> None:
        """Apply retention, then reclaim what only the retired snapshots reached.

        A reclaim that is deferred (takes of other processes stayed in flight
        past ``reclaim_wait_seconds``, or another gc holds the lock) leaves its
        manifests in ``last_retention.reclaimed.pending``; the next commit's
        reclaim takes them along.
        """
        self._retain(snap, name)
        if self.mirror is not None and is_rank_zero():  # one copier per repository
            policy = self.mirror.retention
            if policy is not None:
                policy = RetentionPolicy(*policy.rules, KeepNames([name], "newest checkpoint"))
            self.mirror.submit(snap.repository.storage, name, policy)

    def _retain(self, snap: Snapshot, name: str) -> None:
        if self.retention is None:
            return
        done = retain_after_commit(
            snap.repository.storage,
            name,
            self.retention,
            {s.name for s in self._mine(snap.repository.storage)},
            self.mirror,
            self._summaries,
            self.last_retention,
            self.reclaim_wait_seconds if self.reclaim else None,
        )
        if done is not None:
            self.last_retention, owed = done
            self._kept_for_mirror = (snap, name) if owed else None

    # -- resuming ------------------------------------------------------------
    def restore_latest(self, app_state: dict[str, Any], **restore_kwargs: Any) -> int | None:
        """Restore the newest snapshot of this checkpointer that restores whole, and
        return its step; ``None`` when there is none (or no repository at all).

        A candidate found damaged (an :class:`IntegrityError`, a missing manifest)
        is skipped with a warning and the next older one restored; other errors
        are raised as they are; when none restores, :class:`IntegrityError` lists
        what was tried (docs/retention.md, "Resuming"). The next take's parent is
        the restored snapshot. ``restore_kwargs`` go to :meth:`Snapshot.restore`.

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

        def tensors_of(name: str) -> set[str]:
            entries = repo.read_manifest(repo.resolve(name)).entries
            return {k for k, e in entries.items() if isinstance(e, TensorEntry)}

        chosen = resume(
            [s for s in infos if self._is_mine(s)],
            unreadable,
            lambda name: try_restore(repo, name, restore_one),
            repo.url,
            tensors_of,
        )
        if chosen is None:
            return None
        assert chosen.step is not None
        self._steps.add(chosen.step)
        return chosen.step

    def restore(self, app_state: dict[str, Any], step: int, **restore_kwargs: Any) -> Snapshot:
        """Restore this checkpointer's snapshot of ``step`` (Orbax's ``restore(step)``) and
        return it; the next take's parent is that snapshot. No fallback: any error is
        raised, :class:`SnapshotNotFoundError` when there is no such snapshot.

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
