"""Decoding stored frames, verified: the one decode every read goes through.

This is where a verified read decodes a frame (any codec, a delta rebuilt
on its whole base: :mod:`casnap.chunks.rebuild`) and reacts to a damaged one
(docs/damage.md; containment is :func:`casnap.chunks.stored.contain`).

Every read that checks a frame against its chunk's hash goes through
:func:`decode_frame` (restore, ``read_object``, export and drift through
:func:`casnap.chunks.read.read_chunks`; verify's scrub directly), which
decodes with :func:`casnap.format.codec.decode` whatever the codec: the
verdict of ``verify --read-data`` is the restore's. When the check fails, the
copy is *contained* before the :class:`~casnap.errors.IntegrityError` propagates:

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

from casnap.chunks.rebuild import fetch_base, rebuild
from casnap.chunks.stored import contain, fetch_frame
from casnap.errors import (
    DeltaBaseError,
    IntegrityError,
    ObjectNotFoundError,
    ObjectRefusedError,
)
from casnap.format import codec
from casnap.format.entries import ChunkRef
from casnap.repo.damage import DamagedCopy, record_damage
from casnap.repo.reach import object_key
from casnap.repo.repository import RepoStorage

Buffer = codec.Buffer


def decode_frame(repo: RepoStorage, key: str, ref: ChunkRef, frame: Buffer) -> Buffer:
    """:func:`casnap.format.codec.decode` of ``ref``'s frame, read from object ``key``.

    A damaged pack frame with a good replacement ``chunks/<h>`` yields the
    replacement's bytes (see the module docstring). A delta (``ref.base``)
    is rebuilt on its base, a whole frame read first (:func:`base_bytes`); a base
    that cannot be read leaves the same stand-in, a good loose ``chunks/<h>``
    (written whole by a later take or by repair), else raises
    :class:`DeltaBaseError` naming the base. Only the copy that failed its own
    check is recorded as damaged.
    """
    if ref.base is None:
        return _decode_one(repo, key, ref, frame, None)
    fast = rebuild(repo, ref, frame)
    if fast is not None:
        return fast
    # The base or the delta is wrong: verify the base, then the delta on it, so the
    # copy at fault is the one named (and recorded, if damaged).
    try:
        base = (bytes.fromhex(ref.base.hash), base_bytes(repo, ref.base, key))
    except DeltaBaseError:
        # Any good frame of the chunk is the chunk: a take that wrote it whole since
        # (a base recorded damaged makes it do so) or a repair serves this reference.
        data = loose_copy(repo, ref.hash, ref.size) if ref.pack is not None else None
        if data is None:
            raise
        return data
    return _decode_one(repo, key, ref, frame, base)


def _decode_one(
    repo: RepoStorage, key: str, ref: ChunkRef, frame: Buffer, base: tuple[bytes, Buffer] | None
) -> Buffer:
    try:
        return codec.decode(frame, key, bytes.fromhex(ref.hash), ref.size, base)
    except DeltaBaseError:
        raise  # not this frame's fault
    except IntegrityError as exc:
        if ref.pack is not None:
            data = loose_copy(repo, ref.hash, ref.size)
            if data is not None:
                _keep_record(repo, ref, exc)
                return data
        contain(repo, ref, exc)
        raise


def base_bytes(repo: RepoStorage, base: ChunkRef, user: str) -> Buffer:
    """The verified bytes of chunk ``base`` (a whole frame), which the delta in object
    ``user`` needs.

    The base is checked against its hash like any read. Any failure is a
    :class:`DeltaBaseError` naming the base's object; a damaged base frame is
    recorded (contained) as such.
    """
    try:
        return _decode_one(repo, object_key(base), base, fetch_base(repo, base), None)
    except (ObjectNotFoundError, IntegrityError) as exc:
        what = "is missing" if isinstance(exc, ObjectNotFoundError) else "cannot be read"
        raise DeltaBaseError(
            f"{user}: delta base {object_key(base)} (chunk {base.hash[:12]}) {what}: {exc}",
            object_key(base),
        ) from exc


def loose_copy(repo: RepoStorage, chunk: str, size: int, record: bool = True) -> Buffer | None:
    """The verified bytes of the loose object ``chunks/<chunk>``, whatever frame it holds
    (a stand-in for a damaged frame or a delta whose base is lost, a repair read back),
    or None (damage recorded if ``record``)."""
    loose = ChunkRef(hash=chunk, size=size, length=codec.HEADER_SIZE + size)  # a frame's most
    return read_copy(repo, loose, record)


def read_copy(repo: RepoStorage, ref: ChunkRef, record: bool) -> Buffer | None:
    """The verified bytes of one stored copy, or None (damage recorded if ``record``)."""
    key = object_key(ref)
    base = None
    if ref.base is not None:
        try:
            base = (bytes.fromhex(ref.base.hash), base_bytes(repo, ref.base, key))
        except DeltaBaseError:
            return None  # this copy cannot be rebuilt, though it is not known to be damaged
    try:
        blob = fetch_frame(repo, ref)
    except ObjectNotFoundError:
        return None
    except ObjectRefusedError as exc:  # a FIFO, a link, a loose object longer than its frame
        if record:
            contain(repo, ref, exc)
        return None
    try:
        return codec.decode(blob, key, bytes.fromhex(ref.hash), ref.size, base)
    except IntegrityError as exc:
        if record:
            contain(repo, ref, exc)
        return None


def _keep_record(repo: RepoStorage, ref: ChunkRef, exc: IntegrityError) -> None:
    """The frame's record must stay while its replacement serves reads: gc keeps it by it."""
    if not repo.store.exists(DamagedCopy.of(ref).key):
        record_damage(repo, ref, str(exc))
