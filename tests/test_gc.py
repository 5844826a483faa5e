"""gc: mark from refs and tags, sweep after a grace period, stay out of takes' way."""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
import time
import uuid
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from gcs_server import gcs_bucket, gcs_server  # noqa: F401  (fixtures)
from helpers import take_stats

import casnap.take.job
from casnap import IntegrityError, Repository, Snapshot, SnapshotNotFoundError, StateDict
from casnap.errors import GcBlockedError, LeaseLostError
from casnap.gc.collect import (
    LEASE_TEMP_MIN_AGE,
    GcRefusedError,
    GcSession,
    execute_gc,
    gc,
    read_gc_epoch,
    sweep_list,
)
from casnap.repo.lease_record import GC_LOCK_KEY, LeaseRecord
from casnap.repo.leases import (
    acquire_lease,
    hold_lease,
    scan_leases,
)
from casnap.repo.repository import RepoStorage, chunk_key, manifest_key, pack_key
from casnap.repo.tags import add_tag, remove_tag
from casnap.store import LocalStore
from casnap.store.faults import FailingStore

CHUNK = 64 * 1024


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("CASNAP_INDEX_DIR", str(tmp_path / "index"))
    monkeypatch.setenv("CASNAP_LEASE_TTL", "5")
    yield


def make_state(seed: int) -> StateDict:
    """Two tensors of three loose chunks each and three small (packed) ones."""
    g = torch.Generator().manual_seed(seed)
    big = {f"big{i}": torch.randn(40_000, generator=g) for i in range(2)}
    small = {f"small{i}": torch.randn(100, generator=g) for i in range(3)}
    return StateDict({**big, **small})


def take(repo: RepoStorage, name: str, state: StateDict, **kw) -> Snapshot:
    opts: dict[str, Any] = {"repository": repo, "settings": {"chunk_size": CHUNK}}
    return Snapshot.take(f"{repo.url}/{name}", {"s": state}, **opts, **kw)


def restored(repo: RepoStorage, name: str, like: StateDict) -> StateDict:
    out = StateDict({k: torch.zeros_like(v) for k, v in like.items()})
    Snapshot(f"{repo.url}/{name}", repository=repo).restore({"s": out})
    return out


def assert_restores(repo: RepoStorage, name: str, state: StateDict) -> None:
    out = restored(repo, name, state)
    assert all(torch.equal(out[k], state[k]) for k in state)


def stored(repo: RepoStorage) -> set[str]:
    return {k for kind in ("manifests", "chunks", "packs") for k in repo.store.list(kind)}


def needs(repo: RepoStorage, manifest: str) -> set[str]:
    """The manifest object and every chunk object or pack it references."""
    m = repo.read_manifest(manifest)
    objs = {pack_key(c.pack) if c.pack else chunk_key(c.hash) for c in m.chunk_refs()}
    return objs | {manifest_key(manifest)}


def assert_whole(repo: RepoStorage) -> None:
    """Every manifest in the store (referenced or not) has every object it names."""
    present = stored(repo)
    for key in repo.store.list("manifests"):
        missing = needs(repo, key.rsplit("/", 1)[-1]) - present
        assert not missing, f"{key} names missing objects {sorted(missing)}"


def age(repo: RepoStorage, keys: set[str], seconds: float) -> None:
    then = time.time() - seconds
    for key in keys:
        os.utime(os.path.join(repo.url, ".casnap", *key.split("/")), (then, then))


@pytest.fixture
def repo(tmp_path) -> RepoStorage:
    return RepoStorage.open_or_create(str(tmp_path / "repo"), chunk_size=CHUNK)


@contextmanager
def _no_lease(repo: RepoStorage, **kw):
    """What a take did before leases existed: decide dedup with no exclusion from gc."""
    yield SimpleNamespace(check=lambda: None)


# -- what is swept and what is kept -----------------------------------------------


def test_gc_sweeps_what_no_ref_reaches_and_keeps_the_rest(repo):
    a, b = make_state(1), make_state(1)
    b["big0"].add_(1.0)
    b["small0"].add_(1.0)
    s1 = take(repo, "s1", a)
    s2 = take(repo, "s2", b)
    repo.delete_ref("s1")
    only_s1 = needs(repo, s1.manifest_hash) - needs(repo, s2.manifest_hash)
    # Its manifest and big0's three chunks; its pack still holds small1 and small2 for s2.
    assert len(only_s1) == 1 + 3

    result = gc(repo, grace_seconds=0)

    assert stored(repo) == needs(repo, s2.manifest_hash)
    assert result.deleted_manifests == 1 and result.deleted_chunks == 3
    assert result.deleted_packs == 0
    assert result.bytes_freed > 160_000
    assert_restores(repo, "s2", b)
    again = gc(repo, grace_seconds=0)
    assert again.deleted == 0 and again.epoch == result.epoch


