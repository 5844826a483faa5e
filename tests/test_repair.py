"""casnap repair: good copies of damaged chunks, from the repository, a snapshot, or live state.

Each test damages a real repository on disk (a flipped byte in a loose chunk
and in a packed frame), shows that restore fails, repairs through the real
CLI, and checks what a user sees: restore returns the original tensors bit
for bit and ``verify --read-data`` exits 0, or the snapshots nobody can
supply are listed as unrecoverable with exit 1 (docs/damage.md, "Repair").
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import flip_byte

from casnap import IntegrityError, Repository, StateDict
from casnap.cli.app import main
from casnap.format import codec
from casnap.repo.damage import list_damage
from casnap.store import LocalStore
from casnap.store.faults import FailingStore

CHUNK = 16 * 1024


def live_state() -> dict:
    g = torch.Generator().manual_seed(7)
    return {
        "m": StateDict(
            w=torch.randn(10_000, generator=g),
            b=torch.randn(10, generator=g),
            c=torch.randn(30, generator=g),
        )
    }


def zeros() -> dict:
    return {"m": StateDict(w=torch.zeros(10_000), b=torch.zeros(10), c=torch.zeros(30))}


def make_repo(root: Path, names=("s1",)) -> Repository:
    repo = Repository.init(str(root), chunk_size=CHUNK)
    for name in names:
        repo.take(name, live_state())
    return repo


def restores(repo: Repository, name: str) -> bool:
    """Whether ``name`` restores the live state bit-exact (False on an IntegrityError)."""
    target = zeros()
    try:
        Repository(repo.url).snapshot(name).restore(target)
    except IntegrityError:
        return False
    want = live_state()["m"]
    return all(torch.equal(target["m"][k], want[k]) for k in ("w", "b", "c"))


def save_live(path: Path) -> Path:
    """What a user still holds, saved the usual way: a plain state dict."""
    torch.save({"model": dict(live_state()["m"])}, path)
    return path


def refs_of(repo: Repository, name: str):
    return repo.storage.read_manifest(repo.resolve(name)).chunk_refs()


def damage_loose_and_packed(repo: Repository, name: str = "s1") -> tuple[str, str]:
    """Flip a payload byte of one loose chunk and of one packed frame; returns their hashes."""
    meta = Path(repo.url) / ".casnap"
    loose = next(r for r in refs_of(repo, name) if r.pack is None)
    packed = next(r for r in refs_of(repo, name) if r.pack is not None)
    flip_byte(meta / "chunks" / loose.hash[:2] / loose.hash, codec.HEADER_SIZE + 100)
    flip_byte(meta / "packs" / packed.pack[:2] / packed.pack, packed.offset + codec.HEADER_SIZE + 3)
    return loose.hash, packed.hash


def cli(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    return code, out.out


def tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


# -- repaired -----------------------------------------------------------------


def test_repair_from_live_state_saved_with_torch_save(tmp_path, capsys):
    repo = make_repo(tmp_path / "repo", ("s1", "s2"))
    damage_loose_and_packed(repo)
    assert cli(capsys, "verify", repo.url, "--read-data")[0] == 1
    assert not restores(repo, "s1") and not restores(repo, "s2")  # s2 shares the copies

    live = save_live(tmp_path / "live.pt")
    code, out = cli(capsys, "repair", repo.url, "--from", str(live))
    assert code == 0, out
    assert restores(repo, "s1") and restores(repo, "s2")
    assert cli(capsys, "verify", repo.url, "--read-data")[0] == 0
    assert cli(capsys, "verify", repo.url)[0] == 0


def test_repair_from_a_snapshot_in_another_repository(tmp_path, capsys):
    repo = make_repo(tmp_path / "repo")
    other = make_repo(tmp_path / "other", ("copy",))  # the same tensors, chunked alike
    damage_loose_and_packed(repo)
    assert cli(capsys, "verify", repo.url, "--read-data")[0] == 1

    code, out = cli(capsys, "repair", repo.url, "--from-snapshot", f"{other.url}/copy", "--json")
    report = json.loads(out)
    assert code == 0 and report["ok"] and len(report["written"]) == 2
    assert [r["status"] for r in report["roots"]] == ["repaired"]
    assert restores(repo, "s1")
    assert cli(capsys, "verify", repo.url, "--read-data")[0] == 0


def test_repair_from_the_python_api_with_a_state_dict_in_memory(tmp_path):
    repo = make_repo(tmp_path / "repo")
    damage_loose_and_packed(repo)
    assert not repo.verify(read_data=True).ok
    result = repo.repair(from_states=[live_state()])
    assert result.ok and result.unrecoverable == []
    assert restores(repo, "s1") and repo.verify(read_data=True).ok


def test_a_packed_chunk_is_repaired_from_another_copy_in_the_repository(tmp_path, capsys):
    repo = make_repo(tmp_path / "repo")
    _, packed = damage_loose_and_packed(repo)
    assert cli(capsys, "verify", repo.url, "--read-data")[0] == 1
    repo.take("s2", live_state())  # writes the damaged chunks again: a good copy elsewhere
    assert restores(repo, "s2") and not restores(repo, "s1")

    code, out = cli(capsys, "repair", repo.url)  # no source given: the repository has one
    assert code == 0, out
    assert restores(repo, "s1")
    # The damaged frame keeps its record; reads fall back to its replacement, and gc
    # keeps that replacement while s1 points into the damaged frame.
    assert any(c.chunk == packed and c.pack for c in list_damage(repo.storage))
    repo.gc(grace_seconds=0)
    assert restores(repo, "s1") and cli(capsys, "verify", repo.url, "--read-data")[0] == 0


def test_repair_with_read_data_finds_damage_no_read_has_recorded(tmp_path, capsys):
    repo = make_repo(tmp_path / "repo")
    damage_loose_and_packed(repo)
    live = save_live(tmp_path / "live.pt")
    assert cli(capsys, "repair", repo.url, "--from", str(live))[0] == 0  # nothing recorded yet
    assert not restores(repo, "s1")
    assert cli(capsys, "repair", repo.url, "--from", str(live), "--read-data")[0] == 0
    assert restores(repo, "s1")


# -- not repaired -------------------------------------------------------------


def test_a_chunk_nobody_can_supply_leaves_its_snapshots_unrecoverable(tmp_path, capsys):
    repo = make_repo(tmp_path / "repo", ("s1", "s2"))
    repo.take("other", {"x": StateDict(t=torch.arange(5000.0))})
    loose, packed = damage_loose_and_packed(repo)
    assert cli(capsys, "verify", repo.url, "--read-data")[0] == 1

    code, out = cli(capsys, "repair", repo.url, "--json")
    report = json.loads(out)
    assert code == 1 and not report["ok"]
    status = {r["name"]: r for r in report["roots"]}
    assert status["other"]["status"] == "ok"
    for name in ("s1", "s2"):
        assert status[name]["status"] == "unrecoverable"
        assert sorted(status[name]["missing"]) == sorted([loose, packed])
    code, text = cli(capsys, "repair", repo.url)
    assert (
        code == 1 and "snapshot s1: unrecoverable" in text and "snapshot s2: unrecoverable" in text
    )
    target = {"x": StateDict(t=torch.zeros(5000))}
    repo.snapshot("other").restore(target)
    assert torch.equal(target["x"]["t"], torch.arange(5000.0)) and not restores(repo, "s1")


def test_a_live_state_with_other_values_supplies_nothing(tmp_path, capsys):
    repo = make_repo(tmp_path / "repo")
    damage_loose_and_packed(repo)
    repo.verify(read_data=True)
    changed = live_state()
    changed["m"]["w"] += 1.0  # trained on since: no chunk of w hashes the same
    changed["m"]["b"] += 1.0
    result = repo.repair(from_states=[changed])
    assert not result.ok and result.unrecoverable == ["s1"]


def test_dry_run_changes_nothing(tmp_path, capsys):
    repo = make_repo(tmp_path / "repo")
    damage_loose_and_packed(repo)
    assert cli(capsys, "verify", repo.url, "--read-data")[0] == 1
    live = save_live(tmp_path / "live.pt")
    before = tree(tmp_path / "repo")
    code, out = cli(capsys, "repair", repo.url, "--from", str(live), "--dry-run")
    assert code == 0 and "would write" in out and "(dry run)" in out
    assert tree(tmp_path / "repo") == before
    assert not restores(repo, "s1")


# -- crash safety ---------------------------------------------------------------


def test_a_repair_killed_halfway_leaves_every_snapshot_as_restorable_as_before(tmp_path, capsys):
    repo = make_repo(tmp_path / "repo")
    damage_loose_and_packed(repo)
    repo.verify(read_data=True)
    records = list_damage(repo.storage)
    # The process 'dies' (raises) when repair puts its second chunk.
    store = FailingStore(
        LocalStore(str(tmp_path / "repo")),
        2,
        prefixes=(".casnap/chunks/",),
        fail=lambda key: KeyboardInterrupt("killed"),
    )
    dying = Repository.on_store(store)
    assert isinstance(dying, Repository)
    with pytest.raises(KeyboardInterrupt):
        dying.repair(from_states=[live_state()])
    # One chunk was written (and verified), the other not: still damaged, still recorded.
    assert store.calls == 2 and len(records) == 2
    assert not restores(repo, "s1")
    code, out = cli(capsys, "verify", repo.url, "--read-data", "--json")
    assert code == 1 and len(json.loads(out)["problems"]) == 1
    result = repo.repair(from_states=[live_state()])  # run again: finishes the job
    assert result.ok and restores(repo, "s1")
