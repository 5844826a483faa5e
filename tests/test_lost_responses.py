"""Takes against a store that fails transiently or loses answers (docs/architecture.md, store).

A user meets this on a remote store: a request times out, or its write took
effect and only the answer was lost, and the client tries again.
"""

from __future__ import annotations

import pytest
import torch
from helpers import random_tensors

from casnap import Snapshot, SnapshotExistsError, StateDict
from casnap.errors import StoreError
from casnap.repo.repository import RepoStorage
from casnap.store import LocalStore, RetryingStore, RetryPolicy
from casnap.store.faults import FaultyStore


class _ClientRetriesInternally(LocalStore):
    """A ref create that lands, loses its answer, and is sent again by the client
    library itself (as gcsfs does), which then reports that the object exists."""

    def put(self, key, data, *, create_only=False, durable=True):
        super().put(key, data, create_only=create_only, durable=durable)
        if create_only and key.startswith(".casnap/refs/"):
            super().put(key, data, create_only=True, durable=durable)  # raises: it exists


SHAPES = {"w": 50_000, "b": 10}


def _take(repo: RepoStorage, name: str, state: StateDict) -> None:
    Snapshot.take(
        f"{repo.url}/{name}",
        {"m": state},
        settings={"chunk_size": 64 * 1024},
        repository=repo,
    )


def _restores(repo: RepoStorage, name: str, state: StateDict) -> bool:
    out = StateDict({k: torch.zeros_like(v) for k, v in state.items()})
    Snapshot(f"{repo.url}/{name}", repository=repo).restore({"m": out})
    return all(torch.equal(out[k], state[k]) for k in state)


def test_a_commit_whose_answer_was_lost_is_not_reported_as_a_conflict(tmp_path):
    repo = RepoStorage.on_store(_ClientRetriesInternally(str(tmp_path / "repo")))
    state = StateDict(random_tensors(SHAPES, 0))
    _take(repo, "step_1", state)  # was SnapshotExistsError for its own commit
    assert _restores(repo, "step_1", state)
    # A real conflict is still one: another take under the same name.
    with pytest.raises(SnapshotExistsError):
        _take(repo, "step_1", StateDict(random_tensors(SHAPES, 1)))
    assert _restores(repo, "step_1", state)


def _takes_that_succeed(store, n: int) -> tuple[int, int]:
    repo = RepoStorage.on_store(store)
    ok = 0
    for i in range(n):
        state = StateDict(random_tensors(SHAPES, i))
        try:
            _take(repo, f"step_{i}", state)
            ok += _restores(repo, f"step_{i}", state)
        except StoreError:
            continue
    return ok, n


def test_takes_survive_ten_percent_transient_faults_with_the_retry_wrapper(tmp_path):
    root = str(tmp_path / "repo")
    RepoStorage.on_store(LocalStore(root))
    faulty = FaultyStore(LocalStore(root), 0.10, seed=3)
    store = RetryingStore(faulty, RetryPolicy(retries=4, delay=0.0))
    ok, n = _takes_that_succeed(store, 12)
    assert faulty.faults > 10  # faults were injected, before and after calls took effect
    assert ok == n


def test_without_retries_the_same_faults_fail_takes(tmp_path):
    # The negative control of the test above: the faults are real.
    root = str(tmp_path / "repo")
    RepoStorage.on_store(LocalStore(root))
    ok, n = _takes_that_succeed(FaultyStore(LocalStore(root), 0.10, seed=3), 12)
    assert ok < n
