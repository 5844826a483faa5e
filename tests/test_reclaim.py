"""Retention frees space: reclaim deletes what only the retired snapshots reached.

The main tests measure the repository's bytes on disk (every file under its
directory, as ``du`` counts them) while a Checkpointer loop runs, as a user
meets it.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
import time

import pytest
import torch
from helpers import reclaimed_of, retention_of

from casnap import Repository, Snapshot, StateDict
from casnap.api.checkpointer import Checkpointer
from casnap.cli.app import main
from casnap.errors import ConfigError
from casnap.gc.collect import GcSession, execute_gc
from casnap.gc.reclaim import ReclaimResult, reclaim
from casnap.ops.retention import KeepBest, KeepLast, RetentionPolicy
from casnap.repo.leases import hold_lease
from casnap.repo.repository import chunk_key, manifest_key, pack_key

MiB = 1 << 20
BIG, SMALL = 4, 16  # 1 MiB loose chunks, 16 KiB packed ones
STATE_BYTES = BIG * MiB + SMALL * 16 * 1024  # 4.25 MiB, all of it new every step
# Manifests, refs, config, gc-epoch, frame headers: far below one chunk.
SLACK = 512 * 1024  # under load an async loop peaked at 273 KiB of these


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("CASNAP_INDEX_DIR", str(tmp_path / "index"))
    monkeypatch.setenv("CASNAP_LEASE_TTL", "10")


def state_at(step: int) -> StateDict:
    """Every tensor different at every step; random floats, so nothing compresses."""
    g = torch.Generator().manual_seed(step)
    big = {f"big{i}": torch.randn(MiB // 4, generator=g) for i in range(BIG)}
    small = {f"small{i}": torch.randn(4096, generator=g) for i in range(SMALL)}
    return StateDict({**big, **small})


def disk_bytes(root: str) -> int:
    """What `du --apparent-size` says: the sizes of all files below ``root``."""
    total = 0
    for folder, _dirs, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except FileNotFoundError:
                pass  # deleted while walking
    return total


class Watcher:
    """Samples the repository's size in a thread, as someone watching `du` would."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, disk_bytes(self.root))
            time.sleep(0.001)

    def __enter__(self) -> Watcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, disk_bytes(self.root))


def restores_bit_exact(repo: Repository, name: str, expected: StateDict) -> bool:
    out = StateDict({k: torch.zeros_like(v) for k, v in expected.items()})
    Snapshot(f"{repo.url}/{name}", repository=repo).restore({"m": out})
    return all(torch.equal(out[k], expected[k]) for k in expected)


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out


# -- the retention loop, as a user meets it ----------------------------------


@pytest.mark.parametrize("async_take", [False, True], ids=["sync", "async"])
def test_a_keep_last_2_loop_holds_the_kept_snapshots_plus_one_take_in_flight(tmp_path, async_take):
    root = str(tmp_path / "run")
    after_take = []
    with Watcher(root) as watch:
        ckpt = Checkpointer(root, 1, retention=RetentionPolicy(KeepLast(2)), async_take=async_take)
        for step in range(1, 21):
            ckpt.maybe_take(step, {"m": state_at(step)})
            after_take.append(disk_bytes(root))
        ckpt.close()
    final = disk_bytes(root)
    # After each commit the kept snapshots (at most 2) remain; an async take's
    # successor is already being written when maybe_take returns.
    in_flight = 1 if async_take else 0
    for step, size in enumerate(after_take, start=1):
        kept = min(step - in_flight, 2)
        assert size <= (kept + in_flight) * STATE_BYTES + SLACK, (step, size)
    # At every instant: the kept snapshots plus the one take being written.
    assert watch.peak <= 3 * STATE_BYTES + SLACK, watch.peak
    assert final <= 2 * STATE_BYTES + SLACK, final  # without reclaim: 20 states
    assert ckpt.snapshots() == ["step_000000019", "step_000000020"]
    reclaimed = reclaimed_of(ckpt)
    assert reclaimed.deferred is None and reclaimed.pending == ()
    assert reclaimed.deleted_manifests == 1 and reclaimed.bytes_freed >= STATE_BYTES
    repo = Repository(root)
    assert not repo.du().unreferenced  # nothing left for gc either
    for step in (19, 20):
        assert restores_bit_exact(repo, f"step_{step:09d}", state_at(step))


