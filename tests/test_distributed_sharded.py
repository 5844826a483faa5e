"""DTensor and ShardedTensor: stored with global offsets, resharded on restore.

The multi-rank takes and restores carry ``dist`` (select with ``-m dist``); the reads a
reshard plans, only the chunks that overlap the target, need no processes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks, values

from casnap.format.codec import HEADER_SIZE
from casnap.format.entries import ChunkRef, ShardedEntry, ShardRecord
from casnap.restore.reshard import ShardedSink

OPTS = {"chunk_size": 4096}
SHAPES: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "w1": ((48, 40), torch.float32),
    "w2": ((40, 36), torch.float32),
    "r": ((700,), torch.float64),
    "b": ((30, 9), torch.bfloat16),
    "st": ((50, 24), torch.float32),
}


def global_value(name: str) -> torch.Tensor:
    shape, dtype = SHAPES[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)


def _sharded_tensor(name: str, world: int, fill: bool) -> Any:
    from torch.distributed._shard.sharded_tensor import empty
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    shape, dtype = SHAPES[name]
    spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(world)])
    st = empty(spec, *shape, dtype=dtype)
    full = global_value(name)
    for shard in st.local_shards():
        o, s = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        region = full[o[0] : o[0] + s[0], o[1] : o[1] + s[1]]
        shard.tensor.copy_(region if fill else torch.zeros_like(region))
    return st


def _state(world: int, layout: str, fill: bool) -> dict[str, Any]:
    """Sharded state for ``world`` ranks; ``layout`` picks the placements ("a" or "b")."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))

    def make(name: str, placements: list[Any], m: Any = mesh) -> Any:
        value = global_value(name) if fill else torch.zeros(SHAPES[name][0], dtype=SHAPES[name][1])
        return distribute_tensor(value, m, placements)

    if layout == "a":
        state = {
            "w1": make("w1", [Shard(0)]),
            "r": make("r", [Replicate()]),
            "b": make("b", [Shard(1)]),
        }
        if world == 4:
            state["w2"] = make("w2", [Shard(0), Shard(1)], init_device_mesh("cpu", (2, 2)))
        else:
            state["w2"] = make("w2", [Shard(1)])
    else:
        state = {
            "w1": make("w1", [Shard(1)]),
            "r": make("r", [Shard(0)]),
            "b": make("b", [Replicate()]),
            "w2": make("w2", [Shard(0)]),
        }
    state["st"] = _sharded_tensor("st", world, fill)
    return state


def save(rank: int, world: int, root: str, name: str) -> int:
    from casnap import Snapshot, StateDict
    from casnap.format.entries import ShardedEntry

    app = {
        "dt": StateDict(_state(world, "a", fill=True)),
        "own": StateDict(x=torch.full((3,), float(rank))),
    }
    snap = Snapshot.take(f"{root}/{name}", app, settings=OPTS)
    entry = snap.get_manifest()[f"{rank}/dt/w1"]
    assert entry.kind == "sharded" and len(entry.shards) == world
    replicated = snap.get_manifest()[f"{rank}/dt/r"]
    assert isinstance(replicated, ShardedEntry) and len(replicated.shards) == 1  # stored once
    return sum(s.raw_bytes_written for s in snap.last_take_rank_stats or [])


def _local_parts(value: Any) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    from casnap.torch_io.sharded import as_shard_leaf

    leaf = as_shard_leaf(value, "x")
    assert leaf is not None
    return [(s.offsets, s.tensor) for s in leaf.shards]


def _assert_exact(name: str, value: Any) -> None:
    full = global_value(name)
    for offsets, local in _local_parts(value):
        region = full[tuple(slice(o, o + s) for o, s in zip(offsets, local.shape, strict=True))]
        assert local.dtype == region.dtype and torch.equal(local, region), name


