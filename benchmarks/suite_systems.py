"""The checkpoint systems benchmarks/suite.py compares, each through its natural API.

Every system saves a flat ``{name: tensor}`` state durably (the peers fsync what they
wrote where they do not themselves) and loads it back; ``save_op`` and ``load_op`` say
how (benchmarks/README.md tabulates them). Peers write a full file or folder for every
snapshot, as they would; casnap writes successive snapshots into ONE repository.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from harness import fsync_one as _fsync
from harness import fsync_path

State = dict[str, torch.Tensor]


def fsync_tree(path: str) -> None:
    """fsync every file and folder below ``path`` (and ``path``'s parent)."""
    for folder, _dirs, names in os.walk(path):
        for name in names:
            _fsync(os.path.join(folder, name))
        _fsync(folder)
    _fsync(os.path.dirname(os.path.abspath(path)))


class Pending:
    """What an async save returns: ``wait()`` blocks until it is durable."""

    def __init__(self, wait: Callable[[], Any]) -> None:
        self._wait = wait

    def wait(self) -> Any:
        return self._wait()


@dataclass(frozen=True)
class System:
    name: str  # column title
    save_op: str  # what the save does, for the README and JSON
    load_op: str
    in_place: bool  # loads into the given target tensors (else returns fresh ones)
    suffix: str  # snapshot i is <root>/step_<i><suffix>

    def path(self, root: str, i: int) -> str:
        return os.path.join(root, f"step_{i}{self.suffix}")

    # Overridden per system.
    def save(self, state: State, path: str) -> Any:
        raise NotImplementedError

    def load(self, path: str, target: State) -> State:
        raise NotImplementedError

    def read_one(self, path: str, key: str, like: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def async_save(self, state: State, path: str) -> Pending | None:
        return None  # no natural async API

    @property
    def has_async(self) -> bool:
        return type(self).async_save is not System.async_save


class TorchSave(System):
    def save(self, state: State, path: str) -> None:
        torch.save(state, path)
        fsync_path(path)

    def load(self, path: str, target: State) -> State:
        loaded: State = torch.load(path, weights_only=True)
        return loaded

    def read_one(self, path: str, key: str, like: torch.Tensor) -> torch.Tensor:
        loaded: State = torch.load(path, mmap=True, weights_only=True)
        return loaded[key].clone()


class Safetensors(System):
    def save(self, state: State, path: str) -> None:
        from safetensors.torch import save_file

        save_file(state, path)
        fsync_path(path)

    def load(self, path: str, target: State) -> State:
        from safetensors.torch import load_file

        return load_file(path)

    def read_one(self, path: str, key: str, like: torch.Tensor) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(path, framework="pt") as fh:
            out: torch.Tensor = fh.get_tensor(key)
        return out


class DCP(System):
    def save(self, state: State, path: str) -> None:
        from torch.distributed.checkpoint.state_dict_saver import save

        save(state, checkpoint_id=path)

    def load(self, path: str, target: State) -> State:
        from torch.distributed.checkpoint.state_dict_loader import load

        load(target, checkpoint_id=path)
        return target

    def read_one(self, path: str, key: str, like: torch.Tensor) -> torch.Tensor:
        from torch.distributed.checkpoint.state_dict_loader import load

        out = {key: torch.empty_like(like)}
        load(out, checkpoint_id=path)
        return out[key]

    def async_save(self, state: State, path: str) -> Pending:
        from concurrent.futures import Future

        from torch.distributed.checkpoint.state_dict_saver import async_save

        future = async_save(state, checkpoint_id=path)
        assert isinstance(future, Future)  # the default (no staging response) in torch 2.13
        return Pending(future.result)


class TorchSnapshot(System):
    def save(self, state: State, path: str) -> None:
        import torchsnapshot

        torchsnapshot.Snapshot.take(path, {"model": torchsnapshot.StateDict(state)})
        fsync_tree(path)

    def load(self, path: str, target: State) -> State:
        import torchsnapshot

        torchsnapshot.Snapshot(path).restore({"model": torchsnapshot.StateDict(target)})
        return target

    def read_one(self, path: str, key: str, like: torch.Tensor) -> torch.Tensor:
        import torchsnapshot

        out: Any = torchsnapshot.Snapshot(path).read_object(f"0/model/{key}")
        assert isinstance(out, torch.Tensor)
        return out

    def async_save(self, state: State, path: str) -> Pending:
        import torchsnapshot

        pending = torchsnapshot.Snapshot.async_take(path, {"model": torchsnapshot.StateDict(state)})

        def wait() -> None:
            pending.wait()
            fsync_tree(path)

        return Pending(wait)


class Casnap(System):
    """One training process: its takes and restores share one :class:`casnap.Session`
    (lineage, plan reuse, staging buffers), as a Checkpointer's do."""

    def _session(self) -> Any:
        import casnap

        session = getattr(self, "_casnap_session", None)
        if session is None:
            session = casnap.Session()
            object.__setattr__(self, "_casnap_session", session)
        return session

    def save(self, state: State, path: str) -> Any:
        import casnap

        app = {"model": casnap.StateDict(state)}
        return casnap.Snapshot.take(path, app, session=self._session())

    def load(self, path: str, target: State) -> State:
        import casnap

        casnap.Snapshot(path, session=self._session()).restore({"model": casnap.StateDict(target)})
        return target

    def read_one(self, path: str, key: str, like: torch.Tensor) -> torch.Tensor:
        import casnap

        out = casnap.Snapshot(path).read_object(f"0/model/{key}")
        assert isinstance(out, torch.Tensor)
        return out

    def async_save(self, state: State, path: str) -> Pending:
        import casnap

        app = {"model": casnap.StateDict(state)}
        return Pending(casnap.Snapshot.async_take(path, app, session=self._session()).wait)


SYSTEMS: dict[str, System] = {s.name: s for s in (
    TorchSave("torch.save", "torch.save + fsync", "torch.load(weights_only=True)", False, ".pt"),
    Safetensors("safetensors", "save_file + fsync", "load_file", False, ".safetensors"),
    DCP("DCP", "dcp.save (fsyncs)", "dcp.load in place", True, ""),
    TorchSnapshot("torchsnapshot", "Snapshot.take + fsync of its files", "restore in place", True,
                  ""),
    Casnap("casnap", "Snapshot.take into one repository", "restore in place", True, ""),
)}  # fmt: skip
PEER = "torch.save"  # the peer every ratio is taken against
CASNAP = "casnap"


def system_root(work: str, system: System) -> str:
    """The folder a system's successive snapshots go to (for casnap: the repository)."""
    root = os.path.join(work, system.name.replace(".", "_"))
    os.makedirs(root, exist_ok=True)
    return root
