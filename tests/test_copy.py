"""Copying snapshots between repositories (docs/copy.md): only what is missing, verified
before it is written, the ref last, resumable after an interruption."""

from __future__ import annotations

import json
import os
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from gcs_server import gcs_bucket, gcs_server  # noqa: F401  (fixtures)
from test_cli_contract import casnap, error_line

from casnap import Repository, Snapshot, SnapshotExistsError, StateDict
from casnap.errors import CopyIntegrityError, GcBlockedError, StoreError
from casnap.gc import gc
from casnap.repo.reach import reached_objects
from casnap.store import CountingStore, FsspecStore, LocalStore
from casnap.store.faults import FailingStore

CHUNK = 64 * 1024


def _state(seed: int, new_head: bool = True) -> dict[str, Any]:
    """A backbone that stays, a head that changes with ``seed``, small tensors (packed)."""
    torch.manual_seed(0)
    backbone = torch.nn.Linear(256, 300)
    torch.manual_seed(seed if new_head else 0)
    head = torch.nn.Linear(300, 64)
    return {"backbone": backbone, "head": head, "extra": StateDict(step=seed, t=torch.arange(9))}


def _take(repo: Repository, name: str, seed: int) -> None:
    Snapshot.take(
        f"{repo.url}/{name}",
        _state(seed),
        repository=repo,
        metadata={"step": seed},
    )


def _same_as_original(url: str, name: str, seed: int) -> None:
    """Restore ``name`` from ``url`` into fresh modules: equal to the state taken."""
    want = _state(seed)
    torch.manual_seed(1234)
    got: dict[str, Any] = {
        "backbone": torch.nn.Linear(256, 300),
        "head": torch.nn.Linear(300, 64),
        "extra": StateDict(),
    }
    Snapshot(f"{url}/{name}").restore(got)
    for key in ("backbone", "head"):
        for a, b in zip(want[key].state_dict().values(), got[key].state_dict().values()):
            assert torch.equal(a, b)
    assert got["extra"]["step"] == seed and torch.equal(got["extra"]["t"], torch.arange(9))


def _objects(repo: Repository, name: str) -> set[str]:
    return set(reached_objects(repo.storage.read_manifest(repo.resolve(name))))


def _sent(store: CountingStore) -> list[str]:
    """The chunk and pack objects put through ``store`` (the repository's root)."""
    return [
        k.removeprefix(".casnap/")
        for k in store.written_keys
        if k.split("/")[1] in ("chunks", "packs")
    ]


@pytest.fixture
def src(tmp_path: Path) -> Repository:
    repo = Repository.init(str(tmp_path / "src"), chunk_size=CHUNK)
    for seed in (1, 2):
        _take(repo, f"step_{seed}", seed)
    return repo


def test_local_copy_restores_equal_and_a_second_copy_sends_only_the_new_objects(src, tmp_path):
    dst_store = CountingStore(LocalStore(str(tmp_path / "dst")))
    dst = Repository.on_store(dst_store, chunk_size=4 * CHUNK)  # other chunk size: fine
    result = src.copy_to(dst)
    assert result.copied == ("step_1", "step_2") and result.failed == ()
    every = _objects(src, "step_1") | _objects(src, "step_2")
    assert sorted(_sent(dst_store)) == sorted(every)  # each object once, shared ones once
    assert result.objects_sent == len(every) and result.manifests_sent == 2
    for seed in (1, 2):
        assert dst.resolve(f"step_{seed}") == src.resolve(f"step_{seed}")  # same bytes
        _same_as_original(dst.url, f"step_{seed}", seed)
    assert dst.verify(read_data=True).ok

    _take(src, "step_3", 3)  # the backbone's chunks are already at the destination
    dst_store.reset()
    again = src.copy_to(dst)
    new = _objects(src, "step_3") - every
    assert sorted(_sent(dst_store)) == sorted(new) and new
    assert again.copied == ("step_3",) and again.present == ("step_1", "step_2")
    assert again.objects_present == len(_objects(src, "step_3") - new)
    _same_as_original(dst.url, "step_3", 3)

    dst_store.reset()  # nothing left to send: no object put, no object asked about
    assert src.copy_to(dst).copied == ()
    assert _sent(dst_store) == [] and dst_store.requests["exists"] == 0


