"""The Checkpointer's mirror (docs/copy.md): each committed snapshot is copied to a second
repository in the background, retention applies on both, failures retry at the next commit."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from gcs_server import gcs_bucket, gcs_server  # noqa: F401  (fixtures)

from casnap import KeepLast, Repository, RetentionPolicy, Snapshot, StateDict
from casnap.api.checkpointer import Checkpointer
from casnap.store import LocalStore


def _state(step: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)  # the same every step: its chunks are sent once
    return {"model": model, "extra": StateDict(step=step, w=torch.full((300,), float(step)))}


def _restores_step(url: str, name: str, step: int) -> None:
    got: dict[str, Any] = {"model": torch.nn.Linear(64, 64), "extra": StateDict()}
    Snapshot(f"{url}/{name}").restore(got)
    want = _state(step)
    assert torch.equal(got["model"].weight, want["model"].weight)
    assert got["extra"]["step"] == step and torch.equal(got["extra"]["w"], want["extra"]["w"])


@pytest.mark.parametrize("async_take", [False, True])
def test_every_commit_reaches_the_mirror_and_retention_applies_on_both(tmp_path, async_take):
    local, mirror = str(tmp_path / "local"), str(tmp_path / "mirror")
    policy = RetentionPolicy(KeepLast(2))
    with Checkpointer(
        local, every_n_steps=1, retention=policy, mirror=mirror, async_take=async_take
    ) as ckpt:
        for step in range(5):
            ckpt.maybe_take(step, _state(step))
    names = ["step_000000003", "step_000000004"]
    assert ckpt.snapshots() == names
    assert Repository(mirror).snapshots() == names  # dropped locally, dropped there
    assert ckpt.mirror is not None and ckpt.mirror.unmirrored == ()
    _restores_step(mirror, names[-1], 4)
    # The mirror's reclaim deleted what only the retired snapshots reached.
    plan = Repository(mirror).gc(dry_run=True, grace_seconds=0).plan
    assert plan is not None and plan.data == ()


def test_a_mirror_keeps_its_own_retention(tmp_path):
    local, mirror = str(tmp_path / "local"), str(tmp_path / "mirror")
    with Checkpointer(
        local,
        every_n_steps=1,
        retention=RetentionPolicy(KeepLast(1)),
        mirror=mirror,
        mirror_retention=None,
    ) as ckpt:
        for step in range(3):
            ckpt.maybe_take(step, _state(step))
    assert ckpt.snapshots() == ["step_000000002"]
    assert Repository(mirror).snapshots() == [f"step_00000000{i}" for i in range(3)]
    _restores_step(mirror, "step_000000000", 0)


class _Gated(LocalStore):
    """A local store whose object puts wait for ``gate`` (a slow or stalled network)."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.gate = threading.Event()
        self.stalled = threading.Event()  # a put is waiting at the gate

    def put(self, key, data, *, create_only=False, durable=True):
        if key.startswith((".casnap/chunks/", ".casnap/packs/")):
            self.stalled.set()
            assert self.gate.wait(60), "the test never opened the gate"
        super().put(key, data, create_only=create_only, durable=durable)


def test_a_stalled_mirror_does_not_block_training_until_its_queue_is_full(tmp_path):
    store = _Gated(str(tmp_path / "mirror"))
    mirror = Repository.on_store(store)
    ckpt = Checkpointer(str(tmp_path / "local"), every_n_steps=1, mirror=mirror, mirror_queue=1)
    started = time.monotonic()
    ckpt.maybe_take(0, _state(0))  # the copier takes it and stalls on its first put
    assert store.stalled.wait(30)
    ckpt.maybe_take(1, _state(1))  # waits in the queue
    assert time.monotonic() - started < 30
    assert mirror.snapshots() == []  # nothing visible while its objects are not all there

    third = threading.Thread(target=ckpt.maybe_take, args=(2, _state(2)))
    third.start()  # the queue is full: this one waits for the copier (backpressure)
    third.join(0.5)
    assert third.is_alive()
    store.gate.set()
    third.join(60)
    ckpt.close()
    assert mirror.snapshots() == ["step_000000000", "step_000000001", "step_000000002"]
    _restores_step(mirror.url, "step_000000002", 2)


def test_local_retention_keeps_what_a_mirror_with_its_own_retention_is_still_owed(tmp_path):
    # Seen in CI: local KeepLast(1) deleted step 0 before the copier reached it, so a mirror
    # told to keep everything never received it. Now local retention waits for the copy.
    store = _Gated(str(tmp_path / "mirror"))
    mirror = Repository.on_store(store)
    ckpt = Checkpointer(
        str(tmp_path / "local"),
        every_n_steps=1,
        mirror=mirror,
        retention=RetentionPolicy(KeepLast(1)),
        mirror_retention=None,
    )
    ckpt.maybe_take(0, _state(0))
    assert store.stalled.wait(30)  # the copier holds step 0 at its first put
    ckpt.maybe_take(1, _state(1))
    ckpt.maybe_take(2, _state(2))
    every = ["step_000000000", "step_000000001", "step_000000002"]
    assert ckpt.mirror is not None and list(ckpt.mirror.owed) == every
    assert ckpt.snapshots() == every
    store.gate.set()
    ckpt.close()  # the copier catches up, then local retention applies what waited
    assert ckpt.mirror.owed == ()
    assert mirror.snapshots() == every
    assert ckpt.snapshots() == ["step_000000002"]
    _restores_step(mirror.url, "step_000000000", 0)


