"""A Session is what successive takes share; without one, a take descends from the newest
snapshot in its folder (casnap.take.parent)."""

from __future__ import annotations

import torch

from casnap import Checkpointer, Session, Snapshot, StateDict


def test_takes_through_one_session_form_a_lineage(tmp_path):
    root = str(tmp_path / "repo")
    session = Session()
    state = {"m": StateDict(w=torch.randn(100))}
    s1 = Snapshot.take(f"{root}/s1", state, session=session)
    s2 = Snapshot.take(f"{root}/s2", state, session=session)
    assert s1.manifest.parents == [] and s2.manifest.parents == [s1.manifest_hash]


def test_sessions_do_not_see_each_other(tmp_path):
    root = str(tmp_path / "repo")
    a, b = Session(), Session()
    state = {"m": StateDict(w=torch.randn(100))}
    sa = Snapshot.take(f"{root}/a1", state, session=a)
    sb = Snapshot.take(f"{root}/b1", state, session=b)
    assert sb.manifest.parents == []
    assert Snapshot.take(f"{root}/a2", state, session=a).manifest.parents == [sa.manifest_hash]
    assert Snapshot.take(f"{root}/b2", state, session=b).manifest.parents == [sb.manifest_hash]


def test_without_a_session_a_take_descends_from_the_newest_in_its_folder(tmp_path):
    root = str(tmp_path / "repo")
    state = {"m": StateDict(w=torch.randn(100))}
    s1 = Snapshot.take(f"{root}/s1", state)
    s2 = Snapshot.take(f"{root}/s2", state)
    assert s1.manifest.parents == [] and s2.manifest.parents == [s1.manifest_hash]
    assert s2.last_take_stats is not None and s2.last_take_stats.chunks_written == 0  # dedup
    s3 = Snapshot.take(f"{root}/s3", state, parents=[s1.manifest_hash])
    assert s3.manifest.parents == [s1.manifest_hash]  # an explicit parent wins
    assert Snapshot.take(f"{root}/s4", state, parents=[]).manifest.parents == []  # opted out


def test_a_restore_through_a_session_is_the_next_takes_parent(tmp_path):
    root = str(tmp_path / "repo")
    base = Snapshot.take(f"{root}/base", {"m": StateDict(w=torch.randn(100))})
    session = Session()
    tuned = StateDict(w=torch.empty(100))
    Snapshot(f"{root}/base", session=session).restore({"m": tuned})
    tuned["w"].add_(1.0)
    child = Snapshot.take(f"{root}/tuned", {"m": tuned}, session=session)
    assert child.manifest.parents == [base.manifest_hash]


def test_an_async_take_through_a_session_records_its_lineage_when_committed(tmp_path):
    root = str(tmp_path / "repo")
    session = Session()
    state = {"m": StateDict(w=torch.randn(1000))}
    s1 = Snapshot.async_take(f"{root}/s1", state, session=session).wait()
    s2 = Snapshot.async_take(f"{root}/s2", state, session=session).wait()
    assert s2.manifest.parents == [s1.manifest_hash]
    assert session.staging.reused_bytes == 4000  # the first take's buffer, staged again


def test_each_checkpointer_owns_its_session(tmp_path):
    state = {"m": StateDict(w=torch.randn(100))}
    a = Checkpointer(str(tmp_path / "a"), every_n_steps=1)
    b = Checkpointer(str(tmp_path / "b"), every_n_steps=1)
    assert a.session is not b.session
    first = a.maybe_take(1, state)
    b.maybe_take(1, state)
    second = a.maybe_take(2, state)
    assert isinstance(first, Snapshot) and isinstance(second, Snapshot)
    assert second.manifest.parents == [first.manifest_hash]
