"""Walks over a manifest's entry tree: pure functions of the entries, no I/O, no torch.

Containers list their members' keys; a member lives at ``<key>/<escaped member>``.
"""

from __future__ import annotations

from collections.abc import Mapping

from casnap.errors import ManifestValidationError
from casnap.format.manifest import ContainerEntry, Entry
from casnap.format.names import escape_key


def child_key(key: str, member: str | int) -> str:
    """The logical key of ``member`` of the container at ``key``."""
    return f"{key}/{escape_key(str(member))}"


def subtree(entries: Mapping[str, Entry], key: str) -> list[str]:
    """Keys of ``key`` and every entry below it, by walking the container keys."""
    found: list[str] = []
    stack = [key]
    while stack:
        k = stack.pop()
        entry = entries.get(k)
        if entry is None:
            raise ManifestValidationError(f"entry {k!r} is listed by its container but missing", k)
        found.append(k)
        if isinstance(entry, ContainerEntry):
            stack.extend(child_key(k, m) for m in reversed(entry.keys))
            if len(found) + len(stack) > len(entries) + 1:
                raise ManifestValidationError(f"{key}: container entries form a cycle", key)
    return found
