"""A restore that fails leaves every target tensor at its previous value or the snapshot's.

Real repositories in ``tmp_path``, damaged on disk (a flipped byte in a loose
chunk or in a packed frame, a deleted chunk) or read through a store that
drops the connection halfway through an object. Every target starts filled
with a known pattern; after the failed restore or ``read_object`` each one
must be bit-for-bit either that pattern or the snapshot's value, and the one
holding the damaged chunk must be the pattern.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers import chunk_path, flip_byte, pack_path, tensor_entry

from casnap import IntegrityError, Repository, Snapshot, StateDict
from casnap.chunks.write import ChunkWriter
from casnap.errors import CasnapError, StoreError
from casnap.format import codec
from casnap.format.entries import ChunkRef, ShardedEntry, ShardRecord
from casnap.format.manifest import Manifest
from casnap.repo.damage import list_damage
from casnap.repo.repository import RepoStorage, now_iso
from casnap.settings import Settings
from casnap.store import CountingStore, LocalStore
from casnap.store.base import Buffer, ObjectStore, WrapperStore
from casnap.torch_io.tensors import byte_view

CHUNK = 64 * 1024
ELEMS = CHUNK // 4
PATTERN = 7.25  # what every target holds before the restore


def state_of() -> dict[str, torch.Tensor]:
    """Tensors of several raw chunks, one compressible (zstd), one with a packed tail."""
    gen = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(4 * ELEMS, generator=gen),
        "b": torch.randn(5 * ELEMS, generator=gen),  # 5 raw loose chunks
        "z": torch.arange(6 * ELEMS, dtype=torch.float32),  # compresses: zstd frames
        "t": torch.randn(3 * ELEMS + 1000, generator=gen),  # 3 loose chunks + a packed tail
        "c": torch.randn(3 * ELEMS, generator=gen),
    }


def take(tmp_path, state: dict[str, torch.Tensor]) -> Snapshot:
    return Snapshot.take(
        str(tmp_path / "repo" / "s1"),
        {"s": StateDict(state)},
        settings={"chunk_size": CHUNK},
    )


def patterned(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.full_like(v, PATTERN) for k, v in state.items()}


def object_path(tmp_path, ref: ChunkRef) -> str:
    if ref.pack is not None:
        return str(pack_path(tmp_path / "repo", ref.pack))
    return str(chunk_path(tmp_path / "repo", ref.hash))


def damage(tmp_path, ref: ChunkRef) -> None:
    """Flip a byte in the payload of ``ref``'s frame (its last byte)."""
    start = ref.offset if ref.pack is not None else 0
    flip_byte(object_path(tmp_path, ref), start + ref.length - 1)


def assert_each_old_or_new(target, state, old_keys) -> None:
    for key, t in target.items():
        is_old = torch.equal(t, torch.full_like(t, PATTERN))
        is_new = torch.equal(t, state[key])
        assert is_old or is_new, f"{key} holds neither its previous value nor the snapshot's"
        if key in old_keys:
            assert is_old, f"{key} holds the snapshot's value, but its chunk is damaged"


def is_raw(ref: ChunkRef) -> bool:
    return ref.length == codec.HEADER_SIZE + ref.size


@pytest.mark.parametrize("which", [0, 2, 4])
def test_a_damaged_raw_loose_chunk_leaves_its_tensor_unchanged(tmp_path, which):
    state = state_of()
    snap = take(tmp_path, state)
    ref = tensor_entry(snap.get_manifest(), "0/s/b").chunks[which]
    assert ref.pack is None and is_raw(ref)
    damage(tmp_path, ref)
    target = patterned(state)
    with pytest.raises(IntegrityError, match=ref.hash):
        Snapshot(str(tmp_path / "repo" / "s1")).restore({"s": StateDict(target)})
    assert_each_old_or_new(target, state, {"b"})


def test_a_damaged_compressed_chunk_leaves_its_tensor_unchanged(tmp_path):
    state = state_of()
    snap = take(tmp_path, state)
    chunks = tensor_entry(snap.get_manifest(), "0/s/z").chunks
    assert all(ref.pack is None and not is_raw(ref) for ref in chunks)
    damage(tmp_path, chunks[3])
    target = patterned(state)
    with pytest.raises(IntegrityError, match=chunks[3].hash):
        Snapshot(str(tmp_path / "repo" / "s1")).restore({"s": StateDict(target)})
    assert_each_old_or_new(target, state, {"z"})


