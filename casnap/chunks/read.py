"""Reading chunks: planned ranged gets, verified decoding, damage contained.

:func:`read_chunks`: frames of one pack that lie close together are fetched
by one ranged get; every frame is decoded and verified against its hash
before its bytes are handed to the read's one target
(:class:`~casnap.chunks.target.ReadTarget`), and a damaged one is contained
(:mod:`casnap.chunks.decode`).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

from casnap.chunks.bounce import BouncePool
from casnap.chunks.budget import ByteBudget
from casnap.chunks.decode import decode_frame
from casnap.chunks.rebuild import rebuild_on
from casnap.chunks.stored import contain, frame_limit
from casnap.chunks.target import ReadTarget
from casnap.errors import CasnapError, IntegrityError, ObjectNotFoundError, ObjectRefusedError
from casnap.format import codec
from casnap.format.entries import ChunkRef
from casnap.repo.repository import RepoStorage, chunk_key, pack_key

Buffer = codec.Buffer
# Ranged reads of one pack merge frames separated by less than this gap, into
# ranges of at most _MAX_SPAN bytes (a larger frame is read alone): a manifest's
# offsets never make one request, or one buffer, span more than that.
_MERGE_GAP = 256 * 1024
_MAX_SPAN = 64 << 20


@dataclass(frozen=True)
class Span:
    key: str
    start: int
    end: int
    items: tuple[tuple[int, ChunkRef], ...]


def object_name(ref: ChunkRef) -> str:
    return pack_key(ref.pack) if ref.pack else chunk_key(ref.hash)


def plan_reads(refs: list[ChunkRef]) -> list[Span]:
    spans: list[Span] = []
    by_pack: dict[str, list[tuple[int, ChunkRef]]] = {}
    loose_seen: dict[str, list[tuple[int, ChunkRef]]] = {}
    for i, ref in enumerate(refs):
        if ref.base is not None and ref.pack is not None:
            # A delta is rebuilt on its whole base, which costs about a whole chunk's
            # read: one span each, so the workers rebuild a pack's deltas in parallel.
            spans.append(Span(pack_key(ref.pack), ref.offset, ref.offset + ref.length, ((i, ref),)))
        elif ref.pack is None:
            loose_seen.setdefault(ref.hash, []).append((i, ref))
        else:
            by_pack.setdefault(ref.pack, []).append((i, ref))
    for h, items in loose_seen.items():
        spans.append(Span(chunk_key(h), 0, -1, tuple(items)))
    for pid, items in by_pack.items():
        items.sort(key=lambda it: it[1].offset)
        group: list[tuple[int, ChunkRef]] = []
        start = end = 0
        for it in items:
            ref = it[1]
            far = ref.offset - end > _MERGE_GAP
            if group and (far or max(end, ref.offset + ref.length) - start > _MAX_SPAN):
                spans.append(Span(pack_key(pid), start, end, tuple(group)))
                group = []
            if not group:
                start = ref.offset
                end = ref.offset
            group.append(it)
            end = max(end, ref.offset + ref.length)
        if group:
            spans.append(Span(pack_key(pid), start, end, tuple(group)))
    return spans


@contextmanager
def _refused_is_damage(repo: RepoStorage, span: Span) -> Iterator[None]:
    """What casnap will not read at ``span``'s key is damage to every chunk of it: contained."""
    try:
        yield
    except ObjectRefusedError as exc:  # a FIFO, a link, a loose object longer than its frame
        # Each stored copy once: a span may name one chunk many times (a loose
        # object shared by every shard of a hostile entry: one record, not 40,000).
        for ref in {(ref.hash, ref.pack): ref for _, ref in span.items}.values():
            contain(repo, ref, exc)
        raise


@contextmanager
def _missing_is_integrity_error(span: Span) -> Iterator[None]:
    try:
        yield
    except ObjectNotFoundError as exc:
        raise IntegrityError(f"{span.key} is missing from the repository", span.key) from exc


