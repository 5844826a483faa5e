"""A take without a session descends from the newest snapshot in its folder (casnap.take.parent).

As a torchsnapshot or DCP user meets it: ``Snapshot.take(f"{root}/step_{n}", app_state)``
every N steps, each save perhaps in a new process, no Session anywhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import helpers
import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import flip_byte, pack_path, take_stats, tensor_entry

from casnap import KeepLast, Repository, Snapshot, StateDict, index, settings
from casnap.integrations.dcp import CasnapReader, CasnapWriter
from casnap.store import LocalStore
from casnap.store.base import ObjectInfo, WrapperStore
from casnap.take.reuse import REUSE

ROOT = Path(__file__).resolve().parents[1]
CHUNK = 64 * 1024


@pytest.fixture(autouse=True)
def _private_index(tmp_path, monkeypatch):
    monkeypatch.setenv("CASNAP_INDEX_DIR", str(tmp_path / "index"))
    monkeypatch.delenv("CASNAP_INDEX", raising=False)
    monkeypatch.delenv("CASNAP_AUTO_PARENT", raising=False)
    yield
    index.close_all()


def state(seed: int = 0) -> dict:
    """Ten multi-chunk tensors (loose chunks) and forty small ones (packed)."""
    g = torch.Generator().manual_seed(seed)
    sd = StateDict()
    for i in range(50):
        sd[f"t{i}"] = torch.randn(40_000 if i % 5 == 0 else 300 + i, generator=g)
    return {"m": sd}


def take(path: str | Path, app: dict, **kw) -> Snapshot:
    kw.setdefault("settings", {"chunk_size": CHUNK})
    return Snapshot.take(str(path), app, **kw)


def restores(path: str | Path, app: dict) -> bool:
    blank = {"m": StateDict({k: torch.zeros_like(v) for k, v in app["m"].items()})}
    Snapshot(str(path)).restore(blank)
    return all(torch.equal(blank["m"][k], app["m"][k]) for k in app["m"])


def casnap_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    """The real ``casnap`` executable, importing this checkout."""
    exe = Path(sys.executable).with_name("casnap")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [str(exe), *argv], capture_output=True, text=True, env=env, timeout=120, check=False
    )


def take_in_new_process(path: Path, seed: int, index_dir: Path) -> dict:
    """A fresh process takes ``state(seed)``; returns its manifest's parents and its stats."""
    code = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(ROOT / "tests")!r})
        from test_auto_parent import state, take
        s = take({str(path)!r}, state({seed}))
        st = s.last_take_stats
        print(json.dumps({{"parents": s.manifest.parents, "chunks_written": st.chunks_written,
                          "bytes": st.stored_bytes_written}}))
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CASNAP_INDEX_DIR": str(index_dir)}
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, env=env, timeout=300, capture_output=True
    )
    result: dict = json.loads(out.stdout.decode().strip().splitlines()[-1])
    return result


# -- the parent, and what it brings ----------------------------------------


def test_second_take_descends_from_the_first_and_log_shows_it(tmp_path):
    root = tmp_path / "run"
    app = state()
    s1 = take(root / "step_1", app)
    s2 = take(root / "step_2", app)
    assert s1.manifest.parents == []
    assert s2.manifest.parents == [s1.manifest_hash]
    assert take_stats(s2).chunks_written == 0  # an unchanged re-take writes no chunk
    assert take_stats(s2).stored_bytes_written == 0
    assert restores(root / "step_2", app)

    text = casnap_cli("log", str(root))
    assert text.returncode == 0, text.stderr
    line = next(x for x in text.stdout.splitlines() if "step_2" in x)
    assert line.split()[-1] == "step_1"  # the parents column
    listed = json.loads(casnap_cli("log", "--json", str(root)).stdout)
    assert [e["parents"] for e in listed] == [[], ["step_1"]]


