"""casnap's CasnapAccelerator on the real Accelerate 1.15 (CPU; DDP over gloo).

A run saves mid-epoch with automatic checkpoint naming; a fresh accelerator
(another model init, other RNG) loads the newest checkpoint and its next
steps must match the original's bit for bit: model, AdamW, StepLR, the
stateful data loader's position, ``step`` and a registered object; the
torch, Python and NumPy RNGs draw what they would have drawn.
"""

from __future__ import annotations

import glob
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("torchdata")

from accelerate_helpers import params, reset, setup, train  # noqa: E402
from dist_harness import run_ranks, values  # noqa: E402
from helpers import kill_when_ready  # noqa: E402

import casnap  # noqa: E402

HERE = Path(__file__).parent


@pytest.fixture(autouse=True)
def _fresh_state():
    yield
    reset()


def _chunks(root: Path) -> set[str]:
    return set(glob.glob(str(root / ".casnap" / "chunks" / "**" / "*"), recursive=True))


def _draws() -> tuple[Any, ...]:
    return (torch.rand(3), random.random(), float(np.random.rand()))


def _resume(root: str) -> dict[str, Any]:
    """Save after 3 steps, train 4 more; a fresh accelerator loads and trains the same 4."""
    parts = setup(root, seed=0)
    _, it = train(parts, 3)
    parts[0].save_state()
    draws = _draws()
    after, _ = train(parts, 4, it)
    want = params(parts[1])

    fresh = setup(root, seed=1)
    fresh[0].load_state()
    same_draws = all(
        torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
        for a, b in zip(draws, _draws())
    )
    step, counter = fresh[0].step, fresh[5].n
    resumed, _ = train(fresh, 4)
    got = params(fresh[1])
    return {
        "same_losses": after == resumed,
        "same_params": all(torch.equal(want[k], got[k]) for k in want),
        "same_draws": same_draws,
        "counter": counter,
        "step": step,
    }


def test_load_state_resumes_bit_exact(tmp_path):
    out = _resume(str(tmp_path))
    assert out == {
        "same_losses": True,
        "same_params": True,
        "same_draws": True,
        "counter": 3,
        "step": 0,
    }
    ckpts = tmp_path / "checkpoints"
    assert casnap.Repository(str(ckpts)).snapshots() == ["checkpoint_0"]
    assert sorted(os.listdir(ckpts / "checkpoint_0")) == ["casnap.json"]
    assert casnap.Repository(str(ckpts)).verify(read_data=True).ok


def test_total_limit_rotates_snapshots_and_a_resave_writes_nothing(tmp_path):
    calls: list[str] = []
    parts = setup(str(tmp_path), seed=0, total_limit=2)
    acc = parts[0]
    acc.register_save_state_pre_hook(lambda models, weights, out: calls.append(f"save {out}"))
    acc.register_load_state_pre_hook(lambda models, out: calls.append(f"load {out}"))
    ckpts = tmp_path / "checkpoints"
    train(parts, 2)
    acc.save_state()
    before = _chunks(ckpts)
    acc.save_state()  # nothing changed since: no chunk may be written
    assert _chunks(ckpts) == before
    train(parts, 1)
    acc.save_state()  # checkpoint_0 is rotated away, its snapshot with it
    repo = casnap.Repository(str(ckpts))
    assert sorted(repo.snapshots()) == ["checkpoint_1", "checkpoint_2"]
    assert sorted(p.name for p in ckpts.iterdir()) == [".casnap", "checkpoint_1", "checkpoint_2"]
    acc.load_state()
    assert calls == [f"save {ckpts}/checkpoint_{i}" for i in range(3)] + [
        f"load {ckpts}/checkpoint_2"
    ]
    cli = "from casnap.cli import main; main()"
    verify = [sys.executable, "-c", cli, "verify", "--read-data", str(ckpts)]
    assert subprocess.run(verify, capture_output=True).returncode == 0


def test_saving_again_to_a_folder_replaces_its_snapshot(tmp_path):
    parts = setup(str(tmp_path / "unused"), seed=0)
    parts[0].project_configuration.automatic_checkpoint_naming = False
    folder = tmp_path / "run" / "best"
    parts[0].save_state(str(folder))
    train(parts, 1)
    parts[0].save_state(str(folder))
    want = params(parts[1])
    assert casnap.Repository(str(tmp_path / "run")).snapshots() == ["best@1"]
    fresh = setup(str(tmp_path / "unused"), seed=1)
    fresh[0].load_state(str(folder))
    assert all(torch.equal(want[k], v) for k, v in params(fresh[1]).items())


def test_a_plain_accelerate_checkpoint_still_loads(tmp_path):
    from accelerate import Accelerator

    reset()
    model = torch.nn.Linear(4, 2)
    plain = Accelerator(cpu=True)
    model = plain.prepare(model)
    plain.save_state(str(tmp_path / "plain"))
    want = params(model)
    reset()
    from casnap.integrations.accelerate import CasnapAccelerator

    acc = CasnapAccelerator(cpu=True)
    other = acc.prepare(torch.nn.Linear(4, 2))
    acc.load_state(str(tmp_path / "plain"))
    assert all(torch.equal(want[k], v) for k, v in params(other).items())


@pytest.mark.parametrize("where", ["ref", "pointer"])
def test_a_killed_save_leaves_the_last_checkpoint_latest(tmp_path, where):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), *sys.path]))
    argv = [sys.executable, str(HERE / "accelerate_helpers.py"), "kill", str(tmp_path), where]
    kill_when_ready(argv, tmp_path / "ready", env)
    ckpts = tmp_path / "checkpoints"
    assert (ckpts / "checkpoint_1").is_dir() and not any((ckpts / "checkpoint_1").iterdir())
    repo = casnap.Repository(str(ckpts))
    want = ["checkpoint_0"] if where == "ref" else ["checkpoint_0", "checkpoint_1"]
    assert sorted(repo.snapshots()) == want
    assert repo.verify(read_data=True).ok
    parts = setup(str(tmp_path), seed=4)
    parts[0].load_state()  # the newest complete checkpoint: checkpoint_0
    assert parts[5].n == 3


def _ddp(rank: int, world: int, root: str) -> dict[str, Any]:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ.update(LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    out = _resume(root)
    parts = setup(root, seed=5)
    out["ddp"] = type(parts[1]).__name__
    return out


@pytest.mark.dist
def test_two_ddp_ranks_resume_bit_exact(tmp_path):
    outs = values(run_ranks(2, _ddp, str(tmp_path), timeout=600))
    for out in outs:
        assert out["ddp"] == "DistributedDataParallel"
        assert out["same_losses"] and out["same_params"] and out["same_draws"], out
        assert out["counter"] == 3
    repo = casnap.Repository(str(tmp_path / "checkpoints"))
    snap = repo.snapshot("checkpoint_0")
    assert snap.metadata.world_size == 2
    keys = {k.split("/", 2)[0] + "/" + k.split("/", 2)[1] for k in snap.get_manifest()}
    assert {"1/rng", "1/numpy_rng", "1/accelerate"} <= keys
    assert not any(k.startswith("1/model_") for k in keys)  # the main process saves the model
    assert repo.verify(read_data=True).ok
