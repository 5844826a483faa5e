"""Manifests are named by the hash of their bytes: serialization is pinned byte for byte.

A change in how pydantic (or casnap) dumps a manifest would rename every
manifest written from then on and break dedup of manifests; this test fails
first. ``tests/data/manifest-v1.1.json`` holds the expected bytes.
"""

from __future__ import annotations

from pathlib import Path

from casnap.format.manifest import Dumped, Manifest, RepoConfig, canonical_json, parse_manifest
from casnap.format.names import hash_bytes

DATA = Path(__file__).parent / "data"
H = [f"{i:064x}" for i in range(1, 9)]


def every_kind() -> Manifest:
    """One manifest holding every entry kind, chunk location and JSON value type."""
    loose = {"hash": H[0], "size": 4096, "length": 4096 + 56}
    packed = {"hash": H[1], "size": 40, "pack": H[2], "offset": 112, "length": 96}
    return Manifest.model_validate({
        "format_version": "1.1",
        "created_at": "2026-11-24T00:00:00.000000+00:00",
        "world_size": 2,
        "parents": [H[3]],
        "metadata": {"step": 100, "loss": 0.25, "tags": ["best", "ünïcode"], "nested": {"a": None}},
        "entries": {
            "0/m": {"kind": "container", "type": "dict", "keys": ["w", "b", "s", 3]},
            "0/m/w": {"kind": "tensor", "dtype": "float32", "shape": [1024], "chunk_size": 4096,
                      "chunks": [loose], "replicated": True},
            "0/m/b": {"kind": "tensor", "dtype": "bfloat16", "shape": [4, 5], "chunk_size": 4096,
                      "chunks": [packed]},
            "0/m/s": {"kind": "sharded", "layout": "dtensor", "dtype": "float32", "shape": [2048],
                      "shards": [{"offsets": [0], "sizes": [1024], "chunk_size": 4096,
                                  "chunks": [loose]},
                                 {"offsets": [1024], "sizes": [1024], "chunk_size": 4096,
                                  "chunks": [{**loose, "hash": H[4]}]}]},
            "0/m/3": {"kind": "primitive", "type": "float", "value": "0x1.8000000000000p+1"},
            "0/p": {"kind": "container", "type": "list", "keys": [0, 1, 2, 3]},
            "0/p/0": {"kind": "primitive", "type": "int", "value": 12345678901234567890},
            "0/p/1": {"kind": "primitive", "type": "bool", "value": True},
            "0/p/2": {"kind": "primitive", "type": "none", "value": None},
            "0/p/3": {"kind": "primitive", "type": "str", "value": "a/b%c"},
            "0/o": {"kind": "object", "serializer": "pickle", "type_name": "builtins.set",
                    "size": 40, "chunk_size": 4096, "chunks": [packed]},
        },
    })  # fmt: skip


def test_manifest_bytes_and_name_are_pinned():
    manifest = every_kind()
    expected = (DATA / "manifest-v1.1.json").read_bytes()
    assert manifest.to_bytes() == expected
    assert hash_bytes(expected) == (DATA / "manifest-v1.1.name").read_text().strip()
    assert parse_manifest(expected, hash_bytes(expected)) == manifest


def test_reusing_a_parent_dump_gives_the_same_bytes():
    parent = every_kind()
    dumped = Dumped(parent, parent.to_jsonable())
    child = parent.model_copy(update={"parents": [H[5]]})  # shares every entry object
    assert canonical_json(child.to_jsonable(dumped)) == child.to_bytes()
    assert child.to_bytes() == canonical_json(child.model_dump(mode="json"))


def test_config_bytes_are_pinned():
    config = RepoConfig(repo_id="0" * 32, chunk_size=4 << 20,
                        created_at="2026-11-24T00:00:00.000000+00:00")  # fmt: skip
    from casnap.repo.repository import config_bytes

    stored = (
        b'{"chunk_size":4194304,"created_at":"2026-11-24T00:00:00.000000+00:00",'
        b'"format_version":"1.1","hash":"blake3","repo_id":"00000000000000000000000000000000"'
    )
    # A repository a take creates: the same bytes as before `shared` existed.
    assert config_bytes(config) == stored + b"}"
    # One created to be shared (casnap init) says so.
    assert config_bytes(config.model_copy(update={"shared": True})) == stored + b',"shared":true}'
