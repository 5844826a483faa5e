"""Manifest summaries: what ``log`` and ``du`` need from a manifest, without its entries.

A summary is derived from one manifest and named by its hash, so it never
goes stale. :mod:`casnap.index.lmdb_store` stores summaries in the local index in
the binary form below; :func:`casnap.index.manifest_summaries` serves them.
A :class:`SummaryLine` is the small part ``log`` reads per snapshot: the
summary's figures and the spans it adds to its first parent, not every span
(the parent's summary holds the rest; docs/index.md).
"""

from __future__ import annotations

import json
import struct
import threading
from dataclasses import dataclass, field
from typing import Any

from casnap.format.entries import Entry, chunks_of, with_chunks
from casnap.format.manifest import Manifest, same_entries

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
    # The binary span table of ``spans``, when a SummaryMemo had it at hand already.
    encoded_spans: bytes | None = field(default=None, repr=False)

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


@dataclass(frozen=True, eq=False)
class SummaryLine:
    """What one ``log`` or ``du`` line needs of a manifest: its figures, and how it
    differs from ``base`` (its first parent): the spans it references that the base
    does not, and the store objects it uses that the base does not (``gained``) and
    the base's it does not (``lost``). ``base`` None: ``added`` and ``gained`` hold
    every span and object (a root, or a parent whose summary was not at hand)."""

    manifest: str
    created_at: str
    parents: tuple[str, ...]
    metadata: dict[str, Any]
    logical_bytes: int
    stored_bytes: int
    base: str | None
    added: frozenset[tuple[str, int, int]]
    gained: frozenset[str] = frozenset()
    lost: frozenset[str] = frozenset()

    @property
    def step(self) -> int | None:
        step = self.metadata.get("step")
        return step if isinstance(step, int) else None


def line_of(s: ManifestSummary, base: frozenset[tuple[str, int, int]] | None) -> SummaryLine:
    """The line of ``s``; ``base``: the spans of its first parent, when known."""
    if base is None or not s.parents:
        return _line(s, None, s.spans, frozenset(o for o, _, _ in s.spans), frozenset())
    if base is s.spans:  # an unchanged re-take: the parent's very spans (SummaryMemo)
        return _line(s, s.parents[0], frozenset(), frozenset(), frozenset())
    ours = {o for o, _, _ in s.spans}
    theirs = {o for o, _, _ in base}
    return _line(
        s, s.parents[0], s.spans - base, frozenset(ours - theirs), frozenset(theirs - ours)
    )


def _line(
    s: ManifestSummary,
    base: str | None,
    added: frozenset[tuple[str, int, int]],
    gained: frozenset[str],
    lost: frozenset[str],
) -> SummaryLine:
    return SummaryLine(
        s.manifest, s.created_at, s.parents, s.metadata, s.logical_bytes, s.stored_bytes,
        base, added, gained, lost,
    )  # fmt: skip


def encode_line(line: SummaryLine) -> bytes:
    head = _head(line) | {"stored_bytes": line.stored_bytes, "base": line.base}
    head |= {"gained": len(line.gained), "lost": len(line.lost)}
    digests = b"".join(bytes.fromhex(o) for o in (*sorted(line.gained), *sorted(line.lost)))
    return _pack_head(head) + digests + span_table(line.added)


def decode_line(manifest_hash: str, body: bytes) -> SummaryLine:
    (n,) = _HEAD.unpack_from(body)
    head = json.loads(body[_HEAD.size : _HEAD.size + n])
    gained, lost = int(head["gained"]), int(head["lost"])
    at = _HEAD.size + n
    ends = (at + 32 * gained, at + 32 * (gained + lost))
    if ends[1] > len(body):
        raise ValueError("truncated object table")
    base = head["base"]
    return SummaryLine(
        manifest=manifest_hash,
        created_at=str(head["created_at"]),
        parents=tuple(str(p) for p in head["parents"]),
        metadata=dict(head["metadata"]),
        logical_bytes=int(head["logical_bytes"]),
        stored_bytes=int(head["stored_bytes"]),
        base=None if base is None else str(base),
        added=_spans(memoryview(body)[ends[1] :]),
        gained=frozenset(body[i : i + 32].hex() for i in range(at, ends[0], 32)),
        lost=frozenset(body[i : i + 32].hex() for i in range(ends[0], ends[1], 32)),
    )


