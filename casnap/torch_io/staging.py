"""Host buffers for staging tensors, reused from one take to the next, and the device copy path.

A :class:`StagingPool` (one per :class:`casnap.Session`, and one per process for takes
without a session: :data:`casnap.take.session.SHARED_STAGING`; guarded by a lock) hands out
buffers; a tensor on an accelerator is copied in chunk-sized pieces (:class:`PieceCopy`)
by a copy engine (:class:`CudaCopies`, or :class:`ThreadCopies` without a GPU). Design,
limits and the order of copy and write: docs/gpu.md.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import torch

from casnap.errors import CasnapError
from casnap.torch_io.tensors import copy_bits


class StagingFull(CasnapError, MemoryError):
    """Staging ``nbytes`` more would put the pool's buffers in use over its limit."""


Ready = Callable[[], object]  # waits for one asynchronous copy to complete


class CopyEngine(Protocol):
    """Starts byte copies into host memory and hands back one completion per copy."""

    def start(self, dst: torch.Tensor, src: torch.Tensor, slot: int) -> Ready: ...


class CudaCopies:
    """Device-to-host copies on one CUDA stream per slot, an event per copy."""

    def __init__(self, slots: int = 2) -> None:
        self.slots = slots
        self._streams: dict[torch.device, list[torch.cuda.Stream]] = {}  # per source device

    def _stream(self, device: torch.device, slot: int) -> torch.cuda.Stream:
        streams = self._streams.get(device)
        if streams is None:
            with torch.cuda.device(device):
                streams = [torch.cuda.Stream() for _ in range(self.slots)]  # type: ignore[no-untyped-call]
            self._streams[device] = streams
        return streams[slot % self.slots]

    def start(self, dst: torch.Tensor, src: torch.Tensor, slot: int) -> Ready:
        stream = self._stream(src.device, slot)
        # The copy must see every kernel queued on the producer's stream before the take.
        stream.wait_stream(torch.cuda.current_stream(src.device))
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
        src.record_stream(stream)  # its memory is not reused before the copy has run
        return event.synchronize  # this piece only; later pieces keep copying


class ThreadCopies:
    """The device path's contract on the CPU: copies run on a thread, a future per copy.

    ``delay_s`` slows each copy down (tests use it to make a writer that did
    not wait for its piece read bytes that are not there yet).
    """

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="casnap-copy")

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.delay_s:
            time.sleep(self.delay_s)
        dst.copy_(src)

    def start(self, dst: torch.Tensor, src: torch.Tensor, slot: int) -> Ready:
        return self._executor.submit(self._copy, dst, src).result