def restore(rank: int, world: int, root: str, name: str, saved_world: int) -> dict[str, Any]:
    from casnap import Snapshot, StateDict
    from casnap.errors import MissingKeyError

    snap = Snapshot(f"{root}/{name}")
    for layout in ("a", "b"):
        state = _state(world, layout, fill=False)
        snap.restore({"dt": StateDict(state)})
        for key, value in state.items():
            _assert_exact(key, value)
    # read_object: the whole tensor, or the view an obj_out asks for.
    whole = snap.read_object(f"{rank}/dt/w2" if rank < saved_world else "0/dt/w2")
    assert torch.equal(whole, global_value("w2"))
    view = _state(world, "b", fill=False)["w1"]
    got = snap.read_object("0/dt/w1", obj_out=view)
    _assert_exact("w1", got)
    # Per-rank state: restores onto the same rank; a new rank fails naming key and rank.
    own = StateDict(x=torch.full((3,), -1.0))
    error = ""
    try:
        snap.restore({"own": own})
    except MissingKeyError as exc:
        error = str(exc)
    if rank < saved_world:
        assert not error and torch.equal(own["x"], torch.full((3,), float(rank)))
    else:
        assert "'own'" in error and f"rank {rank}" in error, error
        assert torch.equal(own["x"], torch.full((3,), -1.0))  # untouched
    return {"ok": True}


@pytest.mark.dist
def test_dtensor_sharded_tensor_reshard(tmp_path: Path) -> None:
    root = str(tmp_path / "repo")
    values(run_ranks(4, save, root, "four"))
    values(run_ranks(2, save, root, "two"))
    values(run_ranks(2, restore, root, "four", 4))  # 4 -> 2
    values(run_ranks(3, restore, root, "two", 2))  # 2 -> 3 (rank 2 is new)


@pytest.mark.dist
def test_sharded_single_process_read_object(tmp_path: Path) -> None:
    """World size 1: a DTensor on a one-rank mesh, and read_object of every entry kind."""
    values(run_ranks(1, one_rank, str(tmp_path / "repo")))


def one_rank(rank: int, world: int, root: str) -> None:
    from casnap import Snapshot, StateDict

    state = _state(1, "a", fill=True)
    app = {"dt": StateDict(state), "misc": StateDict(t=torch.arange(5), n=3, s="x", o=[1, 2])}
    snap = Snapshot.take(f"{root}/one", app, settings=OPTS)
    for key, entry in snap.get_manifest().items():
        value = snap.read_object(key)
        if entry.kind == "sharded":
            assert torch.equal(value, global_value(key.split("/")[-1]))
    assert snap.read_object("0/misc/o") == [1, 2] and snap.read_object("0/misc/n") == 3
    assert dist.get_world_size() == 1


# --- which chunks a reshard reads ------------------------------------------------------------


def _entry(rows: int, cols: int, parts: int, chunk: int) -> ShardedEntry:
    per = rows // parts
    nbytes = per * cols * 4
    shards = []
    for p in range(parts):
        refs = [
            ChunkRef(
                hash=f"{p:032x}{i:032x}",
                size=min(chunk, nbytes - i * chunk),
                length=HEADER_SIZE + min(chunk, nbytes - i * chunk),
            )
            for i in range(-(-nbytes // chunk))
        ]
        shards.append(
            ShardRecord(offsets=[p * per, 0], sizes=[per, cols], chunk_size=chunk, chunks=refs)
        )
    return ShardedEntry(layout="dtensor", dtype="float32", shape=[rows, cols], shards=shards)


class _Target:
    """A stand-in for a sharded target with one box (what target_regions returns)."""


def _needed(entry: ShardedEntry, offsets: tuple[int, int], sizes: tuple[int, int]) -> set[str]:
    import casnap.restore.reshard as reshard
    from casnap.torch_io.sharded import LocalShard, target_regions

    box = LocalShard(offsets, sizes, torch.empty(sizes))
    original = target_regions
    reshard.target_regions = lambda value, key: [box]  # type: ignore[attr-defined]  # as used
    original_check = reshard._check
    reshard._check = lambda key, entry, target: None
    try:
        sink = ShardedSink("k", entry, _Target())
    finally:
        reshard.target_regions = original  # type: ignore[attr-defined]
        reshard._check = original_check
    return {ref.hash for _, ref in sink.needed()}


def test_row_overlap_reads_only_overlapping_chunks() -> None:
    entry = _entry(64, 64, 4, 1024)  # 16 rows per shard, 4 rows (1 KiB) per chunk
    got = _needed(entry, (8, 0), (16, 64))  # rows 8..23: half of shard 0, half of shard 1
    want = {f"{0:032x}{i:032x}" for i in (2, 3)} | {f"{1:032x}{i:032x}" for i in (0, 1)}
    assert got == want


def test_column_box_reads_only_its_rows() -> None:
    entry = _entry(64, 64, 4, 256)  # one row per chunk
    got = _needed(entry, (3, 10), (3, 20))  # rows 3..5, columns 10..29
    assert got == {f"{0:032x}{i:032x}" for i in (3, 4, 5)}
