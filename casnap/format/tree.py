"""Walks over a manifest's entry tree: pure functions of the entries, no I/O, no torch.

Containers list their members' keys; a member lives at ``<key>/<escaped member>``.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping

from casnap.errors import ManifestValidationError, MissingKeyError
from casnap.format.entries import ContainerEntry, Entry
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


def leaf_order(entries: Mapping[str, Entry]) -> list[str]:
    """The non-container keys in the order the state was built (a model's state-dict order).

    A manifest keeps its entries sorted by key, which puts ``layers.10`` before
    ``layers.2``; the containers' member lists keep the order the state dict
    had, so walking them depth first from the roots (the entries no container
    lists) gives the model's order. A leaf no container reaches comes last::

        leaf_order(manifest.entries)  # ['0/model/0.weight', '0/model/0.bias', '0/model/1.weight']
    """
    listed = {
        child_key(k, m) for k, e in entries.items() if isinstance(e, ContainerEntry) for m in e.keys
    }
    seen: set[str] = set()
    out: list[str] = []
    for root in [k for k in entries if k not in listed] + list(entries):
        stack = [root]
        while stack:
            k = stack.pop()
            entry = entries.get(k)
            if entry is None or k in seen:  # a dangling member or a cycle: not ours to judge
                continue
            seen.add(k)
            if isinstance(entry, ContainerEntry):
                stack.extend(child_key(k, m) for m in reversed(entry.keys))
            else:
                out.append(k)
    return out


def nearest_keys(key: str, keys: Iterable[str], n: int = 3) -> list[str]:
    """The keys most like ``key``: those it is the tail of (``model/w`` for ``0/model/w``),
    then the closest by difflib's ratio (at least 0.6)."""
    keys = list(keys)
    tails = sorted(k for k in keys if k.endswith("/" + key))
    close = difflib.get_close_matches(key, keys, n=n, cutoff=0.6)
    return list(dict.fromkeys(tails + close))[:n]


def missing_key(key: str, keys: Iterable[str]) -> MissingKeyError:
    """The error for a key the snapshot does not hold, naming the nearest keys it does::

    no entry '0/modl' in the snapshot; did you mean '0/model' or '0/model/w'?
    """
    close = [repr(k) for k in nearest_keys(key, keys)]
    if close:
        head = ", ".join(close[:-1])
        hint = f"; did you mean {head + ' or ' if head else ''}{close[-1]}?"
    else:
        hint = "; `casnap show SNAPSHOT` lists its keys"
    return MissingKeyError(f"no entry {key!r} in the snapshot{hint}", key)


def entries_under(entries: Mapping[str, Entry], key: str | None) -> dict[str, Entry]:
    """The entries at ``key`` and below it (all of them for None); a key no entry is at or
    below raises :class:`casnap.errors.MissingKeyError` naming the nearest keys."""
    if key is None:
        return dict(entries)
    found = {k: e for k, e in entries.items() if k == key or k.startswith(key + "/")}
    if not found:
        raise missing_key(key, entries)
    return found