def default_engine() -> CopyEngine:
    return CudaCopies() if torch.cuda.is_available() else ThreadCopies()


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes, row-major, as a flat uint8 tensor on its own device."""
    t = tensor.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    t = t.contiguous()  # a no-op for the usual parameter; a device copy for a strided view
    return t.reshape(-1).view(torch.uint8)


class PieceCopy:
    """Bytes being copied into one pool buffer: :meth:`wait`, then read ``view``.

    :meth:`give_back` returns the buffer to the pool once the bytes are
    hashed and written (it waits for the copy first, so a buffer a copy may
    still write into is never handed out again).
    """

    def __init__(self, pool: StagingPool, buffer: torch.Tensor, ready: Ready | None) -> None:
        from casnap.torch_io.tensors import byte_view

        self.buffer = buffer
        self.view = byte_view(buffer)
        self._pool = pool
        self._ready = ready

    def wait(self) -> None:
        """Until the bytes are in host memory."""
        if self._ready is not None:
            self._ready()
            self._ready = None

    def give_back(self) -> None:
        self.wait()
        self._pool.give_back([self.buffer])


class StagingPool:
    """Reused host buffers for staging (docs/gpu.md).

    ``pin``: allocate page-locked buffers (default: when CUDA is available;
    plain memory otherwise, or when pinning fails). ``engine``: the copy
    engine of the device path (default: CUDA streams with CUDA, a copy thread
    without). ``device_path_for_cpu``: send CPU tensors down the device path
    too (tests; the path is otherwise for accelerator tensors).

    Example::

        pool = StagingPool(idle_limit=1 << 30)
        raw = raw_bytes(cuda_tensor)
        first = pool.copy_piece(raw, 0, 4 << 20, slot=pool.next_slot())
        first.wait()  # the first 4 MiB are in host memory (first.view)
        first.give_back()
    """

    def __init__(
        self,
        idle_limit: int,
        *,
        pin: bool | None = None,
        engine: CopyEngine | None = None,
        device_path_for_cpu: bool = False,
    ) -> None:
        self.idle_limit = idle_limit  # idle bytes kept for the next take
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.device_path_for_cpu = device_path_for_cpu
        self._engine = engine
        self._slots = itertools.count()
        self._lock = threading.Lock()
        # Flat uint8 buffers by (size, pinned): only the device path pins, since page-locking
        # costs more than it saves for a copy from CPU memory.
        self._free: dict[tuple[int, bool], list[torch.Tensor]] = {}
        self._pinned: set[int] = set()  # data_ptr of the pinned buffers the pool holds
        self._idle_bytes = 0
        self.in_use_bytes = 0  # handed out, not yet given back
        self.peak_in_use_bytes = 0
        self.peak_held_bytes = 0  # in use + idle: what the pool holds at most
        self.allocated_bytes = 0  # fresh allocations, over the pool's life
        self.reused_bytes = 0
        self.pinned_bytes = 0  # of the fresh allocations, page-locked

    @property
    def engine(self) -> CopyEngine:
        if self._engine is None:
            self._engine = default_engine()  # streams are made on first use only
        return self._engine

    def uses_device_path(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is staged by pieces on the copy engine."""
        return tensor.device.type not in ("cpu", "meta") or self.device_path_for_cpu

    def _take(self, nbytes: int, limit: int | None, pinned: bool = False) -> torch.Tensor:
        """A flat uint8 buffer of ``nbytes``: an idle one of that size, or a fresh one."""
        pinned = pinned and self.pin
        with self._lock:
            bucket = self._free.get((nbytes, pinned))
            buf = bucket.pop() if bucket else None
            if buf is not None:
                self._idle_bytes -= nbytes
                self.reused_bytes += nbytes
            else:
                if limit is not None and self.in_use_bytes + nbytes > limit:
                    raise StagingFull(
                        f"staging {nbytes} bytes would put {self.in_use_bytes + nbytes} in use, "
                        f"over the limit of {limit}"
                    )
                if limit is not None and self.in_use_bytes + self._idle_bytes + nbytes > limit:
                    self._drop_idle()
                self.allocated_bytes += nbytes
            self.in_use_bytes += nbytes
            self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
            self.peak_held_bytes = max(self.peak_held_bytes, self.in_use_bytes + self._idle_bytes)
        if buf is None:
            buf = self._allocate(nbytes, pinned)
        return buf

    def _drop_idle(self) -> None:
        """Forget every idle buffer (the allocator gets them back). Called under the lock."""
        for bucket in self._free.values():
            for b in bucket:
                self._pinned.discard(b.data_ptr())
        self._free.clear()
        self._idle_bytes = 0

    def _allocate(self, nbytes: int, pinned: bool) -> torch.Tensor:
        if pinned:
            try:
                buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            except RuntimeError:  # no CUDA driver, or the lock limit: plain memory still works
                self.pin = False
            else:
                with self._lock:
                    self.pinned_bytes += nbytes
                    if nbytes:
                        self._pinned.add(buf.data_ptr())
                return buf
        return torch.empty(nbytes, dtype=torch.uint8)

    def stage(self, tensor: torch.Tensor, limit: int | None = None) -> torch.Tensor:
        """A contiguous CPU copy of ``tensor`` (bit for bit) in a reused or new buffer.

        With ``limit``, idle buffers are dropped before a fresh allocation would
        make the pool's memory (in use + idle + new) exceed it, and
        :class:`StagingFull` is raised when the buffers in use alone would.
        Device tensors go through the copy engine (all pieces waited for here).
        """
        src = tensor.detach()
        if self.uses_device_path(src):
            raw = raw_bytes(src)
            staged = self.copy_piece(raw, 0, raw.numel(), limit, self.next_slot())
            staged.wait()
            return staged.buffer.view(src.dtype).view(src.shape)
        if src.is_conj() or src.is_neg():
            src = src.resolve_conj().resolve_neg()
        nbytes = src.numel() * src.element_size()
        out = self._take(nbytes, limit).view(src.dtype).view(src.shape)
        copy_bits(out, src)
        return out

    def next_slot(self) -> int:
        """A copy slot for one tensor's pieces (engines keep one stream per slot)."""
        return next(self._slots)

    def copy_piece(
        self, raw: torch.Tensor, start: int, stop: int, limit: int | None = None, slot: int = 0
    ) -> PieceCopy:
        """Start copying ``raw[start:stop]`` (bytes, :func:`raw_bytes`) into a pool buffer.

        Returns at once; :meth:`PieceCopy.wait` waits for the copy.
        """
        buf = self._take(stop - start, limit, pinned=True)
        if stop == start:
            return PieceCopy(self, buf, None)
        try:
            ready = self.engine.start(buf, raw[start:stop], slot)
        except BaseException:
            self.give_back([buf])
            raise
        return PieceCopy(self, buf, ready)

    def give_back(self, tensors: Iterable[torch.Tensor]) -> None:
        """Return staged buffers once nothing reads them any more."""
        with self._lock:
            for t in tensors:
                nbytes = t.numel() * t.element_size()
                self.in_use_bytes -= nbytes
                ptr = t.data_ptr()
                if self._idle_bytes + nbytes > self.idle_limit:
                    self._pinned.discard(ptr)
                    continue  # dropped: the allocator gets it back
                flat = t.reshape(-1).view(torch.uint8)  # every buffer is bytes underneath
                pinned = nbytes > 0 and ptr in self._pinned
                self._free.setdefault((nbytes, pinned), []).append(flat)
                self._idle_bytes += nbytes

    def limit_idle(self, idle_limit: int) -> None:
        """Keep at most ``idle_limit`` idle bytes from now on; if more are idle, drop them."""
        with self._lock:
            self.idle_limit = idle_limit
            if self._idle_bytes > idle_limit:
                self._drop_idle()

    @property
    def idle_bytes(self) -> int:
        """Bytes of buffers kept for the next take."""
        return self._idle_bytes

    def __repr__(self) -> str:
        return f"StagingPool(in_use={self.in_use_bytes}, idle={self._idle_bytes})"
