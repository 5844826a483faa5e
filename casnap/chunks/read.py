"""Reading chunks: planned ranged gets, verified decoding, damage contained.

:func:`read_chunks`: frames of one pack that lie close together are fetched
by one ranged get; every frame is decoded and verified against its hash
before its bytes are handed on, and a damaged one is contained
(:mod:`casnap.chunks.decode`).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

from casnap.chunks.bounce import BouncePool
from casnap.chunks.budget import ByteBudget
from casnap.chunks.decode import decode_frame
from casnap.chunks.rebuild import ChainFrames, patch_in_place, rebuild_into, whole_loose
from casnap.chunks.stored import contain, frame_limit
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
            # A delta is rebuilt from its chain, which costs about a whole chunk's
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
        for _, ref in span.items:
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


def _loose(span: Span) -> tuple[int, ChunkRef] | None:
    """The one chunk of ``span`` if it is a loose object (any valid frame of the chunk:
    read whole, then decoded where it is)."""
    if span.end >= 0 or len(span.items) != 1:
        return None
    i, ref = span.items[0]
    return (i, ref) if ref.base is None else None


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
    sink: Callable[[int, Buffer], None],
    pool: ThreadPoolExecutor,
    budget: ByteBudget,
    dest: Callable[[int], memoryview | None] | None = None,
    landed: Callable[[int], None] | None = None,
    mapped: Callable[[int], Callable[[Buffer], None] | None] | None = None,
) -> int:
    """Fetch, decode and verify ``refs``; ``sink(i, data)`` receives chunk ``i``.

    In-flight fetched and decoded bytes stay under ``budget``; ``sink`` may be
    called from worker threads (for different ``i`` concurrently). Returns the
    bytes fetched from the store.

    ``dest(i)``, when given, may return the memory chunk ``i`` finally belongs
    in: a loose chunk is then read whole into a reused page-aligned buffer
    under ``budget`` (:mod:`casnap.chunks.bounce`), decoded and verified there
    and only then copied into it, with no ``sink`` call; a chunk that fails verification
    raises :class:`IntegrityError` and writes nothing. A delta rebuilt in
    place (below) is written to ``dest`` before its check. ``landed(i)``, when
    given, is called once chunk ``i`` written to ``dest`` has been verified
    (the caller keeps what ``dest`` overwrote until then).

    ``mapped(i)``, when given, may return a function that takes chunk ``i``'s
    verified bytes instead: a loose chunk whose object the store can map
    (:meth:`~casnap.store.base.ObjectStore.map`) is verified on the mapping
    (decoded first if not stored raw) and only then handed to it (no ``dest``
    or ``sink`` call), so no unverified byte reaches the caller's memory. The bytes stay valid while
    referenced. Where the store cannot map, ``dest`` and ``sink`` serve.
    A delta chunk whose chain ends in a mappable whole frame is rebuilt on a
    private (copy-on-write) mapping of that frame and verified there, then
    handed to it the same way.
    """
    spans = plan_reads(refs)
    fetched = 0
    lock = threading.Lock()
    # The delta frames of every chain, fetched by shared pack ranges (casnap.chunks.chain).
    shared = ChainFrames(repo, refs) if any(ref.base is not None for ref in refs) else None
    bounce = BouncePool(budget)

    def direct(span: Span) -> bool:
        """A loose object read whole into a page-aligned buffer, decoded and verified
        there, then copied into ``dest`` (:mod:`casnap.chunks.bounce` says why not
        into place). A raw frame is verified where it was read; another codec is
        decoded from there."""
        nonlocal fetched
        one = _loose(span)
        if dest is None or one is None:
            return False  # packed: decoded through a buffer
        i, ref = one
        view = dest(i)
        if view is None or len(view) != ref.size:
            return False
        with bounce.buffer(frame_limit(ref)) as (frame, address):
            with _missing_is_integrity_error(span), _refused_is_damage(repo, span):
                n = repo.store.read_into(span.key, [frame])
            with lock:
                fetched += n
            data = decode_frame(repo, span.key, ref, frame[:n])
            if ref.size and len(data) == n - codec.HEADER_SIZE:  # raw: still in the buffer
                ctypes.memmove(_address(view), address + codec.HEADER_SIZE, ref.size)
            elif ref.size:
                view[:] = memoryview(data).cast("B")
        if landed is not None:
            landed(i)
        return True

    def from_mapping(span: Span) -> bool:
        """A loose object mapped and verified on the mapping: a raw frame's bytes are
        handed to ``mapped(i)`` in place, another codec's decoded bytes to ``sink``."""
        nonlocal fetched
        one = _loose(span)
        if mapped is None or one is None:
            return False
        i, ref = one
        take = mapped(i)
        if take is None:
            return False
        with _missing_is_integrity_error(span), _refused_is_damage(repo, span):
            frame = repo.store.map(span.key, frame_limit(ref))
        if frame is None:
            return False  # the store cannot map: read as usual
        view = memoryview(frame)
        with lock:
            fetched += len(view)
        data = decode_frame(repo, span.key, ref, view)  # a short file too
        if len(view) == frame_limit(ref):
            take(data)  # stored raw: verified bytes of the mapping, no copy
        else:
            sink(i, data)  # decoded into memory of its own: handed on as any decoded chunk
        return True

    def lone_delta(span: Span) -> tuple[int, ChunkRef] | None:
        """The span's one item, if it is a delta (the two rebuilds below take one)."""
        return span.items[0] if len(span.items) == 1 and span.items[0][1].base is not None else None

    def delta_from_mapping(span: Span) -> bool:
        """A delta whose chain ends in a loose raw frame the store can map, rebuilt on a
        private mapping of it (only the pages the deltas change are copied) and
        verified there: handed on as a chunk stored whole is (no undo copy, no
        rebuild buffer, one digest pass)."""
        nonlocal fetched
        one = lone_delta(span)
        if mapped is None or one is None:
            return False
        i, ref = one
        whole = whole_loose(ref)
        if whole is None:
            return False
        take = mapped(i)
        if take is None:
            return False
        key = chunk_key(whole.hash)
        try:
            frame = repo.store.map(key, frame_limit(whole), private=True)
        except CasnapError:
            return False  # the paths below read it and say what is wrong
        if frame is None:
            return False
        view = memoryview(frame)
        try:
            hdr = codec.parse_header(view[: codec.HEADER_SIZE], key)
        except IntegrityError:
            return False
        if len(view) != frame_limit(whole) or hdr.codec != codec.CODEC_RAW:
            return False  # stored compressed, or damaged: the paths below
        if hdr.digest.hex() != whole.hash:
            return False
        payload = view[codec.HEADER_SIZE :]
        if not patch_in_place(repo, ref, payload, shared):
            return False  # damage somewhere: rebuilt link by link below, which names it
        with lock:
            fetched += len(view) + sum(link.length for link in ref.chain()[:-1])
        take(payload)
        return True

    def delta_in_place(span: Span) -> bool:
        """A delta rebuilt in its final memory (``dest``), verified there."""
        one = lone_delta(span)
        if dest is None or one is None:
            return False
        i, ref = one
        view = dest(i)
        if view is None:
            return False
        if not rebuild_into(repo, ref, view, shared):
            # The careful path decodes link by link and names what failed (raising);
            # ``dest`` was handed out, so its bytes land there, then ``landed``.
            with _missing_is_integrity_error(span):
                blob = fetch_span(repo, span)
            view[:] = memoryview(decode_frame(repo, span.key, ref, memoryview(blob))).cast("B")
        if landed is not None:
            landed(i)
        return True

    def run(span: Span) -> None:
        nonlocal fetched
        if from_mapping(span) or direct(span) or delta_from_mapping(span) or delta_in_place(span):
            return
        # A delta also holds its base's bytes and its decoded XOR while it is rebuilt.
        raw = sum(ref.size * (3 if ref.base else 1) for _, ref in span.items)
        cost = raw + (span.end - span.start if span.end >= 0 else frame_limit(span.items[0][1]))
        budget.acquire(cost)
        try:
            with _missing_is_integrity_error(span):
                blob = fetch_span(repo, span)
            with lock:
                fetched += len(blob)
            mv = memoryview(blob)
            for i, ref in span.items:
                if span.end < 0:
                    frame = mv
                else:
                    frame = mv[ref.offset - span.start : ref.offset - span.start + ref.length]
                data = decode_frame(repo, span.key, ref, frame)
                sink(i, data)
        finally:
            budget.release(cost)

    futures = [pool.submit(run, span) for span in spans]
    errors = [f.exception() for f in futures]
    bounce.close()
    for exc in errors:
        if exc is not None:
            raise exc  # a store, integrity or sink error, with its own type
    return fetched
