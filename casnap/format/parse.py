"""Parsing untrusted repository documents: manifests, the config, refs and damage records.

Everything read from a store is untrusted: :func:`parse_manifest` checks
size, hash, version, structure and the arithmetic of every entry before a
caller allocates or reads; every failure is a ``ManifestValidationError``
(or ``UnsupportedFormatError`` for a version this casnap cannot read).
:func:`json_schemas` exports the models' JSON Schemas into ``schema/``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from casnap.errors import ManifestValidationError, UnsupportedFormatError
from casnap.format.entries import ChunkRef, Entry, FormatModel
from casnap.format.json_text import load_json
from casnap.format.manifest import MAX_ENTRIES, Manifest, Part, check_empty_shards
from casnap.format.names import check_hash, hash_bytes
from casnap.format.records import DamageRecord, Ref, RepoConfig, TagRecord
from casnap.format.versions import FORMAT_VERSION
from casnap.python_gc import python_gc_paused

MAX_MANIFEST_BYTES = 1 << 30
# Refs, the config, tags, leases, gc records and damage records are a few
# hundred bytes; a reader refuses anything larger before reading it.
MAX_RECORD_BYTES = 64 << 10


def check_version(version: object, what: str) -> None:
    """Refuse a document of any version but ``FORMAT_VERSION``: there is one format."""
    if version != FORMAT_VERSION or not isinstance(version, str):
        shown = version[:40] if isinstance(version, str) else repr(version)[:40]
        raise UnsupportedFormatError(
            f"{what} has format version {shown}; this casnap reads format "
            f"{FORMAT_VERSION} only (a newer casnap wrote it, or it is not a casnap file)"
        )


def _parse(
    model: type[FormatModel],
    data: bytes,
    what: str,
    *,
    versioned: bool = False,
) -> Any:
    raw = load_json(data, what)
    if versioned and isinstance(raw, dict) and "format_version" not in raw:
        # A default would read any document as the current version (docs/format.md).
        raise ManifestValidationError(
            f"{what} has no format_version; every casnap manifest and config names its "
            "format, so this is not one (or it is damaged)",
            what,
        )
    if isinstance(raw, dict) and "format_version" in raw:
        check_version(raw["format_version"], what)
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = " at " + ".".join(str(p) for p in first["loc"]) if first["loc"] else ""
        raise ManifestValidationError(
            f"{what} is malformed{where}: {first['msg']} ({exc.error_count()} problem(s))",
            what,
        ) from exc


PartLoader = Callable[[ChunkRef], dict[str, Entry]]  # a part's entries, checked (parse_part)


@python_gc_paused()  # a model or more per entry, no cycles (casnap.python_gc)
def parse_manifest(data: bytes, name: str, load_part: PartLoader | None = None) -> Manifest:
    """Validate an untrusted manifest; ``name`` is its hash, checked against the bytes.

    ``load_part`` gives the entries of each part the manifest lists (docs/format.md,
    "Manifest parts"), called only once the parts' declared sizes passed the limits.
    """
    check_hash(name, "manifest name")
    what = f"manifest {name}"
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestValidationError(f"{what} is larger than {MAX_MANIFEST_BYTES} bytes", name)
    if hash_bytes(data) != name:
        raise ManifestValidationError(f"{what}: blake3 digest mismatch (corrupt)", name)
    manifest: Manifest = _parse(Manifest, data, what, versioned=True)
    size = len(data) + sum(p.size for p in manifest.parts)
    if manifest.parts:
        manifest = _with_parts(manifest, size, what, load_part)
    try:
        manifest = manifest.expanded(size)
    except ValueError as exc:
        raise ManifestValidationError(f"{what} is malformed at rank_groups: {exc}", name) from exc
    return manifest


def manifest_part_refs(data: bytes, name: str) -> list[ChunkRef]:
    """The parts an untrusted manifest lists, its parts not read (what repair restores
    when a part is lost: the manifest cannot be read whole without it)."""
    check_hash(name, "manifest name")
    if len(data) > MAX_MANIFEST_BYTES or hash_bytes(data) != name:
        raise ManifestValidationError(f"manifest {name} is too large or corrupt", name)
    manifest: Manifest = _parse(Manifest, data, f"manifest {name}", versioned=True)
    return manifest.parts


def _with_parts(manifest: Manifest, size: int, what: str, load: PartLoader | None) -> Manifest:
    """``manifest`` with the entries of its parts merged in, every limit checked first."""
    if size > MAX_MANIFEST_BYTES:
        raise ManifestValidationError(
            f"{what} and its parts declare {size} bytes, more than {MAX_MANIFEST_BYTES}", what
        )
    if load is None:
        raise ManifestValidationError(f"{what} lists parts: read it from its repository", what)
    entries = dict(manifest.entries)
    for ref in manifest.parts:
        held = load(ref)
        before = len(entries)
        entries.update(held)
        if len(entries) != before + len(held):
            raise ManifestValidationError(f"{what}: part {ref.hash} repeats a key", what)
        if len(entries) > MAX_ENTRIES:
            raise ManifestValidationError(f"{what}: more than {MAX_ENTRIES} entries", what)
    try:
        check_empty_shards(manifest.world_size, entries)
    except ValueError as exc:
        raise ManifestValidationError(f"{what} is malformed in a part: {exc}", what) from exc
    return manifest.model_copy(update={"entries": entries})


@python_gc_paused()
def parse_part(data: bytes, ref: ChunkRef) -> dict[str, Entry]:
    """The entries of an untrusted part, whose bytes were checked against ``ref`` (its
    hash and size: casnap.format.codec.decode)."""
    part: Part = _parse(Part, data, f"manifest part {ref.hash}")
    return part.entries


def parse_config(data: bytes) -> RepoConfig:
    what = "repository config .casnap/config.json"
    config: RepoConfig = _parse(RepoConfig, data, what, versioned=True)
    return config


def parse_ref(data: bytes, name: str) -> Ref:
    ref: Ref = _parse(Ref, data, f"ref {name!r}")
    return ref


def parse_damage_record(data: bytes, key: str) -> DamageRecord:
    record: DamageRecord = _parse(DamageRecord, data, f"damage record {key!r}")
    return record


def json_schemas() -> dict[str, dict[str, Any]]:
    """The JSON Schemas exported into ``schema/`` (see tools/export_schema.py)."""
    return {
        "manifest-v1.schema.json": Manifest.model_json_schema(),
        "manifest-part-v1.schema.json": Part.model_json_schema(),
        "config-v1.schema.json": RepoConfig.model_json_schema(),
        "ref-v1.schema.json": Ref.model_json_schema(),
        "tag-v1.schema.json": TagRecord.model_json_schema(),
        "damage-v1.schema.json": DamageRecord.model_json_schema(),
    }
