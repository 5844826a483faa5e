"""Live state as a source of chunks for ``casnap repair`` (docs/damage.md, "Repair").

A take cuts each tensor's row-major bytes into pieces of the take's chunk
size and names each piece by its blake3 hash (:mod:`casnap.take.scheduler`).
A tensor the user still holds with the same values yields the same pieces,
so cutting it the same way finds the bytes of a damaged chunk wherever the
tensor sits in the state (its key need not match).
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from casnap.errors import CasnapError, ConfigError
from casnap.format.names import digest_of
from casnap.torch_io.tensors import host_view

_MAX_DEPTH = 64


def tensors_in(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Every tensor in ``obj``: mappings, sequences, and objects with ``state_dict()``."""
    if depth > _MAX_DEPTH:
        return
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from tensors_in(v, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_in(v, depth + 1)
    elif callable(getattr(obj, "state_dict", None)):
        yield from tensors_in(obj.state_dict(), depth + 1)


class LiveSource:
    """Chunks of live tensors, cut at each of ``chunk_sizes``; hashed on first use.

    Holds views into the tensors (no copy of their bytes)::

        source = LiveSource(model.state_dict(), [repo.config.chunk_size], "live state")
        source.fetch(chunk_hash, size)  # the bytes, or None
    """

    def __init__(self, state: Any, chunk_sizes: Iterable[int], label: str) -> None:
        self.state = state
        self.chunk_sizes = sorted(set(chunk_sizes))
        self.label = label
        self._index: dict[str, memoryview] | None = None
        self._owners: list[torch.Tensor] = []

    def _build(self) -> dict[str, memoryview]:
        index: dict[str, memoryview] = {}
        for tensor in tensors_in(self.state):
            if tensor.is_sparse or tensor.layout != torch.strided or tensor.device.type == "meta":
                continue
            try:
                view, owner = host_view(tensor)
            except CasnapError:
                continue  # a dtype no take could have stored
            self._owners.append(owner)
            n = len(view)
            for cs in self.chunk_sizes:
                for start in range(0, n, cs):
                    piece = view[start : start + cs]
                    index.setdefault(digest_of(piece).hex(), piece)
        return index

    def fetch(self, chunk: str, size: int) -> memoryview | None:
        if self._index is None:
            self._index = self._build()
        return self._index.get(chunk)


def load_state_file(path: str | Path) -> Any:
    """A ``torch.save`` file's contents, tensors on the CPU; no code runs (weights_only).

    Plain containers and tensors load; a file that needs other classes is
    refused (:class:`casnap.ConfigError`): save ``model.state_dict()``
    rather than the model.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise ConfigError(
            f"{path}: not loadable without running code from it; save plain state dicts "
            f"(torch.save(model.state_dict(), ...)): {str(exc).splitlines()[0]}",
            "from",
        ) from exc
