"""States of many small tensors: written in groups (one work item, no future per chunk).

What a user must still see: identical tensors stored once, the memory budget
held, an async take point-in-time, and a manifest that parses back to exactly
what the take built (its entries are built without running the validators).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch
from helpers import numbered_tensors, take_stats

from casnap import Session, Snapshot, StateDict
from casnap.chunks import ChunkWriter
from casnap.chunks.budget import ByteBudget
from casnap.format import codec, frame
from casnap.format.entries import ObjectEntry, TensorEntry
from casnap.format.names import hash_bytes
from casnap.format.parse import parse_manifest
from casnap.repo.repository import RepoStorage, manifest_key
from casnap.settings import Settings
from casnap.take import job


def _restored(path: str, like: StateDict) -> StateDict:
    out = StateDict({k: torch.empty_like(v) for k, v in like.items()})
    Snapshot(path).restore({"m": out})
    return out


def test_identical_small_tensors_are_stored_once_and_restore_bit_exact(tmp_path):
    state = StateDict(numbered_tensors(1500))
    for i in range(0, 1500, 3):  # a third are zeros (biases, fresh optimizer state)
        state[f"p{i}"] = torch.zeros(64)
    state["odd"] = torch.arange(10, dtype=torch.int16)[::2]  # not contiguous: copied
    state["conj"] = torch.randn(4, dtype=torch.complex64).conj()  # lazily conjugated
    snap = Snapshot.take(str(tmp_path / "repo" / "s1"), {"m": state})
    stats = take_stats(snap)
    assert stats.chunks == 1502
    assert stats.chunks_written == 1000 + 1 + 2  # the zeros once
    out = _restored(str(tmp_path / "repo" / "s1"), state)
    for k, v in state.items():
        assert torch.equal(out[k], v.resolve_conj()), k


def test_the_manifest_a_take_builds_is_the_one_read_back(tmp_path):
    session = Session()
    state = StateDict(numbered_tensors(300))
    path = str(tmp_path / "repo" / "s1")
    snap = Snapshot.take(path, {"m": state}, session=session)
    repo = RepoStorage.open(str(tmp_path / "repo"))
    name = repo.read_ref("s1").manifest
    data = repo.store.get(manifest_key(name))
    assert hash_bytes(data) == name
    assert parse_manifest(data, name, repo.parts.load) == snap.manifest  # same values
    state["p7"].add_(1)  # one tensor changes: a new entry among reused ones
    snap2 = Snapshot.take(str(tmp_path / "repo" / "s2"), {"m": state}, session=session)
    name2 = repo.read_ref("s2").manifest
    data2 = repo.store.get(manifest_key(name2))
    assert parse_manifest(data2, name2, repo.parts.load) == snap2.manifest
    assert take_stats(snap2).chunks_written == 1


class _RecordingBudget(ByteBudget):
    instances: list[_RecordingBudget] = []

    def __init__(self, limit: int) -> None:
        super().__init__(limit)
        _RecordingBudget.instances.append(self)


def test_grouped_small_tensors_stay_under_the_memory_budget(tmp_path, monkeypatch):
    monkeypatch.setattr(job, "ByteBudget", _RecordingBudget)
    _RecordingBudget.instances = []
    state = StateDict(numbered_tensors(1000, 1024))  # 4 MB of 4 KiB tensors, each one copied
    budget = 64 * 1024
    Snapshot.take(str(tmp_path / "repo" / "s1"), {"m": state}, memory_budget_bytes=budget)
    (b,) = _RecordingBudget.instances
    assert 0 < b.peak <= budget
    out = _restored(str(tmp_path / "repo" / "s1"), state)
    assert all(torch.equal(out[k], v) for k, v in state.items())


def test_async_take_of_small_tensors_is_point_in_time(tmp_path):
    state = StateDict(numbered_tensors(2000))
    expected = {k: v.clone() for k, v in state.items()}
    pending = Snapshot.async_take(
        str(tmp_path / "repo" / "s1"),
        {"m": state},
        memory_budget_bytes=16 * 1024,
        session=Session(),
    )
    for t in state.values():  # training goes on as soon as async_take returns
        t.fill_(3.0)
    snap = pending.wait()
    out = _restored(snap.path, state)
    for k, v in expected.items():
        assert torch.equal(out[k], v), k


@pytest.mark.parametrize("second", ["add", "add_small"])
def test_a_chunk_identical_to_a_grouped_one_gets_the_same_location(tmp_path, second):
    """A grouped chunk has no future; an identical chunk added after it waits for its pack."""
    from casnap.repo.repository import RepoStorage as Storage

    repo = Storage.open_or_create(str(tmp_path / "repo"))
    with ThreadPoolExecutor(2) as pool:
        writer = ChunkWriter(repo, Settings(), pool)
        data = b"\x01" * 300
        first = writer.add_small([data], [0])
        futures: list[Future] = []
        if second == "add":
            first.result()  # its frame is in the open pack, not yet written
            futures.append(writer.add(bytes(data)))
        else:
            writer.add_small([bytes(data)], [0])
        writer.finish(futures)
    h = first.result()[0]
    ref = writer.ref_of(h)
    assert ref.pack is not None and ref.size == 300
    assert all(f.result() == ref for f in futures)
    assert writer.stats.chunks == 2 and writer.stats.chunks_written == 1


def test_a_failed_pack_fails_chunks_waiting_on_a_grouped_one(tmp_path, monkeypatch):
    from casnap.errors import StoreError
    from casnap.repo.repository import RepoStorage as Storage

    repo = Storage.open_or_create(str(tmp_path / "repo"))

    def full(*args, **kwargs):
        raise StoreError("disk full")

    with ThreadPoolExecutor(2) as pool:
        writer = ChunkWriter(repo, Settings(), pool)
        writer.add_small([b"\x02" * 300], [0]).result()
        twin = writer.add(b"\x02" * 300)
        done = threading.Event()
        twin.add_done_callback(lambda _f: done.set())
        monkeypatch.setattr(repo.store, "put", full)
        with pytest.raises(StoreError):
            writer.finish([twin])
    assert done.is_set() and isinstance(twin.exception(), StoreError)


class _CountingCompressor:
    """zstd, counting its calls: how many trials a take made."""

    calls = 0

    def __init__(self, inner) -> None:
        self._inner = inner

    def compress(self, data):
        _CountingCompressor.calls += 1
        return self._inner.compress(data)


def _count_compressions(monkeypatch) -> None:
    real = frame.compressor

    def counting(level, grouped=False):
        return _CountingCompressor(real(level, grouped))

    monkeypatch.setattr(frame, "compressor", counting)
    _CountingCompressor.calls = 0


def _frames(path: str) -> dict[str, int]:
    """Each tensor's stored frame length (header + payload)."""
    entries = Snapshot(path).get_manifest().items()
    return {
        k: e.chunks[0].length
        for k, e in entries
        if isinstance(e, TensorEntry | ObjectEntry) and e.chunks
    }


