"""The distributed take: every rank of the group calls :func:`prepare_distributed_take`.

Order of events (docs/distributed.md):

1. start (collective): rank 0 opens or creates the repository, checks the name
   is free, picks the parents and acquires the take's single lease; the other
   ranks open the repository only after the lease is held, so no rank makes
   a dedup decision outside it.
2. planning (collective): every rank flattens its state, hashes its chunks and
   shares the hashes (and its structure, unless the previous take's still
   holds: casnap/distributed/plan_cache.py); every rank computes the same
   writer assignment, and replicated values that differ fail the take here,
   before anything is written. An async take then copies the chunks this
   rank writes into pooled buffers, up to its memory budget, and writes the
   rest before returning (casnap/distributed/staged.py).
3. commit (store only; in the background for ``async_take``): each rank writes
   its assigned chunks, flushes them and posts their locations; rank 0 waits
   for all ranks, writes the manifest and the ref, and posts the outcome.

A failure on any rank in any phase makes every rank raise
:class:`DistributedTakeError` naming the failed ranks; no ref is written.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from casnap.chunks.io import ChunkWriter, WriteStats
from casnap.distributed.group import (
    DistributedTakeError,
    Failure,
    Group,
    Rendezvous,
    all_gather,
    dist_timeout,
    failure_of,
    raise_failures,
)
from casnap.distributed.plan import (
    LocalData,
    RankPlan,
    assign,
    build_entries,
    build_local,
    check_replicas,
)
from casnap.distributed.plan_cache import CacheKey, exchange_plans
from casnap.distributed.staged import stage_chunks
from casnap.format.manifest import ChunkRef, Manifest
from casnap.index import KnownChunks
from casnap.repo.leases import Lease, acquire_lease
from casnap.repo.repository import RepoStorage, locate, now_iso
from casnap.settings import Settings, default_memory_budget, io_workers_for
from casnap.take.commit import commit_snapshot, remember
from casnap.take.job import (
    TakeResult,
    TensorPrepareFunc,
    collect,
    resolve_target,
    staging_limit,
)
from casnap.take.plan import known_chunks
from casnap.take.session import Session
from casnap.torch_io.staging import StagingPool


@dataclass(frozen=True)
class _Start:
    take_id: str
    name: str
    chunk_size: int
    parents: list[str]
    metadata: dict[str, Any]


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


def _settings(storage_options: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    options = dict(storage_options or {})
    overrides: dict[str, Any] = {
        k: options.pop(k) for k in ("chunk_size", "compression") if k in options
    }
    return options, overrides


def _start(
    path: str,
    storage_options: dict[str, Any] | None,
    metadata: dict[str, Any] | None,
    parents: list[str] | None,
    session: Session | None,
) -> tuple[RepoStorage, _Start, Lease]:
    """Rank 0's part of phase 1."""
    target = resolve_target(path, storage_options, metadata, parents, session)
    repo, name, chunk = target.repo, target.name, target.settings.chunk_size
    parents, meta = target.parents, target.metadata
    lease = acquire_lease(repo.store, kind="take")
    return repo, _Start(uuid.uuid4().hex, name, chunk, list(parents), meta), lease


def ddp_patterns(app_state: Mapping[str, Any]) -> list[str]:
    """Globs for app_state entries wrapped in DistributedDataParallel (inferred replicated)."""
    from torch.nn.parallel import DistributedDataParallel

    from casnap.format.names import escape_key

    return [f"{escape_key(k)}/**" for k, v in app_state.items()
            if isinstance(v, DistributedDataParallel)]  # fmt: skip


def prepare_distributed_take(
    path: str,
    app_state: Mapping[str, Any],
    *,
    group: Group,
    replicated: list[str] | None,
    storage_options: dict[str, Any] | None,
    metadata: dict[str, Any] | None,
    allow_pickle: bool,
    parents: list[str] | None,
    stage: bool,
    custom_prepare: TensorPrepareFunc | None = None,
    store: Any = None,
    memory_budget_bytes: int | None = None,
    session: Session | None = None,
) -> Callable[[], TakeResult]:
    """Phases 1 and 2 (collective, every rank); returns phase 3 to run now or in the background.

    ``stage=True`` (async) copies the chunks this rank writes, or writes them
    now past the staging share of ``memory_budget_bytes`` (default
    ``CASNAP_MEMORY_BUDGET``), so the snapshot is point-in-time when this returns.
    """
    lease: Lease | None = None
    start: _Start | Failure | None = None
    repo: RepoStorage | None = None
    try:
        if group.rank == 0:
            try:
                repo, start, lease = _start(path, storage_options, metadata, parents, session)
            except Exception as exc:
                start = failure_of(0, exc)
        starts = all_gather(group, start, "start")
        info = starts[0]
        assert isinstance(info, _Start)
        options, overrides = _settings(storage_options)
        plan: RankPlan | Failure
        local = LocalData()
        key: CacheKey | None = None
        try:
            if repo is None:
                repo, _ = locate(path, options, create=False)
            overrides["chunk_size"] = info.chunk_size
            if "CASNAP_IO_WORKERS" not in os.environ:
                overrides["io_workers"] = io_workers_for(repo.root.capabilities.local)
            settings = Settings.from_env().with_overrides(**overrides)
            nodes = collect(app_state, group.rank, allow_pickle, custom_prepare)
            patterns = list(replicated or []) + ddp_patterns(app_state)
            plan, local = build_local(nodes, group.rank, info.chunk_size, patterns)
            key = (group.size, group.rank, repo.config.repo_id)
        except Exception as exc:
            plan = failure_of(group.rank, exc)
        plans = exchange_plans(group, plan, key, session.plan_cache if session else None)
        check_replicas(plans)
        writers, _load = assign(plans)
    except BaseException:
        if lease is not None:
            lease.release()
        raise
    assert repo is not None
    mine = sorted(h for h, r in writers.items() if r == group.rank)
    local.keep(mine)
    rendezvous = Rendezvous(group, info.take_id, store)
    pool = session.staging if session is not None else StagingPool(idle_limit=0)
    job = _Commit(group, repo, settings, info, plans, local, mine, rendezvous, lease, session, pool)
    if stage:
        job.stage(staging_limit(memory_budget_bytes or default_memory_budget(), settings))
    return job.run


