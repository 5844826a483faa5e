"""Files as casnap entries, for the integrations that see files, not tensors
(:mod:`casnap.integrations.dcp_fs`, :mod:`casnap.integrations.torch_checkpointing`).

A file written is cut into segments at every ``tell()`` (DCP asks for the offset
before each item, so each item is its own segment) and each segment into chunks
at fixed offsets from its start, so an item keeps its chunks when the items
before it change size; only chunks the repository lacks are written. The file
is a 1-D ``uint8`` entry whose shards are the segments (a ``tensor`` entry for
one segment). A file read is served at any offset, each chunk fetched once, in
parallel where a read spans several, and verified against its hash.
"""

from __future__ import annotations

import bisect
import io
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from casnap.chunks.budget import ByteBudget
from casnap.chunks.read import Buffer, read_chunks
from casnap.chunks.target import Consumer
from casnap.chunks.write import ChunkWriter
from casnap.errors import ConfigError
from casnap.format.entries import (
    MAX_SHARDS,
    Entry,
    PrimitiveEntry,
    ShardedEntry,
    ShardRecord,
    TensorEntry,
)
from casnap.repo.repository import RepoStorage
from casnap.settings import Settings, default_memory_budget, read_workers_for
from casnap.take.plan import known_chunks
from casnap.take.scheduler import Scheduler, data_request
from casnap.torch_io.flatten import decode_primitive

_CACHED_CHUNKS = 8  # decoded chunks a read stream keeps (torch.load reads in small pieces)


def store_segments(
    repo: RepoStorage, settings: Settings, parents: list[str], segments: list[bytearray]
) -> Entry:
    """A closed file's entry: its segments' chunks written (those ``parents`` and the
    repository lack) and made durable."""
    segments = [s for s in segments if s]
    if len(segments) > MAX_SHARDS:
        segments = [bytearray(b"".join(segments))]
    requests = [data_request(str(i), memoryview(s), s) for i, s in enumerate(segments)]
    known = known_chunks(repo, parents)
    with ThreadPoolExecutor(settings.io_workers, thread_name_prefix="casnap-files") as pool:
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
    if len(shards) == 1:
        one = shards[0]
        return TensorEntry(
            dtype="uint8", shape=[start], chunk_size=one.chunk_size, chunks=one.chunks
        )
    if not shards:
        return TensorEntry(dtype="uint8", shape=[0], chunk_size=settings.chunk_size, chunks=[])
    return ShardedEntry(layout="dtensor", dtype="uint8", shape=[start], shards=shards)


def inline_bytes(entry: PrimitiveEntry, path: str) -> bytes:
    """A small file kept in the manifest itself (a ``bytes`` primitive)."""
    data = decode_primitive(entry, path)
    if not isinstance(data, bytes):
        raise ConfigError(f"{path}: the snapshot holds a {entry.type}, not a file")
    return data


def entry_size(entry: Entry, path: str) -> int:
    """The size in bytes of the file ``entry`` holds."""
    if isinstance(entry, PrimitiveEntry):
        return len(inline_bytes(entry, path))
    if not isinstance(entry, (TensorEntry, ShardedEntry)):
        raise IsADirectoryError(path)
    return entry.shape[0]


def open_entry(repo: RepoStorage, entry: Entry, path: str) -> io.IOBase:
    """A readable, seekable stream of the file ``entry`` holds; every chunk verified."""
    if isinstance(entry, PrimitiveEntry):
        return io.BytesIO(inline_bytes(entry, path))
    if not isinstance(entry, (TensorEntry, ShardedEntry)):
        raise IsADirectoryError(path)
    return io.BufferedReader(ReadStream(repo, entry), 1 << 20)


class WriteStream(io.RawIOBase):
    """A file being written: its bytes, in segments cut at each ``tell()``, handed
    to ``on_close`` when it closes."""

    def __init__(self, on_close: Callable[[list[bytearray]], None]) -> None:
        super().__init__()
        self.on_close = on_close
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
        self.on_close(segments)


class ReadStream(io.RawIOBase):
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
