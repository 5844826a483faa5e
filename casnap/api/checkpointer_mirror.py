"""The Checkpointer's mirror: each committed snapshot is copied to a second repository
in the background (fast local disk first, a durable copy after), with retention there.

:meth:`Mirror.submit` queues a name for a worker thread that copies it
(:func:`casnap.ops.copy.copy`), then applies the mirror's retention and
reclaims there; training waits only when ``queue_size`` snapshots already wait.
Failures never reach the training loop: they are logged and retried with the
next commit or at :meth:`Mirror.flush`; while a snapshot is owed to the mirror
(:attr:`Mirror.owed`) local retention keeps it. docs/copy.md, "The
Checkpointer's mirror", has the rules.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from casnap.errors import (
    CasnapError,
    ConfigError,
    CopyIntegrityError,
    SnapshotExistsError,
    SnapshotNotFoundError,
    as_path,
    expect_type,
)
from casnap.gc.reclaim import RECLAIM_WAIT_SECONDS, reclaim
from casnap.ops.copy import copy
from casnap.ops.retention import (
    RetentionPolicy,
    RetentionResult,
    RetentionRule,
    SnapshotInfo,
    execute_retention,
    plan_retention,
    read_snapshots,
)
from casnap.repo.repository import RepoStorage

log = logging.getLogger("casnap.checkpointer")


@dataclass(frozen=True)
class _Job:
    src: RepoStorage
    name: str | None  # None: only retry what failed (flush)
    policy: RetentionPolicy | None


class Mirror:
    """Copies committed snapshots from the checkpointer's repository to ``url``.

    ``retention``: applied in the mirror, to the snapshots ``is_mine`` accepts,
    after each copy (the checkpointer passes its own policy, with its newest
    snapshot kept). ``same_retention``: whether that is the local repository's
    policy too (then local retention need not wait for the copier).
    ``queue_size``: snapshots that may wait for the worker before
    :meth:`submit` blocks.
    """

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None,
        is_mine: Callable[[SnapshotInfo], bool],
        *,
        retention: RetentionPolicy | None = None,
        queue_size: int = 2,
        reclaim: bool = True,
        same_retention: bool = False,
    ) -> None:
        expect_type(url, str, "mirror", "a repository URL such as 'gs://bucket/run1'")
        expect_type(queue_size, int, "mirror_queue", "a positive int")
        if queue_size < 1:
            raise ConfigError(f"mirror_queue must be at least 1, got {queue_size}", "mirror_queue")
        self.url = url
        self.retention = retention
        self.same_retention = same_retention
        self.storage_options = dict(storage_options or {})
        self.is_mine = is_mine
        self.reclaim = reclaim
        self._queue: queue.Queue[_Job | None] = queue.Queue(maxsize=queue_size)
        self._retry: dict[str, None] = {}  # names to copy again, in commit order
        self._owed: dict[str, None] = {}  # submitted, neither copied nor given up
        self._caught_up = False  # the copier compared the local and mirror snapshots
        self._dst: RepoStorage | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.copied: list[str] = []  # every snapshot the mirror received, in order
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
        """Snapshots not yet in the mirror: queued, being copied, or waiting for a retry,
        and (once the copier looked) this checkpointer's local ones the mirror lacks.
        A snapshot found damaged locally, or taken in the mirror by other content, is
        given up."""
        with self._lock:
            return tuple(self._owed)

    def owed_of(self, names: Iterable[str]) -> tuple[str, ...]:
        """Those of ``names`` local retention must keep for the mirror: every one until
        the copier has compared the two repositories (its first job), then the owed."""
        with self._lock:
            if not self._caught_up and not self.same_retention:
                return tuple(names)
            return tuple(n for n in names if n in self._owed)

    def submit(self, src: RepoStorage, name: str, policy: RetentionPolicy | None) -> None:
        """Queue ``name`` of ``src`` for the mirror; blocks only while the queue is full."""
        self._start()
        with self._lock:
            self._owed[name] = None
        self._queue.put(_Job(src, name, policy))

    def flush(self) -> tuple[str, ...]:
        """Wait until every queued snapshot was tried, retry the failed ones once more, and
        return those still not mirrored (each was logged)."""
        if self._thread is None:
            return self.unmirrored
        if self.unmirrored:
            self._queue.put(_Job(self._last_src, None, self._last_policy))
        self._queue.join()
        return self.unmirrored

    def close(self) -> tuple[str, ...]:
        """:meth:`flush`, then stop the worker (a later :meth:`submit` starts another)."""
        left = self.flush()
        thread = self._thread
        if thread is not None:
            self._queue.put(None)
            thread.join()
            self._thread = None
        if left:
            log.error(
                "casnap: %d snapshot(s) were not copied to the mirror %s: %s",
                len(left),
                self.url,
                ", ".join(left),
            )
        return left

    # -- the worker ------------------------------------------------------------
    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="casnap-mirror", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                self._last_src, self._last_policy = job.src, job.policy
                self._mirror(job)
                self.failing = False
            except BaseException as exc:  # never let the worker die: log, retry next commit
                self.last_error = exc
                self.failing = True
                log.warning(
                    "casnap: mirror to %s failed, retried at the next commit: %s", self.url, exc
                )
            finally:
                self._queue.task_done()

    _last_src: RepoStorage
    _last_policy: RetentionPolicy | None = None

    def _destination(self, src: RepoStorage) -> RepoStorage:
        if self._dst is None:
            self._dst = RepoStorage.open_or_create(
                self.url, self.storage_options, chunk_size=src.config.chunk_size
            )
        return self._dst

    def _catch_up(self, src: RepoStorage) -> None:
        """Once per process, before its first copy: this checkpointer's local snapshots
        that the mirror lacks are owed too. A process that ended (a preemption, a
        crash) before its copier finished left them, and with a retention of its
        own the mirror may be meant to keep them; they are copied first."""
        if not self.same_retention:
            there = set(self._destination(src).list_snapshots())
            infos, _ = read_snapshots(src)
            missing = [s.name for s in infos if self.is_mine(s) and s.name not in there]
            with self._lock:
                self._retry = {**dict.fromkeys(missing), **self._retry}
                self._owed = {**dict.fromkeys(missing), **self._owed}
        with self._lock:
            self._caught_up = True

    def _mirror(self, job: _Job) -> None:
        if not self._caught_up:
            self._catch_up(job.src)  # an error: retried at the next commit, all kept meanwhile
        with self._lock:
            if job.name is not None:
                self._retry[job.name] = None
            wanted = list(self._retry)
        # Local retention keeps what the mirror is owed unless the same policy applies
        # on both; then it may have deleted some meanwhile, and the mirror drops them too.
        names = [n for n in wanted if job.src.has_ref(n)]
        self._settle([n for n in wanted if n not in names])
        if not names:
            return
        dst = self._destination(job.src)
        done: list[str] = []
        while names:
            try:
                result = copy(job.src, dst, names)
                done = list(result.copied + result.present)
                break
            except SnapshotExistsError as exc:
                # The mirror holds that name with other content (e.g. a run restarted
                # from the mirror into a fresh local folder): retrying cannot help, and
                # it must not hold back the others.
                log.error("casnap: mirror to %s: %s; not copied", self.url, exc)
                self.last_error = exc
                conflict = exc.name if exc.name in names else names[0]
                self._settle([conflict])
                names = [n for n in names if n != conflict]
            except SnapshotNotFoundError:
                # Local retention deleted one after the check above (same policy on both):
                # skipped, as the mirror's retention would drop it too.
                gone = [n for n in names if not job.src.has_ref(n)]
                if not gone:
                    raise
                self._settle(gone)
                names = [n for n in names if n not in gone]
            except CopyIntegrityError as exc:  # damaged locally: retrying cannot help
                log.error("casnap: mirror to %s: %s", self.url, exc)
                self.last_error = exc
                done = [n for n in names if n not in exc.failed]
                self._settle(list(exc.failed))
                break
        self._settle(done)
        with self._lock:
            self.copied += [n for n in done if n not in self.copied]
        if job.policy is not None:
            self._retain(dst, job.policy)

    def _settle(self, names: list[str]) -> None:
        """Neither retried nor owed any more: copied, or given up (gone locally,
        damaged, or taken there by other content)."""
        with self._lock:
            for n in names:
                self._retry.pop(n, None)
                self._owed.pop(n, None)

    def _retain(self, dst: RepoStorage, policy: RetentionPolicy) -> None:
        infos, _ = read_snapshots(dst)
        mine = {s.name for s in infos if self.is_mine(s)}
        plan = plan_retention(dst, policy, names=mine)
        result = execute_retention(dst, plan)
        if self.reclaim and result.retired_manifests:
            try:
                reclaim(dst, result.retired_manifests, wait_seconds=RECLAIM_WAIT_SECONDS)
            except CasnapError as exc:  # housekeeping: the next gc of the mirror frees it
                log.warning("casnap: reclaim in mirror %s failed: %s", self.url, exc)
        self.last_retention = result


def make_mirror(
    url: str | RepoStorage | None,
    storage_options: dict[str, Any] | None,
    retention: RetentionPolicy | None,
    mirror_retention: RetentionPolicy | RetentionRule | None | str,
    is_mine: Callable[[SnapshotInfo], bool],
    *,
    queue_size: int,
    reclaim: bool,
) -> Mirror | None:
    """The Checkpointer's mirror from its options (None without ``mirror``);
    ``mirror_retention="same"`` is the checkpointer's own ``retention``."""
    if url is None:
        return None
    if isinstance(url, RepoStorage):  # an open repository (a store of the caller's choosing)
        mirror = make_mirror(
            url.url,
            storage_options,
            retention,
            mirror_retention,
            is_mine,
            queue_size=queue_size,
            reclaim=reclaim,
        )
        assert mirror is not None
        mirror._dst = url
        return mirror
    same = isinstance(mirror_retention, str)
    if isinstance(mirror_retention, str):
        if mirror_retention != "same":
            raise ConfigError(
                f"mirror_retention must be a RetentionPolicy, None or 'same', got "
                f"{mirror_retention!r}",
                "mirror_retention",
            )
        mirror_retention = retention
    elif isinstance(mirror_retention, RetentionRule):
        mirror_retention = RetentionPolicy(mirror_retention)
    elif mirror_retention is not None:
        expect_type(
            mirror_retention,
            RetentionPolicy,
            "mirror_retention",
            "a casnap.RetentionPolicy, None or 'same'",
        )
    return Mirror(
        as_path(url, "mirror"),
        storage_options,
        is_mine,
        retention=mirror_retention,
        queue_size=queue_size,
        reclaim=reclaim,
        same_retention=same,
    )


def is_rank_zero() -> bool:
    """Whether this process copies to the mirror: one process, or rank 0 of the group."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
