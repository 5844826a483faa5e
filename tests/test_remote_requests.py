"""Requests a take sends to a GCS server (a real fake-gcs-server), counted per store operation."""

from __future__ import annotations

import uuid

import pytest
import torch
from gcs_server import gcs_bucket, gcs_server  # noqa: F401  (fixtures)
from helpers import random_tensors

from casnap import Repository, Session, Snapshot, StateDict
from casnap.store import CountingStore, FsspecStore

pytestmark = pytest.mark.gcs

CHUNK = 64 * 1024


# 8 loose chunks of 64 KiB in "w", and small tensors that are packed
SHAPES = {"w": 8 * CHUNK // 4, "b": 10}


def _chunk_reads(store: CountingStore) -> list[str]:
    return [k for k in store.read_keys if "/chunks/" in k or "/packs/" in k]


def test_first_take_into_a_new_repository_probes_for_nothing(gcs_bucket):  # noqa: F811
    url = f"gs://{gcs_bucket}/{uuid.uuid4().hex}/repo"
    store = CountingStore(FsspecStore(url))
    repo = Repository.on_store(store, chunk_size=CHUNK)  # created here: nothing stored yet
    state = random_tensors(SHAPES)
    store.reset()
    Snapshot.take(f"{url}/s1", {"m": StateDict(state)}, repository=repo)

    # Every loose chunk is put without a probe first, the name is not looked up
    # (the ref is written create-only anyway), and no damage record is listed.
    assert _chunk_reads(store) == []
    assert store.requests["exists"] == 0 and store.requests["list"] == 0
    chunk_puts = [k for k in store.written_keys if "/chunks/" in k]
    assert len(chunk_puts) == 8
    # Beyond the objects themselves (chunks, one pack, manifest, ref): the lease's
    # put and delete, and two small reads (gc lock, gc epoch).
    assert sum(store.requests.values()) == len(store.written_keys) + 1 + 2

    got = {k: torch.zeros_like(v) for k, v in state.items()}
    Snapshot(f"{url}/s1").restore({"m": StateDict(got)})
    assert all(torch.equal(got[k], state[k]) for k in state)


def test_later_takes_still_look_before_writing(gcs_bucket):  # noqa: F811
    """Only the take that found the repository new skips the look-ups."""
    url = f"gs://{gcs_bucket}/{uuid.uuid4().hex}/repo"
    store = CountingStore(FsspecStore(url))
    repo = Repository.on_store(store, chunk_size=CHUNK)
    state = random_tensors(SHAPES)
    opts = {"repository": repo}
    Snapshot.take(f"{url}/s1", {"m": StateDict(state)}, **opts)

    state["w"][: CHUNK // 4].add_(1.0)  # one new chunk; the index does not know it
    store.reset()
    Snapshot.take(f"{url}/s2", {"m": StateDict(state)}, **opts, session=Session())
    assert store.requests["exists"] == 1  # is the name free?
    assert len(_chunk_reads(store)) == 1  # the new chunk is probed before its put
    assert [k for k in store.written_keys if "/chunks/" in k] == [_chunk_reads(store)[0]]

    # A repository opened (not created) by this process: probes as before.
    reopened = Repository.on_store(CountingStore(FsspecStore(url)))
    assert reopened.storage.created is False


def test_maintenance_sends_no_request_per_chunk_object(gcs_bucket):  # noqa: F811
    """verify and gc list the chunks (a page per 1,000 objects, inside one list call)
    and read only refs, manifests and records; an unchanged re-take costs O(1)
    requests, not one per chunk. benchmarks/remote.py --chunks counts the pages."""
    url = f"gs://{gcs_bucket}/{uuid.uuid4().hex}/repo"
    store = CountingStore(FsspecStore(url))
    repo = Repository.on_store(store, chunk_size=4096)
    opts = {"repository": repo}
    state, session = {"m": StateDict(w=torch.randn(1200 * 1024))}, Session()
    Snapshot.take(f"{url}/s1", state, storage_options=opts, session=session)
    costs = {}
    for what, run in {
        "re-take": lambda: Snapshot.take(f"{url}/s2", state, storage_options=opts, session=session),
        "verify": lambda: repo.verify(),
        "gc": lambda: repo.gc(grace_seconds=0),
    }.items():
        store.reset()
        run()
        assert _chunk_reads(store) == [], what
        assert [k for k in store.written_keys if "/chunks/" in k] == [], what
        costs[what] = sum(store.requests.values())
    assert max(costs.values()) <= 30, costs  # 1,200 chunk objects
