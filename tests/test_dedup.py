"""Dedup across snapshots, packing of small tensors, and reads that fetch only what they need."""

from __future__ import annotations

import math

import helpers
import pytest
import torch
from helpers import take_stats, tensor_entry

from casnap import Repository, Snapshot, StateDict
from casnap.repo.repository import RepoStorage
from casnap.store import CountingStore

CHUNK = 64 * 1024


def counted_repo(root: str) -> tuple[Repository, CountingStore]:
    return helpers.counted_repo(root, CHUNK)


def opts(repo: Repository) -> dict:
    return {"repository": repo, "settings": {"chunk_size": CHUNK}}


def data_keys(keys: list[str], repo: Repository) -> list[str]:
    """The chunk data among ``keys``: chunks and packs, not the repository's manifest
    parts (metadata stored as loose objects: docs/format.md, "Manifest parts")."""
    parts = {
        p.hash
        for m in repo.storage.iter_manifest_names()
        for p in repo.storage.read_manifest(m).parts
    }
    return [
        k
        for k in keys
        if k.startswith((".casnap/chunks/", ".casnap/packs/")) and k.rsplit("/", 1)[1] not in parts
    ]


def many_tensors(n: int = 100, seed: int = 0) -> StateDict:
    g = torch.Generator().manual_seed(seed)
    state = StateDict()
    for i in range(n):
        # a mix of multi-chunk tensors (loose objects) and small ones (packed)
        numel = 40_000 if i % 10 == 0 else 500 + i
        state[f"t{i}"] = torch.randn(numel, generator=g)
    return state


def test_second_take_of_unchanged_state_writes_no_chunk_data(tmp_path):
    repo, store = counted_repo(str(tmp_path / "repo"))
    state = {"model": torch.nn.Linear(300, 200), "extra": many_tensors()}
    Snapshot.take(str(tmp_path / "repo" / "s1"), state, **opts(repo))
    assert data_keys(store.written_keys, repo), "the first take writes chunk data"
    store.reset()
    snap = Snapshot.take(str(tmp_path / "repo" / "s2"), state, **opts(repo))
    assert data_keys(store.written_keys, repo) == []
    # besides the take's own lease (a gc root while it runs), only the manifest and the ref
    written = [k for k in store.written_keys if not k.startswith(".casnap/leases/")]
    assert sorted(written) == sorted(
        [f".casnap/manifests/{snap.manifest_hash[:2]}/{snap.manifest_hash}", ".casnap/refs/s2"]
    )
    assert take_stats(snap).stored_bytes_written == 0


def test_unchanged_state_dedups_across_processes_by_loose_chunk(tmp_path):
    # No lineage (as if in a new process): large chunks are still found in the store.
    repo, store = counted_repo(str(tmp_path / "repo"))
    state = {"w": StateDict(w=torch.randn(100_000))}
    Snapshot.take(str(tmp_path / "repo" / "s1"), state, **opts(repo))
    store.reset()
    Snapshot.take(str(tmp_path / "repo" / "s2"), state, **opts(repo))
    assert data_keys(store.written_keys, repo) == []


@pytest.mark.parametrize("which", ["t0", "t7"])  # t0 spans loose chunks, t7 is packed
def test_changing_one_tensor_of_100_writes_only_its_chunks(tmp_path, which):
    repo, store = counted_repo(str(tmp_path / "repo"))
    state = many_tensors()
    Snapshot.take(str(tmp_path / "repo" / "s1"), {"s": state}, **opts(repo))
    state[which].add_(1.0)
    store.reset()
    snap = Snapshot.take(str(tmp_path / "repo" / "s2"), {"s": state}, **opts(repo))
    entry = tensor_entry(snap.get_manifest(), f"0/s/{which}")
    nbytes = state[which].numel() * 4
    written = data_keys(store.written_keys, repo)
    if entry.chunks[0].pack is None:
        assert sorted(written) == sorted(
            f".casnap/chunks/{c.hash[:2]}/{c.hash}" for c in entry.chunks
        )
        assert len(written) == math.ceil(nbytes / CHUNK)
    else:
        assert written == [f".casnap/packs/{entry.chunks[0].pack[:2]}/{entry.chunks[0].pack}"]
    stats = take_stats(snap)
    assert stats.raw_bytes_written == nbytes
    # every other tensor is referenced, not rewritten
    assert stats.chunks_written == len(entry.chunks)