@pytest.mark.gcs
def test_copy_to_gcs_and_back(src, tmp_path, gcs_bucket):  # noqa: F811
    url = f"gs://{gcs_bucket}/{uuid.uuid4().hex}/mirror"
    store = CountingStore(FsspecStore(url))
    remote = Repository.on_store(store)
    first = src.copy_to(remote, ["step_2"])
    assert first.copied == ("step_2",) and first.bytes_sent > 0
    _same_as_original(url, "step_2", 2)
    store.reset()
    second = src.copy_to(remote)  # step_1 shares the backbone: only its head and packs go
    assert second.copied == ("step_1",)
    assert sorted(_sent(store)) == sorted(_objects(src, "step_1") - _objects(src, "step_2"))
    back = Repository(url).copy_to(str(tmp_path / "back"))  # from gs:// to a new local one
    assert back.copied == ("step_1", "step_2")
    _same_as_original(str(tmp_path / "back"), "step_1", 1)


def _corrupt(repo: Repository, key: str) -> None:
    path = Path(repo.url) / ".casnap" / key
    os.chmod(path, 0o644)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("kind", ["chunks", "packs"])
def test_a_damaged_source_object_fails_its_snapshot_and_nothing_of_it_is_visible(
    src, tmp_path, kind
):
    _take(src, "step_3", 3)
    only_3 = sorted(
        k for k in _objects(src, "step_3") - _objects(src, "step_2") if k.startswith(kind)
    )
    only_3 = [k for k in only_3 if k not in _objects(src, "step_1")]
    _corrupt(src, only_3[0])
    dst_url = str(tmp_path / "dst")
    with pytest.raises(CopyIntegrityError, match="step_3") as info:
        src.copy_to(dst_url)
    assert only_3[0] in str(info.value) and set(info.value.failed) == {"step_3"}
    dst = Repository(dst_url)
    assert dst.snapshots() == ["step_1", "step_2"]  # the others were copied
    assert not dst.storage.store.exists(only_3[0])  # the damaged bytes were not written
    assert not dst.storage.store.exists(
        f"manifests/{src.resolve('step_3')[:2]}/{src.resolve('step_3')}"
    )
    assert src.storage.store.list("damaged"), "the damage is recorded at the source"


def _connection_lost(key: str) -> StoreError:
    return StoreError(f"connection lost writing {key}", key, transient=False)


def test_an_interrupted_copy_shows_nothing_and_a_rerun_sends_only_the_rest(src, tmp_path):
    root = str(tmp_path / "dst")
    every = _objects(src, "step_1") | _objects(src, "step_2")
    with pytest.raises(StoreError, match="connection lost"):
        # The 4th put of a chunk file or pack fails, and every one after it.
        lost = FailingStore(LocalStore(root), 4, fail=_connection_lost, lasting=True)
        src.copy_to(Repository.on_store(lost), ["step_2", "step_1"])
    dst = Repository(root)
    assert dst.snapshots() == [] and list(dst.storage.store.list("manifests")) == []
    sent_before = {k for k in every if dst.storage.store.exists(k)}
    assert 0 < len(sent_before) < len(every)

    store = CountingStore(LocalStore(root))
    result = src.copy_to(Repository.on_store(store))
    assert sorted(_sent(store)) == sorted(every - sent_before)  # only what was still missing
    assert result.objects_present == len(sent_before) and result.copied == ("step_1", "step_2")
    _same_as_original(root, "step_1", 1)


