"""The parts of a :class:`~casnap.api.checkpointer.Checkpointer` that need no Checkpointer:
its options, the preemption guard, resuming past damage, retention after a commit, and
the mirror (docs/retention.md, "The Checkpointer"; docs/copy.md, "The Checkpointer's
mirror")."""

from __future__ import annotations

import logging
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, replace
from datetime import timedelta
from typing import Any, Literal

from casnap.api.repository import Repository
from casnap.distributed.group import all_gather, resolve_group
from casnap.errors import (
    CasnapError,
    ConfigError,
    CopyIntegrityError,
    IntegrityError,
    SnapshotExistsError,
    SnapshotNotFoundError,
    StoreError,
    as_names,
    as_path,
    expect_type,
)
from casnap.format.entries import TensorEntry
from casnap.format.names import check_ref_name
from casnap.gc.reclaim import RECLAIM_WAIT_SECONDS, ReclaimResult, reclaim
from casnap.ops.copy import open_destination
from casnap.ops.retention import (
    KeepNames,
    RetentionPolicy,
    RetentionResult,
    RetentionRule,
    SnapshotInfo,
    SummaryCache,
    decide_retention,
    execute_retention,
    read_snapshots,
)
from casnap.ops.verify import check_snapshot
from casnap.repo.repository import RepoStorage
from casnap.settings import check_storage_options, take_overrides
from casnap.take.session import Session

Clock = Callable[[], float]
log = logging.getLogger("casnap.checkpointer")


@dataclass(frozen=True)
class CheckpointerOptions:
    """Every option of a :class:`Checkpointer` but its repository, checked when made (a
    wrong one raises :class:`ConfigError` naming it). The Checkpointer takes them as
    keywords or as ``options=``, which mypy checks (keywords override its fields)::

        options = CheckpointerOptions(every_n_steps=500, async_take=True)
        ckpt = Checkpointer("/ckpt/run1", options=options, take_on_close=True)

    Each option is described in docs/retention.md, "The Checkpointer" (the mirror's in
    docs/copy.md, "The Checkpointer's mirror")."""

    every_n_steps: int | None = None
    _: KW_ONLY
    every_seconds: float | timedelta | None = None
    take_on_close: bool = False
    take_on_preemption: bool | int | Iterable[int] = False
    clock: Clock = time.monotonic
    async_take: bool = False
    name_format: str = "step_{step:09d}"
    storage_options: dict[str, Any] | None = None
    settings: dict[str, Any] | None = None
    tags: Iterable[str] | None = None
    session: Session | None = None
    retention: RetentionPolicy | RetentionRule | None = None
    reclaim: bool = True
    reclaim_wait_seconds: float = RECLAIM_WAIT_SECONDS
    mirror: str | Repository | RepoStorage | None = None
    mirror_storage_options: dict[str, Any] | None = None
    mirror_retention: RetentionPolicy | RetentionRule | None | Literal["same"] = "same"
    mirror_queue: int = 2

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalised once, here
        if self.every_n_steps is not None:
            _at_least(self.every_n_steps, "every_n_steps", "an int or None")
        every = self.every_seconds
        every = every.total_seconds() if isinstance(every, timedelta) else every
        if every is not None:
            expect_type(every, (int, float), "every_seconds", "seconds or a timedelta")
            if not every > 0:  # also refuses NaN
                raise ConfigError(f"every_seconds must be positive, got {every}", "every_seconds")
            set_(self, "every_seconds", float(every))
        if not callable(self.clock):
            raise ConfigError(f"clock must be callable, got {self.clock!r}", "clock")
        preemption_signals(self.take_on_preemption)
        set_(self, "retention", as_policy(self.retention, "retention"))
        mirror_retention, wanted = self.mirror_retention, "a RetentionPolicy, None or 'same'"
        if isinstance(mirror_retention, str) and mirror_retention != "same":
            raise ConfigError(
                f"mirror_retention must be {wanted}, got {mirror_retention!r}", "mirror_retention"
            )
        if mirror_retention != "same":
            as_policy(mirror_retention, "mirror_retention", wanted)
        _at_least(self.mirror_queue, "mirror_queue", "a positive int")
        expect_type(self.name_format, str, "name_format", "a format string like 'step_{step:09d}'")
        for flag in ("take_on_close", "reclaim"):
            expect_type(getattr(self, flag), bool, flag, "True or False")
        wait = expect_type(self.reclaim_wait_seconds, (int, float), "reclaim_wait_seconds", "s")
        if wait < 0:
            raise ConfigError(
                f"reclaim_wait_seconds must not be negative, got {wait}", "reclaim_wait_seconds"
            )
        set_(self, "settings", take_overrides(self.settings))
        for name in ("storage_options", "mirror_storage_options"):
            if getattr(self, name) is not None:
                check_storage_options(expect_type(getattr(self, name), Mapping, name, "a dict"))
        tags = as_names(self.tags, "tags")
        set_(self, "tags", tuple(check_ref_name(t) for t in (tags or [])))
        try:  # a bad format fails here, not at the first take
            check_ref_name(self.name_format.format(step=0))
        except (KeyError, IndexError, ValueError, TypeError) as exc:
            if isinstance(exc, CasnapError):
                raise
            raise ConfigError(
                f"name_format {self.name_format!r} must name snapshots from {{step}}: {exc!r}",
                "name_format",
            ) from exc


