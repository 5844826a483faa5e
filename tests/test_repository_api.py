"""casnap.Repository: the public face of a repository, used as a person would."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from test_cli_contract import casnap as run_cli

import casnap
from casnap import KeepLast, KeepTagged, Repository, RetentionPolicy, Snapshot, StateDict
from casnap.format.entries import ContainerEntry, TensorEntry
from casnap.repo.repository import RepoStorage


@pytest.fixture
def repo(tmp_path) -> Repository:
    r = Repository.init(str(tmp_path / "run1"), chunk_size=64 * 1024)
    state = {"m": StateDict(w=torch.randn(50_000), step=0)}
    for step in (1, 2, 3):
        state["m"]["step"] = step
        if step == 3:
            state["m"]["w"][:10].add_(1.0)
        r.take(f"step_{step}", state, metadata={"step": step})
    return r


def test_a_missing_repository_is_not_found(tmp_path):
    with pytest.raises(casnap.RepositoryNotFoundError):
        Repository(str(tmp_path / "nothing"))


def test_listing_log_du_and_diff(repo):
    again = Repository(repo.url)
    assert again.snapshots() == ["step_1", "step_2", "step_3"]
    lines = again.log()
    assert [ln.name for ln in lines] == ["step_1", "step_2", "step_3"]
    hashes = [again.resolve(f"step_{i}") for i in (1, 2)]
    assert [list(ln.parents) for ln in lines] == [[], hashes[:1], hashes[1:]]  # one session
    assert again.du().snapshots == 3
    changed = {d.key: d.status for d in again.diff("step_2", "step_3")}
    assert changed["0/m/w"] == "changed" and changed["0/m/step"] == "changed"
    drift = again.diff("step_2", "step_3", stats=True)
    assert [d.key for d in drift if d.rel_l2 is not None] == ["0/m/w"]


def test_verify_tags_retain_gc(repo):
    assert repo.verify(read_data=True).ok
    repo.tag("keep", "step_1")
    assert set(repo.tags()) == {"keep"}
    result = repo.retain(RetentionPolicy(KeepLast(1)))
    assert sorted(result.deleted) == ["step_1", "step_2"]
    assert repo.snapshots() == ["step_3"]
    repo.gc(grace_seconds=0)
    assert repo.verify(read_data=True).ok
    repo.untag("keep")
    assert repo.tags() == {}


def test_snapshot_restore_and_export(repo, tmp_path):
    snap = repo.snapshot("step_3")
    out = StateDict(w=torch.zeros(50_000), step=0)
    snap.restore({"m": out})
    assert out["step"] == 3
    result = repo.export("step_3", tmp_path / "w.safetensors", key="0/m")
    assert (tmp_path / "w.safetensors").stat().st_size == result.file_bytes
    assert result.format == "safetensors" and result.tensor_bytes == 50_000 * 4
    with pytest.raises(casnap.SnapshotNotFoundError):
        repo.snapshot("step_9")
    with pytest.raises(casnap.ConfigError):
        repo.export("step_3", tmp_path / "w.bin", format="npz")


def test_the_repository_api_never_imports_torch_for_inspection(repo):
    code = (
        "import sys, casnap\n"
        f"r = casnap.Repository({repo.url!r})\n"
        "r.log(); r.du(); r.verify(); r.snapshots(); r.diff('step_1', 'step_3')\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# -- what the CLI needs, as Repository methods ------------------------------


def test_locate_finds_the_repository_holding_a_snapshot_path(repo, tmp_path):
    found, name = Repository.locate(f"{repo.url}/step_2")
    assert isinstance(found, Repository) and name == "step_2"
    assert found.url == repo.url and found.snapshots() == repo.snapshots()
    with pytest.raises(casnap.SnapshotNotFoundError):
        Repository.locate(str(tmp_path / "elsewhere" / "step_1"))


def test_show_returns_the_header_and_the_entries_under_a_key(repo):
    view = repo.show("step_3")
    assert view.name == "step_3" and view.manifest == repo.resolve("step_3")
    assert view.metadata["step"] == 3 and view.world_size == 1
    assert view.parents == (repo.resolve("step_2"),)
    w = view.entries["0/m/w"]
    assert isinstance(w, TensorEntry) and w.dtype == "float32" and w.shape == [50_000]
    assert isinstance(view.entries["0/m"], ContainerEntry)
    assert set(repo.show("step_3", key="0/m/w").entries) == {"0/m/w"}
    assert set(repo.show("step_3", key="0/m").entries) == {"0/m", "0/m/w", "0/m/step"}
    with pytest.raises(casnap.errors.MissingKeyError, match="did you mean '0/m/w'"):
        repo.show("step_3", key="0/m/x")  # a key no entry is at or below
    with pytest.raises(casnap.SnapshotNotFoundError):
        repo.show("step_9")


def test_diff_stats_fill_in_drift_for_changed_tensors_only(repo):
    rows = {d.key: d for d in repo.diff("step_2", "step_3", stats=True)}
    w = rows["0/m/w"]
    assert w.status == "changed" and w.changed_chunks == 1
    assert w.max_abs_diff == pytest.approx(1.0) and 0 < w.rel_l2 < 1
    assert rows["0/m/step"].status == "changed" and rows["0/m/step"].rel_l2 is None
    plain = {d.key: d for d in repo.diff("step_2", "step_3")}
    assert plain["0/m/w"].max_abs_diff is None and plain["0/m/w"].changed_chunks == 1
    same = repo.diff("step_1", "step_2", stats=True)
    assert {d.key: d.status for d in same}["0/m/w"] == "unchanged"
    assert all(d.rel_l2 is None for d in same)


def test_diff_against_another_repository(repo, tmp_path):
    other = Repository.init(str(tmp_path / "run2"), chunk_size=64 * 1024)
    other.take("zero", {"m": StateDict(w=torch.zeros(50_000), step=3)})
    rows = {d.key: d for d in repo.diff("step_3", "zero", stats=True, other=other)}
    assert rows["0/m/w"].status == "changed" and rows["0/m/w"].rel_l2 == pytest.approx(1.0)
    assert rows["0/m/step"].status == "unchanged"
    with pytest.raises(casnap.SnapshotNotFoundError):
        repo.diff("step_3", "step_1", other=other)  # b is looked up in `other`


def test_du_per_snapshot_and_tags_as_roots(repo):
    per = {u.name: u for u in repo.du().per_snapshot}
    assert list(per) == ["step_1", "step_2", "step_3"]
    assert per["step_1"].logical_bytes == 50_000 * 4  # the tensor; a primitive has no chunk
    assert per["step_3"].exclusive_bytes > 0  # its first chunk is its own
    repo.tag("pin", "step_3")
    per = {u.name: u for u in repo.du().per_snapshot}
    assert per["step_3"].exclusive_bytes == 0  # the tag still reaches everything it uses


def test_verify_part_implies_read_data_and_parts_cover_every_chunk(repo):
    whole = repo.verify(read_data=True)
    assert repo.verify().chunks_read == 0
    parts = [repo.verify(part=(k, 3)) for k in range(3)]
    assert sum(p.chunks_read for p in parts) == whole.chunks_read == whole.chunks > 0
    calls: list[tuple[int, int]] = []
    repo.verify(read_data=True, progress=lambda done, total: calls.append((done, total)))
    assert calls and calls[-1][0] == calls[-1][1]
    with pytest.raises(ValueError):
        repo.verify(part=(3, 3))


def test_retain_dry_run_returns_the_plan_and_deletes_nothing(repo):
    preview = repo.retain(RetentionPolicy(KeepLast(1)), dry_run=True)
    assert preview.dry_run and preview.deleted == () and preview.skipped == {}
    assert preview.plan is not None and preview.plan.delete == ("step_1", "step_2")
    assert set(preview.plan.keep) == {"step_3"}
    assert repo.snapshots() == ["step_1", "step_2", "step_3"]
    repo.tag("keep", "step_1")  # tagged after the plan: executing it leaves step_1 alone
    done = repo.retain(preview.plan)
    assert not done.dry_run and done.plan == preview.plan
    assert done.deleted == ("step_2",) and "tagged since the plan" in done.skipped["step_1"]
    assert repo.snapshots() == ["step_1", "step_3"]


def test_retain_refuses_to_delete_everything_unless_allowed(repo):
    with pytest.raises(casnap.errors.RetentionError):
        repo.retain(RetentionPolicy(KeepTagged()))  # nothing is tagged
    assert len(repo.snapshots()) == 3
    result = repo.retain(RetentionPolicy(KeepTagged()), allow_delete_all=True)
    assert sorted(result.deleted) == ["step_1", "step_2", "step_3"] and repo.snapshots() == []


def test_gc_dry_run_options_and_progress(repo):
    repo.retain(RetentionPolicy(KeepLast(1)))

    def objects() -> int:
        return len([*repo.storage.store.list("chunks"), *repo.storage.store.list("packs")])

    before = objects()
    preview = repo.gc(grace_seconds=0, dry_run=True)
    assert preview.dry_run and preview.plan.bytes_to_free > 0 and preview.deleted == 0
    assert objects() == before
    kept = repo.gc(dry_run=True)  # the default grace (1 h) keeps the fresh garbage
    assert kept.plan.bytes_to_free == 0
    calls: list[tuple[int, int]] = []
    done = repo.gc(
        grace_seconds=0, wait_seconds=1, progress=lambda n, total: calls.append((n, total))
    )
    assert done.bytes_freed == preview.plan.bytes_to_free and done.deleted_manifests == 2
    assert calls and repo.verify(read_data=True).ok
    assert repo.gc(grace_seconds=0).deleted == 0  # nothing left to collect


def test_tag_untag_and_tags_return_what_was_pinned(repo):
    info = repo.tag("best", "step_2")
    assert info.tag == "best" and info.snapshot == "step_2"
    assert info.manifest == repo.resolve("step_2")
    assert repo.tags() == {"best": info}
    with pytest.raises(casnap.errors.ObjectExistsError):
        repo.tag("best", "step_3")
    assert repo.untag("best") == info and repo.tags() == {}
    with pytest.raises(casnap.errors.ObjectNotFoundError):
        repo.untag("best")


def test_export_format_and_progress(repo, tmp_path):
    calls: list[tuple[int, int]] = []
    result = repo.export(
        "step_3",
        tmp_path / "w.bin",
        key="0/m/w",
        progress=lambda n, total: calls.append((n, total)),
    )
    assert result.format == "torch" and calls and calls[-1][0] == calls[-1][1]
    loaded = torch.load(tmp_path / "w.bin", weights_only=True)
    expected = repo.snapshot("step_3").read_object("0/m/w")
    assert torch.equal(next(iter(loaded.values())), expected)
    forced = repo.export("step_3", tmp_path / "w.bin2", format="safetensors")
    assert forced.format == "safetensors" and forced.skipped == ("0/m/step",)


def test_maintenance_and_show_never_import_torch(repo):
    code = (
        "import sys, casnap\n"
        f"r, name = casnap.Repository.locate({repo.url + '/step_3'!r})\n"
        "assert name == 'step_3' and r.show(name).metadata['step'] == 3\n"
        "r.tag('t', 'step_1'); r.tags(); r.untag('t')\n"
        "p = casnap.RetentionPolicy(casnap.KeepLast(1))\n"
        "assert r.retain(p, dry_run=True).plan.delete == ('step_1', 'step_2')\n"
        "assert r.gc(grace_seconds=0, dry_run=True).dry_run\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# -- a Repository holds its storage; names resolve as on the command line -------------


def _take(url: str, name: str, step: int, value: float) -> None:
    state = {"model": StateDict(w=torch.full((64,), value)), "progress": StateDict(step=step)}
    Snapshot.take(f"{url}/{name}", state, metadata={"step": step})


def test_a_repository_holds_its_storage_and_commits_only_through_its_methods(tmp_path):
    url = str(tmp_path / "run1")
    _take(url, "step_1", 1, 1.0)
    repo = Repository(url)
    assert not isinstance(repo, RepoStorage) and isinstance(repo.storage, RepoStorage)
    for commit_point in ("write_ref", "write_manifest", "delete_ref", "replace_ref", "store"):
        assert not hasattr(repo, commit_point)
    assert repo.url == repo.storage.url
    # A Repository names the repository a Snapshot is in.
    got = {"model": StateDict(w=torch.zeros(64)), "progress": StateDict(step=0)}
    Snapshot(f"{url}/step_1", repository=repo).restore(got)
    assert torch.equal(got["model"]["w"], torch.ones(64))


def test_a_snapshot_is_in_a_public_repository(repo):
    for snap in (Snapshot(f"{repo.url}/step_2"), repo.snapshot("latest")):
        found = snap.repository
        assert isinstance(found, Repository) and found.url == repo.url
        assert found is snap.repository  # one object per snapshot
        assert found.resolve(snap.name) == snap.manifest_hash
        assert "step_2" in found.snapshots()
    taken = Snapshot.take(f"{repo.url}/step_4", {"m": StateDict(step=4)})
    assert isinstance(taken.repository, Repository) and taken.repository.url == repo.url


def test_latest_and_tags_resolve_in_python_as_on_the_command_line(tmp_path):
    url = str(tmp_path / "run1")
    _take(url, "step_9", 9, 9.0)
    _take(url, "step_10", 10, 10.0)  # the newest: by step, not by name
    repo = Repository(url)
    repo.tag("best", "step_9")

    assert repo.resolve("latest") == repo.resolve("step_10")
    assert repo.resolve("best") == repo.resolve("step_9")
    assert repo.show("latest").name == "step_10"
    assert [d.status for d in repo.diff("best", "latest") if d.key.endswith("model/w")] == [
        "changed"
    ]

    for name, want in (("latest", 10.0), ("best", 9.0)):
        snap = repo.snapshot(name)
        got = {"model": StateDict(w=torch.zeros(64)), "progress": StateDict(step=0)}
        snap.restore(got)
        assert torch.equal(got["model"]["w"], torch.full((64,), want)), name
        assert got["progress"]["step"] == int(want)
    assert repo.snapshot("latest").name == "step_10"
    assert repo.snapshot("best").name == "step_9"

    # The command line names the same snapshots.
    for name, snapshot in (("latest", "step_10"), ("best", "step_9")):
        code, out, _ = run_cli(tmp_path, "show", f"{url}/{name}", "--json")
        assert code == 0 and json.loads(out)["name"] == snapshot

    with pytest.raises(casnap.SnapshotNotFoundError, match="did you mean 'best'"):
        repo.snapshot("bset")
    with pytest.raises(casnap.SnapshotNotFoundError, match="did you mean 'best'"):
        repo.resolve("bset")
    # delete goes by a snapshot's own name only.
    with pytest.raises(casnap.SnapshotNotFoundError):
        repo.delete("latest")
    assert repo.snapshots() == ["step_9", "step_10"]


def test_latest_below_a_folder_of_a_shared_repository(tmp_path):
    root = str(tmp_path / "ckpt")
    Repository.init(root)
    _take(root, "a/step_1", 1, 1.0)
    _take(root, "b/step_2", 2, 2.0)
    _take(root, "a/step_3", 3, 3.0)
    _take(root, "b/step_4", 4, 4.0)
    repo = Repository(root)
    assert repo.snapshot("a/latest").name == "a/step_3"
    assert repo.snapshot("latest").name == "b/step_4"
