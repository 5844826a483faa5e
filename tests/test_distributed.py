"""Distributed take and restore on several CPU processes over gloo.

What a take on several ranks writes and restores (DDP, async, a failing or dying
rank), what an async take stages under the memory budget, and the planning
exchange: one gather, the plan cache that reuses a previous take's structure,
and the assignment of replicated chunks to writers. Multi-rank tests carry
``dist`` (select with ``-m dist``); the planning units need no processes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks, values

from casnap.distributed.plan import assign
from casnap.distributed.plan_cache import fingerprint, join, split
from casnap.format.entries import ContainerEntry, PrimitiveEntry
from casnap.take.plan import ObjectPlan, RankPlan, ShardedPlan, ShardPlan, TensorPlan

CHUNK = 16384


# --- take and restore on several ranks ---------------------------------------------------------


def _ddp_model() -> torch.nn.Module:
    torch.manual_seed(1234 + dist.get_rank())  # different on purpose: DDP broadcasts rank 0's
    layers = [torch.nn.Linear(128, 128, bias=False) for _ in range(8)]
    return torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*layers))


def ddp_scenario(rank: int, world: int, root: str) -> dict[str, Any]:
    from casnap import Snapshot, StateDict
    from casnap.distributed import DistributedTakeError, ReplicaMismatchError

    opts = {"chunk_size": CHUNK}
    model = _ddp_model()
    progress = StateDict(rank=rank, note=f"rank {rank}", data=torch.full((5,), float(rank)))
    app = {"model": model, "progress": progress}
    snap = Snapshot.take(f"{root}/s1", app, settings=opts)
    stats = snap.last_take_rank_stats
    assert stats is not None
    written = [s.raw_bytes_written for s in stats]
    manifest = snap.get_manifest()
    ranks_in_manifest = sorted({int(k.split("/", 1)[0]) for k in manifest})
    assert ranks_in_manifest == list(range(world))
    assert manifest["3/model/module.0.weight"].replicated
    assert manifest["1/model/module.0.weight"] == manifest["0/model/module.0.weight"]

    # Per-rank and replicated state round-trips; every rank gets its own per-rank values.
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    progress["data"] = torch.zeros(5)
    progress["rank"] = -1
    snap_r = Snapshot(f"{root}/s1")
    snap_r.restore(app)
    for k, v in model.state_dict().items():
        assert torch.equal(v, expected[k]), k
    assert progress["rank"] == rank and torch.equal(progress["data"], torch.full((5,), float(rank)))
    # read_object of a replicated tensor and of a primitive.
    w = snap_r.read_object(f"{rank}/model/module.3.weight")
    assert torch.equal(w, expected["module.3.weight"])
    assert snap_r.read_object(f"{rank}/progress/note") == f"rank {rank}"

    # Replicated values that differ, with replica_mismatch="error": error on every rank,
    # naming the key and ranks; no ref (the default warns: tests/test_replication.py).
    mismatch = None
    bad = StateDict(w=torch.full((4,), 1.0 if rank != 2 else 2.0))
    strict = {**opts, "replica_mismatch": "error"}
    try:
        Snapshot.take(f"{root}/bad", {"bad": bad}, replicated=["bad/**"], settings=strict)
    except ReplicaMismatchError as exc:
        mismatch = (str(exc), exc.failed_ranks)
    assert mismatch is not None and "bad/w" in mismatch[0]

    # A rank raising mid-take (while writing): every rank raises naming it; no ref.
    failed = None
    import casnap.chunks.write as chunks_mod

    original = chunks_mod.ChunkWriter.add
    if rank == 1:
        calls = [0]

        def add(self: Any, data: Any, *args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            if calls[0] > 2:
                raise OSError("injected write failure on rank 1")
            return original(self, data, *args, **kwargs)

        chunks_mod.ChunkWriter.add = add  # type: ignore[method-assign]
    with torch.no_grad():
        model.get_parameter("module.0.weight").add_(1.0)  # new chunks to write
    try:
        Snapshot.take(f"{root}/s2", app, settings=opts)
    except DistributedTakeError as exc:
        failed = (str(exc), exc.failed_ranks)
    finally:
        chunks_mod.ChunkWriter.add = original  # type: ignore[method-assign]
    assert failed is not None and failed[1] == (1,), failed
    dist.barrier()
    assert not Path(root, ".casnap", "refs", "s2").exists()
    Snapshot(f"{root}/s1").restore(app)  # the earlier snapshot is intact
    for k, v in model.state_dict().items():
        assert torch.equal(v, expected[k]), k

    # Re-running the same take reuses the chunks the failed one wrote.
    with torch.no_grad():
        model.get_parameter("module.0.weight").add_(
            1.0
        )  # the state of the failed take (restore undid it)
    again = Snapshot.take(f"{root}/s2", app, settings=opts)
    rerun = sum(s.raw_bytes_written for s in again.last_take_rank_stats or [])
    return {"written": written, "mismatch": mismatch, "failed": failed, "rerun": rerun}


@pytest.mark.dist
def test_ddp_replicated_written_once_and_failures(tmp_path: Path) -> None:
    out = values(run_ranks(4, ddp_scenario, str(tmp_path / "repo")))
    written = out[0]["written"]
    model_bytes = 8 * 128 * 128 * 4
    per_rank_bytes = 5 * 4  # each rank's own tensor (primitives are inline)
    assert sum(written) == model_bytes + 4 * per_rank_bytes, written  # one copy of the model
    mean = sum(written) / len(written)
    assert max(written) <= 1.25 * mean, written
    assert all(o["written"] == written for o in out)  # every rank reports the same numbers
    assert out[2]["mismatch"][1] == (0, 1, 2, 3) or 2 in out[2]["mismatch"][1]
    assert "ranks [0, 1, 3] vs [2]" in out[0]["mismatch"][0]
    for o in out:
        assert "rank 1" in o["failed"][0] and "injected write failure" in o["failed"][0]
    # Only layer 0 changed since s1; the failed take already wrote ranks 0, 2 and 3's
    # share of it, so the re-run writes only what rank 1 never got to write.
    assert 0 < out[0]["rerun"] < 128 * 128 * 4, out[0]["rerun"]


class _Broken:
    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError("state_dict exploded")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def async_scenario(rank: int, world: int, root: str) -> dict[str, Any]:
    from casnap import Snapshot, StateDict
    from casnap.distributed import DistributedTakeError

    state = StateDict(w=torch.arange(6000, dtype=torch.float32), own=torch.full((3,), float(rank)))
    pending = Snapshot.async_take(
        f"{root}/a1", {"s": state}, replicated=["s/w"], settings={"chunk_size": 4096}
    )
    state["w"].add_(1.0)  # after async_take returns: never in the snapshot
    state["own"].add_(1.0)
    snap = pending.wait(60)
    fresh = StateDict(w=torch.zeros(6000), own=torch.zeros(3))
    Snapshot(f"{root}/a1").restore({"s": fresh})
    assert torch.equal(fresh["w"], torch.arange(6000, dtype=torch.float32))
    assert torch.equal(fresh["own"], torch.full((3,), float(rank)))
    written = [s.raw_bytes_written for s in snap.last_take_rank_stats or []]

    # A rank failing while collecting its state: every rank raises, naming it.
    app: dict[str, Any] = {"s": state}
    if rank == 1:
        app["broken"] = _Broken()
    message = ""
    try:
        Snapshot.take(f"{root}/a2", app)
    except DistributedTakeError as exc:
        message = str(exc)
    return {"written": written, "message": message}


@pytest.mark.dist
def test_async_take_point_in_time_and_planning_failure(tmp_path: Path) -> None:
    out = values(run_ranks(2, async_scenario, str(tmp_path / "repo")))
    assert sum(out[0]["written"]) == 6000 * 4 + 2 * 12  # w once, each rank's own tensor
    for o in out:
        assert "rank 1" in o["message"] and "state_dict exploded" in o["message"], o
    assert not (tmp_path / "repo" / ".casnap" / "refs" / "a2").exists()


def dying_scenario(rank: int, world: int, root: str) -> dict[str, Any]:
    import time

    import casnap.chunks.write as chunks_mod
    from casnap import Snapshot, StateDict
    from casnap.distributed import DistributedTakeError

    os.environ["CASNAP_DIST_TIMEOUT"] = "4"
    state = StateDict(w=torch.full((20000,), float(rank)))
    if rank == 2:
        chunks_mod.ChunkWriter.add = lambda *a, **k: os._exit(3)  # type: ignore[method-assign]
    t0 = time.monotonic()
    try:
        Snapshot.take(f"{root}/d", {"s": state}, settings={"chunk_size": 4096})
    except DistributedTakeError as exc:
        return {"message": str(exc), "ranks": exc.failed_ranks, "s": time.monotonic() - t0}
    return {"message": "", "ranks": (), "s": time.monotonic() - t0}


@pytest.mark.dist
def test_dead_rank_fails_every_rank_in_bounded_time(tmp_path: Path) -> None:
    outcomes = run_ranks(3, dying_scenario, str(tmp_path / "repo"))
    assert outcomes[2].error_type == "NoReport"  # the process died mid-write
    for o in outcomes[:2]:
        assert o.value["ranks"] == (2,) and "rank(s) [2]" in o.value["message"], o.value
        assert o.value["s"] < 30
    assert not (tmp_path / "repo" / ".casnap" / "refs" / "d").exists()


# --- what an async take stages -------------------------------------------------------------

STAGING_CHUNK = 4096
W = 64 * 1024  # float32 elements of the replicated tensor: 256 KiB, 64 chunks
OWN = 3000  # float32 elements of each rank's own tensor


def _original(rank: int, step: int) -> dict[str, torch.Tensor]:
    """New bytes every step, so every take writes (dedup would skip reading them)."""
    w = torch.arange(W, dtype=torch.float32) + W * step
    own = torch.arange(OWN, dtype=torch.float32) + 1e6 * (1 + rank + 2 * step)
    return {"w": w, "own": own}


def _staged_take(root: str, step: int, rank: int, session: Any) -> dict[str, Any]:
    """async_take, mutate every tensor as soon as it returns, restore: the original values."""
    from casnap import Snapshot, StateDict

    pool = session.staging
    state = StateDict(_original(rank, step))
    before = pool.reused_bytes
    pool.peak_in_use_bytes = pool.in_use_bytes  # this take's peak only
    pending = Snapshot.async_take(
        f"{root}/a{step}",
        {"s": state},
        replicated=["s/w"],
        settings={"chunk_size": STAGING_CHUNK},
        session=session,
    )
    state["w"].mul_(-1.0)  # right after async_take returns: never in the snapshot
    state["own"].add_(100.0)
    snap = pending.wait(60)
    fresh = StateDict(w=torch.zeros(W), own=torch.zeros(OWN))
    Snapshot(f"{root}/a{step}").restore({"s": fresh})
    for k, v in _original(rank, step).items():
        assert torch.equal(fresh[k], v), (step, k)
    written = [s.raw_bytes_written for s in snap.last_take_rank_stats or []]
    return {
        "staged": pool.peak_in_use_bytes,
        "after": pool.in_use_bytes,
        "written": written,
        "reused": pool.reused_bytes - before,
    }


def staging_scenario(rank: int, world: int, root: str) -> dict[str, Any]:
    from casnap import Session
    from casnap.settings import Settings
    from casnap.take.target import staging_limit

    session = Session()
    roomy = [_staged_take(root, step, rank, session) for step in range(2)]
    os.environ["CASNAP_MEMORY_BUDGET"] = str(64 * 1024)  # well below each rank's share
    tight = _staged_take(root, 2, rank, session)
    limit = staging_limit(64 * 1024, Settings.from_env().with_overrides(chunk_size=STAGING_CHUNK))
    return {"roomy": roomy, "tight": tight, "limit": limit}


@pytest.mark.dist
def test_async_stages_only_assigned_chunks_under_budget(tmp_path: Path) -> None:
    out = values(run_ranks(2, staging_scenario, str(tmp_path / "repo")))
    unique = 4 * W + 2 * 4 * OWN  # w once, and each rank's own tensor
    for o in out:
        first, second = o["roomy"]
        assert sum(first["written"]) == sum(o["tight"]["written"]) == unique
        assert 0 < first["staged"] < 4 * W  # not the whole state: only this rank's chunks
        assert first["after"] == 0 and second["after"] == 0  # buffers went back to the pool
        assert second["staged"] == first["staged"] and second["reused"] == second["staged"]
        assert o["tight"]["staged"] <= o["limit"] < first["staged"]  # the rest was written first
        assert o["tight"]["after"] == 0
    assert sum(o["roomy"][0]["staged"] for o in out) == unique  # every chunk staged by one rank


# --- the planning exchange -------------------------------------------------------------------


def gather_scenario(rank: int, world: int) -> dict[str, Any]:
    from casnap.distributed import DistributedTakeError
    from casnap.distributed.group import Failure, all_gather, resolve_group

    group = resolve_group(None)
    real, calls = dist.all_gather, []

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    dist.all_gather = counted  # the real collective, counted
    small = all_gather(group, {"rank": rank, "parents": ["a" * 40]}, "small")
    n_small = len(calls)
    # Rank 1's value is over the first gather's slot; the others' are not.
    big = all_gather(group, b"x" * (200_000 if rank == 1 else rank), "big")
    n_big = len(calls) - n_small
    empty = all_gather(group, b"", "empty")
    try:
        all_gather(group, Failure(rank, "disk full", "OSError") if rank == 2 else None, "failing")
        failed = ""
    except DistributedTakeError as exc:
        failed = str(exc)
    try:  # a value rank 1 cannot pickle: every rank learns it at once, not at a timeout
        all_gather(group, (lambda: None) if rank == 1 else rank, "unpicklable")
        unpicklable = ""
    except DistributedTakeError as exc:
        unpicklable = str(exc)
    return {
        "small": small,
        "n_small": n_small,
        "big": big,
        "n_big": n_big,
        "empty": empty,
        "failed": failed,
        "unpicklable": unpicklable,
    }


@pytest.mark.dist
def test_all_gather_one_collective_when_small_two_when_not() -> None:
    got = values(run_ranks(3, gather_scenario))
    for o in got:
        assert o["small"] == [{"rank": r, "parents": ["a" * 40]} for r in range(3)]
        assert o["n_small"] == 1  # all_gather_object would issue two
        assert o["big"] == [b"", b"x" * 200_000, b"xx"] and o["n_big"] == 2
        assert o["empty"] == [b""] * 3
        assert "failing on rank(s) [2]: rank 2: disk full" in o["failed"]
        assert "unpicklable on rank(s) [1]" in o["unpicklable"], o["unpicklable"]


# The plan cache reuses the previous take's structure (casnap/distributed/plan_cache.py).
CACHE_OPTS = {"chunk_size": 4096}
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


def _cached_state(rank: int, extra: bool = False) -> dict[str, Any]:
    from casnap import StateDict

    g = torch.Generator().manual_seed(7)
    shared = {f"t{i}": torch.randn(64 + i % 5, generator=g) for i in range(TENSORS)}
    own = StateDict(x=torch.full((100,), float(rank)), step=1, lr=0.125)
    if extra:
        own["new"] = torch.arange(10.0) + rank
    return {"shared": StateDict(shared), "own": own}


def _cached_take(root: str, name: str, app: dict[str, Any], session: Any) -> tuple[Any, Any]:
    from casnap import Snapshot

    snap = Snapshot.take(
        f"{root}/{name}", app, replicated=["shared/**"], settings=CACHE_OPTS, session=session
    )
    return snap, session.plan_cache.last


def _assert_restores(root: str, name: str, app: dict[str, Any], rank: int, extra: bool) -> None:
    from casnap import Snapshot

    fresh = _cached_state(rank, extra)
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
    app = _cached_state(rank)
    s1, first = _cached_take(root, "s1", app, session)
    app["own"]["step"] = 2  # primitives are content: the structure still holds
    app["own"]["x"].add_(1.0)
    app["shared"]["t3"].mul_(2.0)
    s2, second = _cached_take(root, "s2", app, session)
    _assert_restores(root, "s2", app, rank, False)
    session = Session()  # every rank: the plain exchange of the same state, for comparison
    s2b, plain = _cached_take(root, "s2b", app, session)
    assert s2b.get_manifest() == s2.get_manifest()  # bit-identical entries

    # A structure change on rank 1 only: it sends its structure, rank 0 stays compact.
    app = _cached_state(rank, extra=rank == 1)
    s3, changed = _cached_take(root, "s3", app, session)
    _assert_restores(root, "s3", app, rank, rank == 1)
    assert "1/own/new" in s3.get_manifest() and "0/own/new" not in s3.get_manifest()

    # Rank 0 restarted (empty cache): a second gather recovers rank 1's structure.
    if rank == 0:
        session = Session()
    app["own"]["x"].add_(5.0)
    s4, restarted = _cached_take(root, "s4", app, session)
    _assert_restores(root, "s4", app, rank, rank == 1)
    s4b, _ = _cached_take(root, "s4b", app, Session())
    assert s4b.get_manifest() == s4.get_manifest()

    # Replicas are still checked on a reused plan.
    s5, again = _cached_take(root, "s5", app, session)
    mismatch = ""
    if rank == 1:
        app["shared"]["t0"].add_(1.0)
    try:
        with override(replica_mismatch="error"):
            _cached_take(root, "s6", app, session)
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


def test_assignment_balances_replicated_bytes() -> None:
    chunks = tuple((f"{i:064x}", 1000 + (i % 3)) for i in range(40))
    plans = [
        RankPlan(r, 1024, {f"{r}/m/w": TensorPlan("float32", (10,), True, chunks)})
        for r in range(4)
    ]
    writers, load = assign(plans)
    assert len(writers) == 40 and sum(load) == sum(s for _, s in chunks)
    assert max(load) <= 1.05 * sum(load) / 4
    assert writers == assign(list(reversed(plans)))[0]  # order-independent