def _at_least(value: Any, name: str, wanted: str) -> None:
    expect_type(value, int, name, wanted)
    if value < 1:
        raise ConfigError(f"{name} must be at least 1, got {value}", name)


def as_policy(
    value: Any, name: str, wanted: str = "a casnap.RetentionPolicy or None"
) -> RetentionPolicy | None:
    """A retention option as a policy (one rule becomes a policy of it)."""
    if isinstance(value, RetentionRule):
        return RetentionPolicy(value)
    return None if value is None else expect_type(value, RetentionPolicy, name, wanted)


def preemption_signals(value: bool | int | Iterable[int]) -> tuple[signal.Signals, ...]:
    """The signals ``take_on_preemption`` names: ``True`` is SIGTERM, ``False`` none;
    a signal or several (SLURM's ``--signal=USR1@90`` warns with SIGUSR1)."""
    value = signal.SIGTERM if value is True else () if value is False or value is None else value
    out = []
    for item in [value] if isinstance(value, int) else list(value):
        if isinstance(item, bool) or not isinstance(item, int):
            raise ConfigError(
                f"take_on_preemption takes True, a signal or a list of signals, got {item!r}",
                "take_on_preemption",
            )
        try:
            out.append(signal.Signals(item))
        except ValueError as exc:
            raise ConfigError(f"{item} is not a signal", "take_on_preemption") from exc
    return tuple(dict.fromkeys(out))


def resume(
    repo: RepoStorage,
    candidates: Sequence[SnapshotInfo],
    unreadable: Mapping[str, str],
    restore: Callable[[str], object],
) -> SnapshotInfo | None:
    """The newest of ``candidates`` (oldest first) that checks cheaply
    (:func:`~casnap.ops.verify.check_snapshot`) and restores with ``restore(name)``;
    ``None`` if there are none. Only damage (:class:`IntegrityError`, a missing
    manifest) moves on to an older one, logged with why, as are the ``unreadable``;
    when none restores, :class:`IntegrityError` lists every attempt."""
    tried = [f"{name}: {reason}" for name, reason in sorted(unreadable.items())]
    for line in tried:
        log.warning("casnap: snapshot %s; it cannot be resumed from", line)
    attempted: list[str] = []
    for info in reversed(candidates):
        reason = _attempt(repo, info.name, restore)
        if reason is None:
            if tried:
                log.warning(
                    "casnap: resumed from %s (step %s) after skipping: %s. The skipped "
                    "snapshots keep their names, so their steps are not taken again",
                    info.name,
                    info.step,
                    "; ".join(tried),
                )
            if attempted:
                _warn_leftovers(repo, info.name, attempted)
            return info
        log.warning("casnap: skipping snapshot %s (step %s): %s", info.name, info.step, reason)
        tried.append(f"{info.name}: {reason}")
        attempted.append(info.name)
    if tried:
        raise IntegrityError(
            f"no snapshot in {repo.url} could be restored; tried, newest first: "
            + "; ".join(tried)
            + " (app_state may hold tensors of these attempts; run `casnap verify`)"
        )
    return None


def _attempt(repo: RepoStorage, name: str, restore: Callable[[str], object]) -> str | None:
    """``None`` if ``name`` checks and restores, else why not. Every rank tries the same
    candidates in turn, and one rank's failure counts for all."""
    reason = "; ".join(p.detail for p in check_snapshot(repo, name).problems) or None
    if reason is None:
        try:
            restore(name)
        except (IntegrityError, SnapshotNotFoundError) as exc:
            reason = f"restore failed ({type(exc).__name__}: {exc})"
    reasons = all_gather(resolve_group(None), reason, "resuming")
    failed = [(rank, r) for rank, r in enumerate(reasons) if r is not None]
    return reason or (f"failed on rank {failed[0][0]}: {failed[0][1]}" if failed else None)


def _warn_leftovers(repo: RepoStorage, chosen: str, attempted: Sequence[str]) -> None:
    """A failed attempt may have filled tensors (each whole) before it met damage; the
    chosen snapshot's restore overwrites those it holds. Name the others."""

    def tensors_of(name: str) -> set[str]:
        entries = repo.read_manifest(repo.resolve(name)).entries
        return {k for k, e in entries.items() if isinstance(e, TensorEntry)}

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