def test_each_save_in_a_new_process_descends_from_the_last(tmp_path):
    root, idx = tmp_path / "run", tmp_path / "index"
    first = take_in_new_process(root / "step_1", 0, idx)
    again = take_in_new_process(root / "step_2", 0, idx)
    h1 = Repository(str(root)).resolve("step_1")
    assert first["parents"] == [] and again["parents"] == [h1]
    assert again["chunks_written"] == 0 and again["bytes"] == 0
    # On another machine (an index that never saw the repository) the parent's
    # manifest tells where every chunk is: still nothing written.
    other = take_in_new_process(root / "step_3", 0, tmp_path / "other-index")
    assert other["parents"] == [Repository(str(root)).resolve("step_2")]
    assert other["chunks_written"] == 0 and other["bytes"] == 0
    assert restores(root / "step_3", state(0))


def test_a_sparse_update_of_a_large_table_is_stored_as_a_delta(tmp_path):
    root = tmp_path / "run"
    g = torch.Generator().manual_seed(0)
    table = torch.randn(4096, 1024, generator=g)  # 16 MiB, four 4 MiB chunks
    app = {"emb": StateDict(weight=table)}
    Snapshot.take(str(root / "step_1"), app)
    rows = torch.randperm(4096, generator=g)[:41]  # 1% of the rows
    table[rows] += 0.01 * torch.randn(41, 1024, generator=g)
    s2 = Snapshot.take(str(root / "step_2"), app)
    stats = take_stats(s2)
    assert stats.deltas_written > 0
    assert stats.stored_bytes_written < table.numel() * 4 // 20  # 16 MiB table, < 0.8 MiB
    out = {"emb": StateDict(weight=torch.zeros_like(table))}
    Snapshot(str(root / "step_2")).restore(out)
    assert torch.equal(out["emb"]["weight"], table)


def test_a_new_process_reads_its_parent_once_and_the_next_take_none(tmp_path):
    repo, store = helpers.counted_repo(str(tmp_path / "run"), CHUNK)
    opts = {"repository": repo, "settings": {"chunk_size": CHUNK}}
    app = state()
    s1 = Snapshot.take(f"{repo.url}/s1", app, **opts)
    REUSE.clear()  # as in a new process: s1's plan is not in memory
    store.reset()
    s2 = Snapshot.take(f"{repo.url}/s2", app, **opts)
    assert s2.manifest.parents == [s1.manifest_hash]
    assert [k for k in store.read_keys if "/manifests/" in k] == [
        f".casnap/manifests/{s1.manifest_hash[:2]}/{s1.manifest_hash}"
    ]
    assert take_stats(s2).chunks_written == 0
    # one large tensor changed: the parent is read for its chunks' delta bases
    app["m"]["t0"][:100] += 1.0
    REUSE.clear()
    store.reset()
    s3 = Snapshot.take(f"{repo.url}/s3", app, **opts)
    assert [k for k in store.read_keys if "/manifests/" in k] == [
        f".casnap/manifests/{s2.manifest_hash[:2]}/{s2.manifest_hash}"
    ]
    assert take_stats(s3).chunks_written == 1 and take_stats(s3).deltas_written == 1
    assert restores(f"{repo.url}/s3", app)
    # In the same process, the next take finds s3's plan in memory: no manifest read.
    app["m"]["t0"][:100] += 1.0
    store.reset()
    s4 = Snapshot.take(f"{repo.url}/s4", app, **opts)
    assert s4.manifest.parents == [s3.manifest_hash]
    assert not [k for k in store.read_keys if "/manifests/" in k]
    assert take_stats(s4).chunks_written == 1 and take_stats(s4).deltas_written == 1
    assert restores(f"{repo.url}/s4", app)


def test_the_newest_is_the_last_committed_not_the_last_name(tmp_path):
    root = tmp_path / "run"
    app = state()
    take(root / "b", app)
    a = take(root / "a", app)
    assert take(root / "c", app).manifest.parents == [a.manifest_hash]


# -- folders: concurrent runs in one repository ----------------------------


def test_runs_in_different_folders_never_parent_each_other(tmp_path):
    Repository.init(str(tmp_path / "ckpt"))
    root = tmp_path / "ckpt"
    a1 = take(root / "runA" / "step_1", state(1))
    b1 = take(root / "runB" / "step_1", state(2))
    top = take(root / "top", state(3))  # the top level is a folder too
    deeper = take(root / "runA" / "eval" / "step_1", state(4))
    a2 = take(root / "runA" / "step_2", state(1))
    b2 = take(root / "runB" / "step_2", state(2))
    assert b1.manifest.parents == [] and top.manifest.parents == []
    assert deeper.manifest.parents == []  # runA/eval/ is not runA/
    assert a2.manifest.parents == [a1.manifest_hash]
    assert b2.manifest.parents == [b1.manifest_hash]
    assert take(root / "top2", state(3)).manifest.parents == [top.manifest_hash]