def test_a_damaged_packed_frame_leaves_its_tensor_unchanged(tmp_path):
    state = state_of()
    snap = take(tmp_path, state)
    tail = tensor_entry(snap.get_manifest(), "0/s/t").chunks[-1]
    assert tail.pack is not None
    damage(tmp_path, tail)
    target = patterned(state)
    with pytest.raises(IntegrityError, match=tail.pack):
        Snapshot(str(tmp_path / "repo" / "s1")).restore({"s": StateDict(target)})
    assert_each_old_or_new(target, state, {"t"})


def test_a_missing_chunk_leaves_its_tensor_unchanged(tmp_path):
    state = state_of()
    snap = take(tmp_path, state)
    ref = tensor_entry(snap.get_manifest(), "0/s/a").chunks[3]
    os.unlink(object_path(tmp_path, ref))
    target = patterned(state)
    with pytest.raises(IntegrityError, match="missing"):
        Snapshot(str(tmp_path / "repo" / "s1")).restore({"s": StateDict(target)})
    assert_each_old_or_new(target, state, {"a"})


class DroppingStore(WrapperStore):
    """Fails reading one object: halfway through ``read_into``, after part of it reached
    the caller's memory, or at ``map``. Without ``maps`` it cannot map (as every remote
    store), so the object is read with ``read_into``; with it, a local store maps."""

    def __init__(self, inner: ObjectStore, key: str, *, maps: bool) -> None:
        super().__init__(inner)
        self.key, self.maps = key, maps
        self.dropped_in: list[str] = []

    def _drop(self, op: str, key: str) -> None:
        if key == self.key:
            self.dropped_in.append(op)
            raise StoreError(f"connection reset while reading {key!r}", key)

    def read_into(self, key: str, buffers: list[memoryview]) -> int:
        n = self.inner.read_into(key, buffers)
        self._drop("read_into", key)
        return n

    def map(self, key: str, limit: int, *, private: bool = False) -> Buffer | None:
        if not self.maps:
            return None
        self._drop("map", key)
        return self.inner.map(key, limit, private=private)

    def get(self, key: str, *, limit: int | None = None) -> bytes:
        self._drop("get", key)
        return self.inner.get(key, limit=limit)


@pytest.mark.parametrize("maps", [False, True], ids=["read", "mapped"])
def test_a_store_error_mid_restore_leaves_its_tensor_unchanged(tmp_path, maps):
    state = state_of()
    snap = take(tmp_path, state)
    ref = tensor_entry(snap.get_manifest(), "0/s/c").chunks[1]
    key = f".casnap/chunks/{ref.hash[:2]}/{ref.hash}"
    root = str(tmp_path / "repo")
    store = DroppingStore(LocalStore(root), key, maps=maps)
    dropping = Repository.on_store(store)
    target = patterned(state)
    with pytest.raises(StoreError, match="connection reset"):
        Snapshot(f"{root}/s1", repository=dropping).restore({"s": StateDict(target)})
    assert store.dropped_in == ["map" if maps else "read_into"]
    assert_each_old_or_new(target, state, {"c"})


@pytest.mark.parametrize("which", [0, 3])
def test_read_object_into_obj_out_is_all_or_nothing(tmp_path, which):
    state = state_of()
    snap = take(tmp_path, state)
    ref = tensor_entry(snap.get_manifest(), "0/s/a").chunks[which]
    damage(tmp_path, ref)
    out = torch.full_like(state["a"], PATTERN)
    with pytest.raises(IntegrityError):
        Snapshot(str(tmp_path / "repo" / "s1")).read_object("0/s/a", obj_out=out)
    assert torch.equal(out, torch.full_like(out, PATTERN))


def test_read_object_of_a_container_into_obj_out(tmp_path):
    state = state_of()
    snap = take(tmp_path, state)
    damage(tmp_path, tensor_entry(snap.get_manifest(), "0/s/b").chunks[2])
    out = patterned(state)
    with pytest.raises(IntegrityError):
        Snapshot(str(tmp_path / "repo" / "s1")).read_object("0/s", obj_out=out)
    assert_each_old_or_new(out, state, {"b"})


