"""Nothing lost when processes share, fork and exit (issue #40).

Two takes through one ``Repository`` (one store): a take returns only once its
chunks are in place and durable, whichever take's flush synced them, and a
chunk that failed in another take's flush fails its own take. A forked child
never releases its parent's lease, never hangs in ``os.fork()`` on an index
environment a parent thread was using, and can take into the same repository.
A script that ends with an async take pending gets its snapshot.

The fork and exit cases run in a child Python with a timeout, so that a hang
is a failure, not a stuck suite.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from casnap import Repository, Snapshot, StateDict
from casnap.errors import StoreError
from casnap.store import LocalStore, local_sync

ROOT = Path(__file__).resolve().parents[1]
fork_only = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


def _run(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh Python; a hang past ``timeout`` fails the test."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        return subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code), *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"hung for {timeout} s; output so far:\n{exc.stdout!r}\n{exc.stderr!r}")


# -- one store, several takes -------------------------------------------------------------


def test_a_flush_returns_only_once_the_files_another_flush_took_are_in_place(tmp_path, monkeypatch):
    """Take B's flush, finding its files taken by take A's flush, waits for A's to end."""
    store = LocalStore(str(tmp_path))
    with store.deferring():
        store.put("chunks/b", b"b's chunk", durable=False)  # B's, queued on the shared store
    inside, release = threading.Event(), threading.Event()
    real = local_sync._fsync

    def slow_fsync(fd: int) -> None:
        inside.set()
        release.wait(30)
        real(fd)

    monkeypatch.setattr(local_sync, "_fsync", slow_fsync)
    first = threading.Thread(target=store.flush)  # A's flush takes B's file along
    first.start()
    assert inside.wait(30)
    seen: list[bool] = []

    def flush_then_look() -> None:
        store.flush()
        seen.append(store.exists("chunks/b"))

    second = threading.Thread(target=flush_then_look)
    second.start()
    second.join(0.5)
    release.set()
    first.join(30)
    second.join(30)
    assert seen == [True]  # when B's flush returned, B's chunk was in place


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names a file by its fd")
def test_a_file_that_failed_in_another_flush_fails_its_owner(tmp_path, monkeypatch):
    store = LocalStore(str(tmp_path))
    mine, theirs = store.deferral(), store.deferral()
    with store.deferring(mine):
        store.put("chunks/m", b"mine", durable=False)
    with store.deferring(theirs):
        store.put("chunks/t", b"theirs", durable=False)
    real = local_sync._fsync

    def fail_mine(fd: int) -> None:  # the disk fails the owner's file only
        if "/chunks/m" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EIO, "Input/output error")
        real(fd)

    monkeypatch.setattr(local_sync, "_fsync", fail_mine)
    with pytest.raises(StoreError):
        store.flush()  # the other take's flush settles both files, and fails
    monkeypatch.setattr(local_sync, "_fsync", real)
    store.flush()  # the owner's own flush finds nothing left to settle...
    with pytest.raises(StoreError, match="Input/output error"):
        mine.check()  # ...but hears of its file's failure, as the store's error
    theirs.check()
    assert not store.exists("chunks/m") and store.get("chunks/t") == b"theirs"


