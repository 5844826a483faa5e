"""Restore into new tensors and read_object: loose raw chunks read through reused buffers.

A loose raw chunk is read whole into a page-aligned buffer, verified there,
then copied to where it belongs (casnap/chunks/bounce.py says why). What a
user sees: bit-exact tensors, the memory budget kept, and no byte that fails
its check ever reaching a target, also one read in place without an undo copy.
"""

from __future__ import annotations

import mmap

import pytest
import torch
from helpers import tensor_entry

from casnap import IntegrityError, Repository, Snapshot, StateDict
from casnap.chunks import read as chunks_read
from casnap.chunks.bounce import BouncePool
from casnap.chunks.budget import ByteBudget
from casnap.format import codec
from casnap.store import LocalStore
from casnap.store.base import Buffer

CHUNK = 64 * 1024
ELEMS = CHUNK // 4
PATTERN = 7.25


def raw_state() -> dict[str, torch.Tensor]:
    """Loose raw chunks only (random floats do not compress), with odd-sized tails."""
    gen = torch.Generator().manual_seed(3)
    sizes = {"a": 6 * ELEMS, "b": 5 * ELEMS + 5000, "c": 2 * ELEMS + 9000, "d": ELEMS}
    return {k: torch.randn(n, generator=gen) for k, n in sizes.items()}


def take(tmp_path, state) -> Snapshot:
    snap = Snapshot.take(
        str(tmp_path / "repo" / "s1"),
        {"s": StateDict(state)},
        settings={"chunk_size": CHUNK, "compression": "none"},
    )
    refs = [r for k in state for r in tensor_entry(snap.get_manifest(), f"0/s/{k}").chunks]
    assert all(r.pack is None and r.length == codec.HEADER_SIZE + r.size for r in refs)
    return snap


def recorded_bounce_pools(monkeypatch) -> list[BouncePool]:
    pools: list[BouncePool] = []

    class Recorded(BouncePool):
        def __init__(self, budget: ByteBudget) -> None:
            super().__init__(budget)
            pools.append(self)

    monkeypatch.setattr(chunks_read, "BouncePool", Recorded)
    return pools


@pytest.mark.parametrize("budget", [3 * CHUNK, None])
def test_new_tensors_are_bit_exact_and_their_buffers_reused_within_the_budget(
    tmp_path, monkeypatch, budget
):
    state = raw_state()
    take(tmp_path, state)
    pools = recorded_bounce_pools(monkeypatch)
    fresh = StateDict({})
    Snapshot(str(tmp_path / "repo" / "s1")).restore({"s": fresh}, memory_budget_bytes=budget)
    assert fresh.keys() == state.keys()
    assert all(torch.equal(fresh[k], state[k]) for k in state)
    chunks = sum(-(-t.nbytes // CHUNK) for t in state.values())
    assert pools and sum(p.allocated for p in pools) < chunks  # buffers were reused
    for pool in pools:
        assert pool.budget.peak <= pool.budget.limit  # every buffer in use was budgeted
        assert pool.idle_bytes == 0  # dropped once the read is over


def test_read_object_of_one_tensor_reads_only_its_chunks(tmp_path, monkeypatch):
    state = raw_state()
    take(tmp_path, state)
    pools = recorded_bounce_pools(monkeypatch)
    got = Snapshot(str(tmp_path / "repo" / "s1")).read_object("0/s/b")
    assert torch.equal(got, state["b"])
    assert sum(p.allocated for p in pools) <= len(
        tensor_entry(Snapshot(str(tmp_path / "repo" / "s1")).get_manifest(), "0/s/b").chunks
    )


class FlippingStore(LocalStore):
    """A disk that returns one object with a flipped byte to ``read_into`` (``get`` and
    ``map`` read it right): damage that appears between two reads of one restore."""

    def __init__(self, root: str, key: str) -> None:
        super().__init__(root)
        self.key = key

    def map(self, key: str, limit: int, *, private: bool = False) -> Buffer | None:
        return None  # read, never mapped: the reads under test

    def read_into(self, key: str, buffers: list[memoryview]) -> int:
        n = super().read_into(key, buffers)
        if key == self.key:
            last = buffers[-1]
            last[len(last) - 1] ^= 0x01
        return n


def test_a_chunk_that_fails_its_check_never_reaches_an_in_place_target(tmp_path):
    """A target larger than half the budget is verified by a first read, then read in
    place with nothing saved: a chunk that fails its check on that second read is not
    written, so every chunk of the target holds its previous bytes or the snapshot's."""
    state = {"big": torch.randn(8 * ELEMS, generator=torch.Generator().manual_seed(5))}
    snap = take(tmp_path, state)
    ref = tensor_entry(snap.get_manifest(), "0/s/big").chunks[5]
    root = str(tmp_path / "repo")
    store = FlippingStore(root, f".casnap/chunks/{ref.hash[:2]}/{ref.hash}")
    target = {"big": torch.full_like(state["big"], PATTERN)}
    with pytest.raises(IntegrityError, match=ref.hash):
        Snapshot(f"{root}/s1", repository=Repository.on_store(store)).restore(
            {"s": StateDict(target)}, memory_budget_bytes=4 * CHUNK
        )
    for i, (old, new) in enumerate(
        zip(target["big"].split(ELEMS), state["big"].split(ELEMS), strict=True)
    ):
        is_old = torch.equal(old, torch.full_like(old, PATTERN))
        assert is_old or torch.equal(old, new), f"chunk {i} holds bytes that failed their check"
    assert torch.equal(target["big"][5 * ELEMS : 6 * ELEMS], torch.full((ELEMS,), PATTERN))


def test_bounce_buffers_are_page_aligned_reused_and_kept_within_the_limit():
    pool = BouncePool(ByteBudget(3 * mmap.PAGESIZE))
    with pool.buffer(100) as (view, address):
        assert len(view) == 100 and address % mmap.PAGESIZE == 0
        view[:] = b"x" * 100  # writable
        first = address
    with pool.buffer(mmap.PAGESIZE) as (_view, address):
        assert address == first  # the same page, reused
    with pool.buffer(2 * mmap.PAGESIZE) as (_v1, _a1), pool.buffer(mmap.PAGESIZE) as (_v2, _a2):
        pass  # the one-page buffer reused, a two-page one mapped
    assert pool.allocated == 2 and pool.idle_bytes == 3 * mmap.PAGESIZE
    with pool.buffer(3 * mmap.PAGESIZE) as (_view, _address):
        pass  # kept, it would make idle bytes exceed the limit: dropped
    assert pool.allocated == 3 and pool.idle_bytes == 3 * mmap.PAGESIZE
    pool.close()
    assert pool.idle_bytes == 0
