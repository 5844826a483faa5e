"""The distributed take: every rank of the group calls :func:`prepare_distributed_take`.

Its phases (start, planning, commit) are in docs/distributed.md, "The take,
step by step": rank 0 holds the take's single lease before any rank decides
dedup, every rank computes the same writer assignment from the shared plans
(:mod:`casnap.distributed.plan_cache`, :mod:`casnap.distributed.replica_check`),
and rank 0 commits with the same :func:`~casnap.take.commit.commit_snapshot` as
a single process. A failure on any rank in any phase makes every rank raise
:class:`DistributedTakeError` naming the failed ranks; no ref is written.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from casnap.chunks.budget import ByteBudget, check_budget
from casnap.chunks.frames import WriteStats
from casnap.chunks.write import ChunkWriter
from casnap.distributed.coordinate import Planned, assemble_entries, coordinate, manifest_of
from casnap.distributed.group import (
    Failure,
    Group,
    Rendezvous,
    all_gather,
    failure_of,
    raise_failures,
)
from casnap.distributed.plan import LocalData, build_local
from casnap.distributed.plan_cache import CacheKey, exchange_plans
from casnap.errors import DistributedTakeError
from casnap.format.entries import ChunkRef
from casnap.repo.leases import Lease, acquire_lease
from casnap.repo.repository import RepoStorage
from casnap.settings import Settings, dist_timeout
from casnap.take.commit import commit_snapshot, remember
from casnap.take.job import TakeResult
from casnap.take.plan import RankPlan, cached_parent, known_chunks
from casnap.take.scheduler import Scheduler, WriteRequest, data_request, stage
from casnap.take.session import Session, staging_of
from casnap.take.target import (
    TakeOptions,
    TensorPrepareFunc,
    collect,
    resolve_target,
    staging_limit,
    take_settings,
)
from casnap.torch_io.flatten import Node
from casnap.torch_io.staging import StagingPool


@dataclass(frozen=True)
class _Start:
    take_id: str
    name: str
    chunk_size: int
    replica_mismatch: str  # rank 0's setting: every rank must decide alike
    parents: list[str]
    metadata: dict[str, Any]
    fresh: bool  # rank 0 created the repository: no rank probes for chunks


@dataclass(frozen=True)
class _Written:
    refs: dict[str, ChunkRef]
    stats: WriteStats


@dataclass(frozen=True)
class _Done:
    manifest_hash: str
    stats: list[WriteStats]


@dataclass(frozen=True)
class _Failed:
    failures: list[Failure]
    missing: list[int]


def _start(
    path: str,
    options: TakeOptions,
    metadata: dict[str, Any] | None,
    parents: list[str] | None,
    session: Session | None,
) -> tuple[RepoStorage, _Start, Lease]:
    """Rank 0's part of phase 1."""
    target = resolve_target(path, options, metadata, parents, session)
    repo, name, chunk = target.repo, target.name, target.settings.chunk_size
    meta = target.metadata
    lease = acquire_lease(repo.store, kind="take")
    try:  # under the lease, as a single-process take (casnap.take.parent)
        parents = target.parents.choose(repo, name)
    except BaseException:
        lease.release()
        raise
    mismatch = target.settings.replica_mismatch
    start = _Start(uuid.uuid4().hex, name, chunk, mismatch, list(parents), meta, target.fresh)
    return repo, start, lease


def ddp_patterns(app_state: Mapping[str, Any]) -> list[str]:
    """Globs for app_state entries wrapped in DistributedDataParallel (inferred replicated)."""
    from torch.nn.parallel import DistributedDataParallel

    from casnap.format.names import escape_key

    return [
        f"{escape_key(k)}/**"
        for k, v in app_state.items()
        if isinstance(v, DistributedDataParallel)
    ]


