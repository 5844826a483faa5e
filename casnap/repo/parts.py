"""A manifest's parts in the store: written before it, read once per repository object.

A part (docs/format.md, "Manifest parts") is a loose object ``chunks/<h>``: a
chunk frame whose raw bytes are the part's canonical JSON, so gc, verify, copy
and repair follow it as any frame a manifest references
(:meth:`~casnap.format.manifest.Manifest.stored_refs`). :class:`PartMemo` keeps
the parsed entries of the parts read last, by hash: a history operation reading
a thousand manifests that share their parts parses each distinct part once, and
manifests sharing a part share its entry objects.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from casnap.errors import ManifestValidationError, ObjectExistsError, ObjectNotFoundError
from casnap.format import codec
from casnap.format.entries import ChunkRef, Entry
from casnap.format.manifest_bytes import StoredPart
from casnap.format.parse import parse_part
from casnap.store import ObjectStore

# Raw bytes of parsed parts kept: the parts of the largest manifests a history walks.
MEMO_BYTES = 256 << 20


def part_key(h: str) -> str:
    return f"chunks/{h[:2]}/{h}"


def store_parts(store: ObjectStore, parts: list[StoredPart]) -> None:
    """Put each part not known stored (create-only: the same bytes under the same name).

    Non-durably, their syncs deferred, as a take's chunks: the manifest's durable put
    that follows makes them durable first (the commit order), in one flush.
    """
    with store.deferring():
        for part in parts:
            if part.frame is None:
                continue
            try:
                store.put(part_key(part.ref.hash), part.frame, create_only=True, durable=False)
            except ObjectExistsError:
                pass


class PartMemo:
    """The entries of the parts read last, by hash, up to ``MEMO_BYTES`` of their JSON."""

    def __init__(self, store: ObjectStore, capacity: int = MEMO_BYTES) -> None:
        self._store = store
        self._capacity = capacity
        self._held: OrderedDict[str, tuple[dict[str, Entry], int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def load(self, ref: ChunkRef) -> dict[str, Entry]:
        """The checked entries of part ``ref``: fetched, its frame decoded against the
        hash and size ``ref`` declares (before any allocation it declares), parsed."""
        with self._lock:
            hit = self._held.get(ref.hash)
            if hit is not None:
                self._held.move_to_end(ref.hash)
                return hit[0]
        key = part_key(ref.hash)
        try:
            frame = self._store.get(key, limit=codec.HEADER_SIZE + ref.size)
        except ObjectNotFoundError as exc:
            raise ManifestValidationError(f"manifest part {ref.hash} is missing", key) from exc
        raw = codec.decode(frame, key, bytes.fromhex(ref.hash), ref.size)
        entries = parse_part(bytes(raw), ref)
        with self._lock:
            if ref.hash not in self._held and ref.size <= self._capacity:
                self._held[ref.hash] = (entries, ref.size)
                self._bytes += ref.size
                while self._bytes > self._capacity:
                    _, (_, n) = self._held.popitem(last=False)
                    self._bytes -= n
        return entries
