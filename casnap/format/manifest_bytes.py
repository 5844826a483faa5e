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
from collections.abc import Mapping
from typing import Any, TypeVar

from casnap.format.entries import ChunkRef, Entry, Quantization, TensorEntry
from casnap.format.grouped_bytes import grouped_bytes, ref_text
from casnap.format.json_text import canonical_json
from casnap.format.manifest import MAX_KEY_LENGTH, Dumped, Manifest

M = TypeVar("M", ChunkRef, TensorEntry)
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
    out = EntryTexts(manifest.entries)
    for key, entry in manifest.entries.items():
        text = old_texts.get(key) if old_entries.get(key) is entry else None
        out[key] = text if text is not None else entry_text(key, entry)
    return out


class EntryTexts(dict[str, str]):
    """:func:`entry_texts`' result: each key's text, and the ``entries`` member they make
    up, joined once (an unchanged re-take reuses the parent's texts, so the join too)."""

    def __init__(self, of: Mapping[str, Entry]) -> None:
        super().__init__()
        self.of = of  # the entries they are the texts of
        self._body: bytes | None = None

    def body(self) -> bytes:
        """The texts in key order, comma-separated: a manifest's ``entries`` members."""
        if self._body is None:
            self._body = ",".join([self[k] for k in sorted(self)]).encode("utf-8")
        return self._body


def serialize(manifest: Manifest, texts: Mapping[str, str] | None = None) -> bytes:
    """The canonical JSON bytes of ``manifest``, what its name hashes (``texts``: its
    entry texts, :func:`entry_texts`, reused from the last take where unchanged).

    A distributed take's manifest (more than one rank) is
    written with ``rank_groups`` (:mod:`casnap.format.grouped_bytes`); any other as
    :func:`manifest_bytes` assembles it.
    """
    if manifest.writes_rank_groups():  # its ranks share entry objects
        return grouped_bytes(manifest, *manifest.rank_groups_split())
    return manifest_bytes(manifest, texts)


def manifest_bytes(manifest: Manifest, texts: Mapping[str, str] | None = None) -> bytes:
    """``canonical_json(manifest.model_dump(mode="json"))``, assembled from ``texts``
    (:func:`entry_texts`, computed here when not given)."""
    if texts is None:
        texts = entry_texts(manifest)
    head = manifest.model_dump(mode="json", exclude={"entries", "created_at"})
    rest = canonical_json(head)  # b'{"format_version":...}': keys after "entries"
    if isinstance(texts, EntryTexts) and texts.of is manifest.entries:
        body = texts.body()
    else:
        body = ",".join([texts[k] for k in sorted(manifest.entries)]).encode("utf-8")
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
