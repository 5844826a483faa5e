"""Takes without a session stage into the process's pool (``casnap.take.session.SHARED_STAGING``):
reused from one take to the next, a buffer handed out again only once its take's write is
done, idle buffers bounded by ``CASNAP_STAGING_CACHE``. A forked child's pool starts empty:
tests/test_share_fork_exit.py."""

from __future__ import annotations

import threading

import pytest
import torch

from casnap import Repository, Snapshot, StateDict, settings
from casnap.store import local_sync
from casnap.take.session import SHARED_STAGING

MB = 1_000_000  # 250,000 float32


@pytest.fixture(autouse=True)
def _fresh_pool():
    SHARED_STAGING.clear()  # as in a new process
    yield
    SHARED_STAGING.clear()


def _restored(path: str) -> torch.Tensor:
    out = StateDict(w=torch.empty(250_000))
    Snapshot(path).restore({"m": out})
    return out["w"]


def test_a_loop_without_a_session_reuses_the_staging_buffers(tmp_path):
    root = tmp_path / "repo"
    state = StateDict(w=torch.randn(250_000))
    Snapshot.async_take(f"{root}/step_0", {"m": state}).wait()
    pool = SHARED_STAGING.pool()
    assert pool.allocated_bytes == MB and pool.idle_bytes == MB
    for step in (1, 2):  # torchsnapshot's loop: a new path every N steps
        state["w"].add_(1)
        Snapshot.async_take(f"{root}/step_{step}", {"m": state}).wait()
    assert SHARED_STAGING.pool() is pool
    assert pool.allocated_bytes == MB and pool.reused_bytes == 2 * MB  # nothing new
    assert torch.equal(_restored(f"{root}/step_2"), state["w"])


def test_a_buffer_is_handed_out_again_only_once_its_write_is_done(tmp_path, monkeypatch):
    root = tmp_path / "repo"
    Repository.init(str(root))
    real, gate = local_sync._fsync, threading.Event()
    monkeypatch.setattr(local_sync, "_fsync", lambda fd: (gate.wait(60), real(fd))[1])
    w = torch.randn(250_000)
    first = w.clone()
    a = Snapshot.async_take(f"{root}/a", {"m": StateDict(w=w)})  # its write waits at the gate
    w.add_(1)
    b = Snapshot.async_take(f"{root}/b", {"m": StateDict(w=w)})
    pool = SHARED_STAGING.pool()
    assert pool.in_use_bytes == 2 * MB and pool.allocated_bytes == 2 * MB  # a's not reused
    gate.set()
    a.wait()
    b.wait()
    assert pool.in_use_bytes == 0 and pool.idle_bytes == 2 * MB
    assert torch.equal(_restored(f"{root}/a"), first)
    assert torch.equal(_restored(f"{root}/b"), w)


def test_the_staging_cache_setting_bounds_the_idle_buffers(tmp_path):
    root = tmp_path / "repo"
    state = {"m": StateDict(w=torch.randn(250_000))}
    with settings.override(staging_cache=0):
        Snapshot.async_take(f"{root}/a", state).wait()
        assert SHARED_STAGING.pool().idle_bytes == 0  # none kept
    Snapshot.async_take(f"{root}/b", state).wait()
    assert SHARED_STAGING.pool().idle_bytes == MB  # unset: up to the memory budget
    with settings.override(staging_cache=MB // 2):
        assert SHARED_STAGING.pool().idle_bytes == 0  # lowered: dropped at the next take