def test_a_tag_pins_a_snapshot_whose_ref_is_gone(repo):
    a, b = make_state(1), make_state(2)
    s1 = take(repo, "s1", a)
    take(repo, "s2", b)
    add_tag(repo, "release", "s1")
    repo.delete_ref("s1")

    gc(repo, grace_seconds=0)
    assert needs(repo, s1.manifest_hash) <= stored(repo)
    assert_whole(repo)

    remove_tag(repo, "release")
    result = gc(repo, grace_seconds=0)
    assert result.deleted_manifests == 1
    assert manifest_key(s1.manifest_hash) not in stored(repo)


def test_the_grace_period_protects_young_objects_and_what_young_manifests_need(repo):
    a, b = make_state(1), make_state(2)
    s1 = take(repo, "s1", a)
    take(repo, "s2", b)
    repo.delete_ref("s1")
    garbage = needs(repo, s1.manifest_hash)

    plan = gc(repo).plan  # default grace: one hour
    assert plan.empty and plan.young_kept == len(garbage)

    # Old chunks of a young unreachable manifest stay: a manifest that exists is whole.
    age(repo, garbage - {manifest_key(s1.manifest_hash)}, 7200)
    assert gc(repo, grace_seconds=3600).deleted == 0
    assert_whole(repo)

    age(repo, {manifest_key(s1.manifest_hash)}, 7200)
    result = gc(repo, grace_seconds=3600)
    assert result.deleted == len(garbage)
    assert not garbage & stored(repo)
    assert_restores(repo, "s2", b)


def test_dry_run_deletes_nothing_and_prints_the_plan(repo):
    s1 = take(repo, "s1", make_state(1))
    take(repo, "s2", make_state(2))
    repo.delete_ref("s1")
    before = stored(repo)

    result = gc(repo, grace_seconds=0, dry_run=True)

    assert stored(repo) == before
    assert result.dry_run and result.deleted == 0 and read_gc_epoch(repo) is None
    plan = result.plan
    assert {g.key for g in plan.data} == needs(repo, s1.manifest_hash) - needs(
        repo, repo.resolve("s2")
    )
    text = result.render()
    assert "dry run" in text and "1 manifest(s), 6 chunk(s), 1 pack(s)" in text
    assert json.loads(json.dumps(plan.to_json()))["manifests"] == [manifest_key(s1.manifest_hash)]
    assert not repo.store.exists(GC_LOCK_KEY)


def test_a_plan_executed_later_deletes_only_what_is_still_garbage(repo):
    a = make_state(1)
    s1 = take(repo, "s1", a)
    repo.delete_ref("s1")
    plan = sweep_list(repo, grace_seconds=0)  # the lock is released again
    assert len(plan.data) == 1 + 6 + 1

    take(repo, "s2", a, parents=[s1.manifest_hash])  # dedups against the planned garbage
    result = execute_gc(repo, plan)

    assert result.deleted_manifests == 1 and result.deleted_chunks == 0
    assert result.skipped == 7
    assert_restores(repo, "s2", a)
    assert_whole(repo)


def test_progress_is_reported_while_deleting(repo):
    take(repo, "s1", make_state(1))
    repo.delete_ref("s1")
    calls: list[tuple[int, int]] = []
    with GcSession(repo) as session:
        plan = session.plan(grace_seconds=0)
        session.execute(plan, progress=lambda n, total: calls.append((n, total)))
    assert [n for n, _ in calls] == list(range(1, 9)) and {t for _, t in calls} == {8}


def test_gc_works_on_an_fsspec_store_using_its_object_times():
    repo = RepoStorage.open_or_create(f"memory://gc-{uuid.uuid4().hex}", chunk_size=CHUNK)
    take(repo, "s1", make_state(1))
    take(repo, "s2", make_state(2))
    repo.delete_ref("s1")
    assert gc(repo, grace_seconds=3600).deleted == 0  # "created" times are recent
    assert gc(repo, grace_seconds=0).deleted == 1 + 6 + 1
    assert_restores(repo, "s2", make_state(2))


