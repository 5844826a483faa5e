"""The local LMDB index: takes in a fresh process probe nothing it knows; it never misleads.

"A fresh process" is a take without a session and with ``CASNAP_AUTO_PARENT=0``:
it has no parent, so every chunk it skips was found through the index or the store.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import helpers
import lmdb
import pytest
import torch
from gcs_server import gcs_bucket, gcs_server  # noqa: F401  (fixtures)
from helpers import chunk_path, take_stats, tensor_entry

from casnap import Repository, Session, Snapshot, StateDict, index
from casnap.index import lmdb_envs
from casnap.index import lmdb_store as index_lmdb
from casnap.ops.history import stored_bytes
from casnap.store import CountingStore, FsspecStore, LocalStore
from casnap.store.base import WrapperStore

CHUNK = 64 * 1024


@pytest.fixture(autouse=True)
def _private_index(tmp_path, monkeypatch):
    monkeypatch.setenv("CASNAP_INDEX_DIR", str(tmp_path / "index"))
    monkeypatch.delenv("CASNAP_INDEX", raising=False)
    monkeypatch.setenv("CASNAP_AUTO_PARENT", "0")  # no parent: only the index finds chunks
    yield
    index.close_all()


def counted_repo(root: str) -> tuple[Repository, CountingStore]:
    return helpers.counted_repo(root, CHUNK)


def opts(repo: Repository) -> dict:
    return {"repository": repo, "settings": {"chunk_size": CHUNK}}


def data_keys(keys: list[str]) -> list[str]:
    return [k for k in keys if "/chunks/" in k or "/packs/" in k]


def mixed_state(seed: int = 0) -> StateDict:
    """Ten multi-chunk tensors (loose chunks) and forty small ones (packed)."""
    g = torch.Generator().manual_seed(seed)
    state = StateDict()
    for i in range(50):
        state[f"t{i}"] = torch.randn(40_000 if i % 5 == 0 else 300 + i, generator=g)
    return state


def loose_chunks(snap: Snapshot) -> set[str]:
    return {c.hash for c in snap.manifest.chunk_refs() if c.pack is None}


def take(repo: Repository, name: str, state: StateDict) -> Snapshot:
    return Snapshot.take(f"{repo.url}/{name}", {"s": state}, **opts(repo))


def assert_restores(repo: Repository, name: str, state: StateDict) -> None:
    fresh = StateDict({k: torch.empty_like(v) for k, v in state.items()})
    Snapshot(f"{repo.url}/{name}", repository=repo).restore({"s": fresh})
    assert all(torch.equal(fresh[k], state[k]) for k in state)


def test_a_fresh_process_take_probes_no_chunk_and_writes_no_chunk_data(tmp_path):
    repo, store = counted_repo(str(tmp_path / "repo"))
    state = mixed_state()
    s1 = take(repo, "s1", state)
    store.reset()
    s2 = take(repo, "s2", state)
    assert store.requests["get_range"] == 0, "no per-chunk probe"
    assert data_keys(store.written_keys) == []
    assert [k.split("/")[1] for k in store.written_keys if "/leases/" not in k] == [
        "manifests",
        "refs",
    ]
    assert take_stats(s2).chunks_written == 0
    # the small chunks point into the first take's pack, not a copy of it
    assert s2.manifest.chunk_refs() == s1.manifest.chunk_refs()
    assert_restores(repo, "s2", state)


def test_without_the_index_the_same_take_probes_every_loose_chunk(tmp_path, monkeypatch):
    monkeypatch.setenv("CASNAP_INDEX", "0")
    repo, store = counted_repo(str(tmp_path / "repo"))
    state = mixed_state()
    s1 = take(repo, "s1", state)
    store.reset()
    s2 = take(repo, "s2", state)
    assert store.requests["get_range"] == len(loose_chunks(s1))
    packed = [c for c in s1.manifest.chunk_refs() if c.pack is not None]
    assert take_stats(s2).chunks_written == len(packed)  # packed again
    assert not (tmp_path / "index").exists(), "a disabled index is never created"
    assert index.open_index(repo.storage) is None
    assert_restores(repo, "s2", state)


def test_changed_tensors_are_written_and_the_rest_found_in_the_index(tmp_path):
    repo, store = counted_repo(str(tmp_path / "repo"))
    state = mixed_state()
    take(repo, "s1", state)
    state["t0"].add_(1.0)  # loose chunks
    state["t7"].add_(1.0)  # packed
    store.reset()
    s2 = take(repo, "s2", state)
    changed = {
        c.hash for k in ("0/s/t0", "0/s/t7") for c in tensor_entry(s2.manifest.entries, k).chunks
    }
    # each new loose chunk is probed once (it is absent), nothing else is
    assert store.requests["get_range"] == len(changed & loose_chunks(s2))
    assert take_stats(s2).chunks_written == len(changed)
    store.reset()
    take(repo, "s3", state)  # what s2 wrote is now known as well
    assert store.requests["get_range"] == 0 and data_keys(store.written_keys) == []
    assert_restores(repo, "s3", state)


def test_a_new_gc_epoch_drops_every_chunk_entry(tmp_path):
    root = tmp_path / "repo"
    repo, store = counted_repo(str(root))
    state = mixed_state()
    s1 = take(repo, "s1", state)
    # a gc deletes one loose chunk and records that it swept
    victim = sorted(loose_chunks(s1))[0]
    os.unlink(chunk_path(root, victim))
    repo.storage.store.put(index.GC_EPOCH_KEY, b'{"epoch": "%s"}' % uuid.uuid4().hex.encode())
    store.reset()
    take(repo, "s2", state)
    assert store.requests["get_range"] == len(loose_chunks(s1))  # nothing trusted
    written = [k for k in store.written_keys if "/chunks/" in k]
    assert written == [f".casnap/chunks/{victim[:2]}/{victim}"]  # and its small chunks repacked
    assert_restores(repo, "s2", state)
    store.reset()
    take(repo, "s3", state)  # re-learned under the new epoch
    assert store.requests["get_range"] == 0


def test_after_a_real_gc_a_take_rewrites_what_it_deleted(tmp_path):
    from casnap.gc.collect import gc

    repo, store = counted_repo(str(tmp_path / "repo"))
    old = mixed_state(0)
    take(repo, "s1", old)
    take(repo, "s2", mixed_state(1))
    repo.storage.delete_ref("s1")
    assert gc(repo.storage, grace_seconds=0).deleted > 0  # s1's chunks are gone
    store.reset()
    s3 = take(repo, "s3", old)  # the index still lists s1's chunks: it must not trust them
    assert store.requests["get_range"] == len(loose_chunks(s3))
    assert_restores(repo, "s3", old)


def test_a_copy_of_the_repository_never_trusts_the_originals_entries(tmp_path):
    repo, _ = counted_repo(str(tmp_path / "a"))
    state = mixed_state()
    s1 = take(repo, "s1", state)
    shutil.copytree(tmp_path / "a", tmp_path / "b")  # same repo id, other place
    victim = sorted(loose_chunks(s1))[0]
    os.unlink(chunk_path(tmp_path / "b", victim))
    copy, store = counted_repo(str(tmp_path / "b"))
    assert copy.storage.config.repo_id == repo.storage.config.repo_id
    take(copy, "s2", state)
    assert f".casnap/chunks/{victim[:2]}/{victim}" in store.written_keys
    assert_restores(copy, "s2", state)


class _Meanwhile(WrapperStore):
    """Runs ``meanwhile`` once, at the first manifest read: inside a take, after it
    opened the index (a take in the other copy, in another process, at that moment)."""

    def __init__(self, inner: LocalStore, meanwhile) -> None:
        super().__init__(inner)
        self.meanwhile = meanwhile

    def get(self, key: str, *, limit: int | None = None) -> bytes:
        if "/manifests/" in key and self.meanwhile is not None:
            run, self.meanwhile = self.meanwhile, None
            run()
        return super().get(key, limit=limit)


def test_a_take_in_a_copy_meanwhile_never_lends_its_entries(tmp_path, monkeypatch):
    """Two copies of one repository (``cp -r``: one repo id, so one index folder) in
    use at once on one machine: a take in one must not find the chunks the other's
    take just recorded, which live in packs only the other copy has."""
    monkeypatch.setenv("CASNAP_INDEX", "0")
    take(
        Repository.on_store(LocalStore(str(tmp_path / "a")), chunk_size=CHUNK), "s1", mixed_state()
    )
    monkeypatch.delenv("CASNAP_INDEX")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    new = mixed_state(1)

    def take_in_b() -> None:
        b = Repository(str(tmp_path / "b"))
        Snapshot.take(f"{b.url}/t1", {"s": new}, **opts(b))

    a = Repository.on_store(_Meanwhile(LocalStore(str(tmp_path / "a")), take_in_b))
    Snapshot.take(f"{a.url}/s2", {"s": new}, parents=["s1"], **opts(a))
    assert a.verify().ok
    assert_restores(Repository(str(tmp_path / "a")), "s2", new)


def test_a_corrupt_index_file_is_rebuilt_silently(tmp_path):
    repo, store = counted_repo(str(tmp_path / "repo"))
    state = mixed_state()
    take(repo, "s1", state)
    path = index.index_path(repo.storage.config.repo_id)
    index.close_all()  # as if a new process
    (path / "data.mdb").write_bytes(b"\xde\xad" * 8192)
    take(repo, "s2", state)  # no error: the index is rebuilt, the take probes
    store.reset()
    take(repo, "s3", state)
    assert store.requests["get_range"] == 0, "the rebuilt index serves again"
    assert_restores(repo, "s3", state)


def test_a_damaged_entry_is_a_miss_never_a_location(tmp_path):
    repo, store = counted_repo(str(tmp_path / "repo"))
    state = mixed_state()
    s1 = take(repo, "s1", state)
    path = index.index_path(repo.storage.config.repo_id)
    index.close_all()
    env = lmdb.open(str(path), max_dbs=4)
    chunks = env.open_db(b"chunks")
    with env.begin(write=True, db=chunks) as txn:
        for key, value in list(txn.cursor()):
            txn.put(key, value[:-9] + bytes([value[-9] ^ 1]) + value[-8:])  # one bit
    env.close()
    store.reset()
    take(repo, "s2", state)
    assert store.requests["get_range"] == len(loose_chunks(s1))
    assert_restores(repo, "s2", state)


def test_a_sealed_entry_that_is_no_location_is_a_miss(tmp_path):
    """Entries are decoded without pydantic; the rules of a location still hold."""
    repo, store = counted_repo(str(tmp_path / "repo"))
    state = mixed_state()
    s1 = take(repo, "s1", state)
    path = index.index_path(repo.storage.config.repo_id)
    index.close_all()
    env = lmdb.open(str(path), max_dbs=4)
    chunks = env.open_db(b"chunks")
    with env.begin(write=True, db=chunks) as txn:
        for key, _value in list(txn.cursor()):
            bad = index_lmdb._LOOSE.pack(300, 1 << 40)  # a frame longer than its chunk
            txn.put(key, index_lmdb._seal(key, bad))
    env.close()
    store.reset()
    take(repo, "s2", state)
    assert store.requests["get_range"] == len(loose_chunks(s1))  # probed: no entry trusted
    assert_restores(repo, "s2", state)


def test_rebuild_fills_the_index_from_the_store(tmp_path):
    repo, store = counted_repo(str(tmp_path / "repo"))
    state = mixed_state()
    s1 = take(repo, "s1", state)
    index.drop(repo.storage.config.repo_id)
    stats = index.rebuild(repo.storage)
    assert stats.manifests == 1
    assert stats.chunks == len({c.hash for c in s1.manifest.chunk_refs()})
    store.reset()
    take(repo, "s2", state)
    assert store.requests["get_range"] == 0 and data_keys(store.written_keys) == []


def test_manifest_summaries_are_read_once_then_served_locally(tmp_path):
    repo, store = counted_repo(str(tmp_path / "repo"))
    state = mixed_state()
    s1 = take(repo, "s1", state)
    state["t0"].add_(1.0)
    s2 = Snapshot.take(f"{repo.url}/s2", {"s": state}, **opts(repo), parents=[s1.manifest_hash])
    index.drop(repo.storage.config.repo_id)
    store.reset()
    hashes = [repo.resolve("s1"), repo.resolve("s2")]
    first = index.manifest_summaries(repo.storage, hashes)
    gets = store.requests["get"]
    parts = {p.hash for h in hashes for p in repo.storage.read_manifest(h).parts}
    assert parts  # the entries are long enough for parts (docs/format.md, "Manifest parts")
    assert gets == 2 + 2 + len(parts)  # two refs, two manifests, their parts
    store.reset()
    again = index.manifest_summaries(repo.storage, hashes)
    assert store.requests == {}, "no store request for a cached summary"
    for h, snap in zip(hashes, (s1, s2)):
        m = snap.manifest
        s = again[h]
        assert s.spans == first[h].spans
        assert s.stored_bytes == stored_bytes(m)
        assert s.logical_bytes == sum(c.size for c in m.chunk_refs())
        assert s.parents == tuple(m.parents) and s.created_at == m.created_at
    assert again[hashes[1]].parents == (hashes[0],)
    with pytest.raises(FileNotFoundError):
        index.manifest_summary(repo.storage, "0" * 64)
    assert index.manifest_summaries(
        repo.storage, [hashes[0], "0" * 64], missing_ok=True
    ).keys() == {hashes[0]}


def test_disabled_index_gives_the_same_summaries(tmp_path, monkeypatch):
    repo, _ = counted_repo(str(tmp_path / "repo"))
    take(repo, "s1", StateDict(step=3, w=torch.randn(10)))
    h = repo.resolve("s1")
    cached = index.manifest_summary(repo.storage, h)
    monkeypatch.setenv("CASNAP_INDEX", "off")
    direct = index.manifest_summary(repo.storage, h)
    assert direct.spans == cached.spans and direct.metadata == cached.metadata


def _take_in_child(root: str, index_dir: str, name: str, seed: int) -> None:
    os.environ["CASNAP_INDEX_DIR"] = index_dir
    repo = Repository(root)
    state = mixed_state(0)
    state["t1"].add_(seed)  # one tensor differs per process
    for i in range(3):
        Snapshot.take(f"{root}/{name}-{i}", {"s": state}, **opts(repo))


def test_two_processes_share_one_index(tmp_path):
    root = str(tmp_path / "repo")
    repo, store = counted_repo(root)
    take(repo, "base", mixed_state(0))
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=_take_in_child, args=(root, str(tmp_path / "index"), f"p{i}", i + 1))
        for i in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
    for i in range(2):
        state = mixed_state(0)
        state["t1"].add_(i + 1)
        assert_restores(repo, f"p{i}-2", state)
        store.reset()
        take(repo, f"again{i}", state)  # learned by the other process
        assert store.requests["get_range"] == 0


def _probes_in_forked_child(root: str, out: multiprocessing.Queue) -> None:
    repo, store = counted_repo(root)
    take(repo, "child", mixed_state())
    out.put(store.requests["get_range"])


def test_a_forked_child_opens_its_own_environment(tmp_path):
    root = str(tmp_path / "repo")
    repo, _ = counted_repo(root)
    take(repo, "s1", mixed_state())  # the parent has the index open
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_probes_in_forked_child, args=(root, out))
    child.start()
    probes = out.get(timeout=120)
    child.join(timeout=60)
    assert child.exitcode == 0 and probes == 0
    assert_restores(repo, "child", mixed_state())


@pytest.mark.gcs
def test_on_gcs_a_fresh_process_take_sends_no_probe(gcs_bucket, monkeypatch):  # noqa: F811
    url = f"gs://{gcs_bucket}/{uuid.uuid4().hex}/repo"
    store = CountingStore(FsspecStore(url))
    repo = Repository.on_store(store, chunk_size=CHUNK)
    state = mixed_state()
    s1 = take(repo, "s1", state)
    for enabled, probes in (("1", 0), ("0", len(loose_chunks(s1)))):
        monkeypatch.setenv("CASNAP_INDEX", enabled)
        store.reset()
        take(repo, f"s-{enabled}", state)
        assert store.requests["get_range"] == probes
    assert_restores(repo, "s-1", state)


def test_index_lives_where_configured(tmp_path):
    repo, _ = counted_repo(str(tmp_path / "repo"))
    take(repo, "s1", StateDict(w=torch.randn(10)))
    assert Path(index.index_path(repo.storage.config.repo_id)).parent == tmp_path / "index"
    assert (tmp_path / "index" / repo.storage.config.repo_id / "data.mdb").exists()
    # an id from an untrusted config never names another folder
    assert index.index_path("../../etc").parent == tmp_path / "index"


def test_an_index_folder_on_a_network_filesystem_is_not_used(tmp_path, monkeypatch):
    monkeypatch.setattr(lmdb_envs, "_filesystem_type", lambda path: "nfs4")
    repo, store = counted_repo(str(tmp_path / "repo"))
    state = mixed_state()
    s1 = take(repo, "s1", state)
    assert index.open_index(repo.storage) is None
    assert not (tmp_path / "index").exists()
    store.reset()
    take(repo, "s2", state)  # works, as without an index
    assert store.requests["get_range"] == len(loose_chunks(s1))


def test_a_sessions_summaries_reuse_unchanged_entries_and_equal_a_fresh_summary(
    tmp_path, monkeypatch
):
    """The summary a session's commit records reuses the work of the entry objects the
    previous take kept (SummaryMemo); what it records must equal a summary built from
    the manifest read back, for an unchanged re-take, a few changed tensors and a delta.
    An unchanged re-take (None below) walks no entry: it reuses the last summary whole."""
    from casnap.index import summaries

    repo, _ = counted_repo(str(tmp_path / "repo"))
    session = Session()
    state = mixed_state(0)
    steps = [
        lambda: state,
        None,
        lambda: state["t3"].add_(1.0),
        lambda: state["t0"][:50].mul_(2.0),
        None,
        lambda: state.update(extra=torch.ones(7)),
        None,
    ]
    for i, change in enumerate(steps):
        with monkeypatch.context() as m:
            if change is None:
                m.setattr(summaries, "_part", lambda e: pytest.fail("an entry was walked"))
            else:
                change()
            Snapshot.take(f"{repo.url}/s{i}", {"s": state}, **opts(repo), session=session)
    assert any(
        c.base is not None for c in repo.storage.read_manifest(repo.resolve("s3")).chunk_refs()
    )
    for i in range(len(steps)):
        h = repo.resolve(f"s{i}")
        recorded = index.manifest_summary(repo.storage, h)  # recorded at commit, with the memo
        fresh = index.summarize(h, repo.storage.read_manifest(h))
        assert (recorded.spans, recorded.logical_bytes, recorded.chunk_refs) == (
            fresh.spans,
            fresh.logical_bytes,
            fresh.chunk_refs,
        )
        assert recorded.stored_bytes == stored_bytes(repo.storage.read_manifest(h))


def test_a_sessions_unchanged_re_takes_gather_their_parents_chunks_once(tmp_path, monkeypatch):
    """casnap.take.reuse: a parent whose entries with chunks are the objects the
    session gathered last (an unchanged re-take's) is not walked again; a changed
    tensor (a new entry object) makes the next take gather again, and dedup holds."""
    repo, _ = counted_repo(str(tmp_path / "repo"))
    session = Session()
    state = mixed_state(0)
    walked = []
    real = index.parent_chunks

    def counted(manifest: Any, damaged: Any) -> Any:
        walked.append(manifest)
        return real(manifest, damaged)

    monkeypatch.setattr(index, "parent_chunks", counted)

    def take_stats_of(name: str) -> int:
        snap = Snapshot.take(f"{repo.url}/{name}", {"s": state}, **opts(repo), session=session)
        return take_stats(snap).chunks_written

    take_stats_of("s0")
    assert [take_stats_of(f"r{i}") for i in range(3)] == [0, 0, 0]
    assert len(walked) == 1  # r0's parent s0; r1 and r2 reuse it
    state["t3"].add_(1.0)
    assert take_stats_of("c") == 1
    assert take_stats_of("c2") == 0
    assert len(walked) == 2  # c's parent r2 has s0's entries (reused); c2's parent c: walked


def test_rebuild_never_records_a_delta_frame_as_a_whole_chunk(tmp_path):
    """A rebuilt index learns whole chunks only: a delta frame read without its base
    would give a later take a reference no read can serve."""
    repo, _ = counted_repo(str(tmp_path / "repo"))
    table = torch.randn(64, 4096, generator=torch.Generator().manual_seed(1))
    take(repo, "run/s1", StateDict(table=table))
    table[::50, :3] += 1.0  # a sparse change: every chunk of the table stored as a delta
    s2 = Snapshot.take(
        f"{repo.url}/run/s2",
        {"s": StateDict(table=table)},
        **opts(repo),
        parents=["run/s1"],
    )
    deltas = {c.hash for c in s2.manifest.chunk_refs() if c.base is not None}
    assert deltas, "the sparse change was not stored as deltas"
    index.drop(repo.storage.config.repo_id)
    index.rebuild(repo.storage)
    # A take elsewhere of the same state, with no parent: what the index vouches for it uses.
    take(repo, "other/s", StateDict(table=table))
    assert_restores(repo, "other/s", StateDict(table=table))


def test_parent_chunks_keeps_the_whole_copy_of_a_chunk_whose_other_copy_is_damaged():
    """A chunk stored twice (loose, and in a pack) with its packed copy recorded damaged:
    the parent's refs offer the loose copy, whichever key names it first or last, and
    each tensor's delta bases are its own chunk list."""
    from casnap.format.entries import ChunkRef, Entry, TensorEntry
    from casnap.format.manifest import Manifest
    from casnap.repo.damage import DamagedCopy, DamageSet

    h, pack = "a" * 64, "b" * 64
    loose = ChunkRef(hash=h, size=4096, length=4096 + 56)
    packed = ChunkRef(hash=h, size=4096, pack=pack, offset=0, length=4096 + 56)

    def entry(ref: ChunkRef) -> TensorEntry:
        return TensorEntry(dtype="float32", shape=[1024], chunk_size=4096, chunks=[ref])

    damaged = DamageSet([DamagedCopy(h, pack)])
    for order in ([loose, packed], [packed, loose]):
        entries: dict[str, Entry] = {f"0/t{i}": entry(r) for i, r in enumerate(order)}
        manifest = Manifest(created_at="t", entries=entries)
        refs, bases = index.parent_chunks(manifest, damaged)
        assert refs == {h: loose}
        assert {k: list(v[1]) for k, v in bases.items()} == {
            f"0/t{i}": [r] for i, r in enumerate(order)
        }
        assert index.parent_chunks(manifest, DamageSet())[0] == {h: order[-1]}
