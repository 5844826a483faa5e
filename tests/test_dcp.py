"""torch.distributed.checkpoint (DCP) over casnap in one process (docs/dcp.md).

The real DCP: ``dcp.save``/``async_save``/``load`` and the deprecated
``save_state_dict``/``load_state_dict`` with DCP's default planners, writing
through :class:`CasnapWriter` and reading through :class:`CasnapReader`.
"""

from __future__ import annotations

import os
import sys
import warnings
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

import casnap
from casnap.integrations.dcp import HISTORY_SEP, CasnapReader, CasnapWriter

sys.path.insert(0, str(Path(__file__).parent))
from test_cli_contract import casnap as run_cli  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
SMALL = {"chunk_size": 4096}  # several chunks per tensor, so ranges and dedup show


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))


def _trained(seed: int = 0) -> tuple[nn.Sequential, torch.optim.Optimizer]:
    model = _model(seed)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    return model, opt


def _state(model: nn.Module, step: int = 3) -> dict:
    return {"model": model.state_dict(), "step": step, "extra": {"lr": 0.1, "name": "run"}}


def _blank() -> dict:
    return {"model": _model(99).state_dict(), "step": 0, "extra": {"lr": 0.0, "name": ""}}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _stored(repo: Path) -> int:
    """Bytes of chunk and pack objects on disk: what a save costs."""
    meta = repo / ".casnap"
    return sum(f.stat().st_size for d in ("chunks", "packs") for f in (meta / d).rglob("*"))


