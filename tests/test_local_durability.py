"""Non-durable puts (chunks) become durable before any durable put (manifest, ref) returns."""

from __future__ import annotations

import os

import pytest
import torch

from casnap import Snapshot, StateDict
from casnap.store import LocalStore
from casnap.store import local as local_module


@pytest.fixture
def synced(monkeypatch) -> list[str]:
    calls: list[str] = []
    real = local_module._fsync_dir

    def record(folder: str) -> None:
        calls.append(folder)
        real(folder)

    monkeypatch.setattr(local_module, "_fsync_dir", record)
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