def test_takes_through_one_repository_from_several_threads_are_whole_when_they_return(
    tmp_path, monkeypatch
):
    """The user-visible case: every take, the moment it returns, restores bit-exact."""
    real = local_sync._fsync
    monkeypatch.setattr(local_sync, "_fsync", lambda fd: (threading.Event().wait(0.005), real(fd)))
    repo = Repository.init(str(tmp_path / "repo"), chunk_size=64 << 10)
    failures: list[str] = []

    def taker(tag: str, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for i in range(6):
            w = torch.randn(96 << 10, generator=g)  # 6 chunks of new bytes each time
            path = f"{repo.url}/{tag}/s{i}"
            Snapshot.take(path, {"m": StateDict(w=w)}, repository=repo)
            out = StateDict(w=torch.empty_like(w))
            try:
                Snapshot(path, repository=repo).restore({"m": out})
            except Exception as exc:  # noqa: BLE001 - the finding
                failures.append(f"{path}: {type(exc).__name__}: {exc}")
                continue
            if not torch.equal(out["w"], w):
                failures.append(f"{path}: other bytes")

    threads = [threading.Thread(target=taker, args=(t, n)) for n, t in enumerate("ABC")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    assert len(repo.snapshots()) == 18 and repo.verify().ok


# -- fork ----------------------------------------------------------------------------------

_FORK_DURING_DCP_SAVE = """
    import glob, os, sys, threading, time
    import torch
    import torch.distributed.checkpoint as dcp
    import casnap
    from casnap.integrations.dcp import CasnapWriter, CasnapReader
    from casnap.store import local_sync

    root, how = sys.argv[1], sys.argv[2]
    real, gate = local_sync._fsync, threading.Event()
    local_sync._fsync = lambda fd: (gate.wait(60), real(fd))[1]  # the save lasts past the fork
    state = {f"w{i}": torch.randn(64 << 10) for i in range(24)}
    save = threading.Thread(
        target=lambda: dcp.save(state, storage_writer=CasnapWriter(f"{root}/ck1"), no_dist=True)
    )
    save.start()
    leases = lambda: glob.glob(f"{root}/.casnap/leases/*")
    while not leases() and save.is_alive():
        time.sleep(0.001)
    held = leases()
    pid = os.fork()
    if pid == 0:
        if how == "exit":
            sys.exit(0)  # finalizers and atexit handlers run
        os._exit(0)
    os.waitpid(pid, 0)
    after, alive = leases(), save.is_alive()
    gate.set()
    casnap.Repository(root).gc(grace_seconds=0)  # beside the save: must spare what it writes
    save.join()
    target = {k: torch.empty_like(v) for k, v in state.items()}
    dcp.load(target, storage_reader=CasnapReader(f"{root}/ck1"), no_dist=True)
    same = all(torch.equal(target[k], state[k]) for k in state)
    print("held", len(held), "after", len(after), "alive", alive, "same", same,
          "verify", casnap.Repository(root).verify().ok)
"""


@fork_only
@pytest.mark.parametrize("how", ["exit", "_exit"])
def test_a_forked_child_exiting_leaves_the_parents_lease_and_save_alone(tmp_path, how):
    out = _run(_FORK_DURING_DCP_SAVE, str(tmp_path / "repo"), how)
    assert out.returncode == 0, out.stderr
    assert "held 1 after 1 alive True same True verify True" in out.stdout, out.stdout + out.stderr


_FORK_INSIDE_AN_INDEX_WRITE = """
    import os, sys, threading, time
    import torch
    import casnap
    from casnap import Snapshot, StateDict
    from casnap.index import lmdb_store

    root, child_takes = sys.argv[1], sys.argv[2] == "take"
    repo = casnap.Repository.init(root)
    Snapshot.take(f"{root}/s1", {"m": StateDict(w=torch.randn(1 << 16))})  # the index is open
    inside, forked = threading.Event(), threading.Event()
    real = lmdb_store._seal

    def sealing(key, body):  # called inside the index's write transaction
        if not inside.is_set():
            inside.set()
            forked.wait(30)
        return real(key, body)

    lmdb_store._seal = sealing
    take = threading.Thread(
        target=lambda: Snapshot.take(f"{root}/s2", {"m": StateDict(w=torch.randn(1 << 16))})
    )
    take.start()
    assert inside.wait(30)
    pid = os.fork()  # a parent thread is inside a write transaction of the index
    if pid == 0:
        if child_takes:
            w = torch.full((1 << 16,), 7.0)
            Snapshot.take(f"{root}/child", {"m": StateDict(w=w)})
            out = StateDict(w=torch.empty_like(w))
            Snapshot(f"{root}/child").restore({"m": out})
            sys.exit(0 if torch.equal(out["w"], w) else 3)
        os._exit(0)
    forked.set()
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            print("child hung in fork")
            sys.exit(1)
        time.sleep(0.05)
    take.join()
    print("child exit", os.waitstatus_to_exitcode(status), "refs", sorted(repo.snapshots()),
          "verify", repo.verify().ok)
"""


@fork_only
@pytest.mark.parametrize("child", ["nothing", "take"])
def test_a_fork_while_a_thread_writes_the_index_neither_hangs_nor_loses(tmp_path, child):
    out = _run(_FORK_INSIDE_AN_INDEX_WRITE, str(tmp_path / "repo"), child)
    assert out.returncode == 0, out.stdout + out.stderr
    refs = "['child', 's1', 's2']" if child == "take" else "['s1', 's2']"
    assert f"child exit 0 refs {refs} verify True" in out.stdout, out.stdout + out.stderr


_FORK_WHILE_STAGED = """
    import os, sys, threading
    import torch
    import casnap
    from casnap import Snapshot, StateDict
    from casnap.store import local_sync
    from casnap.take.session import SHARED_STAGING

    root = sys.argv[1]
    torch.set_num_threads(1)  # no OpenMP team in the parent: a forked child would hang in it
    casnap.Repository.init(root)
    real, gate = local_sync._fsync, threading.Event()
    local_sync._fsync = lambda fd: (gate.wait(60), real(fd))[1]  # the write lasts past the fork
    w = torch.arange(1 << 18, dtype=torch.float32)
    pending = Snapshot.async_take(f"{root}/parent", {"m": StateDict(w=w)})  # no session
    held = SHARED_STAGING.pool().in_use_bytes
    pid = os.fork()  # the process's staging buffers are in use by the parent's write
    if pid == 0:
        local_sync._fsync = real
        pool = SHARED_STAGING.pool()
        fresh = pool.in_use_bytes == 0 and pool.allocated_bytes == 0
        v = torch.full((1 << 18,), 7.0)
        Snapshot.async_take(f"{root}/child", {"m": StateDict(w=v)}).wait()
        out = StateDict(w=torch.empty_like(v))
        Snapshot(f"{root}/child").restore({"m": out})
        os._exit(0 if fresh and pool.in_use_bytes == 0 and torch.equal(out["w"], v) else 3)
    _, status = os.waitpid(pid, 0)
    gate.set()
    pending.wait()
    out = StateDict(w=torch.empty_like(w))
    Snapshot(f"{root}/parent").restore({"m": out})
    print("held", held, "child exit", os.waitstatus_to_exitcode(status),
          "same", torch.equal(out["w"], w), "in use", SHARED_STAGING.pool().in_use_bytes,
          "refs", sorted(casnap.Repository(root).snapshots()),
          "verify", casnap.Repository(root).verify().ok)
"""


@fork_only
def test_a_child_forked_while_staged_buffers_are_in_use_starts_its_own_pool(tmp_path):
    out = _run(_FORK_WHILE_STAGED, str(tmp_path / "repo"))
    assert out.returncode == 0, out.stdout + out.stderr
    want = f"held {1 << 20} child exit 0 same True in use 0 refs ['child', 'parent'] verify True"
    assert want in out.stdout, out.stdout + out.stderr


# -- exit ----------------------------------------------------------------------------------

_EXIT_WITHOUT_WAIT = """
    import sys
    import torch
    import casnap
    from casnap import Checkpointer, Snapshot, StateDict

    root, how = sys.argv[1], sys.argv[2]
    w = torch.arange(3 << 18, dtype=torch.float32)
    if how == "snapshot":
        Snapshot.async_take(f"{root}/step_1", {"m": StateDict(w=w)})
    else:
        ckpt = Checkpointer(root, every_n_steps=10, async_take=True)
        for step in range(1, 31):
            w[step] += 1
            ckpt.maybe_take(step, {"m": StateDict(w=w)})
    print("returned", flush=True)
    # the script ends: no wait(), no close()
"""


@pytest.mark.parametrize("how", ["snapshot", "checkpointer"])
def test_a_script_ending_with_an_async_take_pending_keeps_its_snapshot(tmp_path, how):
    root = str(tmp_path / "repo")
    out = _run(_EXIT_WITHOUT_WAIT, root, how)
    assert out.returncode == 0, out.stderr
    assert "waiting for the async take of" in out.stderr  # said, naming the snapshot
    name = "step_1" if how == "snapshot" else "step_000000030"
    assert name in out.stderr
    repo = Repository(root)
    assert name in repo.snapshots()
    want = torch.arange(3 << 18, dtype=torch.float32)
    if how == "checkpointer":
        want[1:31] += 1
    got = StateDict(w=torch.empty_like(want))
    Snapshot(f"{root}/{name}").restore({"m": got})
    assert torch.equal(got["w"], want)


_EXIT_AFTER_A_FAILED_COMMIT = """
    import sys
    import torch
    from casnap import Snapshot, StateDict
    from casnap.store import local_sync

    def broken(fd):
        raise OSError(28, "No space left on device")

    local_sync._fsync = broken
    Snapshot.async_take(f"{sys.argv[1]}/step_1", {"m": StateDict(w=torch.randn(1 << 18))})
"""


def test_an_async_take_that_fails_unseen_is_named_at_exit(tmp_path):
    out = _run(_EXIT_AFTER_A_FAILED_COMMIT, str(tmp_path / "repo"))
    assert "the async take of" in out.stderr and "step_1 failed" in out.stderr, out.stderr
    assert "no space left on device" in out.stderr.lower()
