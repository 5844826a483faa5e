"""``dcp.save``/``dcp.load`` by ``checkpoint_id="casnap://..."`` alone, and process-based
async saves (docs/dcp.md, "By checkpoint id alone" and "Process-based async save").

The real DCP picks its own ``FsspecWriter``/``FsspecReader`` for the id; the
``casnap`` protocol (casnap.integrations.dcp_fs) is registered here as the
``fsspec.specs`` entry point would register it in an installed casnap.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tomllib
from concurrent.futures import Future
from pathlib import Path

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import casnap
from casnap.format.entries import ShardedEntry
from casnap.integrations.dcp import CasnapReader, CasnapWriter
from casnap.integrations.dcp_fs import CasnapFileSystem
from casnap.integrations.dcp_layout import FILES_METADATA
from casnap.take.scheduler import Scheduler

sys.path.insert(0, str(Path(__file__).parent))
from helpers import kill_when_ready  # noqa: E402
from test_cli_contract import casnap as run_cli  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
HERE = Path(__file__).parent
CHILD = HERE / "dcp_fs_child.py"


@pytest.fixture(autouse=True)
def _protocol():
    fsspec.register_implementation("casnap", CasnapFileSystem, clobber=True)


def _state(seed: int = 0, name: str = "run") -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(512, 256, generator=g), "b": torch.randn(256, generator=g)},
        "ids": torch.arange(1000),
        "step": seed,
        "extra": {"name": name},
    }


def _blank() -> dict:
    return {
        "model": {"w": torch.zeros(512, 256), "b": torch.zeros(256)},
        "ids": torch.zeros(1000, dtype=torch.int64),
        "step": -1,
        "extra": {"name": ""},
    }


def _equal(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        if isinstance(a[k], dict):
            if not _equal(a[k], b[k]):
                return False
        elif isinstance(a[k], torch.Tensor):
            if not torch.equal(a[k], b[k]):
                return False
        elif a[k] != b[k]:
            return False
    return True


def _stored(repo: Path) -> int:
    meta = repo / ".casnap"
    return sum(f.stat().st_size for d in ("chunks", "packs") for f in (meta / d).rglob("*"))


def _id(path: Path) -> str:
    return f"casnap://{path}"


def test_save_and_load_by_checkpoint_id_alone_round_trip_bit_exact(tmp_path):
    state = _state(3)
    dcp.save(state, checkpoint_id=_id(tmp_path / "run" / "step_3"))
    out = _blank()
    dcp.load(out, checkpoint_id=_id(tmp_path / "run" / "step_3"))
    assert _equal(out, state)
    # one casnap snapshot holding DCP's files, each a uint8 entry; nothing else on disk
    snap = casnap.Snapshot(str(tmp_path / "run" / "step_3"))
    assert FILES_METADATA in snap.metadata
    assert sorted(os.listdir(tmp_path / "run")) == [".casnap"]
    # FsspecWriter's files: its data file a uint8 tensor, its small .metadata inline bytes
    assert snap.read_object("0/__0_0.distcp").dtype == torch.uint8
    assert isinstance(snap.read_object("0/.metadata"), bytes)
    code, out_text, err = run_cli(tmp_path, "verify", "--read-data", str(tmp_path / "run"))
    assert code == 0, out_text + err


def test_an_unchanged_resave_writes_no_chunk_and_an_item_keeps_its_chunks(tmp_path):
    run = tmp_path / "run"
    dcp.save(_state(1), checkpoint_id=_id(run / "step_1"))
    before = _stored(run)
    dcp.save(_state(1), checkpoint_id=_id(run / "step_2"))
    assert _stored(run) == before  # not one chunk or pack more
    # A value saved before the tensors changes size: the tensors after it keep their chunks
    # (each item is its own segment), so the save costs far less than the 512 KiB weight.
    dcp.save(_state(1, name="x" * 5000), checkpoint_id=_id(run / "step_3"))
    assert _stored(run) - before < 64 * 1024
    out = _blank()
    dcp.load(out, checkpoint_id=_id(run / "step_3"))
    assert _equal(out, _state(1, name="x" * 5000))
    assert casnap.Repository(str(run)).verify(read_data=True).ok


def test_saving_again_to_an_id_replaces_it_atomically_and_keeps_history(tmp_path):
    ckpt = _id(tmp_path / "run" / "step")
    dcp.save(_state(1), checkpoint_id=ckpt)
    dcp.save(_state(2), checkpoint_id=ckpt)
    out = _blank()
    dcp.load(out, checkpoint_id=ckpt)
    assert _equal(out, _state(2))
    names = casnap.Repository(str(tmp_path / "run")).snapshots()
    assert "step" in names and any(n.startswith("step@") for n in names)


def test_a_save_that_fails_leaves_no_checkpoint_and_the_earlier_one_loads(tmp_path, monkeypatch):
    run = tmp_path / "run"
    dcp.save(_state(1), checkpoint_id=_id(run / "step_1"))

    def broken(self, save):
        raise OSError("the disk is full")

    monkeypatch.setattr(CasnapFileSystem, "_commit", broken)
    with pytest.raises(CheckpointException):
        dcp.save(_state(2), checkpoint_id=_id(run / "step_2"))
    with pytest.raises(CheckpointException):
        dcp.save(_state(2), checkpoint_id=_id(run / "step_1"))  # a re-save, failing
    monkeypatch.undo()
    fsspec.register_implementation("casnap", CasnapFileSystem, clobber=True)
    assert casnap.Repository(str(run)).snapshots() == ["step_1"]
    assert not fsspec.filesystem("casnap").exists(_id(run / "step_2" / ".metadata"))
    out = _blank()
    dcp.load(out, checkpoint_id=_id(run / "step_1"))
    assert _equal(out, _state(1))
    with pytest.raises(CheckpointException):
        dcp.load(_blank(), checkpoint_id=_id(run / "step_2"))
    # the failed save's lease went with it: gc and a new save to the id go ahead
    dcp.save(_state(2), checkpoint_id=_id(run / "step_2"))
    assert not list((run / ".casnap" / "leases").iterdir())
    assert casnap.Repository(str(run)).verify(read_data=True).ok


def test_a_file_that_fails_to_store_fails_the_save_and_frees_its_lease(tmp_path, monkeypatch):
    run = tmp_path / "run"
    dcp.save(_state(1), checkpoint_id=_id(run / "step_1"))

    def broken(*args, **kwargs):
        raise OSError("the store refused a chunk")

    monkeypatch.setattr(Scheduler, "run", broken)
    with pytest.raises(CheckpointException):
        dcp.save(_state(2), checkpoint_id=_id(run / "step_2"))
    assert not list((run / ".casnap" / "leases").iterdir())  # released at the failure
    monkeypatch.undo()
    fsspec.register_implementation("casnap", CasnapFileSystem, clobber=True)
    assert casnap.Repository(str(run)).snapshots() == ["step_1"]
    dcp.save(_state(2), checkpoint_id=_id(run / "step_2"))  # the id saves afresh
    out = _blank()
    dcp.load(out, checkpoint_id=_id(run / "step_2"))
    assert _equal(out, _state(2))


def test_thread_based_async_save_by_checkpoint_id(tmp_path):
    ckpt = _id(tmp_path / "run" / "step_1")
    fut = dcp.async_save(_state(1), checkpoint_id=ckpt)
    assert isinstance(fut, Future)
    fut.result(timeout=60)
    out = _blank()
    dcp.load(out, checkpoint_id=ckpt)
    assert _equal(out, _state(1))


def test_a_save_killed_before_its_commit_leaves_no_checkpoint(tmp_path):
    run = tmp_path / "run"
    dcp.save(_state(1), checkpoint_id=_id(run / "step_1"))
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    # killed with every chunk written, the ref not yet
    kill_when_ready([sys.executable, str(CHILD), "kill", str(tmp_path)], tmp_path / "ready", env)
    assert casnap.Repository(str(run)).snapshots() == ["step_1"]
    out = _blank()
    dcp.load(out, checkpoint_id=_id(run / "step_1"))
    assert _equal(out, _state(1))
    code, text, err = run_cli(tmp_path, "verify", "--read-data", str(run))
    assert code == 0, text + err


def test_the_reader_refuses_a_snapshot_that_casnap_writer_saved(tmp_path):
    dcp.save(_state(1), storage_writer=CasnapWriter(tmp_path / "run" / "s"))
    with pytest.raises(CheckpointException, match="CasnapReader"):
        dcp.load(_blank(), checkpoint_id=_id(tmp_path / "run" / "s"))


def test_casnap_reader_refuses_a_snapshot_saved_by_id(tmp_path):
    dcp.save(_state(1), checkpoint_id=_id(tmp_path / "run" / "s"))
    with pytest.raises(CheckpointException, match="casnap://"):
        dcp.load(_blank(), storage_reader=CasnapReader(tmp_path / "run" / "s"))


def test_a_url_after_the_protocol_names_a_repository_there(tmp_path):
    ckpt = f"casnap://memory://{tmp_path.name}/run/step_1"
    try:
        dcp.save(_state(1), checkpoint_id=ckpt)
        out = _blank()
        dcp.load(out, checkpoint_id=ckpt)
        assert _equal(out, _state(1))
    finally:
        fsspec.filesystem("memory").rm(f"/{tmp_path.name}", recursive=True)


def test_a_writer_given_passes_take_options_as_fsspec_options(tmp_path):
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    ckpt = tmp_path / "run" / "s"
    dcp.save(_state(1), storage_writer=FsspecWriter(_id(ckpt), chunk_size=4096))
    entry = casnap.Snapshot(str(ckpt)).manifest.entries["0/__0_0.distcp"]
    assert isinstance(entry, ShardedEntry) and {s.chunk_size for s in entry.shards} == {4096}


def test_a_casnap_id_given_to_casnap_writer_names_the_same_snapshot(tmp_path):
    ckpt = tmp_path / "run" / "s"
    assert CasnapWriter.validate_checkpoint_id(_id(ckpt)) and CasnapWriter.validate_checkpoint_id(
        ckpt
    )
    assert not CasnapWriter.validate_checkpoint_id("casnap://")
    writer = CasnapWriter()
    dcp.save(_state(1), storage_writer=writer, checkpoint_id=_id(ckpt))  # reset(id)
    assert writer.checkpoint_id == str(ckpt)
    out = _blank()
    dcp.load(out, storage_reader=CasnapReader(), checkpoint_id=_id(ckpt))
    assert _equal(out, _state(1))


def test_pyproject_registers_the_protocol_as_an_fsspec_entry_point():
    project = tomllib.loads((HERE.parent / "pyproject.toml").read_text())["project"]
    target = project["entry-points"]["fsspec.specs"]["casnap"]
    module, _, name = target.partition(":")
    assert getattr(importlib.import_module(module), name) is CasnapFileSystem


def test_writer_and_reader_pickle_without_their_repository(tmp_path):
    import pickle

    writer = CasnapWriter(tmp_path / "run" / "s", settings={"chunk_size": 4096})
    dcp.save(_state(1), storage_writer=writer)
    copy = pickle.loads(pickle.dumps(writer))
    assert copy.path == writer.path and copy.storage_options == writer.storage_options
    dcp.save(_state(2), storage_writer=copy)
    reader = CasnapReader(tmp_path / "run" / "s")
    dcp.load(_blank(), storage_reader=reader)
    out = _blank()
    dcp.load(out, storage_reader=pickle.loads(pickle.dumps(reader)))
    assert _equal(out, _state(2))


@pytest.mark.parametrize("kind", ["fs", "writer"])
def test_process_based_async_save_round_trips_and_raises_from_the_future(tmp_path, kind):
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    done = subprocess.run(
        [sys.executable, str(CHILD), "async", str(tmp_path), kind],
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    lines = done.stdout.splitlines()
    assert done.returncode == 0 and "OK" in lines, done.stdout[-3000:] + done.stderr[-3000:]
    assert "RAISED CheckpointException ['StoreError']" in lines
    assert casnap.Repository(str(tmp_path / "run")).verify(read_data=True).ok


def _child(tmp_path: Path, *args: str) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    done = subprocess.run(
        [sys.executable, str(CHILD), args[0], str(tmp_path), *args[1:]],
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    lines = done.stdout.splitlines()
    assert done.returncode == 0 and "OK" in lines, done.stdout[-3000:] + done.stderr[-3000:]
    return lines


@pytest.mark.parametrize("kind", ["fs", "writer"])
def test_process_based_async_save_with_dcps_pinned_stager_is_the_staged_state(tmp_path, kind):
    _child(tmp_path, "async-pinned", kind)  # the child asserts the load is the staged state
    assert casnap.Repository(str(tmp_path / "run")).snapshots() == ["step_7"]
    assert casnap.Repository(str(tmp_path / "run")).verify(read_data=True).ok


@pytest.mark.parametrize("kind", ["fs", "writer"])
def test_a_killed_checkpoint_daemon_raises_from_the_future_and_leaves_nothing(tmp_path, kind):
    dcp.save(_state(1), checkpoint_id=_id(tmp_path / "run" / "step_1"))
    lines = _child(tmp_path, "killdaemon", kind)
    assert "RAISED RuntimeError" in lines  # DCP: the checkpoint background process is dead
    assert "SNAPSHOTS step_1" in lines  # seen from the training process, after the future
    assert casnap.Repository(str(tmp_path / "run")).snapshots() == ["step_1"]
    out = _blank()
    dcp.load(out, checkpoint_id=_id(tmp_path / "run" / "step_1"))
    assert _equal(out, _state(1))
    code, text, err = run_cli(tmp_path, "verify", "--read-data", str(tmp_path / "run"))
    assert code == 0, text + err


def test_a_stored_file_reads_back_at_any_offset_and_length(tmp_path):
    import random

    fs = CasnapFileSystem(chunk_size=4096)
    ckpt = _id(tmp_path / "run" / "s")
    rng = random.Random(0)
    pieces = [rng.randbytes(n) for n in (10, 5000, 0, 4096, 70_000, 3, 12_288)]
    fs.makedirs(ckpt, exist_ok=True)
    with fs.open(f"{ckpt}/data", "wb") as f:
        for piece in pieces:
            f.tell()  # a segment boundary, as DCP's before each item
            f.write(piece)
    with fs.open(f"{ckpt}/.metadata.tmp", "wb") as f:
        f.write(b"metadata")
    assert not fs.exists(f"{ckpt}/.metadata")  # nothing visible before the rename
    fs.mv(f"{ckpt}/.metadata.tmp", f"{ckpt}/.metadata")
    whole = b"".join(pieces)
    assert fs.info(f"{ckpt}/data")["size"] == len(whole)
    with fs.open(f"{ckpt}/.metadata", "rb") as f:
        assert f.read() == b"metadata"
    with fs.open(f"{ckpt}/data", "rb") as f:
        assert f.read() == whole
        for _ in range(200):
            at, n = rng.randrange(len(whole)), rng.choice([1, 100, 4096, 9000, 40_000])
            f.seek(at)
            assert f.read(n) == whole[at : at + n]
