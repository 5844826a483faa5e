"""DeepSpeed on CPU for tests/test_deepspeed.py and benchmarks: a small engine, a few steps.

DeepSpeed runs here with its CPU accelerator (``DS_ACCELERATOR=cpu``) over the
gloo group the caller initialized; its shared-memory all-reduce, an op it
would compile at first use, is turned off (gloo does the all-reduce), so
nothing is built or downloaded.

``python deepspeed_helpers.py kill ROOT WHERE``: saves tag ``a`` through casnap,
then tag ``b``, stopping at WHERE (``ref``: every chunk written, the snapshot's
ref not yet; ``pointer``: the ref written, no pointer yet), writing
``ROOT/ready``; the test SIGKILLs it there.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def deepspeed_missing() -> str | None:
    try:
        import deepspeed  # noqa: F401
    except Exception as exc:  # not installed, or its CPU accelerator cannot start
        return f"deepspeed unavailable: {exc}"
    return None


def quiet(rank: int, world: int) -> None:
    """Environment DeepSpeed reads, its logger quiet, its compiled all-reduce off."""
    import logging

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)


def config(stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }


def engine(stage: int, seed: int, width: int = 32, layers: int = 2) -> Any:
    import deepspeed

    torch.manual_seed(seed)
    blocks = [torch.nn.Linear(width, width) for _ in range(layers)]
    model = torch.nn.Sequential(*blocks, torch.nn.Linear(width, 4))
    eng, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config(stage)
    )
    return eng


def train(eng: Any, steps: int, rank: int, start: int, width: int = 32) -> list[float]:
    """``steps`` steps on batches determined by (rank, step): the same on resume."""
    losses = []
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(1000 * rank + step)
        x = torch.randn(4, width, generator=g)
        loss = eng(x).square().mean()
        eng.backward(loss)
        eng.step()
        losses.append(loss.item())
    return losses


def params(eng: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in eng.module.state_dict().items()}


def kill(root: str, where: str) -> None:
    import torch.distributed as dist

    from casnap.integrations import deepspeed as casnap_ds
    from casnap.integrations.deepspeed import CasnapCheckpointEngine
    from casnap.repo.repository import RepoStorage

    init = os.path.join(root, "pg")
    dist.init_process_group(
        "gloo", init_method=f"file://{init}", rank=0, world_size=1, timeout=timedelta(seconds=60)
    )
    quiet(0, 1)
    eng = engine(2, seed=0)
    eng.checkpoint_engine = CasnapCheckpointEngine()
    train(eng, 2, 0, 0)
    eng.save_checkpoint(os.path.join(root, "ckpt"), tag="a")
    train(eng, 1, 0, 2)

    def stop(*args: Any, **kwargs: Any) -> None:
        with open(os.path.join(root, "ready"), "w") as f:
            f.write(where)
        time.sleep(600)

    if where == "ref":
        RepoStorage.write_ref = stop  # type: ignore[method-assign]
    else:
        casnap_ds.write_pointer = stop  # type: ignore[attr-defined]
    eng.save_checkpoint(os.path.join(root, "ckpt"), tag="b")


if __name__ == "__main__":
    if sys.argv[1] == "kill":
        kill(sys.argv[2], sys.argv[3])
