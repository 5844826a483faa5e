"""The committed golden repository still reads bit-exact.

tests/data/golden is format 1.0, the one format: ``first`` and ``second`` were
taken by 2 gloo ranks on CPU with sharded entries (DTensor Shard(0), uneven
Shard(1) and Replicate, a ShardedTensor), replicated plain tensors and
per-rank state (a quantized tensor, a pickled object); ``solo-1`` and
``solo-2`` by one process, ``solo-2`` holding a delta of depth 1, their
entries in a part each.
tools/make_golden.py wrote it once; nothing here writes into tests/data
(every test works on a copy).
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch
from helpers import tensor_entry

from casnap import Repository, Snapshot, StateDict
from casnap.cli import main as cli_main
from casnap.errors import PickleNotAllowedError, UnsupportedFormatError
from casnap.format.entries import ShardedEntry
from casnap.format.json_text import canonical_json
from casnap.format.manifest_bytes import serialize
from casnap.format.names import hash_bytes
from casnap.format.parse import parse_config, parse_manifest

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"
sys.path.insert(0, str(ROOT / "tools"))
from make_golden import (  # noqa: E402
    SOLO,
    WORLD,
    golden_globals,
    golden_model,
    golden_rank_state,
    golden_second,
    golden_solo_second,
    golden_state,
)

SNAPSHOTS = ("first", "second")  # the 2-rank take


@pytest.fixture
def golden(tmp_path) -> Path:
    # a copy, so that nothing a test does can touch the committed files
    dst = tmp_path / "golden"
    shutil.copytree(DATA / "golden", dst)
    return dst


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor) and a.is_quantized:
        return (
            isinstance(b, torch.Tensor)
            and b.is_quantized
            and a.dtype == b.dtype
            and a.q_scale() == b.q_scale()
            and a.q_zero_point() == b.q_zero_point()
            and same(a.int_repr(), b.int_repr())
        )
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bytes(a.contiguous().reshape(-1).view(torch.uint8).tolist())
            == bytes(b.contiguous().reshape(-1).view(torch.uint8).tolist())
        )
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if isinstance(a, float):
        return type(b) is float and a.hex() == b.hex()
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return type(a) is type(b) and a == b


# -- the one process's snapshots, solo-2 with a delta --------------------------


def test_golden_solo_snapshots_restore_bit_exact(golden):
    expected = golden_state()
    for name in SOLO:
        target = StateDict()
        Snapshot(str(golden / name)).restore({"state": target})
        assert set(target) == set(expected)
        for key in expected:
            assert same(expected[key], target[key]), f"{name}: {key} differs"
        golden_solo_second(expected)


def test_golden_solo_metadata_lineage_and_delta(golden):
    repo = Repository(str(golden))
    first = repo.storage.read_manifest(repo.resolve(SOLO[0]))
    second = repo.storage.read_manifest(repo.resolve(SOLO[1]))
    assert first.format_version == "1.0" and first.metadata == {"step": 1, "note": "golden solo"}
    assert first.parents == [] and second.parents == [repo.resolve(SOLO[0])]
    w1 = tensor_entry(first.entries, "0/state/weights")
    w2 = tensor_entry(second.entries, "0/state/weights")
    shared = sum(a.hash == b.hash for a, b in zip(w1.chunks, w2.chunks))
    assert shared == len(w1.chunks) - 1
    # the changed chunk is a delta against solo-1's whole chunk: depth 1
    (old, new) = next((a, b) for a, b in zip(w1.chunks, w2.chunks) if a.hash != b.hash)
    assert new.base is not None and new.base.hash == old.hash and new.base.base is None
    assert new.whole == new.base and all(c.base is None for c in first.chunk_refs())
    # their entries are stored in a part each (the change is in solo-2's), the 2-rank
    # take's inline beside its rank groups
    assert len(first.parts) == len(second.parts) == 1 and first.parts != second.parts
    assert all(not repo.storage.read_manifest(repo.resolve(n)).parts for n in SNAPSHOTS)


# -- the whole repository ------------------------------------------------------


def test_golden_manifests_named_by_their_unchanged_bytes(golden):
    """Each manifest's name is the hash of its bytes, and parsing then dumping gives those bytes."""
    files = sorted((golden / ".casnap" / "manifests").glob("*/*"))
    assert len(files) == 4
    parts = Repository(str(golden)).storage.parts
    for f in files:
        data = f.read_bytes()
        assert hash_bytes(data) == f.name and f.parent.name == f.name[:2]
        manifest = parse_manifest(data, f.name, parts.load)
        assert manifest.format_version == "1.0"
        assert serialize(manifest) == data  # serialization did not change
    repo = Repository(str(golden))
    assert repo.storage.config.format_version == "1.0"
    assert sorted(repo.resolve(s) for s in repo.snapshots()) == [f.name for f in files]


