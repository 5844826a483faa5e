"""``casnap://``: the fsspec protocol that ``dcp.save(sd, checkpoint_id="casnap://...")`` reaches.

DCP picks its writer from a fixed list (``_storage_setup``: ``FileSystemWriter``,
then ``FsspecWriter`` for any id fsspec resolves), so an id alone can only
reach casnap as a file system: ``FsspecWriter`` writes its files here and each
save becomes one casnap snapshot holding them (docs/dcp.md, "By checkpoint id
alone", says why not a routed ``CasnapWriter``). What each call does:

- ``mkdir(<id>)`` (DCP's ``prepare_local_plan``): locate or create the
  repository, take the save's lease (gc sweeps nothing until the ref is
  written) and choose the parents, as ``CasnapWriter`` does;
- a file opened for writing is cut, at its close, into segments at every
  ``tell()`` (DCP asks for the offset before each item, so each item is its
  own segment) and each segment into chunks at fixed offsets from its start:
  an item keeps its chunks when the items before it change size. Only chunks
  the repository lacks are written; the file is a 1-D ``uint8`` entry whose
  shards are the segments;
- ``rename(<id>/.metadata.tmp, <id>/.metadata)`` (DCP's last step) writes the
  manifest, then the ref: the commit point. ``rm(<id>/.metadata)`` (DCP's
  step before it) does nothing: the ref is replaced in one atomic step, the
  previous version kept as ``<name>@<12 hex>``;
- reads open the snapshot the id names when ``.metadata`` is opened and serve
  every later file of that load from the same manifest, each chunk verified.

The state of a save lives in the process that makes it (the fsspec instance
pickles as its options only), so a save is one process: a multi-rank save
through ``casnap://`` is refused (use ``CasnapWriter``).
"""

from __future__ import annotations

import bisect
import io
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from fsspec import AbstractFileSystem

from casnap.chunks.budget import ByteBudget
from casnap.chunks.read import Buffer, read_chunks
from casnap.chunks.target import Consumer
from casnap.chunks.write import ChunkWriter
from casnap.errors import ConfigError, SnapshotNotFoundError
from casnap.format.entries import (
    MAX_SHARDS,
    ContainerEntry,
    Entry,
    PrimitiveEntry,
    ShardedEntry,
    ShardRecord,
    TensorEntry,
)
from casnap.format.manifest import Manifest
from casnap.integrations.dcp_layout import FILES_METADATA, containers, path_key
from casnap.integrations.dcp_writer import _commit_replacing
from casnap.repo.leases import Lease, acquire_lease
from casnap.repo.repository import RepoStorage, locate, now_iso
from casnap.settings import Settings, default_memory_budget, read_workers_for
from casnap.take.parent import parent_rule
from casnap.take.plan import known_chunks
from casnap.take.scheduler import Scheduler, data_request
from casnap.take.session import Session
from casnap.take.target import split_options, take_settings
from casnap.torch_io.flatten import decode_primitive, encode_primitive

PROTOCOL = "casnap"
METADATA = ".metadata"  # DCP's metadata file: its rename is the commit
_CACHED_CHUNKS = 8  # decoded chunks a read stream keeps (torch.load reads in small pieces)
# DCP's metadata up to this size is kept in the manifest (a bytes primitive), not as chunks:
# it names the save's uuid, so it differs every time, and an unchanged re-save then writes
# no chunk or pack at all, only its manifest and ref.
INLINE_METADATA = 1 << 20


def strip(path: str | os.PathLike[str]) -> str:
    """The snapshot path (or one of its files) a ``casnap://`` URL names."""
    text = os.fspath(path)
    if text.startswith(f"{PROTOCOL}://"):
        text = text[len(PROTOCOL) + 3 :]
    return text.rstrip("/") or "/"


@dataclass
class _Save:
    """One save in flight: from ``mkdir`` of its id to the rename of its metadata."""

    repo: RepoStorage
    name: str
    settings: Settings
    lease: Lease
    parents: list[str]
    replaces: str | None
    files: dict[str, Entry] = field(default_factory=dict)
    failed: bool = False  # a file failed to be stored: the save can no longer commit


@dataclass
class _Load:
    repo: RepoStorage
    manifest: Manifest


