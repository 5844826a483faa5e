"""CasnapAccelerator under FSDP2 on 2 gloo CPU ranks (the real Accelerate 1.15).

Accelerate never selects FSDP on CPU by itself (accelerate_helpers.force_fsdp
says where and how the tests make it); its FSDP2 ``prepare`` then shards the
model with ``fully_shard`` and CasnapAccelerator saves the sharded models and
optimizers through casnap's DCP writer, as snapshot ``<folder>.fsdp``.
"""

from __future__ import annotations

import glob
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("torchdata")

from accelerate_helpers import params, reset, setup, train  # noqa: E402
from dist_harness import run_ranks, values  # noqa: E402

import casnap  # noqa: E402

pytestmark = pytest.mark.dist


def _env(rank: int, world: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ.update(LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")


def _chunks(root: str) -> set[str]:
    return set(glob.glob(os.path.join(root, ".casnap", "chunks", "**", "*"), recursive=True))


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _draws() -> tuple[Any, ...]:
    return (torch.rand(3), random.random(), float(np.random.rand()))


def _same_draws(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))


def _resume(rank: int, world: int, root: str) -> dict[str, Any]:
    """Save after 3 steps (twice, unchanged), train 4; a fresh run loads and trains the same 4
    (and its torch, Python and NumPy RNGs draw what the first run drew after the save)."""
    _env(rank, world)
    ckpts = os.path.join(root, "checkpoints")
    parts = setup(root, seed=0, fsdp=True, total_limit=2)
    kinds = (str(parts[0].distributed_type), type(parts[1]).__name__)
    shard = type(next(parts[1].parameters())).__name__
    _, it = train(parts, 3)
    parts[0].save_state()
    before = _chunks(ckpts)
    parts[0].save_state()  # unchanged: no chunk may be written
    parts[0].wait_for_everyone()
    resave_wrote = sorted(_chunks(ckpts) - before)
    draws = _draws()
    after, _ = train(parts, 4, it)
    want = params(parts[1])
    parts[0].save_state()  # checkpoint_0 rotates away (total_limit=2), its snapshots with it
    last = params(parts[1])

    fresh = setup(root, seed=1, fsdp=True, total_limit=2)
    fresh[0].load_state(os.path.join(ckpts, "checkpoint_1"))
    same_draws = _same_draws(draws, _draws())
    step, counter = fresh[0].step, fresh[5].n
    resumed, _ = train(fresh, 4)
    got = params(fresh[1])
    fresh[0].load_state()  # the newest: checkpoint_2
    newest = params(fresh[1])
    reset()
    return {
        "kinds": kinds,
        "shard": shard,
        "resave_wrote": resave_wrote,
        "same_losses": after == resumed,
        "same_params": _same(want, got),
        "newest": _same(last, newest),
        "same_draws": same_draws,
        "counter": counter,
        "step": step,
    }


def test_two_fsdp2_ranks_resume_bit_exact_with_total_limit(tmp_path):
    outs = values(run_ranks(2, _resume, str(tmp_path), timeout=600))
    for out in outs:
        assert out["kinds"] == ("DistributedType.FSDP", "FSDPSequential")
        assert out["shard"] == "DTensor"
        assert out["resave_wrote"] == []
        assert out["same_losses"] and out["same_params"] and out["newest"], out
        assert out["same_draws"], out
        assert (out["counter"], out["step"]) == (3, 0)
    ckpts = tmp_path / "checkpoints"
    repo = casnap.Repository(str(ckpts))
    assert sorted(repo.snapshots()) == [
        "checkpoint_1",
        "checkpoint_1.fsdp",
        "checkpoint_2",
        "checkpoint_2.fsdp",
    ]
    assert sorted(p.name for p in ckpts.iterdir()) == [".casnap", "checkpoint_1", "checkpoint_2"]
    assert os.listdir(ckpts / "checkpoint_2") == ["casnap.json"]
    keys = set(repo.snapshot("checkpoint_2").get_manifest())
    assert not any("/model_" in k or "/optimizer_" in k for k in keys)  # in the .fsdp one
    fsdp_keys = "\n".join(repo.snapshot("checkpoint_2.fsdp").get_manifest())
    assert "model_0" in fsdp_keys and "optimizer_0" in fsdp_keys
    assert repo.verify(read_data=True).ok


def _reshard(rank: int, world: int, root: str, stage: str) -> Any:
    """``save``: two ranks save after 3 steps; ``load``: a world of ``world`` ranks loads it."""
    _env(rank, world)
    if stage == "save":
        parts = setup(root, seed=0, fsdp=True)
        train(parts, 3)
        parts[0].save_state()
        out = params(parts[1])
    else:
        fresh = setup(root, seed=1, fsdp=True)
        fresh[0].load_state()
        out = params(fresh[1])
    reset()
    return out


def test_a_two_rank_fsdp2_save_loads_on_one_rank(tmp_path):
    want = values(run_ranks(2, _reshard, str(tmp_path), "save", timeout=600))[0]
    got = values(run_ranks(1, _reshard, str(tmp_path), "load", timeout=600))[0]
    assert _same(want, got)


def _plain(rank: int, world: int, root: str) -> bool:
    """Accelerate's own FSDP checkpoint (no pointer) still loads into a CasnapAccelerator."""
    _env(rank, world)
    parts = setup(root, seed=0, fsdp=True, plain=True)
    train(parts, 2)
    parts[0].save_state()
    want = params(parts[1])
    fresh = setup(root, seed=1, fsdp=True)
    fresh[0].load_state()
    got = params(fresh[1])
    reset()
    return _same(want, got)


def test_accelerates_own_fsdp2_checkpoint_still_loads(tmp_path):
    assert values(run_ranks(2, _plain, str(tmp_path), timeout=600)) == [True, True]
    assert "pytorch_model_fsdp_0" in os.listdir(Path(tmp_path) / "checkpoints" / "checkpoint_0")


def _resave(rank: int, world: int, root: str) -> bool:
    """Saving twice to one folder: the second snapshot and its shards replace the first."""
    _env(rank, world)
    parts = setup(os.path.join(root, "unused"), seed=0, fsdp=True)
    parts[0].project_configuration.automatic_checkpoint_naming = False
    folder = os.path.join(root, "run", "best")
    parts[0].save_state(folder)
    train(parts, 1)
    parts[0].save_state(folder)
    want = params(parts[1])
    fresh = setup(os.path.join(root, "unused"), seed=1, fsdp=True)
    fresh[0].project_configuration.automatic_checkpoint_naming = False
    fresh[0].load_state(folder)
    got = params(fresh[1])
    reset()
    return _same(want, got)


def test_saving_again_to_a_folder_replaces_its_fsdp2_snapshots(tmp_path):
    assert values(run_ranks(2, _resave, str(tmp_path), timeout=600)) == [True, True]
    repo = casnap.Repository(str(tmp_path / "run"))
    assert sorted(repo.snapshots()) == ["best@1", "best@1.fsdp"]


def _failed(rank: int, world: int, root: str) -> tuple[int, int]:
    """The second save fails in the DCP writer's commit: the first stays the one loaded."""
    from torch.distributed.checkpoint.api import CheckpointException

    from casnap.integrations.dcp import CasnapWriter

    _env(rank, world)
    parts = setup(root, seed=0, fsdp=True)
    _, it = train(parts, 3)
    parts[0].save_state()
    train(parts, 2, it)

    def fail(*args: Any, **kwargs: Any) -> None:
        raise OSError("injected: the store went away")

    CasnapWriter.finish = fail  # type: ignore[method-assign]
    with pytest.raises(CheckpointException) as failed:  # on every rank (a BaseException)
        parts[0].save_state()
    assert "injected" in repr(failed.value)
    fresh = setup(root, seed=1, fsdp=True)
    fresh[0].load_state()
    out = (fresh[5].n, len(train(fresh, 1)[0]))
    reset()
    return out


def test_a_failed_fsdp2_save_leaves_the_last_checkpoint_latest(tmp_path):
    assert values(run_ranks(2, _failed, str(tmp_path), timeout=600)) == [(3, 1), (3, 1)]
    ckpts = tmp_path / "checkpoints"
    assert not (ckpts / "checkpoint_1" / "casnap.json").exists()
    repo = casnap.Repository(str(ckpts))
    assert "checkpoint_1.fsdp" not in repo.snapshots()
    assert repo.verify(read_data=True).ok


def _ddp_then_fsdp(rank: int, world: int, root: str) -> str:
    """A checkpoint saved under DDP is refused, with a reason, by an FSDP2 load."""
    from casnap.errors import ConfigError

    _env(rank, world)
    setup(root, seed=0)[0].save_state()
    fresh = setup(root, seed=1, fsdp=True)
    with pytest.raises(ConfigError) as refused:
        fresh[0].load_state()
    reset()
    return str(refused.value)


def test_a_ddp_checkpoint_is_refused_by_an_fsdp2_load(tmp_path):
    for text in values(run_ranks(2, _ddp_then_fsdp, str(tmp_path), timeout=600)):
        assert "saved without FSDP" in text
