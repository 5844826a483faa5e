"""A distributed take's manifest bytes, assembled per entry object (casnap/format/grouped_bytes.py).

What is written must stay ``canonical_json(manifest.to_jsonable())`` of the
same entries grouped from their keys: these tests build a small world's
manifest through the coordinator's own steps (the planning messages, the
replica grouping, the entries, the manifest) with every kind of entry and
chunk reference, and compare the bytes with that reference dump.
"""

from __future__ import annotations

import copy
import gc
import pickle

import pytest

from casnap.distributed.coordinate import assemble_entries, coordinate, manifest_of
from casnap.distributed.plan_cache import Gathered, message_of
from casnap.format.codec import HEADER_SIZE
from casnap.format.entries import (
    ChunkRef,
    ContainerEntry,
    PrimitiveEntry,
    Quantization,
    ShardedEntry,
    TensorEntry,
)
from casnap.format.json_text import canonical_json
from casnap.format.manifest import GroupedEntries, Manifest
from casnap.format.manifest_bytes import serialize
from casnap.format.names import hash_bytes
from casnap.format.parse import parse_manifest
from casnap.take.plan import ObjectPlan, RankPlan, ShardedPlan, ShardPlan, TensorPlan

WORLD = 6
POSITIONS = 3  # shard positions; ranks p and p + 3 hold the same box


def _h(*parts: object) -> str:
    return hash_bytes("/".join(map(str, parts)).encode())


def _plan(rank: int) -> RankPlan:
    """Ranks 0 and 3 plan alike (one body); 4 and 5 also hold a tensor of their own;
    rank 4's seed differs from its replicas' (a primitive outside the body)."""
    p = rank % POSITIONS
    box = ShardPlan((2 * p, 0), (2, 4), ((_h("w", p, 0), 16), (_h("w", p, 1), 16)))
    quant = Quantization(dtype="qint8", qscheme="per_tensor_affine", scale="0x1.0p-3", zero_point=0)
    entries: dict[str, object] = {
        f"{rank}/model": ContainerEntry(type="dict", keys=["w", 'wé"q', 3]),
        f"{rank}/model/w": ShardedPlan("dtensor", "float32", (6, 4), (box,)),
        f'{rank}/model/wé"q': TensorPlan("float32", (3,), True, ((_h("ddp"), 12),)),
        f"{rank}/model/3": TensorPlan("int8", (4,), False, ((_h("q"), 4),), quant),
        f"{rank}/extra": ObjectPlan("builtins.dict", 20, ((_h("o", 0), 16), (_h("o", 1), 4))),
        f"{rank}/train/step": PrimitiveEntry(type="int", value=7),
        f"{rank}/train/seed": PrimitiveEntry(type="int", value=2 if rank == 4 else 1),
        f"{rank}/train/lr": PrimitiveEntry(type="float", value=(0.5).hex()),
    }
    if rank >= 4:
        entries[f"{rank}/own/x"] = TensorPlan("float32", (2,), False, ((_h("own", rank), 8),))
    return RankPlan(rank, 16, entries)  # type: ignore[arg-type]


def _refs(sizes: dict[str, int]) -> dict[str, ChunkRef]:
    """Loose chunks, chunks in a pack, and one delta against a chunk of an older snapshot."""
    pack = _h("pack")
    refs = {}
    for i, (h, n) in enumerate(sorted(sizes.items())):
        if i % 2:
            refs[h] = ChunkRef(hash=h, size=n, pack=pack, offset=100 * i, length=HEADER_SIZE + n)
        else:
            refs[h] = ChunkRef(hash=h, size=n, length=HEADER_SIZE + n)
    base = ChunkRef(hash=_h("older"), size=12, length=HEADER_SIZE + 12)
    refs[_h("ddp")] = ChunkRef(hash=_h("ddp"), size=12, length=HEADER_SIZE + 5, base=base)
    return refs


def _manifest() -> Manifest:
    blobs = [pickle.dumps(message_of(_plan(r))) for r in range(WORLD)]
    messages = [pickle.loads(b) for b in blobs]
    planned = coordinate(Gathered(messages, [m.structure for m in messages]), "warn")
    assert [len(ms) for ms in planned.members] == [2, 1, 1, 1, 1]  # ranks 0 and 3 share a body
    entries = assemble_entries(planned, _refs(planned.sizes))
    return manifest_of(entries, WORLD, [_h("parent")], {"step": 7, "note": "ünïcode"})


