"""casnap: a content-addressed, deduplicating checkpoint store for PyTorch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from casnap.errors import (
    CasnapError,
    IntegrityError,
    ManifestValidationError,
    MissingKeyError,
    ObjectExistsError,
    ObjectNotFoundError,
    PickleNotAllowedError,
    RepositoryError,
    RepositoryNotFoundError,
    ShapeMismatchError,
    SnapshotExistsError,
    SnapshotNotFoundError,
    StateError,
    StoreError,
    UnexpectedKeyError,
    UnsupportedFormatError,
    UnsupportedValueError,
)
from casnap.repository import Repository

# The torch layers load on first use, so that listing, du, gc and verify (and
# the CLI) never import torch.
_LAZY = {
    "Snapshot": "casnap.snapshot",
    "PendingSnapshot": "casnap.snapshot",
    "RNGState": "casnap.torch_io.stateful",
    "Stateful": "casnap.torch_io.stateful",
    "StateDict": "casnap.torch_io.stateful",
}

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'casnap' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from casnap.snapshot import PendingSnapshot, Snapshot
    from casnap.torch_io.stateful import RNGState, StateDict, Stateful

__all__ = [
    "CasnapError",
    "IntegrityError",
    "ManifestValidationError",
    "MissingKeyError",
    "ObjectExistsError",
    "ObjectNotFoundError",
    "PendingSnapshot",
    "PickleNotAllowedError",
    "RNGState",
    "Repository",
    "RepositoryError",
    "RepositoryNotFoundError",
    "ShapeMismatchError",
    "Snapshot",
    "SnapshotExistsError",
    "SnapshotNotFoundError",
    "StateDict",
    "StateError",
    "Stateful",
    "StoreError",
    "UnexpectedKeyError",
    "UnsupportedFormatError",
    "UnsupportedValueError",
]
