"""One stored copy of a chunk: its object, the bytes a read of it takes, fetching it,
and containing it when it is damaged (docs/damage.md).

A copy that fails its check is *contained* (:func:`contain`) before the
:class:`~casnap.errors.IntegrityError` propagates: it is recorded in the
repository (``.casnap/damaged/...``, :mod:`casnap.repo.damage`), so every
take, in any process on any machine, stops referencing it and writes the
chunk again, and this machine's index forgets the chunk. Containment never
deletes or moves anything, so a wrong verdict (a read glitch) costs one
rewrite of identical bytes, never data.
"""

from __future__ import annotations

from casnap import index
from casnap.errors import IntegrityError
from casnap.format import codec
from casnap.format.entries import ChunkRef
from casnap.repo.damage import record_damage
from casnap.repo.repository import RepoStorage, chunk_key, pack_key


def contain(repo: RepoStorage, ref: ChunkRef, exc: IntegrityError) -> None:
    """Record ``ref``'s copy as damaged and make this machine's index forget the chunk."""
    record_damage(repo, ref, str(exc))
    handle = index.open_index(repo, chunks=False)
    if handle is not None:
        handle.forget_chunks([ref.hash])


def frame_limit(ref: ChunkRef) -> int:
    """The most bytes a read of ``ref``'s frame takes, refusing a longer object unread.

    A packed frame is where the manifest says, ``ref.length`` bytes (a pack is
    immutable). A loose object ``chunks/<h>`` is any valid frame of chunk
    ``h``: another take or a repair may have stored it again with another codec
    (docs/format.md, "Loose objects"), so its length is not the manifest's but
    at most the largest valid frame, the header and the raw bytes.
    """
    return ref.length if ref.pack is not None else codec.HEADER_SIZE + ref.size


def fetch_frame(repo: RepoStorage, ref: ChunkRef) -> bytes:
    """The stored frame of ``ref`` (at most :func:`frame_limit` bytes), unchecked."""
    if ref.pack is None:
        return repo.store.get(chunk_key(ref.hash), limit=frame_limit(ref))
    return repo.store.get_range(pack_key(ref.pack), ref.offset, ref.offset + ref.length)