def retain(
    repo: RepoStorage,
    policy: RetentionPolicy,
    mine: set[str],
    *keep: RetentionRule,
    cache: SummaryCache | None = None,
    last: RetentionResult | None = None,
    reclaim_wait_seconds: float | None = RECLAIM_WAIT_SECONDS,
) -> RetentionResult:
    """Apply ``policy`` and ``keep`` to the snapshots ``mine``, then reclaim (unless
    ``reclaim_wait_seconds`` is None) what the retired ones and ``last``'s pending
    reached. A failed reclaim is logged and left pending for the next: freeing space
    is housekeeping, and a cut-short sweep is consistent (manifests before chunks)."""
    plan = decide_retention(repo, RetentionPolicy(*policy.rules, *keep), names=mine, cache=cache)
    result = execute_retention(repo, plan)
    earlier = last.reclaimed if last is not None else None
    retired = (earlier.pending if earlier is not None else ()) + result.retired_manifests
    if reclaim_wait_seconds is None or not retired:
        return result
    try:
        freed = reclaim(repo, retired, wait_seconds=reclaim_wait_seconds)
    except (StoreError, OSError) as exc:
        log.warning("casnap: reclaim after retention failed, retried next commit: %s", exc)
        freed = ReclaimResult(retired, pending=retired, deferred=f"failed: {exc}")
    return replace(result, reclaimed=freed)


def is_rank_zero() -> bool:
    """Whether this process copies to the mirror: one process, or rank 0 of the group."""
    return resolve_group(None).rank == 0