_Part = tuple[Entry, int, int, tuple[tuple[str, int, int], ...]]


class SummaryMemo:
    """What :func:`summarize` worked out per entry object of the manifest it summarized
    last, and that manifest's span table: the child take of a cached manifest
    (casnap.take.reuse) reuses the entry objects of what did not change, so its
    summary only walks the changed ones
    (2,000 unchanged small tensors: 2.8 ms and 1.1 ms of encoding per take, before).

    Only identity counts: a part is reused for the very entry object it was
    computed from (entries are immutable), never for an equal one.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._parts: dict[int, _Part] = {}
        self._encoded: tuple[frozenset[tuple[str, int, int]], bytes] | None = None
        self._last: str | None = None  # the manifest whose spans _encoded holds
        # The last manifest's entries with chunks (with_chunks) and its (logical, count).
        self._whole: tuple[dict[str, Entry], tuple[int, int]] | None = None

    def take(self) -> tuple[dict[int, _Part], tuple[frozenset[Any], bytes] | None]:
        """The parts and the (spans, table) of the manifest summarized last, together."""
        with self._lock:
            return self._parts, self._encoded

    def spans_of(self, manifest_hash: str) -> frozenset[tuple[str, int, int]] | None:
        """The spans of ``manifest_hash`` if it is the manifest summarized last."""
        with self._lock:
            encoded, last = self._encoded, self._last
        return encoded[0] if encoded is not None and last == manifest_hash else None

    def now_of(self, manifest_hash: str) -> None:
        with self._lock:
            self._last = manifest_hash

    def unchanged(
        self, held: dict[str, Entry]
    ) -> tuple[tuple[int, int], frozenset[Any], bytes] | None:
        """The totals, spans and table of the last manifest when ``held`` (its entries
        with chunks, :func:`~casnap.format.entries.with_chunks`) are the last one's very
        objects (an unchanged re-take: its containers and primitives are new objects,
        but hold no chunks): nothing is walked again."""
        with self._lock:
            whole, encoded = self._whole, self._encoded
        if whole is None or encoded is None or not same_entries(held, whole[0]):
            return None
        return whole[1], encoded[0], encoded[1]

    def keep(
        self,
        parts: dict[int, _Part],
        spans: frozenset[Any],
        table: bytes,
        whole: tuple[dict[str, Entry], tuple[int, int]] | None = None,
        manifest_hash: str | None = None,
    ) -> None:
        """Remember a summarized manifest's parts, span table and entry objects (one
        step: a take in another thread reads all of one manifest)."""
        with self._lock:
            self._parts, self._encoded, self._whole = parts, (spans, table), whole
            self._last = manifest_hash


def _part(e: Entry) -> tuple[int, int, tuple[tuple[str, int, int], ...]]:
    """An entry object's raw bytes, chunk refs and spans."""
    refs = chunks_of(e)
    spans: list[tuple[str, int, int]] = []
    for r in refs:
        if r.base is None:
            spans.append((r.pack or r.hash, r.offset, r.length))
        else:  # every frame the snapshot needs, a delta's bases too: reclaim and du count them
            spans.extend((c.pack or c.hash, c.offset, c.length) for c in r.chain())
    return sum(r.size for r in refs), len(refs), tuple(spans)