def test_gc_refuses_to_sweep_when_a_reachable_manifest_is_unreadable(repo):
    s1 = take(repo, "s1", make_state(1))
    take(repo, "s2", make_state(2))
    repo.delete_ref("s2")
    path = os.path.join(repo.url, ".casnap", *manifest_key(s1.manifest_hash).split("/"))
    with open(path, "r+b") as fh:
        fh.write(b"X")
    before = stored(repo)
    with pytest.raises(GcRefusedError, match="cannot tell which chunks"):
        gc(repo, grace_seconds=0)
    assert stored(repo) == before and not repo.store.exists(GC_LOCK_KEY)


def _temp_files(repo, folder, names, age):
    os.makedirs(os.path.join(repo.url, ".casnap", *folder), exist_ok=True)
    base = os.path.join(repo.url, ".casnap", *folder)
    paths = [os.path.join(base, f"{n}~tmp-{uuid.uuid4().hex}") for n in names]
    then = time.time() - age
    for path in paths:
        with open(path, "wb") as fh:
            fh.write(b"x" * 10)
        os.utime(path, (then, then))
    return paths


def test_temp_files_of_killed_takes_are_removed_after_the_grace_period(repo):
    take(repo, "s1", make_state(1))
    old_chunks = _temp_files(repo, ("chunks", "ab"), ["a0", "a1"], 7200)
    young_chunks = _temp_files(repo, ("packs", "cd"), ["b0"], 5)
    old_lease = _temp_files(repo, ("leases",), ["c0"], 7200)
    young_lease = _temp_files(repo, ("leases",), ["d0"], 5)  # a take starting now
    # The default grace period keeps what is younger than it.
    result = gc(repo)
    assert result.deleted_temp_files == 3
    assert not any(map(os.path.exists, old_chunks + old_lease))
    assert all(map(os.path.exists, young_chunks + young_lease))
    # --grace 0: no take holds a lease, so every data folder's temp file is a dead writer's.
    result = gc(repo, grace_seconds=0)
    assert result.deleted_temp_files == 1
    assert not any(map(os.path.exists, young_chunks))
    assert all(map(os.path.exists, young_lease))
    assert_restores(repo, "s1", make_state(1))


def test_temp_files_at_the_top_of_the_store_are_swept_or_kept_by_who_writes_them(repo):
    # A gc killed while replacing gc-epoch leaves its temp file at the top of
    # .casnap; only gc.lock's holder writes gc-epoch, so the next gc removes it.
    # gc.lock, gc-claims/ and config.json may be written by a live rival gc or
    # a repository being created: kept, as a lease's, for ten minutes.
    take(repo, "s1", make_state(1))
    epoch = _temp_files(repo, (), ["gc-epoch"], 5)
    lock, config = _temp_files(repo, (), ["gc.lock", "config.json"], 5)
    claim = _temp_files(repo, ("gc-claims",), ["c1"], 5)
    assert Repository.of(repo).du().leftovers.temp_files == 4  # what du reports counts them too
    result = gc(repo, grace_seconds=0)
    assert result.deleted_temp_files == 1
    assert not any(map(os.path.exists, epoch))
    assert all(map(os.path.exists, [lock, config, *claim]))
    old = time.time() - LEASE_TEMP_MIN_AGE - 1
    for path in (lock, config, *claim):
        os.utime(path, (old, old))
    assert gc(repo, grace_seconds=0).deleted_temp_files == 3
    assert Repository.of(repo).du().leftovers.temp_files == 0
    assert_restores(repo, "s1", make_state(1))


def test_a_malformed_ref_makes_gc_refuse(repo):
    take(repo, "s1", make_state(1))
    repo.store.put("refs/broken", b"not json")
    with pytest.raises(GcRefusedError, match="nothing was deleted"):
        gc(repo, grace_seconds=0)


# -- the gc epoch -------------------------------------------------------------------


def test_the_gc_epoch_changes_only_when_gc_deleted_something(repo):
    take(repo, "s1", make_state(1))
    assert read_gc_epoch(repo) is None
    gc(repo, grace_seconds=0)
    assert read_gc_epoch(repo) is None  # nothing was garbage

    take(repo, "s2", make_state(2))
    repo.delete_ref("s1")
    result = gc(repo, grace_seconds=0)
    first = read_gc_epoch(repo)
    assert first is not None and result.epoch == first

    gc(repo, grace_seconds=0)
    assert read_gc_epoch(repo) == first
    repo.delete_ref("s2")
    gc(repo, grace_seconds=0)
    assert read_gc_epoch(repo) not in (None, first)