def test_gc_at_the_destination_cannot_sweep_while_a_copy_runs(src, tmp_path):
    """The copy's lease keeps gc out between "the object is there" and the ref."""
    outcome: list[object] = []

    class GcMidway(LocalStore):
        def put(self, key, data, *, create_only=False, durable=True):
            super().put(key, data, create_only=create_only, durable=durable)
            if key.startswith(".casnap/manifests/") and not outcome:  # objects sent, no ref
                try:
                    outcome.append(gc(Repository(root).storage, grace_seconds=0, wait_seconds=0.3))
                except BaseException as exc:
                    outcome.append(exc)

    root = str(tmp_path / "dst")
    src.copy_to(Repository.on_store(GcMidway(root)), ["step_1"])
    assert outcome and isinstance(outcome[0], GcBlockedError)
    _same_as_original(root, "step_1", 1)


def test_a_name_with_other_content_is_refused_unless_forced(src, tmp_path):
    other = Repository.init(str(tmp_path / "other"), chunk_size=CHUNK)
    _take(other, "step_1", 7)
    with pytest.raises(SnapshotExistsError, match="step_1"):
        src.copy_to(other)
    assert other.snapshots() == ["step_1"]  # nothing was copied, step_2 neither
    assert other.copy_to(other).present == ("step_1",)
    forced = src.copy_to(other, force=True)
    assert forced.copied == ("step_1", "step_2")
    _same_as_original(other.url, "step_1", 1)


def test_concurrent_copies_into_one_destination_both_succeed(src, tmp_path):
    dst = str(tmp_path / "dst")
    Repository.init(dst)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            Repository(src.url).copy_to(dst)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and Repository(dst).snapshots() == ["step_1", "step_2"]


# -- the command line, as a person runs it ------------------------------------------


def test_cli_copy_prints_a_summary_resumes_and_maps_errors_to_exit_codes(src, tmp_path):
    dst = str(tmp_path / "cli-dst")
    code, out, err = casnap(tmp_path, "copy", src.url, dst, "--dry-run")
    assert code == 0 and "step_2: copy" in out and "dry run" in out
    assert not Path(dst).exists()  # a dry run creates nothing
    code, out, err = casnap(tmp_path, "copy", src.url, dst, "latest")
    assert code == 0, err
    assert out.startswith("copied 1 snapshot(s)") and "skipped as present" in out
    code, out, _ = casnap(tmp_path, "copy", src.url, dst, "--json")
    data = json.loads(out)
    assert code == 0 and data["copied"] == ["step_1"] and data["present"] == ["step_2"]
    assert data["objects_present"] > 0
    _same_as_original(dst, "step_1", 1)

    code, _, err = casnap(tmp_path, "copy", src.url, dst, "step_9")
    assert code == 3 and "step_9" in error_line(err)
    code, _, err = casnap(tmp_path, "copy", str(tmp_path / "nothing"), dst)
    assert code == 3
    other = Repository.init(str(tmp_path / "other"), chunk_size=CHUNK)
    _take(other, "step_2", 5)
    code, _, err = casnap(tmp_path, "copy", src.url, other.url, "step_2")
    assert code == 5 and "--force" in error_line(err)
    code, _, err = casnap(tmp_path, "copy", src.url, other.url, "step_2", "--force")
    assert code == 0 and other.resolve("step_2") == src.resolve("step_2")

    _take(src, "step_3", 3)
    head = sorted(
        k for k in _objects(src, "step_3") - _objects(src, "step_2") if k.startswith("chunks")
    )
    _corrupt(src, head[0])
    code, out, err = casnap(tmp_path, "copy", src.url, dst)
    last = err.strip().splitlines()[-1]  # after the warning that the damage is recorded
    assert code == 4 and last.startswith("casnap: error: 1 snapshot(s) not copied")
    assert "step_3" in last and head[0] in last and "Traceback" not in err
    assert "not copied: step_3" in out
    assert Repository(dst).snapshots() == ["step_1", "step_2"]
