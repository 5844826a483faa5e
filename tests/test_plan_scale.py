"""Planning a distributed take for a simulated world from metadata (benchmarks/plan_scale.py).

The coordinator's step (casnap/distributed/coordinate.py) runs on the planning
messages that 64 HSDP ranks of a (2-layer) Llama-70B-shaped model would send;
the properties asserted are what a job of any size relies on: every unique
chunk is written exactly once, by a rank that holds it, the writing is
balanced, and the manifest holds every rank's keys without repeating what
the ranks share. Timings belong to the benchmark, not here.
"""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path

import pytest

from casnap.distributed.coordinate import assemble_entries, coordinate, manifest_of
from casnap.distributed.plan_cache import Gathered, join, message_of
from casnap.errors import ManifestValidationError
from casnap.format.codec import HEADER_SIZE
from casnap.format.entries import ChunkRef, ShardedEntry
from casnap.format.manifest_bytes import serialize
from casnap.format.names import hash_bytes
from casnap.format.parse import parse_manifest
from casnap.take.plan import RankPlan, TensorPlan, chunks_of

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import plan_scale  # noqa: E402

CHUNK_MIB = 4.0


def _world(ranks: int, extra: bool = False) -> tuple[list[bytes], list[RankPlan]]:
    """Each rank's message as the gather carries it, and its plan (for independent checks).

    ``extra``: every rank also holds a DDP-replicated tensor and a tensor of its own.
    """
    chunk = int(CHUNK_MIB * (1 << 20))
    shapes = plan_scale.llama70b_shapes(layers=2)
    boxes = plan_scale.shard_boxes(shapes, chunk)
    plans = []
    for r in range(ranks):
        plan = plan_scale.rank_plan(r, boxes, shapes, chunk)
        if extra:
            shared = TensorPlan("float32", (3,), True, (("a" * 64, 12),))
            own = TensorPlan("float32", (2 * r + 1,), False, ((f"{r:064x}", 8 * r + 4),))
            plan.entries.update({f"{r}/ddp/w": shared, f"{r}/own/w": own})
        plans.append(plan)
    blobs = [pickle.dumps(message_of(p), pickle.HIGHEST_PROTOCOL) for p in plans]
    return blobs, plans


def _plan(blobs: list[bytes]):
    messages = [pickle.loads(b) for b in blobs]
    return coordinate(Gathered(messages, [m.structure for m in messages]), "warn")


@pytest.mark.parametrize("extra", [False, True])
def test_every_chunk_is_written_once_by_a_holder_and_the_writing_is_balanced(extra: bool) -> None:
    blobs, plans = _world(64, extra)
    planned = _plan(blobs)
    holders: dict[str, set[int]] = {}
    sizes: dict[str, int] = {}
    for p in plans:  # from every rank's own plan, not from the coordinator's grouping
        for e in p.entries.values():
            for h, n in chunks_of(e):
                holders.setdefault(h, set()).add(p.rank)
                sizes[h] = n
    assert set(planned.writers) == set(holders)  # every chunk, once (a dict: one writer)
    assert all(planned.writers[h] in holders[h] for h in holders)
    load = [0] * 64
    for h, r in planned.writers.items():
        load[r] += sizes[h]
    assert load == planned.load and sum(load) == sum(sizes.values())
    assert min(load) > 0 and max(load) / (sum(load) / 64) <= 1.05
    # Replicas share one body: 8 shard positions (+ one per rank holding its own tensor).
    assert len(planned.plans) == (64 if extra else 8)


def test_manifest_holds_every_key_and_writes_shared_entries_once() -> None:
    sizes = {}
    for ranks in (8, 64):
        blobs, plans = _world(ranks)
        planned = _plan(blobs)
        refs = {
            h: ChunkRef(hash=h, size=n, length=HEADER_SIZE + n) for h, n in planned.sizes.items()
        }
        entries = assemble_entries(planned, refs)
        assert set(entries) == {k for p in plans for k in p.entries}
        manifest = manifest_of(entries, ranks, [], {"step": 1})
        data = serialize(manifest)
        sizes[ranks] = len(data)
        parsed = parse_manifest(data, hash_bytes(data))
        assert parsed.entries == entries and parsed.format_version == "1.0"
        union = parsed.entries[f"{ranks - 1}/model/output.weight"]
        assert isinstance(union, ShardedEntry) and len(union.shards) == 8
        assert union is parsed.entries["0/model/output.weight"]  # one object for all ranks
        schema = json.loads((ROOT / "schema" / "manifest-v1.schema.json").read_text())
        import jsonschema

        jsonschema.validate(json.loads(data), schema)
    assert sizes[64] < 1.1 * sizes[8]  # grows with the model, not with ranks x model


def test_what_a_rank_sends_does_not_grow_with_the_world() -> None:
    small, _ = _world(8)
    large, plans = _world(64)
    assert len(small[3]) == len(large[3])  # rank 3's message: its own plan only
    keys = len(plans[63].entries)
    assert len(large[63]) - len(large[3]) <= 2 * keys  # a longer rank number in each key


def _grouped_json(world_size: int, ranks: list[list[int]], twice: bool = False) -> bytes:
    entry = {"kind": "primitive", "type": "int", "value": 1}
    doc = {
        "format_version": "1.0",
        "created_at": "2026-11-24T00:00:00+00:00",
        "world_size": world_size,
        "parents": [],
        "metadata": {},
        "entries": {"0/a": entry} if twice else {},
        "rank_groups": [{"ranks": ranks, "entries": {"a": entry}}],
    }
    return json.dumps(doc).encode()


def test_rank_groups_from_an_untrusted_manifest_are_checked() -> None:
    good = _grouped_json(4, [[0, 3]])
    assert set(parse_manifest(good, hash_bytes(good)).entries) == {"0/a", "1/a", "2/a", "3/a"}
    bad_ones = [
        _grouped_json(4, [[0, 4]]),  # rank 4 in a world of 4
        _grouped_json(4, [[2, 1]]),  # an empty range
        _grouped_json(4, [[0, 3]], twice=True),  # 0/a given as an entry and by the group
        _grouped_json(1 << 40, [[0, (1 << 40) - 1]]),  # a trillion keys: refused, not built
    ]
    for bad in bad_ones:
        with pytest.raises(ManifestValidationError, match="rank_groups"):
            parse_manifest(bad, hash_bytes(bad))


def test_join_of_a_decoded_structure_gives_the_plan_back() -> None:
    blobs, plans = _world(16)
    message = pickle.loads(blobs[9])
    assert join(pickle.loads(message.structure), message.content) == plans[9]
