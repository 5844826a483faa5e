"""Refs and tags by name: where a name is stored below ``refs/`` or ``tags/``, and listing them.

A name is stored under its flat, percent-encoded key when that fits one file
name with room for a temporary suffix (200 bytes), else under a hashed key,
``%%`` + blake3 hex of the name, whose record carries the name
(docs/format.md, "Names of refs and tags").
Repositories written before the flat layout kept ``a/b`` at ``refs/a/b``,
and versions before hashed keys wrote flat keys up to 255 bytes; those keys
are still read and listed.

Example::

    from casnap.repo.named import stored_names

    names, damaged = stored_names(repo.store, "refs")  # damaged: [(key, reason), ...]
"""

from __future__ import annotations

from casnap.display import natural_key
from casnap.errors import (
    IntegrityError,
    InvalidNameError,
    ManifestValidationError,
    ObjectNotFoundError,
)
from casnap.format.json_text import load_json
from casnap.format.names import (
    MAX_NAME_KEY_BYTES,
    check_hashed_key,
    check_ref_name,
    decode_name,
    encode_name,
    is_hashed_key,
    legacy_key,
    name_key,
)
from casnap.format.parse import MAX_RECORD_BYTES
from casnap.format.records import Ref, TagRecord
from casnap.store import ObjectStore

# The field of a record under a hashed key that says its name, per folder.
_NAME_FIELD = {"refs": "name", "tags": "tag"}


def named_keys(folder: str, name: str) -> list[str]:
    """Where a ref or tag ``name`` may be stored: its key, then where older versions put it.

    The first is where it is written (:func:`casnap.format.names.name_key`).
    The others are only read, and make the name taken: its flat key when that
    is 201 to 255 bytes (written flat before hashed keys existed), and its key
    in the nested layout of repositories written before the flat one
    (``refs/a/b`` for ``a/b``).
    """
    keys = [f"{folder}/{name_key(name)}"]
    flat = encode_name(name)
    if is_hashed_key(keys[0][len(folder) + 1 :]) and len(flat) <= MAX_NAME_KEY_BYTES:
        keys.append(f"{folder}/{flat}")
    old = legacy_key(name)
    if old is not None:
        keys.append(f"{folder}/{old}")
    return keys


def check_recorded_name(folder: str, key: str, name: str, recorded: str | None) -> None:
    """Refuse a record whose name field disagrees with the name it was read as.

    A record under a hashed key MUST say its name; any record that says one
    must say the name it is stored for (so the name hashes to its key).
    """
    if recorded is None and not is_hashed_key(key):
        return
    if recorded != name:
        says = "does not record its name" if recorded is None else f"records the name {recorded!r}"
        raise ManifestValidationError(
            f"{folder[:-1]} record .casnap/{folder}/{key} {says}, not {name!r}: damaged", key
        )


def recorded_name(store: ObjectStore, folder: str, key: str) -> str:
    """The name the record under hashed ``key`` carries, checked to be stored under that key.

    :class:`casnap.errors.ManifestValidationError` (naming the key) when the key is not
    one casnap writes, the record is unreadable or has no name, or its name
    does not hash to the key: the record is damaged or not casnap's.
    """
    where = f"{folder[:-1]} record .casnap/{folder}/{key}"
    if not check_hashed_key(key):
        raise ManifestValidationError(
            f"{where}: not a key casnap writes ('%%' and 64 hex digits)", key
        )
    raw = load_json(store.get(f"{folder}/{key}", limit=MAX_RECORD_BYTES), where)
    model = Ref if folder == "refs" else TagRecord
    try:
        name = model.model_validate(raw).model_dump()[_NAME_FIELD[folder]]
    except ValueError as exc:  # pydantic's ValidationError
        raise ManifestValidationError(f"{where} is malformed: {exc}", key) from exc
    if not isinstance(name, str):
        raise ManifestValidationError(f"{where} does not record its name: damaged", key)
    try:
        check_ref_name(name)
    except InvalidNameError as exc:
        raise ManifestValidationError(f"{where} records an invalid name: {exc}", key) from exc
    if name_key(name) != key:
        raise ManifestValidationError(
            f"{where} records the name {name!r}, which is not stored under this key: damaged",
            key,
        )
    return name


def stored_names(store: ObjectStore, folder: str) -> tuple[list[str], list[tuple[str, str]]]:
    """The names stored below ``folder`` (``refs`` or ``tags``), in natural order
    (``step_2`` before ``step_10``), both layouts, and
    the hashed keys whose record cannot say its name, as ``(key, reason)``.

    A flat or nested key is decoded; a hashed key's record is read (one get each:
    only names over 255 bytes once encoded have one).
    """
    names: set[str] = set()
    damaged: list[tuple[str, str]] = []
    for full in store.list(folder):
        key = full[len(folder) + 1 :]
        if not is_hashed_key(key):
            names.add(decode_name(key))
            continue
        try:
            names.add(recorded_name(store, folder, key))
        except ObjectNotFoundError:
            continue  # deleted while listing
        except IntegrityError as exc:
            damaged.append((f"{folder}/{key}", str(exc)))
    return sorted(names, key=natural_key), sorted(damaged)


def names_in(store: ObjectStore, folder: str) -> list[str]:
    """The names stored below ``folder``, in natural order; a damaged hashed record is refused
    (:class:`casnap.errors.ManifestValidationError`): a listing must not lose a name silently."""
    names, damaged = stored_names(store, folder)
    if damaged:
        key, reason = damaged[0]
        raise ManifestValidationError(f"{reason} (casnap verify lists every such record)", key)
    return names