def prepare_distributed_take(
    path: str,
    app_state: Mapping[str, Any],
    *,
    group: Group,
    replicated: list[str] | None,
    options: TakeOptions,
    metadata: dict[str, Any] | None,
    allow_pickle: bool,
    parents: list[str] | None,
    stage: bool,
    custom_prepare: TensorPrepareFunc | None = None,
    store: Any = None,
    memory_budget_bytes: int | None = None,
    session: Session | None = None,
) -> DistributedJob:
    """Phases 1 and 2 (collective, every rank); returns phase 3 (:meth:`DistributedJob.run`)
    to run now or in the background.

    ``stage=True`` (async) copies the chunks this rank writes into the
    session's pool (without one, the process's), up to the staging share of
    ``memory_budget_bytes`` (default ``CASNAP_MEMORY_BUDGET``); the rest stay
    live, are written first, and the caller waits for :attr:`DistributedJob.live_consumed` so the
    snapshot is point-in-time when ``async_take`` returns.
    """
    lease: Lease | None = None
    start: _Start | Failure | None = None
    repo: RepoStorage | None = None
    # Each rank's state first: rank 0 creates nothing for a state it cannot take.
    nodes: dict[str, Node] | Failure
    try:
        nodes = collect(app_state, group.rank, allow_pickle, custom_prepare)
    except Exception as exc:
        nodes = failure_of(group.rank, exc)
    try:
        if group.rank == 0:
            if isinstance(nodes, Failure):
                start = nodes
            else:
                try:
                    repo, start, lease = _start(path, options, metadata, parents, session)
                except Exception as exc:
                    start = failure_of(0, exc)
        starts = all_gather(group, start, "start")
        info = starts[0]
        assert isinstance(info, _Start)
        plan: RankPlan | Failure
        local = LocalData()
        key: CacheKey | None = None
        try:
            if repo is None:
                repo, _ = options.locate(path, create=False)
            settings = take_settings(repo, options.settings, chunk_size=info.chunk_size)
            if isinstance(nodes, Failure):
                plan = nodes  # reported to every rank by the exchange
            else:
                patterns = list(replicated or []) + ddp_patterns(app_state)
                plan, local = build_local(nodes, group.rank, info.chunk_size, patterns)
                key = (group.size, group.rank, repo.config.repo_id)
        except Exception as exc:
            plan = failure_of(group.rank, exc)
        gathered = exchange_plans(group, plan, key, session.plan_cache if session else None)
        planned = coordinate(gathered, info.replica_mismatch)
        writers = planned.writers
    except BaseException:
        if lease is not None:
            lease.release()
        raise
    assert repo is not None
    mine = sorted(h for h, r in writers.items() if r == group.rank)
    local.keep(mine)
    # A check id is no hash: the writer hashes that chunk (the ref it posts names the hash).
    requests = [
        data_request(
            h,
            local.chunks[h],
            local.owners[h],
            live=h in local.live,
            digests=None if h in local.checked else [bytes.fromhex(h)],
        )
        for h in mine
    ]
    budget = ByteBudget(check_budget(memory_budget_bytes))
    pool = staging_of(session)
    job = DistributedJob(
        group,
        repo,
        settings,
        info,
        planned,
        requests,
        budget,
        Rendezvous(group, info.take_id, store),
        lease,
        session,
        pool,
    )
    local.keep([])  # the requests hold what this rank writes; nothing else is needed
    if stage:
        job.stage(staging_limit(budget.limit, settings))
    else:
        job.live_consumed.set()
    return job


