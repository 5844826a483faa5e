"""``replicated=`` in a single-process take, as torchsnapshot treats it.

torchsnapshot marks the entries matching ``replicated`` as replicated even
when one process takes the snapshot, so a job that trained on one process and
resumes on several finds them on every rank. Per-rank state (not replicated)
restores only onto the rank that saved it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from dist_harness import run_ranks

from casnap import Snapshot, StateDict
from casnap.errors import MissingKeyError


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    return {"model": StateDict(w=torch.randn(64, 8), b=torch.randn(8)), "step": StateDict(n=7)}


def test_entries_matching_replicated_are_marked_in_a_one_process_take(tmp_path: Path) -> None:
    snap = Snapshot.take(str(tmp_path / "run" / "s"), _state(), replicated=["model/*"])
    entries = snap.get_manifest()
    assert entries["0/model/w"].replicated and entries["0/model/b"].replicated
    plain = Snapshot.take(str(tmp_path / "run" / "t"), _state())
    assert not plain.get_manifest()["0/model/w"].replicated


def _restore_on_rank(rank: int, world: int, path: str) -> Any:
    target = {"model": StateDict(w=torch.zeros(64, 8), b=torch.zeros(8))}
    try:
        Snapshot(path).restore(target)
    except MissingKeyError as exc:
        return f"missing: {exc}"
    return [target["model"]["w"], target["model"]["b"]]


@pytest.mark.dist
def test_a_one_process_snapshot_resumes_on_two_ranks_when_replicated(tmp_path: Path) -> None:
    expected = _state()["model"]
    Snapshot.take(str(tmp_path / "run" / "rep"), _state(), replicated=["**"])
    Snapshot.take(str(tmp_path / "run" / "own"), _state())

    rep = run_ranks(2, _restore_on_rank, str(tmp_path / "run" / "rep"))
    for outcome in rep:
        assert outcome.error is None, outcome.error_text
        w, b = outcome.value
        assert torch.equal(w, expected["w"]) and torch.equal(b, expected["b"])

    own = run_ranks(2, _restore_on_rank, str(tmp_path / "run" / "own"))
    assert all(o.error is None for o in own), [o.error_text for o in own]
    w, _ = own[0].value
    assert torch.equal(w, expected["w"])  # rank 0 saved it
    assert isinstance(own[1].value, str) and "per-rank state" in own[1].value
