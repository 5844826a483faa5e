"""Snapshots on a remote store, each test run against every remote backend.

Take, dedup, restore, read_object, verify, gc, a race for a snapshot name and
names that need quoting, on gs:// against a real fake-gcs-server (marker
``gcs``) and on s3:// against a real S3 API server, moto's, on localhost (marker
``s3``); the ``casnap`` command with ``--storage-option endpoint_url=...`` on
S3 only. ``-m "not gcs"`` or ``-m "not s3"`` leaves one backend out.
Run: ``pytest -q tests/test_remote_snapshot.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from gcs_server import gcs_bucket, gcs_server  # noqa: F401  (fixtures)
from s3_server import S3Bucket, s3_bucket, s3_server  # noqa: F401  (fixtures)

from casnap import Repository, Snapshot, SnapshotExistsError, StateDict
from casnap.repo.repository import RepoStorage
from casnap.store import CountingStore, FsspecStore, ObjectStore, S3Store

REPO_ROOT = Path(__file__).resolve().parents[1]
CASNAP = str(Path(sys.executable).parent / "casnap")


@dataclass(frozen=True)
class Remote:
    """One bucket on a local server: where a test's repository goes and how to reach it."""

    root: str  # gs://bucket or s3://bucket
    store: Callable[[str], ObjectStore]  # the store class this backend's tests use
    options: dict[str, Any] = field(default_factory=dict)

    def repo_url(self) -> str:
        """A fresh repository URL of the test's own (tests isolate themselves by prefix)."""
        return f"{self.root}/{uuid.uuid4().hex}/repo"


@pytest.fixture(
    params=[
        pytest.param("gcs", marks=pytest.mark.gcs),
        pytest.param("s3", marks=pytest.mark.s3),
    ]
)
def remote(request: pytest.FixtureRequest) -> Remote:
    """The bucket of this parameter's backend; only that backend's server is started."""
    if request.param == "gcs":
        bucket: str = request.getfixturevalue("gcs_bucket")
        return Remote(f"gs://{bucket}", FsspecStore)
    s3: S3Bucket = request.getfixturevalue("s3_bucket")
    return Remote(s3.url, lambda url: S3Store(url, s3.options), s3.options)


def test_take_restore_and_dedup(remote: Remote) -> None:
    url = remote.repo_url()
    store = CountingStore(remote.store(url))
    repo = Repository.on_store(store, chunk_size=64 * 1024)
    opts: dict[str, Any] = {"repository": repo}
    model = torch.nn.Linear(256, 300)
    extra = StateDict(step=7, small=torch.arange(10))
    Snapshot.take(f"{url}/s1", {"model": model, "extra": extra}, **opts)
    store.reset()
    Snapshot.take(f"{url}/s2", {"model": model, "extra": extra}, **opts)
    assert [k for k in store.written_keys if "/chunks/" in k or "/packs/" in k] == []

    # a separate reader, finding the repository from the path and the options alone
    fresh = torch.nn.Linear(256, 300)
    got = StateDict()
    Snapshot(f"{url}/s2", storage_options=remote.options).restore({"model": fresh, "extra": got})
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
    assert got["step"] == 7 and torch.equal(got["small"], extra["small"])
    s1 = Snapshot(f"{url}/s1", storage_options=remote.options)
    assert torch.equal(s1.read_object("0/model/bias"), model.bias)
    assert Repository(url, remote.options).snapshots() == ["s1", "s2"]


def test_verify_and_gc(remote: Remote) -> None:
    url, options = remote.repo_url(), remote.options
    repo = Repository.init(url, options, chunk_size=64 * 1024)
    frozen, head = torch.randn(200, 256), torch.randn(300, 256)
    Snapshot.take(f"{url}/a", {"m": StateDict(frozen=frozen, head=head)}, storage_options=options)
    head2 = head + 1
    Snapshot.take(f"{url}/b", {"m": StateDict(frozen=frozen, head=head2)}, storage_options=options)
    report = repo.verify(read_data=True)
    assert report.ok and report.snapshots == 2 and report.chunks_read == report.chunks

    repo.delete("a")
    # The gc lock is a create-only put: a conditional write (atomic_create).
    assert repo.storage.root.capabilities.atomic_create
    result = repo.gc(grace_seconds=0)
    assert result.deleted_manifests == 1 and result.deleted_chunks + result.deleted_packs > 0
    assert result.bytes_freed >= head.numel() * head.element_size()
    assert Repository(url, options).verify(read_data=True).ok
    got = StateDict()
    Snapshot(f"{url}/b", storage_options=options).restore({"m": got})
    assert torch.equal(got["frozen"], frozen) and torch.equal(got["head"], head2)
    assert repo.gc(grace_seconds=0).bytes_freed == 0


def test_a_snapshot_name_is_taken_once_even_under_a_race(remote: Remote) -> None:
    url, options = remote.repo_url(), remote.options
    repo = RepoStorage.open_or_create(url, options)
    manifests = []
    for i in range(4):
        Snapshot.take(f"{url}/seed{i}", {"s": StateDict(i=i)}, parents=[], storage_options=options)
        manifests.append(repo.resolve(f"seed{i}"))
    outcomes: list[str] = []
    # Each committer has its own client: only the server decides who wins.
    handles = [RepoStorage.open(url, {**options, "skip_instance_cache": True}) for _ in manifests]

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
        Snapshot.take(f"{url}/contended", {"s": StateDict(x=1)}, storage_options=options)


def test_names_with_spaces_non_ascii_and_nesting_round_trip(remote: Remote) -> None:
    # Stored keys hold '%' (run%201, %C3%BC): the client must keep them as they are.
    url, options = remote.repo_url(), remote.options
    repo = Repository.init(url, options)
    names = ["run 1", "schritt_ü", "a", "a/b", "x%y"]
    for i, name in enumerate(names):
        Snapshot.take(f"{url}/{name}", {"s": StateDict(i=i)}, storage_options=options)
    assert Repository(url, options).snapshots() == sorted(names)
    for i, name in enumerate(names):
        got = StateDict()
        Snapshot(f"{url}/{name}", storage_options=options).restore({"s": got})
        assert got["i"] == i, name
    repo.delete("a")
    assert Repository(url, options).snapshots() == sorted(set(names) - {"a"})


def _casnap(cwd: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """The real executable with this worktree's code, as a person runs it."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "CASNAP_INDEX_DIR": str(cwd / "index")}
    return subprocess.run(
        [CASNAP, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.s3
def test_the_command_line_reaches_s3_through_storage_options(
    s3_bucket: S3Bucket,  # noqa: F811
    tmp_path: Path,
) -> None:
    url = f"{s3_bucket.url}/{uuid.uuid4().hex}/repo"
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
