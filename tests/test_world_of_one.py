"""A take inside a process group of one rank is a single-process take.

Benchmarks and single-GPU jobs often initialise a default group of one rank
(DCP's ``async_save`` wants one). Such a take has nothing to coordinate; it
used to go through the distributed pipeline all the same, which hashes every
byte in the caller's thread before ``async_take`` returns: on an H100 a 2 GiB
``async_take`` blocked 2.0 s instead of the 0.04 s its staging copy takes
(benchmarks/README.md, "Latest figures").
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import numbered_tensors

import casnap.distributed.plan as plan
from casnap import Session, Snapshot, StateDict
from casnap.format.names import digest_of  # what plan.digest_of is until the patch


def _entries(snap: Snapshot) -> dict[str, object]:
    return {k: v for k, v in snap.get_manifest().items()}


def test_one_rank_group_takes_like_a_single_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    alone = Snapshot.take(
        str(tmp_path / "alone" / "s"), {"m": StateDict(numbered_tensors(4, (256, 256)))}
    )
    hashed_in: list[int] = []

    def recording(piece):
        hashed_in.append(threading.get_ident())
        return digest_of(piece)

    monkeypatch.setattr(plan, "digest_of", recording)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        live = numbered_tensors(4, (256, 256))
        session = Session()
        pending = Snapshot.async_take(
            str(tmp_path / "grouped" / "s"), {"m": StateDict(live)}, session=session
        )
        caller_hashed = threading.get_ident() in hashed_in
        for t in live.values():
            t.add_(1)  # after async_take returned: the snapshot is point-in-time
        grouped = pending.wait()
    finally:
        dist.destroy_process_group()
    assert not caller_hashed, "async_take hashed the state before returning"
    assert _entries(grouped) == _entries(alone)
    out = {k: torch.zeros(256, 256) for k in numbered_tensors(4, (256, 256))}
    grouped.restore({"m": StateDict(out)})
    for k, t in numbered_tensors(4, (256, 256)).items():
        assert torch.equal(out[k], t)
