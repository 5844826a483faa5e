"""Containment: the one place a verified read reacts to a damaged frame (docs/damage.md).

Every read that checks a frame against its chunk's hash goes through
:func:`decode_frame` or :func:`verify_in_place` (restore, ``read_object``,
export and drift through :func:`casnap.chunks.io.read_chunks`; verify's scrub
directly). When the check fails, the copy is *contained* before the
:class:`~casnap.errors.IntegrityError` propagates:

1. it is recorded in the repository (``.casnap/damaged/...``), so every take,
   in any process on any machine, stops referencing it and writes the chunk
   again (:mod:`casnap.repo.damage`);
2. this machine's index forgets the chunk.

A frame inside a pack that fails its check may have a **replacement**: a loose
object ``chunks/<h>`` that ``casnap repair`` wrote with verified bytes while
the frame's damage record stays (docs/damage.md, "Repair"). The read then
returns the replacement's bytes instead of failing; gc keeps a replacement
while its record and a reachable reference into the damaged frame exist.

Only a frame that was fetched and fails its check is damage. A missing object,
a store error or a frame of an unknown version raise before this point and
record nothing. Containment never deletes or moves anything, so a wrong
verdict (a read glitch) costs one rewrite of identical bytes, never data.
"""

from __future__ import annotations

from casnap import index
from casnap.errors import IntegrityError, ObjectNotFoundError, ObjectRefusedError
from casnap.format import codec
from casnap.format.manifest import ChunkRef
from casnap.repo.damage import DamagedCopy, record_damage
from casnap.repo.repository import RepoStorage, chunk_key, pack_key

Buffer = codec.Buffer


def contain(repo: RepoStorage, ref: ChunkRef, exc: IntegrityError) -> None:
    """Record ``ref``'s copy as damaged and make this machine's index forget the chunk."""
    record_damage(repo, ref, str(exc))
    handle = index.open_index(repo, chunks=False)
    if handle is not None:
        handle.forget_chunks([ref.hash])


def decode_frame(repo: RepoStorage, key: str, ref: ChunkRef, frame: Buffer) -> Buffer:
    """:func:`casnap.format.codec.decode` of ``ref``'s frame, read from object ``key``.

    A damaged pack frame with a good replacement ``chunks/<h>`` yields the
    replacement's bytes (see the module docstring).
    """
    try:
        return codec.decode(frame, key, bytes.fromhex(ref.hash), ref.size)
    except IntegrityError as exc:
        if ref.pack is not None:
            data = _replacement(repo, ref)
            if data is not None:
                _keep_record(repo, ref, exc)
                return data
        contain(repo, ref, exc)
        raise


def _replacement(repo: RepoStorage, ref: ChunkRef) -> Buffer | None:
    """The verified bytes of the loose object ``chunks/<h>`` standing in for a damaged frame."""
    loose = ChunkRef(hash=ref.hash, size=ref.size, length=codec.HEADER_SIZE + ref.size)
    return read_copy(repo, loose, record=True)  # a frame's most: header + raw bytes


def read_copy(repo: RepoStorage, ref: ChunkRef, record: bool) -> Buffer | None:
    """The verified bytes of one stored copy, or None (damage recorded if ``record``)."""
    key = pack_key(ref.pack) if ref.pack else chunk_key(ref.hash)
    try:
        if ref.pack is None:
            blob = repo.store.get(key, limit=ref.length)
        else:
            blob = repo.store.get_range(key, ref.offset, ref.offset + ref.length)
    except ObjectNotFoundError:
        return None
    except ObjectRefusedError as exc:  # a FIFO, a link, a loose object longer than its frame
        if record:
            contain(repo, ref, exc)
        return None
    try:
        return codec.decode(blob, key, bytes.fromhex(ref.hash), ref.size)
    except IntegrityError as exc:
        if record:
            contain(repo, ref, exc)
        return None


def _keep_record(repo: RepoStorage, ref: ChunkRef, exc: IntegrityError) -> None:
    """The frame's record must stay while its replacement serves reads: gc keeps it by it."""
    if not repo.store.exists(DamagedCopy.of(ref).key):
        record_damage(repo, ref, str(exc))


def verify_in_place(
    repo: RepoStorage, key: str, ref: ChunkRef, head: Buffer, data: Buffer, received: int
) -> None:
    """:func:`casnap.format.codec.verify_raw_in_place` of a loose raw frame read into place."""
    try:
        codec.verify_raw_in_place(head, data, received, key, bytes.fromhex(ref.hash), ref.size)
    except IntegrityError as exc:
        contain(repo, ref, exc)
        raise
