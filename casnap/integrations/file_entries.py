"""Reading a file of a ``casnap://`` snapshot (:mod:`casnap.integrations.dcp_fs`): at any
offset, each chunk fetched once, in parallel where a read spans several, and verified."""

from __future__ import annotations

import bisect
import io
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from casnap.chunks.budget import ByteBudget
from casnap.chunks.read import Buffer, read_chunks
from casnap.chunks.target import Consumer
from casnap.format.entries import ShardedEntry, TensorEntry
from casnap.repo.repository import RepoStorage
from casnap.settings import default_memory_budget, read_workers_for

_CACHED_CHUNKS = 8  # decoded chunks a read stream keeps (torch.load reads in small pieces)


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
