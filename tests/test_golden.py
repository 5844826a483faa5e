"""The committed golden repositories still read bit-exact.

tests/data/golden-v1 is format 1.0 (one process); tests/data/golden-v1.1 is
format 1.1, taken by 2 gloo ranks on CPU with sharded entries (DTensor
Shard(0), uneven Shard(1) and Replicate, a ShardedTensor), replicated plain
tensors and per-rank state. tools/make_golden.py wrote both once; nothing
here writes into tests/data (every test works on a copy).
"""

from __future__ import annotations

import math
import shutil
import sys
from pathlib import Path

import pytest
import torch
from helpers import tensor_entry

from casnap import Repository, Snapshot, StateDict
from casnap.cli import main as cli_main
from casnap.errors import PickleNotAllowedError
from casnap.format.entries import ShardedEntry
from casnap.format.manifest_bytes import serialize
from casnap.format.names import hash_bytes
from casnap.format.parse import parse_manifest

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"
sys.path.insert(0, str(ROOT / "tools"))
from make_golden import (  # noqa: E402
    V11_WORLD,
    golden_state,
    golden_v11_globals,
    golden_v11_model,
    golden_v11_rank_state,
    golden_v11_second,
)


def _copy(tmp_path: Path, name: str) -> Path:
    # a copy, so that nothing a test does can touch the committed files
    dst = tmp_path / name
    shutil.copytree(DATA / name, dst)
    return dst


@pytest.fixture
def golden(tmp_path) -> Path:
    return _copy(tmp_path, "golden-v1")


@pytest.fixture
def golden11(tmp_path) -> Path:
    return _copy(tmp_path, "golden-v1.1")


def same(a, b) -> bool:
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


def test_golden_snapshots_restore_bit_exact(golden):
    expected = golden_state()
    for name in ("first", "second"):
        target = StateDict()
        Snapshot(str(golden / name)).restore({"state": target})
        assert set(target) == set(expected)
        for key in expected:
            assert same(expected[key], target[key]), f"{name}: {key} differs"
        expected["weights"][3].add_(1.0)


def test_golden_repository_metadata_and_lineage(golden):
    repo = Repository(str(golden))
    assert repo.storage.list_snapshots() == ["first", "second"]
    first = repo.storage.read_manifest(repo.resolve("first"))
    second = repo.storage.read_manifest(repo.resolve("second"))
    assert first.format_version == "1.0" and first.metadata == {"step": 1, "note": "golden v1"}
    assert second.parents == [repo.resolve("first")]
    w1 = tensor_entry(first.entries, "0/state/weights")
    w2 = tensor_entry(second.entries, "0/state/weights")
    shared = sum(a.hash == b.hash for a, b in zip(w1.chunks, w2.chunks))
    assert shared == len(w1.chunks) - 1


# -- both repositories -------------------------------------------------------


@pytest.mark.parametrize(("name", "version"), [("golden-v1", "1.0"), ("golden-v1.1", "1.1")])
def test_golden_manifests_named_by_their_unchanged_bytes(tmp_path, name, version):
    """Each manifest's name is the hash of its bytes, and parsing then dumping gives those bytes."""
    root = _copy(tmp_path, name)
    files = sorted((root / ".casnap" / "manifests").glob("*/*"))
    assert len(files) == 2
    for f in files:
        data = f.read_bytes()
        assert hash_bytes(data) == f.name and f.parent.name == f.name[:2]
        manifest = parse_manifest(data, f.name)
        assert manifest.format_version == version
        assert serialize(manifest) == data  # serialization did not change
    repo = Repository(str(root))
    assert repo.storage.config.format_version == version
    assert sorted(repo.resolve(s) for s in repo.snapshots()) == [f.name for f in files]


@pytest.mark.parametrize("name", ["golden-v1", "golden-v1.1"])
def test_golden_verify_with_read_data(tmp_path, name, capsys):
    root = _copy(tmp_path, name)
    report = Repository(str(root)).verify(read_data=True)
    assert report.ok, report.problems
    assert report.snapshots == 2 and report.manifests == 2
    assert report.chunks_read == report.chunks > 0
    assert cli_main(["verify", "--read-data", str(root)]) == 0
    assert "OK" in capsys.readouterr().out


