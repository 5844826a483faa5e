"""The planning exchange reuses the previous take's structure (casnap/distributed/plan_cache.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from dist_harness import run_ranks, values

from casnap.distributed.plan_cache import fingerprint, join, split
from casnap.format.entries import ContainerEntry, PrimitiveEntry
from casnap.take.plan import ObjectPlan, RankPlan, ShardedPlan, ShardPlan, TensorPlan

OPTS = {"chunk_size": 4096}
TENSORS = 300


def _plan() -> RankPlan:
    h = [f"{i:064x}" for i in range(6)]
    entries: dict[str, Any] = {
        "1/m": ContainerEntry(type="dict", keys=["w", 3]),
        "1/m/w": TensorPlan("float32", (2, 3), True, ((h[0], 4096), (h[1], 8))),
        "1/m/3": PrimitiveEntry(type="int", value=7),
        "1/o": ObjectPlan("builtins.set", 10, ((h[2], 10),)),
        "1/lr": PrimitiveEntry(type="float", value="0x1.0p-3"),
        "1/s": ShardedPlan(
            "dtensor",
            "bfloat16",
            (4, 4),
            (ShardPlan((0, 0), (2, 4), ((h[3], 16),)), ShardPlan((2, 0), (2, 4), ((h[4], 16),))),
        ),
        "1/e": TensorPlan("int64", (0,), False, ()),
    }
    return RankPlan(1, 4096, entries)


def test_split_join_round_trip_and_fingerprint() -> None:
    plan = _plan()
    structure, content = split(plan)
    assert join(structure, content) == plan
    assert fingerprint(plan) == fingerprint(structure)  # computed without splitting
    assert len(content.digests) == 5 * 32 and len(content.primitives) == 2

    # Content (hashes, primitive values) is not structure; shapes, flags and keys are.
    def changed(key: str, entry: Any) -> bytes:
        return fingerprint(split(RankPlan(1, 4096, {**plan.entries, key: entry}))[0])

    rehashed = TensorPlan("float32", (2, 3), True, (("f" * 64, 4096), ("e" * 64, 8)))
    assert changed("1/m/w", rehashed) == fingerprint(structure)
    assert changed("1/lr", PrimitiveEntry(type="int", value=1)) == fingerprint(structure)
    w = plan.entries["1/m/w"]
    assert isinstance(w, TensorPlan)
    unflagged = TensorPlan("float32", (2, 3), False, w.chunks)
    assert changed("1/m/w", unflagged) != fingerprint(structure)
    assert changed("1/m", ContainerEntry(type="dict", keys=["w", "3"])) != fingerprint(structure)
    bigger = ObjectPlan("builtins.set", 11, (("2" * 64, 11),))
    assert changed("1/o", bigger) != fingerprint(structure)
    with pytest.raises(ValueError):
        join(structure, type(content)(content.digests[:-32], content.primitives))


def _state(rank: int, extra: bool = False) -> dict[str, Any]:
    from casnap import StateDict

    g = torch.Generator().manual_seed(7)
    shared = {f"t{i}": torch.randn(64 + i % 5, generator=g) for i in range(TENSORS)}
    own = StateDict(x=torch.full((100,), float(rank)), step=1, lr=0.125)
    if extra:
        own["new"] = torch.arange(10.0) + rank
    return {"shared": StateDict(shared), "own": own}


def _take(root: str, name: str, app: dict[str, Any], session: Any) -> tuple[Any, Any]:
    from casnap import Snapshot

    snap = Snapshot.take(
        f"{root}/{name}", app, replicated=["shared/**"], storage_options=OPTS, session=session
    )
    return snap, session.plan_cache.last


def _assert_restores(root: str, name: str, app: dict[str, Any], rank: int, extra: bool) -> None:
    from casnap import Snapshot

    fresh = _state(rank, extra)
    for sd in fresh.values():
        for k, v in sd.items():
            if isinstance(v, torch.Tensor):
                sd[k] = torch.zeros_like(v)
    Snapshot(f"{root}/{name}").restore(fresh)
    for key, sd in app.items():
        for k, v in sd.items():
            got = fresh[key][k]
            assert torch.equal(got, v) if isinstance(v, torch.Tensor) else got == v, (name, k)


def cache_scenario(rank: int, world: int, root: str) -> dict[str, Any]:
    from casnap import Session
    from casnap.distributed import ReplicaMismatchError
    from casnap.settings import override

    session = Session()  # what this rank's process keeps from one take to the next
    app = _state(rank)
    s1, first = _take(root, "s1", app, session)
    app["own"]["step"] = 2  # primitives are content: the structure still holds
    app["own"]["x"].add_(1.0)
    app["shared"]["t3"].mul_(2.0)
    s2, second = _take(root, "s2", app, session)
    _assert_restores(root, "s2", app, rank, False)
    session = Session()  # every rank: the plain exchange of the same state, for comparison
    s2b, plain = _take(root, "s2b", app, session)
    assert s2b.get_manifest() == s2.get_manifest()  # bit-identical entries

    # A structure change on rank 1 only: it sends its structure, rank 0 stays compact.
    app = _state(rank, extra=rank == 1)
    s3, changed = _take(root, "s3", app, session)
    _assert_restores(root, "s3", app, rank, rank == 1)
    assert "1/own/new" in s3.get_manifest() and "0/own/new" not in s3.get_manifest()

    # Rank 0 restarted (empty cache): a second gather recovers rank 1's structure.
    if rank == 0:
        session = Session()
    app["own"]["x"].add_(5.0)
    s4, restarted = _take(root, "s4", app, session)
    _assert_restores(root, "s4", app, rank, rank == 1)
    s4b, _ = _take(root, "s4b", app, Session())
    assert s4b.get_manifest() == s4.get_manifest()

    # Replicas are still checked on a reused plan.
    s5, again = _take(root, "s5", app, session)
    mismatch = ""
    if rank == 1:
        app["shared"]["t0"].add_(1.0)
    try:
        with override(replica_mismatch="error"):
            _take(root, "s6", app, session)
    except ReplicaMismatchError as exc:
        mismatch = str(exc)
    return {
        "modes": [x.mode for x in (first, second, plain, changed, restarted, again)],
        "gathers": [x.gathers for x in (first, second, changed, restarted)],
        "bytes": [first.payload_bytes, second.payload_bytes, changed.payload_bytes],
        "second_bytes": restarted.second_bytes,
        "mismatch": mismatch,
    }


@pytest.mark.dist
def test_second_take_reuses_structure_and_falls_back(tmp_path: Path) -> None:
    out = values(run_ranks(2, cache_scenario, str(tmp_path / "repo")))
    for rank, o in enumerate(out):
        assert o["modes"] == ["full", "reused", "full", "reused", "fallback", "reused"], o
        assert o["gathers"] == [1, 1, 1, 2], o
        first, second, changed = o["bytes"]
        assert second * 3 < first, o["bytes"]  # digests only: the structure is not sent
        if rank == 0:  # compact with s3; restarted (full) with s4, sends nothing more
            assert changed * 3 < first and o["second_bytes"] < 100, o
        else:  # sent its new structure with s3; compact with s4, then asked for it
            assert changed > first // 2 and o["second_bytes"] > first // 2, o
        assert "shared/t0" in o["mismatch"] and "ranks [0] vs [1]" in o["mismatch"], o
