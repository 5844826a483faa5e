"""The Checkpointer: every-N-steps takes, lineage, retention, async, and resuming after a kill."""

from __future__ import annotations

import inspect
import os
import select
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from casnap import PendingSnapshot, Repository, Snapshot, StateDict
from casnap.api.checkpointer import Checkpointer
from casnap.errors import StoreError
from casnap.ops.retention import KeepBest, KeepLast, RetentionPolicy
from casnap.repo.repository import RepoStorage
from casnap.store import LocalStore
from casnap.store.faults import FailingStore

NAMES = [f"step_{s:09d}" for s in (5, 10, 15, 20)]


def fill(state: dict[str, StateDict], step: int) -> None:
    """The training state at ``step``, deterministic, written in place."""
    g = torch.Generator().manual_seed(step)
    state["model"]["w"].copy_(torch.randn(50_000, generator=g))
    state["model"]["b"].copy_(torch.arange(300, dtype=torch.float64) * step)
    state["progress"]["step"] = step


def fresh() -> dict[str, StateDict]:
    return {
        "model": StateDict(w=torch.zeros(50_000), b=torch.zeros(300, dtype=torch.float64)),
        "progress": StateDict(step=-1),
    }


def same_bits(a: dict[str, StateDict], b: dict[str, StateDict]) -> bool:
    return (
        all(
            a["model"][k].view(torch.uint8).equal(b["model"][k].view(torch.uint8))
            for k in ("w", "b")
        )
        and a["progress"]["step"] == b["progress"]["step"]
    )


def expected(step: int) -> dict[str, StateDict]:
    state = fresh()
    fill(state, step)
    return state


def run_loop(ckpt: Checkpointer, state: dict[str, StateDict]) -> list[object]:
    results: list[object] = []
    for step in range(1, 21):
        fill(state, step)
        results.append(ckpt.maybe_take(step, state, metrics={"loss": 100.0 / step}))
        # training moves on: the live tensors change right after the take
        state["model"]["w"].add_(1000.0)
    return results


def manifests(root: Path) -> dict[str, Snapshot]:
    repo = Repository(str(root))
    return {name: Snapshot(f"{root}/{name}") for name in repo.storage.list_snapshots()}


@pytest.mark.parametrize("async_take", [False, True])
def test_loop_takes_every_n_steps_with_metadata_and_lineage(tmp_path, async_take):
    root = tmp_path / "run"
    state = fresh()
    with Checkpointer(str(root), 5, async_take=async_take, tags=["run1"]) as ckpt:
        results = run_loop(ckpt, state)
        again = ckpt.maybe_take(20, state)  # never twice for one step
    assert again is None
    taken = [r for r in results if r is not None]
    kind = PendingSnapshot if async_take else Snapshot
    assert len(taken) == 4 and all(isinstance(r, kind) for r in taken)
    assert [i for i, r in enumerate(results, 1) if r is not None] == [5, 10, 15, 20]
    assert ckpt.snapshots() == NAMES and ckpt.latest() == NAMES[-1]
    snaps = manifests(root)
    assert list(snaps) == NAMES
    previous: list[str] = []
    for step, name in zip((5, 10, 15, 20), NAMES):
        snap = snaps[name]
        assert snap.metadata == {"step": step, "metrics": {"loss": 100.0 / step}, "tags": ["run1"]}
        assert snap.manifest.parents == previous
        previous = [snap.manifest_hash]
        # point in time: the values at the take, not the ones changed right after it
        out = fresh()
        snap.restore(out)
        assert same_bits(out, expected(step))


