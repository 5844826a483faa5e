"""A process for tests/test_dcp_fs.py: a save killed mid-way, a process-based async save.

``python dcp_fs_child.py kill ROOT``: saves ``ROOT/run/step_2`` through ``casnap://``
and stops just before the commit (after every chunk is written), writing
``ROOT/ready``; the test SIGKILLs it there.
``python dcp_fs_child.py async ROOT KIND``: ``dcp.async_save`` with
``AsyncCheckpointerType.PROCESS`` (a spawned daemon saves) by checkpoint id
(KIND ``fs``) or through ``CasnapWriter`` (KIND ``writer``), then loads the
result and checks it bit-exact; then a save that fails in the daemon, whose
error the future raises. Prints ``OK`` on success.
"""

from __future__ import annotations

import os
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
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from casnap.integrations import dcp_fs
from casnap.integrations.dcp import CasnapReader, CasnapWriter

warnings.filterwarnings("ignore")
fsspec.register_implementation("casnap", dcp_fs.CasnapFileSystem, clobber=True)


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
    assert isinstance(fut, Future)  # no async_stager given: a plain Future
    fut.result(timeout=120)


def run_async(root: Path, kind: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{root}/pg", rank=0, world_size=1)
    try:
        want = state(5)
        if kind == "fs":
            ckpt = f"casnap://{root}/run/step_5"
            fut = dcp.async_save(
                want, checkpoint_id=ckpt, async_checkpointer_type=AsyncCheckpointerType.PROCESS
            )
        else:
            ckpt = str(root / "run" / "step_5")
            fut = dcp.async_save(
                want,
                storage_writer=CasnapWriter(ckpt),
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            )
        _wait(fut)
        got = blank()
        if kind == "fs":
            dcp.load(got, checkpoint_id=ckpt)
        else:
            dcp.load(got, storage_reader=CasnapReader(ckpt))
        assert torch.equal(got["w"], want["w"]) and torch.equal(got["b"], want["b"])
        assert got["step"] == 5
        (root / "blocker").write_text("a file, not a folder")
        bad = root / "blocker" / "run" / "step_6"
        if kind == "fs":
            fut = dcp.async_save(
                want,
                checkpoint_id=f"casnap://{bad}",
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            )
        else:
            fut = dcp.async_save(
                want,
                storage_writer=CasnapWriter(bad),
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            )
        try:
            _wait(fut)
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
    else:
        run_async(where, sys.argv[3])
    sys.stdout.flush()
    os._exit(0)  # the checkpoint daemon goes with its parent