def test_save_then_load_gives_back_the_state(tmp_path):
    model, opt = _trained()
    state = {**_state(model), "optim": opt.state_dict()}
    dcp.save(state, storage_writer=CasnapWriter(tmp_path / "run" / "step_3", settings=SMALL))
    out = {**_blank(), "optim": _trained(5)[1].state_dict()}
    dcp.load(out, storage_reader=CasnapReader(tmp_path / "run" / "step_3"))
    assert _same(out["model"], model.state_dict())
    assert out["step"] == 3 and out["extra"] == {"lr": 0.1, "name": "run"}
    assert torch.equal(out["optim"]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    # The layout is casnap's own: a casnap reader sees the same tensors and values.
    snap = casnap.Snapshot(str(tmp_path / "run" / "step_3"))
    assert torch.equal(snap.read_object("0/model/0.weight"), model.state_dict()["0.weight"])
    assert snap.read_object("0/step") == 3
    assert _same(snap.read_object("0/model"), model.state_dict())


def test_an_unchanged_resave_writes_no_chunk(tmp_path):
    model, _ = _trained()
    writer = CasnapWriter(tmp_path / "run" / "step_1", settings=SMALL)
    dcp.save(_state(model), storage_writer=writer)
    first = writer.last_write_stats
    before = _stored(tmp_path / "run")
    dcp.save(_state(model, 4), storage_writer=writer, checkpoint_id=tmp_path / "run" / "step_2")
    assert first is not None and first.stored_bytes_written > 16 << 10
    assert writer.last_write_stats is not None
    assert writer.last_write_stats.stored_bytes_written == 0
    assert _stored(tmp_path / "run") == before
    # A new writer (another process, say) finds the chunks too: at most a small pack again.
    dcp.save(_state(model, 5), storage_writer=CasnapWriter(tmp_path / "run" / "step_3"))
    assert _stored(tmp_path / "run") - before < 2048
    usage = casnap.Repository(str(tmp_path / "run")).du()
    assert usage.snapshots == 3 and usage.dedup_ratio > 2.5


def test_a_frozen_backbone_resave_writes_only_the_head(tmp_path):
    model, _ = _trained()
    writer = CasnapWriter(tmp_path / "run" / "step_1", settings=SMALL)
    dcp.save(_state(model), storage_writer=writer)
    with torch.no_grad():
        model.get_parameter("2.weight").add_(1.0)  # the head: 64*8 floats = 2 KiB
    dcp.save(_state(model), storage_writer=writer, checkpoint_id=tmp_path / "run" / "step_2")
    assert writer.last_write_stats is not None
    assert 0 < writer.last_write_stats.raw_bytes_written <= 64 * 8 * 4


def test_saving_again_to_an_id_replaces_it_and_keeps_the_old_one_in_history(tmp_path):
    path = tmp_path / "run" / "latest"
    model, _ = _trained()
    dcp.save(_state(model, 1), storage_writer=CasnapWriter(path))
    repo = casnap.Repository(str(tmp_path / "run"))
    old = repo.resolve("latest")
    with torch.no_grad():
        model.get_parameter("0.bias").fill_(7.0)
    dcp.save(_state(model, 2), storage_writer=CasnapWriter(path))
    out = _blank()
    dcp.load(out, storage_reader=CasnapReader(path))
    assert out["step"] == 2 and bool((out["model"]["0.bias"] == 7.0).all())
    history = f"latest{HISTORY_SEP}{old[:12]}"
    assert sorted(repo.snapshots()) == sorted(["latest", history])
    assert repo.storage.read_manifest(repo.resolve("latest")).parents == [old]
    back = _blank()
    dcp.load(back, storage_reader=CasnapReader(tmp_path / "run" / history))
    assert back["step"] == 1 and not bool((back["model"]["0.bias"] == 7.0).all())
    # Retention drops the history like any snapshot; the current save still loads.
    repo.retain(casnap.RetentionPolicy(casnap.KeepLast(1)), prune=True)
    assert repo.snapshots() == ["latest"]
    dcp.load(_blank(), storage_reader=CasnapReader(path))
    assert repo.verify(read_data=True).ok


def test_overwrite_false_refuses_an_existing_id_in_dcps_words(tmp_path):
    model, _ = _trained()
    path = tmp_path / "r" / "s"
    dcp.save(_state(model), storage_writer=CasnapWriter(path))
    before = casnap.Repository(str(tmp_path / "r")).resolve("s")
    # FileSystemWriter(overwrite=False) raises RuntimeError("Checkpoint already exists and
    # self.overwrite=False."), which DCP wraps; code matching that matches casnap's too.
    with pytest.raises(CheckpointException, match="Checkpoint already exists") as info:
        dcp.save(_state(_model(1)), storage_writer=CasnapWriter(path, overwrite=False))
    ((error, _trace),) = info.value.failures.values()
    assert isinstance(error, RuntimeError) and isinstance(error, casnap.errors.SnapshotExistsError)
    assert str(error).startswith("Checkpoint already exists and self.overwrite=False.")
    repo = casnap.Repository(str(tmp_path / "r"))
    assert repo.resolve("s") == before and repo.snapshots() == ["s"]  # nothing changed
    # A new id saves as usual with overwrite=False.
    dcp.save(_state(model), storage_writer=CasnapWriter(tmp_path / "r" / "t", overwrite=False))


def test_checkpoint_id_no_dist_and_the_deprecated_api(tmp_path):
    model, _ = _trained()
    path = str(tmp_path / "run" / "a")
    dcp.save(_state(model), checkpoint_id=path, storage_writer=CasnapWriter(), no_dist=True)
    out = _blank()
    dcp.load(out, checkpoint_id=path, storage_reader=CasnapReader(), no_dist=True)
    assert _same(out["model"], model.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save_state_dict(
            _state(model, 9), storage_writer=CasnapWriter(tmp_path / "run" / "b"), no_dist=True
        )
        out = _blank()
        dcp.load_state_dict(out, storage_reader=CasnapReader(tmp_path / "run" / "b"), no_dist=True)
    assert out["step"] == 9 and _same(out["model"], model.state_dict())


class _Counter:
    """A DCP Stateful value: DCP calls state_dict() on save and load_state_dict() on load."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.t = torch.arange(n, dtype=torch.float64)

    def state_dict(self) -> dict:
        return {"n": self.n, "t": self.t}

    def load_state_dict(self, sd: dict) -> None:
        self.n, self.t = sd["n"], sd["t"]


def test_stateful_values_and_async_save(tmp_path):
    model, _ = _trained()
    state = {**_state(model), "counter": _Counter(5)}
    fut = dcp.async_save(state, storage_writer=CasnapWriter(tmp_path / "run" / "s"))
    assert isinstance(fut, Future)  # not a staged AsyncSaveResponse: no async_stager given
    fut.result()
    counter = _Counter(5)
    counter.n, counter.t = 0, torch.zeros(5, dtype=torch.float64)  # DCP loads in place
    out = {**_blank(), "counter": counter}
    dcp.load(out, storage_reader=CasnapReader(tmp_path / "run" / "s"))
    assert counter.n == 5 and torch.equal(counter.t, torch.arange(5, dtype=torch.float64))
    assert _same(out["model"], model.state_dict())


def test_a_damaged_chunk_fails_the_load_and_verify_finds_it(tmp_path):
    model, _ = _trained()
    dcp.save(_state(model), storage_writer=CasnapWriter(tmp_path / "run" / "s", settings=SMALL))
    loose = sorted((tmp_path / "run" / ".casnap" / "chunks").rglob("*"))
    victim = next(f for f in loose if f.is_file())
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    os.chmod(victim, 0o644)
    victim.write_bytes(bytes(data))
    with pytest.raises(CheckpointException) as info:
        dcp.load(_blank(), storage_reader=CasnapReader(tmp_path / "run" / "s"))
    assert "IntegrityError" in str(info.value) or "digest" in str(info.value)
    report = casnap.Repository(str(tmp_path / "run")).verify(read_data=True)
    assert not report.ok


def test_the_cli_works_on_a_dcp_written_repository(tmp_path):
    model, _ = _trained()
    run = tmp_path / "run"
    writer = CasnapWriter(run / "step_1", settings=SMALL, metadata={"step": 1})
    dcp.save(_state(model, 1), storage_writer=writer)
    with torch.no_grad():
        model.get_parameter("2.bias").add_(1.0)
    writer.metadata = {"step": 2}
    dcp.save(_state(model, 2), storage_writer=writer, checkpoint_id=run / "step_2")
    code, out, _ = run_cli(tmp_path, "log", str(run))
    assert code == 0 and "step_1" in out and "step_2" in out
    code, out, _ = run_cli(tmp_path, "diff", str(run / "step_1"), str(run / "step_2"))
    assert code == 0 and "0/model/2.bias" in out and "0/model/0.weight" not in out
    code, out, _ = run_cli(tmp_path, "du", str(run))
    assert code == 0
    code, out, _ = run_cli(tmp_path, "verify", "--read-data", str(run))
    assert code == 0, out
    casnap.Repository(str(run)).delete("step_1")
    code, out, _ = run_cli(tmp_path, "gc", "--grace", "0", str(run))
    assert code == 0, out
    out_state = _blank()
    dcp.load(out_state, storage_reader=CasnapReader(run / "step_2"))
    assert _same(out_state["model"], model.state_dict())
    assert casnap.Repository(str(run)).verify(read_data=True).ok
