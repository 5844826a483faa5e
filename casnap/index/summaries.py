"""Manifest summaries: what ``log`` and ``du`` need from a manifest, without its entries.

A summary is derived from one manifest and named by its hash, so it never
goes stale. :mod:`casnap.index.lmdb_store` stores summaries in the local index in
the binary form below; :func:`casnap.index.manifest_summaries` serves them.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

from casnap.format.manifest import Manifest

_SPAN = struct.Struct("<32sQQ")  # object digest, offset, frame length
_HEAD = struct.Struct("<I")  # length of a summary's JSON head


@dataclass(frozen=True, eq=False)
class ManifestSummary:
    """What ``log`` and ``du`` need from one manifest, without its entries.

    ``spans`` holds each distinct ``(object, offset, frame length)`` the
    manifest references, where object is the pack id or, for a loose chunk,
    the chunk hash: exactly ``history._object_of`` of every chunk ref.
    """

    manifest: str
    created_at: str
    world_size: int
    parents: tuple[str, ...]
    metadata: dict[str, Any]
    logical_bytes: int  # sum of the raw sizes of all chunk refs
    chunk_refs: int
    spans: frozenset[tuple[str, int, int]]

    @property
    def step(self) -> int | None:
        step = self.metadata.get("step")
        return step if isinstance(step, int) else None  # as history.log reads it

    @property
    def stored_bytes(self) -> int:
        """Bytes of the frames this snapshot references, shared frames counted once."""
        return sum(length for _, _, length in self.spans)

    def object_extents(self) -> dict[str, int]:
        """Per store object, the end of the last frame referenced (a loose chunk's size)."""
        out: dict[str, int] = {}
        for obj, offset, length in self.spans:
            out[obj] = max(out.get(obj, 0), offset + length)
        return out


def summarize(manifest_hash: str, manifest: Manifest) -> ManifestSummary:
    """What ``log``/``du`` need of ``manifest``, each distinct entry object read once
    (a rank-grouped manifest repeats one object under every rank's key)."""
    logical = count = 0
    spans: set[tuple[str, int, int]] = set()
    for refs, holders in manifest.distinct_chunk_refs():
        logical += holders * sum(r.size for r in refs)
        count += holders * len(refs)
        # Every frame the snapshot needs, a delta's bases too: retention's reclaim
        # and du count what the snapshot keeps alive from these.
        spans.update((c.pack or c.hash, c.offset, c.length) for r in refs for c in r.chain())
    return ManifestSummary(
        manifest=manifest_hash,
        created_at=manifest.created_at,
        world_size=manifest.world_size,
        parents=tuple(manifest.parents),
        metadata=dict(manifest.metadata),
        logical_bytes=logical,
        chunk_refs=count,
        spans=frozenset(spans),
    )


def encode_summary(s: ManifestSummary) -> bytes:
    head = json.dumps({
        "created_at": s.created_at, "world_size": s.world_size, "parents": list(s.parents),
        "metadata": s.metadata, "logical_bytes": s.logical_bytes, "chunk_refs": s.chunk_refs,
    }, sort_keys=True, separators=(",", ":")).encode()  # fmt: skip
    spans = b"".join(_SPAN.pack(bytes.fromhex(o), off, n) for o, off, n in sorted(s.spans))
    return _HEAD.pack(len(head)) + head + spans


def decode_summary(manifest_hash: str, body: bytes) -> ManifestSummary:
    (n,) = _HEAD.unpack_from(body)
    head = json.loads(body[_HEAD.size : _HEAD.size + n])
    rest = memoryview(body)[_HEAD.size + n :]
    if len(rest) % _SPAN.size:
        raise ValueError("truncated span table")
    spans = frozenset((o.hex(), off, ln) for o, off, ln in _SPAN.iter_unpack(rest))
    return ManifestSummary(
        manifest=manifest_hash,
        created_at=str(head["created_at"]),
        world_size=int(head["world_size"]),
        parents=tuple(str(p) for p in head["parents"]),
        metadata=dict(head["metadata"]),
        logical_bytes=int(head["logical_bytes"]),
        chunk_refs=int(head["chunk_refs"]),
        spans=spans,
    )
