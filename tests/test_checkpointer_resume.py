"""Resuming with a Checkpointer: ``restore_latest`` (no repository yet, the restored step
not taken again, after a take killed halfway, past a damaged or unreadable newest
snapshot, and what it raises rather than skips) and ``restore(step=...)``
(docs/retention.md, "Resuming")."""

from __future__ import annotations

import inspect
import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import chunk_path, tensor_entry
from test_checkpointer import NAMES, expected, fill, fresh, name, same_bits, wait_for_line

from casnap import IntegrityError, Repository, Snapshot, StateDict
from casnap.api.checkpointer import Checkpointer
from casnap.errors import SnapshotNotFoundError
from casnap.repo.repository import RepoStorage


def test_restore_latest_on_missing_or_empty_repository(tmp_path):
    ckpt = Checkpointer(str(tmp_path / "absent"), 5)
    assert ckpt.restore_latest(fresh()) is None
    assert ckpt.latest() is None and ckpt.snapshots() == []
    assert not (tmp_path / "absent").exists()  # asking does not create a repository
    Repository.of(RepoStorage.open_or_create(str(tmp_path / "empty")))
    assert Checkpointer(str(tmp_path / "empty"), 5).restore_latest(fresh()) is None


def test_resume_at_the_restored_step_does_not_take_it_again(tmp_path):
    root = tmp_path / "run"
    state = fresh()
    first = Checkpointer(str(root), 5)
    for step in (5, 10):
        fill(state, step)
        first.maybe_take(step, state)
    ckpt = Checkpointer(str(root), 5)
    out = fresh()
    assert ckpt.restore_latest(out) == 10 and same_bits(out, expected(10))
    assert ckpt.maybe_take(10, out) is None
    fill(out, 15)
    snap = ckpt.maybe_take(15, out)
    assert isinstance(snap, Snapshot)
    assert snap.manifest.parents == [Snapshot(f"{root}/{NAMES[1]}").manifest_hash]


def test_restore_a_given_step_and_continue_from_it(tmp_path):
    root = str(tmp_path / "run")
    state = fresh()
    first = Checkpointer(root, 5)
    for step in (5, 10, 15):
        fill(state, step)
        first.maybe_take(step, state)
    ckpt = Checkpointer(root, 5)
    out = fresh()
    snap = ckpt.restore(out, step=10)
    assert snap.metadata["step"] == 10 and same_bits(out, expected(10))
    fill(out, 11)
    taken = ckpt.maybe_take(11, out, force=True)
    assert isinstance(taken, Snapshot) and taken.manifest.parents == [snap.manifest_hash]
    with pytest.raises(SnapshotNotFoundError, match=r"step 7 .*5, 10, 11, 15") as err:
        ckpt.restore(out, step=7)
    assert isinstance(err.value, FileNotFoundError)
    with pytest.raises(SnapshotNotFoundError, match="none"):
        Checkpointer(str(tmp_path / "absent"), 5).restore(fresh(), step=1)


CHILD = """
import os, sys, threading, time
import torch
from casnap import Repository, StateDict
from casnap.api.checkpointer import Checkpointer
from casnap.store import LocalStore
from casnap.store.faults import FailingStore

{helpers}


tripped = threading.Lock()


def killed_here(key):
    # Several writer threads get here: the first tells the parent (one atomic
    # write) to SIGKILL us, and every writer stops until it does.
    if tripped.acquire(blocking=False):
        os.write(1, b"CHUNK_WRITTEN\\n")
    time.sleep(120)
    return RuntimeError("not killed")


# Once armed, each chunk write lands, then waits to be killed.
chunks = (".casnap/chunks/",)
store = FailingStore(
    LocalStore(sys.argv[1]), 1, prefixes=chunks, fail=killed_here, after=True, lasting=True,
    armed=False,
)
repo = Repository.on_store(store, chunk_size=4096)
ckpt = Checkpointer(repo, 5)
state = fresh()
for step in range(1, 16):
    fill(state, step)
    store.armed = step == 15
    ckpt.maybe_take(step, state, metrics={{"loss": 1.0 / step}})
print("NOT KILLED", flush=True)
"""


