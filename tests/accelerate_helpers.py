"""Accelerate on CPU for tests/test_accelerate.py and benchmarks: a small run to checkpoint.

``python accelerate_helpers.py kill ROOT WHERE``: ``save_state`` twice with
automatic naming; the second stops at WHERE (``ref``: every chunk written,
the snapshot's ref not yet; ``pointer``: the ref written, no pointer yet),
writing ``ROOT/ready``; the test SIGKILLs it there.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch


def reset() -> None:
    """Forget Accelerate's process-wide state (one Accelerator at a time in a process)."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


class Counter:
    """An object registered with ``register_for_checkpointing``."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = state["n"]


def force_fsdp(acc: Any) -> None:
    """Make Accelerate treat this CPU (gloo) run as FSDP, which it never selects on CPU.

    ``AcceleratorState.__init__`` (accelerate/state.py, 1.15.0, lines 986-1013)
    turns ``fsdp_plugin`` into ``DistributedType.FSDP`` only when the type is
    one of the accelerator kinds (MULTI_GPU, MULTI_NPU, ...); MULTI_CPU stays
    MULTI_CPU and the plugin is dropped. Set afterwards (in the shared state
    of both ``PartialState`` and ``AcceleratorState``), Accelerate's own FSDP2
    ``prepare`` (``fully_shard``) and ``save_state``/``load_state`` run on gloo.
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    PartialState().distributed_type = DistributedType.FSDP
    acc.state.distributed_type = DistributedType.FSDP
    acc.state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2)


def setup(
    root: str,
    seed: int,
    *,
    total_limit: int | None = None,
    width: int = 16,
    fsdp: bool = False,
    plain: bool = False,
) -> Any:
    """A CasnapAccelerator with a model, AdamW, a scheduler, a stateful data loader
    and a registered counter, all prepared.

    The loader does not shuffle and the model has no dropout: Accelerate's own
    ``save_state``/``load_state`` resume neither bit-exactly mid-epoch (a new
    iterator draws from the restored RNG; the shuffle order is not saved), and
    casnap's resume is Accelerate's, value for value. The RNG is checked apart.
    ``fsdp``: FSDP2 (:func:`force_fsdp`); ``plain``: Accelerate's own Accelerator.
    """
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration
    from torch.utils.data import DataLoader, TensorDataset

    from casnap.integrations.accelerate import CasnapAccelerator

    reset()
    config = ProjectConfiguration(root, automatic_checkpoint_naming=True, total_limit=total_limit)
    acc = (Accelerator if plain else CasnapAccelerator)(
        cpu=True,
        project_config=config,
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True),
    )
    if fsdp:
        force_fsdp(acc)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    g = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.randn(64, width, generator=g), torch.randn(64, 1, generator=g))
    loader = DataLoader(data, batch_size=4, shuffle=False)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    return acc, model, opt, loader, sched, counter


def train(parts: Any, steps: int, it: Any = None) -> tuple[list[float], Any]:
    """``steps`` steps from the loader's iterator ``it`` (a new one if None)."""
    acc, model, opt, loader, sched, counter = parts
    it = iter(loader) if it is None else it
    losses = []
    for _ in range(steps):
        x, y = next(it)
        loss = torch.nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        counter.n += 1
        losses.append(loss.item())
    return losses, it


def params(model: Any) -> dict[str, torch.Tensor]:
    """The model's whole tensors (an FSDP2 shard gathered: every rank calls it)."""
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in model.state_dict().items()
    }


def kill(root: str, where: str) -> None:
    from casnap.integrations import accelerate as casnap_acc
    from casnap.repo.repository import RepoStorage

    parts = setup(root, seed=0)
    _, it = train(parts, 3)
    parts[0].save_state()

    def stop(*args: Any, **kwargs: Any) -> None:
        with open(os.path.join(root, "ready"), "w") as f:
            f.write(where)
        time.sleep(600)

    train(parts, 2, it)
    if where == "ref":
        RepoStorage.write_ref = stop  # type: ignore[method-assign]
    else:
        casnap_acc.write_pointer = stop  # type: ignore[attr-defined]
    parts[0].save_state()


if __name__ == "__main__":
    if sys.argv[1] == "kill":
        kill(sys.argv[2], sys.argv[3])
