"""casnap: a content-addressed, deduplicating checkpoint store for PyTorch.

The top level holds what a training script names; each name and why it is
here: docs/architecture.md, "Public API". Every error and warning is in
:mod:`casnap.errors`; the few a user catches every day are here too.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from casnap import errors, settings
from casnap.api.repository import Repository
from casnap.errors import (
    CasnapError,
    CasnapWarning,
    ConfigError,
    IntegrityError,
    RepositoryNotFoundError,
    SnapshotExistsError,
    SnapshotNotFoundError,
)
from casnap.ops.retention import (
    KeepBest,
    KeepEveryStep,
    KeepLast,
    KeepTagged,
    KeepWithin,
    RetentionPolicy,
)

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
    # taking and restoring (the torchsnapshot API)
    "Snapshot",
    "PendingSnapshot",
    "StateDict",
    "Stateful",
    "RNGState",
    "Session",
    # training loops
    "Checkpointer",
    "RetentionPolicy",
    "KeepLast",
    "KeepEveryStep",
    "KeepBest",
    "KeepWithin",
    "KeepTagged",
    # the repository
    "Repository",
    "export_safetensors",
    "export_torch",
    # modules
    "errors",
    "settings",
    # the errors caught every day (all of them: casnap.errors)
    "CasnapError",
    "CasnapWarning",
    "SnapshotNotFoundError",
    "SnapshotExistsError",
    "RepositoryNotFoundError",
    "IntegrityError",
    "ConfigError",
]
