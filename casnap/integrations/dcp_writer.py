"""``CasnapWriter``: a torch.distributed.checkpoint ``StorageWriter`` that saves into casnap.

What each DCP call does is in docs/dcp.md, "What each rank does": the
coordinator's ``prepare_global_plan`` locates or creates the repository,
takes the save's lease and picks the chunk size and parents; every rank's
``write_data`` writes the chunks the repository lacks; the coordinator's
``finish`` writes the manifest (:mod:`casnap.integrations.dcp_layout`), then
the ref. Saving again to a name that exists keeps the old version as
``<name>@<12 hex of its manifest>`` and replaces the ref conditionally
(docs/dcp.md, "What is atomic").
"""

from __future__ import annotations

import io
import os
import threading
import uuid
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    Metadata,
    StorageMeta,
)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from casnap.chunks.budget import ByteBudget
from casnap.chunks.frames import WriteStats
from casnap.chunks.write import ChunkWriter
from casnap.errors import (
    CasnapWarning,
    CheckpointExistsError,
    ConfigError,
    SnapshotExistsError,
    SnapshotNotFoundError,
    UnsupportedValueError,
)
from casnap.format.entries import (
    Entry,
    PrimitiveEntry,
)
from casnap.format.manifest import Manifest
from casnap.format.manifest_bytes import entry_texts
from casnap.integrations.dcp_entries import StoredBytes, StoredTensor, entry_of, primitive_of
from casnap.integrations.dcp_layout import (
    DCP_METADATA,
    containers,
    dcp_record,
    fqn_keys,
    planner_paths,
    whole_tensor_keys,
)
from casnap.repo.leases import Lease, acquire_lease
from casnap.repo.repository import RepoStorage, now_iso
from casnap.settings import Settings, default_memory_budget
from casnap.take.commit import commit_snapshot, remember
from casnap.take.parent import parent_rule
from casnap.take.plan import known_chunks
from casnap.take.scheduler import Scheduler, data_request, tensor_request
from casnap.take.session import Session
from casnap.take.target import TakeOptions, check_metadata, take_settings
from casnap.torch_io.tensors import dtype_name

HISTORY_SEP = "@"  # <name>@<12 hex>: an earlier save to the same checkpoint id
# ``casnap://P`` names snapshot P here too (dcp_fs: the same id, saved by FsspecWriter)
URL_SCHEME = "casnap://"


@dataclass(frozen=True)
class SaveTarget:
    """What the coordinator tells every rank (a SavePlan's ``storage_data``)."""

    url: str
    name: str
    store_options: dict[str, Any]
    overrides: dict[str, Any]
    chunk_size: int
    parents: tuple[str, ...]


def _as_path(checkpoint_id: str | os.PathLike[str]) -> str:
    if isinstance(checkpoint_id, os.PathLike):
        checkpoint_id = os.fspath(checkpoint_id)
    if not isinstance(checkpoint_id, str) or not checkpoint_id:
        raise ConfigError(f"a checkpoint id must be a non-empty path or URL, got {checkpoint_id!r}")
    if checkpoint_id.startswith(URL_SCHEME):  # the id DCP's FsspecWriter would take
        checkpoint_id = checkpoint_id[len(URL_SCHEME) :]
        if not checkpoint_id:
            raise ConfigError("a casnap:// checkpoint id names no snapshot")
    return checkpoint_id


def _valid_id(checkpoint_id: str | os.PathLike[str]) -> bool:
    """DCP's ``validate_checkpoint_id`` for the writer and the reader."""
    try:
        _as_path(checkpoint_id)
    except ConfigError:
        return False
    return True


