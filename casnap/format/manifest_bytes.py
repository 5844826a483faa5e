"""A manifest's canonical JSON, assembled from one cached text per entry, and trusted builders.

A manifest's bytes are ``canonical_json(manifest.model_dump(mode="json"))``
(pinned by tests/test_manifest_bytes.py). Dumping 20,000 entries through
pydantic and ``json.dumps`` every take was most of the time of a take of many
small tensors, and of an unchanged re-take nearly all of it. Here the same
bytes are assembled from each entry's ``"key":{...}`` text (:func:`entry_texts`):
a dense tensor's from a template, any other entry through ``canonical_json``;
an entry shared with the previous take (the very same frozen object) reuses
that take's text. Top-level keys of a manifest are fixed by the model
(``extra="forbid"``) and ``created_at`` < ``entries`` < every other in sort
order, which is what lets the entries be spliced in.

:func:`trusted_chunk_ref` and :func:`trusted_tensor_entry` build models from
values casnap computed itself (a hash it took, a shape torch reported)
without running the validators, which cost more than the rest of building
the entry. Everything read from a store still goes through
:func:`~casnap.format.parse.parse_manifest`, and tests check that a
take's manifest parses back equal to what the take built.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from casnap.format import codec
from casnap.format.entries import ChunkRef, Entry, Quantization, TensorEntry
from casnap.format.grouped_bytes import grouped_bytes, ref_text
from casnap.format.json_text import canonical_json
from casnap.format.manifest import MAX_KEY_LENGTH, Dumped, Manifest
from casnap.format.names import digest_of

M = TypeVar("M", ChunkRef, TensorEntry)
# How a writer cuts entries into parts (docs/format.md, "Manifest parts"): a manifest
# whose entries' JSON is at most INLINE_MAX characters holds them inline; else every
# entry is in a part. A part ends after PART_MAX characters, or after PART_MIN at a
# key whose crc32 has its low bits clear: an end chosen by the keys, so a changed
# entry changes its own part only, and an added key moves no other part's ends.
INLINE_MAX = 16 << 10
PART_MIN = 64 << 10
PART_MAX = 512 << 10
_CUT_MASK = 15
PART_LEVEL = 1  # zstd level of a part's frame
_REF_FIELDS = {"hash", "size", "pack", "offset", "length", "base"}
_TENSOR_FIELDS = {"dtype", "shape", "chunk_size", "chunks", "replicated", "quantized"}


def _trusted(cls: type[M], values: dict[str, Any], fields: set[str]) -> M:
    """A model holding ``values`` as validation would leave them, without validating.

    ``fields`` (the fields set) is shared by every model built here: one object
    less per chunk and entry for the garbage collector to track. Nothing
    mutates a frozen model's fields set (``model_copy`` copies it first).
    """
    model = object.__new__(cls)
    object.__setattr__(model, "__dict__", values)
    object.__setattr__(model, "__pydantic_fields_set__", fields)
    object.__setattr__(model, "__pydantic_extra__", None)
    object.__setattr__(model, "__pydantic_private__", None)
    return model


def trusted_chunk_ref(
    h: str, size: int, pack: str | None, offset: int, length: int, base: ChunkRef | None = None
) -> ChunkRef:
    """``ChunkRef(hash=h, ...)`` for a chunk this process hashed and wrote (not validated;
    ``base``: the delta base, a reference read from a validated manifest)."""
    values = {
        "hash": h,
        "size": size,
        "pack": pack,
        "offset": offset,
        "length": length,
        "base": base,
    }
    return _trusted(ChunkRef, values, _REF_FIELDS)


def trusted_tensor_entry(
    dtype: str,
    shape: list[int],
    chunk_size: int,
    chunks: list[ChunkRef],
    replicated: bool,
    quantized: Quantization | None,
) -> TensorEntry:
    """``TensorEntry(...)`` of a tensor this process flattened and wrote (not validated)."""
    values = {
        "kind": "tensor",
        "dtype": dtype,
        "shape": shape,
        "chunk_size": chunk_size,
        "chunks": chunks,
        "replicated": replicated,
        "quantized": quantized,
    }
    return _trusted(TensorEntry, values, _TENSOR_FIELDS)


def trusted_manifest(entries: dict[str, Entry], **fields: Any) -> Manifest:
    """``Manifest(entries=entries, **fields)`` where ``entries`` are models already built.

    Validating a manifest runs every entry's validators again (pydantic
    revalidates the members of a discriminated union); here only the other
    fields and the keys' lengths are checked. A key out of bounds falls back
    to full validation, which raises as it always did.
    """
    if any(not 0 < len(k) <= MAX_KEY_LENGTH for k in entries):
        return Manifest(entries=entries, **fields)
    return Manifest(entries={}, **fields).model_copy(update={"entries": entries})


# ``json.dumps(s, ensure_ascii=False)`` of a str, without building an encoder per call.
_quoted = json.encoder.encode_basestring


def entry_text(key: str, entry: Entry) -> str:
    """``"key":{...}`` exactly as ``canonical_json`` writes this member of ``entries``.

    A dense tensor's text comes from a template (its dtype, hashes and ints
    need no escaping: the model admits nothing else); any other entry is
    dumped the usual way.
    """
    name = _quoted(key)
    if isinstance(entry, TensorEntry) and entry.quantized is None:
        refs = entry.chunks
        chunks = ref_text(refs[0]) if len(refs) == 1 else ",".join(map(ref_text, refs))
        shape = ",".join(map(str, entry.shape))
        replicated = "true" if entry.replicated else "false"
        return (
            f'{name}:{{"chunk_size":{entry.chunk_size},"chunks":[{chunks}],'
            f'"dtype":"{entry.dtype}","kind":"tensor","replicated":{replicated},'
            f'"shape":[{shape}]}}'
        )
    return f"{name}:{canonical_json(entry.model_dump(mode='json')).decode('utf-8')}"


def entry_texts(manifest: Manifest, reuse: Dumped | None = None) -> Mapping[str, str]:
    """Every entry's :func:`entry_text`, reusing ``reuse``'s for the entries the two share.

    A take of an unchanged structure shares most entry objects with its
    parent's manifest (casnap.take.plan.build_entries); entries are frozen,
    so a text cannot go stale. An unchanged re-take holds the parent's very
    entries (casnap.take.job): its texts are the parent's.
    """
    if reuse is not None and reuse.manifest.entries is manifest.entries:
        return reuse.texts
    old_entries = reuse.manifest.entries if reuse is not None else {}
    old_texts = reuse.texts if reuse is not None else {}
    known = {p.hash: p for p in manifest.parts}
    if isinstance(old_texts, EntryTexts):  # the parent's parts are stored: not encoded again
        known.update((p.ref.hash, p.ref) for p in old_texts.parts())
    elif reuse is not None:
        known.update((p.hash, p) for p in reuse.manifest.parts)
    out = EntryTexts(manifest.entries, known)
    for key, entry in manifest.entries.items():
        text = old_texts.get(key) if old_entries.get(key) is entry else None
        out[key] = text if text is not None else entry_text(key, entry)
    return out


class EntryTexts(dict[str, str]):
    """:func:`entry_texts`' result: each key's text, and the ``entries`` member they make
    up, joined once (an unchanged re-take reuses the parent's texts, so the join too)."""

    def __init__(self, of: Mapping[str, Entry], known: Mapping[str, ChunkRef] | None = None):
        super().__init__()
        self.of = of  # the entries they are the texts of
        self.known = known or {}  # parts already stored (the parent's), by hash
        self._body: bytes | None = None
        self._parts: list[StoredPart] | None = None

    def body(self) -> bytes:
        """The texts in key order, comma-separated: a manifest's ``entries`` members."""
        if self._body is None:
            self._body = ",".join([self[k] for k in sorted(self)]).encode("utf-8")
        return self._body

    def parts(self) -> list[StoredPart]:
        """:func:`cut_parts` of these texts, once (an unchanged re-take reuses them)."""
        if self._parts is None:
            self._parts = cut_parts(self, sorted(self), self.known)
        return self._parts

    def stored(self) -> None:
        """Record that :meth:`parts` are stored: they are not put again."""
        if self._parts is not None:
            self._parts = [StoredPart(p.ref, None) for p in self._parts]


@dataclass(frozen=True)
class StoredPart:
    """A part of a manifest's entries: its reference and, unless stored already, its frame."""

    ref: ChunkRef
    frame: bytes | None  # None: known stored (the parent's part, or one read back)


def cut_parts(
    texts: Mapping[str, str], keys: list[str], known: Mapping[str, ChunkRef]
) -> list[StoredPart]:
    """The parts of the entries ``keys`` (sorted), as the writer's rule cuts them (see
    ``PART_MIN``); ``known``: parts stored already, by hash, not encoded again."""
    out: list[StoredPart] = []
    start = size = 0
    for i, key in enumerate(keys):
        size += len(texts[key]) + 1
        end = i == len(keys) - 1 or size >= PART_MAX
        if not end and size >= PART_MIN:
            end = zlib.crc32(key.encode("utf-8")) & _CUT_MASK == 0
        if end:
            members = ",".join([texts[k] for k in keys[start : i + 1]])
            out.append(_part(('{"entries":{' + members + "}}").encode("utf-8"), known))
            start, size = i + 1, 0
    return out


def _part(data: bytes, known: Mapping[str, ChunkRef]) -> StoredPart:
    digest = digest_of(data)
    ref = known.get(digest.hex())
    if ref is not None:
        return StoredPart(ref, None)
    # JSON always compresses: zstd without a trial, one compression per part
    header, payload = codec.encode(data, digest, level=PART_LEVEL, choice=codec.CODEC_ZSTD)
    frame = header + bytes(payload)
    return StoredPart(trusted_chunk_ref(digest.hex(), len(data), None, 0, len(frame)), frame)


def serialize(manifest: Manifest, texts: Mapping[str, str] | None = None) -> bytes:
    """The canonical JSON bytes of ``manifest`` as stored, what its name hashes
    (``texts``: its entry texts, :func:`entry_texts`, reused from the last take where
    unchanged); its parts are :func:`split`'s."""
    return split(manifest, texts)[0]


def split(
    manifest: Manifest, texts: Mapping[str, str] | None = None
) -> tuple[bytes, list[StoredPart]]:
    """The manifest's bytes and the parts they list (docs/format.md, "Manifest parts").

    A distributed take's manifest (more than one rank) is written with
    ``rank_groups`` (:mod:`casnap.format.grouped_bytes`) and its entries inline;
    any other as :func:`manifest_bytes` assembles it, in parts when its entries'
    JSON is longer than ``INLINE_MAX``.
    """
    if manifest.writes_rank_groups():  # its ranks share entry objects
        return grouped_bytes(manifest, *manifest.rank_groups_split()), []
    if texts is None:
        texts = entry_texts(manifest)
    if not isinstance(texts, EntryTexts) or texts.of is not manifest.entries:
        known = {p.hash: p for p in manifest.parts}
        texts = _as_entry_texts(manifest, texts, known)
    if len(texts.body()) <= INLINE_MAX:
        return manifest_bytes(manifest, texts.body()), []
    parts = texts.parts()
    return manifest_bytes(manifest, b"", [p.ref for p in parts]), parts


def _as_entry_texts(
    manifest: Manifest, texts: Mapping[str, str], known: dict[str, ChunkRef]
) -> EntryTexts:
    out = EntryTexts(manifest.entries, known)
    out.update((k, texts[k]) for k in manifest.entries)
    return out


def manifest_bytes(manifest: Manifest, body: bytes, parts: list[ChunkRef] | None = None) -> bytes:
    """``canonical_json`` of the manifest with ``body`` (its entries' texts, comma-joined,
    or none) as ``entries`` and ``parts`` listed."""
    head = manifest.model_dump(mode="json", exclude={"entries", "created_at"})
    rest = canonical_json(head)  # b'{"format_version":...}': keys after "entries"
    if parts:  # "parts" sorts between "parents" and "world_size", the last key
        listed = ",".join([ref_text(p) for p in parts]).encode("utf-8")
        world = b',"world_size":'
        at = rest.rindex(world)
        rest = rest[:at] + b',"parts":[' + listed + b"]" + rest[at:]
    return b"".join(
        [
            b'{"created_at":',
            canonical_json(manifest.created_at),
            b',"entries":{',
            body,
            b"},",
            rest[1:],
        ]
    )