@dataclass
class DistributedJob:
    """Phase 3 of a distributed take on one rank: write, then commit through rank 0."""

    group: Group
    repo: RepoStorage
    settings: Settings
    info: _Start
    planned: Planned
    requests: list[WriteRequest]  # the chunks this rank writes
    budget: ByteBudget
    rendezvous: Rendezvous
    lease: Lease | None
    session: Session | None
    pool: StagingPool  # the session's, or the process's without a session
    buffers: list[torch.Tensor] = field(default_factory=list)  # staged: back to the pool
    failed: Failure | None = None  # staging failed: reported by run(), like a write failure
    # Set once every live request's chunks are consumed (at once when there are none).
    live_consumed: threading.Event = field(default_factory=threading.Event)
    progress: Callable[[int, int], None] | None = None  # this rank's (done, total) bytes

    def stage(self, limit: int) -> None:
        """Async, caller's thread: copy what the background writes, as far as ``limit`` allows.

        Chunks past it stay live; the background writes them first and
        ``async_take`` waits for that. A failure here is reported by
        :meth:`run` like a background one, so the other ranks (already past
        the collectives) learn of it through the store.
        """
        try:
            staged = stage(self.requests, limit, self.pool)
            self.requests, self.buffers = staged.requests, staged.buffers
        except Exception as exc:
            self.failed = failure_of(self.group.rank, exc)
        if self.failed is not None or not any(r.live for r in self.requests):
            self.live_consumed.set()

    def run(self) -> TakeResult:
        """Phase 3: synchronises through the store only (safe in a background thread)."""
        try:
            written = self._write()
            self.rendezvous.post("written", self.group.rank, written)
            if self.group.rank == 0:
                return self._commit_rank0()
            return self._await_commit()
        finally:
            self.live_consumed.set()  # also on failure: the caller must not hang
            if self.lease is not None:
                self.lease.release()

    def _write(self) -> _Written | Failure:
        """Write this rank's chunks and flush them; release the staged copies either way."""
        try:
            if self.failed is not None:
                return self.failed
            known = known_chunks(self.repo, self.info.parents, self.info.fresh)
            workers = self.settings.io_workers
            with ThreadPoolExecutor(workers, thread_name_prefix="casnap-w") as pool:
                writer = ChunkWriter(self.repo, self.settings, pool, known)
                scheduler = Scheduler(
                    writer, self.settings, self.budget, self.live_consumed, self.progress
                )
                written = scheduler.run(self.requests)
            self.repo.store.flush()  # this rank's chunks are durable before rank 0 commits
            return _Written({h: refs[0] for h, refs in written.items()}, writer.stats)
        except Exception as exc:
            return failure_of(self.group.rank, exc)
        finally:
            self.requests = []
            buffers, self.buffers = self.buffers, []
            self.pool.give_back(buffers)

    def _commit_rank0(self) -> TakeResult:
        ranks = list(range(self.group.size))
        got, missing = self.rendezvous.collect("written", ranks, dist_timeout())
        failures = [v for v in got.values() if isinstance(v, Failure)]
        if failures or missing:
            self.rendezvous.post("done", 0, _Failed(failures, missing))
            _raise(failures, missing)
        try:
            refs: dict[str, ChunkRef] = {}
            per_rank: list[WriteStats] = []
            for r in ranks:
                w = got[r]
                assert isinstance(w, _Written)
                refs.update(w.refs)
                per_rank.append(w.stats)
            previous, dumped = cached_parent(self.repo, self.info.parents)
            entries = assemble_entries(self.planned, refs, previous)
            manifest = manifest_of(entries, self.group.size, self.info.parents, self.info.metadata)
            manifest_hash, manifest = commit_snapshot(
                self.repo,
                self.info.name,
                manifest,
                lease=self.lease,
                session=self.session,
                previous=dumped,
            )
        except Exception as exc:
            self.rendezvous.post("done", 0, _Failed([failure_of(0, exc)], []))
            raise
        self.rendezvous.post("done", 0, _Done(manifest_hash, per_rank))
        return TakeResult(self.repo, self.info.name, manifest_hash, manifest, per_rank[0], per_rank)

    def _await_commit(self) -> TakeResult:
        # Rank 0 waits up to the timeout for the others, then commits: allow both.
        got, _ = self.rendezvous.collect("done", [0], 2 * dist_timeout() + 30)
        done = got.get(0)
        if done is None:
            raise DistributedTakeError(
                "distributed take failed: rank 0 did not report the commit in time; "
                "the snapshot may or may not have been committed",
                (0,),
            )
        if isinstance(done, _Failed):
            _raise(done.failures, done.missing)
        assert isinstance(done, _Done)
        manifest = self.repo.read_manifest(done.manifest_hash)
        remember(self.repo, done.manifest_hash, manifest, self.session)
        return TakeResult(
            self.repo,
            self.info.name,
            done.manifest_hash,
            manifest,
            done.stats[self.group.rank],
            done.stats,
        )


def _raise(failures: list[Failure], missing: list[int]) -> None:
    if missing and not failures:
        raise DistributedTakeError(
            f"distributed take failed: rank(s) {missing} did not finish writing within "
            f"{dist_timeout():.0f}s (CASNAP_DIST_TIMEOUT); no snapshot was committed",
            tuple(missing),
        )
    raise_failures(failures, "writing")