@pytest.mark.parametrize("budget", [3 * CHUNK, 16 * CHUNK, None])
def test_all_or_nothing_under_any_budget(tmp_path, budget):
    """Small budgets read a tensor's chunks in several steps: still nothing mixed."""
    state = state_of()
    snap = take(tmp_path, state)
    intact = patterned(state)
    Snapshot(str(tmp_path / "repo" / "s1")).restore(
        {"s": StateDict(intact)}, memory_budget_bytes=budget
    )
    assert all(torch.equal(intact[k], state[k]) for k in state)
    damage(tmp_path, tensor_entry(snap.get_manifest(), "0/s/b").chunks[3])
    target = patterned(state)
    with pytest.raises(IntegrityError):
        Snapshot(str(tmp_path / "repo" / "s1")).restore(
            {"s": StateDict(target)}, memory_budget_bytes=budget
        )
    assert_each_old_or_new(target, state, {"b"})


# -- sharded entries ----------------------------------------------------------

SCHUNK = 16 * 1024
ROWS, COLS = 256, 64  # 64 KiB


def sharded_snapshot(root: str, full: torch.Tensor, parts: int) -> tuple[str, list[ShardRecord]]:
    """A repository holding ``full`` as ``parts`` row shards, as a distributed take leaves it."""
    repo = RepoStorage.open_or_create(root, chunk_size=SCHUNK)
    settings = Settings.from_env().with_overrides(chunk_size=SCHUNK, compression="none")
    per = full.shape[0] // parts
    shards = []
    with ThreadPoolExecutor(2) as pool:
        writer = ChunkWriter(repo, settings, pool)
        for p in range(parts):
            view = byte_view(full[p * per : (p + 1) * per].contiguous())
            futures = [writer.add(view[i : i + SCHUNK]) for i in range(0, len(view), SCHUNK)]
            refs = writer.finish(futures)
            shards.append(
                ShardRecord(
                    offsets=[p * per, 0], sizes=[per, full.shape[1]], chunk_size=SCHUNK, chunks=refs
                )
            )
    repo.store.flush()
    entry = ShardedEntry(layout="dtensor", dtype="float32", shape=list(full.shape), shards=shards)
    manifest = Manifest(created_at=now_iso(), world_size=parts, entries={"0/m/w": entry})
    repo.write_ref("s1", repo.write_manifest(manifest)[0])
    return f"{root}/s1", shards


@pytest.mark.parametrize("budget", [20 * 1024, 64 * 1024, None])
@pytest.mark.parametrize("damaged_shard", [0, 7])
def test_a_resharded_read_is_all_or_nothing(tmp_path, budget, damaged_shard):
    full = torch.randn(ROWS, COLS)
    path, shards = sharded_snapshot(str(tmp_path / "repo"), full, 8)
    damage(tmp_path, shards[damaged_shard].chunks[-1])
    target = torch.full((ROWS, COLS), PATTERN)
    with pytest.raises(IntegrityError):
        Snapshot(path).read_object("0/m/w", obj_out=target, memory_budget_bytes=budget)
    assert torch.equal(target, torch.full_like(target, PATTERN))


def test_errors_keep_their_type(tmp_path):
    """The rollback re-raises the original error, not a wrapper."""
    state = state_of()
    snap = take(tmp_path, state)
    damage(tmp_path, tensor_entry(snap.get_manifest(), "0/s/a").chunks[1])
    target = patterned(state)
    with pytest.raises(IntegrityError) as info:
        Snapshot(str(tmp_path / "repo" / "s1")).restore({"s": StateDict(target)})
    assert isinstance(info.value, CasnapError) and info.value.__cause__ is None


def recorded_pools(monkeypatch) -> list:
    """The undo pool of every restore that follows."""
    from casnap.restore import restore as restore_module
    from casnap.restore.undo import Undo

    pools = []

    class Recorded(Undo):
        def __init__(self) -> None:
            super().__init__()
            pools.append(self.pool)

    monkeypatch.setattr(restore_module, "Undo", Recorded)
    return pools


