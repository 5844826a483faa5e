"""Where repair finds good bytes of a bad chunk (docs/damage.md, "Repair").

A chunk is named by the hash of its bytes, so any bytes that hash to the
name are the chunk, wherever they come from. A :class:`ChunkSource` claims
bytes for a chunk and :mod:`casnap.ops.repair` verifies them: the
repository's other copies of the chunk (:class:`RepoCopies`), snapshots
given, in this or another repository (:class:`SnapshotSource`), live states
given, and a delta on the chunk applied to its own chunk's bytes
(:class:`FromDeltas`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from casnap.chunks.decode import read_copy
from casnap.chunks.read import object_name
from casnap.chunks.stored import fetch_frame
from casnap.errors import CasnapError
from casnap.format import codec
from casnap.format.delta import apply_delta
from casnap.format.entries import ChunkRef
from casnap.format.manifest import Manifest
from casnap.format.names import digest_of
from casnap.ops.verify import VerifyReport, roots
from casnap.repo.repository import RepoStorage

Buffer = codec.Buffer
# A delta's chunk may itself be the (whole) base of other deltas: FromDeltas follows at
# most this many such hops, which also ends a cycle a hostile repository could hold.
MAX_HOPS = 8


class ChunkSource(Protocol):
    """Somewhere good bytes of a chunk may come from; what it returns is verified by repair."""

    label: str

    def fetch(self, chunk: str, size: int) -> Buffer | None:
        """Bytes claimed to be chunk ``chunk`` (``size`` bytes), or None."""


class SnapshotSource:
    """The chunks of snapshots (manifests), read from their repository and verified."""

    def __init__(self, repo: RepoStorage, manifests: Iterable[Manifest], label: str) -> None:
        self.repo = repo
        self.label = label
        self.copies: dict[str, list[ChunkRef]] = {}
        for m in manifests:
            for ref in m.stored_refs():
                self.copies.setdefault(ref.hash, []).append(ref)

    def fetch(self, chunk: str, size: int) -> Buffer | None:
        for ref in self.copies.get(chunk, ()):
            data = read_copy(self.repo, ref, record=False)
            if data is not None:
                return data
        return None


class RepoCopies:
    """This repository's other copies of a chunk: every referenced frame that is not bad."""

    label = "another copy in this repository"

    def __init__(self, repo: RepoStorage, bad_copies: Iterable[str], dry_run: bool) -> None:
        self.repo, self.bad_copies, self.record = repo, tuple(bad_copies), not dry_run

    def fetch(self, chunk: str, size: int) -> Buffer | None:
        bad_keys = {c.rsplit(" ", 1)[0] for c in self.bad_copies}
        for ref in _referenced_copies(self.repo, chunk):
            if object_name(ref) in bad_keys:
                continue
            data = read_copy(self.repo, ref, self.record)
            if data is not None:
                return data
        return None


def _referenced_copies(repo: RepoStorage, chunk: str) -> list[ChunkRef]:
    out: dict[tuple[str | None, int], ChunkRef] = {}
    for mhash in roots(repo, VerifyReport()):
        try:
            manifest = repo.read_manifest(mhash)
        except CasnapError:
            continue
        out.update(((r.pack, r.offset), r) for r in manifest.stored_refs() if r.hash == chunk)
    return list(out.values())


class FromDeltas:
    """A damaged base rebuilt from a delta on it: a delta frame is the XOR of its chunk
    with its base over the runs that differ, so applying it to the chunk's bytes
    gives the base's. The chunk's bytes come from the other sources (live state
    still holding them, a snapshot) or, where that chunk is stored whole too (the
    base of other deltas), from a delta on *it*, each verified against its hash
    before it is used.
    """

    label = "a delta on it, rebuilt from another source"

    def __init__(self, repo: RepoStorage, sources: Sequence[ChunkSource]) -> None:
        self.repo, self.sources = repo, sources
        self._users: dict[str, list[ChunkRef]] | None = None

    def users(self) -> dict[str, list[ChunkRef]]:
        """The referenced delta frames by the hash of their base (read once)."""
        if self._users is None:
            self._users = {}
            seen: set[tuple[str | None, int]] = set()
            for mhash in roots(self.repo, VerifyReport()):
                try:
                    manifest = self.repo.read_manifest(mhash)
                except CasnapError:
                    continue
                for ref in manifest.stored_refs():
                    if ref.base is not None and (ref.pack, ref.offset) not in seen:
                        seen.add((ref.pack, ref.offset))
                        self._users.setdefault(ref.base.hash, []).append(ref)
        return self._users

    def fetch(self, chunk: str, size: int, depth: int = 0) -> Buffer | None:
        if depth > MAX_HOPS:
            return None
        for delta in self.users().get(chunk, ()):
            data = self._verified(delta, depth)
            if data is None:
                continue
            try:
                frame = fetch_frame(self.repo, delta)
                hdr = codec.parse_header(frame, object_name(delta))
                if hdr.codec != codec.CODEC_DELTA or hdr.raw_length != size:
                    continue
                out = bytearray(data)
                payload = memoryview(frame)[codec.HEADER_SIZE : hdr.frame_length]
                apply_delta(hdr, payload, object_name(delta), bytes.fromhex(chunk), out)
            except CasnapError:
                continue  # the delta's own frame is damaged or gone: another user may serve
            if digest_of(out) == bytes.fromhex(chunk):
                return out
        return None

    def _verified(self, delta: ChunkRef, depth: int) -> Buffer | None:
        want = bytes.fromhex(delta.hash)
        for source in self.sources:
            data = source.fetch(delta.hash, delta.size)
            if data is not None and len(data) == delta.size and digest_of(data) == want:
                return data
        data = self.fetch(delta.hash, delta.size, depth + 1)  # a delta on the delta's chunk
        return data if data is not None and digest_of(data) == want else None