def test_retention_runs_after_each_commit_and_keeps_foreign_snapshots(tmp_path):
    root = tmp_path / "run"
    Snapshot.take(str(root / "base"), {"model": StateDict(x=torch.ones(10))})
    state = fresh()
    seen = []
    ckpt = Checkpointer(str(root), 5, retention=RetentionPolicy(KeepLast(2)))
    for step in range(1, 21):
        fill(state, step)
        if ckpt.maybe_take(step, state) is not None:
            seen.append(ckpt.snapshots())
    assert seen == [NAMES[:1], NAMES[:2], NAMES[1:3], NAMES[2:4]]
    assert ckpt.last_retention is not None and ckpt.last_retention.deleted == (NAMES[1],)
    repo = Repository(str(root))
    assert repo.storage.list_snapshots() == [
        "base",
        *NAMES[2:],
    ]  # the foreign snapshot is untouched
    # the retired snapshots' manifests were reclaimed: base's and the two kept ones remain
    assert len(list(repo.storage.iter_manifest_names())) == 3


def test_async_retention_applies_when_the_take_is_observed_complete(tmp_path):
    root = tmp_path / "run"
    state = fresh()
    policy = RetentionPolicy(KeepLast(1), KeepBest(1, "loss", mode="max"))
    ckpt = Checkpointer(str(root), 5, async_take=True, retention=policy)
    run_loop(ckpt, state)
    # the last take is pending or committed but not yet retained against
    ckpt.wait()
    # best loss (max) is step 5's; the newest is step 20's
    assert ckpt.snapshots() == [NAMES[0], NAMES[3]]
    assert ckpt.wait() is None  # nothing pending any more


def test_the_newest_snapshot_is_never_retired(tmp_path):
    root = tmp_path / "run"
    state = fresh()
    ckpt = Checkpointer(str(root), 5, retention=RetentionPolicy(KeepBest(1, "loss")))
    for step in (5, 10, 15):
        fill(state, step)
        ckpt.maybe_take(step, state, metrics={"loss": float(step)})
    assert ckpt.snapshots() == [NAMES[0], NAMES[2]]
    plan_reasons = ckpt.last_retention
    assert plan_reasons is not None and plan_reasons.deleted == (NAMES[1],)


def test_an_async_failure_is_raised_once_and_the_step_can_be_retried(tmp_path):
    # Every chunk write fails while armed (a full disk): below, around the take that fails.
    disk_full = lambda key: StoreError("disk full (injected)", key)  # noqa: E731
    local, chunks = LocalStore(str(tmp_path / "run")), (".casnap/chunks/",)
    store = FailingStore(local, 1, prefixes=chunks, fail=disk_full, lasting=True, armed=False)
    repo = Repository.on_store(store, chunk_size=4096)
    ckpt = Checkpointer(repo.url, 5, async_take=True, storage_options={"repository": repo})
    state = fresh()
    fill(state, 5)
    store.armed = True
    assert isinstance(ckpt.maybe_take(5, state), PendingSnapshot)
    with pytest.raises(StoreError, match="injected"):
        ckpt.wait()
    assert ckpt.wait() is None and ckpt.snapshots() == []
    store.armed = False
    assert isinstance(ckpt.maybe_take(5, state), PendingSnapshot)  # not "already taken"
    ckpt.close()
    assert ckpt.snapshots() == NAMES[:1]


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


def test_arguments_are_checked(tmp_path):
    with pytest.raises(ValueError):
        Checkpointer(str(tmp_path), 0)
    with pytest.raises(ValueError):  # a name that could leave the repository
        Checkpointer(str(tmp_path), 5, name_format="../{step}")
    with pytest.raises(ValueError):
        Checkpointer(str(tmp_path), 5, tags=["no\ncontrol characters"])


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
ckpt = Checkpointer(sys.argv[1], 5, storage_options={{"repository": repo}})
state = fresh()
for step in range(1, 16):
    fill(state, step)
    store.armed = step == 15
    ckpt.maybe_take(step, state, metrics={{"loss": 1.0 / step}})
print("NOT KILLED", flush=True)
"""


def wait_for_line(proc: subprocess.Popen[str], timeout: float) -> str:
    """The child's first line of output; "" if it exits or stays silent for ``timeout``."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline() if ready else ""


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