def summarize(
    manifest_hash: str, manifest: Manifest, memo: SummaryMemo | None = None
) -> ManifestSummary:
    """What ``log``/``du`` need of ``manifest``, each distinct entry object read once
    (a rank-grouped manifest repeats one object under every rank's key); ``memo``
    reuses the work of the entry objects it summarized last."""
    held = with_chunks(manifest.entries) if memo is not None else {}
    reused = memo.unchanged(held) if memo is not None else None
    if reused is not None:
        (total, refs), spans, encoded = reused
        if memo is not None:
            memo.now_of(manifest_hash)  # the same spans, now this manifest's
        return _summary(manifest_hash, manifest, total, refs, spans, encoded)
    logical = count = 0
    old, last = memo.take() if memo is not None else ({}, None)
    parts: dict[int, _Part] = {}
    missed = 0
    for e, holders in manifest.distinct_entries():
        hit = old.get(id(e))
        if hit is None or hit[0] is not e:
            hit = (e, *_part(e))
            missed += 1
        parts[id(e)] = hit
        logical += holders * hit[1]
        count += holders * hit[2]
    # The very entry objects of the manifest encoded last: the same spans, not gathered again.
    same = last is not None and not missed and len(parts) == len(old)
    if same and last is not None:
        frozen = last[0]
    else:
        frozen = frozenset(span for hit in parts.values() for span in hit[3])
    table = None
    if memo is not None:  # the summary is about to be recorded: its table is needed
        reuse = last is not None and (same or last[0] == frozen)
        table = last[1] if reuse and last is not None else span_table(frozen)
        memo.keep(parts, frozen, table, (held, (logical, count)), manifest_hash)
    return _summary(manifest_hash, manifest, logical, count, frozen, table)


def _summary(
    manifest_hash: str,
    manifest: Manifest,
    logical: int,
    count: int,
    spans: frozenset[tuple[str, int, int]],
    table: bytes | None,
) -> ManifestSummary:
    if manifest.parts:  # the manifest's parts are frames it needs too (not chunk refs)
        held = frozenset((p.hash, p.offset, p.length) for p in manifest.parts)
        spans = spans | held
        table = None if table is None else table + span_table(held)  # a set: order is free
    return ManifestSummary(
        manifest=manifest_hash,
        created_at=manifest.created_at,
        world_size=manifest.world_size,
        parents=tuple(manifest.parents),
        metadata=dict(manifest.metadata),
        logical_bytes=logical,
        chunk_refs=count,
        spans=spans,
        encoded_spans=table,
    )


def _head(s: ManifestSummary | SummaryLine) -> dict[str, Any]:
    return {
        "created_at": s.created_at,
        "parents": list(s.parents),
        "metadata": s.metadata,
        "logical_bytes": s.logical_bytes,
    }


def _pack_head(head: dict[str, Any]) -> bytes:
    text = json.dumps(head, sort_keys=True, separators=(",", ":")).encode()
    return _HEAD.pack(len(text)) + text


def _unpack(body: bytes) -> tuple[dict[str, Any], frozenset[tuple[str, int, int]]]:
    (n,) = _HEAD.unpack_from(body)
    head = json.loads(body[_HEAD.size : _HEAD.size + n])
    return head, _spans(memoryview(body)[_HEAD.size + n :])


def _spans(table: memoryview) -> frozenset[tuple[str, int, int]]:
    if len(table) % _SPAN.size:
        raise ValueError("truncated span table")
    return frozenset((o.hex(), off, ln) for o, off, ln in _SPAN.iter_unpack(table))


def encode_summary(s: ManifestSummary) -> bytes:
    head = _head(s) | {"world_size": s.world_size, "chunk_refs": s.chunk_refs}
    spans = s.encoded_spans
    if spans is None:
        spans = span_table(s.spans)
    return _pack_head(head) + spans


def span_table(spans: frozenset[tuple[str, int, int]]) -> bytes:
    """The binary form of a summary's spans, sorted."""
    return b"".join(_SPAN.pack(bytes.fromhex(o), off, n) for o, off, n in sorted(spans))


def decode_summary(manifest_hash: str, body: bytes) -> ManifestSummary:
    head, spans = _unpack(body)
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
