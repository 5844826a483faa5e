"""Where a verified read puts each chunk: one target object (torchsnapshot's ``BufferConsumer``).

:func:`casnap.chunks.read.read_chunks` hands every chunk ``i`` it verified to
one :class:`ReadTarget`. A target that only implements :meth:`~ReadTarget.consume`
receives decoded bytes (export, drift, DCP, sharded staging); a target that
also says where a chunk finally lives (:meth:`~ReadTarget.place`) or that it
may keep a verified mapping (:meth:`~ReadTarget.holds`) opens the reader's
faster paths for that chunk. Whatever path a chunk takes, no unverified byte
reaches memory of the target's except through :meth:`~ReadTarget.place`, whose
contract says so.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from casnap.format import codec

Buffer = codec.Buffer


class ReadTarget:
    """Receives the verified chunks of one read; methods may be called from worker
    threads, for different ``i`` concurrently, and each chunk arrives exactly once:
    by :meth:`consume`, by :meth:`placed` after :meth:`place`, or by :meth:`hold`."""

    def consume(self, i: int, data: Buffer) -> None:
        """Chunk ``i``'s verified bytes, in memory of the reader's: copy what you keep."""
        raise NotImplementedError

    def place(self, i: int, size: int) -> memoryview | None:
        """The memory chunk ``i`` (``size`` bytes) finally belongs in, or ``None`` (then
        :meth:`consume`). A view handed out is written by the reader: a loose chunk
        only once verified, a delta rebuilt there before its check (keep what it
        overwrote until :meth:`placed`). The reader calls :meth:`placed` once the
        bytes there verified, or raises."""
        return None

    def placed(self, i: int) -> None:
        """Chunk ``i``, written into :meth:`place`'s view, verified."""

    def holds(self, i: int, size: int) -> bool:
        """Whether chunk ``i``'s verified bytes may come by :meth:`hold` (a mapping)."""
        return False

    def hold(self, i: int, data: memoryview) -> None:
        """Chunk ``i``'s verified bytes on a mapping of its stored object (a private one
        for a rebuilt delta), valid while referenced: kept, not copied."""
        raise NotImplementedError


class Consumer(ReadTarget):
    """A target that hands every chunk to one function (``fn(i, data)``)."""

    def __init__(self, fn: Callable[[int, Buffer], None]) -> None:
        self._fn = fn

    def consume(self, i: int, data: Buffer) -> None:
        self._fn(i, data)


class Discard(ReadTarget):
    """A read that only verifies: the bytes are dropped."""

    def consume(self, i: int, data: Buffer) -> None:
        pass


class Chunked(ReadTarget):
    """Chunk ``i`` lands at byte ``i * chunk_size`` of one buffer (an object's bytes)."""

    def __init__(self, view: memoryview | bytearray, chunk_size: int) -> None:
        self.view = memoryview(view)
        self.chunk_size = chunk_size

    def view_for(self, i: int, size: int) -> memoryview:
        start = i * self.chunk_size
        return self.view[start : start + size]

    def consume(self, i: int, data: Buffer) -> None:
        start = i * self.chunk_size
        self.view[start : start + len(data)] = data


class Routes(ReadTarget):
    """One read for several targets: chunk ``i`` is chunk ``parts[i][1]`` of ``parts[i][0]``."""

    def __init__(self, parts: Sequence[tuple[ReadTarget, int]]) -> None:
        self.parts = parts

    def consume(self, i: int, data: Buffer) -> None:
        target, j = self.parts[i]
        target.consume(j, data)

    def place(self, i: int, size: int) -> memoryview | None:
        target, j = self.parts[i]
        return target.place(j, size)

    def placed(self, i: int) -> None:
        target, j = self.parts[i]
        target.placed(j)

    def holds(self, i: int, size: int) -> bool:
        target, j = self.parts[i]
        return target.holds(j, size)

    def hold(self, i: int, data: memoryview) -> None:
        target, j = self.parts[i]
        target.hold(j, data)