class Mirror:
    """Copies each commit to ``opts.mirror`` with :meth:`casnap.Repository.copy_to`,
    on one background thread: :meth:`submit` blocks only while ``queue_size`` wait.
    Failures are logged and retried with the next commit or at :meth:`flush`, never
    raised to the training loop. After each copy, ``retention`` applies in the mirror
    to the snapshots ``is_mine`` accepts; unless it is the local one too
    (``same_retention``), local retention keeps what the mirror is still owed."""

    def __init__(
        self,
        opts: CheckpointerOptions,
        retention: RetentionPolicy | None,
        is_mine: Callable[[SnapshotInfo], bool],
    ) -> None:
        dst = opts.mirror.storage if isinstance(opts.mirror, Repository) else opts.mirror
        self.url = dst.url if isinstance(dst, RepoStorage) else as_path(dst, "mirror")
        self._dst = Repository.of(dst) if isinstance(dst, RepoStorage) else None
        self.storage_options = dict(opts.mirror_storage_options or {})
        self.is_mine = is_mine
        self.same_retention = opts.mirror_retention == "same"
        own = None if self.same_retention else as_policy(opts.mirror_retention, "mirror_retention")
        self.retention = retention if self.same_retention else own
        self.reclaim = opts.reclaim
        # Jobs: a name to copy, "" to retry only what failed (flush), None to stop.
        self._queue: queue.Queue[str | None] = queue.Queue(maxsize=opts.mirror_queue)
        self._lock = threading.Lock()
        self._retry: dict[str, None] = {}  # names to copy again, in commit order
        self._owed: dict[str, None] = {}  # submitted, neither copied nor given up
        self._caught_up = False  # the copier compared the local and mirror snapshots
        self._thread: threading.Thread | None = None
        self._src: RepoStorage | None = None
        self._newest = ""  # the last submitted name, kept by the mirror's retention
        self.last_error: BaseException | None = None
        self.failing = False  # the copier's last job failed (and is retried)
        self.last_retention: RetentionResult | None = None

    @property
    def unmirrored(self) -> tuple[str, ...]:
        """Snapshots whose copy failed and waits for the next commit (or :meth:`flush`)."""
        with self._lock:
            return tuple(self._retry)

    @property
    def owed(self) -> tuple[str, ...]:
        """Snapshots not yet in the mirror: queued, being copied or waiting for a retry, and
        (once the copier looked) this checkpointer's local ones the mirror lacks."""
        with self._lock:
            return tuple(self._owed)

    def owed_here(self, names: set[str]) -> list[str] | None:
        """Those of ``names`` local retention must keep: every one until the copier has
        compared the repositories, then the owed; None on ranks but 0, which alone copies,
        so alone knows, so alone applies local retention."""
        if self.same_retention:
            return []
        if not is_rank_zero():
            return None
        with self._lock:
            owed = sorted(n for n in names if not self._caught_up or n in self._owed)
        if owed and self.failing:
            log.warning(
                "casnap: %d snapshot(s) kept here until the mirror %s has them "
                "(its last copy failed: %s)",
                len(owed),
                self.url,
                self.last_error,
            )
        return owed

    def submit(self, src: RepoStorage, name: str) -> None:
        """Queue ``name`` of ``src`` for the mirror; blocks only while the queue is full.
        Only rank 0 of a process group copies (one copier per repository)."""
        if not is_rank_zero():
            return
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="casnap-mirror", daemon=True)
            self._thread.start()
        self._src = src
        with self._lock:
            self._owed[name] = None
        self._queue.put(name)

    def flush(self) -> tuple[str, ...]:
        """Wait for the queue, retry the failed once more; return those still not copied."""
        if self._thread is None:
            return self.unmirrored
        if self.unmirrored:
            self._queue.put("")
        self._queue.join()
        return self.unmirrored

    def close(self) -> tuple[str, ...]:
        """:meth:`flush`, then stop the worker (a later :meth:`submit` starts another)."""
        left = self.flush()
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        if left:
            log.error(
                "casnap: %d snapshot(s) were not copied to the mirror %s: %s",
                len(left),
                self.url,
                ", ".join(left),
            )
        return left

    def _run(self) -> None:
        while True:
            name = self._queue.get()
            try:
                if name is None:
                    return
                self._mirror(name)
                self.failing = False
            except BaseException as exc:  # never let the worker die: log, retry next commit
                self.last_error, self.failing = exc, True
                log.warning(
                    "casnap: mirror to %s failed, retried at the next commit: %s", self.url, exc
                )
            finally:
                self._queue.task_done()

    def _destination(self, src: RepoStorage) -> Repository:
        if self._dst is None:
            storage = open_destination(self.url, self.storage_options, src, create=True)
            self._dst = Repository.of(storage)
        return self._dst

    def _catch_up(self, src: RepoStorage) -> None:
        """Before the first copy: the local snapshots the mirror lacks (which a process
        killed before its copier finished leaves) are owed too, and copied first."""
        if not self.same_retention:
            there = set(self._destination(src).snapshots())
            infos, _ = read_snapshots(src)
            missing = dict.fromkeys(
                s.name for s in infos if self.is_mine(s) and s.name not in there
            )
            with self._lock:
                self._retry, self._owed = {**missing, **self._retry}, {**missing, **self._owed}
        with self._lock:
            self._caught_up = True

    def _mirror(self, name: str) -> None:
        src = self._src
        assert src is not None  # set by submit before the job
        self._newest = name or self._newest
        if not self._caught_up:
            self._catch_up(src)  # an error: retried at the next commit, all kept meanwhile
        with self._lock:
            if name:
                self._retry[name] = None
            wanted = list(self._retry)
        # With the same policy on both, local retention may have deleted some meanwhile;
        # the mirror would drop them too.
        names = [n for n in wanted if src.has_ref(n)]
        self._settle([n for n in wanted if n not in names])
        if not names:
            return
        dst = self._destination(src)
        self._settle(self._copy(Repository.of(src), dst, names))
        if self.retention is not None:
            infos, _ = read_snapshots(dst.storage)
            mine = {s.name for s in infos if self.is_mine(s)}
            newest = KeepNames([self._newest], "newest checkpoint")
            wait = RECLAIM_WAIT_SECONDS if self.reclaim else None
            self.last_retention = retain(
                dst.storage,
                self.retention,
                mine,
                newest,
                last=self.last_retention,
                reclaim_wait_seconds=wait,
            )

    def _copy(self, src: Repository, dst: Repository, names: list[str]) -> list[str]:
        """Copy ``names``; return those copied or present. What a retry cannot help is
        logged and given up: damaged here, or held there with other content."""
        while names:
            try:
                result = src.copy_to(dst, names)
                return list(result.copied + result.present)
            except SnapshotExistsError as exc:
                log.error("casnap: mirror to %s: %s; not copied", self.url, exc)
                self.last_error = exc
                conflict = exc.name if exc.name in names else names[0]
                self._settle([conflict])
                names = [n for n in names if n != conflict]
            except SnapshotNotFoundError:
                # Local retention deleted one after the check (same policy on both): skipped.
                gone = [n for n in names if not src.storage.has_ref(n)]
                if not gone:
                    raise
                self._settle(gone)
                names = [n for n in names if n not in gone]
            except CopyIntegrityError as exc:
                log.error("casnap: mirror to %s: %s", self.url, exc)
                self.last_error = exc
                self._settle(list(exc.failed))
                return [n for n in names if n not in exc.failed]
        return []

    def _settle(self, names: Iterable[str]) -> None:
        """Neither retried nor owed any more: copied, or given up."""
        with self._lock:
            for n in names:
                self._retry.pop(n, None)
                self._owed.pop(n, None)