# -- leases: takes and gc exclude each other (the lock itself: test_gc_lock.py) ---


def test_a_live_lease_makes_gc_give_up_without_deleting(repo):
    take(repo, "s1", make_state(1))
    repo.delete_ref("s1")
    before = stored(repo)
    with hold_lease(repo):
        started = time.monotonic()
        with pytest.raises(GcBlockedError, match="1 take"):
            gc(repo, grace_seconds=0, wait_seconds=0.3)
        assert time.monotonic() - started >= 0.3
    assert stored(repo) == before and read_gc_epoch(repo) is None
    assert not repo.store.exists(GC_LOCK_KEY)
    assert gc(repo, grace_seconds=0).deleted == len(before)


def test_gc_waits_for_a_lease_to_end(repo):
    take(repo, "s1", make_state(1))
    repo.delete_ref("s1")
    lease = acquire_lease(repo.store)
    timer = threading.Timer(0.4, lease.release)
    timer.start()
    started = time.monotonic()
    result = gc(repo, grace_seconds=0, wait_seconds=10)
    assert time.monotonic() - started >= 0.35
    assert result.deleted == 8
    timer.join()


def test_an_expired_lease_of_a_crashed_take_is_ignored_and_removed(repo):
    take(repo, "s1", make_state(1))
    repo.delete_ref("s1")
    dead = LeaseRecord.new("take", ttl=-1.0)
    repo.store.put(f"leases/{dead.id}", dead.to_bytes())
    result = gc(repo, grace_seconds=0, wait_seconds=0)
    assert result.deleted == 8 and result.deleted_leases == 1
    assert list(repo.store.list("leases")) == []


def test_a_take_waits_while_gc_holds_the_lock(repo):
    state = make_state(1)
    done = threading.Event()

    def taker() -> None:
        take(repo, "s1", state)
        done.set()

    with GcSession(repo):
        thread = threading.Thread(target=taker)
        thread.start()
        assert not done.wait(0.5)
        assert not repo.has_ref("s1")
        assert not scan_leases(repo.store).live  # it withdrew its lease while waiting
    assert done.wait(10)
    thread.join()
    assert_restores(repo, "s1", state)


def test_a_take_whose_lease_lapsed_does_not_commit(repo, monkeypatch):
    # A process stalled for longer than its lease lives (no heartbeat got through).
    monkeypatch.setattr("casnap.repo.leases.Lease._renew", lambda self: None)
    monkeypatch.setenv("CASNAP_LEASE_TTL", "0.4")
    real = repo.write_manifest

    def slow_write_manifest(manifest, jsonable=None):
        time.sleep(0.5)
        return real(manifest, jsonable)

    monkeypatch.setattr(repo, "write_manifest", slow_write_manifest)
    with pytest.raises(LeaseLostError):
        take(repo, "s1", make_state(1))
    assert not repo.has_ref("s1")
    assert list(repo.store.list("leases")) == []


# -- the race gc must design out ------------------------------------------------------


@pytest.mark.parametrize("protected", [True, False], ids=["with-leases", "without-leases"])
def test_a_take_deduping_against_garbage_that_gc_is_sweeping(repo, monkeypatch, protected):
    """DESIGN.md's race: a take skips chunks that exist but no ref reaches; gc runs
    between that decision and the take's ref. Without leases the new snapshot loses
    its chunks; with them gc stays out until the ref is written."""
    state = make_state(1)
    s1 = take(repo, "s1", state)
    repo.delete_ref("s1")  # retention: s1's chunks are now garbage
    outcome: list[object] = []
    commit_ref = repo.write_ref

    def write_ref_after_a_gc(name: str, manifest: str) -> None:
        try:
            outcome.append(gc(repo, grace_seconds=0, wait_seconds=0.2))
        except GcBlockedError as exc:
            outcome.append(exc)
        commit_ref(name, manifest)

    monkeypatch.setattr(repo, "write_ref", write_ref_after_a_gc)
    if not protected:
        monkeypatch.setattr(casnap.take.job, "hold_lease", _no_lease)
    # Resumed from s1 (its manifest gives the packed chunks), large chunks probed.
    s2 = take(repo, "s2", state, parents=[s1.manifest_hash])
    assert take_stats(s2).chunks_written == 0

    if protected:
        assert isinstance(outcome[0], GcBlockedError)
        assert_restores(repo, "s2", state)
        assert gc(repo, grace_seconds=0).deleted == 1  # only s1's manifest
        assert_restores(repo, "s2", state)
        assert_whole(repo)
    else:
        # s1's objects and the new, not yet referenced manifest of s2: the snapshot is lost.
        assert outcome[0].deleted == 8 + 1  # type: ignore[attr-defined]
        with pytest.raises((IntegrityError, SnapshotNotFoundError), match="missing"):
            restored(repo, "s2", state)