def test_a_thousand_small_tensors_become_a_handful_of_objects(tmp_path):
    repo, store = counted_repo(str(tmp_path / "repo"))
    g = torch.Generator().manual_seed(1)
    state = StateDict({f"bias{i}": torch.randn(64, generator=g) for i in range(1000)})
    snap = Snapshot.take(str(tmp_path / "repo" / "s1"), {"s": state}, **opts(repo))
    objects = data_keys(store.written_keys, repo)
    total = 1000 * (64 * 4)
    assert 1 <= len(objects) <= math.ceil(total / (4 << 20)) + 1
    # ...and any one of them can still be read alone, with one small ranged read.
    fresh = Snapshot(str(tmp_path / "repo" / "s1"), repository=repo)
    assert fresh.manifest.entries  # load the manifest before counting
    store.reset()
    got = fresh.read_object("0/s/bias517")
    assert torch.equal(got, state["bias517"])
    ref = tensor_entry(snap.get_manifest(), "0/s/bias517").chunks[0]
    assert store.requests["get_range"] == 1 and store.requests["get"] == 0
    assert store.bytes_read == ref.length


def test_read_object_reads_only_that_tensors_chunks(tmp_path):
    repo, store = counted_repo(str(tmp_path / "repo"))
    g = torch.Generator().manual_seed(2)
    state = StateDict({f"w{i}": torch.randn(50_000, generator=g) for i in range(10)})
    Snapshot.take(str(tmp_path / "repo" / "s1"), {"s": state}, **opts(repo))
    snap = Snapshot(str(tmp_path / "repo" / "s1"), repository=repo)
    entry = tensor_entry(snap.get_manifest(), "0/s/w3")
    store.reset()
    out = torch.empty(50_000)
    got = snap.read_object("0/s/w3", obj_out=out)
    assert got is out and torch.equal(out, state["w3"])
    assert store.bytes_read == sum(c.length for c in entry.chunks)
    wanted = {f".casnap/chunks/{c.hash[:2]}/{c.hash}" for c in entry.chunks}
    wanted |= {f".casnap/packs/{c.pack[:2]}/{c.pack}" for c in entry.chunks if c.pack}
    assert set(store.read_keys) <= wanted


def test_identical_tensors_within_one_take_are_stored_once(tmp_path):
    repo, store = counted_repo(str(tmp_path / "repo"))
    t = torch.randn(30_000)
    state = StateDict(a=t, b=t.clone(), c=t.clone())
    snap = Snapshot.take(str(tmp_path / "repo" / "s1"), {"s": state}, **opts(repo))
    m = snap.get_manifest()
    assert (
        tensor_entry(m, "0/s/a").chunks
        == tensor_entry(m, "0/s/b").chunks
        == tensor_entry(m, "0/s/c").chunks
    )
    assert take_stats(snap).raw_bytes_written == t.numel() * 4


def test_compressible_chunks_are_stored_smaller_and_incompressible_raw(tmp_path):
    repo, _store = counted_repo(str(tmp_path / "repo"))
    state = StateDict(zeros=torch.zeros(200_000), noise=torch.randn(200_000))
    snap = Snapshot.take(str(tmp_path / "repo" / "s1"), {"s": state}, **opts(repo))
    m = snap.get_manifest()
    zeros_stored = sum(c.length for c in tensor_entry(m, "0/s/zeros").chunks)
    noise_stored = sum(c.length for c in tensor_entry(m, "0/s/noise").chunks)
    assert zeros_stored < 0.05 * 800_000
    # random float32 mantissas barely compress: stored raw, header overhead only
    assert 800_000 <= noise_stored <= 800_000 + 56 * len(tensor_entry(m, "0/s/noise").chunks)
    fresh = StateDict(zeros=torch.ones(200_000), noise=torch.empty(200_000))
    Snapshot(str(tmp_path / "repo" / "s1"), repository=repo).restore({"s": fresh})
    assert torch.equal(fresh["zeros"], state["zeros"]) and torch.equal(
        fresh["noise"], state["noise"]
    )


def test_chunk_size_of_a_new_repository_is_remembered(tmp_path):
    state = {"s": StateDict(w=torch.randn(50_000))}
    Snapshot.take(str(tmp_path / "repo" / "s1"), state, settings={"chunk_size": 8192})
    assert RepoStorage.open(str(tmp_path / "repo")).config.chunk_size == 8192
    snap = Snapshot.take(str(tmp_path / "repo" / "s2"), state)  # no option: the repo's size
    assert tensor_entry(snap.get_manifest(), "0/s/w").chunk_size == 8192
    assert take_stats(snap).chunks_written == 0
