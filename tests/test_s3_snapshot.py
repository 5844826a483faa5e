"""Snapshots on s3:// against a real S3 API server (moto's) on localhost.

Take, dedup, restore, read_object, verify, gc, a race for a snapshot name, and
the ``casnap`` command with ``--storage-option endpoint_url=...``.
Run: ``pytest -q tests/test_s3_snapshot.py`` (marker ``s3``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
import torch
from s3_server import S3Bucket, s3_bucket, s3_server  # noqa: F401  (fixtures)

from casnap import Repository, Snapshot, SnapshotExistsError, StateDict
from casnap.repo.repository import RepoStorage
from casnap.store import CountingStore, S3Store

pytestmark = pytest.mark.s3

REPO_ROOT = Path(__file__).resolve().parents[1]
CASNAP = str(Path(sys.executable).parent / "casnap")


def _repo_url(bucket: S3Bucket) -> str:
    return f"{bucket.url}/{uuid.uuid4().hex}/repo"


def test_take_restore_and_dedup_on_s3(s3_bucket):  # noqa: F811
    url = _repo_url(s3_bucket)
    store = CountingStore(S3Store(url, s3_bucket.options))
    repo = Repository.on_store(store, chunk_size=64 * 1024)
    opts = {"repository": repo}
    model = torch.nn.Linear(256, 300)
    extra = StateDict(step=7, small=torch.arange(10))
    Snapshot.take(f"{url}/s1", {"model": model, "extra": extra}, storage_options=opts)
    store.reset()
    Snapshot.take(f"{url}/s2", {"model": model, "extra": extra}, storage_options=opts)
    assert [k for k in store.written_keys if "/chunks/" in k or "/packs/" in k] == []

    # a separate reader, finding the repository from the path and the options alone
    fresh = torch.nn.Linear(256, 300)
    got = StateDict()
    Snapshot(f"{url}/s2", storage_options=s3_bucket.options).restore({"model": fresh, "extra": got})
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
    assert got["step"] == 7 and torch.equal(got["small"], extra["small"])
    s1 = Snapshot(f"{url}/s1", storage_options=s3_bucket.options)
    assert torch.equal(s1.read_object("0/model/bias"), model.bias)
    assert Repository(url, s3_bucket.options).snapshots() == ["s1", "s2"]


def test_verify_and_gc_on_s3(s3_bucket):  # noqa: F811
    url = _repo_url(s3_bucket)
    repo = Repository.init(url, s3_bucket.options, chunk_size=64 * 1024)
    frozen, head = torch.randn(200, 256), torch.randn(300, 256)
    Snapshot.take(
        f"{url}/a", {"m": StateDict(frozen=frozen, head=head)}, storage_options=s3_bucket.options
    )
    head2 = head + 1
    Snapshot.take(
        f"{url}/b", {"m": StateDict(frozen=frozen, head=head2)}, storage_options=s3_bucket.options
    )
    report = repo.verify(read_data=True)
    assert report.ok and report.snapshots == 2 and report.chunks_read == report.chunks

    repo.delete("a")
    # The gc lock is a create-only put: on S3 a conditional write (atomic_create).
    assert repo.storage.root.capabilities.atomic_create
    result = repo.gc(grace_seconds=0)
    assert result.deleted_manifests == 1 and result.deleted_chunks + result.deleted_packs > 0
    assert result.bytes_freed >= head.numel() * head.element_size()
    assert Repository(url, s3_bucket.options).verify(read_data=True).ok
    got = StateDict()
    Snapshot(f"{url}/b", storage_options=s3_bucket.options).restore({"m": got})
    assert torch.equal(got["frozen"], frozen) and torch.equal(got["head"], head2)
    assert repo.gc(grace_seconds=0).bytes_freed == 0


def test_a_snapshot_name_is_taken_once_even_under_a_race(s3_bucket):  # noqa: F811
    url = _repo_url(s3_bucket)
    repo = RepoStorage.open_or_create(url, s3_bucket.options)
    manifests = []
    for i in range(4):
        Snapshot.take(
            f"{url}/seed{i}", {"s": StateDict(i=i)}, parents=[], storage_options=s3_bucket.options
        )
        manifests.append(repo.resolve(f"seed{i}"))
    outcomes: list[str] = []
    # Each committer has its own S3 client: only the server decides who wins.
    handles = [
        RepoStorage.open(url, {**s3_bucket.options, "skip_instance_cache": True}) for _ in manifests
    ]

    def commit(handle: RepoStorage, manifest: str) -> None:
        try:
            handle.write_ref("contended", manifest)
            outcomes.append(manifest)
        except SnapshotExistsError:
            outcomes.append("refused")

    threads = [threading.Thread(target=commit, args=hm) for hm in zip(handles, manifests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [o for o in outcomes if o != "refused"]
    assert len(winners) == 1 and outcomes.count("refused") == 3
    assert repo.resolve("contended") == winners[0]
    with pytest.raises(SnapshotExistsError):
        Snapshot.take(f"{url}/contended", {"s": StateDict(x=1)}, storage_options=s3_bucket.options)


def _casnap(cwd: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """The real executable with this worktree's code, as a person runs it."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "CASNAP_INDEX_DIR": str(cwd / "index")}
    return subprocess.run(
        [CASNAP, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_the_command_line_reaches_s3_through_storage_options(s3_bucket, tmp_path):  # noqa: F811
    url = _repo_url(s3_bucket)
    for step in (100, 200):
        Snapshot.take(
            f"{url}/step_{step}",
            {"s": StateDict(step=step, w=torch.ones(4) * step)},
            storage_options=s3_bucket.options,
        )
    opts = s3_bucket.cli_options()
    assert opts[1].startswith("endpoint_url=http://127.0.0.1:")
    done = _casnap(tmp_path, "log", url, *opts)
    assert done.returncode == 0, done.stderr
    assert "step_100" in done.stdout and "step_200" in done.stdout
    done = _casnap(tmp_path, "--json", "verify", url, *opts)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["ok"] is True