@pytest.mark.parametrize("version", ["0.9", "1.1", "1.4", "2.0", "1", "", 1.0, None])
def test_any_other_format_version_is_refused(golden, version):
    """One format: a manifest or config of any other version is refused, saying so."""
    f = next((golden / ".casnap" / "manifests").glob("*/*"))
    doc = json.loads(f.read_bytes())
    doc["format_version"] = version
    data = canonical_json(doc)
    with pytest.raises(UnsupportedFormatError, match="reads format 1.0 only"):
        parse_manifest(data, hash_bytes(data))
    config = json.loads((golden / ".casnap" / "config.json").read_bytes())
    config["format_version"] = version
    with pytest.raises(UnsupportedFormatError, match="reads format 1.0 only"):
        parse_config(canonical_json(config))


def test_golden_verify_with_read_data(golden, capsys):
    report = Repository(str(golden)).verify(read_data=True)
    assert report.ok, report.problems
    assert report.snapshots == 4 and report.manifests == 4
    assert report.chunks_read == report.chunks > 0
    assert cli_main(["verify", "--read-data", str(golden)]) == 0
    assert "OK" in capsys.readouterr().out


# -- the 2-rank take: sharded entries, rank groups ---------------------------


def expected_model() -> dict[str, dict[str, torch.Tensor]]:
    """Every model value of the 2-rank take, whole, by snapshot name."""
    first = golden_globals()
    second = {k: v.clone() for k, v in first.items()}
    golden_second(second)
    return {"first": first, "second": second}


def rank_state_of(rank: int, snapshot: str) -> dict:
    return golden_rank_state(rank, step=SNAPSHOTS.index(snapshot) + 1)


def test_golden_restore_whole_tensors_bit_exact(golden):
    """One process (rank 0) restores every sharded and replicated entry into plain tensors."""
    for name, expected in expected_model().items():
        model = StateDict({k: torch.zeros_like(v) for k, v in expected.items()})
        own = StateDict(
            x=torch.zeros(6, dtype=torch.int64),
            mask=torch.ones(5, dtype=torch.bool),
            step=-1,
            rank=-1,
            lr=0.0,
            name="",
            frac=None,
            q=torch.quantize_per_tensor(torch.zeros(8), 1.0, 0, torch.qint8),
        )
        with pytest.raises(PickleNotAllowedError):
            Snapshot(str(golden / name)).restore({"model": model, "rank_state": own})
        assert not model["w_row"].any()  # refused before anything was modified
        Snapshot(str(golden / name)).restore({"model": model, "rank_state": own}, allow_pickle=True)
        assert same(expected, dict(model)), name
        assert same(rank_state_of(0, name), dict(own)), name


def test_golden_read_object_every_entry(golden):
    expected = expected_model()
    for name in SNAPSHOTS:
        snap = Snapshot(str(golden / name))
        for rank in range(WORLD):
            for key, value in expected[name].items():
                assert same(value, snap.read_object(f"{rank}/model/{key}")), (name, rank, key)
            own = rank_state_of(rank, name)
            for key, value in own.items():
                got = snap.read_object(f"{rank}/rank_state/{key}", allow_pickle=True)
                assert same(value, got), (name, rank, key)
            assert same(own, snap.read_object(f"{rank}/rank_state", allow_pickle=True))
            with pytest.raises(PickleNotAllowedError):
                snap.read_object(f"{rank}/rank_state/frac")
        # obj_out: the data lands in the given tensor
        out = torch.empty(64, 40)
        assert snap.read_object("1/model/w_row", obj_out=out) is out
        assert same(expected[name]["w_row"], out)