class CasnapFileSystem(AbstractFileSystem):  # type: ignore[misc]
    """``casnap://<snapshot path>/<file>``: DCP's files as a casnap snapshot (docs/dcp.md).

    ``storage_options`` (fsspec's constructor keywords) are those of a take:
    ``chunk_size``, ``compression``, ``repository``, the store's options.
    """

    protocol = PROTOCOL
    root_marker = ""

    def __init__(self, *args: Any, **storage_options: Any) -> None:
        super().__init__(*args, **storage_options)
        self.take_options = dict(storage_options)
        for key in ("skip_instance_cache", "use_listings_cache", "listings_expiry_time"):
            self.take_options.pop(key, None)
        self.session = Session()
        self._saves: dict[str, _Save] = {}
        self._loads: dict[str, _Load] = {}
        self._guard = threading.Lock()

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        return strip(path)

    # -- saving ----------------------------------------------------------
    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self._begin(strip(path))

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        self._begin(strip(path))

    def _begin(self, ckpt: str) -> _Save:
        """Start a save to ``ckpt``: the repository, the lease, the parents."""
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise ConfigError(
                "a casnap:// checkpoint id is saved by one process; for a multi-rank save "
                "pass storage_writer=casnap.integrations.dcp.CasnapWriter(path)"
            )
        self._abandon(ckpt)  # an earlier save to it that failed before its commit
        options, overrides = split_options(self.take_options)
        new_repo_chunk = Settings.from_env().with_overrides(**overrides).chunk_size
        repo, name = locate(ckpt, options, create=True, chunk_size=new_repo_chunk)
        settings = take_settings(repo, overrides)
        fresh, repo.created = repo.created, False
        replaces = repo.resolve(name) if repo.has_ref(name) else None
        lease = acquire_lease(repo.store, kind="take")
        try:
            given = [replaces] if replaces is not None else None
            rule = parent_rule(repo, given, self.session, settings, fresh, own_session=True)
            parents = rule.choose(repo, name)
        except BaseException:
            lease.release()
            raise
        save = _Save(repo, name, settings, lease, parents, replaces)
        with self._guard:
            self._saves[ckpt] = save
        return save

    def _abandon(self, ckpt: str) -> None:
        with self._guard:
            save = self._saves.pop(ckpt, None)
        if save is not None:
            save.lease.release()

    def _save_of(self, ckpt: str) -> _Save:
        with self._guard:
            save = self._saves.get(ckpt)
        if save is None:
            return self._begin(ckpt)
        if save.failed:
            raise ConfigError(f"the save to {ckpt!r} failed: an earlier file was not stored")
        return save

    def _stored(self, path: str, segments: list[bytearray]) -> None:
        """A written file, closed: its segments' chunks written, its entry staged.

        If it fails, so does the save: its lease is released at once (the
        next save to the id starts afresh) and nothing of it can commit.
        """
        ckpt, file = os.path.split(path)
        save = self._save_of(ckpt)
        try:
            self._store(save, file, segments)
        except BaseException:
            save.failed = True
            save.lease.release()
            raise

    def _store(self, save: _Save, file: str, segments: list[bytearray]) -> None:
        settings, repo = save.settings, save.repo
        segments = [s for s in segments if s]
        if file.startswith(METADATA) and sum(map(len, segments)) <= INLINE_METADATA:
            inline = encode_primitive(b"".join(segments))
            assert inline is not None  # bytes always are a primitive
            with self._guard:
                save.files[file] = inline
            return
        if len(segments) > MAX_SHARDS:
            segments = [bytearray(b"".join(segments))]
        requests = [data_request(str(i), memoryview(s), s) for i, s in enumerate(segments)]
        known = known_chunks(repo, save.parents)
        with ThreadPoolExecutor(settings.io_workers, thread_name_prefix="casnap-dcpfs") as pool:
            writer = ChunkWriter(repo, settings, pool, known)
            written = Scheduler(writer, settings, ByteBudget(default_memory_budget())).run(requests)
        repo.store.flush()
        shards, start = [], 0
        for i, seg in enumerate(segments):
            chunks = list(written.get(str(i), ()))
            shards.append(
                ShardRecord(
                    offsets=[start], sizes=[len(seg)], chunk_size=settings.chunk_size, chunks=chunks
                )
            )
            start += len(seg)
        entry: Entry
        if len(shards) == 1:
            one = shards[0]
            entry = TensorEntry(
                dtype="uint8", shape=[start], chunk_size=one.chunk_size, chunks=one.chunks
            )
        elif not shards:
            entry = TensorEntry(dtype="uint8", shape=[0], chunk_size=settings.chunk_size, chunks=[])
        else:
            entry = ShardedEntry(layout="dtensor", dtype="uint8", shape=[start], shards=shards)
        with self._guard:
            save.files[file] = entry

    def mv(self, path1: str, path2: str, **kwargs: Any) -> None:
        src, dst = strip(path1), strip(path2)
        ckpt, file = os.path.split(dst)
        if file != METADATA or os.path.dirname(src) != ckpt:
            raise ConfigError(f"casnap:// renames only {METADATA}.tmp to {METADATA}, not {src}")
        with self._guard:
            save = self._saves.get(ckpt)
            staged = save.files.pop(os.path.basename(src), None) if save else None
        if save is None or staged is None or save.failed:
            raise FileNotFoundError(src)
        save.files[METADATA] = staged
        try:
            self._commit(save)
        finally:
            self._abandon(ckpt)

    rename = mv

    def _commit(self, save: _Save) -> None:
        """The manifest of the staged files, then the ref (as ``CasnapWriter.finish``)."""
        entries: dict[str, Entry] = {path_key((f,)): e for f, e in save.files.items()}
        entries.update(containers(entries))
        manifest = Manifest(
            created_at=now_iso(),
            world_size=1,
            parents=list(save.parents),
            metadata={FILES_METADATA: {"version": 1}},
            entries=entries,
        )
        _commit_replacing(save.repo, save.name, manifest, save.replaces, save.lease, self.session)

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        ckpt, file = os.path.split(strip(path))
        if file == METADATA:
            return  # DCP's step before the rename: the commit replaces the ref atomically
        with self._guard:
            save = self._saves.get(ckpt)
            if save is not None:
                save.files.pop(file, None)  # a write that failed: DCP cleans it up

    def rm_file(self, path: Any) -> None:
        self.rm(path)

    # -- loading ---------------------------------------------------------
    def _load(self, ckpt: str, fresh: bool) -> _Load:
        with self._guard:
            load = self._loads.get(ckpt)
        if load is None or fresh:
            options, _ = split_options(self.take_options)
            repo, name = locate(ckpt, options, create=False, existing=True)
            manifest = repo.read_manifest(repo.resolve(name))
            if FILES_METADATA not in manifest.metadata:
                raise ConfigError(
                    f"snapshot {ckpt!r} was not saved through casnap://; read it with "
                    "storage_reader=casnap.integrations.dcp.CasnapReader(path)"
                )
            load = _Load(repo, manifest)
            with self._guard:
                self._loads[ckpt] = load
        return load

    def _entry(self, path: str, fresh: bool = False) -> tuple[_Load, Entry]:
        ckpt, file = os.path.split(path)
        load = self._load(ckpt, fresh)
        entry = load.manifest.entries.get(path_key((file,)))
        if entry is None or isinstance(entry, ContainerEntry):
            raise FileNotFoundError(path)
        return load, entry

    def exists(self, path: Any, **kwargs: Any) -> bool:
        try:
            self._entry(strip(path), fresh=True)
        except (FileNotFoundError, SnapshotNotFoundError, ConfigError):
            return False
        return True

    def ls(self, path: Any, detail: bool = True, **kwargs: Any) -> list[Any]:
        ckpt = strip(path)
        load = self._load(ckpt, fresh=True)
        names = [
            k.split("/", 1)[1]
            for k, e in load.manifest.entries.items()
            if k.count("/") == 1 and not isinstance(e, ContainerEntry)
        ]
        out = [self.info(f"{ckpt}/{n}") for n in names]
        return out if detail else [o["name"] for o in out]

    def info(self, path: Any, **kwargs: Any) -> dict[str, Any]:
        _, entry = self._entry(strip(path))
        if isinstance(entry, PrimitiveEntry):
            size = len(_inline(entry, path))
        else:
            assert isinstance(entry, (TensorEntry, ShardedEntry))
            size = entry.shape[0]
        return {"name": strip(path), "size": size, "type": "file"}

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> io.IOBase:
        path = strip(path)
        if "w" in mode:
            return _WriteStream(self, path)
        if mode != "rb":
            raise ConfigError(f"casnap:// files open as 'rb' or 'wb', not {mode!r}")
        load, entry = self._entry(path, fresh=os.path.basename(path) == METADATA)
        if isinstance(entry, PrimitiveEntry):
            return io.BytesIO(_inline(entry, path))
        assert isinstance(entry, (TensorEntry, ShardedEntry))
        return io.BufferedReader(_ReadStream(load.repo, entry), 1 << 20)


