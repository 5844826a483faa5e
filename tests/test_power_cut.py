"""Power loss on a real ext4: every take reported taken survives the cut (issue #40).

A child process takes snapshots from two threads through one ``Repository``
(one store: their flushes share files) into a repository on an ext4 file
system on a loop device, and writes each snapshot's name to a log on another
file system once its take returned. At a random moment the file system's
journal is cut (``EXT4_IOC_SHUTDOWN`` with ``EXT4_GOING_FLAGS_NOLOGFLUSH``:
nothing more reaches the disk, as xfstests' shutdown tests do), the child is
killed, and the file system is mounted again (the journal replays). Every
snapshot in the log must restore bit-exact, and verify must pass.

Needs root, ``losetup`` and ``mkfs.ext4``; skipped otherwise.
"""

from __future__ import annotations

import fcntl
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from casnap import Repository, Snapshot, StateDict

ROOT = Path(__file__).resolve().parents[1]
EXT4_IOC_SHUTDOWN = 0x8004587D  # _IOR('X', 125, __u32)
EXT4_GOING_FLAGS_NOLOGFLUSH = 2  # the journal is not flushed: a power cut

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.geteuid() != 0 or not (shutil.which("losetup") and shutil.which("mkfs.ext4")),
        reason="needs root, losetup and mkfs.ext4 for an ext4 on a loop device",
    ),
]

_TAKER = """
    import os, sys, threading
    import torch
    from casnap import Repository, Snapshot, StateDict

    repo = Repository.init(sys.argv[1], chunk_size=256 << 10) if sys.argv[3] == "init" else (
        Repository(sys.argv[1]))
    log = open(sys.argv[2], "a")
    lock = threading.Lock()

    def state(name):
        g = torch.Generator().manual_seed(sum(map(ord, name)) * 7919 + len(name))
        return {"m": StateDict(w=torch.randn(1 << 19, generator=g), step=name)}

    def taker(tag):
        i = 0
        while True:
            name = f"{sys.argv[4]}{tag}{i}"
            Snapshot.take(f"{repo.url}/{name}", state(name), storage_options={"repository": repo})
            with lock:  # reported taken: on another file system, durable
                log.write(name + "\\n")
                log.flush()
                os.fsync(log.fileno())
            i += 1

    for tag in "AB":
        threading.Thread(target=taker, args=(tag,), daemon=True).start()
    threading.Event().wait()
"""


def _state(name: str) -> dict[str, StateDict]:
    g = torch.Generator().manual_seed(sum(map(ord, name)) * 7919 + len(name))
    return {"m": StateDict(w=torch.randn(1 << 19, generator=g), step=name)}


@pytest.fixture
def ext4(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """An ext4 on a loop device: (the image, the mount point); unmounted at the end."""
    image, mnt = tmp_path / "disk.img", tmp_path / "mnt"
    mnt.mkdir()
    with open(image, "wb") as fh:
        fh.truncate(384 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
    try:
        subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], check=True)
    except subprocess.CalledProcessError:
        pytest.skip("cannot mount a loop device here")
    try:
        yield image, mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def _cut(mnt: Path) -> None:
    """Cut the power: the file system stops, nothing of its journal not yet on disk gets
    there."""
    fd = os.open(mnt, os.O_RDONLY)
    try:
        fcntl.ioctl(fd, EXT4_IOC_SHUTDOWN, EXT4_GOING_FLAGS_NOLOGFLUSH.to_bytes(4, "little"))
    finally:
        os.close(fd)


def _returned(log: Path) -> list[str]:
    return log.read_text().split() if log.exists() else []


def test_every_take_that_returned_survives_a_power_cut(ext4, tmp_path):
    image, mnt = ext4
    repo_url, log = str(mnt / "repo"), tmp_path / "returned.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CASNAP_INDEX_DIR": str(mnt / "index")}
    rng = random.Random(40)
    cuts = 5
    for cut in range(cuts):
        before = len(_returned(log))
        child = subprocess.Popen(
            [
                sys.executable,
                "-c",
                textwrap.dedent(_TAKER),
                repo_url,
                str(log),
                "init" if cut == 0 else "open",
                f"c{cut}",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        want = before + rng.randint(2, 8)
        deadline = time.monotonic() + 120
        while len(_returned(log)) < want and child.poll() is None:
            assert time.monotonic() < deadline, "the takes made no progress"
            time.sleep(0.01)
        time.sleep(rng.random() * 0.3)  # a random moment: mid-take, mid-flush, mid-commit
        assert child.poll() is None, child.stdout.read().decode() if child.stdout else ""
        _cut(mnt)
        child.send_signal(signal.SIGKILL)
        child.wait(60)
        subprocess.run(["umount", str(mnt)], check=True)
        subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], check=True)  # replays
        repo = Repository(repo_url)
        present = set(repo.snapshots())
        taken = _returned(log)
        lost = [n for n in taken if n not in present]
        assert lost == [], f"cut {cut}: reported taken, gone after the cut: {lost}"
        for name in taken:
            want_state = _state(name)
            got = {"m": StateDict(w=torch.empty(1 << 19), step="")}
            Snapshot(f"{repo_url}/{name}").restore(got)
            assert torch.equal(got["m"]["w"], want_state["m"]["w"]), name
            assert got["m"]["step"] == name
        assert repo.verify().ok
    assert len(_returned(log)) >= 2 * cuts