def _address(view: memoryview) -> int:
    """The address of a writable buffer's first byte (it must not be empty)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def fetch_span(repo: RepoStorage, span: Span) -> bytes:
    """The stored bytes of ``span``: a loose object (at most its frame's length) or a pack range.

    What casnap will not read at the key (a FIFO, a link, a loose object longer
    than its frame: :class:`ObjectRefusedError`) is damage to every chunk of
    the span: contained like a frame that fails its check (docs/damage.md),
    so the next take writes those chunks again, then raised.
    """
    with _refused_is_damage(repo, span):
        if span.end < 0:
            return repo.store.get(span.key, limit=frame_limit(span.items[0][1]))
        return repo.store.get_range(span.key, span.start, span.end)


def read_chunks(
    repo: RepoStorage,
    refs: list[ChunkRef],
    target: ReadTarget,
    pool: ThreadPoolExecutor,
    budget: ByteBudget,
) -> int:
    """Fetch, decode and verify ``refs``; ``target`` receives chunk ``i``'s verified bytes.

    In-flight fetched and decoded bytes stay under ``budget``; ``target``'s
    methods may be called from worker threads (for different ``i``
    concurrently). Returns the bytes fetched from the store.

    Each span of the plan (:func:`plan_reads`) takes one path, chosen by what
    it holds and what ``target`` offers for its chunk (:class:`ReadTarget`):

    - a loose chunk the target :meth:`~ReadTarget.holds`, from a store that can
      map it (:meth:`~casnap.store.base.ObjectStore.map`): verified on the
      mapping (decoded first if not stored raw), then :meth:`~ReadTarget.hold`
      (raw) or :meth:`~ReadTarget.consume`; no unverified byte reaches the
      target's memory;
    - a loose chunk the target places (:meth:`~ReadTarget.place`): read whole into a
      reused page-aligned buffer under ``budget`` (:mod:`casnap.chunks.bounce`),
      decoded and verified there, only then copied into place; a chunk that
      fails verification raises :class:`IntegrityError` and writes nothing;
    - a packed delta on a loose base the store can map, for a target that
      holds: rebuilt on a private (copy-on-write) mapping of the base,
      verified there, then held (:mod:`casnap.chunks.rebuild`);
    - everything else (packed frames, other deltas, several chunks of one
      span, a target that only consumes): fetched by one get, decoded through
      a buffer (a delta rebuilt on its whole base), consumed.
    """
    reader = _Reader(repo, target, budget)
    futures = [pool.submit(reader.run, span) for span in plan_reads(refs)]
    errors = [f.exception() for f in futures]
    reader.bounce.close()
    for exc in errors:
        if exc is not None:
            raise exc  # a store, integrity or target error, with its own type
    return reader.fetched


class _Reader:
    """One :func:`read_chunks` call: each span runs on a worker, by one path."""

    def __init__(self, repo: RepoStorage, target: ReadTarget, budget: ByteBudget) -> None:
        self.repo = repo
        self.target = target
        self.budget = budget
        self.fetched = 0
        self._lock = threading.Lock()
        self.bounce = BouncePool(budget)

    def _count(self, n: int) -> None:
        with self._lock:
            self.fetched += n

    def run(self, span: Span) -> None:
        """The span by the first path that takes it (:func:`read_chunks` lists them)."""
        one = span.items[0] if len(span.items) == 1 else None
        if one is None or not self._fast(span, *one):
            self._buffered(span)

    def _fast(self, span: Span, i: int, ref: ChunkRef) -> bool:
        """A span of one chunk by its fast path, if the target and the store allow one."""
        if ref.base is not None:
            return self._delta_mapped(span, i, ref)
        if span.end >= 0:  # a packed frame: buffered
            return False
        # A loose object (any valid frame of the chunk: read whole).
        return self._loose_mapped(span, i, ref) or self._loose_placed(span, i, ref)

    def _loose_mapped(self, span: Span, i: int, ref: ChunkRef) -> bool:
        """A loose object mapped and verified on the mapping: a raw frame's bytes are
        held by the target in place, another codec's decoded bytes consumed."""
        if not self.target.holds(i, ref.size):
            return False
        with _missing_is_integrity_error(span), _refused_is_damage(self.repo, span):
            frame = self.repo.store.map(span.key, frame_limit(ref))
        if frame is None:
            return False  # the store cannot map: read as usual
        view = memoryview(frame)
        self._count(len(view))
        data = decode_frame(self.repo, span.key, ref, view)  # a short file too
        if len(view) == frame_limit(ref):
            self.target.hold(i, memoryview(data))  # stored raw: verified bytes of the mapping
        else:
            self.target.consume(i, data)  # decoded into memory of its own
        return True

    def _loose_placed(self, span: Span, i: int, ref: ChunkRef) -> bool:
        """A loose object read whole into a page-aligned buffer, decoded and verified
        there, then copied into place (:mod:`casnap.chunks.bounce` says why not
        straight into place). A raw frame is verified where it was read; another
        codec is decoded from there."""
        view = self.target.place(i, ref.size)
        if view is None or len(view) != ref.size:
            return False  # decoded through a buffer
        with self.bounce.buffer(frame_limit(ref)) as (frame, address):
            with _missing_is_integrity_error(span), _refused_is_damage(self.repo, span):
                n = self.repo.store.read_into(span.key, [frame])
            self._count(n)
            data = decode_frame(self.repo, span.key, ref, frame[:n])
            if ref.size and len(data) == n - codec.HEADER_SIZE:  # raw: still in the buffer
                ctypes.memmove(_address(view), address + codec.HEADER_SIZE, ref.size)
            elif ref.size:
                view[:] = memoryview(data).cast("B")
        self.target.placed(i)
        return True

    def _delta_mapped(self, span: Span, i: int, ref: ChunkRef) -> bool:
        """A packed delta on a loose base, for a target that holds: rebuilt on a private
        (copy-on-write) mapping of the base, where only the pages the delta changes
        are copied, verified there and held as a chunk stored whole is (no undo copy,
        no rebuild buffer, one digest pass). Where that fails, the careful decode
        names the frame at fault (:func:`~casnap.chunks.decode.decode_frame`)."""
        base = ref.base
        if base is None or base.pack is not None or span.end < 0:
            return False  # a loose delta (no writer makes one) or a packed base: buffered
        if not self.target.holds(i, ref.size):
            return False
        try:
            frame = self.repo.store.map(chunk_key(base.hash), frame_limit(base), private=True)
        except CasnapError:
            return False  # the buffered path reads it and says what is wrong
        if frame is None:
            return False  # the store cannot map: buffered
        cost = span.end - span.start
        self.budget.acquire(cost)
        try:
            with _missing_is_integrity_error(span):
                delta = fetch_span(self.repo, span)
            self._count(len(delta) + len(frame))
            data = rebuild_on(ref, delta, frame)
            if data is None:
                self.target.consume(i, decode_frame(self.repo, span.key, ref, delta))
            else:
                self.target.hold(i, memoryview(data))
        finally:
            self.budget.release(cost)
        return True

    def _buffered(self, span: Span) -> None:
        """The span fetched by one get, each frame decoded through a buffer, consumed."""
        # A delta also holds its base's bytes and its decoded XOR while it is rebuilt.
        raw = sum(ref.size * (3 if ref.base else 1) for _, ref in span.items)
        cost = raw + (span.end - span.start if span.end >= 0 else frame_limit(span.items[0][1]))
        self.budget.acquire(cost)
        try:
            with _missing_is_integrity_error(span):
                blob = fetch_span(self.repo, span)
            self._count(len(blob))
            mv = memoryview(blob)
            for i, ref in span.items:
                if span.end < 0:
                    frame = mv
                else:
                    frame = mv[ref.offset - span.start : ref.offset - span.start + ref.length]
                self.target.consume(i, decode_frame(self.repo, span.key, ref, frame))
        finally:
            self.budget.release(cost)
