"""Progress of a restore: bytes verified and landed, reported as they arrive.

A restore's reads are batches (``restore._Reads``), each with one read target
(:class:`~casnap.chunks.target.ReadTarget`) that a chunk reaches exactly once:
consumed (decoded through a buffer), placed (read straight into the target,
then verified) or held (verified on a mapping). :class:`Counted` wraps the
target to add the chunk's size to one running total at each, so
``progress(done_bytes, total_bytes)`` sees every chunk exactly once, after it
verified, and ends at the total of the chunks read.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from casnap.chunks.target import Buffer, ReadTarget
from casnap.format.entries import ChunkRef

Progress = Callable[[int, int], None]  # (done_bytes, total_bytes)


class _Batch(Protocol):
    # Read-only members: a dataclass's fields (``restore._Reads``) satisfy them.
    @property
    def refs(self) -> list[ChunkRef]: ...
    @property
    def target(self) -> ReadTarget: ...


B = TypeVar("B", bound=_Batch)


class _Tally:
    """One running total over every batch, reported in order."""

    def __init__(self, total: int, progress: Progress) -> None:
        self.total = total
        self.done = 0
        self.progress = progress
        self._lock = threading.Lock()

    def tick(self, nbytes: int) -> None:
        with self._lock:  # in order: the callback sees done_bytes increase
            self.done += nbytes
            self.progress(self.done, self.total)


class Counted(ReadTarget):
    """``target``, with every verified chunk of ``refs`` also counted in ``tally``."""

    def __init__(self, target: ReadTarget, refs: list[ChunkRef], tally: _Tally) -> None:
        self.target = target
        self.refs = refs
        self.tally = tally

    def consume(self, i: int, data: Buffer) -> None:
        self.target.consume(i, data)
        self.tally.tick(self.refs[i].size)

    def place(self, i: int, size: int) -> memoryview | None:
        return self.target.place(i, size)

    def placed(self, i: int) -> None:
        self.target.placed(i)
        self.tally.tick(self.refs[i].size)

    def holds(self, i: int, size: int) -> bool:
        return self.target.holds(i, size)

    def hold(self, i: int, data: memoryview) -> None:
        self.target.hold(i, data)
        self.tally.tick(self.refs[i].size)


def counted(batches: Sequence[B], progress: Progress) -> list[B]:
    """``batches`` with every delivery of a chunk also reported to ``progress`` (in order)."""
    tally = _Tally(sum(ref.size for b in batches for ref in b.refs), progress)
    return [
        dataclasses.replace(b, target=Counted(b.target, b.refs, tally))  # type: ignore[type-var]
        for b in batches
    ]