@pytest.mark.parametrize("budget", [16 * CHUNK, 40 * CHUNK])
def test_saved_bytes_stay_within_half_the_budget(tmp_path, monkeypatch, budget):
    """What a restore keeps to roll back counts against the memory budget."""
    pools = recorded_pools(monkeypatch)
    state = state_of()
    take(tmp_path, state)
    target = patterned(state)
    Snapshot(str(tmp_path / "repo" / "s1")).restore(
        {"s": StateDict(target)}, memory_budget_bytes=budget
    )
    assert all(torch.equal(target[k], state[k]) for k in state)
    (pool,) = pools
    assert 0 < pool.peak <= budget // 2
    assert pool.in_use == 0


# -- loose raw chunks verified on a mapping -------------------------------------


def raw_state() -> dict[str, torch.Tensor]:
    """Tensors of several loose raw chunks only (random floats do not compress)."""
    gen = torch.Generator().manual_seed(1)
    return {k: torch.randn(n * ELEMS, generator=gen) for k, n in (("a", 4), ("b", 5), ("c", 3))}


def counted(tmp_path) -> tuple[CountingStore, dict]:
    root = str(tmp_path / "repo")
    store = CountingStore(LocalStore(root))
    return store, {"repository": Repository.on_store(store)}


def chunk_keys(snap: Snapshot, state) -> set[str]:
    refs = [r for k in state for r in tensor_entry(snap.get_manifest(), f"0/s/{k}").chunks]
    assert all(r.pack is None and is_raw(r) for r in refs)
    return {f".casnap/chunks/{r.hash[:2]}/{r.hash}" for r in refs}


def test_loose_raw_chunks_are_verified_on_a_mapping_and_saved_nowhere(tmp_path, monkeypatch):
    pools = recorded_pools(monkeypatch)
    state = raw_state()
    snap = take(tmp_path, state)
    keys = chunk_keys(snap, state)
    store, options = counted(tmp_path)
    target = patterned(state)
    Snapshot(str(tmp_path / "repo" / "s1"), **options).restore({"s": StateDict(target)})
    assert all(torch.equal(target[k], state[k]) for k in state)
    assert set(store.mapped_keys) == keys  # every chunk read through a mapping
    (pool,) = pools
    assert pool.peak == 0  # no byte of any target was saved aside
    assert pool.held == 9 * CHUNK  # every chunk but each tensor's last held, then copied in


@pytest.mark.parametrize("which", [0, 2, 4])
def test_a_damaged_mapped_chunk_never_reaches_its_target(tmp_path, monkeypatch, which):
    """The tensor keeps its previous value with nothing saved: no byte of it was written."""
    pools = recorded_pools(monkeypatch)
    state = raw_state()
    snap = take(tmp_path, state)
    chunk_keys(snap, state)
    ref = tensor_entry(snap.get_manifest(), "0/s/b").chunks[which]
    damage(tmp_path, ref)
    store, options = counted(tmp_path)
    target = patterned(state)
    with pytest.raises(IntegrityError, match=ref.hash):
        Snapshot(str(tmp_path / "repo" / "s1"), **options).restore({"s": StateDict(target)})
    assert torch.equal(target["b"], torch.full_like(target["b"], PATTERN))
    assert_each_old_or_new(target, state, {"b"})
    assert f".casnap/chunks/{ref.hash[:2]}/{ref.hash}" in store.mapped_keys
    (pool,) = pools
    assert pool.peak == 0  # nothing saved, so nothing was rolled back either


def test_a_short_mapped_chunk_is_damage(tmp_path):
    state = raw_state()
    snap = take(tmp_path, state)
    ref = tensor_entry(snap.get_manifest(), "0/s/c").chunks[1]
    os.truncate(object_path(tmp_path, ref), ref.length - 100)
    store, options = counted(tmp_path)
    target = patterned(state)
    with pytest.raises(IntegrityError, match=ref.hash):
        Snapshot(str(tmp_path / "repo" / "s1"), **options).restore({"s": StateDict(target)})
    assert torch.equal(target["c"], torch.full_like(target["c"], PATTERN))
    assert_each_old_or_new(target, state, {"c"})
    damaged = list_damage(Repository(str(tmp_path / "repo")).storage)
    assert [d.chunk for d in damaged] == [ref.hash]  # recorded: the next take writes it again