class CasnapWriter(StorageWriter):
    """Save DCP checkpoints as casnap snapshots: deduplicated, verified, gc-able.

    ``path`` (or DCP's ``checkpoint_id=``) is a snapshot path, as for
    ``casnap.Snapshot.take``; ``storage_options`` (the store's), ``settings``
    and ``repository`` are those of a take and ``metadata`` (JSON) goes into
    each manifest. ``overwrite=False`` refuses an
    existing id as ``FileSystemWriter`` does
    (:class:`casnap.errors.CheckpointExistsError`); FileSystemWriter's other
    arguments are accepted and ignored. A save descends from the snapshot it
    replaces, else from the previous save through this writer or ``session``
    (docs/dcp.md has the mapping, the parents and what each rank does).

    Example::

        import torch.distributed.checkpoint as dcp
        from casnap.integrations.dcp import CasnapWriter, CasnapReader

        dcp.save({"model": model.state_dict()}, storage_writer=CasnapWriter("/ckpt/run1/step_100"))
        dcp.load(state, storage_reader=CasnapReader("/ckpt/run1/step_100"))
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
        settings: dict[str, Any] | None = None,
        repository: Any = None,
        metadata: dict[str, Any] | None = None,
        overwrite: bool = True,
        session: Session | None = None,
        **_filesystem_writer_options: Any,
    ) -> None:
        super().__init__()
        self.path: str | None = _as_path(path) if path is not None else None
        self.storage_options = dict(storage_options or {})
        self.options = TakeOptions.of(self.storage_options, settings, repository)
        self.metadata = check_metadata(metadata)
        if DCP_METADATA in self.metadata:
            raise UnsupportedValueError(f"metadata key {DCP_METADATA!r} is the DCP writer's own")
        self.overwrite = overwrite
        self.session = session if session is not None else Session()
        # A save with no parent from its session descends from the newest in its folder,
        # unless the caller's own session says otherwise (casnap.take.parent).
        self._own = session is None
        self.save_id = uuid.uuid4().hex
        self.is_coordinator = False
        self.rank = 0
        #: This rank's writes in the last save (chunks, bytes written after dedup).
        self.last_write_stats: WriteStats | None = None
        #: The manifest hash the last save committed (coordinator only).
        self.last_manifest: str | None = None
        self._repo: RepoStorage | None = None
        self._lease: Lease | None = None
        self._name = ""  # the snapshot's name in self._repo
        self._replaces: str | None = None  # the manifest a re-save replaces
        self._parents: list[str] = []  # the save's parents, chosen by the coordinator
        self._lock = threading.Lock()
        self._finalizer: weakref.finalize[Any, Any] | None = None

    # -- pickling: process-based async save sends the writer to a daemon --
    def __getstate__(self) -> dict[str, Any]:
        """What a spawned process needs: the options, not the repository or the lease.

        ``dcp.async_save(..., async_checkpointer_type=AsyncCheckpointerType.PROCESS)``
        pickles the writer to its daemon, which saves with it: the repository
        is opened there, at the save's ``prepare_global_plan``. The session
        (lineage of this process) does not travel; a re-save still descends
        from the snapshot it replaces.
        """
        state = dict(self.__dict__)
        for key in ("_repo", "_lease", "_finalizer", "_lock", "session"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._repo, self._lease, self._finalizer = None, None, None
        self._lock = threading.Lock()
        self.session = Session()

    # -- DCP's StorageWriter ---------------------------------------------
    @property
    def checkpoint_id(self) -> str | None:
        """The snapshot path the next save writes (DCP logs it)."""
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return _valid_id(checkpoint_id)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._release()  # a save that failed on another rank never reached finish()
        if checkpoint_id:
            self.path = _as_path(checkpoint_id)
        self.save_id = uuid.uuid4().hex

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._release()
        if self.path is None:
            raise ConfigError("CasnapWriter needs a path: CasnapWriter(path) or checkpoint_id=")
        if not kwargs.get("use_collectives", True) and _world() > 1:
            raise ConfigError(
                "CasnapWriter needs DCP's collectives (use_collectives=True): one save is one "
                "snapshot, committed once by the coordinator"
            )
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank") or 0)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """(all ranks) ``overwrite=False``: refuse an existing id on every rank, as DCP does."""
        if not self.overwrite:
            assert self.path is not None
            try:
                repo, name = self.options.locate(self.path, create=False)
            except SnapshotNotFoundError:
                return plan  # no repository holds it yet
            if repo.has_ref(name):
                raise _exists(name, repo)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """(coordinator) Locate the snapshot, take the lease, choose chunk size and parents."""
        assert self.path is not None
        overrides = self.options.settings
        new_repo_chunk = Settings.from_env().with_overrides(**overrides).chunk_size
        repo, name = self.options.locate(self.path, create=True, chunk_size=new_repo_chunk)
        settings = take_settings(repo, overrides)
        # Created for this save, or (a repository object given in the options) since it
        # was made: later saves and takes through the same object are not (target.py).
        fresh, repo.created = repo.created, False
        replaces = repo.resolve(name) if repo.has_ref(name) else None
        if replaces is not None and not self.overwrite:
            raise _exists(name, repo)
        # From before any rank's first dedup decision until the ref is written.
        self._lease = acquire_lease(repo.store, kind="take")
        self._finalizer = weakref.finalize(self, self._lease.release)
        self._repo, self._name, self._replaces = repo, name, replaces
        given = [replaces] if replaces is not None else None  # a re-save descends from it
        rule = parent_rule(repo, given, self.session, settings, fresh, own_session=self._own)
        self._parents = rule.choose(repo, name)  # under the lease (casnap.take.parent)
        parents = tuple(self._parents)
        store_options = self.storage_options
        target = SaveTarget(repo.url, name, store_options, overrides, settings.chunk_size, parents)
        return [replace(plan, storage_data=target) for plan in plans]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """(all ranks) Write this rank's items; each result names the chunks it became."""
        try:
            results = self._write(plan, planner)
        except BaseException:
            if self.is_coordinator:
                self._release()
            raise
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """(coordinator) Write the manifest, then the ref: the commit point."""
        try:
            self._commit(metadata, results)
        finally:
            self._release()

    # -- the work --------------------------------------------------------
    def _open(self, target: SaveTarget) -> RepoStorage:
        if self._repo is not None and self._repo.url == target.url:
            return self._repo
        return RepoStorage.open(target.url, target.store_options or None)

    def _write(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        target = plan.storage_data
        if not isinstance(target, SaveTarget):
            raise ConfigError("CasnapWriter.write_data got a plan it did not prepare")
        repo = self._open(target)
        settings = take_settings(repo, target.overrides, chunk_size=target.chunk_size)
        requests = []
        kinds: list[torch.Tensor | PrimitiveEntry | int] = []
        data_of_planner = plan.planner_data
        if data_of_planner is None:
            data_of_planner = getattr(planner, "mappings", None)
        whole = whole_tensor_keys(plan.items, data_of_planner)  # for delta bases
        entry_keys = {f"{i}:{plan.items[i].index.fqn}": key for i, key in whole.items()}
        for i, item in enumerate(plan.items):
            key = f"{i}:{item.index.fqn}"
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                assert isinstance(data, io.BytesIO)
                raw = data.getvalue()
                primitive = primitive_of(raw)
                kinds.append(primitive if primitive is not None else len(raw))
                if primitive is None:
                    requests.append(data_request(key, memoryview(raw), raw))
            else:
                assert isinstance(data, torch.Tensor)
                kinds.append(data)
                requests.append(tensor_request(key, data))
        known = known_chunks(repo, list(target.parents))
        with ThreadPoolExecutor(settings.io_workers, thread_name_prefix="casnap-dcp") as pool:
            writer = ChunkWriter(repo, settings, pool, known)
            writer.entry_keys = entry_keys
            budget = ByteBudget(default_memory_budget())
            written = Scheduler(writer, settings, budget).run(requests)
        # Chunks are put non-durably; the coordinator's durable manifest put covers only
        # its own process, so every rank makes its chunks durable before reporting them.
        repo.store.flush()
        self.last_write_stats = writer.stats
        results = []
        for i, (item, kind) in enumerate(zip(plan.items, kinds, strict=True)):
            refs = tuple(written.get(f"{i}:{item.index.fqn}", ()))
            stored: StoredTensor | StoredBytes
            if isinstance(kind, torch.Tensor):
                stored = StoredTensor(
                    dtype_name(kind.dtype, item.index.fqn),
                    tuple(kind.shape),
                    settings.chunk_size,
                    refs,
                )
                size = kind.numel() * kind.element_size()
            elif isinstance(kind, PrimitiveEntry):
                stored, size = StoredBytes(kind, 0, settings.chunk_size, ()), 0
            else:
                stored, size = StoredBytes(None, kind, settings.chunk_size, refs), kind
            results.append(WriteResult(index=item.index, size_in_bytes=size, storage_data=stored))
        return results

    def _commit(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        repo, lease = self._repo, self._lease
        assert repo is not None and lease is not None and self.path is not None
        stored: dict[str, list[tuple[Any, Any]]] = {}
        for rank in results:
            for wr in rank:
                stored.setdefault(wr.index.fqn, []).append((wr.index, wr.storage_data))
        paths = planner_paths(metadata.planner_data)
        keys = fqn_keys(metadata.state_dict_metadata, paths)
        entries: dict[str, Entry] = {}
        for fqn, md in metadata.state_dict_metadata.items():
            entries[keys[fqn]] = entry_of(fqn, md, stored.get(fqn, []))
        entries.update(containers(entries))
        target_name = self._name
        parents = list(self._parents)  # chosen in prepare_global_plan
        manifest = Manifest(
            # 2.0 where an entry holds a delta chunk (written now, or a parent's reused):
            # a 1.x manifest with deltas is refused by every reader
            created_at=now_iso(),
            world_size=len(results),
            parents=parents,
            metadata={**self.metadata, DCP_METADATA: dcp_record(metadata.version, paths)},
            entries=entries,
        )
        if self._replaces is None and not self.overwrite:
            try:
                self.last_manifest, _ = commit_snapshot(
                    repo, target_name, manifest, lease=lease, session=self.session
                )
            except SnapshotExistsError as exc:  # another save committed it meanwhile
                raise _exists(target_name, repo) from exc
            return
        self.last_manifest = _commit_replacing(
            repo, target_name, manifest, self._replaces, lease, self.session
        )

    def _release(self) -> None:
        with self._lock:
            lease, self._lease = self._lease, None
            finalizer, self._finalizer = self._finalizer, None
        if finalizer is not None:
            finalizer.detach()
        if lease is not None:
            lease.release()


def _exists(name: str, repo: RepoStorage) -> CheckpointExistsError:
    """The refusal of ``overwrite=False``, in the words of DCP's ``FileSystemWriter``."""
    return CheckpointExistsError(
        f"Checkpoint already exists and self.overwrite=False. (casnap: snapshot {name!r} "
        f"exists in {repo.url}; save to another id, or overwrite=True keeps it as history)",
        name,
    )


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _commit_replacing(
    repo: RepoStorage,
    name: str,
    manifest: Manifest,
    old: str | None,
    lease: Lease,
    session: Session,
) -> str:
    """Commit ``manifest`` as ``name``, which names ``old`` (None: no snapshot yet),
    keeping ``old`` as history first.

    1. the manifest (create-only); 2. ``<name>@<old[:12]>`` -> ``old``, create-only
    (idempotent: a retry after a crash finds it); 3. the lease is still ours;
    4. replace the ref if it still names ``old`` (a conditional replace; create
    it if there was none): the commit point. A crash before 4 leaves ``name``
    as it was. If another save to ``name`` committed between reading ``old``
    and 4, this one did not replace it: it is kept as ``<name>@<its 12 hex>``
    instead, as if it had committed just before the other (a warning says so),
    so no save that returns is left without a ref.
    """
    texts = entry_texts(manifest)
    manifest_hash, manifest = repo.write_manifest(manifest, texts)
    if old is not None:
        repo.write_ref(f"{name}{HISTORY_SEP}{old[:12]}", old)
    lease.check()
    try:
        if old is None:
            repo.write_ref(name, manifest_hash)  # create-only
        else:
            repo.replace_ref(name, manifest_hash, old)  # the commit point
    except SnapshotExistsError:  # SnapshotChangedError too: another save got there first
        kept = f"{name}{HISTORY_SEP}{manifest_hash[:12]}"
        repo.write_ref(kept, manifest_hash)
        warnings.warn(
            f"another save to checkpoint {name!r} in {repo.url} committed while this one "
            f"ran; this save is kept in its history as {kept!r}",
            CasnapWarning,
            stacklevel=2,
        )
    remember(repo, manifest_hash, manifest, session, texts, committed=True)
    return manifest_hash
