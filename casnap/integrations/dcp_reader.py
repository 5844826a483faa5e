"""``CasnapReader``: a torch.distributed.checkpoint ``StorageReader`` over a casnap snapshot.

DCP calls, on every rank: ``reset(checkpoint_id)`` when one is given,
``read_metadata()``, ``set_up_storage_reader(metadata, is_coordinator)``,
``prepare_local_plan``, then (coordinator) ``prepare_global_plan``, then
``read_data(plan, planner)``. The metadata is rebuilt from the manifest
(casnap.integrations.dcp_layout): one DCP chunk per stored shard, so DCP's
own planner reshards onto any world size or placement, and ``read_data``
serves each ``ReadItem`` (a box of one stored shard) by fetching only the
chunks that hold it. Every chunk is verified against its hash as it is read;
a damaged one raises :class:`casnap.IntegrityError` (and is recorded, so the
next save writes it again: docs/damage.md).
"""

from __future__ import annotations

import io
import math
import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from casnap.chunks.budget import ByteBudget
from casnap.chunks.read import Buffer, read_chunks
from casnap.chunks.target import Consumer
from casnap.errors import ConfigError, IntegrityError
from casnap.format.entries import (
    DTYPE_ITEMSIZE,
    ChunkRef,
    ContainerEntry,
    ObjectEntry,
    PrimitiveEntry,
    ShardedEntry,
    ShardRecord,
    TensorEntry,
)
from casnap.format.manifest import Manifest
from casnap.integrations.dcp_layout import key_fqns, read_record
from casnap.integrations.dcp_writer import _as_path, _valid_id
from casnap.repo.locate import locate
from casnap.repo.repository import RepoStorage
from casnap.settings import default_memory_budget, read_workers_for
from casnap.torch_io.flatten import decode_primitive
from casnap.torch_io.tensors import byte_view, copy_bits, torch_dtype


@dataclass(frozen=True)
class _Stored:
    """Where one DCP chunk lives: the entry's key and, for a sharded entry, the shard."""

    key: str
    shard: int  # -1: the entry itself (a dense tensor, a primitive or an object)