def test_restore_latest_after_a_take_killed_halfway(tmp_path):
    root = tmp_path / "run"
    script = tmp_path / "child.py"
    helpers = inspect.getsource(fresh) + "\n\n" + inspect.getsource(fill)
    script.write_text(textwrap.dedent(CHILD).format(helpers=helpers))
    proc = subprocess.Popen(
        [sys.executable, str(script), str(root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = wait_for_line(proc, timeout=60)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        _, err = proc.communicate(timeout=30)
    assert line == "CHUNK_WRITTEN\n", f"child said {line!r}; stderr:\n{err}"
    assert proc.returncode == -signal.SIGKILL, err

    repo = Repository(str(root))
    assert repo.storage.list_snapshots() == NAMES[:2]  # the killed take left no ref ...
    assert len(list(repo.storage.iter_manifest_names())) == 2  # ... and no manifest
    referenced = {
        c.hash
        for name in NAMES[:2]
        for c in repo.storage.read_manifest(repo.resolve(name)).chunk_refs()
    }
    loose = {p.name for p in (root / ".casnap" / "chunks").rglob("*") if p.is_file()}
    assert loose - referenced, "the killed take had written a chunk"

    ckpt = Checkpointer(str(root), 5)
    state = fresh()
    assert ckpt.restore_latest(state) == 10
    assert same_bits(state, expected(10))
    fill(state, 15)
    snap = ckpt.maybe_take(15, state, metrics={"loss": 1.0 / 15})
    assert isinstance(snap, Snapshot)
    assert snap.manifest.parents == [repo.resolve(NAMES[1])]
    assert ckpt.snapshots() == NAMES[:3]
    out = fresh()
    Snapshot(f"{root}/{NAMES[2]}").restore(out)
    assert same_bits(out, expected(15))


# -- resuming past damage -------------------------------------------------------

CHUNK = 16 * 1024


def take_steps(root: str, steps: list[int]) -> Checkpointer:
    ckpt = Checkpointer(root, 5, settings={"chunk_size": CHUNK})
    state = fresh()
    for step in steps:
        fill(state, step)
        ckpt.maybe_take(step, state, metrics={"loss": 1.0 / step})
    return ckpt


def flip_a_chunk_byte(root: Path, step: int, *, delete: bool = False) -> str:
    """Flip one byte in (or delete) a loose chunk of ``step``'s weights (a chunk no other
    step shares)."""
    ref = tensor_entry(Snapshot(f"{root}/{name(step)}").get_manifest(), "0/model/w").chunks[6]
    assert ref.pack is None
    path = chunk_path(root, ref.hash)
    if delete:
        path.unlink()
        return ref.hash
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x01
    path.write_bytes(bytes(data))
    return ref.hash


def test_a_missing_chunk_in_the_newest_snapshot_is_skipped_too(tmp_path, caplog):
    root = tmp_path / "run"
    take_steps(str(root), [5, 10])
    flip_a_chunk_byte(root, 10, delete=True)
    state = fresh()
    with caplog.at_level(logging.WARNING, logger="casnap"):
        assert Checkpointer(str(root), 5).restore_latest(state) == 5
    assert same_bits(state, expected(5))
    assert any("missing" in r.getMessage() and name(10) in r.getMessage() for r in caplog.records)


def test_restore_latest_resumes_from_the_newest_snapshot_that_restores(tmp_path, caplog):
    root = tmp_path / "run"
    take_steps(str(root), [5, 10, 15])
    flip_a_chunk_byte(root, 15)

    ckpt = Checkpointer(str(root), 5)
    state = fresh()
    fill(state, 99)  # whatever the failed attempt wrote is overwritten by step 10's values
    with caplog.at_level(logging.WARNING, logger="casnap"):
        assert ckpt.restore_latest(state) == 10
    assert same_bits(state, expected(10))
    skipped = [r.getMessage() for r in caplog.records if "skipping snapshot" in r.getMessage()]
    assert len(skipped) == 1 and name(15) in skipped[0] and "IntegrityError" in skipped[0]
    # the next take continues from step 10
    fill(state, 11)
    snap = ckpt.maybe_take(11, state, force=True)
    assert isinstance(snap, Snapshot)
    assert snap.manifest.parents == [Snapshot(f"{root}/{name(10)}").manifest_hash]

    # a new process knows the damage from its record: it does not even try step 15
    caplog.clear()
    again = fresh()
    with caplog.at_level(logging.WARNING, logger="casnap"):
        assert Checkpointer(str(root), 5).restore_latest(again) == 11
    assert same_bits(again, state)
    skipped = [r.getMessage() for r in caplog.records if "skipping snapshot" in r.getMessage()]
    assert len(skipped) == 1 and name(15) in skipped[0] and "recorded as damaged" in skipped[0]


def test_a_recorded_damage_is_skipped_without_reading_data(tmp_path, caplog):
    root = tmp_path / "run"
    take_steps(str(root), [5, 10])
    flip_a_chunk_byte(root, 10)
    with pytest.raises(IntegrityError):  # found by a plain restore: recorded as damaged
        Snapshot(f"{root}/{name(10)}").restore(fresh())
    state = fresh()
    fill(state, 99)
    with caplog.at_level(logging.WARNING, logger="casnap"):
        assert Checkpointer(str(root), 5).restore_latest(state) == 5
    assert same_bits(state, expected(5))
    assert any("recorded as damaged" in r.getMessage() for r in caplog.records)


def test_an_unreadable_newest_manifest_is_skipped(tmp_path, caplog):
    root = tmp_path / "run"
    take_steps(str(root), [5, 10])
    manifest = Repository(str(root)).snapshots()  # both refs
    mhash = Snapshot(f"{root}/{name(10)}").manifest_hash
    path = root / ".casnap" / "manifests" / mhash[:2] / mhash
    path.write_bytes(path.read_bytes()[:-5] + b"xxxxx")
    state = fresh()
    with caplog.at_level(logging.WARNING, logger="casnap"):
        assert Checkpointer(str(root), 5).restore_latest(state) == 5
    assert same_bits(state, expected(5)) and manifest == [name(5), name(10)]
    assert any(name(10) in r.getMessage() for r in caplog.records)


def test_when_no_snapshot_restores_the_error_lists_them(tmp_path):
    root = tmp_path / "run"
    take_steps(str(root), [5, 10])
    flip_a_chunk_byte(root, 5)
    flip_a_chunk_byte(root, 10)
    with pytest.raises(IntegrityError, match=rf"tried, newest first: {name(10)}: .*{name(5)}: "):
        Checkpointer(str(root), 5).restore_latest(fresh())


def test_a_key_mismatch_is_raised_not_skipped(tmp_path):
    root = tmp_path / "run"
    take_steps(str(root), [5, 10])
    with pytest.raises(KeyError):  # the user's app_state is wrong for every snapshot
        Checkpointer(str(root), 5).restore_latest({"other": StateDict(x=torch.zeros(1))})


class _Gone:
    """A class that later "disappears" (see the test below)."""

    def __init__(self, value: int) -> None:
        self.value = value


def test_an_object_that_cannot_be_unpickled_is_not_skipped_as_damage(tmp_path, monkeypatch):
    from casnap.errors import ObjectLoadError

    root = str(tmp_path / "run")
    ckpt = Checkpointer(root, 1)
    ckpt.maybe_take(1, expected(1))
    later = expected(2)
    later["extra"] = StateDict(obj=_Gone(7))
    Snapshot.take(f"{root}/{name(2)}", later, allow_pickle=True, metadata={"step": 2})
    monkeypatch.delattr(sys.modules[__name__], "_Gone")  # the class is gone in this process

    state = fresh()
    state["extra"] = StateDict(obj=None)
    with pytest.raises(ObjectLoadError, match="cannot be loaded"):
        Checkpointer(root, 1).restore_latest(state, allow_pickle=True)
    assert same_bits(state, fresh())  # the tensors were filled, then rolled back


def test_a_fallback_names_the_tensors_the_older_snapshot_does_not_hold(tmp_path, caplog):
    root = tmp_path / "run"
    ckpt = take_steps(str(root), [5])
    state = expected(10)
    state["model"]["v"] = torch.ones(100)  # a tensor new in step 10
    ckpt.maybe_take(10, state)
    flip_a_chunk_byte(root, 10)
    target = fresh()
    target["model"]["v"] = torch.zeros(100)
    with caplog.at_level(logging.WARNING, logger="casnap"):
        assert Checkpointer(str(root), 5).restore_latest(target) == 5
    warned = [r.getMessage() for r in caplog.records if "does not hold" in r.getMessage()]
    assert len(warned) == 1 and "0/model/v" in warned[0]
