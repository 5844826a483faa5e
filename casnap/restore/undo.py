"""What a restore overwrites in place, kept until each tensor is complete.

Why and how (saved bytes in a reused pool, verified mappings *held* instead of
written, no copy for the chunk that completes a tensor): docs/pipeline.md,
"A failed restore: all or nothing per tensor".
"""

from __future__ import annotations

import ctypes
import mmap
import threading

from casnap.chunks.target import Buffer, Chunked, ReadTarget

# Fresh anonymous memory costs a page fault per page on first touch; populating
# a buffer when it is mapped costs about half as much on this VM
# (benchmarks/restore_atomic.py). Linux only; elsewhere a bytearray.
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_FLAGS = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0) | _POPULATE


def _address(buf: memoryview | bytearray | mmap.mmap) -> int:
    """The address of a writable buffer's first byte (it must not be empty)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


class _PyBuffer(ctypes.Structure):
    _fields_ = [  # noqa: RUF012  (CPython's Py_buffer)
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(_PyBuffer)]
_PYBUF_ANY_CONTIGUOUS = 0x80


def _read_address(buf: memoryview) -> int:
    """The address of a contiguous, possibly read-only buffer's first byte (``buf`` keeps it)."""
    info = _PyBuffer()
    _get_buffer(buf, ctypes.byref(info), _PYBUF_ANY_CONTIGUOUS)  # raises if not contiguous
    try:
        return int(info.buf)
    finally:
        _release_buffer(ctypes.byref(info))


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
        self.held = 0  # bytes of verified chunks held off their targets (mappings), in all
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

    def count_held(self, n: int) -> None:
        with self._lock:
            self.held += n

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
        self._size = len(view)
        self._saved: list[tuple[int, int, tuple[bytearray | mmap.mmap, int]]] = []
        self._held: list[tuple[int, memoryview]] = []  # verified, not yet written
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

    def deliver(self, index: int, data: memoryview) -> None:
        """Chunk ``index``'s verified bytes (``data`` must stay valid): written once all are."""
        start = index * self._chunk_size
        if start + len(data) > self._size:
            raise ValueError(f"chunk {index} ends past its tensor")  # the caller checked
        with self._lock:
            hold = self._remaining > 1
            if hold:
                self._remaining -= 1
                self._held.append((start, data))
        if hold:
            self._pool.count_held(len(data))
            return
        self._copy_in(start, data)  # the last one: nothing of this tensor can fail now
        self.landed(index)

    def _copy_in(self, start: int, data: memoryview) -> None:
        if len(data):
            ctypes.memmove(self._base + start, _read_address(data), len(data))  # releases the GIL

    def landed(self, index: int) -> None:
        with self._lock:
            if self._remaining > 1:
                self._remaining -= 1
                return
            held, self._held = self._held, []
        for start, data in held:  # every chunk is verified: the held ones go in
            self._copy_in(start, data)
        with self._lock:
            self._remaining = 0
            saved, self._saved = self._saved, []
        for _start, _size, item in saved:
            self._pool.give(item)

    @property
    def complete(self) -> bool:
        return self._remaining == 0

    def rollback(self) -> None:
        """Put back every saved range (the tensor's previous value where anything landed)."""
        with self._lock:
            saved, self._saved = self._saved, []
            self._held = []  # never written: nothing to put back
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


class Guarded(ReadTarget):
    """The read target of one in-place tensor (``sink``) whose ``undo`` keeps what each
    chunk overwrites until the tensor is complete; a verified mapping is held instead."""

    def __init__(self, sink: Chunked, undo: TensorUndo) -> None:
        self.sink = sink
        self.undo = undo

    def consume(self, i: int, data: Buffer) -> None:
        self.undo.before_write(i, len(data), verified=True)
        self.sink.consume(i, data)
        self.undo.landed(i)

    def place(self, i: int, size: int) -> memoryview | None:
        view = self.sink.place(i, size)
        if view is not None:
            self.undo.before_write(i, size, verified=False)
        return view

    def placed(self, i: int) -> None:
        self.undo.landed(i)

    def holds(self, i: int, size: int) -> bool:
        return len(self.sink.view_for(i, size)) == size  # else decoded through a buffer

    def hold(self, i: int, data: memoryview) -> None:
        self.undo.deliver(i, data)
