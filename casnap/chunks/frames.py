"""Storing the frames of new chunks: loose objects and packs.

:class:`FrameWriter` is the part of :class:`~casnap.chunks.write.ChunkWriter`
that puts what its dedup found new. Chunks of at least ``pack_threshold``
bytes become loose objects ``chunks/<h>`` (found stored by a probe, or written
whole; a copy recorded as damaged is replaced); smaller ones are appended as
frames to a pack that is written once it reaches ``pack_target``. Every frame
stays independently readable by a ranged get. Once a frame is stored, the
futures waiting for its chunk are resolved.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from itertools import accumulate

from casnap.errors import IntegrityError, ObjectExistsError, ObjectNotFoundError
from casnap.format import codec
from casnap.format.entries import ChunkRef
from casnap.format.manifest_bytes import trusted_chunk_ref
from casnap.format.names import hash_bytes
from casnap.repo.damage import DamagedCopy, DamageSet, clear_damage
from casnap.repo.repository import RepoStorage, chunk_key, pack_key
from casnap.settings import Settings
from casnap.store.base import Deferral

Buffer = codec.Buffer


@dataclass
class WriteStats:
    chunks: int = 0  # chunks submitted
    chunks_written: int = 0  # chunks whose frame was written
    raw_bytes: int = 0  # raw bytes submitted
    raw_bytes_written: int = 0  # raw bytes of the chunks written
    stored_bytes_written: int = 0  # frame bytes written (after compression)
    objects_written: int = 0  # store objects put (loose chunks + packs)
    deltas_written: int = 0  # chunks written as deltas against a parent's chunk


# Not frozen: a frozen dataclass sets each field through object.__setattr__, several
# times slower to build, and a take builds one per new small chunk.
@dataclass(slots=True, eq=False)
class PackFrame:
    """One new chunk's encoded frame on its way into a pack."""

    result: Future[ChunkRef] | None  # None for add_small's chunks: found in ``known``
    hash: str
    size: int  # raw bytes
    head: bytes
    payload: bytes
    base: ChunkRef | None = None  # a delta frame's base


@dataclass
class _Pack:
    parts: list[Buffer] = field(default_factory=list)  # each frame's header, then payload
    frames: list[PackFrame] = field(default_factory=list)
    size: int = 0


def encode_chunk(
    data: Buffer, digest: bytes, settings: Settings, elem_size: int, choice: int | None = None
) -> tuple[bytes, Buffer]:
    """The frame a take with ``settings`` writes for a chunk whose elements are
    ``elem_size`` bytes (a float tensor's element size, else 0): header and payload.
    A repair writes the same (:mod:`casnap.ops.repair`)."""
    return codec.encode(
        data,
        digest,
        compress=settings.compression == "auto",
        level=settings.zstd_level,
        elem_size=elem_size,
        choice=choice,
    )


class FrameWriter:
    """Puts new chunks' frames: loose objects and packs; the base of ChunkWriter.

    ``known`` maps chunk hashes to where they are stored; a frame this writer
    stores is added to it, and to the chunks to record in the index. A chunk
    whose frame is being stored by another worker waits in ``_waiting``.
    """

    def __init__(
        self,
        repo: RepoStorage,
        settings: Settings,
        known: dict[str, ChunkRef],
        damaged: DamageSet,
        probe: bool,
    ) -> None:
        self.repo = repo
        self.settings = settings
        self.damaged = damaged
        self.probe = probe  # false in a repository the take created: a probe could only miss
        self.known = known
        self.stats = WriteStats()
        self._lock = threading.Lock()
        # Futures of chunks identical to one of add_small's (no future of its own)
        # being written, by hash: resolved once its pack or loose object is.
        self._waiting: dict[str, list[Future[ChunkRef]]] = {}
        self._pack = _Pack()
        self._present: list[ChunkRef] = []  # stored by this writer: for the index
        # A store with deferred sync (a local one) syncs the frames' files later, many
        # at once, and renames each into place once synced: at the latest when
        # finish() flushes the store. Its files that fail in any flush (another
        # take's, through the same store) are this writer's errors: finish() raises
        # them (docs/pipeline.md).
        self.deferral: Deferral | None = None
        self._deferring: Callable[[], contextlib.AbstractContextManager[None]] = (
            contextlib.nullcontext
        )
        if repo.store.capabilities.deferred_sync:
            self.deferral = repo.store.deferral()
            self._deferring = functools.partial(repo.store.deferring, self.deferral)

    def _encode(
        self, data: Buffer, digest: bytes, elem_size: int, choice: int | None = None
    ) -> tuple[bytes, Buffer]:
        return encode_chunk(data, digest, self.settings, elem_size, choice)

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
        if heal:
            self.repo.store.put(key, [head, payload], durable=False)  # replaces atomically
            self.repo.store.flush()  # durable before its damage record goes
            clear_damage(self.repo, [damaged])
        else:
            with self._deferring():
                self.repo.store.put(key, [head, payload], durable=False)
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
        self._append_frames([PackFrame(result, h, len(data), head, bytes(payload))])

    def _append_frames(self, frames: list[PackFrame]) -> None:
        """Append encoded frames to the open pack, writing each pack that fills up."""
        full: list[_Pack] = []
        with self._lock:
            for frame in frames:
                pack = self._pack
                pack.frames.append(frame)
                pack.parts += (frame.head, frame.payload)  # no tuple kept per frame
                pack.size += len(frame.head) + len(frame.payload)
                self.stats.raw_bytes_written += frame.size
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
                    with self._deferring():
                        self.repo.store.put(pack_key(pid), blob, create_only=True, durable=False)
                except ObjectExistsError:
                    pass  # identical pack already durable
            with self._lock:
                self.stats.objects_written += 1
                self.stats.stored_bytes_written += len(blob)
        except BaseException as exc:
            with self._lock:
                failed = [f for fr in pack.frames for f in self._waiting.pop(fr.hash, [])]
            for waiter in [fr.result for fr in pack.frames if fr.result is not None] + failed:
                waiter.set_exception(exc)
            raise
        # What it wrote: each frame's offset is the sum of the lengths before it.
        lengths = [len(fr.head) + len(fr.payload) for fr in pack.frames]
        places = zip(pack.frames, accumulate(lengths, initial=0), lengths)
        done = [
            (fr.result, trusted_chunk_ref(fr.hash, fr.size, pid, offset, length, fr.base))
            for fr, offset, length in places
        ]
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

    def _flush_open(self) -> None:
        """Write the open pack (the last of a take), even if not full."""
        with self._lock:
            last, self._pack = self._pack, _Pack()
        self._flush(last)
