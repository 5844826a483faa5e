"""Manifests are named by the hash of their bytes: serialization is pinned byte for byte.

A change in how pydantic (or casnap) dumps a manifest would rename every
manifest written from then on and break dedup of manifests; this test fails
first. The golden repository's manifests (tests/data/golden) hold the expected bytes.
"""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from casnap.format.entries import ChunkRef, TensorEntry
from casnap.format.json_text import canonical_json
from casnap.format.manifest import Dumped, Manifest
from casnap.format.manifest_bytes import (
    entry_texts,
    serialize,
    trusted_chunk_ref,
    trusted_tensor_entry,
)
from casnap.format.names import hash_bytes
from casnap.format.parse import parse_manifest
from casnap.format.records import RepoConfig
from casnap.repo.repository import RepoStorage

DATA = Path(__file__).parent / "data"
H = [f"{i:064x}" for i in range(1, 9)]


def every_kind() -> Manifest:
    """One manifest holding every entry kind, chunk location and JSON value type."""
    loose = {"hash": H[0], "size": 4096, "length": 4096 + 56}
    packed = {"hash": H[1], "size": 40, "pack": H[2], "offset": 112, "length": 96}
    return Manifest.model_validate(
        {
            "format_version": "1.0",
            "created_at": "2026-11-24T00:00:00.000000+00:00",
            "world_size": 2,
            "parents": [H[3]],
            "metadata": {
                "step": 100,
                "loss": 0.25,
                "tags": ["best", "ünïcode"],
                "nested": {"a": None},
            },
            "entries": {
                "0/m": {"kind": "container", "type": "dict", "keys": ["w", "b", "s", 3]},
                "0/m/w": {
                    "kind": "tensor",
                    "dtype": "float32",
                    "shape": [1024],
                    "chunk_size": 4096,
                    "chunks": [loose],
                    "replicated": True,
                },
                "0/m/b": {
                    "kind": "tensor",
                    "dtype": "bfloat16",
                    "shape": [4, 5],
                    "chunk_size": 4096,
                    "chunks": [packed],
                },
                "0/m/s": {
                    "kind": "sharded",
                    "layout": "dtensor",
                    "dtype": "float32",
                    "shape": [2048],
                    "shards": [
                        {"offsets": [0], "sizes": [1024], "chunk_size": 4096, "chunks": [loose]},
                        {
                            "offsets": [1024],
                            "sizes": [1024],
                            "chunk_size": 4096,
                            "chunks": [{**loose, "hash": H[4]}],
                        },
                    ],
                },
                "0/m/3": {"kind": "primitive", "type": "float", "value": "0x1.8000000000000p+1"},
                "0/p": {"kind": "container", "type": "list", "keys": [0, 1, 2, 3]},
                "0/p/0": {"kind": "primitive", "type": "int", "value": 12345678901234567890},
                "0/p/1": {"kind": "primitive", "type": "bool", "value": True},
                "0/p/2": {"kind": "primitive", "type": "none", "value": None},
                "0/p/3": {"kind": "primitive", "type": "str", "value": "a/b%c"},
                "0/o": {
                    "kind": "object",
                    "serializer": "pickle",
                    "type_name": "builtins.set",
                    "size": 40,
                    "chunk_size": 4096,
                    "chunks": [packed],
                },
            },
        }
    )


def test_manifest_bytes_and_name_are_pinned():
    kinds = set()
    parts = RepoStorage.open(str(DATA / "golden")).parts
    for f in sorted((DATA / "golden" / ".casnap" / "manifests").glob("*/*")):
        expected = f.read_bytes()
        manifest = parse_manifest(expected, f.name, parts.load)
        assert serialize(manifest) == expected and hash_bytes(expected) == f.name
        kinds |= {e.kind for e in manifest.entries.values()}
    assert kinds == {"tensor", "primitive", "container", "object", "sharded"}
    manifest = every_kind()
    data = serialize(manifest)
    assert data == canonical_json(manifest.to_jsonable())
    assert parse_manifest(data, hash_bytes(data)) == manifest


def test_reusing_a_parent_dump_gives_the_same_bytes():
    parent = every_kind()
    dumped = Dumped(parent, entry_texts(parent))
    child = parent.model_copy(update={"parents": [H[5]]})  # shares every entry object
    texts = entry_texts(child, dumped)
    assert all(texts[k] is dumped.texts[k] for k in child.entries)  # reused, not re-dumped
    assert serialize(child, texts) == serialize(child)
    assert serialize(child) == canonical_json(child.model_dump(mode="json"))


def test_config_bytes_are_pinned():
    config = RepoConfig(
        repo_id="0" * 32, chunk_size=4 << 20, created_at="2026-11-24T00:00:00.000000+00:00"
    )
    from casnap.repo.repository import config_bytes

    stored = (
        b'{"chunk_size":4194304,"created_at":"2026-11-24T00:00:00.000000+00:00",'
        b'"format_version":"1.0","hash":"blake3","repo_id":"00000000000000000000000000000000"'
    )
    # A repository a take creates: the same bytes as before `shared` existed.
    assert config_bytes(config) == stored + b"}"
    # One created to be shared (casnap init) says so.
    assert config_bytes(config.model_copy(update={"shared": True})) == stored + b',"shared":true}'


_hashes = st.sampled_from(H)
_refs = st.builds(
    lambda h, size, pack, offset: {
        "hash": h,
        "size": size,
        "pack": pack,
        "offset": offset if pack else 0,
        "length": 56 + size,
    },
    _hashes,
    st.integers(0, 1 << 20),
    st.none() | _hashes,
    st.integers(0, 1 << 40),
)
_tensors = st.builds(
    lambda dtype, shape, cs, chunks, rep: {
        "kind": "tensor",
        "dtype": dtype,
        "shape": shape,
        "chunk_size": cs,
        "chunks": chunks,
        "replicated": rep,
    },
    st.sampled_from(["float32", "bfloat16", "int4", "float8_e4m3fn", "bool"]),
    st.lists(st.integers(0, 1 << 33), max_size=4),
    st.integers(1, 1 << 30),
    st.lists(_refs, max_size=3),
    st.booleans(),
)


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.text(min_size=1, max_size=12), _tensors, max_size=6), st.text())
def test_assembled_bytes_equal_canonical_json(entries, created_at):
    """Keys with quotes, controls or any unicode, and every tensor field, serialize as
    canonical_json does; the entries' validators are skipped, so ``construct`` is used."""
    manifest = Manifest.model_construct(
        created_at=created_at,
        entries={
            k: TensorEntry.model_construct(
                **{**e, "chunks": [ChunkRef.model_construct(**c) for c in e["chunks"]]}
            )
            for k, e in entries.items()
        },
    )
    expected = canonical_json(manifest.model_dump(mode="json"))
    assert serialize(manifest) == expected
    assert serialize(manifest, entry_texts(manifest)) == expected


def test_trusted_models_equal_validated_ones():
    ref = trusted_chunk_ref(H[0], 40, H[1], 112, 96)
    valid = ChunkRef(hash=H[0], size=40, pack=H[1], offset=112, length=96)
    assert ref == valid and ref.model_dump() == valid.model_dump()
    entry = trusted_tensor_entry("float32", [10], 4096, [ref], True, None)
    valid_entry = TensorEntry(
        dtype="float32",
        shape=[10],
        chunk_size=4096,
        chunks=[valid],
        replicated=True,
        quantized=None,
    )
    assert entry == valid_entry
    assert entry.model_dump(mode="json") == valid_entry.model_dump(mode="json")
    assert entry.model_fields_set == valid_entry.model_fields_set
