"""torchtitan through casnap when a save dies: SIGKILL mid-save, and a power cut.

``python tests/test_torchtitan_crash.py kill ROOT`` and ``... power MNT LOG WANT MODE``
are the processes these tests kill (tests/test_torchtitan.py has the job they run).
The power cut uses tests/test_power_cut.py's ext4 on a loop device (root only).
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torchtitan")

import casnap  # noqa: E402
from casnap.integrations.dcp import CasnapWriter  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from helpers import kill_when_ready  # noqa: E402
from test_cli_contract import casnap as run_cli  # noqa: E402
from test_power_cut import NO_FSYNC, _mount, _no_fsync, cut, ext4  # noqa: E402, F401  (ext4: the fixture)
from test_torchtitan import Job, same, verify_clean  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning"
)
CUT = "CUT"


# -- a save killed mid-way ---------------------------------------------------------
def _killed_child(root: Path) -> None:
    """Save steps 1 and 2, then start step 3 and stop after its chunks, before its ref."""
    dist.init_process_group("gloo", init_method=f"file://{root}/pg", rank=0, world_size=1)
    job = Job(root, async_mode="async")
    job.train(2)
    job.ckpt.maybe_wait_for_saving()
    torch.save(job.state()["model"], root / "at_2.pt")

    def stop(self, metadata, results):
        (root / "ready").write_text("x")
        time.sleep(600)

    CasnapWriter.finish = stop  # type: ignore[method-assign]
    job.train(1)
    time.sleep(600)


def test_a_killed_save_leaves_the_earlier_steps_and_no_latest_half(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    # killed with step 3's chunks written, its ref not
    kill_when_ready([sys.executable, __file__, "kill", str(tmp_path)], tmp_path / "ready", env)
    folder = tmp_path / "checkpoint"
    assert casnap.Repository(str(folder)).snapshots() == ["step-1", "step-2"]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg2", rank=0, world_size=1)
    try:
        job = Job(tmp_path, seed=8)
        assert job.ckpt._find_load_step() == 2
        assert job.ckpt.load() is True
        assert same(job.state()["model"], torch.load(tmp_path / "at_2.pt"))
        assert job.ckpt.load(step=1) is True
        job.ckpt.close()
    finally:
        dist.destroy_process_group()
    verify_clean(tmp_path, folder)


# -- a power cut -------------------------------------------------------------------
def _power_child(mnt: Path, log: Path, want: Path, mode: str) -> None:
    """Resume from what the folder holds, then train and save every step until killed;
    each step saved is logged (its model kept in ``want``, on another file system).
    ``after:N``: cut the power right after the N-th save of this process returned."""
    dist.init_process_group("gloo", init_method=f"file://{want}/pg-{os.getpid()}", rank=0,
                            world_size=1)  # fmt: skip
    if os.environ.get(NO_FSYNC):
        _no_fsync()
    job = Job(mnt, seed=os.getpid(), async_mode="async")
    job.ckpt.load()
    for n in range(1, 10_000):
        job.train(1, save=False)
        step = job.train_state.step
        torch.save(job.state()["model"], want / f"step-{step}.pt")
        job.ckpt.save(step)
        job.ckpt.maybe_wait_for_saving()
        with open(log, "a") as fh:
            fh.write(f"{step}\n")
        if mode == f"after:{n}":
            cut(mnt)
            with open(log, "a") as fh:
                fh.write(CUT + "\n")
            time.sleep(600)
        time.sleep(random.random() * 0.2)


def _lines(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def _saved(log: Path) -> list[int]:
    return [int(x) for x in _lines(log) if x != CUT]


class PowerCuts:
    """Training children saving into ``mnt/checkpoint``, cut, remounted and checked."""

    def __init__(self, image: Path, mnt: Path, tmp: Path, *, no_fsync: bool = False) -> None:
        self.image, self.mnt, self.tmp = image, mnt, tmp
        self.log, self.want = tmp / "saved.log", tmp / "want"
        self.want.mkdir()
        self.env = {
            **os.environ,
            "PYTHONPATH": str(HERE.parent),
            "CASNAP_INDEX_DIR": str(mnt / "index"),
            "CASNAP_STATE_DIR": str(mnt / "state"),
            **({NO_FSYNC: "1"} if no_fsync else {}),
        }
        self.checked = 0  # log lines checked after an earlier cut

    def power_cut(self, mode: str, rng: random.Random) -> None:
        """A child trains; the power is cut (``after:N``: by the child right after its
        N-th save returned; ``random``: by us while it saves); the file system remounted."""
        log, before = self.log, len(_saved(self.log))
        argv = [sys.executable, __file__, "power", str(self.mnt), str(log), str(self.want), mode]
        child = subprocess.Popen(argv, env=self.env)
        try:
            deadline = time.monotonic() + 180
            while len(_saved(log)) < before + 2 and CUT not in _lines(log):
                assert child.poll() is None, "the child died before its saves"
                assert time.monotonic() < deadline
                time.sleep(0.01)
            if mode == "random":
                time.sleep(rng.random() * 0.3)  # mid-save, mid-commit, or between saves
                cut(self.mnt)
            while mode != "random" and CUT not in _lines(log):
                assert child.poll() is None and time.monotonic() < deadline
                time.sleep(0.01)
        finally:
            child.kill()
            child.wait(60)
        log.write_text("".join(f"{s}\n" for s in _saved(log)))  # CUT: seen
        subprocess.run(["umount", str(self.mnt)], check=True)
        _mount(self.image, self.mnt)  # the journal replays

    def losses(self) -> list[str]:
        """What the cut lost of the steps saved: a missing step, one that loads wrong, a
        latest step that does not load, a problem verify finds."""
        saved, folder = _saved(self.log), self.mnt / "checkpoint"
        try:
            steps = set(casnap.Repository(str(folder)).snapshots())
        except Exception as exc:
            return [f"repository: {exc!r}"]
        lost = [f"step-{s}: gone" for s in saved if f"step-{s}" not in steps]
        pg = f"file://{self.tmp}/pg-{self.checked}"
        dist.init_process_group("gloo", init_method=pg, rank=0, world_size=1)
        try:
            job = Job(self.mnt, seed=99)
            latest = job.ckpt._find_load_step()
            for step in sorted({*saved[self.checked :], latest} - {-1}):
                try:
                    job.ckpt.load(step=step)
                except Exception as exc:
                    lost.append(f"step-{step}: {exc!r}")
                    continue
                kept = self.want / f"step-{step}.pt"
                if kept.exists() and not same(job.state()["model"], torch.load(kept)):
                    lost.append(f"step-{step}: loads, but differs")
            job.ckpt.close()
        finally:
            dist.destroy_process_group()
        self.checked = len(saved)
        code, out, err = run_cli(
            self.tmp,
            "verify",
            "--read-data",
            str(folder),
            env={"CASNAP_INDEX_DIR": self.env["CASNAP_INDEX_DIR"]},
        )
        return lost + ([f"verify: {out}{err}"] if code != 0 else [])


def power(test: Any) -> Any:
    """The marks of a power-cut test: slow, and root with a loop device."""
    test = pytest.mark.skipif(not shutil.which("losetup"), reason="needs losetup")(test)
    test = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount a loop device")(test)
    return pytest.mark.slow(test)


@power
def test_every_step_saved_survives_power_cuts_and_the_latest_is_whole(ext4, tmp_path):  # noqa: F811
    """A step is saved once ``save`` and ``maybe_wait_for_saving`` returned; the latest
    step (perhaps one whose commit reached the disk just before the cut) loads whole."""
    image, mnt = ext4
    cuts, rng = PowerCuts(image, mnt, tmp_path), random.Random(5)
    for mode in ("after:2", "random", "after:1", "random"):
        cuts.power_cut(mode, rng)
        assert cuts.losses() == [], mode
    assert len(_saved(cuts.log)) >= 7  # 2, at least 2, 1, at least 2


@power
def test_the_power_cut_check_fails_when_fsync_does_nothing(ext4, tmp_path):  # noqa: F811
    image, mnt = ext4
    cuts, rng = PowerCuts(image, mnt, tmp_path, no_fsync=True), random.Random(3)
    for _try in range(3):
        cuts.power_cut("after:2", rng)
        if cuts.losses():
            return
    pytest.fail("three power cuts with fsync a no-op lost nothing: the check cannot fail")


if __name__ == "__main__" and sys.argv[1:2] == ["kill"]:
    _killed_child(Path(sys.argv[2]))
elif __name__ == "__main__" and sys.argv[1:2] == ["power"]:
    _power_child(Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]), sys.argv[5])