def test_random_small_tensors_are_judged_together_not_each_tried(tmp_path, monkeypatch):
    _count_compressions(monkeypatch)
    path = str(tmp_path / "repo" / "s1")
    snap = Snapshot.take(path, {"m": StateDict(numbered_tensors(2000))})
    # Two groups of up to 1,024 tensors, five trials each: not five per tensor (and one
    # compression per part of the manifest: docs/format.md, "Manifest parts").
    assert _CountingCompressor.calls <= 20 + len(snap.manifest.parts)
    assert set(_frames(path).values()) == {codec.HEADER_SIZE + 256}  # stored raw, as before


def test_compressible_small_tensors_are_still_compressed(tmp_path):
    state = StateDict(numbered_tensors(600))
    for i in range(0, 600, 2):  # half of them constant (norm weights, fresh optimizer state)
        state[f"p{i}"] = torch.full((64,), float(i))
    path = str(tmp_path / "repo" / "s1")
    Snapshot.take(path, {"m": state})
    frames = _frames(path)
    assert all(frames[f"0/m/p{i}"] < codec.HEADER_SIZE + 64 for i in range(0, 600, 2))
    assert all(frames[f"0/m/p{i}"] == codec.HEADER_SIZE + 256 for i in range(1, 600, 2))
    out = _restored(path, state)
    assert all(torch.equal(out[k], v) for k, v in state.items())