class CasnapReader(StorageReader):
    """Load a DCP checkpoint that :class:`~casnap.integrations.dcp.CasnapWriter` saved.

    ``path`` (or DCP's ``checkpoint_id=``) is the snapshot path given to the
    writer; ``storage_options`` (the store's) and ``repository`` as for
    ``casnap.Snapshot``.

    Example::

        import torch.distributed.checkpoint as dcp
        from casnap.integrations.dcp import CasnapReader

        state = {"model": model.state_dict()}
        dcp.load(state, storage_reader=CasnapReader("/ckpt/run1/step_100"))
        model.load_state_dict(state["model"])
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
        repository: Any = None,
        **_filesystem_reader_options: Any,
    ) -> None:
        super().__init__()
        self.path: str | None = _as_path(path) if path is not None else None
        self.storage_options = dict(storage_options or {})
        self.repository = repository
        self.load_id = uuid.uuid4().hex
        self._repo: RepoStorage | None = None
        self._manifest: Manifest | None = None
        self.manifest_hash: str | None = None
        self._where: dict[MetadataIndex, _Stored] = {}
        #: Bytes fetched from the store by the last ``read_data`` of this rank.
        self.last_fetched_bytes = 0

    def __getstate__(self) -> dict[str, Any]:
        """The options only: the repository and manifest are read in the process that loads."""
        state = dict(self.__dict__)
        state.update(_repo=None, _manifest=None, manifest_hash=None, _where={})
        return state

    @property
    def checkpoint_id(self) -> str | None:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return _valid_id(checkpoint_id)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self.path = _as_path(checkpoint_id)
        self._repo = self._manifest = self.manifest_hash = None
        self._where = {}
        self.load_id = uuid.uuid4().hex

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's Metadata, rebuilt from the snapshot's manifest (read and hash-checked)."""
        if kwargs.get("rank") is not None:
            # DCP asks for a per-rank metadata file (a save without collectives) only
            # when the global one is missing; casnap never writes one.
            raise FileNotFoundError("casnap snapshots have no per-rank DCP metadata")
        if self.path is None:
            raise ConfigError("CasnapReader needs a path: CasnapReader(path) or checkpoint_id=")
        repo, name = locate(
            self.path, self.storage_options, create=False, existing=True, repository=self.repository
        )
        manifest_hash = repo.resolve(name)
        manifest = repo.read_manifest(manifest_hash)
        version, paths = read_record(manifest.metadata, f"snapshot {name!r}")
        leaves = [k for k, e in manifest.entries.items() if not isinstance(e, ContainerEntry)]
        fqns = key_fqns(leaves, paths)
        state: dict[str, Any] = {}
        where: dict[MetadataIndex, _Stored] = {}
        for key in leaves:
            fqn, entry = fqns[key], manifest.entries[key]
            if isinstance(entry, (PrimitiveEntry, ObjectEntry)):
                state[fqn] = BytesStorageMetadata()
                where[MetadataIndex(fqn)] = _Stored(key, -1)
                continue
            assert isinstance(entry, (TensorEntry, ShardedEntry))
            props = TensorProperties(dtype=torch_dtype(entry.dtype))
            boxes = _shards(entry)
            state[fqn] = TensorStorageMetadata(
                properties=props,
                size=torch.Size(entry.shape),
                chunks=[
                    ChunkStorageMetadata(offsets=torch.Size(s.offsets), sizes=torch.Size(s.sizes))
                    for s in boxes
                ],
            )
            for i, s in enumerate(boxes):
                shard = i if isinstance(entry, ShardedEntry) else -1
                where[MetadataIndex(fqn, s.offsets)] = _Stored(key, shard)
        self._repo, self._manifest, self.manifest_hash = repo, manifest, manifest_hash
        self._where = where
        planner_data = {f: tuple(p) for f, p in paths.items()} if paths else None
        return Metadata(
            state_dict_metadata=state,
            planner_data=planner_data,
            storage_data=where,
            storage_meta=StorageMeta(checkpoint_id=self.path, load_id=self.load_id),
            version=version,
        )

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if self._manifest is None:
            raise ConfigError("CasnapReader.set_up_storage_reader before read_metadata")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Fetch, verify and hand over every item of ``plan``, one stored shard at a time."""
        repo, manifest = self._repo, self._manifest
        assert repo is not None and manifest is not None
        groups: dict[_Stored, list[ReadItem]] = {}
        for item in plan.items:
            groups.setdefault(self._where[item.storage_index], []).append(item)
        fetched = 0
        with ThreadPoolExecutor(
            read_workers_for(repo.root.capabilities.local), thread_name_prefix="casnap-dcp-r"
        ) as pool:
            budget = ByteBudget(default_memory_budget())
            for where, items in groups.items():
                entry = manifest.entries[where.key]
                if isinstance(entry, (PrimitiveEntry, ObjectEntry)):
                    fetched += _load_bytes(repo, where.key, entry, items, planner, pool, budget)
                else:
                    assert isinstance(entry, (TensorEntry, ShardedEntry))
                    shard = _shards(entry)[max(where.shard, 0)]
                    fetched += _load_boxes(
                        repo, where.key, entry.dtype, shard, items, planner, pool, budget
                    )
        self.last_fetched_bytes = fetched
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut


def _shards(entry: TensorEntry | ShardedEntry) -> list[ShardRecord]:
    if isinstance(entry, ShardedEntry):
        return entry.shards
    whole = ShardRecord(
        offsets=[0] * len(entry.shape),
        sizes=list(entry.shape),
        chunk_size=entry.chunk_size,
        chunks=entry.chunks,
    )
    return [whole]


def _fetch(
    repo: RepoStorage,
    refs: list[ChunkRef],
    out: memoryview,
    starts: list[int],
    pool: ThreadPoolExecutor,
    budget: ByteBudget,
) -> int:
    """Read and verify ``refs``, chunk ``i`` into ``out[starts[i]:]``."""

    def sink(i: int, data: Buffer) -> None:
        out[starts[i] : starts[i] + len(data)] = data

    return read_chunks(repo, refs, Consumer(sink), pool, budget)


def _load_bytes(
    repo: RepoStorage,
    key: str,
    entry: PrimitiveEntry | ObjectEntry,
    items: list[ReadItem],
    planner: LoadPlanner,
    pool: ThreadPoolExecutor,
    budget: ByteBudget,
) -> int:
    fetched = 0
    if isinstance(entry, PrimitiveEntry):
        buf = io.BytesIO()
        torch.save(decode_primitive(entry, key), buf)
        raw = buf.getvalue()
    else:
        data = bytearray(entry.size)
        cs = entry.chunk_size
        starts = [i * cs for i in range(len(entry.chunks))]
        fetched = _fetch(repo, entry.chunks, memoryview(data), starts, pool, budget)
        raw = bytes(data)
    for item in items:
        planner.load_bytes(item, io.BytesIO(raw))
    return fetched


def _load_boxes(
    repo: RepoStorage,
    key: str,
    dtype_name: str,
    shard: ShardRecord,
    items: list[ReadItem],
    planner: LoadPlanner,
    pool: ThreadPoolExecutor,
    budget: ByteBudget,
) -> int:
    """Serve ``items`` (boxes of one stored shard), fetching only the chunks that hold them.

    The shard is row-major: a box's elements lie between the linear offsets of
    its first and last element, so the chunks covering that byte span hold
    it. The span of all the items is staged once and viewed with the shard's
    strides.
    """
    itemsize = DTYPE_ITEMSIZE[dtype_name]
    dtype = torch_dtype(dtype_name)
    sizes = shard.sizes
    strides = [math.prod(sizes[d + 1 :]) for d in range(len(sizes))]
    nbytes = math.prod(sizes) * itemsize
    cs = shard.chunk_size
    spans = []
    for item in items:
        off, lengths = list(item.storage_offsets), list(item.lengths)
        if any(o + n > s for o, n, s in zip(off, lengths, sizes, strict=True)):
            raise IntegrityError(f"{key}: DCP asked for a box outside the stored shard", key)
        if math.prod(lengths) == 0:
            spans.append((0, 0))
            continue
        first = sum(o * st for o, st in zip(off, strides, strict=True))
        last = sum((o + n - 1) * st for o, n, st in zip(off, lengths, strides, strict=True))
        spans.append((first * itemsize, (last + 1) * itemsize))
    used = [s for s in spans if s[1] > s[0]]
    fetched = 0
    if used:
        lo_chunk = min(a for a, _ in used) // cs
        hi_chunk = (max(b for _, b in used) - 1) // cs
        base = lo_chunk * cs
        if base % itemsize:
            lo_chunk, base = 0, 0  # a chunk size that splits elements: stage from the start
        top = min((hi_chunk + 1) * cs, nbytes)
        staged = torch.empty((top - base) // itemsize, dtype=dtype)
        view = byte_view(staged)
        refs = shard.chunks[lo_chunk : hi_chunk + 1]
        starts = [i * cs - base for i in range(lo_chunk, hi_chunk + 1)]
        fetched = _fetch(repo, refs, view, starts, pool, budget)
    for item, (a, _b) in zip(items, spans, strict=True):
        lengths = list(item.lengths)
        if math.prod(lengths) == 0:
            src = torch.empty(lengths, dtype=dtype)
        else:
            src = torch.as_strided(staged, lengths, strides, (a - base) // itemsize)
        target = planner.resolve_tensor(item).detach()
        if list(target.shape) != lengths:
            raise IntegrityError(
                f"{key}: DCP's target is {list(target.shape)}, the stored box {lengths}", key
            )
        if target.dtype == dtype:
            copy_bits(target, src)
        else:
            target.copy_(src)
        planner.commit_tensor(item, target)
    return fetched
