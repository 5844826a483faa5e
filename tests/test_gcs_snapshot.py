"""Snapshots on gs:// against a real fake-gcs-server: take, dedup, restore, create-only refs."""

from __future__ import annotations

import threading
import uuid

import pytest
import torch
from gcs_server import gcs_bucket, gcs_server  # noqa: F401  (fixtures)

from casnap import Repository, Snapshot, SnapshotExistsError, StateDict
from casnap.repo.repository import RepoStorage
from casnap.store import CountingStore, FsspecStore

pytestmark = pytest.mark.gcs


def test_take_restore_and_dedup_on_gcs(gcs_bucket):  # noqa: F811
    url = f"gs://{gcs_bucket}/{uuid.uuid4().hex}/repo"
    store = CountingStore(FsspecStore(url))
    repo = Repository.on_store(store, chunk_size=64 * 1024)
    opts = {"repository": repo}
    model = torch.nn.Linear(256, 300)
    extra = StateDict(step=7, small=torch.arange(10))
    Snapshot.take(f"{url}/s1", {"model": model, "extra": extra}, storage_options=opts)
    store.reset()
    Snapshot.take(f"{url}/s2", {"model": model, "extra": extra}, storage_options=opts)
    assert [k for k in store.written_keys if "/chunks/" in k or "/packs/" in k] == []

    # a separate reader, discovering the repository from the path alone
    fresh = torch.nn.Linear(256, 300)
    got = StateDict()
    Snapshot(f"{url}/s2").restore({"model": fresh, "extra": got})
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
    assert got["step"] == 7 and torch.equal(got["small"], extra["small"])
    assert torch.equal(Snapshot(f"{url}/s1").read_object("0/model/bias"), model.bias)
    assert Repository(url).snapshots() == ["s1", "s2"]


def test_a_snapshot_name_is_taken_once_even_under_a_race(gcs_bucket):  # noqa: F811
    url = f"gs://{gcs_bucket}/{uuid.uuid4().hex}/repo"
    repo = RepoStorage.open_or_create(url)
    manifests = []
    for i in range(4):
        Snapshot.take(f"{url}/seed{i}", {"s": StateDict(i=i)}, parents=[])
        manifests.append(repo.resolve(f"seed{i}"))
    outcomes: list[str] = []

    def commit(manifest: str) -> None:
        try:
            repo.write_ref("contended", manifest)
            outcomes.append(manifest)
        except SnapshotExistsError:
            outcomes.append("refused")

    threads = [threading.Thread(target=commit, args=(m,)) for m in manifests]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [o for o in outcomes if o != "refused"]
    assert len(winners) == 1 and outcomes.count("refused") == 3
    assert repo.resolve("contended") == winners[0]
    with pytest.raises(SnapshotExistsError):
        Snapshot.take(f"{url}/contended", {"s": StateDict(x=1)})


def test_names_with_spaces_non_ascii_and_nesting_round_trip_on_gcs(gcs_bucket):  # noqa: F811
    # Stored keys hold '%' (run%201, %C3%BC): the GCS client must keep them as they are.
    url = f"gs://{gcs_bucket}/{uuid.uuid4().hex}/repo"
    repo = Repository.init(url)
    names = ["run 1", "schritt_ü", "a", "a/b", "x%y"]
    for i, name in enumerate(names):
        Snapshot.take(f"{url}/{name}", {"s": StateDict(i=i)})
    assert Repository(url).snapshots() == sorted(names)
    for i, name in enumerate(names):
        got = StateDict()
        Snapshot(f"{url}/{name}").restore({"s": got})
        assert got["i"] == i, name
    repo.delete("a")
    assert Repository(url).snapshots() == sorted(set(names) - {"a"})
