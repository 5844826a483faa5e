"""``log`` reads one small line per snapshot from the index, and says what reading
every span of every summary would say."""

from __future__ import annotations

import pytest
import torch

from casnap import Repository, Session, Snapshot, StateDict, index
from casnap.index import lmdb_store
from casnap.ops import history

CHUNK = 4096


@pytest.fixture(autouse=True)
def _private_index(tmp_path, monkeypatch):
    monkeypatch.setenv("CASNAP_INDEX_DIR", str(tmp_path / "index"))
    monkeypatch.delenv("CASNAP_INDEX", raising=False)
    yield
    index.close_all()


def _series(tmp_path, n: int = 6) -> Repository:
    """A chain through one Session, a fork off its middle, and one take without a parent."""
    repo = Repository.init(str(tmp_path / "repo"), chunk_size=CHUNK)
    opts = {"repository": repo}
    g = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(8 * CHUNK // 4, generator=g) for i in range(3)}
    state["small"] = torch.randn(10, generator=g)  # packed
    session = Session()
    for i in range(n):
        state[f"t{i % 3}"][: CHUNK // 4] += 1.0  # one chunk changes: a delta
        state["small"] += 1.0
        Snapshot.take(
            f"{repo.url}/s{i}",
            {"m": StateDict(state)},
            storage_options=opts,
            session=session,
            metadata={"step": i},
        )
    state["t1"][-10:] += 2.0
    Snapshot.take(f"{repo.url}/fork", {"m": StateDict(state)}, storage_options=opts, parents=["s2"])
    Snapshot.take(f"{repo.url}/alone", {"m": StateDict(state)}, storage_options=opts, parents=[])
    return repo


def _by_every_span(repo: Repository) -> dict[str, tuple[int, int]]:
    """(stored, new) bytes per snapshot, from every span of every summary."""
    heads = {n: repo.resolve(n) for n in repo.storage.list_snapshots()}
    sums = index.manifest_summaries(repo.storage, heads.values(), missing_ok=True)
    sums |= index.manifest_summaries(
        repo.storage, {p for s in sums.values() for p in s.parents}, missing_ok=True
    )
    seen: set = set()
    out = {}
    for name, h in sorted(heads.items(), key=lambda kv: sums[kv[1]].created_at):
        for p in sums[h].parents:
            seen |= sums[p].spans if p in sums else set()
        out[name] = (sums[h].stored_bytes, sum(x[2] for x in sums[h].spans - seen))
        seen |= sums[h].spans
    return out


def _log(repo: Repository) -> dict[str, tuple[int, int]]:
    return {line.name: (line.stored_bytes, line.new_bytes) for line in repo.log()}


def test_a_warm_log_reads_lines_only_and_agrees_with_every_span(tmp_path, monkeypatch):
    repo = _series(tmp_path)
    expected = _by_every_span(repo)
    assert sum(new for _, new in expected.values()) > 0
    decoded = []
    real = lmdb_store.decode_summary
    monkeypatch.setattr(lmdb_store, "decode_summary", lambda h, b: decoded.append(h) or real(h, b))
    assert _log(repo) == expected
    assert decoded == [], "a log of snapshots whose parents are listed read no whole summary"


def test_a_cold_index_and_none_at_all_give_the_same_log(tmp_path, monkeypatch):
    repo = _series(tmp_path)
    expected = _by_every_span(repo)
    index.drop(repo.storage.config.repo_id)
    assert _log(repo) == expected  # lines made from the store's manifests
    assert _log(repo) == expected  # and from the lines then cached
    monkeypatch.setenv("CASNAP_INDEX", "0")
    assert _log(repo) == expected


@pytest.mark.parametrize("gone", ["s0", "s3", "s5"])
def test_a_deleted_parent_leaves_the_log_right(tmp_path, gone):
    """A line is relative to its first parent: one whose parent is no longer listed
    (its ref deleted, its manifest kept or collected) is counted from every span."""
    repo = _series(tmp_path)
    repo.storage.delete_ref(gone)
    assert _log(repo) == _by_every_span(repo)
    repo.gc(grace_seconds=0)
    index.drop(repo.storage.config.repo_id)
    assert _log(repo) == _by_every_span(repo)


def test_log_lines_match_the_summaries(tmp_path):
    repo = _series(tmp_path)
    heads = [repo.resolve(n) for n in repo.storage.list_snapshots()]
    lines = index.summary_lines(repo.storage, heads)
    sums = index.manifest_summaries(repo.storage, heads)
    for h in heads:
        line, s = lines[h], sums[h]
        assert (line.stored_bytes, line.logical_bytes, line.parents) == (
            s.stored_bytes,
            s.logical_bytes,
            s.parents,
        )
        base = sums[line.base].spans if line.base is not None else frozenset()
        assert line.added == s.spans - base
    assert history.log(repo.storage)[0].step == 0


def _du_by_every_span(repo: Repository) -> dict[str, tuple[int, int, int]]:
    """(logical, stored, exclusive) per snapshot, from every span of every root."""
    roots = [(n, repo.resolve(n), True) for n in repo.storage.list_snapshots()]
    roots += [(f"tag:{t}", i.manifest, False) for t, i in repo.tags().items()]
    sums = index.manifest_summaries(repo.storage, [h for _, h, _ in roots])
    owners: dict[str, int] = {}
    for _, h, _ in roots:
        for obj in sums[h].object_extents():
            owners[obj] = owners.get(obj, 0) + 1
    sizes = {
        i.key.rpartition("/")[2]: i.size
        for kind in ("chunks", "packs")
        for i in repo.storage.store.list_info(kind)
    }
    return {
        n: (
            sums[h].logical_bytes,
            sums[h].stored_bytes,
            sum(sizes[o] for o in sums[h].object_extents() if owners[o] == 1),
        )
        for n, h, is_ref in roots
        if is_ref
    }


def _du(repo: Repository) -> dict[str, tuple[int, int, int]]:
    return {
        u.name: (u.logical_bytes, u.stored_bytes, u.exclusive_bytes) for u in repo.du().per_snapshot
    }


@pytest.mark.parametrize("gone", [None, "s0", "s3"])
def test_du_from_lines_agrees_with_every_span(tmp_path, gone):
    repo = _series(tmp_path)
    repo.tag("pin", "s4")  # a tag is a root too: what it reaches is freed by no deletion
    if gone is not None:
        repo.storage.delete_ref(gone)
    expected = _du_by_every_span(repo)
    assert any(excl for _, _, excl in expected.values())
    usage = repo.du()
    assert _du(repo) == expected
    assert usage.stored_bytes == sum(
        x[2]
        for x in set().union(
            *(
                s.spans
                for s in index.manifest_summaries(
                    repo.storage,
                    [repo.resolve(n) for n in repo.storage.list_snapshots()]
                    + [i.manifest for i in repo.tags().values()],
                ).values()
            )
        )
    )
    index.drop(repo.storage.config.repo_id)
    assert _du(repo) == expected
