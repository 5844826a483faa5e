"""Sharded entries that ask for more work than they hold are refused when read (issue #41).

A sharded entry's shards tile its tensor: together they hold each element
once, and a rank's empty local shard is at most one per rank. rank_groups may
expand to no more keys and shard records than a fixed bound plus a multiple
of the manifest's bytes. Each is a ``ManifestValidationError`` naming the entry.
"""

from __future__ import annotations

import json

import pytest

from casnap.errors import ManifestValidationError
from casnap.format.names import hash_bytes
from casnap.format.parse import parse_manifest

H = "a" * 64


def _shard(off: int, size: int, cs: int = 4096) -> dict:
    chunks = [{"hash": H, "size": size * 4, "length": 56 + size * 4}] if size else []
    return {"offsets": [off], "sizes": [size], "chunk_size": cs, "chunks": chunks}


def _manifest(shards: list[dict], shape: list[int], **extra: object) -> bytes:
    entry = {"kind": "sharded", "layout": "dtensor", "dtype": "float32", "shape": shape}
    doc = {
        "format_version": "1.1",
        "created_at": "t",
        "entries": {"0/m/w": {**entry, "shards": shards}},
    }
    doc.update(extra)
    return json.dumps(doc).encode()


def _parse(data: bytes):
    return parse_manifest(data, hash_bytes(data))


def test_shards_that_tile_the_tensor_are_accepted():
    m = _parse(_manifest([_shard(0, 16), _shard(16, 16), _shard(32, 0)], [32], world_size=4))
    assert len(m.entries["0/m/w"].shards) == 3


@pytest.mark.parametrize(
    ("shards", "words"),
    [
        ([_shard(0, 16), _shard(0, 16), _shard(16, 16)], "overlap"),  # a duplicate
        ([_shard(0, 16)], "16 of the tensor's 32"),  # a gap
        ([_shard(0, 32)] + [_shard(i, 0) for i in range(5)], "5 empty shards"),
    ],
)
def test_shards_that_overlap_leave_gaps_or_are_empty_beyond_the_ranks_are_refused(shards, words):
    with pytest.raises(ManifestValidationError, match=words) as info:
        _parse(_manifest(shards, [32], world_size=2))
    assert "0/m/w" in str(info.value)


def test_many_shards_beside_a_huge_declared_tensor_are_refused():
    # The tensor declares 17,179,869,192 bytes; its 4,096 small shards hold 64 KiB of it.
    shards = [_shard(i * 4, 4) for i in range(4096)]
    with pytest.raises(ManifestValidationError, match="0/m/w.*16384 of the tensor's 4294967298"):
        _parse(_manifest(shards, [4294967298]))


def test_rank_groups_expand_to_at_most_a_multiple_of_the_manifest():
    def grouped(world: int) -> bytes:
        entry = {"kind": "primitive", "type": "int", "value": 1}
        group = {"ranks": [[0, world - 1]], "entries": {"m/a": entry}}
        doc = {"format_version": "1.3", "created_at": "t", "world_size": world}
        return json.dumps({**doc, "entries": {}, "rank_groups": [group]}).encode()

    assert len(_parse(grouped(4096)).entries) == 4096
    with pytest.raises(ManifestValidationError, match="more than the 1.* a manifest of"):
        _parse(grouped(1 << 24))  # 16 M keys from 200 bytes, refused before any is made
