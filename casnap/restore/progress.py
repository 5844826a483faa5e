"""Progress of a restore: bytes verified and landed, reported as they arrive.

A restore's reads are batches (``restore._Reads``) whose chunks arrive through
one of three callbacks: ``sink`` (decoded through a buffer), ``landed`` (read
straight into the target) or ``mapped`` (verified on a mapping). Each is
wrapped to add the chunk's size to one running total, so
``progress(done_bytes, total_bytes)`` sees every chunk exactly once, after it
verified, and ends at the total of the chunks read.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from casnap.format.entries import ChunkRef

Progress = Callable[[int, int], None]  # (done_bytes, total_bytes)


class _Batch(Protocol):
    # Read-only members: a dataclass's fields (``restore._Reads``) satisfy them.
    @property
    def refs(self) -> list[ChunkRef]: ...
    @property
    def sink(self) -> Callable[[int, Any], None]: ...
    @property
    def landed(self) -> Callable[[int], None] | None: ...
    @property
    def mapped(self) -> Callable[[int], Callable[[Any], None] | None] | None: ...


B = TypeVar("B", bound=_Batch)


def counted(batches: Sequence[B], progress: Progress) -> list[B]:
    """``batches`` with every delivery of a chunk also reported to ``progress`` (in order)."""
    total = sum(ref.size for b in batches for ref in b.refs)
    lock = threading.Lock()
    done = [0]

    def tick(nbytes: int) -> None:
        with lock:  # in order: the callback sees done_bytes increase
            done[0] += nbytes
            progress(done[0], total)

    return [_counted_batch(b, tick) for b in batches]


def _counted_batch(b: B, tick: Callable[[int], None]) -> B:
    refs, sink, landed, mapped = b.refs, b.sink, b.landed, b.mapped

    def sink2(i: int, data: Any) -> None:
        sink(i, data)
        tick(refs[i].size)

    def landed2(i: int) -> None:
        if landed is not None:
            landed(i)
        tick(refs[i].size)

    def mapped2(i: int) -> Callable[[Any], None] | None:
        take = mapped(i) if mapped is not None else None
        if take is None:
            return None

        def take2(data: Any) -> None:
            take(data)
            tick(refs[i].size)

        return take2

    changes = {"sink": sink2, "landed": landed2, "mapped": mapped2 if mapped else None}
    return dataclasses.replace(b, **changes)  # type: ignore[type-var]