def test_keep_last_2_and_keep_best_1_over_6_saves_frees_the_retired_space(tmp_path):
    """The issue's scenario: the directory grew to 6 states and gc freed nothing."""
    root = str(tmp_path / "run")
    policy = RetentionPolicy(KeepLast(2), KeepBest(1, "loss"))
    ckpt = Checkpointer(root, 1, retention=policy)
    sizes = []
    for step in range(1, 7):
        ckpt.maybe_take(step, {"m": state_at(step)}, metrics={"loss": abs(step - 2.2)})
        sizes.append(disk_bytes(root))
    assert ckpt.snapshots() == ["step_000000002", "step_000000005", "step_000000006"]
    assert max(sizes) <= 3 * STATE_BYTES + SLACK, sizes
    assert sizes[-1] <= 3 * STATE_BYTES + SLACK  # was 6 states, and 0 B freed by gc
    freed = reclaimed_of(ckpt)
    assert retention_of(ckpt).deleted == ("step_000000004",)
    assert freed.deleted_manifests == 1 and freed.deleted_chunks == BIG
    assert freed.deleted_packs == 1 and freed.bytes_freed >= STATE_BYTES
    assert "reclaimed" in freed.render()


# -- what is kept, and why ---------------------------------------------------


def test_a_chunk_shared_by_a_dropped_and_a_kept_snapshot_stays(tmp_path):
    root = str(tmp_path / "run")
    frozen = torch.randn(MiB // 4)  # e.g. frozen embeddings: the same chunk in every snapshot
    ckpt = Checkpointer(root, 1, retention=RetentionPolicy(KeepLast(1)))
    states, objects = {}, {}
    for step in (1, 2, 3):
        states[step] = StateDict(frozen=frozen.clone(), w=state_at(step)["big0"])
        snap = ckpt.maybe_take(step, {"m": states[step]})
        assert isinstance(snap, Snapshot)
        objects[step] = needs(snap.manifest)
    repo = Repository(root)
    shared = objects[2] & objects[3]
    assert len(shared) == 1 and all(repo.storage.store.exists(k) for k in shared)
    assert not any(repo.storage.store.exists(k) for k in objects[2] - shared)
    result = reclaimed_of(ckpt)
    assert result.shared_objects == 1 and result.shared_bytes >= MiB
    assert result.deleted_chunks == 1  # step 2's own "w"
    assert "kept 1 object(s)" in result.render()
    assert restores_bit_exact(repo, "step_000000003", states[3])
    assert repo.verify(read_data=True).ok


def test_reclaim_false_leaves_the_space_to_gc(tmp_path, capsys):
    root = str(tmp_path / "run")
    ckpt = Checkpointer(root, 1, retention=RetentionPolicy(KeepLast(1)), reclaim=False)
    for step in (1, 2, 3):
        ckpt.maybe_take(step, {"m": state_at(step)})
    assert retention_of(ckpt).reclaimed is None
    assert disk_bytes(root) > 2 * STATE_BYTES  # the retired snapshots' bytes are still there
    code, out = run_cli(capsys, "du", root)
    assert code == 0 and "unreferenced" in out
    assert run_cli(capsys, "gc", root, "--grace", "0")[0] == 0
    assert disk_bytes(root) <= STATE_BYTES + SLACK


def needs(manifest) -> set[str]:
    return {pack_key(r.pack) if r.pack else chunk_key(r.hash) for r in manifest.chunk_refs()}


def test_a_pack_some_kept_snapshot_still_reads_from_stays_and_its_dead_frames_are_reported(
    tmp_path,
):
    root = str(tmp_path / "run")
    first = state_at(1)
    second = StateDict(dict(first.items()))
    second["small0"] = torch.randn(4096)  # one small tensor changes: a new pack holds it
    ckpt = Checkpointer(root, 1, retention=RetentionPolicy(KeepLast(1)))
    ckpt.maybe_take(1, {"m": first})
    ckpt.maybe_take(2, {"m": second})
    result = reclaimed_of(ckpt)
    assert result.deleted_packs == 0 and result.partial_packs == 1
    assert result.dead_pack_bytes >= 16 * 1024  # small0's old frame, until the pack goes
    assert "pack(s) hold" in result.render()
    repo = Repository(root)
    assert restores_bit_exact(repo, "step_000000002", second)


def test_objects_the_retirement_did_not_create_keep_the_grace_period(tmp_path, capsys):
    root = str(tmp_path / "run")
    repo = Repository.init(root)
    # A take that died after its manifest: unreachable, but not retired by anyone.
    orphan = repo.take("crashed", {"m": state_at(100)}).manifest_hash
    repo.storage.delete_ref("crashed")
    orphan_keys = {manifest_key(orphan)} | needs(repo.storage.read_manifest(orphan))
    ckpt = Checkpointer(root, 1, retention=RetentionPolicy(KeepLast(1)))
    for step in (1, 2, 3):
        ckpt.maybe_take(step, {"m": state_at(step)})
    assert reclaimed_of(ckpt).deleted_manifests == 1
    assert all(repo.storage.store.exists(k) for k in orphan_keys)
    code, out = run_cli(capsys, "gc", root)
    assert code == 0 and "freed 0 B" in out
    # gc says what its grace period kept and how to free it
    assert f"kept: {len(orphan_keys)} unreachable object(s)" in out and "--grace 0" in out
    code, out = run_cli(capsys, "gc", root, "--grace", "0", "--json")
    assert json.loads(out)["deleted_manifests"] == 1
    assert not any(repo.storage.store.exists(k) for k in orphan_keys)


def test_an_unreferenced_manifest_that_uses_a_retired_chunk_keeps_it(tmp_path):
    repo = Repository.init(str(tmp_path / "run"))
    state = state_at(1)
    old = repo.take("old", {"m": state}).manifest_hash
    other = repo.take("other", {"m": StateDict(dict(state.items()))}).manifest_hash
    repo.take("new", {"m": state_at(2)})
    repo.storage.delete_ref("other")  # e.g. a take that died before its ref
    repo.storage.delete_ref("old")
    result = reclaim(repo.storage, [old])
    assert result.deleted_manifests == 1 and result.deleted_chunks == 0
    assert result.held_objects == BIG + 1 and "other unreferenced manifests" in result.render()
    assert repo.storage.store.exists(manifest_key(other))
    repo.storage.write_ref("other", other)
    assert restores_bit_exact(repo, "other", state)


def test_a_retired_manifest_a_tag_still_pins_is_kept(tmp_path):
    repo = Repository.init(str(tmp_path / "run"))
    m = repo.take("a", {"m": state_at(1)}).manifest_hash
    repo.take("b", {"m": state_at(2)})
    repo.tag("golden", "a")
    repo.storage.delete_ref("a")
    result = reclaim(repo.storage, [m])
    assert result.deleted == 0 and result.still_rooted == 1
    assert repo.storage.store.exists(manifest_key(m))


def test_a_reclaim_is_a_gc_plan_narrowed_to_the_retired_manifests(tmp_path):
    repo = Repository.init(str(tmp_path / "run"))
    orphan = repo.take("crashed", {"m": state_at(100)}).manifest_hash
    repo.storage.delete_ref("crashed")  # unreachable, but retired by nobody: out of scope
    orphan_keys = {manifest_key(orphan)} | needs(repo.storage.read_manifest(orphan))
    m = repo.take("a", {"m": state_at(1)}).manifest_hash
    repo.take("b", {"m": state_at(2)})
    repo.storage.delete_ref("a")
    with GcSession(repo.storage) as session:
        with pytest.raises(ConfigError, match="grace"):
            session.plan(retired=[m])  # the default grace period: a reclaim has none
        plan = session.plan(grace_seconds=0, retired=[m, m])
    assert plan.retired == (m,) and [g.key for g in plan.manifests] == [manifest_key(m)]
    assert len(plan.chunks) == BIG and len(plan.packs) == 1
    assert not plan.temp_files and not plan.dead_leases
    assert json.loads(json.dumps(plan.to_json()))["retired"] == [m]
    assert "reclaim plan" in plan.render()
    # Executed under another lock it is re-checked; nothing out of its scope goes.
    result = execute_gc(repo.storage, plan)
    assert result.deleted == 1 + BIG + 1 and result.skipped == 0
    assert all(repo.storage.store.exists(k) for k in orphan_keys)
    assert restores_bit_exact(repo, "b", state_at(2))


# -- beside takes in flight --------------------------------------------------


def test_reclaim_under_its_own_lease_defers_quickly_instead_of_deadlocking(tmp_path):
    repo = Repository.init(str(tmp_path / "run"))
    m = repo.take("a", {"m": state_at(1)}).manifest_hash
    repo.take("b", {"m": state_at(2)})
    repo.storage.delete_ref("a")
    before = disk_bytes(repo.url)
    with hold_lease(repo.storage):  # as if this process's own async take were in flight
        started = time.monotonic()
        result = reclaim(repo.storage, [m], wait_seconds=0.2)
        assert time.monotonic() - started < 2
    assert result.deferred is not None and "in flight" in result.deferred
    assert result.pending == (m,) and result.deleted == 0
    assert disk_bytes(repo.url) == before
    assert "deferred" in result.render()
    assert reclaim(repo.storage, result.pending).deleted_manifests == 1


def _hold_a_lease(root: str, held, release) -> None:
    repo = Repository(root)
    with hold_lease(repo.storage):
        held.set()
        release.wait(60)


def test_a_deferred_reclaim_is_done_by_the_next_commit(tmp_path):
    """Another process's take holds a lease: the commit does not wait long; the next reclaims."""
    root = str(tmp_path / "run")
    ckpt = Checkpointer(root, 1, retention=RetentionPolicy(KeepLast(1)), reclaim_wait_seconds=0.3)
    ckpt.maybe_take(1, {"m": state_at(1)})
    ctx = multiprocessing.get_context("spawn")
    held, release = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_hold_a_lease, args=(root, held, release))
    proc.start()
    try:
        assert held.wait(60)
        started = time.monotonic()
        ckpt.maybe_take(2, {"m": state_at(2)})
        assert time.monotonic() - started < 5  # a short, bounded wait; the take itself is fast
        deferred = reclaimed_of(ckpt)
        assert deferred.deferred is not None and len(deferred.pending) == 1
        assert disk_bytes(root) >= 2 * STATE_BYTES  # step 1 still on disk
    finally:
        release.set()
        proc.join(30)
    ckpt.maybe_take(3, {"m": state_at(3)})
    caught_up = reclaimed_of(ckpt)
    assert caught_up.deferred is None and caught_up.pending == ()
    assert caught_up.deleted_manifests == 2  # step 1's, left over, and step 2's
    assert disk_bytes(root) <= STATE_BYTES + SLACK


