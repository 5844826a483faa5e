"""Damage is contained: once a read finds a chunk whose bytes do not match its name,
no later take references those bytes again, in this process or any other.

Each test damages a real repository on disk the way a failing disk would (one
flipped byte), lets casnap find it the way a user would (verify, restore,
read_object, export), then takes the intact live state again in a NEW process
and checks that the new snapshot restores bit-exact (docs/damage.md).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import chunk_path, flip_byte, pack_path, tensor_entry

from casnap import IntegrityError, Repository, Session, Snapshot, StateDict
from casnap.errors import StoreError
from casnap.repo.damage import list_damage
from casnap.store import LocalStore
from casnap.store.base import Data

CHUNK = 64 * 1024
ROOT = Path(__file__).resolve().parents[1]

# The live state, rebuilt identically in every process: one tensor of loose
# chunks (64 KiB each) and two small tensors that go to a pack.
STATE_SRC = """
import torch
from casnap import StateDict
def live_state():
    g = torch.Generator().manual_seed(1234)
    return {"m": StateDict(w=torch.randn(100_000, generator=g),
                           b=torch.randn(100, generator=g),
                           c=torch.randn(50, generator=g))}
"""
_ns: dict = {}
exec(STATE_SRC, _ns)
live_state = _ns["live_state"]


def snap_path(repo: Path, name: str) -> str:
    return str(repo / name)


def take_here(repo: Path, name: str, **kw) -> Snapshot:
    return Snapshot.take(snap_path(repo, name), live_state(), settings={"chunk_size": CHUNK}, **kw)


def take_in_new_process(
    repo: Path, name: str, parents: list[str] | None = None, index_dir: Path | None = None
) -> None:
    """A fresh process takes the intact live state (same CASNAP_INDEX_DIR: a real machine;
    ``index_dir``: another machine, whose index never saw this repository)."""
    code = STATE_SRC + textwrap.dedent(f"""
        from casnap import Snapshot
        Snapshot.take({snap_path(repo, name)!r}, live_state(),
                      settings={{"chunk_size": {CHUNK}}}, parents={parents!r})
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if index_dir is not None:
        env["CASNAP_INDEX_DIR"] = str(index_dir)
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300)


def restores_bit_exact(repo: Path, name: str) -> bool:
    expected = live_state()["m"]
    target = {"m": StateDict(w=torch.zeros(100_000), b=torch.zeros(100), c=torch.zeros(50))}
    Snapshot(snap_path(repo, name)).restore(target)
    return all(torch.equal(target["m"][k], expected[k]) for k in expected)


def damage_loose(repo: Path, snap: Snapshot) -> str:
    ref = tensor_entry(snap.get_manifest(), "0/m/w").chunks[1]
    assert ref.pack is None
    path = chunk_path(repo, ref.hash)
    flip_byte(path, path.stat().st_size - 10)  # in the payload: the header still probes fine
    return ref.hash


def damage_packed(repo: Path, snap: Snapshot) -> tuple[str, str]:
    ref = tensor_entry(snap.get_manifest(), "0/m/b").chunks[0]
    assert ref.pack is not None
    flip_byte(pack_path(repo, ref.pack), ref.offset + ref.length - 3)
    return ref.hash, ref.pack


def corrupt_chunks(report) -> list:
    return [p for p in report.problems if p.kind == "corrupt-chunk"]


# -- found by verify -------------------------------------------------------


def test_loose_chunk_found_by_verify_is_rewritten_by_the_next_take_in_a_new_process(tmp_path):
    repo = tmp_path / "repo"
    s1 = take_here(repo, "s1")
    h = damage_loose(repo, s1)
    report = Repository(str(repo)).verify(read_data=True)
    assert [p.subject for p in corrupt_chunks(report)] == [f"chunks/{h[:2]}/{h} ({h[:12]})"]

    take_in_new_process(repo, "s2")

    assert restores_bit_exact(repo, "s2")
    assert restores_bit_exact(repo, "s1")  # same name, good bytes again: the old one heals
    assert Repository(str(repo)).verify(read_data=True).ok
    assert list_damage(Repository(str(repo)).storage) == []  # the rewrite cleared the record


def test_packed_chunk_found_by_verify_is_written_anew_by_the_next_take(tmp_path):
    repo = tmp_path / "repo"
    s1 = take_here(repo, "s1")
    h, pack = damage_packed(repo, s1)
    report = Repository(str(repo)).verify(read_data=True)
    assert len(corrupt_chunks(report)) == 1

    take_in_new_process(repo, "s2")  # no lineage: the index knew the packed frame

    assert restores_bit_exact(repo, "s2")
    new_ref = tensor_entry(Snapshot(snap_path(repo, "s2")).get_manifest(), "0/m/b").chunks[0]
    assert new_ref.hash == h and new_ref.pack != pack
    # the neighbour frame in the damaged pack was left alone and is still shared
    c_old = tensor_entry(s1.get_manifest(), "0/m/c").chunks[0]
    assert tensor_entry(Snapshot(snap_path(repo, "s2")).get_manifest(), "0/m/c").chunks[0] == c_old
    # verify keeps reporting the old snapshot, and only it, while it references the frame
    again = corrupt_chunks(Repository(str(repo)).verify(read_data=True))
    assert [p.snapshots for p in again] == [("s1",)]


