"""A process for tests/test_dcp_fs.py: a save killed mid-way, a process-based async save.

``python dcp_fs_child.py kill ROOT``: saves ``ROOT/run/step_2`` through ``casnap://``
and stops just before the commit (after every chunk is written), writing
``ROOT/ready``; the test SIGKILLs it there.
``python dcp_fs_child.py async ROOT KIND``: ``dcp.async_save`` with
``AsyncCheckpointerType.PROCESS`` (a spawned daemon saves) by checkpoint id
(KIND ``fs``) or through ``CasnapWriter`` (KIND ``writer``), then loads the
result and checks it bit-exact; then a save that fails in the daemon, whose
error the future raises. Prints ``OK`` on success.
``python dcp_fs_child.py async-pinned ROOT KIND``: a save as torchtitan's
``async_with_pinned_mem`` makes it, with DCP's ``DefaultStager`` (shared memory, async
staging; pinned memory and non-blocking copies where an accelerator is), the state
changed as soon as staging is done.
``python dcp_fs_child.py killdaemon ROOT KIND``: a process-based async save whose
daemon stops just before its commit (every chunk written) and is SIGKILLed there; the
future raises, and nothing of the save is visible.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import fsspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

import casnap
from casnap.integrations import dcp_fs
from casnap.integrations.dcp import CasnapReader, CasnapWriter

warnings.filterwarnings("ignore")
fsspec.register_implementation("casnap", dcp_fs.CasnapFileSystem, clobber=True)
STALL = "CASNAP_TEST_STALL_COMMIT"  # a folder: the daemon's commit stops there


def _stall(*args: Any, **kwargs: Any) -> None:
    """In place of the commit: say so (with this process's pid), then wait to be killed."""
    Path(os.environ[STALL], "ready").write_text(str(os.getpid()))
    time.sleep(600)


if os.environ.get(STALL):  # this module is imported again in DCP's spawned daemon
    setattr(dcp_fs.CasnapFileSystem, "_commit", _stall)  # noqa: B010  (mypy: a method)
    setattr(CasnapWriter, "_commit", _stall)  # noqa: B010


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(256, 64, generator=g), "b": torch.arange(17), "step": seed}


def blank() -> dict:
    return {"w": torch.zeros(256, 64), "b": torch.zeros(17, dtype=torch.int64), "step": -1}


def kill(root: Path) -> None:
    def stop(self, save):  # every chunk is written and flushed: the commit is next
        (root / "ready").write_text("x")
        time.sleep(600)

    setattr(dcp_fs.CasnapFileSystem, "_commit", stop)  # noqa: B010  (mypy: a method)
    dcp.save(state(2), checkpoint_id=f"casnap://{root}/run/step_2")


def _wait(fut: Any) -> None:
    if isinstance(fut, AsyncSaveResponse):  # an async_stager given
        fut.staging_completion.result(timeout=120)
        fut = fut.upload_completion
    assert isinstance(fut, Future)
    fut.result(timeout=120)


def _save(root: Path, kind: str, state: dict, step: int, **kwargs: Any) -> tuple[Any, str]:
    """``dcp.async_save`` of ``state`` as ``run/step_<step>``, in a spawned daemon."""
    kwargs["async_checkpointer_type"] = AsyncCheckpointerType.PROCESS
    if kind == "fs":
        ckpt = f"casnap://{root}/run/step_{step}"
        return dcp.async_save(state, checkpoint_id=ckpt, **kwargs), ckpt
    ckpt = str(root / "run" / f"step_{step}")
    return dcp.async_save(state, storage_writer=CasnapWriter(ckpt), **kwargs), ckpt


def _load(kind: str, ckpt: str) -> dict:
    got = blank()
    if kind == "fs":
        dcp.load(got, checkpoint_id=ckpt)
    else:
        dcp.load(got, storage_reader=CasnapReader(ckpt))
    return got


def _same(got: dict, want: dict) -> bool:
    return (
        torch.equal(got["w"], want["w"])
        and torch.equal(got["b"], want["b"])
        and got["step"] == want["step"]
    )


def _init(root: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{root}/pg", rank=0, world_size=1)


def run_pinned(root: Path, kind: str) -> None:
    """torchtitan's ``async_with_pinned_mem``: DefaultStager, then the daemon's save."""
    _init(root)
    device = torch.accelerator.is_available()  # DCP pins and copies non-blocking only there
    options = StagingOptions(
        use_pinned_memory=device,
        use_shared_memory=True,
        use_async_staging=True,
        use_non_blocking_copy=device,
    )
    stager = DefaultStager(options)
    try:
        live = state(7)
        want = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in live.items()}
        response, ckpt = _save(root, kind, live, 7, async_stager=stager)
        assert isinstance(response, AsyncSaveResponse)
        response.staging_completion.result(timeout=120)
        live["w"].add_(1.0)  # training goes on: the save holds the state as staged
        _wait(response)
        assert _same(_load(kind, ckpt), want), "the save is not the state at staging"
        print("OK")
    finally:
        stager.close()
        dist.destroy_process_group()


def run_killed_daemon(root: Path, kind: str) -> None:
    """The daemon dies (SIGKILL) just before its commit: the future raises, nothing shows."""
    _init(root)
    try:
        os.environ[STALL] = str(root)  # before the daemon is spawned: it inherits it
        fut, ckpt = _save(root, kind, state(9), 9)
        deadline = time.monotonic() + 120
        while not (root / "ready").exists():
            assert time.monotonic() < deadline, "the daemon never reached its commit"
            time.sleep(0.05)
        os.kill(int((root / "ready").read_text()), signal.SIGKILL)
        try:
            _wait(fut)
        except Exception as exc:  # DCP: "Checkpoint background process is dead"
            print("RAISED", type(exc).__name__)
        else:
            raise AssertionError("a save whose daemon was killed returned normally")
        print("SNAPSHOTS", " ".join(casnap.Repository(str(root / "run")).snapshots()))
        print("OK")
    finally:
        dist.destroy_process_group()


def run_async(root: Path, kind: str) -> None:
    _init(root)
    try:
        fut, ckpt = _save(root, kind, state(5), 5)
        _wait(fut)
        assert _same(_load(kind, ckpt), state(5))
        (root / "blocker").write_text("a file, not a folder")
        bad = root / "blocker"
        try:
            _wait(_save(bad, kind, state(5), 6)[0])
        except (Exception, CheckpointException) as exc:  # the daemon's, from the future
            causes = getattr(exc, "failures", {0: exc})
            kinds = [type(c[0] if isinstance(c, tuple) else c).__name__ for c in causes.values()]
            print("RAISED", type(exc).__name__, kinds)
        else:
            raise AssertionError("a save that failed in the daemon returned normally")
        print("OK")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    where = Path(sys.argv[2])
    if sys.argv[1] == "kill":
        kill(where)
    elif sys.argv[1] == "async-pinned":
        run_pinned(where, sys.argv[3])
    elif sys.argv[1] == "killdaemon":
        run_killed_daemon(where, sys.argv[3])
    else:
        run_async(where, sys.argv[3])
    sys.stdout.flush()
    os._exit(0)  # the checkpoint daemon goes with its parent
