"""A take in one process: a world of one, through the pipeline every take shares.

A take runs in two phases:

1. ``prepare`` (always in the caller's thread): find the repository, check
   the name is free, call every ``state_dict()``, flatten
   (:mod:`casnap.take.target`), turn the values into write requests and,
   for an async take, stage them into pooled host buffers (the session's,
   else the process's: :func:`casnap.take.session.staging_of`) as far as
   the memory budget allows (:func:`casnap.take.scheduler.stage`); the rest
   stay "live".
2. ``commit`` (caller's thread, or a background thread for async): inside
   the take's lease, run the requests through the scheduler (chunks
   deduplicated, packed, written; live ones first), build the entries from
   the plan (:func:`casnap.take.plan.build_entries`) and commit
   (:func:`casnap.take.commit.commit_snapshot`). ``async_take`` returns
   once every chunk of a live request has been consumed
   (:attr:`TakeJob.live_consumed`): the snapshot is point-in-time when it
   returns, and staging never exceeds the budget.

The distributed take (:mod:`casnap.distributed.take`) is the same pipeline
with a planning exchange between the phases.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from casnap.chunks.budget import ByteBudget, check_budget
from casnap.chunks.frames import WriteStats
from casnap.chunks.write import ChunkWriter
from casnap.errors import UnsupportedValueError
from casnap.format.entries import ChunkRef, ContainerEntry, Entry, PrimitiveEntry, TensorEntry
from casnap.format.manifest import Manifest, same_entries
from casnap.format.manifest_bytes import trusted_manifest
from casnap.python_gc import python_gc_paused
from casnap.repo.leases import Lease, hold_lease
from casnap.repo.repository import RepoStorage, now_iso
from casnap.settings import Settings
from casnap.take.commit import commit_snapshot
from casnap.take.parent import ParentRule
from casnap.take.plan import (
    EntryPlan,
    ObjectPlan,
    RankPlan,
    build_entries,
    cached_parent,
    is_replicated,
    known_chunks,
    tensor_entry,
)
from casnap.take.scheduler import (
    Scheduler,
    WriteRequest,
    Written,
    data_request,
    stage,
    tensor_request,
)
from casnap.take.session import Session, staging_of
from casnap.take.target import (
    TakeOptions,
    Target,
    TensorPrepareFunc,
    collect,
    resolve_target,
    staging_limit,
)
from casnap.torch_io.flatten import Node, ObjectLeaf, TensorLeaf
from casnap.torch_io.staging import StagingPool
from casnap.torch_io.tensors import dtype_name


@dataclass
class TakeResult:
    repo: RepoStorage
    name: str
    manifest_hash: str
    manifest: Manifest
    stats: WriteStats  # this rank's writes
    rank_stats: list[WriteStats] | None = None  # every rank's, for a distributed take


@dataclass
class TakeJob:
    """Phase 2 of a single-process take, prepared by :func:`prepare_take`."""

    repo: RepoStorage
    name: str
    nodes: dict[str, Node]
    requests: list[WriteRequest]
    settings: Settings
    rule: ParentRule  # what the parents will be, chosen under the lease (casnap.take.parent)
    metadata: dict[str, Any]
    budget: ByteBudget
    session: Session | None
    pool: StagingPool  # the session's, or the process's without a session
    replicated: list[str] = field(default_factory=list)  # fnmatch patterns of logical keys
    fresh: bool = False  # the take created the repository: nothing to probe for
    parents: list[str] = field(default_factory=list)  # chosen by ``rule`` under the lease
    buffers: list[torch.Tensor] = field(default_factory=list)  # staged: back to the pool
    # Set once every live request's chunks are consumed (at once when there are none).
    live_consumed: threading.Event = field(default_factory=threading.Event)
    progress: Callable[[int, int], None] | None = None  # (done_bytes, total_bytes) written
    # The caller waits for the whole commit (a blocking take) and holds the collector's
    # pause throughout. An async take's commit pauses it only for its per-entry steps
    # after the writes, not while training runs beside a long write (casnap.python_gc).
    blocking: bool = False

    @classmethod
    def of(
        cls,
        target: Target,
        nodes: dict[str, Node],
        requests: list[WriteRequest],
        budget: ByteBudget,
        session: Session | None,
        pool: StagingPool,
        **rest: Any,
    ) -> TakeJob:
        """A job writing to ``target``: its repository, name, settings, parents and flags."""
        return cls(
            target.repo,
            target.name,
            nodes,
            requests,
            target.settings,
            target.parents,
            target.metadata,
            budget,
            session,
            pool,
            fresh=target.fresh,
            **rest,
        )

    def run(self) -> TakeResult:
        """Write, then commit; the staging buffers go back to the pool either way."""
        try:
            return self._commit()
        finally:
            self.live_consumed.set()  # also on failure: the caller must not hang
            buffers, self.buffers = self.buffers, []
            self.nodes, self.requests = {}, []
            self.pool.give_back(buffers)

    def _commit(self) -> TakeResult:
        # From before the first dedup decision until the ref makes every chunk it
        # names reachable, the lease keeps gc from sweeping (docs/gc.md).
        with hold_lease(self.repo, kind="take") as lease:
            self.parents = self.rule.choose(self.repo, self.name)
            known = known_chunks(self.repo, self.parents, self.fresh)
            workers = self.settings.io_workers
            with ThreadPoolExecutor(workers, thread_name_prefix="casnap-w") as pool:
                writer = ChunkWriter(self.repo, self.settings, pool, known)
                scheduler = Scheduler(
                    writer,
                    self.settings,
                    self.budget,
                    self.live_consumed,
                    self.progress,
                    self.pool,
                    sum(b.numel() * b.element_size() for b in self.buffers),
                )
                written = scheduler.run(self.requests)
            # A blocking take's caller holds the pause throughout (Snapshot.take); an
            # async one pauses only its per-entry steps, not the writes beside training.
            with nullcontext() if self.blocking else python_gc_paused():
                manifest, manifest_hash = self._commit_entries(written, lease)
        return TakeResult(self.repo, self.name, manifest_hash, manifest, writer.stats)

    def _commit_entries(self, written: Written, lease: Lease) -> tuple[Manifest, str]:
        """Every entry and the manifest, from what the scheduler wrote; then the commit."""
        previous, dumped = cached_parent(self.repo, self.parents)
        plan, tensors, by_hash = _plan_of(
            self.nodes, written, self.settings.chunk_size, self.replicated, previous
        )
        others = build_entries([plan], by_hash, previous)
        entries = {k: tensors[k] if k in tensors else others[k] for k in self.nodes}
        if dumped is not None and same_entries(entries, dumped.manifest.entries):
            # An unchanged re-take: the parent's own entries, whose JSON and
            # summary are reused whole.
            entries = dumped.manifest.entries
        manifest = trusted_manifest(  # the entries were built (or validated) already
            entries,
            created_at=now_iso(),
            world_size=1,
            parents=self.parents,
            metadata=self.metadata,
        )
        manifest_hash, manifest = commit_snapshot(
            self.repo, self.name, manifest, lease=lease, session=self.session, previous=dumped
        )
        return manifest, manifest_hash


def _plan_of(
    nodes: Mapping[str, Node],
    written: Mapping[str, list[ChunkRef]],
    chunk_size: int,
    replicated: list[str],
    previous: Mapping[str, Entry] | None = None,
) -> tuple[RankPlan, dict[str, TensorEntry], dict[str, ChunkRef]]:
    """The plan of a world of one, its chunk ids known once the scheduler hashed them,
    and the chunk refs of its pickled objects by hash.

    Tensors matching ``replicated`` are marked so (as torchsnapshot does with one
    process), so a job resumed on more ranks finds them on every rank. A
    tensor's chunks are at hand, so its entry is built here, returned next to
    the plan of the rest (:func:`~casnap.take.plan.tensor_entry`: the
    ``previous`` one when unchanged): no plan per tensor.
    """
    entries: dict[str, EntryPlan] = {}
    tensors: dict[str, TensorEntry] = {}
    by_hash: dict[str, ChunkRef] = {}
    old = previous or {}
    for key, node in nodes.items():
        if isinstance(node, TensorLeaf):
            t = node.tensor
            tensors[key] = tensor_entry(
                dtype_name(t.dtype, key),
                list(t.shape),
                chunk_size,
                written.get(key, []),
                is_replicated(key, replicated),
                node.quantized,
                old.get(key),
            )
        elif isinstance(node, ObjectLeaf):
            refs = written.get(key, [])
            by_hash.update((r.hash, r) for r in refs)
            ids = tuple((r.hash, r.size) for r in refs)
            entries[key] = ObjectPlan(node.type_name, len(node.payload), ids)
        elif isinstance(node, (ContainerEntry, PrimitiveEntry)):
            entries[key] = node
    return RankPlan(0, chunk_size, entries), tensors, by_hash


class ShardedNeedsGroup(UnsupportedValueError):
    """A single-process take met a sharded value (a caller with a group of one retries
    through the distributed take, which handles them)."""


def requests_of(nodes: Mapping[str, Node]) -> list[WriteRequest]:
    """One write request per tensor and pickled object; sharded values need a process group."""
    requests = []
    for key, node in nodes.items():
        if isinstance(node, TensorLeaf):
            requests.append(tensor_request(key, node.tensor))
        elif isinstance(node, ObjectLeaf):
            requests.append(data_request(key, memoryview(node.payload)))
        elif not isinstance(node, (ContainerEntry, PrimitiveEntry)):
            raise ShardedNeedsGroup(f"{key}: sharded tensors need a process group", key)
    return requests


def prepare_take(
    path: str,
    app_state: Mapping[str, Any],
    *,
    options: TakeOptions,
    metadata: dict[str, Any] | None,
    allow_pickle: bool,
    parents: list[str] | None,
    stage: bool,
    custom_prepare: TensorPrepareFunc | None = None,
    memory_budget_bytes: int | None = None,
    session: Session | None = None,
    replicated: list[str] | None = None,
) -> TakeJob:
    """Phase 1 of a take (see the module docstring); the caller pauses Python's cyclic
    collector around it (casnap.python_gc), as :class:`casnap.Snapshot` does."""
    budget = ByteBudget(check_budget(memory_budget_bytes))
    nodes = collect(app_state, 0, allow_pickle, custom_prepare)  # bad app_state: nothing created
    requests = requests_of(nodes)  # sharded values: refused before anything is created
    target = resolve_target(path, options, metadata, parents, session)
    pool = staging_of(session)  # without a session: the process's (casnap.take.session)
    job = TakeJob.of(
        target,
        nodes,
        requests,
        budget,
        session,
        pool,
        replicated=list(replicated or []),
        blocking=not stage,
    )
    if stage:
        _stage(job)
    else:
        job.live_consumed.set()  # a blocking take: the caller waits for the commit anyway
    return job


def _stage(job: TakeJob) -> None:
    """Copy what the background writes into the job's pool (point-in-time for async)."""
    staged = stage(job.requests, staging_limit(job.budget.limit, job.settings), job.pool)
    job.requests, job.buffers = staged.requests, staged.buffers
    if not any(r.live for r in job.requests):
        job.live_consumed.set()
