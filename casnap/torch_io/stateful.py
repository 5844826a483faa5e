"""The Stateful protocol and the two helpers torchsnapshot users know."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
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
        """A plain ``dict`` of the members (the same objects, so tensors load in place)."""
        return dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.update(state_dict)


class RNGState:
    """The global RNG state (torch CPU, CUDA if present, Python ``random``).

    After ``restore``, the RNGs produce what they would have produced right
    after the take. A take captures it before any other ``state_dict()`` and
    puts it back after the last one; a restore applies it after every other
    ``load_state_dict()``. So statefuls that draw random numbers while saving or
    loading cannot shift it (as in torchsnapshot).

    Example::

        Snapshot.take(path, {"model": model, "rng": RNGState()})
        after_take = torch.rand(1)
        Snapshot(path).restore({"model": model, "rng": RNGState()})
        assert torch.equal(torch.rand(1), after_take)
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


def rng_keeper(app_state: Mapping[str, Any]) -> Callable[[], None]:
    """Capture the global RNG state now if ``app_state`` holds an :class:`RNGState`.

    The returned call puts it back: a take calls it after every
    ``state_dict()``, so the randomness those calls drew does not change what
    the RNGs produce after the take (and after a restore of it).
    """
    keeper = next((s for s in app_state.values() if isinstance(s, RNGState)), None)
    if keeper is None:
        return lambda: None
    captured = keeper.state_dict()
    return lambda: keeper.load_state_dict(captured)