# -- golden-v1.1: format 1.1, two ranks, sharded entries ----------------------

V11_SNAPSHOTS = ("first", "second")


def v11_expected() -> dict[str, dict[str, torch.Tensor]]:
    """Every model value of golden-v1.1, whole, by snapshot name."""
    first = golden_v11_globals()
    second = {k: v.clone() for k, v in first.items()}
    golden_v11_second(second)
    return {"first": first, "second": second}


def v11_rank_state(rank: int, snapshot: str) -> dict:
    return golden_v11_rank_state(rank, step=V11_SNAPSHOTS.index(snapshot) + 1)


def test_golden_v11_restore_whole_tensors_bit_exact(golden11):
    """One process (rank 0) restores every sharded and replicated entry into plain tensors."""
    for name, expected in v11_expected().items():
        model = StateDict({k: torch.zeros_like(v) for k, v in expected.items()})
        own = StateDict(
            x=torch.zeros(6, dtype=torch.int64),
            mask=torch.ones(5, dtype=torch.bool),
            step=-1,
            rank=-1,
            lr=0.0,
            name="",
            frac=None,
        )
        with pytest.raises(PickleNotAllowedError):
            Snapshot(str(golden11 / name)).restore({"model": model, "rank_state": own})
        assert not model["w_row"].any()  # refused before anything was modified
        Snapshot(str(golden11 / name)).restore(
            {"model": model, "rank_state": own}, allow_pickle=True
        )
        assert same(expected, dict(model)), name
        assert same(v11_rank_state(0, name), dict(own)), name


def test_golden_v11_read_object_every_entry(golden11):
    expected = v11_expected()
    for name in V11_SNAPSHOTS:
        snap = Snapshot(str(golden11 / name))
        for rank in range(V11_WORLD):
            for key, value in expected[name].items():
                assert same(value, snap.read_object(f"{rank}/model/{key}")), (name, rank, key)
            own = v11_rank_state(rank, name)
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


def test_golden_v11_manifest_layout_lineage_and_dedupe(golden11):
    repo = Repository(str(golden11))
    assert repo.snapshots() == ["first", "second"]
    first = repo.storage.read_manifest(repo.resolve("first"))
    second = repo.storage.read_manifest(repo.resolve("second"))
    assert first.format_version == second.format_version == "1.1"
    assert first.world_size == second.world_size == V11_WORLD
    assert first.parents == [] and second.parents == [repo.resolve("first")]
    assert first.metadata == {"step": 1, "note": "golden v1.1"}
    assert second.metadata == {"step": 2}
    boxes = {
        "w_row": ("dtensor", [([0, 0], [32, 40]), ([32, 0], [32, 40])]),
        "w_col": ("dtensor", [([0, 0], [10, 17]), ([0, 17], [10, 16])]),
        "codes": ("dtensor", [([0, 0], [20, 6]), ([20, 0], [20, 6])]),
        "rep": ("dtensor", [([0], [20])]),  # Replicate(): stored once
        "st": ("sharded_tensor", [([0, 0], [8, 8]), ([8, 0], [7, 8])]),
    }
    for rank in range(V11_WORLD):
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
def test_golden_v11_reshard_on_restore(golden11, world):
    """Ranks restore onto other placements (and a third rank onto a 2-rank snapshot)."""
    from dist_harness import run_ranks, values

    assert values(run_ranks(world, reshard_restore, str(golden11))) == [True] * world


def reshard_restore(rank: int, world: int, root: str) -> bool:
    from casnap.torch_io.sharded import as_shard_leaf

    for name, expected in v11_expected().items():
        zeros = {k: torch.zeros_like(v) for k, v in expected.items()}
        model = golden_v11_model(world, zeros, layout="reshard")
        app = {"model": StateDict(model)}
        own = StateDict(
            x=torch.zeros(6, dtype=torch.int64),
            mask=torch.ones(5, dtype=torch.bool),
            step=-1,
            rank=-1,
            lr=0.0,
            name="",
            frac=None,
        )
        if rank < V11_WORLD:  # per-rank state restores onto the same rank only
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
        if rank < V11_WORLD:
            assert same(v11_rank_state(rank, name), dict(own)), (name, rank)
    return True
