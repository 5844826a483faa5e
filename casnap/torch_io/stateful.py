"""The Stateful protocol and the two helpers torchsnapshot users know."""

from __future__ import annotations

import random
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict()``: modules, optimizers, schedulers."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


class StateDict(dict):  # type: ignore[type-arg]
    """A dict that is its own state: wraps tensors and primitives for ``app_state``.

    Example::

        progress = StateDict(step=0, best_loss=float("inf"))
        Snapshot.take("/ckpt/run/s1", {"progress": progress})
    """

    def state_dict(self) -> dict[str, Any]:
        return self

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.update(state_dict)


class RNGState:
    """The global RNG state (torch CPU, CUDA if present, Python ``random``).

    After ``restore``, the RNGs produce what they would have produced right
    after the take. Restore applies it after every other stateful, so loading
    other state cannot disturb it.
    """

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = random.getstate()
        state: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "python_version": version,
            "python_state": torch.tensor(internal, dtype=torch.int64),
            "python_gauss": gauss,
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        torch.set_rng_state(state_dict["torch"])
        internal = tuple(int(x) for x in state_dict["python_state"].tolist())
        random.setstate((state_dict["python_version"], internal, state_dict["python_gauss"]))
        if "cuda" in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state_dict["cuda"])