def _reference(manifest: Manifest) -> bytes:
    """What a manifest of the same entries writes when grouped from its keys and dumped
    by pydantic: a plain dict of entries carries no grouping."""
    plain = manifest.model_copy(update={"entries": dict(manifest.entries)})
    return canonical_json(plain.to_jsonable())


def test_grouped_bytes_equal_the_reference_dump() -> None:
    manifest = _manifest()
    assert isinstance(manifest.entries, GroupedEntries)
    data = serialize(manifest)
    assert data == _reference(manifest)
    doc = manifest.to_jsonable()
    assert canonical_json(doc) == data
    # What was exercised: a group of every rank (the sharded entry: one object), a group
    # of one body's members (ranks 0 and 3), keys of one rank (rank 4's own seed, the
    # other bodies), a delta, packed chunks, a quantized tensor.
    assert manifest.format_version == "1.0"
    groups = {str(g["ranks"]): set(g["entries"]) for g in doc["rank_groups"]}
    assert groups[str([[0, WORLD - 1]])] == {"model/w"}
    assert groups[str([[0, 0], [3, 3]])] >= {"model", 'model/wé"q', "train/seed", "model/3"}
    assert {"1/model", "4/train/seed", "4/train/step", "5/own/x"} <= set(doc["entries"])
    assert "3/train/seed" not in doc["entries"]
    parsed = parse_manifest(data, hash_bytes(data))
    assert parsed.entries == manifest.entries
    shared = parsed.entries["5/model/w"]
    assert isinstance(shared, ShardedEntry) and len(shared.shards) == POSITIONS
    ddp = parsed.entries['2/model/wé"q']
    assert isinstance(ddp, TensorEntry) and ddp.chunks[0].base is not None
    assert parsed.entries["4/train/seed"] == PrimitiveEntry(type="int", value=2)


def test_copies_of_the_manifest_write_the_same_bytes() -> None:
    manifest = _manifest()
    data = serialize(manifest)
    for other in (
        pickle.loads(pickle.dumps(manifest)),
        copy.deepcopy(manifest),
        manifest.model_copy(),
    ):
        assert serialize(other) == data


def test_entries_changed_after_grouping_are_grouped_again() -> None:
    manifest = _manifest()
    entries = manifest.entries
    assert isinstance(entries, GroupedEntries)
    entries["9/late"] = PrimitiveEntry(type="int", value=9)  # nothing of casnap does this
    changed = manifest.model_copy(update={"world_size": 10})
    data = serialize(changed)
    assert data == _reference(changed)
    assert parse_manifest(data, hash_bytes(data)).entries["9/late"].value == 9  # type: ignore[union-attr]


@pytest.mark.parametrize("enabled", [True, False])
def test_the_collector_is_left_as_it_was(enabled: bool) -> None:
    was = gc.isenabled()
    try:
        gc.enable() if enabled else gc.disable()
        _manifest()
        assert gc.isenabled() is enabled
    finally:
        gc.enable() if was else gc.disable()


def test_a_grouped_manifests_summary_counts_every_key_and_walks_each_object_once() -> None:
    # The index summary (log/du) of a rank-grouped manifest: the same totals as
    # walking every key, from each shared entry object read once, as built by the
    # coordinator and as parsed back from its bytes.
    from casnap.index.summaries import summarize

    built = _manifest()
    for m in (built, parse_manifest(serialize(built), hash_bytes(serialize(built)))):
        refs = m.chunk_refs()
        s = summarize("m", m)
        assert s.logical_bytes == sum(r.size for r in refs) > 0
        assert s.chunk_refs == len(refs)
        assert s.spans == {(r.pack or r.hash, r.offset, r.length) for r in m.stored_refs()}
        distinct = m.distinct_chunk_refs()
        assert len(distinct) < len(m.entries)  # objects are shared across ranks' keys
        assert sum(n for _, n in distinct) == len(m.entries)
