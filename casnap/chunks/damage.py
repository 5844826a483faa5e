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

import bisect
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import blake3

from casnap import index
from casnap.errors import (
    CasnapError,
    DeltaBaseError,
    IntegrityError,
    ObjectNotFoundError,
    ObjectRefusedError,
)
from casnap.format import codec
from casnap.format.manifest import ChunkRef
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
    that cannot be read raises :class:`DeltaBaseError` naming it, and only
    the copy that failed its own check is recorded as damaged.
    """
    if ref.base is None:
        return _decode_one(repo, key, ref, frame, None)
    fast = _rebuild(repo, key, ref, frame)
    if fast is not None:
        return fast
    # Something in the chain is wrong: rebuild link by link, each verified, so the
    # copy at fault is the one named (and recorded, if damaged).
    base = (bytes.fromhex(ref.base.hash), base_bytes(repo, ref.base, key))
    return _decode_one(repo, key, ref, frame, base)


def rebuild_into(repo: RepoStorage, ref: ChunkRef, view: memoryview) -> bool:
    """Rebuild delta ``ref`` straight into ``view`` (its final memory); False if not done.

    Only for a chain that ends in a loose raw frame (the usual case: the
    whole chunk written by an earlier take): it is read into ``view``, each
    delta applied there, and the result's digest checked there, so a sparse
    chain costs what reading the whole chunk does. False (``view`` possibly
    overwritten) when anything fails; the caller then takes the careful path.
    """
    chain = ref.chain()
    whole = whole_raw_loose(ref)
    if whole is None or len(view) != ref.size:
        return False
    try:
        frames = _fetch_chain(repo, chain[:-1])
        head = bytearray(codec.HEADER_SIZE)
        n = repo.store.read_into(chunk_key(whole.hash), [memoryview(head), view])
        hdr = codec.parse_header(head, chunk_key(whole.hash))
        if n != whole.length or hdr.codec != codec.CODEC_RAW or hdr.digest.hex() != whole.hash:
            return False
        out = view.cast("B")
        for link, raw in zip(reversed(chain[:-1]), reversed(frames), strict=True):
            if not _apply(raw, link, out):
                return False
    except (CasnapError, ValueError):
        return False
    return digest_of(view).hex() == ref.hash


@dataclass(frozen=True)
class Patched:
    """A verified chunk given as its base's bytes with patches over them, not copied.

    ``base`` is the chain's whole frame payload (a mapping of the stored
    object); ``patches`` are ``(offset, bytes)`` where the chunk differs. The
    chunk is ``base`` with each patch written over it, in one copy, once whoever
    holds it may write (``TensorUndo`` in casnap/restore/undo.py).
    """

    base: memoryview
    patches: tuple[tuple[int, bytes], ...]

    def __len__(self) -> int:
        return len(self.base)


def verify_patched(repo: RepoStorage, ref: ChunkRef, base: memoryview) -> Patched | None:
    """Delta ``ref`` verified over ``base`` (the mapped payload of its chain's whole
    frame, of which only the header was checked) without building it: the digest
    is taken over the unchanged spans of ``base`` and the patched runs in between.

    None when anything does not fit or the digest differs; the caller then
    takes a path that rebuilds and, on damage, names the link that failed.
    """
    chain = ref.chain()
    if len(base) != ref.size:
        return None
    try:
        frames = _fetch_chain(repo, chain[:-1])
        deltas = []
        for link, raw in zip(reversed(chain[:-1]), reversed(frames), strict=True):
            frame = _delta_frame(raw, link)
            if frame is None:
                return None
            key, hdr, payload, base_digest = frame
            deltas.append(codec.delta_runs(hdr, payload, key, base_digest))
    except (CasnapError, ValueError):
        return None
    spans = _union([(a, a + n) for runs, _ in deltas for a, n in runs])
    starts = [a for a, _ in spans]
    patches = [bytearray(base[a:b]) for a, b in spans]
    for runs, kept in deltas:  # oldest first: each applies to what the earlier ones made
        pos = 0
        for a, n in runs:
            k = bisect.bisect_right(starts, a) - 1
            at = a - starts[k]
            patch = patches[k]
            mine = kept[pos : pos + n].tobytes()
            patch[at : at + n] = int.to_bytes(
                int.from_bytes(patch[at : at + n], "little") ^ int.from_bytes(mine, "little"),
                n,
                "little",
            )
            pos += n
    h = blake3.blake3()
    prev = 0
    for (a, b), patch in zip(spans, patches, strict=True):
        h.update(base[prev:a])
        h.update(patch)
        prev = b
    h.update(base[prev:])
    if h.digest().hex() != ref.hash:
        return None
    return Patched(base, tuple((a, bytes(p)) for (a, _), p in zip(spans, patches, strict=True)))


def _union(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Overlapping or touching ``[a, b)`` spans merged, in order."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


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


def whole_raw_loose(ref: ChunkRef) -> ChunkRef | None:
    """The end of ``ref``'s chain if it is a loose frame stored raw (readable in place)."""
    whole = ref.chain()[-1]
    if whole.pack is not None or whole.length != codec.HEADER_SIZE + whole.size:
        return None
    return whole


def _apply(raw: Buffer, link: ChunkRef, out: Any) -> bool:
    """XOR delta frame ``raw`` of ``link`` into ``out``; False if the frame is not that delta."""
    frame = _delta_frame(raw, link)
    if frame is None:
        return False
    key, hdr, payload, base_digest = frame
    codec.apply_delta(hdr, payload, key, base_digest, out)
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
        out = bytearray(codec.decode(frames[-1], _name(whole), bytes.fromhex(whole.hash),
                                     whole.size, check_digest=False))  # fmt: skip
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
            data = _replacement(repo, ref)
            if data is not None:
                _keep_record(repo, ref, exc)
                return data
        contain(repo, ref, exc)
        raise


def fetch_frame(repo: RepoStorage, ref: ChunkRef) -> bytes:
    """The stored frame of ``ref`` (at most its declared length), unchecked."""
    if ref.pack is None:
        return repo.store.get(chunk_key(ref.hash), limit=ref.length)
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


def _fetch_chain(repo: RepoStorage, chain: list[ChunkRef]) -> list[bytes]:
    """Every frame of ``chain``; concurrently where each request waits on a network."""

    def one(ref: ChunkRef) -> bytes:
        try:
            return fetch_frame(repo, ref)
        except ObjectRefusedError as exc:  # a FIFO, a link: damage to that copy
            contain(repo, ref, exc)
            raise

    if len(chain) == 1 or repo.root.capabilities.local:
        return [one(ref) for ref in chain]  # a local read is a page-cache copy: no gain
    with ThreadPoolExecutor(len(chain), thread_name_prefix="casnap-chain") as pool:
        return list(pool.map(one, chain))


def _replacement(repo: RepoStorage, ref: ChunkRef) -> Buffer | None:
    """The verified bytes of the loose object ``chunks/<h>`` standing in for a damaged frame."""
    loose = ChunkRef(hash=ref.hash, size=ref.size, length=codec.HEADER_SIZE + ref.size)
    return read_copy(repo, loose, record=True)  # a frame's most: header + raw bytes


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


def verify_in_place(
    repo: RepoStorage, key: str, ref: ChunkRef, head: Buffer, data: Buffer, received: int
) -> None:
    """:func:`casnap.format.codec.verify_raw_in_place` of a loose raw frame read into place."""
    try:
        codec.verify_raw_in_place(head, data, received, key, bytes.fromhex(ref.hash), ref.size)
    except IntegrityError as exc:
        contain(repo, ref, exc)
        raise
