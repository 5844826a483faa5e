"""Resharding reads only the chunks that overlap the target (no processes needed)."""

from __future__ import annotations

import torch

from casnap.distributed.plan import assign
from casnap.format.codec import HEADER_SIZE
from casnap.format.entries import ChunkRef, ShardedEntry, ShardRecord
from casnap.restore.reshard import ShardedSink
from casnap.take.plan import RankPlan, TensorPlan


def _entry(rows: int, cols: int, parts: int, chunk: int) -> ShardedEntry:
    per = rows // parts
    nbytes = per * cols * 4
    shards = []
    for p in range(parts):
        refs = [
            ChunkRef(
                hash=f"{p:032x}{i:032x}",
                size=min(chunk, nbytes - i * chunk),
                length=HEADER_SIZE + min(chunk, nbytes - i * chunk),
            )
            for i in range(-(-nbytes // chunk))
        ]
        shards.append(
            ShardRecord(offsets=[p * per, 0], sizes=[per, cols], chunk_size=chunk, chunks=refs)
        )
    return ShardedEntry(layout="dtensor", dtype="float32", shape=[rows, cols], shards=shards)


class _Target:
    """A stand-in for a sharded target with one box (what target_regions returns)."""


def _needed(entry: ShardedEntry, offsets: tuple[int, int], sizes: tuple[int, int]) -> set[str]:
    import casnap.restore.reshard as reshard
    from casnap.torch_io.sharded import LocalShard, target_regions

    box = LocalShard(offsets, sizes, torch.empty(sizes))
    original = target_regions
    reshard.target_regions = lambda value, key: [box]  # type: ignore[attr-defined]  # as used
    original_check = reshard._check
    reshard._check = lambda key, entry, target: None
    try:
        sink = ShardedSink("k", entry, _Target())
    finally:
        reshard.target_regions = original  # type: ignore[attr-defined]
        reshard._check = original_check
    return {ref.hash for _, ref in sink.needed()}


def test_row_overlap_reads_only_overlapping_chunks() -> None:
    entry = _entry(64, 64, 4, 1024)  # 16 rows per shard, 4 rows (1 KiB) per chunk
    got = _needed(entry, (8, 0), (16, 64))  # rows 8..23: half of shard 0, half of shard 1
    want = {f"{0:032x}{i:032x}" for i in (2, 3)} | {f"{1:032x}{i:032x}" for i in (0, 1)}
    assert got == want


def test_column_box_reads_only_its_rows() -> None:
    entry = _entry(64, 64, 4, 256)  # one row per chunk
    got = _needed(entry, (3, 10), (3, 20))  # rows 3..5, columns 10..29
    assert got == {f"{0:032x}{i:032x}" for i in (3, 4, 5)}


def test_assignment_balances_replicated_bytes() -> None:
    chunks = tuple((f"{i:064x}", 1000 + (i % 3)) for i in range(40))
    plans = [
        RankPlan(r, 1024, {f"{r}/m/w": TensorPlan("float32", (10,), True, chunks)})
        for r in range(4)
    ]
    writers, load = assign(plans)
    assert len(writers) == 40 and sum(load) == sum(s for _, s in chunks)
    assert max(load) <= 1.05 * sum(load) / 4
    assert writers == assign(list(reversed(plans)))[0]  # order-independent
