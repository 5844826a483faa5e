"""Writing and reading chunks: dedup, packing of small chunks, verified reads.

Writing (:class:`ChunkWriter`): each chunk is hashed; a chunk already known
(written earlier in this take, listed by a parent manifest, or present as a
loose object) is not written again. Chunks of at least ``pack_threshold``
bytes become loose objects ``chunks/<h>``; smaller ones are appended as
frames to a pack that is written once it reaches ``pack_target``. Every
frame stays independently readable by a ranged get.

Reading (:func:`read_chunks`): frames of one pack that lie close together are
fetched by one ranged get; every frame is decoded and verified against its
hash before its bytes are handed on, and a damaged one is contained
(:mod:`casnap.chunks.damage`).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from casnap.chunks.bounce import BouncePool
from casnap.chunks.budget import ByteBudget
from casnap.chunks.chain import ChainFrames
from casnap.chunks.damage import (
    contain,
    decode_frame,
    patch_in_place,
    rebuild_into,
    verify_in_place,
    whole_raw_loose,
)
from casnap.chunks.delta import DeltaEncoder
from casnap.errors import (
    CasnapError,
    IntegrityError,
    ObjectExistsError,
    ObjectNotFoundError,
    ObjectRefusedError,
)
from casnap.format import codec
from casnap.format.entries import ChunkRef
from casnap.format.manifest_bytes import trusted_chunk_ref
from casnap.format.names import digest_of, hash_bytes
from casnap.index import KnownChunks, RepoIndex
from casnap.repo.damage import DamagedCopy, DamageSet, clear_damage
from casnap.repo.repository import RepoStorage, chunk_key, pack_key
from casnap.settings import Settings

Buffer = codec.Buffer
# Small chunks go to the workers in batches of up to this many bytes or items.
BATCH_BYTES = 1 << 20
BATCH_ITEMS = 256
# Fewer small chunks of one element size than this are each tried alone (the
# trials cost little then), more are judged together first (ChunkWriter._worth_trying).
_JUDGED_TOGETHER = 8
# Ranged reads of one pack merge frames separated by less than this gap, into
# ranges of at most _MAX_SPAN bytes (a larger frame is read alone): a manifest's
# offsets never make one request, or one buffer, span more than that.
_MERGE_GAP = 256 * 1024
_MAX_SPAN = 64 << 20


@dataclass
class WriteStats:
    chunks: int = 0  # chunks submitted
    chunks_written: int = 0  # chunks whose frame was written
    raw_bytes: int = 0  # raw bytes submitted
    raw_bytes_written: int = 0  # raw bytes of the chunks written
    stored_bytes_written: int = 0  # frame bytes written (after compression)
    objects_written: int = 0  # store objects put (loose chunks + packs)
    deltas_written: int = 0  # chunks written as deltas against a parent's chunk


@dataclass(frozen=True)
class BatchItem:
    """One chunk of :meth:`ChunkWriter.add_batch`; ``result`` receives its ChunkRef."""

    data: Buffer
    result: Future[ChunkRef]
    on_done: Callable[[], None] | None = None
    elem_size: int = 0
    digest: bytes | None = None  # computed by the caller (see ChunkWriter._process)
    base: ChunkRef | None = None  # the parent's chunk here, for a delta (casnap.chunks.delta)


@dataclass
class _Pack:
    parts: list[Buffer] = field(default_factory=list)  # each frame's header, then payload
    # (future or None for add_small's chunks, hash, raw size, offset, frame length, delta base)
    waiters: list[tuple[Future[ChunkRef] | None, str, int, int, int, ChunkRef | None]] = field(
        default_factory=list
    )
    size: int = 0


class ChunkBatcher:
    """Groups small chunks (they are packed anyway) into work items of ~1 MiB."""

    def __init__(self, writer: ChunkWriter) -> None:
        self._writer = writer
        self._items: list[BatchItem] = []
        self._bytes = 0

    def add(self, item: BatchItem) -> None:
        self._items.append(item)
        self._bytes += len(item.data)
        if self._bytes >= BATCH_BYTES or len(self._items) >= BATCH_ITEMS:
            self.flush()

    def flush(self) -> None:
        if self._items:
            self._writer.add_batch(self._items)
            self._items, self._bytes = [], 0


class ChunkWriter:
    """Writes the chunks of one take; ``add`` returns a future of the chunk's ChunkRef.

    ``known`` maps chunk hashes to locations already committed (from parent
    manifests); such chunks are referenced, never rewritten. ``index`` (by
    default ``known.index`` when ``known`` is a :class:`KnownChunks`) is asked
    on a miss, before a loose chunk is probed or a small one packed again.
    Every chunk this writer put, or found present by a probe, is recorded in
    the index when :meth:`finish` returns or raises: "the object exists" is
    true from its successful put on, and only a gc (which changes the gc
    epoch, so the index drops it) can make it false (docs/index.md).

    A copy recorded as damaged (``known.damaged``, docs/damage.md) is never
    referenced: a damaged loose object is replaced by an atomic put of the
    good bytes (which heals every snapshot naming it, and clears its record);
    a chunk damaged inside a pack gets a new frame in this take's pack.
    """

    def __init__(
        self,
        repo: RepoStorage,
        settings: Settings,
        pool: ThreadPoolExecutor,
        known: Mapping[str, ChunkRef] | None = None,
        index: RepoIndex | None = None,
    ) -> None:
        self.repo = repo
        self.settings = settings
        self.pool = pool
        if index is None and isinstance(known, KnownChunks):
            index = known.index
        self.index = index
        self.damaged = known.damaged if isinstance(known, KnownChunks) else DamageSet()
        # A repository the take created holds no chunk: a probe could only miss.
        self.probe = not (isinstance(known, KnownChunks) and known.fresh)
        self.known: dict[str, ChunkRef] = dict(known or {})  # known_chunks left damage out
        self.stats = WriteStats()
        self._lock = threading.Lock()
        # Chunks being written: by hash, the future of the first, None for add_small's
        # (no future); futures of identical chunks waiting on one of those.
        self._pending: dict[str, Future[ChunkRef] | None] = {}
        self._waiting: dict[str, list[Future[ChunkRef]]] = {}
        self._pack = _Pack()
        self._work: list[Future[Any]] = []
        self._present: list[ChunkRef] = []  # stored by this writer: for the index
        # Per tensor key, the parent's (chunk size, chunk refs): the bases of deltas.
        self.bases: Mapping[str, tuple[int, Sequence[ChunkRef]]] = (
            known.bases if isinstance(known, KnownChunks) else {}
        )
        self._tensor_of: dict[str, str] = {}
        self.delta = (
            DeltaEncoder(repo, settings.delta_max_chain, settings.zstd_level)
            if settings.delta and settings.compression == "auto"
            else None
        )

    def base_of(self, key: str, index: int, chunk_size: int) -> ChunkRef | None:
        """The delta base of chunk ``index`` of tensor ``key``: the parent's chunk there."""
        if self.delta is None:
            return None
        found = self.bases.get(key)
        if found is None or found[0] != chunk_size or index >= len(found[1]):
            return None
        base = found[1][index]
        self._tensor_of[base.hash] = key  # for the delta test's back-off, by tensor
        return base

    def add(
        self,
        data: Buffer,
        on_done: Callable[[], None] | None = None,
        elem_size: int = 0,
        digest: bytes | None = None,
        base: ChunkRef | None = None,
    ) -> Future[ChunkRef]:
        """Schedule one chunk; ``data`` must stay unchanged until the future resolves.

        ``base`` (see :meth:`base_of`) lets a changed chunk be written as a delta.
        """
        result: Future[ChunkRef] = Future()
        work = self.pool.submit(self._process, data, result, elem_size, digest, base)
        with self._lock:
            self._work.append(work)
        if on_done is not None:
            work.add_done_callback(lambda _f: on_done())
        work.add_done_callback(lambda f: _forward_error(f, result))
        return result

    def add_batch(self, items: list[BatchItem]) -> None:
        """Schedule several small chunks as one work item (resolving each item's future).

        Submitting a work item and its future costs tens of microseconds; for a
        state of thousands of small tensors that is most of a take. Items are
        processed in order; each one's ``on_done`` runs after its chunk, also
        on failure, and the first failure is raised once all were attempted.
        """
        work = self.pool.submit(self._process_batch, items)
        with self._lock:
            self._work.append(work)

    def add_digested(self, chunks: Sequence[tuple[Buffer, bytes]]) -> list[Future[ChunkRef]]:
        """Schedule chunks whose digests are known; small ones travel in batches."""
        futures: list[Future[ChunkRef]] = []
        batch = ChunkBatcher(self)
        for data, digest in chunks:
            if len(data) >= self.settings.pack_limit:
                futures.append(self.add(data, digest=digest))
                continue
            item = BatchItem(data, Future(), digest=digest)
            futures.append(item.result)
            batch.add(item)
        batch.flush()
        return futures

    def _process_batch(self, items: list[BatchItem]) -> None:
        first: BaseException | None = None
        for item in items:
            try:
                self._process(item.data, item.result, item.elem_size, item.digest, item.base)
            except BaseException as exc:
                if not item.result.done():
                    item.result.set_exception(exc)
                first = first or exc
            finally:
                if item.on_done is not None:
                    item.on_done()
        if first is not None:
            raise first

    def add_small(
        self,
        data: Sequence[Buffer],
        elem_sizes: Sequence[int],
        digests: Sequence[bytes | None] | None = None,
    ) -> Future[list[str]]:
        """Schedule small chunks as one work item: ``data[i]``, its ``elem_sizes[i]``, and
        ``digests[i]`` when the caller computed it (three lists: no tuple per chunk).

        Unlike :meth:`add_batch`, no chunk gets a future of its own (a future
        and its callbacks cost more than hashing and packing 256 bytes): the
        returned future gives the chunks' hashes, in order, and once
        :meth:`finish` has returned :meth:`ref_of` gives each one's ChunkRef.
        ``data`` must stay unchanged until the future resolves.
        """
        work: Future[list[str]] = self.pool.submit(self._process_small, data, elem_sizes, digests)
        with self._lock:
            self._work.append(work)
        return work

    def ref_of(self, h: str) -> ChunkRef:
        """Where chunk ``h`` (hashed by this writer) is stored; only after :meth:`finish`."""
        return self.known[h]

    def _process_small(
        self,
        chunks: Sequence[Buffer],
        elem_sizes: Sequence[int],
        given: Sequence[bytes | None] | None,
    ) -> list[str]:
        """:meth:`_process` of each chunk, with one lock and one index read for the group."""
        if given is None:
            digests = [digest_of(data) for data in chunks]
        else:
            digests = [d if d is not None else digest_of(data)
                       for data, d in zip(chunks, given, strict=True)]  # fmt: skip
        hashes = [d.hex() for d in digests]
        known = self.known
        with self._lock:
            self.stats.chunks += len(chunks)
            self.stats.raw_bytes += sum([len(data) for data in chunks])
            refs = [known.get(h) for h in hashes]
        misses = [i for i, ref in enumerate(refs) if ref is None]
        if misses and self.index is not None:
            found = self.index.lookup_chunks([(hashes[i], len(chunks[i])) for i in misses])
            for i, ref in zip(misses, found, strict=True):
                if ref is not None and not (self.damaged and ref in self.damaged):
                    refs[i] = ref  # else: the index predates the damage record
        new: list[int] = []
        with self._lock:
            for i, h in enumerate(hashes):
                ref = refs[i]
                if ref is not None:
                    known[h] = ref
                elif h not in known and h not in self._pending:  # else written or pending
                    self._pending[h] = None
                    new.append(i)
        packed: list[int] = []
        for i in new:
            data = chunks[i]
            if len(data) < self.settings.pack_limit:
                packed.append(i)
                continue
            ref = self._store_loose(data, digests[i], hashes[i], elem_sizes[i])  # not from
            with self._lock:  # the scheduler: written loose
                known[hashes[i]] = ref
                waiting = self._waiting.pop(hashes[i], [])
            for fut in waiting:
                fut.set_result(ref)
        tried = self._worth_trying([chunks[i] for i in packed], [elem_sizes[i] for i in packed])
        frames: list[tuple[Future[ChunkRef] | None, str, int, bytes, bytes, ChunkRef | None]] = []
        for i in packed:
            data, elem = chunks[i], elem_sizes[i]
            if tried[elem]:
                head, payload = self._encode(data, digests[i], elem)
            else:
                head, payload = codec.encode(data, digests[i], compress=False)
            frames.append((None, hashes[i], len(data), head, bytes(payload), None))
        self._append_frames(frames)
        return hashes  # each one's ref is known[h] once finish() flushed the last pack

    def _process(
        self,
        data: Buffer,
        result: Future[ChunkRef],
        elem_size: int = 0,
        known_digest: bytes | None = None,
        base: ChunkRef | None = None,
    ) -> None:
        # A digest computed by the caller (the distributed planner) is trusted:
        # the frame's own digest is re-verified on every read anyway.
        digest = known_digest if known_digest is not None else digest_of(data)
        h = digest.hex()
        size = len(data)
        with self._lock:
            self.stats.chunks += 1
            self.stats.raw_bytes += size
            ref = self.known.get(h)
        if ref is None and self.index is not None:
            ref = self.index.lookup_chunk(h, size)  # no store request
            if ref is not None and self.damaged and ref in self.damaged:
                ref = None  # the index predates the damage record
        with self._lock:
            if ref is None:
                ref = self.known.get(h)  # written by another worker meanwhile
            else:
                self.known[h] = ref
            twin = None
            if ref is None:
                if h not in self._pending:
                    self._pending[h] = result
                elif (twin := self._pending[h]) is None:  # add_small's: no future to chain
                    self._waiting.setdefault(h, []).append(result)
                    return  # resolved when its pack (or loose object) is written
        if ref is not None:
            result.set_result(ref)
            return
        if twin is not None:  # same bytes earlier in this take
            twin.add_done_callback(lambda f: _copy_result(f, result))
            return
        if size >= self.settings.pack_limit:
            heal = self._heals(h)
            ref = self._present_loose(digest, h, size, heal)
            if ref is None:
                done, choice = self._try_delta(data, digest, h, result, elem_size, base)
                if done:
                    return
                ref = self._write_loose(data, digest, h, elem_size, heal, choice)
            with self._lock:
                self.known[h] = ref
            result.set_result(ref)
        else:
            self._append_to_pack(data, digest, h, result, elem_size)

    def _worth_trying(self, chunks: list[Buffer], elem_sizes: list[int]) -> dict[int, bool]:
        """Per element size, whether zstd is tried on each of these small chunks.

        Judged once for all chunks of one element size (:func:`codec.may_pay`):
        five trials per chunk of a few hundred bytes cost more than the rest of
        writing it, and a state of many small tensors is mostly such chunks.
        """
        by_elem: dict[int, list[Buffer]] = {}
        for data, elem in zip(chunks, elem_sizes, strict=True):
            by_elem.setdefault(elem, []).append(data)
        if self.settings.compression != "auto":
            return dict.fromkeys(by_elem, False)
        level = self.settings.zstd_level
        return {elem: len(group) < _JUDGED_TOGETHER or codec.may_pay(group, elem, level)
                for elem, group in by_elem.items()}  # fmt: skip

    def _encode(
        self, data: Buffer, digest: bytes, elem_size: int, choice: int | None = None
    ) -> tuple[bytes, Buffer]:
        return codec.encode(
            data,
            digest,
            compress=self.settings.compression == "auto",
            level=self.settings.zstd_level,
            elem_size=elem_size,
            choice=choice,
        )

    def _try_delta(
        self,
        data: Buffer,
        digest: bytes,
        h: str,
        result: Future[ChunkRef],
        elem_size: int,
        base: ChunkRef | None,
    ) -> tuple[bool, int | None]:
        """Append ``data`` as a delta frame to the pack if that pays (casnap.chunks.delta);
        whether it did, and else the plain codec its test chose (None: not tested).

        Delta frames always go to packs: a pack is never replaced, whereas
        ``chunks/<h>`` may be rewritten whole by any writer that finds it
        unreadable, which would break every delta reference to it.
        """
        if self.delta is None or base is None or base.hash == h:
            return False, None
        if self.damaged and any(link in self.damaged for link in base.chain()):
            return False, None
        tensor = self._tensor_of.get(base.hash, "")
        choice = self.delta.encode(data, digest, elem_size, base, tensor)
        if choice.frame is None:
            return False, choice.plain
        head, payload = choice.frame
        with self._lock:
            self.stats.deltas_written += 1
        self._append_frames([(result, h, len(data), head, payload, base)])
        return True, None

    def _heals(self, h: str) -> bool:
        """Whether ``chunks/<h>`` is recorded damaged: written again whatever a probe says
        (a damaged object's header may well probe fine)."""
        return bool(self.damaged) and DamagedCopy(h, None) in self.damaged

    def _present_loose(self, digest: bytes, h: str, size: int, heal: bool) -> ChunkRef | None:
        """``chunks/<h>`` found stored by a probe (recorded for the index), else None.

        No probe in a repository this take created (nothing to find) or for a
        damaged object (it is written again)."""
        if heal or not self.probe:
            return None
        ref = self._probe_loose(digest, h, size)
        if ref is not None:
            with self._lock:
                self._present.append(ref)
        return ref

    def _store_loose(self, data: Buffer, digest: bytes, h: str, elem_size: int) -> ChunkRef:
        """``chunks/<h>`` as found stored, else written whole (never a delta)."""
        heal = self._heals(h)
        ref = self._present_loose(digest, h, len(data), heal)
        return ref if ref is not None else self._write_loose(data, digest, h, elem_size, heal)

    def _probe_loose(self, digest: bytes, h: str, size: int) -> ChunkRef | None:
        """``chunks/<h>`` as a reference if it exists and its header is this chunk's."""
        key = chunk_key(h)
        try:
            header = codec.parse_header(self.repo.store.get_range(key, 0, codec.HEADER_SIZE), key)
        except (ObjectNotFoundError, IntegrityError):
            return None  # absent, or a damaged object a whole write replaces
        same = header.digest == digest and header.raw_length == size
        if same and header.codec != codec.CODEC_DELTA:  # a loose delta is no writer's: replaced
            return trusted_chunk_ref(h, size, None, 0, header.frame_length)
        return None

    def _write_loose(
        self,
        data: Buffer,
        digest: bytes,
        h: str,
        elem_size: int,
        heal: bool,
        choice: int | None = None,
    ) -> ChunkRef:
        """Put ``chunks/<h>`` (probed absent, or ``heal``: recorded damaged), with codec
        ``choice`` when the delta test already chose it."""
        key = chunk_key(h)
        damaged = DamagedCopy(h, None)
        head, payload = self._encode(data, digest, elem_size, choice)
        self.repo.store.put(key, [head, payload], durable=False)  # replaces atomically
        if heal:
            self.repo.store.flush()  # durable before its damage record goes
            clear_damage(self.repo, [damaged])
        length = len(head) + len(payload)
        ref = trusted_chunk_ref(h, len(data), None, 0, length)
        with self._lock:
            self.stats.chunks_written += 1
            self.stats.objects_written += 1
            self.stats.raw_bytes_written += len(data)
            self.stats.stored_bytes_written += length
            self._present.append(ref)
        return ref

    def _append_to_pack(
        self, data: Buffer, digest: bytes, h: str, result: Future[ChunkRef], elem_size: int
    ) -> None:
        head, payload = self._encode(data, digest, elem_size)
        # bytes(): the pack outlives the caller's buffer
        self._append_frames([(result, h, len(data), head, bytes(payload), None)])

    def _append_frames(
        self,
        frames: list[tuple[Future[ChunkRef] | None, str, int, bytes, bytes, ChunkRef | None]],
    ) -> None:
        """Append encoded frames (with their delta base, if any) to the open pack,
        writing each pack that fills up."""
        full: list[_Pack] = []
        with self._lock:
            for result, h, size, head, payload, base in frames:
                pack = self._pack
                length = len(head) + len(payload)
                pack.waiters.append((result, h, size, pack.size, length, base))
                pack.parts += (head, payload)  # no tuple kept per frame
                pack.size += length
                self.stats.raw_bytes_written += size
                self.stats.chunks_written += 1
                if pack.size >= self.settings.pack_target:
                    full.append(pack)
                    self._pack = _Pack()
        for pack in full:
            self._flush(pack)

    def _flush(self, pack: _Pack) -> None:
        if not pack.parts:
            return
        parts = pack.parts
        blob = b"".join(parts)
        pid = hash_bytes(blob)
        # The same small chunks packed in the same order make the same pack: if a
        # read recorded a frame of it damaged, the stored copy is replaced, not kept.
        heal = self.damaged.in_pack(pid) if pid in self.damaged.packs else []
        try:
            if heal:
                self.repo.store.put(pack_key(pid), blob, durable=False)  # replaces atomically
                self.repo.store.flush()  # durable before its damage records go
                clear_damage(self.repo, heal)
            else:
                try:
                    self.repo.store.put(pack_key(pid), blob, create_only=True, durable=False)
                except ObjectExistsError:
                    pass  # identical pack already durable
            with self._lock:
                self.stats.objects_written += 1
                self.stats.stored_bytes_written += len(blob)
        except BaseException as exc:
            with self._lock:
                failed = [f for _, h, *_ in pack.waiters for f in self._waiting.pop(h, [])]
            for waiter in [f for f, *_ in pack.waiters if f is not None] + failed:
                waiter.set_exception(exc)
            raise
        done = [(fut, trusted_chunk_ref(h, size, pid, offset, length, base))  # what it wrote
                for fut, h, size, offset, length, base in pack.waiters]  # fmt: skip
        with self._lock:
            for _, ref in done:
                self.known[ref.hash] = ref
            self._present.extend([ref for _, ref in done])
            waiting = (
                [(f, ref) for _, ref in done for f in self._waiting.pop(ref.hash, [])]
                if self._waiting
                else []
            )
        for fut, ref in done:
            if fut is not None:
                fut.set_result(ref)
        for fut, ref in waiting:
            fut.set_result(ref)

    def finish(self, futures: Iterable[Future[ChunkRef]]) -> list[ChunkRef]:
        """Flush the last pack and wait for ``futures``; raise the first failure."""
        # Every chunk is resolved, appended to the open pack, or waiting for an
        # identical chunk once its work item is done; then the last pack flushes.
        try:
            with self._lock:
                work = list(self._work)
            wait(work)
            for w in work:
                exc = w.exception()
                if exc is not None:
                    raise exc
            with self._lock:
                last, self._pack = self._pack, _Pack()
            self._flush(last)
            return [f.result() for f in futures]
        finally:
            self._record_present()

    def _record_present(self) -> None:
        with self._lock:
            present, self._present = self._present, []
        # The index records where a frame is, not its delta base: deltas stay out of it
        # (a take finds them through its parent's manifest).
        present = [r for r in present if r.base is None]
        if self.index is not None and present:
            self.index.record_chunks(present)  # one LMDB transaction per take


