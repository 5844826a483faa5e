"""casnap.Repository: the public face of a repository, used as a person would."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import casnap
from casnap import KeepLast, Repository, RetentionPolicy, StateDict


@pytest.fixture
def repo(tmp_path) -> Repository:
    r = Repository.init(str(tmp_path / "run1"), chunk_size=64 * 1024)
    state = {"m": StateDict(w=torch.randn(50_000), step=0)}
    for step in (1, 2, 3):
        state["m"]["step"] = step
        if step == 3:
            state["m"]["w"][:10].add_(1.0)
        r.take(f"step_{step}", state, metadata={"step": step})
    return r


def test_a_missing_repository_is_not_found(tmp_path):
    with pytest.raises(casnap.RepositoryNotFoundError):
        Repository(str(tmp_path / "nothing"))


def test_listing_log_du_and_diff(repo):
    again = Repository(repo.url)
    assert again.snapshots() == ["step_1", "step_2", "step_3"]
    lines = again.log()
    assert [ln.name for ln in lines] == ["step_1", "step_2", "step_3"]
    hashes = [again.resolve(f"step_{i}") for i in (1, 2)]
    assert [list(ln.parents) for ln in lines] == [[], hashes[:1], hashes[1:]]  # one session
    assert again.du().snapshots == 3
    changed = {d.key: d.status for d in again.diff("step_2", "step_3")}
    assert changed["0/m/w"] == "changed" and changed["0/m/step"] == "changed"
    drift = again.diff("step_2", "step_3", stats=True)
    assert [d.key for d in drift] == ["0/m/w"]


def test_verify_tags_retain_gc(repo):
    assert repo.verify(read_data=True).ok
    repo.tag("keep", "step_1")
    assert set(repo.tags()) == {"keep"}
    result = repo.retain(RetentionPolicy(KeepLast(1)))
    assert sorted(result.deleted) == ["step_1", "step_2"]
    assert repo.snapshots() == ["step_3"]
    repo.gc(grace_seconds=0)
    assert repo.verify(read_data=True).ok
    repo.untag("keep")
    assert repo.tags() == {}


def test_snapshot_restore_and_export(repo, tmp_path):
    snap = repo.snapshot("step_3")
    out = StateDict(w=torch.zeros(50_000), step=0)
    snap.restore({"m": out})
    assert out["step"] == 3
    result = repo.export("step_3", tmp_path / "w.safetensors", key="0/m")
    assert (tmp_path / "w.safetensors").stat().st_size == result.file_bytes
    assert result.format == "safetensors" and result.tensor_bytes == 50_000 * 4
    with pytest.raises(casnap.SnapshotNotFoundError):
        repo.snapshot("step_9")
    with pytest.raises(casnap.ConfigError):
        repo.export("step_3", tmp_path / "w.bin", format="npz")


def test_the_repository_api_never_imports_torch_for_inspection(repo):
    code = ("import sys, casnap\n"
            f"r = casnap.Repository({repo.url!r})\n"
            "r.log(); r.du(); r.verify(); r.snapshots(); r.diff('step_1', 'step_3')\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")  # fmt: skip
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
