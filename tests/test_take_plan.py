"""A take reuses the previous take's plan; small chunks travel in batches."""

from __future__ import annotations

import json
from typing import Any

import helpers
import pytest
import torch
from helpers import take_stats

from casnap import Repository, Session, Snapshot, StateDict
from casnap.errors import StoreError
from casnap.format.json_text import canonical_json
from casnap.format.manifest_bytes import split
from casnap.format.names import hash_bytes
from casnap.repo.parts import part_key
from casnap.repo.repository import manifest_key
from casnap.store import CountingStore
from casnap.take.reuse import REUSE

CHUNK = 64 * 1024


@pytest.fixture(params=["session", "none"])
def session(request) -> Session | None:
    """What one process keeps between takes: lineage and the last plan; or no session,
    whose takes leave their plans in the detached ones (casnap.take.session)."""
    REUSE.clear()
    return Session() if request.param == "session" else None


def counted_repo(root: str) -> tuple[Repository, CountingStore]:
    return helpers.counted_repo(root, CHUNK)


def take(
    repo: Repository, name: str, state: StateDict, session: Session | None, **kwargs
) -> Snapshot:
    opts: dict[str, Any] = {"repository": repo, "settings": {"chunk_size": CHUNK}}
    return Snapshot.take(f"{repo.url}/{name}", {"s": state}, **opts, session=session, **kwargs)


def state_of(n_small: int, seed: int = 0) -> StateDict:
    g = torch.Generator().manual_seed(seed)
    state = StateDict(big=torch.randn(100_000, generator=g))
    for i in range(n_small):
        state[f"small{i}"] = torch.randn(64, generator=g)
    return state


def restored(repo: Repository, name: str, like: StateDict) -> StateDict:
    out = StateDict({k: torch.empty_like(v) for k, v in like.items()})
    Snapshot(f"{repo.url}/{name}", repository=repo).restore({"s": out})
    return out


