"""The index never takes the process down (docs/index.md, "Failure is never the user's problem").

A full, read-only or damaged index filesystem means a take that runs without
the index, with one warning in the ``casnap.index`` logger, and a snapshot
that restores bit-exact. The repository itself is always healthy here.

Every take that could die of a signal runs in a child process, so a
regression (SIGBUS from LMDB's memory maps) fails the test instead of killing
pytest. The full and read-only cases need a small filesystem of their own
(a tmpfs, or a loop-mounted ext4): they mount it under ``tmp_path`` and skip
where this machine does not let the tests mount.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import lmdb
import pytest
import torch

from casnap import Repository, Snapshot, StateDict, index
from casnap.index import lmdb_files

CHUNK = 64 * 1024
TESTS = Path(__file__).parent
ROOT = TESTS.parent

# The child: takes ``takes`` snapshots of a state that changes one tensor each
# time, optionally filling the index filesystem after the first, and prints the
# store's probe count of its last take.
CHILD = textwrap.dedent(
    """
    import os, sys
    import helpers, torch
    from casnap import Snapshot, StateDict

    root, name, takes, fill = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    repo, store = helpers.counted_repo(root, {chunk})

    def state(i):
        g = torch.Generator().manual_seed(0)
        s = StateDict({{f"t{{k}}": torch.randn(40_000 if k % 5 == 0 else 300 + k, generator=g)
                        for k in range(50)}})
        s["t0"].add_(i)
        return s

    for i in range(takes):
        if i == 1 and fill != "-":
            with open(fill, "ab", buffering=0) as fh:  # the index filesystem fills up between takes
                for size in (4096, 512, 1):
                    try:
                        while True:
                            fh.write(bytes(size))
                    except OSError:
                        pass
        store.reset()
        Snapshot.take(f"{{root}}/{{name}}{{i}}", {{"s": state(i)}},
                      repository=repo, settings={{"chunk_size": {chunk}}})
    print("probes", store.requests.get("get_range", 0))
    """
).format(chunk=CHUNK)


def state(i: int) -> StateDict:
    g = torch.Generator().manual_seed(0)
    s = StateDict(
        {f"t{k}": torch.randn(40_000 if k % 5 == 0 else 300 + k, generator=g) for k in range(50)}
    )
    s["t0"].add_(i)
    return s


def run_takes(
    root: Path, index_dir: Path, name: str = "s", takes: int = 3, fill: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Snapshots ``name0``, ``name1``, ... taken by a child process (state ``i`` in ``name{i}``)."""
    env = dict(
        os.environ,
        CASNAP_INDEX_DIR=str(index_dir),
        PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS)]),
    )
    env.pop("CASNAP_INDEX", None)
    args = [sys.executable, "-c", CHILD, str(root), name, str(takes), str(fill or "-")]
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)


def assert_survived(proc: subprocess.CompletedProcess[str], warnings: int | None = 1) -> int:
    """The child exited normally with ``warnings`` index warnings; its last take's probes."""
    if proc.returncode < 0:
        pytest.fail(f"the take died of {signal.Signals(-proc.returncode).name}:\n{proc.stderr}")
    assert proc.returncode == 0, proc.stderr
    said = [line for line in proc.stderr.splitlines() if line.startswith("casnap index")]
    if warnings is not None:
        assert len(said) == warnings, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    return int(proc.stdout.split()[-1])


def assert_restores(root: Path, name: str = "s", takes: int = 3) -> None:
    repo = Repository(str(root))
    for i in range(takes):
        want = state(i)
        got = StateDict({k: torch.empty_like(v) for k, v in want.items()})
        Snapshot(f"{root}/{name}{i}", repository=repo).restore({"s": got})
        assert all(torch.equal(got[k], want[k]) for k in want)


def new_repo(root: Path) -> Path:
    """A repository at ``root``; the path of its index folder."""
    repo = Repository.init(str(root), chunk_size=CHUNK)
    return index.index_path(repo.storage.config.repo_id)


# -- small filesystems ---------------------------------------------------------


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def _mount(kind: str, where: Path, work: Path) -> str | None:
    """Mount a 1-4 MiB filesystem of ``kind`` at ``where``; why not, if it cannot."""
    if shutil.which("mount") is None or shutil.which("umount") is None:
        return "no mount command"
    if kind == "tmpfs":
        args = ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0755", "tmpfs", str(where)]
    else:
        if shutil.which("mkfs.ext4") is None:
            return "no mkfs.ext4"
        image = work / "ext4.img"
        with open(image, "wb") as fh:
            fh.truncate(4 << 20)
        made = _run("mkfs.ext4", "-q", "-F", "-m", "0", str(image))
        if made.returncode:
            return f"mkfs.ext4 failed: {made.stderr.strip()}"
        args = ["mount", "-o", "loop", str(image), str(where)]
    done = _run(*args)
    return None if done.returncode == 0 else f"cannot mount {kind} here: {done.stderr.strip()}"


def _fill(folder: Path) -> None:
    """Write a file until the filesystem holding ``folder`` has no block left."""
    with open(folder / "filler", "ab", buffering=0) as fh:
        for size in (4096, 512, 1):
            try:
                while True:
                    fh.write(bytes(size))
            except OSError:
                pass
    left = os.statvfs(folder)
    assert left.f_bavail * left.f_frsize < 4096, "not even one page is left"