# -- opting out --------------------------------------------------------------


def test_opting_out(tmp_path, monkeypatch):
    root = tmp_path / "run"
    app = state()
    s1 = take(root / "s1", app)
    assert take(root / "s2", app, parents=[]).manifest.parents == []
    off = {"chunk_size": CHUNK, "auto_parent": False}
    assert take(root / "s3", app, settings=off).manifest.parents == []
    with settings.override(auto_parent=False):
        assert take(root / "s4", app).manifest.parents == []
    monkeypatch.setenv("CASNAP_AUTO_PARENT", "0")
    s5 = take(root / "s5", app)
    assert s5.manifest.parents == []
    assert take_stats(s5).chunks_written == 0  # dedup through the index all the same
    monkeypatch.delenv("CASNAP_AUTO_PARENT")
    assert take(root / "s6", app, parents=["s1"]).manifest.parents == [s1.manifest_hash]


# -- DCP ---------------------------------------------------------------------


def test_dcp_saves_with_a_new_writer_each_descend_from_the_last(tmp_path):
    root = tmp_path / "run"
    model = torch.nn.Linear(256, 256)
    dcp.save({"model": model.state_dict()}, storage_writer=CasnapWriter(root / "step_1"))
    with torch.no_grad():
        model.bias.add_(1.0)
    writer = CasnapWriter(root / "step_2")
    dcp.save({"model": model.state_dict()}, storage_writer=writer)
    repo = Repository(str(root))
    m2 = repo.storage.read_manifest(repo.resolve("step_2"))
    assert m2.parents == [repo.resolve("step_1")]
    assert writer.last_write_stats is not None
    assert writer.last_write_stats.stored_bytes_written < 4 * 1024  # only the bias
    off = CasnapWriter(root / "step_3", settings={"auto_parent": False})
    dcp.save({"model": model.state_dict()}, storage_writer=off)
    assert repo.storage.read_manifest(repo.resolve("step_3")).parents == []


# -- retention, gc and damage ----------------------------------------------


def test_a_parent_deleted_by_retention_and_gc_between_takes_loses_nothing(tmp_path):
    root = tmp_path / "run"
    apps = [state(i % 2) for i in range(4)]
    for i, app in enumerate(apps[:3]):
        take(root / f"s{i}", app)
    repo = Repository(str(root))
    repo.retain(KeepLast(1))  # s2 is kept
    repo.gc(grace_seconds=0)
    s3 = take(root / "s3", apps[3])
    assert s3.manifest.parents == [repo.resolve("s2")]
    repo.delete("s3")
    repo.delete("s2")  # every candidate gone: the next take has no parent
    repo.gc(grace_seconds=0)
    s4 = take(root / "s4", apps[3])
    assert s4.manifest.parents == []
    assert restores(root / "s4", apps[3])
    assert repo.verify(read_data=True).ok


def test_after_a_gc_the_index_no_longer_vouches_for_the_parent(tmp_path):
    repo, store = helpers.counted_repo(str(tmp_path / "run"), CHUNK)
    opts = {"repository": repo, "settings": {"chunk_size": CHUNK}}
    app = state()
    Snapshot.take(f"{repo.url}/s1", app, **opts)
    s2 = Snapshot.take(f"{repo.url}/s2", state(1), **opts)
    repo.delete("s1")
    repo.gc(grace_seconds=0)  # a new gc epoch: every chunk entry dropped
    REUSE.clear()  # as in a new process: s2's plan is not in memory
    store.reset()
    s3 = Snapshot.take(f"{repo.url}/s3", state(1), **opts)
    assert s3.manifest.parents == [s2.manifest_hash]
    assert [k for k in store.read_keys if "/manifests/" in k]  # read: the index knew nothing
    assert take_stats(s3).chunks_written == 0
    assert restores(f"{repo.url}/s3", state(1))
    assert repo.verify(read_data=True).ok


