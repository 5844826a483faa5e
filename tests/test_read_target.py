"""The read target contract: every chunk reaches the target once, verified, by a path it offers.

One snapshot holds every kind of chunk a read meets: loose raw chunks, a
loose compressed one, small packed ones and delta chains. A recording target
offers some of :class:`~casnap.chunks.target.ReadTarget`'s paths and checks
what arrives where.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from casnap import Session, Snapshot, StateDict
from casnap.chunks.budget import ByteBudget
from casnap.chunks.read import read_chunks
from casnap.chunks.target import Buffer, ReadTarget
from casnap.format.entries import ChunkRef
from casnap.format.names import hash_bytes

CHUNK = 64 * 1024
ROWS, COLS = 256, 256  # fp32: 256 KiB, 4 chunks


def _snapshot(root: Path) -> str:
    """The newest of 4 snapshots whose table changes sparsely (deltas), plus a zero
    tensor (compressed), small tensors (packed) and raw random ones (loose, raw)."""
    session = Session()
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(ROWS, COLS, generator=gen)
    fixed = {
        "zeros": torch.zeros(CHUNK // 2),
        "small": torch.randn(16, generator=gen),
        "bias": torch.randn(32, generator=gen),
        "dense": torch.randn(CHUNK // 2, generator=gen),
    }
    for i in range(4):
        if i:
            table = table.clone()
            table[i * 7 : i * 7 + 2] *= 1.001
        state = {"m": StateDict(table=table, **fixed)}
        opts = {"chunk_size": CHUNK}
        Snapshot.take(f"{root}/s{i}", state, session=session, settings=opts)
    return f"{root}/s3"


class _Recorder(ReadTarget):
    def __init__(self, refs: list[ChunkRef], place: bool, hold: bool) -> None:
        self.refs = refs
        self.offer_place, self.offer_hold = place, hold
        self.memory = [bytearray(ref.size) for ref in refs]
        self.arrived: dict[int, str] = {}
        self.lock = threading.Lock()

    def _arrive(self, i: int, how: str, data: Buffer) -> None:
        assert hash_bytes(data) == self.refs[i].hash  # verified bytes only
        with self.lock:
            assert i not in self.arrived, f"chunk {i} arrived twice"
            self.arrived[i] = how

    def consume(self, i: int, data: Buffer) -> None:
        self._arrive(i, "consume", data)

    def place(self, i: int, size: int) -> memoryview | None:
        return memoryview(self.memory[i]) if self.offer_place else None

    def placed(self, i: int) -> None:
        self._arrive(i, "placed", self.memory[i])

    def holds(self, i: int, size: int) -> bool:
        return self.offer_hold

    def hold(self, i: int, data: memoryview) -> None:
        self._arrive(i, "hold", bytes(data))


@pytest.mark.parametrize(
    ("place", "hold", "paths"),
    [
        (False, False, {"consume"}),
        (True, False, {"consume", "placed"}),
        (True, True, {"consume", "hold"}),
    ],
)
def test_every_chunk_arrives_once_verified_by_a_path_the_target_offers(
    tmp_path: Path, place: bool, hold: bool, paths: set[str]
) -> None:
    snap = Snapshot(_snapshot(tmp_path))
    refs = [ref for entry in snap.get_manifest().values() for ref in getattr(entry, "chunks", [])]
    assert any(ref.base is not None for ref in refs)  # deltas
    assert any(ref.pack is not None and ref.base is None for ref in refs)  # packed
    assert len({ref.pack is None for ref in refs}) == 2  # and loose
    target = _Recorder(refs, place, hold)
    with ThreadPoolExecutor(4) as pool:
        read_chunks(snap.repository.storage, refs, target, pool, ByteBudget(1 << 20))
    assert sorted(target.arrived) == list(range(len(refs)))
    assert set(target.arrived.values()) == paths  # packed chunks are always consumed
    for i, ref in enumerate(refs):
        if ref.pack is not None and ref.base is None:
            assert target.arrived[i] == "consume"