def test_snapshots_an_earlier_process_left_uncopied_reach_the_mirror_before_local_retention(
    tmp_path,
):
    # A process preempted (or crashed) before its copier finished leaves local snapshots
    # the mirror lacks; the next process must not let local retention delete them first.
    local, mirror = str(tmp_path / "local"), str(tmp_path / "mirror")
    with Checkpointer(local, every_n_steps=1) as before:  # as if its copier never ran
        for step in range(3):
            before.maybe_take(step, _state(step))
    with Checkpointer(
        local,
        every_n_steps=1,
        retention=RetentionPolicy(KeepLast(1)),
        mirror=mirror,
        mirror_retention=None,
    ) as ckpt:
        ckpt.restore_latest({"model": torch.nn.Linear(64, 64), "extra": StateDict()})
        ckpt.maybe_take(3, _state(3))
    assert Repository(mirror).snapshots() == [f"step_00000000{i}" for i in range(4)]
    assert ckpt.snapshots() == ["step_000000003"]
    _restores_step(mirror, "step_000000001", 1)


def test_a_name_the_mirror_holds_with_other_content_is_given_up_not_retried_forever(
    tmp_path, caplog
):
    local, mirror = str(tmp_path / "local"), str(tmp_path / "mirror")
    Snapshot.take(f"{mirror}/step_000000001", {"extra": StateDict(other=True)})
    ckpt = Checkpointer(
        local,
        every_n_steps=1,
        retention=RetentionPolicy(KeepLast(1)),
        mirror=mirror,
        mirror_retention=None,
    )
    with caplog.at_level(logging.ERROR, logger="casnap.checkpointer"), ckpt:
        for step in range(1, 4):
            ckpt.maybe_take(step, _state(step))
    assert any("other content" in r.getMessage() for r in caplog.records)
    assert ckpt.mirror is not None and ckpt.mirror.owed == ()
    assert Repository(mirror).snapshots() == ["step_000000001", "step_000000002", "step_000000003"]
    assert ckpt.snapshots() == ["step_000000003"]  # local retention was not held back
    _restores_step(mirror, "step_000000003", 3)


def test_a_failed_copy_is_logged_and_retried_at_the_next_commit(tmp_path, caplog):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the mirror's folder should be")
    mirror = str(blocker / "mirror")
    ckpt = Checkpointer(str(tmp_path / "local"), every_n_steps=1, mirror=mirror)
    with caplog.at_level(logging.WARNING, logger="casnap.checkpointer"):
        ckpt.maybe_take(0, _state(0))
        assert ckpt.wait() is None and ckpt.mirror is not None
    assert ckpt.mirror.unmirrored == ("step_000000000",)
    assert any("mirror to" in r.getMessage() for r in caplog.records)
    blocker.unlink()  # the network is back
    ckpt.maybe_take(1, _state(1))
    ckpt.close()
    after = ckpt.mirror  # read anew: close() changed it, which mypy's narrowing above cannot see
    assert after is not None and after.unmirrored == ()
    assert Repository(mirror).snapshots() == ["step_000000000", "step_000000001"]
    _restores_step(mirror, "step_000000000", 0)


def test_a_snapshot_retention_deletes_between_the_check_and_the_copy_is_skipped(
    tmp_path, caplog, monkeypatch
):
    """With the same retention on both, a snapshot local retention deleted after the copier
    saw it (its ref gone just before the copy) is skipped, not logged as a failed copy."""
    local, mirror = str(tmp_path / "local"), str(tmp_path / "mirror")
    real_copy = Repository.copy_to
    raced: list[str] = []

    def copy_after_retention(src, dst, names, *args, **kwargs):
        if not raced and "step_000000001" in names:  # retention wins the race, once
            raced.append("step_000000001")
            Repository(local).delete("step_000000001")
        return real_copy(src, dst, names, *args, **kwargs)

    monkeypatch.setattr(Repository, "copy_to", copy_after_retention)
    ckpt = Checkpointer(
        local,
        every_n_steps=1,
        retention=RetentionPolicy(KeepLast(2)),
        mirror=mirror,
        mirror_retention="same",
    )
    with caplog.at_level(logging.WARNING, logger="casnap.checkpointer"), ckpt:
        for step in range(1, 4):
            ckpt.maybe_take(step, _state(step))
    assert raced == ["step_000000001"]
    assert not [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert ckpt.mirror is not None and ckpt.mirror.owed == () and ckpt.mirror.unmirrored == ()
    assert Repository(mirror).snapshots() == ["step_000000002", "step_000000003"]
    _restores_step(mirror, "step_000000003", 3)


@pytest.mark.gcs
def test_mirror_to_gcs(tmp_path, gcs_bucket):  # noqa: F811
    url = f"gs://{gcs_bucket}/{uuid.uuid4().hex}/run1"
    with Checkpointer(
        str(tmp_path / "local"),
        every_n_steps=2,
        async_take=True,
        retention=RetentionPolicy(KeepLast(2)),
        mirror=url,
    ) as ckpt:
        for step in range(7):
            ckpt.maybe_take(step, _state(step))
    assert Repository(url).snapshots() == ckpt.snapshots() == ["step_000000004", "step_000000006"]
    _restores_step(url, "step_000000006", 6)


def test_no_mirror_no_thread(tmp_path: Path):
    ckpt = Checkpointer(str(tmp_path / "local"), every_n_steps=1)
    ckpt.maybe_take(0, _state(0))
    ckpt.close()
    assert ckpt.mirror is None
    assert not any(t.name == "casnap-mirror" for t in threading.enumerate())