def _inline(entry: PrimitiveEntry, path: str) -> bytes:
    data = decode_primitive(entry, path)
    if not isinstance(data, bytes):
        raise ConfigError(f"{path}: the snapshot holds a {entry.type}, not a file")
    return data


class _WriteStream(io.RawIOBase):
    """A file being written: its bytes, in segments cut at each ``tell()``."""

    def __init__(self, fs: CasnapFileSystem, path: str) -> None:
        super().__init__()
        self.fs, self.path = fs, path
        self.segments: list[bytearray] = [bytearray()]
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        data = memoryview(b).cast("B")
        self.segments[-1] += data
        self.size += len(data)
        return len(data)

    def tell(self) -> int:
        if self.segments[-1]:
            self.segments.append(bytearray())  # DCP asks before each item: a boundary
        return self.size

    def seekable(self) -> bool:
        return False

    def close(self) -> None:
        if self.closed:
            return
        segments, self.segments = self.segments, []
        super().close()
        self.fs._stored(self.path, segments)


class _ReadStream(io.RawIOBase):
    """A stored file, read at any offset; every chunk is verified as it is fetched."""

    def __init__(self, repo: RepoStorage, entry: TensorEntry | ShardedEntry) -> None:
        super().__init__()
        self.repo = repo
        if isinstance(entry, TensorEntry):
            self.shards = [(0, entry.shape[0], entry.chunk_size, entry.chunks)]
        else:
            self.shards = [(s.offsets[0], s.sizes[0], s.chunk_size, s.chunks) for s in entry.shards]
        self._starts = [start for start, *_ in self.shards]
        self.size = entry.shape[0]
        self.pos = 0
        self._cache: dict[tuple[int, int], bytearray] = {}
        workers = read_workers_for(repo.root.capabilities.local)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="casnap-dcpfs-r")
        self._budget = ByteBudget(default_memory_budget())

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        done = 0
        while done < len(out) and self.pos < self.size:
            i = bisect.bisect_right(self._starts, self.pos) - 1
            start, size, cs, _refs = self.shards[i]
            at = self.pos - start
            want = min(len(out) - done, size - at)
            first, last = at // cs, (at + want - 1) // cs
            self._prefetch(i, first, last)  # a read over several chunks: fetched in parallel
            for c in range(first, last + 1):
                data = self._cache[(i, c)]
                off = self.pos - start - c * cs
                n = min(len(out) - done, len(data) - off)
                out[done : done + n] = memoryview(data)[off : off + n]
                done += n
                self.pos += n
        return done

    def _prefetch(self, shard: int, first: int, last: int) -> None:
        """Chunks ``first..last`` of ``shard`` into the cache; those missing read and verified."""
        _start, size, cs, refs = self.shards[shard]
        missing = [c for c in range(first, last + 1) if (shard, c) not in self._cache]
        if not missing:
            return
        bufs = [bytearray(min(cs, size - c * cs)) for c in missing]

        def sink(j: int, data: Buffer) -> None:
            bufs[j][: len(data)] = data

        read_chunks(self.repo, [refs[c] for c in missing], Consumer(sink), self._pool, self._budget)
        keep = max(_CACHED_CHUNKS, last - first + 1)
        for c, buf in zip(missing, bufs, strict=True):
            while len(self._cache) >= keep:
                oldest = next(iter(self._cache))
                if oldest[0] == shard and first <= oldest[1] <= last:
                    break  # never evict what this read is about to copy
                del self._cache[oldest]
            self._cache[(shard, c)] = buf

    def close(self) -> None:
        if not self.closed:
            self._pool.shutdown(wait=False)
        super().close()
