"""casnap: a content-addressed, deduplicating checkpoint store for PyTorch."""

from __future__ import annotations

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
from casnap.snapshot import PendingSnapshot, Snapshot
from casnap.torch_io.stateful import RNGState, StateDict, Stateful

__version__ = "0.1.0"

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