def _forward_error(work: Future[None], result: Future[ChunkRef]) -> None:
    exc = work.exception()
    if exc is not None and not result.done():
        result.set_exception(exc)


def _copy_result(src: Future[ChunkRef], dst: Future[ChunkRef]) -> None:
    exc = src.exception()
    if exc is not None:
        dst.set_exception(exc)
    else:
        dst.set_result(src.result())


# -- reading ---------------------------------------------------------------


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


def _raw_loose(span: Span) -> tuple[int, ChunkRef] | None:
    """The one chunk of ``span`` if it is a loose object stored raw (readable in place)."""
    if span.end >= 0 or len(span.items) != 1:
        return None
    i, ref = span.items[0]
    return (i, ref) if ref.length == codec.HEADER_SIZE + ref.size and ref.base is None else None


def fetch_span(repo: RepoStorage, span: Span) -> bytes:
    """The stored bytes of ``span``: a loose object (at most its frame's length) or a pack range.

    What casnap will not read at the key (a FIFO, a link, a loose object longer
    than its frame: :class:`ObjectRefusedError`) is damage to every chunk of
    the span: contained like a frame that fails its check (docs/damage.md),
    so the next take writes those chunks again, then raised.
    """
    with _refused_is_damage(repo, span):
        if span.end < 0:
            return repo.store.get(span.key, limit=span.items[0][1].length)
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
    in: a loose chunk stored raw (frame length == header + size, known from the
    manifest) is then read whole into a reused page-aligned buffer under
    ``budget`` (:mod:`casnap.chunks.bounce`), verified there and only then
    copied into it, with no ``sink`` call; a chunk that fails verification
    raises :class:`IntegrityError` and writes nothing. A delta rebuilt in
    place (below) is written to ``dest`` before its check. ``landed(i)``, when
    given, is called once chunk ``i`` written to ``dest`` has been verified
    (the caller keeps what ``dest`` overwrote until then).

    ``mapped(i)``, when given, may return a function that takes chunk ``i``'s
    verified bytes instead: a loose chunk stored raw whose object the store
    can map (:meth:`~casnap.store.base.ObjectStore.map`) is verified on the
    mapping and only then handed to it (no ``dest`` or ``sink`` call), so no
    unverified byte reaches the caller's memory. The bytes stay valid while
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
        """A loose raw frame read whole into a page-aligned buffer, verified there,
        then copied into ``dest`` (:mod:`casnap.chunks.bounce` says why not into place)."""
        nonlocal fetched
        one = _raw_loose(span)
        if dest is None or one is None:
            return False  # compressed or packed: decoded through a buffer
        i, ref = one
        view = dest(i)
        if view is None or len(view) != ref.size:
            return False
        with bounce.buffer(ref.length) as (frame, address):
            with _missing_is_integrity_error(span), _refused_is_damage(repo, span):
                n = repo.store.read_into(span.key, [frame])
            with lock:
                fetched += n
            head, payload = frame[: codec.HEADER_SIZE], frame[codec.HEADER_SIZE :]
            verify_in_place(repo, span.key, ref, head, payload[: max(0, n - len(head))], n)
            if ref.size:
                ctypes.memmove(_address(view), address + codec.HEADER_SIZE, ref.size)
        if landed is not None:
            landed(i)
        return True

    def from_mapping(span: Span) -> bool:
        nonlocal fetched
        one = _raw_loose(span)
        if mapped is None or one is None:
            return False
        i, ref = one
        take = mapped(i)
        if take is None:
            return False
        with _missing_is_integrity_error(span), _refused_is_damage(repo, span):
            frame = repo.store.map(span.key, ref.length)
        if frame is None:
            return False  # the store cannot map: read as usual
        view = memoryview(frame)
        with lock:
            fetched += len(view)
        head, payload = view[: codec.HEADER_SIZE], view[codec.HEADER_SIZE :]
        verify_in_place(repo, span.key, ref, head, payload, len(view))  # a short file too
        take(payload)
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
        whole = whole_raw_loose(ref)
        if whole is None:
            return False
        take = mapped(i)
        if take is None:
            return False
        key = chunk_key(whole.hash)
        try:
            frame = repo.store.map(key, whole.length, private=True)
        except CasnapError:
            return False  # the paths below read it and say what is wrong
        if frame is None:
            return False
        view = memoryview(frame)
        try:
            hdr = codec.parse_header(view[: codec.HEADER_SIZE], key)
        except IntegrityError:
            return False
        if len(view) != whole.length or hdr.codec != codec.CODEC_RAW:
            return False
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
        cost = raw + (span.end - span.start if span.end >= 0 else span.items[0][1].length)
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
