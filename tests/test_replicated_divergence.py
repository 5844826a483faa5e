"""Values declared replicated that differ between ranks (``-m dist``, docs/distributed.md).

By default the take succeeds with a :class:`casnap.errors.ReplicaMismatchWarning`
naming the keys and the ranks, and keeps every rank's own value;
``replica_mismatch="error"`` fails the take on every rank with no ref written.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_harness import run_ranks, values

pytestmark = pytest.mark.dist

OPTS = {"chunk_size": 4096}


def _state(rank: int) -> dict[str, Any]:
    from casnap import StateDict

    # "w" differs between ranks; "same" really is replicated.
    return {"s": StateDict(w=torch.full((8,), float(rank + 1)), same=torch.arange(6.0))}


def warn_scenario(rank: int, world: int, root: str) -> dict[str, Any]:
    from casnap import Snapshot, StateDict
    from casnap.errors import ReplicaMismatchWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        snap = Snapshot.take(f"{root}/s1", _state(rank), replicated=["s/**"], storage_options=OPTS)
    found = [w for w in caught if issubclass(w.category, ReplicaMismatchWarning)]
    manifest = snap.get_manifest()
    flags = {
        f"{r}/{k}": manifest[f"{r}/s/{k}"].replicated for r in range(world) for k in ("w", "same")
    }
    # Each rank restores its own value of the diverged key, and the shared one.
    target = StateDict(w=torch.zeros(8), same=torch.zeros(6))
    Snapshot(f"{root}/s1").restore({"s": target})
    assert torch.equal(target["w"], torch.full((8,), float(rank + 1)))
    assert torch.equal(target["same"], torch.arange(6.0))
    # Nothing is dropped: every rank's value can be read back from any rank.
    read = [snap.read_object(f"{r}/s/w")[0].item() for r in range(world)]
    return {
        "messages": [str(w.message) for w in found],
        "where": [w.filename for w in found],
        "mismatches": [w.message.mismatches for w in found],  # type: ignore[union-attr]
        "flags": flags,
        "read": read,
    }


def test_default_warns_naming_keys_and_ranks_and_keeps_each_value(tmp_path: Path) -> None:
    out = values(run_ranks(2, warn_scenario, str(tmp_path / "repo")))
    for o in out:  # every rank warns, once
        (message,) = o["messages"]
        assert "s/w: ranks [0] vs [1]" in message and "s/same" not in message, message
        assert o["mismatches"] == [{"s/w": [[0], [1]]}]
        # The diverged key became per-rank state; the equal one stays replicated.
        assert o["flags"] == {"0/w": False, "1/w": False, "0/same": True, "1/same": True}
        assert o["read"] == [1.0, 2.0]
        assert o["where"] == [__file__]  # the warning points at the line calling take
    assert (tmp_path / "repo" / ".casnap" / "refs" / "s1").exists()


def error_scenario(rank: int, world: int, root: str) -> dict[str, Any]:
    from casnap import Snapshot
    from casnap.errors import ReplicaMismatchError
    from casnap.settings import override

    errors = []
    # Through storage_options, and through the setting (set on rank 0 only: its choice
    # holds on every rank, so no rank is left waiting for another that chose otherwise).
    for name, opts, setting in (
        ("e1", {**OPTS, "replica_mismatch": "error"}, None),
        ("e2", OPTS, "error" if rank == 0 else None),
    ):
        try:
            with override(replica_mismatch=setting):
                Snapshot.take(
                    f"{root}/{name}", _state(rank), replicated=["s/**"], storage_options=opts
                )
        except ReplicaMismatchError as exc:
            errors.append((str(exc), exc.mismatches))
    return {"errors": errors}


def test_the_error_option_fails_every_rank_without_a_ref(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    out = values(run_ranks(2, error_scenario, str(root)))
    for o in out:
        assert len(o["errors"]) == 2, o
        for text, mismatches in o["errors"]:
            assert "s/w: ranks [0] vs [1]" in text and "nothing was written" in text
            assert mismatches == {"s/w": [[0], [1]]}
    refs = root / ".casnap" / "refs"
    assert not (refs / "e1").exists() and not (refs / "e2").exists()


def dtensor_scenario(rank: int, world: int, root: str) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor, Replicate, init_device_mesh

    from casnap import Snapshot, StateDict
    from casnap.errors import ReplicaMismatchWarning

    mesh = init_device_mesh("cpu", (world,))

    def replicated(fill: float) -> Any:
        return DTensor.from_local(torch.full((6,), fill), mesh, [Replicate()], run_check=False)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Snapshot.take(
            f"{root}/d", {"m": StateDict(r=replicated(float(rank)))}, storage_options=OPTS
        )
    found = [str(w.message) for w in caught if issubclass(w.category, ReplicaMismatchWarning)]
    target = StateDict(r=replicated(-1.0))
    Snapshot(f"{root}/d").restore({"m": target})
    return {"warned": found, "restored": target["r"].to_local().tolist()}


def test_a_replicated_dtensor_that_differs_keeps_each_ranks_value(tmp_path: Path) -> None:
    out = values(run_ranks(2, dtensor_scenario, str(tmp_path / "repo")))
    for rank, o in enumerate(out):
        (message,) = o["warned"]
        assert "m/r[offsets=[0]]: ranks [0] vs [1]" in message, message
        assert o["restored"] == [float(rank)] * 6


# Large replicated chunks are compared by check id, and only their writer hashes them
# (casnap.distributed.replica_check): 4 chunks of 256 KiB, 2 written by each rank.
BIG = {"chunk_size": "256KiB"}
BIG_NUMEL = 4 * (256 << 10) // 4  # float32


def _big(rank: int, diverge_at: int | None) -> torch.Tensor:
    w = torch.arange(BIG_NUMEL, dtype=torch.float32)
    if rank == 1 and diverge_at is not None:
        w[diverge_at * (BIG_NUMEL // 4) + 1000] += 0.5  # one value, in chunk ``diverge_at``
    return w


def big_scenario(rank: int, world: int, root: str) -> dict[str, Any]:
    from casnap import Snapshot, StateDict
    from casnap.errors import ReplicaMismatchError, ReplicaMismatchWarning
    from casnap.format.names import hash_bytes
    from casnap.torch_io.tensors import byte_view

    def take(name: str, diverge_at: int | None, **opts: Any) -> tuple[Any, list[str]]:
        state = {"s": StateDict(w=_big(rank, diverge_at))}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            snap = Snapshot.take(
                f"{root}/{name}", state, replicated=["s/**"], storage_options={**BIG, **opts}
            )
        found = [str(w.message) for w in caught if issubclass(w.category, ReplicaMismatchWarning)]
        return snap, found

    equal, warned = take("equal", None)
    entry = equal.get_manifest()[f"{rank}/s/w"]
    value = _big(rank, None)
    mine = byte_view(value)  # valid while ``value`` lives
    cs = 256 << 10
    out: dict[str, Any] = {
        "equal_warned": warned,
        "equal_replicated": entry.replicated,
        # The manifest names content hashes (blake3 of the bytes), not check ids.
        "hashes_are_content": [r.hash for r in entry.chunks]
        == [hash_bytes(mine[i * cs : (i + 1) * cs]) for i in range(4)],
        "written": [s.raw_bytes_written for s in equal.last_take_rank_stats or []],
    }
    again, _ = take("again", None)  # unchanged: every chunk found by its real hash
    out["again_written"] = [s.raw_bytes_written for s in again.last_take_rank_stats or []]
    # Rank 1 diverges in one chunk, each chunk in turn: two of them are chunks rank 0
    # writes when the values agree, which rank 1 then never hashes.
    out["diverged"] = []
    for at in range(4):
        snap, warned = take(f"d{at}", at)
        target = StateDict(w=torch.zeros(BIG_NUMEL))
        Snapshot(f"{root}/d{at}").restore({"s": target})
        out["diverged"].append(
            {
                "warned": warned,
                "own": torch.equal(target["w"], _big(rank, at)),
                "replicated": snap.get_manifest()[f"{rank}/s/w"].replicated,
            }
        )
    try:
        take("err", 2, replica_mismatch="error")
        out["error"] = None
    except ReplicaMismatchError as exc:
        out["error"] = exc.mismatches
    return out


def test_a_divergence_in_a_large_chunk_another_rank_writes_is_detected(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    out = values(run_ranks(2, big_scenario, str(root)))
    for o in out:
        assert o["equal_warned"] == [] and o["equal_replicated"] is True
        assert o["hashes_are_content"]
        assert o["written"] == [2 * (256 << 10)] * 2  # one copy, half each
        assert o["again_written"] == [0, 0]
        for d in o["diverged"]:
            (message,) = d["warned"]
            assert "s/w: ranks [0] vs [1]" in message, message
            assert d["own"] and d["replicated"] is False
        assert o["error"] == {"s/w": [[0], [1]]}
    assert not (root / ".casnap" / "refs" / "err").exists()
