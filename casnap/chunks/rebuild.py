"""Rebuilding a delta chunk from its chain: the frames fetched once, the deltas applied
in place, one digest check for the result (docs/chunking.md).

A delta's chain ends in a whole frame; each link XORs its runs into the
bytes below it (:mod:`casnap.format.delta`). The fast paths here decode the
whole frame without its own check, apply every delta in place and check
only the result's digest: a sparse chain then costs about what reading the
whole chunk does. :func:`rebuild` returns a new buffer, :func:`patch_in_place`
patches the caller's bytes, and :func:`rebuild_into` reads a raw whole frame
straight into its final memory first. Any failure is an answer (None, False), never an error: the
careful path, :func:`casnap.chunks.decode.decode_frame`, then decodes link
by link and names the copy at fault.

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
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

from casnap.chunks.stored import contain, fetch_frame, frame_limit
from casnap.errors import CasnapError, ObjectRefusedError
from casnap.format import codec
from casnap.format.delta import DeltaRuns, delta_runs
from casnap.format.entries import ChunkRef
from casnap.format.names import digest_of
from casnap.repo.reach import object_key
from casnap.repo.repository import RepoStorage, chunk_key, pack_key

Buffer = codec.Buffer
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

    ``rebuilds`` bounds the rebuilds running at once to the cores: decoding and
    XOR are CPU work that mostly holds the GIL (zstd, numpy on small runs), and
    a dozen I/O workers contending for it took 1.3x the time two did
    (benchmarks/delta.py, series). The digest of the result is taken outside
    it: blake3 releases the GIL, so one worker hashes while another decodes
    (series restore 1.69-1.85x -> 1.51-1.60x deltas off, alternated).
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


def rebuild_into(
    repo: RepoStorage, ref: ChunkRef, view: memoryview, shared: ChainFrames | None = None
) -> bool:
    """Rebuild delta ``ref`` straight into ``view`` (its final memory); False if not done.

    Only for a chain that ends in a loose object stored raw (the usual case:
    the whole chunk written by an earlier take): it is read into ``view``, each
    delta applied there, and the result's digest checked there, so a sparse
    chain costs what reading the whole chunk does. False (``view`` possibly
    overwritten) when anything fails; the caller then takes the careful path.
    """
    whole = whole_loose(ref)
    if whole is None or len(view) != ref.size:
        return False
    try:
        head = bytearray(codec.HEADER_SIZE)
        n = repo.store.read_into(chunk_key(whole.hash), [memoryview(head), view])
        hdr = codec.parse_header(head, chunk_key(whole.hash))
    except (CasnapError, ValueError):
        return False
    if n != frame_limit(whole) or hdr.codec != codec.CODEC_RAW or hdr.digest.hex() != whole.hash:
        return False  # stored compressed (any valid frame serves), or damaged
    return patch_in_place(repo, ref, view, shared)


def patch_in_place(
    repo: RepoStorage,
    ref: ChunkRef,
    out: memoryview,
    shared: ChainFrames | None = None,
) -> bool:
    """Apply the deltas of ``ref``'s chain to ``out`` (the bytes of the whole frame at its
    end, unverified) and check the result against ``ref``'s digest: True if it is
    ``ref``'s chunk, False (``out`` possibly changed) when anything fails.

    One digest check covers every link, the whole frame included (a damaged
    one yields other bytes); the caller takes the careful path, which names
    the link at fault, on False.
    """
    chain = ref.chain()
    if len(out) != ref.size:
        return False
    try:
        frames = fetch_chain(repo, chain[:-1], shared)
        with shared.rebuilds if shared is not None else nullcontext():
            dst = out.cast("B") if out.format != "B" else out
            for link, raw in zip(chain[:-1], frames, strict=True):  # XOR: any order
                if not apply_link(raw, link, dst):
                    return False
        return digest_of(out).hex() == ref.hash
    except (CasnapError, ValueError):
        return False


def delta_frame(
    raw: Buffer, link: ChunkRef
) -> tuple[str, codec.FrameHeader, memoryview, bytes] | None:
    """``raw``'s key, header, payload and base digest if it is the delta frame ``link``
    names, else None."""
    key = object_key(link)
    hdr = codec.parse_header(raw, key)
    if hdr.codec != codec.CODEC_DELTA or hdr.frame_length != len(raw):
        return None
    if hdr.digest.hex() != link.hash or hdr.raw_length != link.size or link.base is None:
        return None
    return key, hdr, memoryview(raw)[codec.HEADER_SIZE :], bytes.fromhex(link.base.hash)


def whole_loose(ref: ChunkRef) -> ChunkRef | None:
    """The end of ``ref``'s chain if it is a loose object (readable in place when its
    stored frame, whatever the manifest recorded, turns out raw)."""
    whole = ref.chain()[-1]
    return whole if whole.pack is None else None


def link_runs(raw: Buffer, link: ChunkRef) -> DeltaRuns | None:
    """The checked runs of delta frame ``raw`` of ``link``; None if the frame is not that delta."""
    frame = delta_frame(raw, link)
    if frame is None:
        return None
    key, hdr, payload, base_digest = frame
    return delta_runs(hdr, payload, key, base_digest)


def apply_link(raw: Buffer, link: ChunkRef, out: Any) -> bool:
    """XOR delta frame ``raw`` of ``link`` into ``out``; False if the frame is not that delta."""
    runs = link_runs(raw, link)
    if runs is None:
        return False
    runs.xor_into(out)
    return True


def rebuild(repo: RepoStorage, ref: ChunkRef, frame: Buffer) -> Buffer | None:
    """The delta ``ref`` rebuilt with one digest check, of the result; None if anything fails.

    The whole frame at the chain's end is decoded without its own check and
    every delta is XORed into it in place: a sparse chain costs about what
    reading the whole chunk does. The result's digest covers every link
    (a damaged one yields other bytes), so the careful path is only needed
    to say which link failed.
    """
    chain = ref.chain()
    try:
        frames = [frame, *fetch_chain(repo, chain[1:])]
        whole = chain[-1]
        out = bytearray(
            codec.decode(
                frames[-1],
                object_key(whole),
                bytes.fromhex(whole.hash),
                whole.size,
                check_digest=False,
            )
        )
        for link, raw in zip(reversed(chain[:-1]), reversed(frames[:-1]), strict=True):
            if not apply_link(raw, link, out):
                return None
    except (CasnapError, ValueError):
        return None
    return out if digest_of(out).hex() == ref.hash else None


def fetch_chain(
    repo: RepoStorage, chain: list[ChunkRef], shared: ChainFrames | None = None
) -> list[Buffer]:
    """Every frame of ``chain``; from ``shared`` where it holds them, the others
    concurrently where each request waits on a network."""

    def one(ref: ChunkRef) -> Buffer:
        try:
            return fetch_frame(repo, ref)
        except ObjectRefusedError as exc:  # a FIFO, a link: damage to that copy
            contain(repo, ref, exc)
            raise

    got: list[Buffer | None] = [None] * len(chain)
    if shared is not None:
        got = [shared.get(ref) for ref in chain]
    missing = [i for i, frame in enumerate(got) if frame is None]
    if len(missing) <= 1 or repo.root.capabilities.local:
        for i in missing:  # a local read is a page-cache copy: no gain from threads
            got[i] = one(chain[i])
    else:
        with ThreadPoolExecutor(len(missing), thread_name_prefix="casnap-chain") as pool:
            for i, frame in zip(missing, pool.map(one, [chain[i] for i in missing]), strict=True):
                got[i] = frame
    return [frame for frame in got if frame is not None]  # every None was filled