def _state_of_other(i: int) -> StateDict:
    return state_at((i - 1) % 12 + 1)


def _take_alongside(root: str, ready, done) -> None:
    """Another run in the same repository, retiring and reclaiming too: it writes the
    states the first run writes, so each dedups against chunks the other may be
    reclaiming at that moment."""
    ckpt = Checkpointer(
        root,
        1,
        name_format="other_{step:06d}",
        retention=RetentionPolicy(KeepLast(1)),
        reclaim_wait_seconds=10.0,
    )
    i = 1
    while not done.is_set() or i <= 12:
        ckpt.maybe_take(i, {"m": _state_of_other(i)})
        ready.set()
        i += 1


def test_reclaim_beside_takes_in_another_process_keeps_every_snapshot_whole(tmp_path):
    root = str(tmp_path / "run")
    ckpt = Checkpointer(
        root,
        1,
        retention=RetentionPolicy(KeepLast(2)),
        async_take=True,
        reclaim_wait_seconds=10.0,  # reclaim rather than defer: exercise the race
    )
    ckpt.maybe_take(1, {"m": state_at(1)})
    ckpt.wait()
    ctx = multiprocessing.get_context("spawn")
    ready, done = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_take_alongside, args=(root, ready, done))
    proc.start()
    results: list[ReclaimResult | None] = []
    try:
        assert ready.wait(120)  # its takes are running from now on
        for step in range(2, 13):
            ckpt.maybe_take(step, {"m": state_at(step)})
            results.append(ckpt.last_retention.reclaimed if ckpt.last_retention else None)
        ckpt.close()
        results.append(retention_of(ckpt).reclaimed)
    finally:
        done.set()
        proc.join(120)
    assert proc.exitcode == 0
    repo = Repository(root)
    names = repo.storage.list_snapshots()
    assert ckpt.snapshots() == ["step_000000011", "step_000000012"]
    assert len(names) == 3  # and the other run's newest
    # Reclaims that met the other run's gc lock were deferred; catch up now.
    results.append(reclaim(repo.storage, reclaimed_of(ckpt).pending))
    assert sum(r.bytes_freed for r in results if r is not None) > 0
    assert repo.verify(read_data=True).ok
    for name in names:
        step = int(name.rsplit("_", 1)[-1])
        expected = state_at(step) if name.startswith("step_") else _state_of_other(step)
        assert restores_bit_exact(repo, name, expected), name
    # What deferred reclaims left is garbage only: gc takes it and every snapshot stays whole.
    Repository(root).gc(grace_seconds=0)
    assert repo.verify(read_data=True).ok and not repo.du().unreferenced


