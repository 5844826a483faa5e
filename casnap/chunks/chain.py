"""The delta frames one read needs, fetched by pack ranges once (docs/chunking.md).

Restoring the newest of a series of snapshots with deltas reads, for every
chunk, one delta frame from each snapshot of its chain, and each snapshot's
deltas lie next to each other in a few packs. Fetched one frame at a time,
that is one request (on a local disk: an open, a read and a close) per link
and chunk; :class:`ChainFrames` plans the delta links of every chunk of a
read up front, merges the frames of one pack that lie close together into
ranges, fetches each range once, when a chunk first needs it, and drops it
once every chunk that needs it has taken its frames.

Only an optimisation: the frames are handed out unchecked, as a fetch of the
frame alone would be, and whatever goes wrong (a range that cannot be
fetched, a frame asked for more often than planned, the memory limit) makes
:meth:`ChainFrames.get` answer None, and the caller fetches the frame alone,
which reports and contains what is wrong.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

from casnap.errors import CasnapError
from casnap.format.entries import ChunkRef
from casnap.repo.repository import RepoStorage, pack_key

# Frames further apart than this are fetched by separate ranges; a range is at most
# _MAX_RANGE bytes and holds only frames of at most _MAX_FRAME bytes (a larger one
# gains nothing from sharing a request). At most _LIMIT bytes are held at once.
_GAP = 256 * 1024
_MAX_RANGE = 8 << 20
_MAX_FRAME = 2 << 20
_LIMIT = 128 << 20


@dataclass
class _Range:
    pack: str
    start: int
    end: int
    users: int = 0  # frame uses planned and not yet handed out
    data: bytes | None = None
    failed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class ChainFrames:
    """The frames of the delta links of ``refs``, fetched by shared pack ranges.

    Example::

        frames = ChainFrames(repo, refs)
        raw = frames.get(link)  # the frame's bytes, or None: fetch it alone
        with frames.rebuilds:   # decoding and XOR: as many at once as there are cores
            ...

    ``rebuilds`` bounds the rebuilds running at once to the cores: a rebuild is
    CPU work that mostly holds the GIL (zstd, numpy on small runs), and a
    dozen I/O workers contending for it took 1.3x the time two did
    (benchmarks/delta.py, series).
    """

    def __init__(self, repo: RepoStorage, refs: Iterable[ChunkRef], limit: int = _LIMIT) -> None:
        self._repo = repo
        self._limit = limit
        self._held = 0
        self._lock = threading.Lock()
        self.rebuilds = threading.BoundedSemaphore(max(1, os.cpu_count() or 1))
        uses: dict[tuple[str, int, int], int] = {}
        for ref in refs:
            if ref.base is None:
                continue
            for link in ref.chain():
                if link.base is not None and link.pack is not None and link.length <= _MAX_FRAME:
                    where = (link.pack, link.offset, link.length)
                    uses[where] = uses.get(where, 0) + 1
        self._where: dict[tuple[str, int, int], _Range] = {}
        current: _Range | None = None
        for pack, offset, length in sorted(uses):
            end = offset + length
            if (
                current is None
                or current.pack != pack
                or offset - current.end > _GAP
                or max(end, current.end) - current.start > _MAX_RANGE
            ):
                current = _Range(pack, offset, end)
            current.end = max(current.end, end)
            current.users += uses[(pack, offset, length)]
            self._where[(pack, offset, length)] = current

    def get(self, link: ChunkRef) -> memoryview | None:
        """``link``'s stored frame (unchecked), or None: the caller fetches it alone."""
        if link.pack is None:
            return None
        rng = self._where.get((link.pack, link.offset, link.length))
        if rng is None:
            return None
        with rng.lock:
            if rng.failed or rng.users <= 0:
                return None
            if rng.data is None and not self._fetch(rng):
                return None
            data = rng.data
            assert data is not None
            rng.users -= 1
            if rng.users == 0:  # every planned use handed out: drop it
                rng.data = None
                with self._lock:
                    self._held -= rng.end - rng.start
        at = link.offset - rng.start
        if at + link.length > len(data):
            return None  # the pack is shorter than the manifest says: fetched alone, reported
        return memoryview(data)[at : at + link.length]

    def _fetch(self, rng: _Range) -> bool:
        """Fetch ``rng`` (its lock held); False if it cannot be held or fetched."""
        size = rng.end - rng.start
        with self._lock:
            if self._held + size > self._limit:
                return False  # this frame is fetched alone; the range may fit later
            self._held += size
        try:
            rng.data = self._repo.store.get_range(pack_key(rng.pack), rng.start, rng.end)
        except (CasnapError, OSError):  # the frame alone is fetched, which says what is wrong
            rng.failed = True
            with self._lock:
                self._held -= size
            return False
        return True
