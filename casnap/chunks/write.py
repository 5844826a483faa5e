"""Writing chunks: dedup, delta choice and scheduling on the take's workers.

:class:`ChunkWriter`: each chunk is hashed; a chunk already known (written
earlier in this take, listed by a parent manifest, or present as a loose
object) is not written again. A changed chunk may be written as a delta
against the whole frame of the parent's chunk at its place, never against a
delta (:mod:`casnap.chunks.delta`). Where a
new chunk's frame goes, a loose object or a pack, is
:mod:`casnap.chunks.frames`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from casnap.chunks.delta import DeltaEncoder
from casnap.chunks.frames import FrameWriter, PackFrame
from casnap.format import codec
from casnap.format.entries import ChunkRef
from casnap.format.names import digest_of
from casnap.index import KnownChunks, RepoIndex
from casnap.repo.damage import DamageSet
from casnap.repo.repository import RepoStorage
from casnap.settings import Settings

Buffer = codec.Buffer
# Fewer small chunks of one element size than this are each tried alone (the
# trials cost little then), more are judged together first (ChunkWriter._worth_trying).
_JUDGED_TOGETHER = 8
# Where a chunk's delta base would be: (tensor key, chunk index, chunk size). Resolved
# only once the chunk is known to be new, after any parent left for later was read.
BaseAt = tuple[str, int, int]


class ChunkWriter(FrameWriter):
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

    Where a new chunk's frame goes (a loose object or a pack) is its base,
    :class:`~casnap.chunks.frames.FrameWriter`.
    """

    def __init__(
        self,
        repo: RepoStorage,
        settings: Settings,
        pool: ThreadPoolExecutor,
        known: Mapping[str, ChunkRef] | None = None,
        index: RepoIndex | None = None,
    ) -> None:
        super().__init__(
            repo,
            settings,
            dict(known or {}),  # known_chunks left damage out
            known.damaged if isinstance(known, KnownChunks) else DamageSet(),
            # A repository the take created holds no chunk: a probe could only miss.
            probe=not (isinstance(known, KnownChunks) and known.fresh),
        )
        self.pool = pool
        if index is None and isinstance(known, KnownChunks):
            index = known.index
        self.index = index
        # Chunks being written: by hash, the future of the first, None for add_small's
        # (no future); futures of identical chunks wait on one of those, or in
        # ``_waiting`` (FrameWriter) for add_small's.
        self._pending: dict[str, Future[ChunkRef] | None] = {}
        self._work: list[Future[Any]] = []
        # Per tensor key, the parent's (chunk size, chunk refs): the bases of deltas.
        self.bases: Mapping[str, tuple[int, Sequence[ChunkRef]]] = (
            known.bases if isinstance(known, KnownChunks) else {}
        )
        self._tensor_of: dict[str, str] = {}
        # A request key -> the key of its entry in the parent, where they differ (a DCP
        # save's requests are named by write item; base_of looks bases up by entry).
        self.entry_keys: Mapping[str, str] = {}
        self.delta = (
            DeltaEncoder(repo, settings.zstd_level)
            if settings.delta and settings.compression == "auto"
            else None
        )

    def base_of(self, key: str, index: int, chunk_size: int) -> BaseAt | None:
        """Where the delta base of chunk ``index`` of tensor ``key`` is: the whole frame of
        the parent's chunk there (:attr:`ChunkRef.whole`), looked up (:meth:`_base`) only
        if the chunk turns out to be new."""
        return None if self.delta is None else (key, index, chunk_size)

    def _base(self, at: BaseAt | None) -> ChunkRef | None:
        if at is None:
            return None
        key, index, chunk_size = at
        found = self.bases.get(self.entry_keys.get(key, key))
        if found is None or found[0] != chunk_size or index >= len(found[1]):
            return None
        base = found[1][index].whole  # every delta is against a whole chunk: no chains
        with self._lock:
            self._tensor_of[base.hash] = key  # for the delta test's back-off, by tensor
        return base

    def add(
        self,
        data: Buffer,
        on_done: Callable[[], None] | None = None,
        elem_size: int = 0,
        digest: bytes | None = None,
        base: BaseAt | None = None,
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

    def add_small(
        self,
        data: Sequence[Buffer],
        elem_sizes: Sequence[int],
        digests: Sequence[bytes | None] | None = None,
    ) -> Future[list[str]]:
        """Schedule small chunks as one work item: ``data[i]``, its ``elem_sizes[i]``, and
        ``digests[i]`` when the caller computed it (three lists: no tuple per chunk).

        Unlike :meth:`add`, no chunk gets a future of its own (a future
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
            digests = [
                d if d is not None else digest_of(data)
                for data, d in zip(chunks, given, strict=True)
            ]
        hashes = [d.hex() for d in digests]
        _refs, new = self._dedup(hashes, [len(data) for data in chunks])
        known = self.known
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
        frames: list[PackFrame] = []
        for i in packed:
            data, elem = chunks[i], elem_sizes[i]
            if tried[elem]:
                head, payload = self._encode(data, digests[i], elem)
            else:
                head, payload = codec.encode(data, digests[i], compress=False)
            frames.append(PackFrame(None, hashes[i], len(data), head, bytes(payload)))
        self._append_frames(frames)
        return hashes  # each one's ref is known[h] once finish() flushed the last pack

    def _process(
        self,
        data: Buffer,
        result: Future[ChunkRef],
        elem_size: int = 0,
        known_digest: bytes | None = None,
        base: BaseAt | None = None,
    ) -> None:
        # A digest computed by the caller (the distributed planner) is trusted:
        # the frame's own digest is re-verified on every read anyway.
        digest = known_digest if known_digest is not None else digest_of(data)
        h = digest.hex()
        size = len(data)
        refs, new = self._dedup([h], [size], result)
        if not new:
            if refs[0] is not None:
                result.set_result(refs[0])
            return  # else: resolved once the same bytes, claimed by other work, are stored
        if size >= self.settings.pack_limit:
            heal = self._heals(h)
            ref = self._present_loose(digest, h, size, heal)
            if ref is None:
                done, choice = self._try_delta(data, digest, h, result, elem_size, self._base(base))
                if done:
                    return
                ref = self._write_loose(data, digest, h, elem_size, heal, choice)
            with self._lock:
                self.known[h] = ref
            result.set_result(ref)
        else:
            self._append_to_pack(data, digest, h, result, elem_size)

    def _dedup(
        self, hashes: Sequence[str], sizes: Sequence[int], result: Future[ChunkRef] | None = None
    ) -> tuple[list[ChunkRef | None], list[int]]:
        """The dedup decision for each chunk: where it is stored already, and the
        indices of those this caller writes (claimed in ``_pending``).

        A chunk is stored if this take knows it (written, or listed by a
        parent), else if the index knows it (no store request) and no damage
        is recorded on that copy. A chunk neither stored nor claimed is claimed
        for this caller; one that other work claimed is left to it, and
        ``result`` (given with :meth:`add`'s one chunk) resolves with that one.
        """
        known = self.known
        with self._lock:
            self.stats.chunks += len(hashes)
            self.stats.raw_bytes += sum(sizes)
            refs = [known.get(h) for h in hashes]
        misses = [i for i, ref in enumerate(refs) if ref is None]
        if misses and self.index is not None:
            found = self.index.lookup_chunks([(hashes[i], sizes[i]) for i in misses])
            for i, ref in zip(misses, found, strict=True):
                if ref is not None and not (self.damaged and ref in self.damaged):
                    refs[i] = ref  # else: the index predates the damage record
        new: list[int] = []
        twin: Future[ChunkRef] | None = None
        with self._lock:
            for i in misses:
                h, ref = hashes[i], refs[i]
                if ref is not None:
                    known[h] = ref
                elif (ref := known.get(h)) is not None:  # written by other work meanwhile
                    refs[i] = ref
                elif h not in self._pending:
                    self._pending[h] = result
                    new.append(i)
                elif result is not None and (twin := self._pending[h]) is None:
                    # add_small's: no future to chain; resolved when its frame is stored
                    self._waiting.setdefault(h, []).append(result)
        if twin is not None and result is not None:  # the same bytes, from an earlier add
            twin.add_done_callback(lambda f: _copy_result(f, result))
        return refs, new

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
        return {
            elem: len(group) < _JUDGED_TOGETHER or codec.may_pay(group, elem, level)
            for elem, group in by_elem.items()
        }

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
        if self.damaged and base in self.damaged:
            return False, None
        tensor = self._tensor_of.get(base.hash, "")
        choice = self.delta.encode(data, digest, elem_size, base, tensor)
        if choice.frame is None:
            return False, choice.plain
        head, payload = choice.frame
        with self._lock:
            self.stats.deltas_written += 1
        self._append_frames([PackFrame(result, h, len(data), head, payload, base)])
        return True, None

    def finish(self, futures: Iterable[Future[ChunkRef]]) -> list[ChunkRef]:
        """Flush the last pack, wait for ``futures``, then flush the store: every frame
        written is durable and in place when this returns. Raises the first failure."""
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
            self._flush_open()
        except BaseException:
            self._settle(failed=True)
            raise
        self._settle(failed=False)
        return [f.result() for f in futures]

    def _settle(self, failed: bool) -> None:
        """Flush the store (the frames' files are synced and renamed into place: a local
        store defers both), then record in the index what this writer stored.

        Nothing is recorded if the flush fails: a frame whose file could not be
        synced is not in place. After a failed take the frames written are
        still flushed, so that a retry finds them; an error then is left to the
        take's own."""
        try:
            self.repo.store.flush()
            if self.deferral is not None:
                self.deferral.check()  # its files another take's flush settled
        except BaseException:
            with self._lock:
                self._present = []
            if failed:
                return
            raise
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
