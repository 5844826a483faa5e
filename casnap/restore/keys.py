"""Which keys a restore expects: ``strict=True``'s check and what a failed load leaves.

Without ``strict`` a restore hands each ``load_state_dict`` the snapshot's
state dict and lets it decide (docs/pipeline.md, "What ``load_state_dict``
receives"); with it, the target's keys and the snapshot's must match before
anything is read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from casnap.errors import MissingKeyError, UnexpectedKeyError
from casnap.format.entries import ContainerEntry
from casnap.format.manifest import Manifest

MAX_LISTED = 8


def listed(keys: list[str]) -> str:
    more = f" and {len(keys) - MAX_LISTED} more" if len(keys) > MAX_LISTED else ""
    return ", ".join(repr(k) for k in keys[:MAX_LISTED]) + more


def _strictness(
    manifest: Manifest, stored: list[str], target: dict[str, Any]
) -> tuple[list[str], list[str]]:
    """Keys the target has that the snapshot lacks, and stored keys the target does not expect.

    An empty container in the target (a fresh optimizer's ``state``) accepts
    whatever the snapshot holds below it.
    """
    stored_set = set(stored)
    missing = [k for k in target if k not in stored_set]
    unexpected = []
    for k in stored:
        if k in target:
            continue
        parent = k.rsplit("/", 1)[0]
        if parent in target:
            t_parent = target[parent]
            accepts = isinstance(t_parent, (Mapping, list, tuple)) and len(t_parent) == 0
            if not accepts and isinstance(manifest.entries.get(parent), ContainerEntry):
                unexpected.append(k)
    return missing, unexpected


def check_keys(manifest: Manifest, key: str, stored: list[str], target: dict[str, Any]) -> None:
    """``strict=True``: raise unless the target's keys and the snapshot's match."""
    missing, unexpected = _strictness(manifest, stored, target)
    if missing:
        raise MissingKeyError(
            f"{key!r}: the target expects keys the snapshot does not hold: {listed(missing)}",
            missing[0],
        )
    if unexpected:
        raise UnexpectedKeyError(
            f"{key!r}: the snapshot holds keys the target does not expect: "
            f"{listed(unexpected)} (without strict=True they are passed to load_state_dict)",
            unexpected[0],
        )


def failed_load_note(key: str, loaded: list[str]) -> str:
    """What a restore whose ``load_state_dict`` raised has already changed (docs/pipeline.md)."""
    done = f"; app_state {listed(loaded)} were loaded" if loaded else ""
    return (
        f"casnap: app_state[{key!r}].load_state_dict() raised after every read: tensors "
        f"restored in place already hold the snapshot's values{done}, the rest were not "
        "loaded. restore(..., strict=True) checks keys before anything is changed"
    )