def test_packed_chunk_is_not_reused_through_a_parent_manifest(tmp_path):
    repo = tmp_path / "repo"
    s1 = take_here(repo, "s1")
    h, pack = damage_packed(repo, s1)
    assert not Repository(str(repo)).verify(read_data=True).ok

    take_in_new_process(repo, "s2", parents=["s1"])  # dedup against s1's manifest

    assert restores_bit_exact(repo, "s2")
    assert (
        tensor_entry(Snapshot(snap_path(repo, "s2")).get_manifest(), "0/m/b").chunks[0].pack != pack
    )


def test_a_session_that_remembers_the_damaged_plan_writes_the_chunk_again(tmp_path):
    repo = tmp_path / "repo"
    session = Session()
    s1 = take_here(repo, "s1", session=session)
    damage_loose(repo, s1)
    damage_packed(repo, s1)
    assert len(corrupt_chunks(Repository(str(repo)).verify(read_data=True))) == 2

    take_here(repo, "s2", session=session)  # parent s1, plan remembered in memory

    assert restores_bit_exact(repo, "s2")
    with pytest.raises(IntegrityError):
        restores_bit_exact(repo, "s1")  # s1's pack frame stays damaged
    problems = corrupt_chunks(Repository(str(repo)).verify(read_data=True))
    assert [p.snapshots for p in problems] == [("s1",)]  # the loose one healed


def test_a_session_re_take_after_damage_gathers_its_parents_chunks_again(tmp_path):
    """A session's re-take reuses the parent chunks it gathered last when the parent's
    entries are the same objects (casnap.take.reuse), never once damage is
    recorded: s2's parent s1 has s0's entries, and the copies s1 names are damaged."""
    repo = tmp_path / "repo"
    session = Session()
    take_here(repo, "s0", session=session)
    s1 = take_here(repo, "s1", session=session)  # gathers s0's chunks: s1's are the same
    damage_loose(repo, s1)
    damage_packed(repo, s1)
    assert len(corrupt_chunks(Repository(str(repo)).verify(read_data=True))) == 2

    take_here(repo, "s2", session=session)

    assert restores_bit_exact(repo, "s2")
    problems = corrupt_chunks(Repository(str(repo)).verify(read_data=True))
    assert [p.snapshots for p in problems] == [("s0", "s1")]  # the loose one healed


# -- found by a read -------------------------------------------------------


def test_damage_found_by_a_restore_is_contained_too(tmp_path):
    repo = tmp_path / "repo"
    s1 = take_here(repo, "s1")
    damage_loose(repo, s1)
    damage_packed(repo, s1)
    with pytest.raises(IntegrityError):
        restores_bit_exact(repo, "s1")

    # a plain verify (no data read) now reports what the restore found
    problems = corrupt_chunks(Repository(str(repo)).verify())
    assert len(problems) == 2 and all(p.snapshots == ("s1",) for p in problems)

    take_in_new_process(repo, "s2")

    assert restores_bit_exact(repo, "s2")


def test_damage_found_by_read_object_is_contained_too(tmp_path):
    repo = tmp_path / "repo"
    s1 = take_here(repo, "s1")
    damage_packed(repo, s1)
    with pytest.raises(IntegrityError):
        Snapshot(snap_path(repo, "s1")).read_object("0/m/b")

    take_in_new_process(repo, "s2")

    assert restores_bit_exact(repo, "s2")


def test_damage_found_by_export_is_contained_too(tmp_path):
    repo = tmp_path / "repo"
    s1 = take_here(repo, "s1")
    damage_loose(repo, s1)
    with pytest.raises(IntegrityError):
        Repository(str(repo)).export("s1", tmp_path / "out.safetensors")

    take_in_new_process(repo, "s2")

    assert restores_bit_exact(repo, "s2")
    assert restores_bit_exact(repo, "s1")


# -- what is not damage, and where nothing can be recorded -----------------


def test_a_missing_object_is_not_recorded_as_damage(tmp_path):
    repo = tmp_path / "repo"
    s1 = take_here(repo, "s1")
    ref = tensor_entry(s1.get_manifest(), "0/m/w").chunks[1]
    (chunk_path(repo, ref.hash)).unlink()
    with pytest.raises(IntegrityError, match="missing"):
        restores_bit_exact(repo, "s1")
    assert list_damage(Repository(str(repo)).storage) == []