def test_a_damaged_parent_chunk_is_not_referenced(tmp_path):
    root = tmp_path / "run"
    app = state()
    s1 = take(root / "s1", app)
    packed = tensor_entry(s1.manifest.entries, "0/m/t1").chunks[0]
    loose = tensor_entry(s1.manifest.entries, "0/m/t0").chunks[1]
    assert packed.pack is not None and loose.pack is None
    flip_byte(pack_path(root, packed.pack), packed.offset + packed.length - 3)
    flip_byte(root / ".casnap" / "chunks" / loose.hash[:2] / loose.hash, CHUNK // 2)
    assert not Repository(str(root)).verify(read_data=True).ok  # records the damage
    s2 = take(root / "s2", app)
    assert s2.manifest.parents == [s1.manifest_hash]
    assert tensor_entry(s2.manifest.entries, "0/m/t1").chunks[0].pack != packed.pack
    assert restores(root / "s2", app)


def test_a_dcp_save_reusing_a_delta_chunk_loads_back(tmp_path):
    """A DCP save descends from the newest snapshot in its folder, and so reuses its
    delta chunks, and it loads back."""
    root = tmp_path / "run"
    g = torch.Generator().manual_seed(0)
    table = torch.randn(1024, 1024, generator=g)  # 4 MiB: one loose chunk
    Snapshot.take(str(root / "step_1"), {"emb": StateDict(weight=table)})
    table[torch.randperm(1024, generator=g)[:10]] += 1.0
    s2 = Snapshot.take(str(root / "step_2"), {"emb": StateDict(weight=table)})
    assert take_stats(s2).deltas_written == 1
    writer = CasnapWriter(root / "step_3")
    dcp.save({"emb": {"weight": table}}, storage_writer=writer)
    assert writer.last_write_stats is not None
    assert writer.last_write_stats.chunks_written == 0  # the delta chunk, reused
    out = {"emb": {"weight": torch.zeros_like(table)}}
    dcp.load(out, storage_reader=CasnapReader(root / "step_3"))
    assert torch.equal(out["emb"]["weight"], table)
    assert Repository(str(root)).verify().ok


class _WholeSeconds(WrapperStore):
    """A listing that gives modification times in whole seconds, as S3's does."""

    def list_info(self, prefix: str = "") -> Iterator[ObjectInfo]:
        for info in super().list_info(prefix):
            mtime = None if info.mtime is None else float(int(info.mtime))
            yield ObjectInfo(info.key, info.size, mtime)


def test_after_a_dcp_re_save_the_parent_is_the_new_save_not_its_history(tmp_path):
    """A re-save keeps the old one as ``<id>@<12 hex>`` and replaces ``<id>``
    within the same second: on a store that lists whole seconds, the next take
    must still descend from what ``<id>`` names now, not from the history."""
    Repository.init(str(tmp_path / "run"))
    repo = Repository.on_store(_WholeSeconds(LocalStore(str(tmp_path / "run"))))
    opts = {"repository": repo}
    model = torch.nn.Linear(64, 64)
    dcp.save(
        {"model": model.state_dict()},
        storage_writer=CasnapWriter(f"{repo.url}/ckpt", **opts),
    )
    with torch.no_grad():
        model.bias.add_(1.0)
    resave = CasnapWriter(f"{repo.url}/ckpt", overwrite=True, **opts)
    dcp.save({"model": model.state_dict()}, storage_writer=resave)
    assert len(repo.snapshots()) == 2  # ckpt and its history
    s = Snapshot.take(f"{repo.url}/after", {"model": model}, **opts)
    assert s.manifest.parents == [repo.resolve("ckpt")]


def test_saves_through_a_repository_object_made_here_get_parents(tmp_path):
    """``repository=repo`` with a repository this process just
    created (``Repository.init``, ``on_store``): only the first save into it is
    "fresh"; every later save, DCP or take, descends from the one before."""
    repo = Repository.on_store(LocalStore(str(tmp_path / "run")))
    opts = {"repository": repo}
    model = torch.nn.Linear(64, 64)
    for step in (1, 2):
        writer = CasnapWriter(f"{repo.url}/step_{step}", **opts)
        dcp.save({"model": model.state_dict()}, storage_writer=writer)
    assert repo.storage.read_manifest(repo.resolve("step_2")).parents == [repo.resolve("step_1")]
    s3 = Snapshot.take(f"{repo.url}/step_3", {"model": model}, **opts)
    assert s3.manifest.parents == [repo.resolve("step_2")]


def test_an_import_descends_from_the_newest_snapshot_in_its_folder(tmp_path):
    """``casnap import`` is a take without a session like any other (docs/import.md)."""
    from safetensors.torch import save_file

    from casnap.integrations.importers import import_checkpoint

    root = tmp_path / "run"
    s1 = take(root / "step_1", state())
    save_file(dict(state()["m"]), tmp_path / "m.safetensors")
    imported = import_checkpoint(tmp_path / "m.safetensors", root / "step_2")
    assert imported.manifest.parents == [s1.manifest_hash]
    again = import_checkpoint(tmp_path / "m.safetensors", root / "step_3")
    assert again.manifest.parents == [imported.manifest_hash]
    assert take_stats(again).chunks_written == 0
    off = import_checkpoint(
        tmp_path / "m.safetensors", root / "step_4", settings={"auto_parent": False}
    )
    assert off.manifest.parents == []


def test_a_sparse_update_saved_through_dcp_is_stored_as_a_delta(tmp_path):
    """docs/repository.md: a CasnapWriter per save forms a lineage and stores sparse
    updates as deltas, as Snapshot.take does."""
    root = tmp_path / "run"
    g = torch.Generator().manual_seed(0)
    table = torch.randn(4096, 1024, generator=g)  # 16 MiB, four 4 MiB chunks
    dcp.save({"emb": {"weight": table}}, storage_writer=CasnapWriter(root / "step_1"))
    table[torch.randperm(4096, generator=g)[:41]] += 0.01  # 1% of the rows
    writer = CasnapWriter(root / "step_2")
    dcp.save({"emb": {"weight": table}}, storage_writer=writer)
    stats = writer.last_write_stats
    assert stats is not None and stats.deltas_written > 0
    assert stats.stored_bytes_written < table.numel() * 4 // 20  # < 0.8 MiB of 16 MiB
    out = {"emb": {"weight": torch.zeros_like(table)}}
    dcp.load(out, storage_reader=CasnapReader(root / "step_2"))
    assert torch.equal(out["emb"]["weight"], table)


class _SlowManifests(WrapperStore):
    """Manifest reads take a remote store's time (the rest is as fast as a local disk)."""

    def get(self, key: str, *, limit: int | None = None) -> bytes:
        if "/manifests/" in key:
            time.sleep(0.3)
        return super().get(key, limit=limit)


def test_every_changed_chunk_of_a_take_finds_its_delta_base(tmp_path):
    """A parent not in memory (a new process) is read before any chunk is written, so
    every worker's changed chunk finds its delta base, even when reading the manifest
    is slow (a remote store, or a manifest of many entries)."""
    Repository.init(str(tmp_path / "run"))
    repo = Repository.on_store(_SlowManifests(LocalStore(str(tmp_path / "run"))))
    opts = {"repository": repo, "settings": {"chunk_size": 1 << 20}}
    g = torch.Generator().manual_seed(0)
    table = torch.randn(4096, 1024, generator=g)  # 16 MiB: sixteen 1 MiB chunks
    app = {"emb": StateDict(weight=table, bias=torch.randn(1024, generator=g))}
    Snapshot.take(f"{repo.url}/step_1", app, **opts)
    table[::256] += 0.01  # one row in each chunk
    REUSE.clear()  # as in a new process: step_1 is read from the store
    s2 = Snapshot.take(f"{repo.url}/step_2", app, **opts)
    stats = take_stats(s2)
    assert stats.chunks_written == 16
    assert stats.deltas_written == 16
    assert stats.stored_bytes_written < 1 << 20  # of 16 MiB
    assert restores_emb(f"{repo.url}/step_2", app, repo)


def restores_emb(path: str, app: dict, repo: Repository) -> bool:
    blank = {"emb": StateDict({k: torch.zeros_like(v) for k, v in app["emb"].items()})}
    Snapshot(path, repository=repo).restore(blank)
    return all(torch.equal(blank["emb"][k], app["emb"][k]) for k in app["emb"])