def test_golden_manifest_layout_lineage_and_dedupe(golden):
    repo = Repository(str(golden))
    assert repo.snapshots() == ["first", "second", *SOLO]
    first = repo.storage.read_manifest(repo.resolve("first"))
    second = repo.storage.read_manifest(repo.resolve("second"))
    assert first.format_version == second.format_version == "1.0"
    assert first.world_size == second.world_size == WORLD
    assert first.parents == [] and second.parents == [repo.resolve("first")]
    assert first.metadata == {"step": 1, "note": "golden"}
    assert second.metadata == {"step": 2}
    boxes = {
        "w_row": ("dtensor", [([0, 0], [32, 40]), ([32, 0], [32, 40])]),
        "w_col": ("dtensor", [([0, 0], [10, 17]), ([0, 17], [10, 16])]),
        "codes": ("dtensor", [([0, 0], [20, 6]), ([20, 0], [20, 6])]),
        "rep": ("dtensor", [([0], [20])]),  # Replicate(): stored once
        "st": ("sharded_tensor", [([0, 0], [8, 8]), ([8, 0], [7, 8])]),
    }
    for rank in range(WORLD):
        for key, (layout, shards) in boxes.items():
            entry = first.entries[f"{rank}/model/{key}"]
            assert entry.kind == "sharded" and entry.layout == layout
            assert [(s.offsets, s.sizes) for s in entry.shards] == shards
            assert entry == first.entries[f"0/model/{key}"]  # every rank holds the same entry
        for key in ("emb", "bias"):
            entry = first.entries[f"{rank}/model/{key}"]
            assert entry.kind == "tensor" and entry.replicated
            assert entry == first.entries[f"0/model/{key}"]
        assert first.entries[f"{rank}/rank_state/frac"].kind == "object"
        assert not first.entries[f"{rank}/rank_state/x"].replicated
    assert first.entries["0/rank_state/x"] != first.entries["1/rank_state/x"]
    # packed and loose chunks both occur
    refs = first.chunk_refs()
    assert any(r.pack for r in refs) and any(r.pack is None for r in refs)
    # second changed one row of rank 0's shard of w_row: one new chunk, the rest shared
    new = {r.hash for r in second.chunk_refs()} - {r.hash for r in refs}
    e1, e2 = first.entries["0/model/w_row"], second.entries["0/model/w_row"]
    assert isinstance(e1, ShardedEntry) and isinstance(e2, ShardedEntry)
    w1, w2 = e1.shards, e2.shards
    assert new == {w2[0].chunks[0].hash} and w1[0].chunks[0].hash != w2[0].chunks[0].hash


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3])
def test_golden_reshard_on_restore(golden, world):
    """Ranks restore onto other placements (and a third rank onto a 2-rank snapshot)."""
    from dist_harness import run_ranks, values

    assert values(run_ranks(world, reshard_restore, str(golden))) == [True] * world


def reshard_restore(rank: int, world: int, root: str) -> bool:
    from casnap.torch_io.sharded import as_shard_leaf

    for name, expected in expected_model().items():
        zeros = {k: torch.zeros_like(v) for k, v in expected.items()}
        model = golden_model(world, zeros, layout="reshard")
        app = {"model": StateDict(model)}
        own = StateDict(
            x=torch.zeros(6, dtype=torch.int64),
            mask=torch.ones(5, dtype=torch.bool),
            step=-1,
            rank=-1,
            lr=0.0,
            name="",
            frac=None,
            q=torch.quantize_per_tensor(torch.zeros(8), 1.0, 0, torch.qint8),
        )
        if rank < WORLD:  # per-rank state restores onto the same rank only
            app["rank_state"] = own
        Snapshot(f"{root}/{name}").restore(app, allow_pickle=True)
        for key, value in model.items():
            leaf = as_shard_leaf(value, key)
            parts = (
                [((0,) * value.dim(), value)]
                if leaf is None
                else [(s.offsets, s.tensor) for s in leaf.shards]
            )
            for offsets, local in parts:
                box = tuple(slice(o, o + n) for o, n in zip(offsets, local.shape, strict=True))
                assert same(expected[key][box].contiguous(), local), (name, rank, key)
        if rank < WORLD:
            assert same(rank_state_of(rank, name), dict(own)), (name, rank)
    return True