class _ReadOnlyStore(LocalStore):
    """A local store opened without write access (as `verify` on a read-only mount)."""

    def put(self, key: str, data: Data, *, create_only: bool = False, durable: bool = True) -> None:
        raise StoreError(f"read-only store refuses to write {key}", key)

    def delete(self, key: str) -> None:
        raise StoreError(f"read-only store refuses to delete {key}", key)


def test_verify_on_a_read_only_repository_reports_damage_and_warns(tmp_path, caplog):
    repo = tmp_path / "repo"
    s1 = take_here(repo, "s1")
    damage_loose(repo, s1)
    read_only = Repository.on_store(_ReadOnlyStore(str(repo)))
    with caplog.at_level(logging.WARNING, logger="casnap"):
        report = read_only.verify(read_data=True)
    assert len(corrupt_chunks(report)) == 1
    assert any("could not record" in r.getMessage() for r in caplog.records)
    assert list_damage(Repository(str(repo)).storage) == []


def test_gc_drops_the_record_of_a_damaged_object_it_deletes(tmp_path):
    repo = tmp_path / "repo"
    s1 = take_here(repo, "s1")
    damage_packed(repo, s1)
    assert not Repository(str(repo)).verify(read_data=True).ok
    assert len(list_damage(Repository(str(repo)).storage)) == 1
    r = Repository(str(repo))
    r.storage.delete_ref("s1")
    r.gc(grace_seconds=0)
    assert list_damage(Repository(str(repo)).storage) == []


def test_a_flipped_bit_in_a_frame_version_is_damage_not_a_newer_format(tmp_path):
    repo = tmp_path / "repo"
    s1 = take_here(repo, "s1")
    ref = tensor_entry(s1.get_manifest(), "0/m/w").chunks[1]
    path = chunk_path(repo, ref.hash)
    flip_byte(path, 4)  # the frame's version byte: 1 -> 0
    with pytest.raises(IntegrityError, match="damaged frame header"):
        restores_bit_exact(repo, "s1")
    assert [d.chunk for d in list_damage(Repository(str(repo)).storage)] == [ref.hash]
    assert len(corrupt_chunks(Repository(str(repo)).verify(read_data=True))) == 1
    take_in_new_process(repo, "s2")
    assert restores_bit_exact(repo, "s2") and restores_bit_exact(repo, "s1")


@pytest.mark.parametrize("how", ["symlink-to-dev-zero", "fifo", "longer-than-its-frame"])
def test_a_loose_chunk_casnap_will_not_read_is_damage_and_the_next_take_replaces_it(tmp_path, how):
    repo = tmp_path / "repo"
    s1 = take_here(repo, "s1")
    ref = tensor_entry(s1.get_manifest(), "0/m/w").chunks[1]
    path = chunk_path(repo, ref.hash)
    if how == "longer-than-its-frame":
        with open(path, "ab") as fh:
            fh.write(b"\0" * 4096)
    else:
        path.unlink()
        os.symlink("/dev/zero", path) if how == "symlink-to-dev-zero" else os.mkfifo(path)
    if how == "longer-than-its-frame":  # a restore reads the frame's bytes only: they are fine
        assert restores_bit_exact(repo, "s1")
        assert not Repository(str(repo)).verify(read_data=True).ok  # verify reads it whole
    else:
        with pytest.raises(IntegrityError):
            restores_bit_exact(repo, "s1")
    assert [c.chunk for c in list_damage(Repository(str(repo)).storage)] == [ref.hash]  # recorded

    take_in_new_process(repo, "s2")

    assert path.is_file() and not path.is_symlink()  # replaced by the good bytes
    assert restores_bit_exact(repo, "s2") and restores_bit_exact(repo, "s1")
    assert Repository(str(repo)).verify(read_data=True).ok
    assert list_damage(Repository(str(repo)).storage) == []


def test_a_damaged_loose_chunk_never_lands_in_tensors_the_restore_allocates(tmp_path):
    """A damaged loose chunk read into a tensor the restore allocated raises, is
    contained, and the half-filled tensor is never handed to load_state_dict."""
    repo = tmp_path / "repo"
    s1 = take_here(repo, "s1")
    h = damage_loose(repo, s1)
    fresh = StateDict()  # the restore allocates every tensor
    with pytest.raises(IntegrityError):
        Snapshot(snap_path(repo, "s1")).restore({"m": fresh})
    assert len(fresh) == 0  # load_state_dict was never called
    with pytest.raises(IntegrityError):
        Snapshot(snap_path(repo, "s1")).read_object("0/m/w")
    problems = corrupt_chunks(Repository(str(repo)).verify())
    assert len(problems) == 1 and h in problems[0].subject + problems[0].detail
