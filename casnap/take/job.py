"""One take, shared by ``Snapshot.take`` and ``Snapshot.async_take``.

A take runs in two phases:

1. ``prepare`` (always in the caller's thread): find the repository, check
   the name is free, call every ``state_dict()``, flatten, and stage. For an
   async take, staging copies tensors into reused host buffers owned by the
   take, as many as the memory budget allows; the rest stay "live".
2. ``commit`` (caller's thread, or a background thread for async): write
   chunks (deduplicated, packed), then the manifest, then the ref. Nothing is
   visible before the ref; a failure leaves only unreferenced objects. Live
   tensors go first, and ``async_take`` returns only once every chunk of
   them has been consumed (:attr:`TakeJob.live_consumed`): the snapshot is
   point-in-time when it returns, and staging never exceeds the budget.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from casnap.chunks.budget import ByteBudget
from casnap.chunks.io import BatchItem, ChunkBatcher, ChunkWriter, WriteStats
from casnap.errors import SnapshotExistsError, UnsupportedValueError
from casnap.format.manifest import (
    ChunkRef,
    ContainerEntry,
    Dumped,
    Entry,
    Manifest,
    ObjectEntry,
    PrimitiveEntry,
    canonical_json,
)
from casnap.format.names import escape_key
from casnap.repo.leases import hold_lease
from casnap.repo.repository import RepoStorage, locate, now_iso
from casnap.settings import Settings, default_memory_budget, io_workers_for
from casnap.take.commit import commit_snapshot
from casnap.take.plan import known_chunks, tensor_entry
from casnap.take.session import Session
from casnap.torch_io.flatten import Node, ObjectLeaf, TensorLeaf, flatten
from casnap.torch_io.staging import StagingPool
from casnap.torch_io.stateful import RNGState
from casnap.torch_io.tensors import host_view

TensorPrepareFunc = Callable[[str, torch.Tensor, bool], torch.Tensor]


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
    repo: RepoStorage
    name: str
    nodes: dict[str, Node]
    settings: Settings
    parents: list[str]
    metadata: dict[str, Any]
    staged: bool  # tensors already copied (async): no further staging needed
    budget: ByteBudget
    session: Session | None
    pool: StagingPool  # the session's, or a private one without a session
    _owners: list[Any] = field(default_factory=list)
    # Async: keys left unstaged (over the budget), written first; the caller
    # returns once their chunks are consumed (set at once when there are none).
    live: set[str] = field(default_factory=set)
    live_consumed: threading.Event = field(default_factory=threading.Event)

    def commit(self) -> TakeResult:
        try:
            return self._commit()
        finally:
            self.live_consumed.set()  # also on failure: the caller must not hang

    def _live_first(self) -> list[tuple[str, Node]]:
        items = list(self.nodes.items())
        return [kv for kv in items if kv[0] in self.live] + [
            kv for kv in items if kv[0] not in self.live
        ]

    def _commit(self) -> TakeResult:
        # From before the first dedup decision until the ref makes every chunk it
        # names reachable, the lease keeps gc from sweeping (docs/gc.md).
        with hold_lease(self.repo, kind="take") as lease:
            last_plan = self.session.last_plan if self.session is not None else None
            known = known_chunks(self.repo, self.parents, last_plan)
            with ThreadPoolExecutor(
                self.settings.io_workers, thread_name_prefix="casnap-w"
            ) as pool:
                writer = ChunkWriter(self.repo, self.settings, pool, known)
                pending: dict[str, list[Future[ChunkRef]]] = {}
                live = _Countdown(self.live_consumed)
                batch = ChunkBatcher(writer)
                for key, node in self._live_first():
                    if isinstance(node, TensorLeaf):
                        counter = live if key in self.live else None
                        pending[key] = self._submit_tensor(writer, key, node.tensor, counter, batch)
                    elif isinstance(node, ObjectLeaf):
                        pending[key] = self._submit(writer, memoryview(node.payload), None)
                batch.flush()
                live.arm()
                all_futures = [f for fs in pending.values() for f in fs]
                writer.finish(all_futures)
            entries: dict[str, Entry] = {}
            cs = self.settings.chunk_size
            previous = self._previous_entries()
            for key, node in self.nodes.items():
                if isinstance(node, TensorLeaf):
                    entries[key] = tensor_entry(
                        key, node.tensor, cs, [f.result() for f in pending[key]], previous.get(key)
                    )
                elif isinstance(node, ObjectLeaf):
                    entries[key] = ObjectEntry(
                        serializer="pickle",
                        type_name=node.type_name,
                        size=len(node.payload),
                        chunk_size=cs,
                        chunks=[f.result() for f in pending[key]],
                    )
                elif isinstance(node, (ContainerEntry, PrimitiveEntry)):
                    entries[key] = node
                else:  # sharded values need a process group: the distributed take
                    raise UnsupportedValueError(f"{key}: sharded tensors need a process group", key)
            manifest = Manifest(
                created_at=now_iso(),
                world_size=1,
                parents=self.parents,
                metadata=self.metadata,
                entries=entries,
            )
            manifest_hash = commit_snapshot(
                self.repo, self.name, manifest, lease=lease, session=self.session,
                previous=self._previous_dumped(),
            )  # fmt: skip
        self.nodes = {}
        return TakeResult(self.repo, self.name, manifest_hash, manifest, writer.stats)

    def _previous_manifest(self) -> Manifest | None:
        if self.session is None:
            return None
        for parent in self.parents:
            manifest = self.session.last_plan.get(self.repo.config.repo_id, parent)
            if manifest is not None:
                return manifest
        return None

    def _previous_dumped(self) -> Dumped | None:
        if self.session is None:
            return None
        for parent in self.parents:
            dumped = self.session.last_plan.dumped(self.repo.config.repo_id, parent)
            if dumped is not None:
                return dumped
        return None

    def _previous_entries(self) -> Mapping[str, Entry]:
        previous = self._previous_manifest()
        return previous.entries if previous is not None else {}

    def commit_staged(self) -> TakeResult:
        """:meth:`commit`, then hand the staging buffers back for the next async take."""
        try:
            return self.commit()
        finally:
            staged, self._owners = self._owners, []
            self.nodes = {}
            self.pool.give_back(staged)

    def _submit_tensor(
        self,
        writer: ChunkWriter,
        key: str,
        tensor: torch.Tensor,
        live: _Countdown | None = None,
        batch: ChunkBatcher | None = None,
    ) -> list[Future[ChunkRef]]:
        nbytes = tensor.numel() * tensor.element_size()
        needs_copy = not (
            tensor.device.type == "cpu"
            and tensor.is_contiguous()
            and not tensor.is_conj()
            and not tensor.is_neg()
        )
        if needs_copy:
            self.budget.acquire(nbytes)  # staging copies stay under the budget
        view, owner = host_view(tensor, key)
        # Floats compress better with the bytes of each element position grouped.
        elem = tensor.element_size() if tensor.dtype.is_floating_point else 0
        return self._submit(writer, view, owner, nbytes if needs_copy else 0, elem, live, batch)

    def _submit(
        self,
        writer: ChunkWriter,
        view: memoryview,
        owner: Any,
        held: int = 0,
        elem_size: int = 0,
        live: _Countdown | None = None,
        batch: ChunkBatcher | None = None,
    ) -> list[Future[ChunkRef]]:
        cs = self.settings.chunk_size
        n = len(view)
        count = math.ceil(n / cs) if n else 0
        if count == 0:
            if held:
                self.budget.release(held)
            return []
        remaining = [count]
        if live is not None:
            live.add(count)

        def one_done() -> None:
            if live is not None:
                live.done()  # this chunk's bytes are hashed and written or packed
            remaining[0] -= 1
            if remaining[0] == 0:
                if held:
                    self.budget.release(held)
                # ``owner`` (a staged copy) is referenced by this closure until here.
                _ = owner

        if count == 1 and n < self.settings.pack_limit and batch is not None:
            result: Future[ChunkRef] = Future()
            batch.add(BatchItem(view, result, one_done, elem_size))
            return [result]
        return [writer.add(view[i * cs : (i + 1) * cs], one_done, elem_size) for i in range(count)]


class _Countdown:
    """Sets ``event`` once every added chunk is done and :meth:`arm` was called."""

    def __init__(self, event: threading.Event) -> None:
        self._event = event
        self._lock = threading.Lock()
        self._left = 0
        self._armed = False

    def add(self, n: int) -> None:
        with self._lock:
            self._left += n

    def done(self) -> None:
        with self._lock:
            self._left -= 1
            fire = self._armed and self._left == 0
        if fire:
            self._event.set()

    def arm(self) -> None:
        """Every chunk has been added: from now on, zero means finished."""
        with self._lock:
            self._armed = True
            fire = self._left == 0
        if fire:
            self._event.set()


def _order(app_state: Mapping[str, Any]) -> list[tuple[str, Any]]:
    # RNG state is captured first, before other state_dict() calls could consume randomness.
    items = list(app_state.items())
    return [kv for kv in items if isinstance(kv[1], RNGState)] + [
        kv for kv in items if not isinstance(kv[1], RNGState)
    ]


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def collect(
    app_state: Mapping[str, Any], rank: int, allow_pickle: bool, prepare: TensorPrepareFunc | None
) -> dict[str, Node]:
    nodes: dict[str, Node] = {}
    for key, stateful in _order(app_state):
        if not isinstance(key, str) or not key or not _utf8(key):
            raise UnsupportedValueError(
                f"app_state keys must be non-empty UTF-8 strings, got {key!r}"
            )
        if not callable(getattr(stateful, "state_dict", None)):
            raise UnsupportedValueError(
                f"app_state[{key!r}] is a {type(stateful).__name__} without state_dict(); "
                "wrap plain values in casnap.StateDict",
                key,
            )
        flatten(stateful.state_dict(), f"{rank}/{escape_key(key)}", allow_pickle, nodes)
    if prepare is not None:
        for key, node in nodes.items():
            if isinstance(node, TensorLeaf):
                nodes[key] = TensorLeaf(prepare(key, node.tensor, False))
    return nodes


@dataclass(frozen=True)
class Target:
    """Where a take goes and with what: shared by single-process and distributed takes."""

    repo: RepoStorage
    name: str
    settings: Settings
    metadata: dict[str, Any]
    parents: list[str]


def resolve_target(
    path: str,
    storage_options: dict[str, Any] | None,
    metadata: dict[str, Any] | None,
    parents: list[str] | None,
    session: Session | None,
) -> Target:
    """Find or create the repository, check the name is free, validate metadata, pick parents."""
    options = dict(storage_options or {})
    overrides: dict[str, Any] = {
        k: options.pop(k) for k in ("chunk_size", "compression") if k in options
    }
    base = Settings.from_env()
    new_repo_chunk = int(overrides.get("chunk_size", base.chunk_size))
    repo, name = locate(path, options, create=True, chunk_size=new_repo_chunk)
    if "chunk_size" not in overrides and "CASNAP_CHUNK_SIZE" not in os.environ:
        overrides["chunk_size"] = repo.config.chunk_size
    if "CASNAP_IO_WORKERS" not in os.environ:
        overrides["io_workers"] = io_workers_for(repo.root.capabilities.local)
    settings = base.with_overrides(**overrides) if overrides else base
    if repo.has_ref(name):
        raise SnapshotExistsError(
            f"snapshot {name!r} already exists in {repo.url}; snapshots are immutable", name
        )
    meta = dict(metadata or {})
    try:
        canonical_json(meta)
    except (TypeError, ValueError) as exc:
        raise UnsupportedValueError(f"metadata must be JSON-serializable: {exc}") from exc
    if parents is None:  # the session's previous take or restore, if any
        last = session.lineage.parent(repo.config.repo_id) if session is not None else None
        parents = [last] if last else []
    return Target(repo, name, settings, meta, list(parents))


def prepare_take(
    path: str,
    app_state: Mapping[str, Any],
    *,
    storage_options: dict[str, Any] | None,
    metadata: dict[str, Any] | None,
    allow_pickle: bool,
    parents: list[str] | None,
    stage: bool,
    custom_prepare: TensorPrepareFunc | None = None,
    memory_budget_bytes: int | None = None,
    session: Session | None = None,
) -> TakeJob:
    """Phase 1 of a take (see module docstring)."""
    if memory_budget_bytes is not None and memory_budget_bytes <= 0:
        raise ValueError(f"memory_budget_bytes must be positive, got {memory_budget_bytes}")
    target = resolve_target(path, storage_options, metadata, parents, session)
    repo, name, settings = target.repo, target.name, target.settings
    meta, parents = target.metadata, target.parents
    nodes = collect(app_state, 0, allow_pickle, custom_prepare)
    budget = ByteBudget(memory_budget_bytes or default_memory_budget())
    pool = session.staging if session is not None else StagingPool(idle_limit=0)
    job = TakeJob(repo, name, nodes, settings, parents, meta, stage, budget, session, pool)
    if stage:
        _stage_all(job)
    else:
        job.live_consumed.set()
    return job


def staging_limit(budget: int, settings: Settings) -> int:
    """Bytes an async take may stage: the budget less the writer's own working set.

    The writer holds encoded chunks and compression buffers of every I/O
    worker, the open pack, and copies of live tensors that are not contiguous
    CPU memory: a synchronous take of 1 GiB peaks 61 MiB above the live state
    with 4 workers and 4 MiB chunks (benchmarks/suite.py, rss). That reserve,
    4 chunks per worker plus a pack, is kept out of the staging share, but
    never more than half the budget.
    """
    reserve = 4 * settings.io_workers * settings.chunk_size + settings.pack_target
    return budget - min(reserve, budget // 2)


def _stage_all(job: TakeJob) -> None:
    """Copy tensors into host buffers owned by the take (point-in-time for async).

    The buffers come from the session's staging pool and go back to it when
    the background part ends (:meth:`TakeJob.commit_staged`). Tensors that do
    not fit the staging share of the budget stay live: the commit writes them
    first, and ``async_take`` waits for that before returning.
    """
    limit = staging_limit(job.budget.limit, job.settings)
    staged_bytes = 0
    for key, node in job.nodes.items():
        if isinstance(node, TensorLeaf):
            nbytes = node.tensor.numel() * node.tensor.element_size()
            if staged_bytes + nbytes > limit:
                job.live.add(key)
                continue
            staged = job.pool.stage(node.tensor, limit)
            staged_bytes += nbytes
            job._owners.append(staged)
            job.nodes[key] = TensorLeaf(staged)
    if not job.live:
        job.live_consumed.set()