# -- crash safety -------------------------------------------------------------------


def _gc_that_dies(root: str) -> None:
    # Killed at its second deletion of a chunk file or pack: no cleanup, no lock release.
    dies = FailingStore(LocalStore(root), 2, op="delete", fail=lambda key: os._exit(17))
    repo = RepoStorage.on_store(dies)
    gc(repo, grace_seconds=0)


def test_gc_killed_between_manifest_and_chunk_deletion_leaves_every_ref_whole(repo, monkeypatch):
    a, b, c = make_state(1), make_state(2), make_state(3)
    take(repo, "s1", a)
    take(repo, "s2", b)
    take(repo, "s3", c)
    repo.delete_ref("s1")
    repo.delete_ref("s2")
    monkeypatch.setenv("CASNAP_LEASE_TTL", "1.5")
    child = multiprocessing.get_context("spawn").Process(target=_gc_that_dies, args=(repo.url,))
    child.start()
    child.join(60)
    assert child.exitcode == 17

    assert list(repo.store.list("manifests")) == [manifest_key(repo.resolve("s3"))]
    assert_whole(repo)
    assert_restores(repo, "s3", c)
    assert read_gc_epoch(repo) is not None  # replaced before the first deletion
    assert repo.store.exists(GC_LOCK_KEY)  # left behind by the killed gc

    # Takes wait out the dead gc's lock; the next gc breaks it and finishes the sweep.
    take(repo, "s4", a)
    result = gc(repo, grace_seconds=0)
    assert result.deleted_chunks + result.deleted_packs > 0
    assert stored(repo) == needs(repo, repo.resolve("s3")) | needs(repo, repo.resolve("s4"))
    assert_restores(repo, "s3", c)
    assert_restores(repo, "s4", a)


# -- on GCS -------------------------------------------------------------------------


@pytest.mark.gcs
def test_gc_and_leases_on_gcs(gcs_bucket):  # noqa: F811
    repo = RepoStorage.open_or_create(
        f"gs://{gcs_bucket}/{uuid.uuid4().hex}/repo", chunk_size=CHUNK
    )
    take(repo, "s1", make_state(1))
    take(repo, "s2", make_state(2))
    repo.delete_ref("s1")
    assert list(repo.store.list("leases")) == []  # each take removed its lease
    assert gc(repo, grace_seconds=3600).plan.young_kept == 8  # object times from GCS
    with hold_lease(repo), pytest.raises(GcBlockedError):
        gc(repo, grace_seconds=0, wait_seconds=0.2)
    assert gc(repo, grace_seconds=0).deleted == 8
    assert_restores(repo, "s2", make_state(2))
    assert_whole(repo)


_KILLED_TAKE = """
import os, sys, torch
from casnap import Snapshot, StateDict
real_replace = os.replace
def die(src, dst):  # the process is killed between writing a chunk and renaming it
    if "/chunks/" in dst:
        os._exit(9)
    real_replace(src, dst)
os.replace = die
state = StateDict(w=torch.randn(200_000))
Snapshot.take(sys.argv[1], {"s": state}, settings={"chunk_size": 65536})
"""


def test_du_reports_what_a_killed_take_left_and_gc_grace_0_reclaims_it(repo, capsys):
    import subprocess
    import sys

    from casnap.cli import main

    take(repo, "s1", make_state(1))
    env = {**os.environ, "CASNAP_LEASE_TTL": "0.5"}
    proc = subprocess.run([sys.executable, "-c", _KILLED_TAKE, f"{repo.url}/s2"], env=env)
    assert proc.returncode == 9
    time.sleep(0.6)  # its lease expires: nobody renews it
    left = Repository.of(repo).du().leftovers
    assert left.temp_files >= 1 and left.temp_bytes > 0 and left.expired_leases == 1
    assert main(["du", repo.url]) == 0
    assert "left by interrupted takes: " in capsys.readouterr().out
    result = gc(repo, grace_seconds=0)
    assert result.deleted_temp_files == left.temp_files and result.deleted_leases == 1
    assert not Repository.of(repo).du().leftovers
    assert main(["du", repo.url]) == 0
    assert "left by interrupted takes" not in capsys.readouterr().out
    assert_restores(repo, "s1", make_state(1))
