"""Decoding stored frames, verified: the one decode every read goes through, and containment.

This is where a verified read decodes a frame (any codec, a delta rebuilt
from its chain) and reacts to a damaged one (docs/damage.md).

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

from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from typing import Any

from casnap import index
from casnap.chunks.chain import ChainFrames
from casnap.errors import (
    CasnapError,
    DeltaBaseError,
    IntegrityError,
    ObjectNotFoundError,
    ObjectRefusedError,
)
from casnap.format import codec
from casnap.format.delta import apply_delta
from casnap.format.entries import ChunkRef
from casnap.format.names import digest_of
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
    replacement's bytes (see the module docstring). A delta (``ref.base``)
    is rebuilt from its base chain, read first (:func:`base_bytes`); a base
    that cannot be read leaves the same stand-in, a good loose ``chunks/<h>``
    (written whole by a later take or by repair), else raises
    :class:`DeltaBaseError` naming the base. Only the copy that failed its own
    check is recorded as damaged.
    """
    if ref.base is None:
        return _decode_one(repo, key, ref, frame, None)
    fast = _rebuild(repo, key, ref, frame)
    if fast is not None:
        return fast
    # Something in the chain is wrong: rebuild link by link, each verified, so the
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
    repo: RepoStorage, ref: ChunkRef, out: memoryview, shared: ChainFrames | None = None
) -> bool:
    """Apply the deltas of ``ref``'s chain to ``out`` (the bytes of the whole frame at its
    end, unverified) and check the result against ``ref``'s digest: True if it is
    ``ref``'s chunk, False (``out`` possibly changed) when anything fails.

    One digest check covers every link, the whole frame included (a damaged
    one yields other bytes); the caller takes the careful path, which names
    the link at fault, on False. A restore applies the deltas to a private
    (copy-on-write) mapping of the whole frame: only the pages a delta
    changes are copied, and the digest is taken in one pass, as for a chunk
    stored whole.
    """
    chain = ref.chain()
    if len(out) != ref.size:
        return False
    try:
        frames = _fetch_chain(repo, chain[:-1], shared)
        with shared.rebuilds if shared is not None else nullcontext():
            dst = out.cast("B") if out.format != "B" else out
            for link, raw in zip(chain[:-1], frames, strict=True):  # XOR: any order
                if not _apply(raw, link, dst):
                    return False
            return digest_of(out).hex() == ref.hash
    except (CasnapError, ValueError):
        return False


def _delta_frame(
    raw: Buffer, link: ChunkRef
) -> tuple[str, codec.FrameHeader, memoryview, bytes] | None:
    """``raw``'s key, header, payload and base digest if it is the delta frame ``link``
    names, else None."""
    key = _name(link)
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


def frame_limit(ref: ChunkRef) -> int:
    """The most bytes a read of ``ref``'s frame takes, refusing a longer object unread.

    A packed frame is where the manifest says, ``ref.length`` bytes (a pack is
    immutable). A loose object ``chunks/<h>`` is any valid frame of chunk
    ``h``: another take or a repair may have stored it again with another codec
    (docs/format.md, "Loose objects"), so its length is not the manifest's but
    at most the largest valid frame, the header and the raw bytes.
    """
    return ref.length if ref.pack is not None else codec.HEADER_SIZE + ref.size


def _apply(raw: Buffer, link: ChunkRef, out: Any) -> bool:
    """XOR delta frame ``raw`` of ``link`` into ``out``; False if the frame is not that delta."""
    frame = _delta_frame(raw, link)
    if frame is None:
        return False
    key, hdr, payload, base_digest = frame
    apply_delta(hdr, payload, key, base_digest, out)
    return True


def _rebuild(repo: RepoStorage, key: str, ref: ChunkRef, frame: Buffer) -> Buffer | None:
    """The delta ``ref`` rebuilt with one digest check, of the result; None if anything fails.

    The whole frame at the chain's end is decoded without its own check and
    every delta is XORed into it in place: a sparse chain costs about what
    reading the whole chunk does. The result's digest covers every link
    (a damaged one yields other bytes), so the careful path is only needed
    to say which link failed.
    """
    chain = ref.chain()
    try:
        frames = [frame, *_fetch_chain(repo, chain[1:])]
        whole = chain[-1]
        out = bytearray(
            codec.decode(
                frames[-1], _name(whole), bytes.fromhex(whole.hash), whole.size, check_digest=False
            )
        )
        for link, raw in zip(reversed(chain[:-1]), reversed(frames[:-1]), strict=True):
            if not _apply(raw, link, out):
                return None
    except (CasnapError, ValueError):
        return None
    return out if digest_of(out).hex() == ref.hash else None


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


def fetch_frame(repo: RepoStorage, ref: ChunkRef) -> bytes:
    """The stored frame of ``ref`` (at most :func:`frame_limit` bytes), unchecked."""
    if ref.pack is None:
        return repo.store.get(chunk_key(ref.hash), limit=frame_limit(ref))
    return repo.store.get_range(pack_key(ref.pack), ref.offset, ref.offset + ref.length)


def base_bytes(repo: RepoStorage, base: ChunkRef, user: str) -> Buffer:
    """The verified bytes of chunk ``base``, which the delta in object ``user`` needs.

    The frames of the chain (``base`` and its own bases) are fetched first,
    concurrently on a remote store (one round trip for the chain, not one per
    link), then decoded from the whole frame up, each checked against its
    hash like any read. Any failure is a :class:`DeltaBaseError` naming the
    base's object; a damaged base frame is recorded (contained) as such.
    """
    if base.base is not None:  # one digest check for the chain, unless it fails
        try:
            fast = _rebuild(repo, _name(base), base, fetch_frame(repo, base))
        except CasnapError:
            fast = None
        if fast is not None:
            return fast
    chain = base.chain()
    try:
        frames = _fetch_chain(repo, chain)
        data: Buffer | None = None
        for ref, frame in zip(reversed(chain), reversed(frames), strict=True):
            link = (bytes.fromhex(ref.base.hash), data) if ref.base is not None else None
            data = _decode_one(repo, _name(ref), ref, frame, link)  # type: ignore[arg-type]
    except (ObjectNotFoundError, IntegrityError) as exc:
        what = "is missing" if isinstance(exc, ObjectNotFoundError) else "cannot be read"
        raise DeltaBaseError(
            f"{user}: delta base {_name(base)} (chunk {base.hash[:12]}) {what}: {exc}", _name(base)
        ) from exc
    assert data is not None
    return data


def _name(ref: ChunkRef) -> str:
    return pack_key(ref.pack) if ref.pack else chunk_key(ref.hash)


def _fetch_chain(
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


def loose_copy(repo: RepoStorage, chunk: str, size: int, record: bool = True) -> Buffer | None:
    """The verified bytes of the loose object ``chunks/<chunk>``, whatever frame it holds
    (a stand-in for a damaged frame or a lost delta chain, a repair read back), or None
    (damage recorded if ``record``)."""
    loose = ChunkRef(hash=chunk, size=size, length=codec.HEADER_SIZE + size)  # a frame's most
    return read_copy(repo, loose, record)


def read_copy(repo: RepoStorage, ref: ChunkRef, record: bool) -> Buffer | None:
    """The verified bytes of one stored copy, or None (damage recorded if ``record``)."""
    key = _name(ref)
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