@pytest.fixture(params=["tmpfs", "ext4"])
def small_fs(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """A tiny filesystem of its own, mounted under tmp_path (skips where mounting is refused)."""
    where = tmp_path / "small-fs"
    where.mkdir()
    why = _mount(request.param, where, tmp_path)
    if why is not None:
        pytest.skip(why)
    try:
        yield where
    finally:
        if _run("umount", str(where)).returncode:
            _run("umount", "-l", str(where))


def remount_read_only(where: Path) -> None:
    done = _run("mount", "-o", "remount,ro", str(where))
    if done.returncode:
        pytest.skip(f"cannot remount read-only here: {done.stderr.strip()}")


# -- a full index filesystem ----------------------------------------------------


def test_a_take_on_a_full_index_filesystem_runs_without_the_index(small_fs, tmp_path, monkeypatch):
    """The case that died of SIGBUS: LMDB's lock file mapped over blocks the disk cannot give."""
    root, index_dir = tmp_path / "repo", small_fs / "index"
    monkeypatch.setenv("CASNAP_INDEX_DIR", str(index_dir))
    new_repo(root).mkdir(parents=True)  # the folders exist; no block is left for files
    _fill(small_fs)
    proc = run_takes(root, index_dir)
    assert_survived(proc)
    assert_restores(root)


def test_an_index_filesystem_that_fills_up_between_takes(small_fs, tmp_path):
    root = tmp_path / "repo"
    new_repo(root)
    proc = run_takes(root, small_fs / "index", fill=small_fs / "filler")
    assert_survived(proc)
    assert_restores(root)


def test_an_index_that_fits_still_serves_on_a_small_filesystem(small_fs, tmp_path):
    """The control: the reservation costs a few KiB, and a take that fits probes nothing."""
    root = tmp_path / "repo"
    new_repo(root)
    assert_survived(run_takes(root, small_fs / "index", name="a", takes=1), warnings=0)
    probes = assert_survived(run_takes(root, small_fs / "index", takes=1), warnings=0)
    assert probes == 0


# -- a read-only index filesystem -------------------------------------------------


def test_an_existing_index_on_a_read_only_filesystem(small_fs, tmp_path):
    root = tmp_path / "repo"
    new_repo(root)
    assert_survived(run_takes(root, small_fs / "index", name="a", takes=1), warnings=0)
    remount_read_only(small_fs)
    proc = run_takes(root, small_fs / "index")
    assert_survived(proc)
    assert_restores(root)


def test_an_empty_read_only_index_filesystem(small_fs, tmp_path):
    root = tmp_path / "repo"
    new_repo(root)
    remount_read_only(small_fs)
    assert_survived(run_takes(root, small_fs / "index"))
    assert_restores(root)


# -- a damaged index (no mount needed) ------------------------------------------------


@pytest.fixture(scope="module")
def one_take(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A repository with snapshot ``a0`` and its index, taken by a child: built once."""
    base = tmp_path_factory.mktemp("one-take")
    with pytest.MonkeyPatch.context() as mp:  # Repository.init's own index state: in base too
        mp.setenv("CASNAP_INDEX_DIR", str(base / "init-index"))
        new_repo(base / "repo")
    assert_survived(run_takes(base / "repo", base / "index", name="a", takes=1), warnings=0)
    return base


def copy_of(one_take: Path, tmp_path: Path) -> tuple[Path, Path]:
    """This test's own copy of ``one_take``'s repository and index (the same repository id)."""
    root, index_dir = tmp_path / "repo", tmp_path / "index"
    shutil.copytree(one_take / "repo", root)
    shutil.copytree(one_take / "index", index_dir)
    return root, index_dir


def test_a_truncated_index_file_is_rebuilt(tmp_path, one_take):
    """A data.mdb shorter than the database it describes faults on read: it is rebuilt."""
    root, index_dir = copy_of(one_take, tmp_path)
    (data,) = index_dir.glob("*/data.mdb")
    os.truncate(data, data.stat().st_size // 2)
    probes = assert_survived(run_takes(root, index_dir, takes=2))
    # Only the changed tensor's chunks are probed (absent): the rest of the
    # 10 multi-chunk tensors' loose chunks come from the rebuilt index.
    assert probes < 10, "the rebuilt index serves the second take"
    assert_restores(root, takes=2)


@pytest.mark.parametrize("damage", ["garbage", "empty", "folder"])
def test_a_damaged_lock_file(tmp_path, one_take, damage):
    root, index_dir = copy_of(one_take, tmp_path)
    (lock,) = index_dir.glob("*/lock.mdb")
    if damage == "garbage":
        lock.write_bytes(os.urandom(lock.stat().st_size))
    elif damage == "empty":
        lock.write_bytes(b"")
    else:
        lock.unlink()
        lock.mkdir()
    assert_survived(run_takes(root, index_dir), warnings=None if damage != "folder" else 1)
    assert_restores(root)


def test_one_warning_per_process_then_silence(tmp_path, caplog, monkeypatch):
    """In process: an index that cannot be opened is reported once, not once per take."""
    root = tmp_path / "repo"
    folder = new_repo(root)
    folder.mkdir(parents=True)
    (folder / "lock.mdb").mkdir()  # never openable
    repo = Repository(str(root))
    with caplog.at_level("WARNING", logger="casnap.index"):
        for i in range(3):
            Snapshot.take(f"{root}/s{i}", {"s": state(i)}, repository=repo)
    assert len([r for r in caplog.records if r.name == "casnap.index"]) == 1
    assert_restores(root)
    index.close_all()  # forgets that it gave up: the next use tries again
    (folder / "lock.mdb").rmdir()
    assert index.open_index(repo.storage) is not None


def test_the_lock_file_reservation_is_lmdbs_own_size(tmp_path):
    """LMDB sizes its lock file from max_readers; the reservation must not change that size."""
    env = lmdb.open(str(tmp_path), max_readers=lmdb_files.MAX_READERS, lock=True)
    env.close()
    assert (tmp_path / "lock.mdb").stat().st_size == lmdb_files.LOCK_BYTES
