"""Host buffers for async takes, reused from one take to the next.

An async take must copy every tensor before it returns (that is what makes
it point-in-time), so its staging memory equals the state's size. What need
not be paid every time is the allocation: page-faulting fresh memory costs
as much as the copy itself on a large state. Buffers come back to the pool
when a take's background part finishes, and the next take of the same
structure finds them there. The pool keeps at most ``idle_limit`` bytes of
idle buffers, and a fresh allocation that would push buffers in use plus
idle ones over the caller's limit first drops the idle ones (a take whose
structure changed does not pay for the old structure's buffers too).

A pool belongs to a :class:`casnap.Session` (successive async takes through
one session reuse its buffers); it is guarded by a lock, since the caller
stages while a previous take's background part gives buffers back.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch

from casnap.torch_io.tensors import copy_bits


class StagingPool:
    def __init__(self, idle_limit: int) -> None:
        self.idle_limit = idle_limit  # idle bytes kept for the next take
        self._lock = threading.Lock()
        self._free: dict[tuple[torch.dtype, int], list[torch.Tensor]] = {}
        self._idle_bytes = 0
        self.in_use_bytes = 0  # handed out by stage(), not yet given back
        self.peak_in_use_bytes = 0
        self.allocated_bytes = 0  # fresh allocations, over the pool's life
        self.reused_bytes = 0

    def stage(self, tensor: torch.Tensor, limit: int | None = None) -> torch.Tensor:
        """A contiguous CPU copy of ``tensor`` (bit for bit) in a reused or new buffer.

        With ``limit``, idle buffers are dropped before a fresh allocation would
        make the pool's memory (in use + idle + new) exceed it.
        """
        src = tensor.detach()
        if src.is_conj() or src.is_neg():
            src = src.resolve_conj().resolve_neg()
        nbytes = src.numel() * src.element_size()
        key = (src.dtype, src.numel())
        with self._lock:
            bucket = self._free.get(key)
            buf = bucket.pop() if bucket else None
            if buf is not None:
                self._idle_bytes -= nbytes
                self.reused_bytes += nbytes
            else:
                over = limit is not None and self.in_use_bytes + self._idle_bytes + nbytes > limit
                if over:
                    self._free.clear()
                    self._idle_bytes = 0
                self.allocated_bytes += nbytes
            self.in_use_bytes += nbytes
            self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
        if buf is None:
            pin = src.device.type == "cuda" and torch.cuda.is_available()
            buf = torch.empty(src.numel(), dtype=src.dtype, pin_memory=pin)
        out = buf.view(src.shape)
        copy_bits(out, src)
        return out

    def give_back(self, tensors: Iterable[torch.Tensor]) -> None:
        """Return staged buffers once nothing reads them any more."""
        with self._lock:
            for t in tensors:
                nbytes = t.numel() * t.element_size()
                self.in_use_bytes -= nbytes
                if self._idle_bytes + nbytes > self.idle_limit:
                    continue  # dropped: the allocator gets it back
                flat = t.reshape(-1)
                self._free.setdefault((t.dtype, t.numel()), []).append(flat)
                self._idle_bytes += nbytes

    @property
    def idle_bytes(self) -> int:
        """Bytes of buffers kept for the next take."""
        return self._idle_bytes

    def __repr__(self) -> str:
        return f"StagingPool(in_use={self.in_use_bytes}, idle={self._idle_bytes})"
