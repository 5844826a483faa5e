"""How a DCP checkpoint is laid out in a casnap manifest (shared by the writer and the reader).

Each DCP fqn is stored under the logical key a casnap take of the same state
would use: ``0/<path component>/...`` from the planner's recorded path, each
component escaped, else ``0/<fqn>``. Whole tensors are ``tensor`` entries,
boxes ``sharded`` entries, other values ``primitive`` or ``object`` entries,
with ``container`` entries for the prefixes; ``metadata["dcp"]`` keeps DCP's
version and planner data. docs/dcp.md, "DCP's concepts in casnap's", has the table.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from casnap.errors import ManifestValidationError, UnsupportedValueError
from casnap.format.entries import ContainerEntry, Entry
from casnap.format.names import escape_key, unescape_key

DCP_METADATA = "dcp"  # the key of DCP's own fields in a manifest's metadata
# A snapshot of DCP's files, saved by checkpoint id through casnap:// (dcp_fs), says so here
FILES_METADATA = "dcp_files"
RANK = "0"  # DCP's state is one global namespace: every key is below rank 0

PathT = tuple[str | int, ...]


def path_key(path: PathT) -> str:
    """The logical key of a state-dict path (``("model", "w")`` -> ``0/model/w``)."""
    return "/".join([RANK, *(escape_key(str(p)) for p in path)])


def planner_paths(planner_data: Any) -> dict[str, PathT]:
    """The default planner's fqn -> path mapping; {} without one.

    Only that form is stored (as JSON): a custom planner's own data would need
    pickling, which casnap keeps off the load path.
    """
    if planner_data is None:
        return {}
    if not isinstance(planner_data, Mapping):
        raise UnsupportedValueError(
            f"DCP planner data of type {type(planner_data).__name__} cannot be stored; casnap "
            "stores the default planner's fqn -> state-dict path mapping only"
        )
    out: dict[str, PathT] = {}
    for fqn, path in planner_data.items():
        if (
            not isinstance(fqn, str)
            or not isinstance(path, (tuple, list))
            or not all(isinstance(p, (str, int)) and not isinstance(p, bool) for p in path)
        ):
            raise UnsupportedValueError(
                f"DCP planner data for {fqn!r} is not a state-dict path ({path!r})"
            )
        out[fqn] = tuple(path)
    return out


def whole_tensor_keys(items: Sequence[Any], planner_data: Any) -> dict[int, str]:
    """Per index of a write item that is a whole tensor (not one of a DTensor's or
    ShardedTensor's boxes), the key of its entry (:func:`fqn_keys`'s rule): its chunk i
    is chunk i of that entry, so a parent's chunk there is its delta base. A planner
    whose data is not the default planner's paths gives none."""
    try:
        paths = planner_paths(planner_data)
    except UnsupportedValueError:
        return {}
    out = {}
    for i, item in enumerate(items):
        data = getattr(item, "tensor_data", None)
        if data is None or any(data.chunk.offsets) or list(data.chunk.sizes) != list(data.size):
            continue
        fqn = item.index.fqn
        out[i] = path_key(paths.get(fqn) or (fqn,))
    return out


def fqn_keys(fqns: Iterable[str], paths: Mapping[str, PathT]) -> dict[str, str]:
    """fqn -> logical key; two fqns that would share a key are refused."""
    keys: dict[str, str] = {}
    seen: dict[str, str] = {}
    for fqn in fqns:
        path = paths.get(fqn) or (fqn,)
        key = path_key(path)
        if key in seen:
            raise UnsupportedValueError(
                f"DCP values {seen[key]!r} and {fqn!r} would be stored under the same key {key!r}"
            )
        seen[key] = fqn
        keys[fqn] = key
    return keys


def containers(keys: Iterable[str]) -> dict[str, Entry]:
    """``container`` entries (dicts) for every proper prefix of ``keys`` below the rank.

    DCP cannot tell a list from a dict with int keys (an optimizer's
    ``state``), so every container is a dict; its member names are the
    stored components.
    """
    members: dict[str, dict[str, None]] = {}
    for key in keys:
        parts = key.split("/")
        for depth in range(2, len(parts)):
            members.setdefault("/".join(parts[:depth]), {})[parts[depth]] = None
    return {
        prefix: ContainerEntry(type="dict", keys=[unescape_key(m) for m in names])
        for prefix, names in members.items()
    }


def key_fqns(keys: Iterable[str], paths: Mapping[str, PathT]) -> dict[str, str]:
    """Logical key -> fqn for the leaf ``keys`` of a manifest (the inverse of :func:`fqn_keys`)."""
    known = {path_key(p): f for f, p in paths.items()}
    out: dict[str, str] = {}
    for key in keys:
        fqn = known.get(key)
        if fqn is None:
            parts = key.split("/")
            if len(parts) != 2 or parts[0] != RANK:
                raise ManifestValidationError(
                    f"entry {key!r} is not one a DCP save wrote (no fqn maps to it)", key
                )
            fqn = unescape_key(parts[1])
        out[key] = fqn
    return out


def dcp_record(version: str | None, paths: Mapping[str, PathT]) -> dict[str, Any]:
    """``metadata["dcp"]`` of a manifest: DCP's version and the planner's paths (JSON)."""
    return {"version": version, "planner_data": {f: list(p) for f, p in paths.items()}}


def read_record(metadata: Mapping[str, Any], what: str) -> tuple[str | None, dict[str, PathT]]:
    """(version, fqn -> path) from a manifest's metadata; a snapshot without it is refused."""
    record = metadata.get(DCP_METADATA)
    if FILES_METADATA in metadata:
        raise ManifestValidationError(
            f"{what} holds DCP's files, saved by checkpoint id through casnap://; load it "
            "with dcp.load(state, checkpoint_id='casnap://<its path>')",
            what,
        )
    if not isinstance(record, Mapping):
        raise ManifestValidationError(
            f"{what} was not written by casnap's DCP writer (no metadata[{DCP_METADATA!r}]); "
            "read it with casnap.Snapshot instead",
            what,
        )
    version = record.get("version")
    raw = record.get("planner_data") or {}
    try:
        paths = planner_paths({f: tuple(p) for f, p in dict(raw).items()})
    except (TypeError, ValueError, UnsupportedValueError) as exc:
        raise ManifestValidationError(f"{what}: malformed DCP planner data", what) from exc
    return (version if isinstance(version, str) else None), paths
