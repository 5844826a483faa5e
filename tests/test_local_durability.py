"""Non-durable puts (chunks) become durable before any durable put (manifest, ref) returns;
deferred ones (a take's chunk files) are in place only once synced."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable

import pytest
import torch

from casnap import Repository, Snapshot, StateDict
from casnap.errors import ObjectExistsError, StoreError
from casnap.store import LocalStore, local_sync
from casnap.store import local as local_module


@pytest.fixture
def synced(monkeypatch) -> list[str]:
    calls: list[str] = []
    real = local_module.fsync_dir

    def record(folder: str) -> None:
        calls.append(folder)
        real(folder)

    monkeypatch.setattr(local_module, "fsync_dir", record)
    return calls


def test_durable_put_first_syncs_every_deferred_folder(tmp_path, synced):
    store = LocalStore(str(tmp_path))
    store.put("chunks/aa/x", b"1", durable=False)
    store.put("chunks/bb/y", b"2", durable=False)
    assert synced == []  # nothing synced yet: folders and renames are pending
    store.put("refs/r", b"ref")
    must = {
        str(tmp_path / "chunks" / "aa"),
        str(tmp_path / "chunks" / "bb"),
        str(tmp_path / "chunks"),
        str(tmp_path),
    }
    ref_dir = str(tmp_path / "refs")
    assert must <= set(synced[: synced.index(ref_dir)]), "chunks synced before the ref's folder"
    synced.clear()
    store.flush()
    assert synced == []  # nothing left pending


def test_a_take_syncs_chunk_folders_once_before_the_manifest(tmp_path, synced):
    state = StateDict({f"w{i}": torch.randn(300_000) for i in range(6)})
    Snapshot.take(str(tmp_path / "repo" / "s1"), {"s": state})
    manifests = [
        i
        for i, f in enumerate(synced)
        if f.endswith(os.path.join(".casnap", "manifests")) or os.sep + "manifests" + os.sep in f
    ]
    chunk_dirs = [i for i, f in enumerate(synced) if os.sep + "chunks" + os.sep in f]
    assert chunk_dirs and manifests and max(chunk_dirs) < min(manifests)
    # one sync per chunk folder, not one per chunk
    assert len(chunk_dirs) == len({synced[i] for i in chunk_dirs})


def _objects(root) -> set[str]:
    """Every file below ``root``, temp files (of unfinished puts) apart."""
    return {
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.is_file() and local_module._TMP_MARK not in p.name
    }


def _temporaries(root) -> list[str]:
    return [p.name for p in root.rglob("*") if local_module._TMP_MARK in p.name]


def test_a_deferred_put_appears_whole_only_once_flushed(tmp_path, synced):
    store = LocalStore(str(tmp_path))
    with store.deferring():
        store.put("chunks/aa/x", [b"head", b"payload"], durable=False)
        store.put("packs/bb/y", b"pack", create_only=True, durable=False)
    assert not store.exists("chunks/aa/x") and not store.exists("packs/bb/y")
    assert len(_temporaries(tmp_path)) == 2
    store.put("refs/r", b"ref")  # a durable put flushes first: the commit order
    assert store.get("chunks/aa/x") == b"headpayload" and store.get("packs/bb/y") == b"pack"
    assert _temporaries(tmp_path) == []
    assert str(tmp_path / "chunks" / "aa") in synced[: synced.index(str(tmp_path / "refs"))]


def test_deferring_is_per_thread_and_only_for_non_durable_puts(tmp_path):
    store = LocalStore(str(tmp_path))
    seen: list[bool] = []
    with store.deferring():
        store.put("leases/l", b"lease")  # durable: in place at once
        thread = threading.Thread(target=lambda: store.put("k/other", b"1", durable=False))
        thread.start()
        thread.join()
        seen.append(store.exists("k/other"))  # another thread's put is not deferred
    assert store.exists("leases/l") and seen == [True]
    store.put("k/later", b"2", durable=False)  # after the block: not deferred either
    assert store.exists("k/later")


def test_a_create_only_deferred_put_of_a_present_key_is_refused_or_dropped(tmp_path):
    store = LocalStore(str(tmp_path))
    store.put("packs/p", b"same")
    with store.deferring(), pytest.raises(ObjectExistsError):
        store.put("packs/p", b"same", create_only=True, durable=False)
    with store.deferring():
        store.put("packs/q", b"same", create_only=True, durable=False)
    store.put("packs/q", b"same", create_only=True, durable=False)  # another writer's
    store.flush()  # the deferred one finds it there: dropped, no error, no temp file left
    assert store.get("packs/q") == b"same" and _temporaries(tmp_path) == []


def test_past_the_window_the_oldest_deferred_files_are_settled(tmp_path, monkeypatch):
    monkeypatch.setattr(local_sync, "WINDOW", 4)
    store = LocalStore(str(tmp_path))
    with store.deferring():
        for i in range(9):
            store.put(f"chunks/c{i}", bytes([i]) * 10, durable=False)
    # Two batches of two were handed to the settling thread, and the third put past the
    # window waited for the second one: the four oldest are in place before any flush.
    assert {f"chunks/c{i}" for i in range(4)} <= _objects(tmp_path)
    store.flush()
    assert _objects(tmp_path) == {f"chunks/c{i}" for i in range(9)}
    assert _temporaries(tmp_path) == []
    assert all(store.get(f"chunks/c{i}") == bytes([i]) * 10 for i in range(9))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names fds through /proc")
def test_a_failure_in_a_batch_settled_in_the_background_fails_the_next_flush(tmp_path, monkeypatch):
    monkeypatch.setattr(local_sync, "WINDOW", 4)
    failed = _failing_fsync(monkeypatch, lambda name: "/c1~tmp-" in name)
    store = LocalStore(str(tmp_path))
    with store.deferring():
        for i in range(9):  # c1 is in the first batch, settled while c5... are written
            store.put(f"chunks/c{i}", bytes([i]), durable=False)
    with pytest.raises(StoreError, match="Input/output error"):
        store.flush()
    assert failed and _objects(tmp_path) == {f"chunks/c{i}" for i in range(9) if i != 1}
    assert _temporaries(tmp_path) == []
    store.flush()  # reported once


def _failing_fsync(monkeypatch, fail_on: Callable[[str], bool]) -> list[str]:
    """Deferred fsyncs of files whose name ``fail_on`` picks fail with EIO."""
    failed: list[str] = []
    real = local_sync._fsync

    def fsync(fd: int) -> None:
        name = os.readlink(f"/proc/self/fd/{fd}")
        if fail_on(name):
            failed.append(name)
            raise OSError(errno.EIO, "Input/output error")
        real(fd)

    monkeypatch.setattr(local_sync, "_fsync", fsync)
    return failed


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names fds through /proc")
def test_a_file_whose_deferred_fsync_fails_is_never_put_in_place(tmp_path, monkeypatch):
    failed = _failing_fsync(monkeypatch, lambda name: "/bad~tmp-" in name)
    store = LocalStore(str(tmp_path))
    with store.deferring():
        for key in ("chunks/good", "chunks/bad", "chunks/also-good"):
            store.put(key, key.encode(), durable=False)
    with pytest.raises(StoreError, match="Input/output error"):
        store.flush()
    assert failed and _objects(tmp_path) == {"chunks/good", "chunks/also-good"}
    assert _temporaries(tmp_path) == []  # removed, never renamed: it may be incomplete
    store.flush()  # nothing left pending: the failure is not reported twice


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names fds through /proc")
def test_a_take_whose_chunk_fsync_fails_fails_and_leaves_nothing_visible(tmp_path, monkeypatch):
    root = tmp_path / "repo"
    first = {f"w{i}": torch.randn(300_000) for i in range(4)}  # loose chunks
    Snapshot.take(str(root / "s1"), {"s": StateDict(first)})
    second = {k: v + 1 for k, v in first.items()}
    picked: list[str] = []

    def one_new_chunk(name: str) -> bool:  # the first chunk file synced: it fails
        if os.sep + "chunks" + os.sep in name and not picked:
            picked.append(name)
        return name in picked

    failed = _failing_fsync(monkeypatch, one_new_chunk)
    with pytest.raises(StoreError, match="Input/output error"):
        Snapshot.take(str(root / "s2"), {"s": StateDict(second)})
    assert failed
    repo = Repository(str(root))
    assert repo.snapshots() == ["s1"]
    assert len(list(repo.storage.iter_manifest_names())) == 1
    bad = picked[0].split(local_module._TMP_MARK)[0]
    assert not os.path.exists(bad) and _temporaries(root) == []
    out = StateDict({k: torch.empty_like(v) for k, v in first.items()})
    Snapshot(str(root / "s1")).restore({"s": out})
    assert all(torch.equal(out[k], first[k]) for k in first)
    # the retry writes the chunk that failed, and the snapshot restores
    monkeypatch.setattr(local_sync, "_fsync", os.fsync)
    Snapshot.take(str(root / "s2"), {"s": StateDict(second)})
    assert os.path.exists(bad)
    out = StateDict({k: torch.empty_like(v) for k, v in first.items()})
    Snapshot(str(root / "s2")).restore({"s": out})
    assert all(torch.equal(out[k], second[k]) for k in second)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_child_settles_deferred_files_on_threads_of_its_own(tmp_path):
    store = LocalStore(str(tmp_path))
    with store.deferring():
        store.put("chunks/a", b"a", durable=False)
        store.put("chunks/b", b"b", durable=False)
    store.flush()  # the parent's sync threads exist now; a fork does not inherit them
    with store.deferring():
        store.put("chunks/p", b"p", durable=False)  # the parent's, unsettled at the fork
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 only if its own deferred puts are settled
        try:
            with store.deferring():
                store.put("chunks/c", b"c", durable=False)
                store.put("chunks/d", b"d", durable=False)
            store.flush()
            ok = store.get("chunks/c") + store.get("chunks/d") == b"cd"
            os._exit(0 if ok and not store.exists("chunks/p") else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert not store.exists("chunks/p")  # the child left the parent's file alone
    store.flush()
    assert _objects(tmp_path) == {f"chunks/{k}" for k in "abcdp"}
