"""Distributed async_take stages only the chunks each rank writes, under the memory budget."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_harness import run_ranks, values

pytestmark = pytest.mark.dist

CHUNK = 4096
W = 64 * 1024  # float32 elements of the replicated tensor: 256 KiB, 64 chunks
OWN = 3000  # float32 elements of each rank's own tensor


def _original(rank: int, step: int) -> dict[str, torch.Tensor]:
    """New bytes every step, so every take writes (dedup would skip reading them)."""
    w = torch.arange(W, dtype=torch.float32) + W * step
    own = torch.arange(OWN, dtype=torch.float32) + 1e6 * (1 + rank + 2 * step)
    return {"w": w, "own": own}


def _async_take(root: str, step: int, rank: int, session: Any) -> dict[str, Any]:
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
        storage_options={"chunk_size": CHUNK},
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


def async_scenario(rank: int, world: int, root: str) -> dict[str, Any]:
    from casnap import Session
    from casnap.settings import Settings
    from casnap.take.target import staging_limit

    session = Session()
    roomy = [_async_take(root, step, rank, session) for step in range(2)]
    os.environ["CASNAP_MEMORY_BUDGET"] = str(64 * 1024)  # well below each rank's share
    tight = _async_take(root, 2, rank, session)
    limit = staging_limit(64 * 1024, Settings.from_env().with_overrides(chunk_size=CHUNK))
    return {"roomy": roomy, "tight": tight, "limit": limit}


def test_async_stages_only_assigned_chunks_under_budget(tmp_path: Path) -> None:
    out = values(run_ranks(2, async_scenario, str(tmp_path / "repo")))
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
