"""What a restore overwrites in place, kept until each tensor is complete (docs/pipeline.md).

A restore reads chunks straight into the target tensors. A chunk that fails
verification after it landed, a store error after part of a chunk arrived,
or a tensor of several chunks of which some landed before another failed,
would each leave a tensor holding neither its previous value nor the
snapshot's. So before a chunk lands in a target, the bytes it overwrites are
copied aside; once every chunk of that tensor has landed verified, the copies
go back to a pool that the next tensors reuse (fresh memory costs a page fault
per page, as much as the copy itself). A failed read puts back the saved bytes
of every tensor that is not complete.

The one write that needs no copy: a verified chunk that completes its tensor
(every other chunk has landed verified), as nothing of that tensor can fail
after it. A tensor of one chunk decoded from a pack or from zstd costs nothing.
"""

from __future__ import annotations

import ctypes
import mmap
import threading

# Fresh anonymous memory costs a page fault per page on first touch; populating
# a buffer when it is mapped costs about half as much on this VM
# (benchmarks/restore_atomic.py). Linux only; elsewhere a bytearray.
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_FLAGS = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0) | _POPULATE


def _address(buf: memoryview | bytearray | mmap.mmap) -> int:
    """The address of a writable buffer's first byte (it must not be empty)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def _fresh(n: int) -> bytearray | mmap.mmap:
    if _POPULATE and n >= mmap.PAGESIZE:
        return mmap.mmap(-1, n, flags=_FLAGS)
    return bytearray(n)


class UndoPool:
    """Buffers for saved bytes, shared by the tensors of one restore and reused.

    ``limit`` bounds in-use plus idle bytes where it can: before a fresh
    allocation would exceed it, idle buffers are dropped. The caller sizes
    ``limit`` so that the bytes in use alone never exceed it.
    """

    def __init__(self, limit: int = 0) -> None:
        self.limit = limit
        self.in_use = 0
        self.peak = 0  # most bytes held (in use + idle) at once
        self._idle = 0
        self._free: dict[int, list[tuple[bytearray | mmap.mmap, int]]] = {}
        self._lock = threading.Lock()

    def take(self, n: int) -> tuple[bytearray | mmap.mmap, int]:
        with self._lock:
            bucket = self._free.get(n)
            if bucket:
                self._idle -= n
                self.in_use += n
                return bucket.pop()
            if self.in_use + self._idle + n > self.limit:
                self._free.clear()
                self._idle = 0
            self.in_use += n
            self.peak = max(self.peak, self.in_use + self._idle)
        buf = _fresh(n)
        return buf, _address(buf)

    def give(self, item: tuple[bytearray | mmap.mmap, int]) -> None:
        n = len(item[0])
        with self._lock:
            self.in_use -= n
            self._idle += n
            self._free.setdefault(n, []).append(item)


class TensorUndo:
    """The saved bytes of one target tensor whose ``chunks`` chunks land in ``view``.

    Readers call :meth:`before_write` before a chunk's bytes reach ``view``
    (with ``verified`` true when they are already verified) and :meth:`landed`
    once they are there and verified; :meth:`rollback` runs after every reader
    has stopped.
    """

    def __init__(self, pool: UndoPool, view: memoryview, chunk_size: int, chunks: int) -> None:
        self._pool = pool
        self._base = _address(view)
        self._chunk_size = chunk_size
        self._remaining = chunks
        self._saved: list[tuple[int, int, tuple[bytearray | mmap.mmap, int]]] = []
        self._lock = threading.Lock()

    def before_write(self, index: int, size: int, *, verified: bool) -> None:
        if size == 0:
            return
        with self._lock:
            if verified and self._remaining == 1:
                return  # completes the tensor: nothing of it can fail after this write
        item = self._pool.take(size)
        start = index * self._chunk_size
        ctypes.memmove(item[1], self._base + start, size)  # releases the GIL
        with self._lock:
            self._saved.append((start, size, item))

    def landed(self, index: int) -> None:
        with self._lock:
            self._remaining -= 1
            done, saved = self._remaining == 0, self._saved
            if done:
                self._saved = []
        if done:
            for _start, _size, item in saved:
                self._pool.give(item)

    @property
    def complete(self) -> bool:
        return self._remaining == 0

    def rollback(self) -> None:
        """Put back every saved range (the tensor's previous value where anything landed)."""
        with self._lock:
            saved, self._saved = self._saved, []
        for start, size, item in reversed(saved):
            ctypes.memmove(self._base + start, item[1], size)
            self._pool.give(item)


class Undo:
    """Every :class:`TensorUndo` of one restore, with the pool they share."""

    def __init__(self) -> None:
        self.pool = UndoPool()
        self._tensors: list[TensorUndo] = []

    def guard(self, view: memoryview, chunk_size: int, chunks: int) -> TensorUndo:
        undo = TensorUndo(self.pool, view, chunk_size, chunks)
        self._tensors.append(undo)
        return undo

    def rollback(self) -> None:
        """Roll back every incomplete tensor, last guarded first (call once readers stopped)."""
        for undo in reversed(self._tensors):
            if not undo.complete:
                undo.rollback()