# -- gc, du and verify tell the user about garbage ---------------------------


def test_du_and_verify_report_unreferenced_bytes_and_prune_frees_them(tmp_path, capsys):
    root = str(tmp_path / "run")
    repo = Repository.init(root)
    for step in (1, 2, 3):
        repo.take(f"s{step}", {"m": state_at(step)}, metadata={"step": step})
    code, out = run_cli(capsys, "retain", root, "--keep-last", "1")
    assert code == 0 and "--prune" in out
    expected = run_cli(capsys, "gc", root, "--grace", "0", "--dry-run", "--json")[1]
    garbage = json.loads(expected)["plan"]["bytes_to_free"]
    assert garbage >= 2 * STATE_BYTES
    code, out = run_cli(capsys, "du", root)
    assert code == 0 and "unreferenced: 2 manifest(s)" in out and "casnap gc" in out
    code, out = run_cli(capsys, "du", root, "--json")
    assert json.loads(out)["unreferenced"]["bytes"] == garbage
    code, out = run_cli(capsys, "verify", root)
    assert code == 0 and "OK" in out and "unreferenced: 2 manifest(s)" in out  # not damage
    code, out = run_cli(capsys, "verify", root, "--json")
    report = json.loads(out)
    assert code == 0 and report["ok"] and report["unreferenced"]["bytes"] == garbage

    # `retain --prune` reclaims what the snapshots it retires reached, at once
    repo.take("s4", {"m": state_at(4)}, metadata={"step": 4})
    before = disk_bytes(root)
    code, out = run_cli(capsys, "retain", root, "--keep-last", "1", "--prune")
    assert code == 0 and "reclaimed" in out
    assert before - disk_bytes(root) >= STATE_BYTES
    code, out = run_cli(capsys, "retain", root, "--keep-last", "1", "--prune", "--json")
    nothing = json.loads(out)["reclaimed"]  # nothing retired this time
    assert code == 0 and nothing["retired"] == [] and nothing["bytes_freed"] == 0
    code, out = run_cli(capsys, "gc", root, "--grace", "0")
    assert code == 0
    code, out = run_cli(capsys, "du", root, "--json")
    assert json.loads(out)["unreferenced"] == {
        "manifests": 0,
        "objects": 0,
        "bytes": 0,
        "hint": None,
    }
    code, out = run_cli(capsys, "verify", root)
    assert code == 0 and "unreferenced" not in out
