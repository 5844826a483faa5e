"""Page-aligned buffers that loose chunk files are read into, verified in, then copied out of.

Reading a loose raw frame straight into its target (``preadv`` of the header
and the payload) costs more than it should: a frame's payload starts
``codec.HEADER_SIZE`` (56) bytes into its file, so the kernel copies every
page-cache page to an address 8 bytes out of step with it (targets start on
64-byte boundaries), and its copy is much slower so. Measured on the 2-core
AMD VM (1 GiB state, 255 loose chunks, 12 readers, CPU seconds user + sys):
into place 1.15-1.20 warm and 1.39-1.44 cold, through these buffers
0.93-0.96 warm and 1.27-1.35 cold, and the cold wall time fell from 1.35-2.5 s
to 1.04-1.1 s. The whole frame is read into a page-aligned buffer (in step:
the fast copy), verified there while it is hot in the cache, and only then
copied into place by ``memmove``, which handles the offset well and releases
the GIL. A side effect: no unverified byte ever reaches the target.

Buffers are reused within one read (a fresh one costs a page fault per
page); each one in use holds its bytes of the read's :class:`ByteBudget`, and
idle ones are kept only while in-use plus idle bytes stay within the budget's
limit.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from casnap.chunks.budget import ByteBudget

# Linux: mapped populated, so the first read into a buffer faults no page.
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_FLAGS = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0) | _POPULATE


def _rounded(n: int) -> int:
    """Buffers come in whole pages: frames of one chunk size share them."""
    page = mmap.PAGESIZE
    return max(page, -(-n // page) * page)


class BouncePool:
    """Reusable page-aligned read buffers of one read, under its ``budget``.

    Example::

        pool = BouncePool(ByteBudget(64 << 20))
        with pool.buffer(4 << 20) as (view, address):
            n = store.read_into(key, [view])
    """

    def __init__(self, budget: ByteBudget) -> None:
        self.budget = budget
        self._idle: dict[int, list[tuple[mmap.mmap, int]]] = {}
        self._idle_bytes = 0
        self._in_use = 0
        self.allocated = 0  # buffers mapped (the rest of the reads reused one)
        self._lock = threading.Lock()

    @contextmanager
    def buffer(self, n: int) -> Iterator[tuple[memoryview, int]]:
        """A writable view of ``n`` bytes at a page boundary, and the address of its first byte."""
        size = _rounded(n)
        self.budget.acquire(size)
        try:
            item = self._take(size)
            try:
                view = memoryview(item[0])
                try:
                    yield view[:n], item[1]
                finally:
                    view.release()
            finally:
                self._give(size, item)
        finally:
            self.budget.release(size)

    def _take(self, size: int) -> tuple[mmap.mmap, int]:
        with self._lock:
            self._in_use += size
            bucket = self._idle.get(size)
            if bucket:
                self._idle_bytes -= size
                return bucket.pop()
            self.allocated += 1
        buf = mmap.mmap(-1, size, flags=_FLAGS)
        return buf, ctypes.addressof(ctypes.c_char.from_buffer(buf))

    def _give(self, size: int, item: tuple[mmap.mmap, int]) -> None:
        with self._lock:
            self._in_use -= size
            if self._in_use + self._idle_bytes + size <= self.budget.limit:
                self._idle.setdefault(size, []).append(item)
                self._idle_bytes += size
                return
        # Over the budget's limit with it: dropped. Unmapped once nothing refers to it
        # (mmap.close() would refuse while a view exported by ctypes is alive).

    @property
    def idle_bytes(self) -> int:
        return self._idle_bytes

    def close(self) -> None:
        """Drop every idle buffer (the read is over)."""
        with self._lock:
            self._idle.clear()
            self._idle_bytes = 0