@dataclass
class _Commit:
    group: Group
    repo: RepoStorage
    settings: Settings
    info: _Start
    plans: list[RankPlan]
    local: LocalData
    mine: list[str]
    rendezvous: Rendezvous
    lease: Lease | None
    session: Session | None
    pool: StagingPool  # the session's, or a private one without a session
    buffers: list[torch.Tensor] = field(default_factory=list)  # staged: back to the pool
    early: _Written | Failure | None = None  # the overflow, written before async_take returned
    _known: KnownChunks | None = None

    def stage(self, limit: int) -> None:
        """Async, caller's thread: copy what the background writes, write the overflow now.

        A failure here is reported by :meth:`run` like a background one, so the
        other ranks (already past the collectives) learn of it through the store.
        """
        try:
            staged = stage_chunks(self.local, self.mine, limit, self.pool)
            self.buffers = staged.buffers
            if staged.overflow:
                self.early = self._write(staged.overflow, flush=False)
                done = set(staged.overflow)
                self.mine = [h for h in self.mine if h not in done]
                self.local.keep(self.mine)
        except Exception as exc:
            self.early = failure_of(self.group.rank, exc)

    def run(self) -> TakeResult:
        """Phase 3: synchronises through the store only (safe in a background thread)."""
        try:
            written = self._write_rest()
            self.rendezvous.post("written", self.group.rank, written)
            if self.group.rank == 0:
                return self._commit_rank0()
            stats = written.stats if isinstance(written, _Written) else WriteStats()
            return self._await_commit(stats)
        finally:
            if self.lease is not None:
                self.lease.release()

    def _write_rest(self) -> _Written | Failure:
        """Write what :meth:`stage` left (everything for a blocking take); release the copies."""
        try:
            if isinstance(self.early, Failure):
                return self.early
            written = self._write(self.mine, flush=True)
            return written if self.early is None else _merged(self.early, written)
        except Exception as exc:
            return failure_of(self.group.rank, exc)
        finally:
            self.local = LocalData()
            buffers, self.buffers = self.buffers, []
            self.pool.give_back(buffers)

    def _write(self, hashes: list[str], flush: bool) -> _Written:
        if self._known is None:
            last_plan = self.session.last_plan if self.session is not None else None
            self._known = known_chunks(self.repo, self.info.parents, last_plan)
        with ThreadPoolExecutor(self.settings.io_workers, thread_name_prefix="casnap-w") as pool:
            writer = ChunkWriter(self.repo, self.settings, pool, self._known)
            chunks = [(self.local.chunks[h], bytes.fromhex(h)) for h in hashes]
            futures = writer.add_digested(chunks)
            refs = writer.finish(futures)
        if flush:
            self.repo.store.flush()  # this rank's chunks are durable before rank 0 commits
        return _Written({r.hash: r for r in refs}, writer.stats)

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
            manifest = Manifest(
                created_at=now_iso(),
                world_size=self.group.size,
                parents=self.info.parents,
                metadata=self.info.metadata,
                entries=build_entries(self.plans, refs),
            )
            manifest_hash = commit_snapshot(
                self.repo, self.info.name, manifest, lease=self.lease, session=self.session
            )
        except Exception as exc:
            self.rendezvous.post("done", 0, _Failed([failure_of(0, exc)], []))
            raise
        self.rendezvous.post("done", 0, _Done(manifest_hash, per_rank))
        return TakeResult(self.repo, self.info.name, manifest_hash, manifest,
                          per_rank[0], per_rank)  # fmt: skip

    def _await_commit(self, stats: WriteStats) -> TakeResult:
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
        return TakeResult(self.repo, self.info.name, done.manifest_hash, manifest,
                          done.stats[self.group.rank], done.stats)  # fmt: skip


def _merged(a: _Written, b: _Written) -> _Written:
    """The chunks and stats of two writes of one rank (overflow, then background)."""
    stats = WriteStats(**{f.name: getattr(a.stats, f.name) + getattr(b.stats, f.name)
                          for f in fields(WriteStats)})  # fmt: skip
    return _Written({**a.refs, **b.refs}, stats)


def _raise(failures: list[Failure], missing: list[int]) -> None:
    if missing and not failures:
        raise DistributedTakeError(
            f"distributed take failed: rank(s) {missing} did not finish writing within "
            f"{dist_timeout():.0f}s (CASNAP_DIST_TIMEOUT); no snapshot was committed",
            tuple(missing),
        )
    raise_failures(failures, "writing")
