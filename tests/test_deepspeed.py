"""casnap's DeepSpeed checkpoint engine on the real DeepSpeed 0.19 (CPU accelerator, gloo).

Each case runs DeepSpeed in rank processes (``dist_harness.run_ranks``; a world
of one for the single-process cases): ``save_checkpoint`` through
``CasnapCheckpointEngine``, then a fresh engine's ``load_checkpoint`` from the
``latest`` file DeepSpeed wrote, whose continued training must match the
original bit for bit (model, ZeRO optimizer partitions, LR scheduler, step
counters: what DeepSpeed saves; it saves no RNG or data loader state).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from deepspeed_helpers import deepspeed_missing, engine, params, quiet, train
from dist_harness import run_ranks, values
from helpers import kill_when_ready

import casnap

pytestmark = pytest.mark.skipif(deepspeed_missing() is not None, reason=str(deepspeed_missing()))

HERE = Path(__file__).parent


def _chunk_files(root: str) -> set[str]:
    return set(glob.glob(os.path.join(root, ".casnap", "chunks", "**", "*"), recursive=True))


def _resume(rank: int, world: int, root: str, stage: int) -> dict[str, Any]:
    """Save after 3 steps, train 3 more; a fresh engine loads and trains the same 3."""
    from casnap.integrations.deepspeed import CasnapCheckpointEngine

    quiet(rank, world)
    ckpt = os.path.join(root, "ckpt")
    eng = engine(stage, seed=0)
    eng.checkpoint_engine = CasnapCheckpointEngine()
    train(eng, 3, rank, 0)
    eng.save_checkpoint(ckpt)
    torch.distributed.barrier()
    before = _chunk_files(ckpt)
    eng.save_checkpoint(ckpt, tag="again")  # nothing changed: no chunk may be written
    torch.distributed.barrier()
    unchanged_new = len(_chunk_files(ckpt) - before)
    eng.save_checkpoint(ckpt, tag="again")  # the same tag again: "again@1" (rank 0 picks it)
    sched = eng.lr_scheduler.state_dict()
    after = train(eng, 3, rank, 3)
    want = params(eng)

    fresh = engine(stage, seed=1)
    fresh.checkpoint_engine = CasnapCheckpointEngine()
    path, client = fresh.load_checkpoint(ckpt, tag="global_step3")
    loaded = {
        "global_steps": fresh.global_steps,
        "sched": fresh.lr_scheduler.state_dict() == sched,
    }
    resumed = train(fresh, 3, rank, 3)
    got = params(fresh)
    fresh2 = engine(stage, seed=2)
    fresh2.checkpoint_engine = CasnapCheckpointEngine()
    latest_path, _ = fresh2.load_checkpoint(ckpt)  # the tag in "latest": "again"
    return {
        "path": path,
        "latest_path": latest_path,
        "loaded": loaded,
        "same_losses": resumed == after,
        "same_params": all(torch.equal(want[k], got[k]) for k in want),
        "unchanged_new": unchanged_new,
        "client_keys": sorted(client or {}),
    }


def _check_resume(tmp_path: Path, outs: list[dict[str, Any]], world: int) -> None:
    ckpt = tmp_path / "ckpt"
    for out in outs:
        assert out["same_losses"] and out["same_params"], out
        assert out["loaded"] == {"global_steps": 3, "sched": True}
        assert out["unchanged_new"] == 0
        assert out["path"].endswith("global_step3/mp_rank_00_model_states.pt")
        assert out["latest_path"].endswith("again/mp_rank_00_model_states.pt")
    assert (ckpt / "latest").read_text() == "again"
    repo = casnap.Repository(str(ckpt))
    assert sorted(repo.snapshots()) == ["again@1", "global_step3"]
    files = sorted(p.name for p in (ckpt / "global_step3").iterdir())
    zero = [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world)]
    assert files == sorted(["mp_rank_00_model_states.pt", *zero])
    for f in files:  # each is a small pointer to the tag's snapshot
        doc = json.loads((ckpt / "global_step3" / f).read_text())
        assert doc["casnap"] == "deepspeed-checkpoint" and doc["snapshot"] == "global_step3"
    snap = repo.snapshot("global_step3")
    assert snap.metadata["step"] == 3 and snap.metadata.world_size == world
    assert repo.verify(read_data=True).ok


@pytest.mark.parametrize("stage", [1, 2])
def test_resume_is_bit_exact_and_a_resave_writes_nothing(tmp_path, stage):
    outs = values(run_ranks(1, _resume, str(tmp_path), stage, timeout=600))
    _check_resume(tmp_path, outs, 1)


@pytest.mark.dist
@pytest.mark.parametrize("stage", [1, 2])
def test_two_ranks_resume_bit_exact(tmp_path, stage):
    outs = values(run_ranks(2, _resume, str(tmp_path), stage, timeout=600))
    _check_resume(tmp_path, outs, 2)


def _retention(rank: int, world: int, root: str) -> list[list[str]]:
    import shutil

    from casnap.integrations.deepspeed import CasnapCheckpointEngine

    quiet(rank, world)
    ckpt = os.path.join(root, "ckpt")
    eng = engine(2, seed=0)
    eng.checkpoint_engine = CasnapCheckpointEngine(keep_last=2)
    seen = []
    for i in range(3):
        train(eng, 1, rank, i)
        eng.save_checkpoint(ckpt)
        seen.append(sorted(casnap.Repository(ckpt).snapshots()))
    eng.checkpoint_engine = CasnapCheckpointEngine()  # no keep_last: follows the folders
    shutil.rmtree(os.path.join(ckpt, "global_step2"))  # as a wrapper's rotation would
    eng.save_checkpoint(ckpt, tag="global_step3")  # the same tag again: global_step3@1
    seen.append(sorted(casnap.Repository(ckpt).snapshots()))
    fresh = engine(2, seed=1)
    fresh.checkpoint_engine = CasnapCheckpointEngine()
    fresh.load_checkpoint(ckpt)
    same = all(torch.equal(a, b) for a, b in zip(params(eng).values(), params(fresh).values()))
    seen.append([str(same)])
    return seen


def test_keep_last_and_removed_folders_retire_their_snapshots(tmp_path):
    (seen,) = values(run_ranks(1, _retention, str(tmp_path), timeout=600))
    assert seen[0] == ["global_step1"]
    assert seen[1] == ["global_step1", "global_step2"]
    assert seen[2] == ["global_step2", "global_step3"]
    assert seen[3] == ["global_step3@1"]
    assert seen[4] == ["True"]
    ckpt = tmp_path / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == [".casnap", "global_step3"]
    doc = json.loads((ckpt / "global_step3" / "mp_rank_00_model_states.pt").read_text())
    assert doc["snapshot"] == "global_step3@1"
    cli = "from casnap.cli import main; main()"
    verify = [sys.executable, "-c", cli, "verify", "--read-data", str(ckpt)]
    assert subprocess.run(verify, capture_output=True).returncode == 0


@pytest.mark.parametrize("where", ["ref", "pointer"])
def test_a_killed_save_leaves_the_last_checkpoint_as_latest(tmp_path, where):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), *sys.path]))
    argv = [sys.executable, str(HERE / "deepspeed_helpers.py"), "kill", str(tmp_path), where]
    kill_when_ready(argv, tmp_path / "ready", env)
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "latest").read_text() == "a"  # DeepSpeed would resume from "a"
    repo = casnap.Repository(str(ckpt))
    assert repo.snapshots() == (["a"] if where == "ref" else ["a", "b"])
    assert not any((ckpt / "b").iterdir())  # no pointer names a snapshot of "b"
    assert repo.verify(read_data=True).ok
    outs = values(run_ranks(1, _load_a, str(ckpt), timeout=600))
    assert outs == [True]


def _load_a(rank: int, world: int, ckpt: str) -> bool:
    from casnap.integrations.deepspeed import CasnapCheckpointEngine

    quiet(rank, world)
    eng = engine(2, seed=5)
    eng.checkpoint_engine = CasnapCheckpointEngine()
    path, _ = eng.load_checkpoint(ckpt)
    return path is not None and path.endswith("a/mp_rank_00_model_states.pt")
