"""async_take staging reuse and failures; memory budgets of restore and read_object."""

from __future__ import annotations

import pytest
import torch

from casnap import Snapshot, StateDict, lineage, restore, staging
from casnap.budget import ByteBudget
from casnap.errors import StoreError


@pytest.fixture(autouse=True)
def _fresh():
    lineage.forget()
    staging.POOL.clear()
    yield
    lineage.forget()
    staging.POOL.clear()


def test_a_second_async_take_reuses_the_staging_buffers(tmp_path):
    state = StateDict(w=torch.randn(500_000), b=torch.randn(1000))
    Snapshot.async_take(str(tmp_path / "repo" / "s1"), {"m": state}).wait()
    allocated = staging.POOL.allocated_bytes
    assert allocated == 501_000 * 4
    state["w"].add_(1)
    pending = Snapshot.async_take(str(tmp_path / "repo" / "s2"), {"m": state})
    expected = state["w"].clone()
    state["w"].zero_()  # point in time: the snapshot keeps the staged values
    pending.wait()
    assert staging.POOL.allocated_bytes == allocated  # nothing new allocated
    assert staging.POOL.reused_bytes == allocated
    out = StateDict(w=torch.empty(500_000), b=torch.empty(1000))
    Snapshot(str(tmp_path / "repo" / "s2")).restore({"m": out})
    assert torch.equal(out["w"], expected)


def test_a_failing_background_write_surfaces_from_wait_with_its_type(tmp_path, monkeypatch):
    from casnap import repository

    def full_disk(self, manifest):
        raise StoreError("no space left on device while writing the manifest")

    monkeypatch.setattr(repository.Repository, "write_manifest", full_disk)
    pending = Snapshot.async_take(str(tmp_path / "repo" / "s1"), {"m": StateDict(w=torch.ones(10))})
    with pytest.raises(StoreError, match="no space"):
        pending.wait()
    assert pending.done()
    monkeypatch.undo()
    # the staging buffers went back to the pool even though the take failed
    assert staging.POOL._idle_bytes == 40


class RecordingBudget(ByteBudget):
    instances: list[RecordingBudget] = []

    def __init__(self, limit: int) -> None:
        super().__init__(limit)
        RecordingBudget.instances.append(self)


@pytest.mark.parametrize("budget", [64 * 1024, 1 << 20])
def test_read_object_and_restore_stay_under_the_memory_budget(tmp_path, monkeypatch, budget):
    monkeypatch.setattr(restore, "ByteBudget", RecordingBudget)
    RecordingBudget.instances = []
    state = StateDict(w=torch.randn(2_000_000))  # 8 MB in 64 KiB chunks
    Snapshot.take(str(tmp_path / "repo" / "s1"), {"m": state},
                  storage_options={"chunk_size": 64 * 1024})  # fmt: skip
    snap = Snapshot(str(tmp_path / "repo" / "s1"))
    out = torch.empty(2_000_000)
    snap.read_object("0/m/w", obj_out=out, memory_budget_bytes=budget)
    assert torch.equal(out, state["w"])
    target = StateDict(w=torch.empty(2_000_000))
    snap.restore({"m": target}, memory_budget_bytes=budget)
    assert torch.equal(target["w"], state["w"])
    assert len(RecordingBudget.instances) == 2
    for b in RecordingBudget.instances:
        # one chunk (raw + frame) may exceed a tiny budget alone, never more
        assert 0 < b.peak <= max(budget, 2 * (64 * 1024 + 56))
