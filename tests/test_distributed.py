"""Distributed take and restore on several CPU processes over gloo (select with ``-m dist``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks, values

pytestmark = pytest.mark.dist

CHUNK = 16384


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
    snap = Snapshot.take(f"{root}/s1", app, storage_options=opts)
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
    # naming the key and ranks; no ref (the default warns: tests/test_replicated_divergence.py).
    mismatch = None
    bad = StateDict(w=torch.full((4,), 1.0 if rank != 2 else 2.0))
    strict = {**opts, "replica_mismatch": "error"}
    try:
        Snapshot.take(f"{root}/bad", {"bad": bad}, replicated=["bad/**"], storage_options=strict)
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
        Snapshot.take(f"{root}/s2", app, storage_options=opts)
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
    again = Snapshot.take(f"{root}/s2", app, storage_options=opts)
    rerun = sum(s.raw_bytes_written for s in again.last_take_rank_stats or [])
    return {"written": written, "mismatch": mismatch, "failed": failed, "rerun": rerun}


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
        f"{root}/a1", {"s": state}, replicated=["s/w"], storage_options={"chunk_size": 4096}
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
        Snapshot.take(f"{root}/d", {"s": state}, storage_options={"chunk_size": 4096})
    except DistributedTakeError as exc:
        return {"message": str(exc), "ranks": exc.failed_ranks, "s": time.monotonic() - t0}
    return {"message": "", "ranks": (), "s": time.monotonic() - t0}


def test_dead_rank_fails_every_rank_in_bounded_time(tmp_path: Path) -> None:
    outcomes = run_ranks(3, dying_scenario, str(tmp_path / "repo"))
    assert outcomes[2].error_type == "NoReport"  # the process died mid-write
    for o in outcomes[:2]:
        assert o.value["ranks"] == (2,) and "rank(s) [2]" in o.value["message"], o.value
        assert o.value["s"] < 30
    assert not (tmp_path / "repo" / ".casnap" / "refs" / "d").exists()


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


def test_all_gather_one_collective_when_small_two_when_not() -> None:
    got = values(run_ranks(3, gather_scenario))
    for o in got:
        assert o["small"] == [{"rank": r, "parents": ["a" * 40]} for r in range(3)]
        assert o["n_small"] == 1  # all_gather_object would issue two
        assert o["big"] == [b"", b"x" * 200_000, b"xx"] and o["n_big"] == 2
        assert o["empty"] == [b""] * 3
        assert "failing on rank(s) [2]: rank 2: disk full" in o["failed"]
        assert "unpicklable on rank(s) [1]" in o["unpicklable"], o["unpicklable"]