def assert_same(a: StateDict, b: StateDict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_the_next_take_reuses_the_previous_manifest_instead_of_reading_it(tmp_path, session):
    repo, store = counted_repo(str(tmp_path / "repo"))
    state = state_of(50)
    s1 = take(repo, "s1", state, session)
    state["small3"].add_(1)
    store.reset()
    s2 = take(repo, "s2", state, session)
    assert s2.manifest.parents == [s1.manifest_hash]
    manifest_gets = [k for k in store.read_keys if "/manifests/" in k]
    assert manifest_gets == []  # the plan came from memory, checked by one exists()
    assert take_stats(s2).chunks_written == 1
    # Unchanged entries are the very objects of the previous manifest; the changed one is new.
    assert s2.manifest.entries["0/s/big"] is s1.manifest.entries["0/s/big"]
    assert s2.manifest.entries["0/s/small0"] is s1.manifest.entries["0/s/small0"]
    assert s2.manifest.entries["0/s/small3"] != s1.manifest.entries["0/s/small3"]
    assert_same(restored(repo, "s2", state), state)
    # What was written is exactly what a fresh read of the manifest gives, and its
    # bytes, manifest and parts, are those of a full dump made afresh (the reused entry
    # dumps changed nothing; docs/format.md, "Manifest parts").
    assert repo.storage.read_manifest(s2.manifest_hash) == s2.manifest
    data, parts = split(s2.manifest.model_copy(update={"parts": []}))
    assert repo.storage.store.get(manifest_key(s2.manifest_hash)) == data
    assert [p.ref for p in parts] == s2.manifest.parts
    for part in parts:
        assert repo.storage.store.get(part_key(part.ref.hash)) == part.frame


def test_an_unchanged_re_take_holds_its_parents_very_entries(tmp_path, session):
    """Containers, primitives and pickled objects are built anew each take; equal ones
    are the parent's objects, so an unchanged re-take's manifest holds the parent's
    entries dict itself (casnap.format.manifest.same_entries) and reuses its format
    version, entry texts and their join. Its bytes stay the canonical JSON; a changed
    primitive gives a new entries dict with only that entry new."""
    repo, _ = counted_repo(str(tmp_path / "repo"))
    state = state_of(20)
    extra = StateDict(step=7, lr=0.5, opts={"betas": (0.9, 0.99)}, tags={"a", "b"})

    def snap(name: str) -> Snapshot:
        opts: dict[str, Any] = {"repository": repo, "settings": {"chunk_size": CHUNK}}
        app = {"s": state, "x": extra}
        return Snapshot.take(f"{repo.url}/{name}", app, **opts, session=session, allow_pickle=True)

    s1, s2 = snap("s1"), snap("s2")
    assert s2.manifest.parents == [s1.manifest_hash]
    assert s2.manifest.entries is s1.manifest.entries  # every entry unchanged
    extra["step"] = 8
    s3 = snap("s3")
    assert s3.manifest.entries is not s2.manifest.entries
    changed = [k for k, e in s3.manifest.entries.items() if e is not s2.manifest.entries[k]]
    assert changed == ["0/x/step"]
    for s in (s2, s3):
        stored = repo.storage.store.get(manifest_key(s.manifest_hash))
        assert stored == canonical_json(s.manifest.model_dump(mode="json"))
        assert repo.storage.read_manifest(s.manifest_hash) == s.manifest
    out = StateDict(step=0, lr=0.0, opts={}, tags=set())
    Snapshot(f"{repo.url}/s3", repository=repo).restore({"x": out}, allow_pickle=True)
    assert dict(out) == dict(extra)


def test_a_parents_malformed_primitive_is_not_reused_for_an_equal_value(tmp_path):
    """``True == 1``: a parent a session restored, whose stored primitive is
    ``{"type": "int", "value": true}`` (parsed; refused only when restored), must not
    lend its entry to the next take's ``1``, or that take stores the bad value too."""
    repo, _ = counted_repo(str(tmp_path / "repo"))
    opts: dict[str, Any] = {"repository": repo, "settings": {"chunk_size": CHUNK}}
    app = {"a": StateDict(w=torch.ones(4)), "b": StateDict(flag=1)}
    s0 = Snapshot.take(f"{repo.url}/s0", app, **opts)
    store = repo.storage.store
    doc = json.loads(store.get(manifest_key(s0.manifest_hash)))
    doc["entries"]["0/b/flag"]["value"] = True
    bad = canonical_json(doc)
    store.put(manifest_key(hash_bytes(bad)), bad, create_only=True)
    repo.storage.write_ref("bad", hash_bytes(bad))
    session = Session()
    Snapshot(f"{repo.url}/bad", repository=repo, session=session).restore(
        {"a": StateDict(w=torch.zeros(4))}
    )
    s1 = Snapshot.take(f"{repo.url}/s1", app, **opts, session=session)
    assert s1.manifest.parents == [hash_bytes(bad)]  # the session's plan is the bad one
    out = {"b": StateDict(flag=0)}
    Snapshot(f"{repo.url}/s1", repository=repo).restore(out)
    assert out["b"]["flag"] == 1 and type(out["b"]["flag"]) is int


def test_a_remembered_parent_that_gc_swept_is_not_trusted(tmp_path, session):
    from casnap.gc.collect import gc

    repo, _ = counted_repo(str(tmp_path / "repo"))
    old = state_of(20, seed=0)
    s1 = take(repo, "s1", old, session)  # remembered as the session's plan
    repo.storage.delete_ref("s1")
    assert gc(repo.storage, grace_seconds=0).deleted > 0  # its manifest, chunks and pack are gone
    s2 = take(repo, "s2", old, session)  # parent: s1, from the session's lineage and last plan
    assert take_stats(s2).chunks_written == len(s1.manifest.chunk_refs())  # all again
    assert_same(restored(repo, "s2", old), old)


def test_a_detached_plan_whose_manifest_gc_swept_is_not_trusted(tmp_path):
    from casnap.gc.collect import gc

    REUSE.clear()
    repo, _ = counted_repo(str(tmp_path / "repo"))
    old = state_of(20, seed=0)
    s1 = take(repo, "s1", old, None)  # remembered in the detached plans
    repo.storage.delete_ref("s1")
    assert gc(repo.storage, grace_seconds=0).deleted > 0  # its manifest, chunks and pack are gone
    s2 = take(repo, "s2", old, None, parents=[s1.manifest_hash])  # named, as a user may
    assert take_stats(s2).chunks_written == len(s1.manifest.chunk_refs())  # all again
    assert_same(restored(repo, "s2", old), old)


def test_detached_plans_serve_only_their_own_repositories(tmp_path):
    """Two session-less loops into two repositories each keep their plan; takes into
    as many more repositories as the reuse cache holds forget the least recent, which
    then re-takes from the store."""
    from casnap.take.reuse import CAPACITY

    REUSE.clear()
    state = state_of(30)
    repos = [counted_repo(str(tmp_path / f"repo{i}")) for i in range(CAPACITY + 1)]
    firsts = [take(r, "s1", state, None) for r, _ in repos[:2]]
    agains = []
    for (repo, store), first in zip(repos[:2], firsts, strict=True):
        store.reset()
        agains.append(take(repo, "s2", state, None))
        assert [k for k in store.read_keys if "/manifests/" in k] == []
        assert agains[-1].manifest.entries["0/s/small1"] is first.manifest.entries["0/s/small1"]
    for other, _ in repos[2:]:
        take(other, "s1", state, None)  # repo0 is now the least recent: forgotten
    repo, store = repos[0]
    store.reset()
    third = take(repo, "s3", state, None)
    assert third.manifest.parents == [agains[0].manifest_hash]
    assert third.manifest.entries["0/s/small1"] is not agains[0].manifest.entries["0/s/small1"]
    assert take_stats(third).chunks_written == 0  # the index still knows every chunk
    assert repo.storage.read_manifest(third.manifest_hash) == third.manifest
    assert_same(restored(repo, "s3", state), state)


def test_thousands_of_small_tensors_round_trip_through_batches(tmp_path, session):
    repo, store = counted_repo(str(tmp_path / "repo"))
    state = state_of(3000)
    s1 = take(repo, "s1", state, session)
    packs = {c.pack for c in s1.manifest.chunk_refs() if c.pack}
    assert 1 <= len(packs) <= 3  # 3000 x 256 B packed into a handful of objects
    assert_same(restored(repo, "s1", state), state)
    store.reset()
    s2 = take(repo, "s2", state, session)
    assert take_stats(s2).chunks_written == 0
    assert s2.manifest.chunk_refs() == s1.manifest.chunk_refs()


def test_a_failure_inside_a_batch_fails_the_take_and_writes_no_ref(tmp_path, monkeypatch, session):
    from casnap.format import codec

    repo, _ = counted_repo(str(tmp_path / "repo"))
    small: list[int] = []  # sizes of the small chunks encoded, up to the failure
    real = codec.encode  # every new chunk is encoded, compressed or not

    def flaky(data, *args, **kwargs):
        if len(data) == 64 * 4:  # one of the small tensors, all written as one batch
            small.append(len(data))
            if len(small) == 7:
                raise StoreError("disk full while packing")
        return real(data, *args, **kwargs)

    monkeypatch.setattr(codec, "encode", flaky)
    with pytest.raises(StoreError, match="disk full"):
        take(repo, "s1", state_of(40), session)
    assert len(small) == 7  # failed on the 7th small chunk, in the middle of the batch
    assert not repo.storage.has_ref("s1")
    monkeypatch.undo()
    state = state_of(40)
    take(repo, "s1", state, session)
    assert_same(restored(repo, "s1", state), state)


def test_a_take_and_restore_of_plain_tensors_do_not_import_dtensor(tmp_path):
    # Importing torch.distributed.tensor costs about a second; a state without
    # sharded tensors must not pay it (a DTensor cannot exist before it is imported).
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from casnap import Snapshot, StateDict\n"
        f"path = {str(tmp_path / 'repo' / 's1')!r}\n"
        "state = StateDict(w=torch.randn(10), step=3)\n"
        "Snapshot.take(path, {'m': state})\n"
        "Snapshot(path).restore({'m': StateDict(w=torch.empty(10), step=0)})\n"
        "heavy = [m for m in ('torch.distributed.tensor', "
        "'torch.distributed._shard.sharded_tensor.api') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
