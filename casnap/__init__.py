"""casnap: a content-addressed, deduplicating checkpoint store for PyTorch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from casnap import settings
from casnap.api.repository import Repository
from casnap.errors import (
    ArgumentTypeError,
    CasnapError,
    CasnapWarning,
    CheckpointExistsError,
    ConditionalReplaceUnsupportedError,
    ConfigError,
    CopyIntegrityError,
    DamagedSourceError,
    DeltaBaseError,
    DistributedTakeError,
    GcBlockedError,
    GcBusyError,
    GcRefusedError,
    IntegrityError,
    InvalidNameError,
    LeaseLostError,
    ManifestValidationError,
    MissingKeyError,
    ObjectChangedError,
    ObjectExistsError,
    ObjectLoadError,
    ObjectNotFoundError,
    ObjectRefusedError,
    OutputSpaceError,
    PickleNotAllowedError,
    ReplicaMismatchError,
    ReplicaMismatchWarning,
    RepositoryError,
    RepositoryNotFoundError,
    RetentionError,
    ShapeMismatchError,
    SnapshotChangedError,
    SnapshotExistsError,
    SnapshotNotFoundError,
    SourceFormatError,
    SourceNotFoundError,
    StateError,
    StoreError,
    TooLargeError,
    UnexpectedKeyError,
    UnsupportedFormatError,
    UnsupportedValueError,
)
from casnap.ops.copy import CopyResult, copy
from casnap.ops.retention import (
    KeepBest,
    KeepEveryStep,
    KeepLast,
    KeepTagged,
    KeepWithin,
    RetentionPlan,
    RetentionPolicy,
    execute_retention,
    plan_retention,
)
from casnap.repo.tags import TagInfo, add_tag, list_tags, remove_tag

# The torch layers load on first use, so that listing, du, gc and verify (and
# the CLI) never import torch.
_LAZY = {
    "Snapshot": "casnap.api.snapshot",
    "PendingSnapshot": "casnap.api.snapshot",
    "RNGState": "casnap.torch_io.stateful",
    "Stateful": "casnap.torch_io.stateful",
    "StateDict": "casnap.torch_io.stateful",
    "Checkpointer": "casnap.api.checkpointer",
    "Session": "casnap.take.session",
    "export_safetensors": "casnap.export",
    "export_torch": "casnap.export",
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
    from casnap.api.checkpointer import Checkpointer
    from casnap.api.snapshot import PendingSnapshot, Snapshot
    from casnap.export import export_safetensors, export_torch
    from casnap.take.session import Session
    from casnap.torch_io.stateful import RNGState, StateDict, Stateful

__all__ = [
    "ArgumentTypeError",
    "CasnapError",
    "CasnapWarning",
    "CheckpointExistsError",
    "ConfigError",
    "CopyIntegrityError",
    "CopyResult",
    "DamagedSourceError",
    "DeltaBaseError",
    "SourceFormatError",
    "SourceNotFoundError",
    "copy",
    "DistributedTakeError",
    "GcBlockedError",
    "GcBusyError",
    "GcRefusedError",
    "LeaseLostError",
    "ReplicaMismatchError",
    "ReplicaMismatchWarning",
    "Checkpointer",
    "InvalidNameError",
    "KeepBest",
    "KeepEveryStep",
    "KeepLast",
    "KeepTagged",
    "KeepWithin",
    "RetentionError",
    "RetentionPlan",
    "RetentionPolicy",
    "TagInfo",
    "add_tag",
    "execute_retention",
    "export_safetensors",
    "export_torch",
    "list_tags",
    "plan_retention",
    "remove_tag",
    "ConditionalReplaceUnsupportedError",
    "IntegrityError",
    "ManifestValidationError",
    "MissingKeyError",
    "ObjectChangedError",
    "ObjectExistsError",
    "ObjectNotFoundError",
    "ObjectRefusedError",
    "OutputSpaceError",
    "PendingSnapshot",
    "ObjectLoadError",
    "PickleNotAllowedError",
    "RNGState",
    "Repository",
    "settings",
    "RepositoryError",
    "RepositoryNotFoundError",
    "ShapeMismatchError",
    "Session",
    "Snapshot",
    "SnapshotChangedError",
    "SnapshotExistsError",
    "SnapshotNotFoundError",
    "StateDict",
    "StateError",
    "Stateful",
    "StoreError",
    "TooLargeError",
    "UnexpectedKeyError",
    "UnsupportedFormatError",
    "UnsupportedValueError",
]
