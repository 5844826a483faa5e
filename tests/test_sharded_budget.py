"""Reading sharded entries stays under the memory budget (single process).

The repository is written by hand here (chunks through the real ChunkWriter,
a manifest with a ``sharded`` entry, a ref), as a distributed take would have
left it; reading it needs no process group.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from casnap import Snapshot, StateDict
from casnap.chunks.write import ChunkWriter
from casnap.format.entries import ContainerEntry, ShardedEntry, ShardRecord
from casnap.format.manifest import Manifest
from casnap.repo.repository import RepoStorage, now_iso
from casnap.restore import reshard
from casnap.settings import Settings
from casnap.torch_io.tensors import byte_view

CHUNK = 16 * 1024
ROWS, COLS, PARTS = 256, 64, 8  # 64 KiB, stored as 8 row shards of 8 KiB


def sharded_snapshot(root: str, full: torch.Tensor, parts: int, container: bool = False) -> str:
    """A snapshot whose entry ``0/m/w`` is ``full`` in ``parts`` row shards (and, with
    ``container``, ``0/m`` the dict that holds it, so that ``restore`` finds ``m``)."""
    repo = RepoStorage.open_or_create(root, chunk_size=CHUNK)
    settings = Settings.from_env().with_overrides(chunk_size=CHUNK)
    per = full.shape[0] // parts
    shards = []
    with ThreadPoolExecutor(2) as pool:
        writer = ChunkWriter(repo, settings, pool)
        for p in range(parts):
            piece = full[p * per : (p + 1) * per].contiguous()
            view = byte_view(piece)
            futures = [writer.add(view[i : i + CHUNK]) for i in range(0, len(view), CHUNK)]
            refs = writer.finish(futures)
            shards.append(
                ShardRecord(
                    offsets=[p * per, 0], sizes=[per, full.shape[1]], chunk_size=CHUNK, chunks=refs
                )
            )
    repo.store.flush()
    entry = ShardedEntry(layout="dtensor", dtype="float32", shape=list(full.shape), shards=shards)
    entries: dict[str, Any] = {"0/m/w": entry}
    if container:
        entries["0/m"] = ContainerEntry(type="dict", keys=["w"])
    manifest = Manifest(created_at=now_iso(), world_size=parts, entries=entries)
    repo.write_ref("s1", repo.write_manifest(manifest)[0])
    return f"{root}/s1"


@pytest.fixture
def staged(monkeypatch):
    """Records the most staging bytes held at once, across every sharded sink."""
    held = {"now": 0, "peak": 0}
    real_allocate, real_copy_out = reshard.ShardedSink.allocate, reshard.ShardedSink.copy_out

    def allocate(self, shards):
        held["now"] += sum(n for si, n in self.shard_units() if si in shards)
        held["peak"] = max(held["peak"], held["now"])
        real_allocate(self, shards)

    def copy_out(self, shards):
        real_copy_out(self, shards)
        held["now"] -= sum(n for si, n in self.shard_units() if si in shards)

    monkeypatch.setattr(reshard.ShardedSink, "allocate", allocate)
    monkeypatch.setattr(reshard.ShardedSink, "copy_out", copy_out)
    return held


@pytest.mark.parametrize("budget", [32 * 1024, 64 * 1024, None])
def test_read_object_of_a_sharded_entry_stages_a_group_of_shards_at_a_time(
    tmp_path, staged, budget
):
    full = torch.randn(ROWS, COLS)
    path = sharded_snapshot(str(tmp_path / "repo"), full, PARTS)
    out = Snapshot(path).read_object("0/m/w", memory_budget_bytes=budget)
    assert torch.equal(out, full)
    shard_bytes = full.numel() * 4 // PARTS
    if budget is None:  # the default budget holds every shard at once
        assert staged["peak"] == full.numel() * 4
    else:
        assert staged["peak"] <= budget // 2
        assert staged["peak"] >= shard_bytes  # one shard at least
    assert staged["now"] == 0


def test_read_into_a_plain_tensor_in_place_under_a_small_budget(tmp_path, staged):
    full = torch.randn(ROWS, COLS)
    path = sharded_snapshot(str(tmp_path / "repo"), full, PARTS)
    target = torch.zeros(ROWS, COLS)
    out = Snapshot(path).read_object("0/m/w", obj_out=target, memory_budget_bytes=20 * 1024)
    assert out is target and torch.equal(target, full)
    assert staged["peak"] == full.numel() * 4 // PARTS  # 8 KiB shards, one at a time


def test_a_shard_larger_than_half_the_budget_is_staged_alone(tmp_path, staged):
    full = torch.randn(ROWS, COLS)
    path = sharded_snapshot(str(tmp_path / "repo"), full, 2)  # 32 KiB shards
    out = Snapshot(path).read_object("0/m/w", memory_budget_bytes=16 * 1024)
    assert torch.equal(out, full)
    assert staged["peak"] == full.numel() * 4 // 2


def test_restore_progress_counts_the_chunks_of_sharded_entries(tmp_path):
    full = torch.randn(ROWS, COLS)
    path = sharded_snapshot(str(tmp_path / "repo"), full, PARTS, container=True)
    calls: list[tuple[int, int]] = []
    target = {"m": StateDict(w=torch.zeros(ROWS, COLS))}
    Snapshot(path).restore(
        target, progress=lambda done, total: calls.append((done, total)), memory_budget_bytes=None
    )
    assert torch.equal(target["m"]["w"], full)
    dones = [d for d, _ in calls]
    assert dones == sorted(dones)
    assert {t for _, t in calls} == {full.numel() * 4}  # every stored shard is needed
    assert dones[-1] == full.numel() * 4
