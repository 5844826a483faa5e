"""State dicts <-> manifest entries under torchsnapshot-style logical keys.

A state dict becomes one entry per node: containers (dict, OrderedDict, list,
tuple) list their keys, and their members live at ``<key>/<member>`` with
``/`` and ``%`` escaped in member names. Tensors and pickled objects are
leaves filled in by the take; primitives are stored inline as JSON.
"""

from __future__ import annotations

import base64
import collections
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from casnap.errors import (
    ManifestValidationError,
    PickleNotAllowedError,
    UnsupportedValueError,
)
from casnap.format.entries import (
    ContainerEntry,
    Entry,
    ObjectEntry,
    PrimitiveEntry,
    Quantization,
    ShardedEntry,
    TensorEntry,
)
from casnap.format.floats import decode_float, encode_float
from casnap.format.names import escape_key
from casnap.format.tree import child_key
from casnap.torch_io import quantized
from casnap.torch_io.sharded import ShardLeaf, as_shard_leaf, is_sharded
from casnap.torch_io.tensors import check_storable, dtype_name, torch_dtype

MAX_DEPTH = 64
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_PLAIN_MAPS = (dict, collections.OrderedDict)  # values() in keys() order, by construction


@dataclass(slots=True)  # not frozen: its __init__ costs a third as much, per tensor
class TensorLeaf:
    tensor: torch.Tensor  # what is stored: a quantized tensor's integer representation
    quantized: Quantization | None = None  # how to rebuild a quantized tensor from it


def tensor_leaf(value: torch.Tensor, key: str) -> TensorLeaf:
    """The leaf of a plain tensor; refuses what cannot be stored before anything is written."""
    if value.is_quantized:
        ints, q = quantized.split(value, key)
        return TensorLeaf(ints, q)
    check_storable(value, key)
    return TensorLeaf(value)


@dataclass(frozen=True)
class ObjectLeaf:
    payload: bytes
    type_name: str


Node = ContainerEntry | PrimitiveEntry | TensorLeaf | ObjectLeaf | ShardLeaf


# JSON readers refuse longer integers (CPython's int <-> str limit is 4300 digits).
_MAX_INLINE_INT_BITS = 14_000


def _inline(value: str | int) -> bool:
    """Whether a str or int fits a JSON manifest: UTF-8 encodable, not too many digits."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates
            return False
        return True
    return value.bit_length() <= _MAX_INLINE_INT_BITS


def encode_primitive(value: Any) -> PrimitiveEntry | None:
    """The inline entry for a JSON-representable scalar, or None if ``value`` is not one."""
    if value is None:
        return PrimitiveEntry(type="none", value=None)
    if isinstance(value, bool):
        return PrimitiveEntry(type="bool", value=value)
    if isinstance(value, (int, str)) and not _inline(value):
        return None  # stored only by pickling it
    if isinstance(value, int):
        return PrimitiveEntry(type="int", value=int(value))
    if isinstance(value, float):
        return PrimitiveEntry(type="float", value=encode_float(float(value)))
    if isinstance(value, str):
        return PrimitiveEntry(type="str", value=str(value))
    if isinstance(value, (bytes, bytearray)):
        return PrimitiveEntry(type="bytes", value=base64.b64encode(value).decode("ascii"))
    if isinstance(value, complex):
        return PrimitiveEntry(
            type="complex", value=[encode_float(value.real), encode_float(value.imag)]
        )
    if isinstance(value, torch.dtype):
        return PrimitiveEntry(type="dtype", value=dtype_name(value))
    return None


def decode_primitive(entry: PrimitiveEntry, key: str) -> Any:
    v = entry.value
    try:
        if entry.type == "none":
            return None
        if entry.type == "bool" and isinstance(v, bool):
            return v
        if entry.type == "int" and isinstance(v, int) and not isinstance(v, bool):
            return v
        if entry.type == "float" and isinstance(v, str):
            return decode_float(v)
        if entry.type == "str" and isinstance(v, str):
            return v
        if entry.type == "bytes" and isinstance(v, str):
            return base64.b64decode(v, validate=True)
        if entry.type == "complex" and isinstance(v, list) and len(v) == 2:
            return complex(decode_float(v[0]), decode_float(v[1]))
        if entry.type == "dtype" and isinstance(v, str):
            return torch_dtype(v)
    except (ValueError, TypeError) as exc:
        raise ManifestValidationError(f"{key}: bad {entry.type} value {v!r}", key) from exc
    raise ManifestValidationError(f"{key}: value {v!r} is not of type {entry.type}", key)


def _container_type(value: Any) -> str | None:
    if isinstance(value, collections.OrderedDict):
        return "OrderedDict"
    if isinstance(value, dict):
        return "dict"
    if isinstance(value, list):
        return "list"
    if isinstance(value, tuple) and not hasattr(value, "_fields"):  # not a namedtuple
        return "tuple"
    return None


def flatten(value: Any, key: str, allow_pickle: bool, out: dict[str, Node], depth: int = 0) -> None:
    """Add the nodes of ``value`` (stored at ``key``) to ``out``, parents before members."""
    if depth > MAX_DEPTH:
        raise UnsupportedValueError(f"{key}: nested deeper than {MAX_DEPTH} levels", key)
    if type(value) in _PLAIN_TENSORS:  # most values: neither sharded nor a subclass
        out[key] = tensor_leaf(value, key)
        return
    if is_sharded(value):
        leaf = as_shard_leaf(value, key)
        assert leaf is not None
        for shard in leaf.shards:
            check_storable(shard.tensor, key)
        out[key] = leaf
        return
    if isinstance(value, torch.Tensor):  # plain tensors were handled above
        raise UnsupportedValueError(
            f"{key}: tensor subclass {type(value).__name__} is not supported here", key
        )
    prim = encode_primitive(value)
    if prim is not None:
        out[key] = prim
        return
    ctype = _container_type(value)
    if ctype is not None:
        mapping = isinstance(value, Mapping)
        # The keys first, then the members: no (key, member) pair per member is kept.
        keys: list[int | str] = []
        seen: dict[str, None] = {}  # the escaped member names, in order
        ok = True
        for k in value.keys() if mapping else range(len(value)):
            if isinstance(k, bool) or not isinstance(k, (int, str)) or not _inline(k):
                ok = False
                break
            name = escape_key(str(k))
            if name in seen:
                ok = False
                break
            seen[name] = None
            keys.append(k)
        if ok:
            out[key] = ContainerEntry(type=ctype, keys=keys)  # type: ignore[arg-type]
            # child_key(key, k) for each member, its name escaped once above; a plain
            # tensor member (most of a state dict) without a call of its own. Members
            # by key: a Mapping subclass may order keys() unlike values().
            members = (
                value.values()
                if type(value) in _PLAIN_MAPS
                else ([value[k] for k in keys] if mapping else value)
            )
            for name, member in zip(seen, members, strict=True):
                if type(member) in _PLAIN_TENSORS and depth < MAX_DEPTH:
                    out[f"{key}/{name}"] = tensor_leaf(member, f"{key}/{name}")
                else:
                    flatten(member, f"{key}/{name}", allow_pickle, out, depth + 1)
            return
    if not allow_pickle:
        raise PickleNotAllowedError(
            f"{key}: a {type(value).__module__}.{type(value).__qualname__} can only be stored "
            "by pickling it; pass allow_pickle=True to take() to allow that",
            key,
        )
    try:
        payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise UnsupportedValueError(f"{key}: cannot be pickled: {exc}", key) from exc
    out[key] = ObjectLeaf(payload, f"{type(value).__module__}.{type(value).__qualname__}")


def leaves_of(value: Any, key: str, out: dict[str, Any], depth: int = 0) -> None:
    """Map every member path of a restore target to its value (containers included)."""
    out[key] = value
    if depth > MAX_DEPTH or isinstance(value, torch.Tensor):
        return
    ctype = _container_type(value)
    if ctype is None:
        return
    members = value.items() if isinstance(value, Mapping) else enumerate(value)
    for k, member in members:
        if isinstance(k, (int, str)) and not isinstance(k, bool):
            leaves_of(member, child_key(key, k), out, depth + 1)


def inflate(
    entries: Mapping[str, Entry],
    key: str,
    values: Mapping[str, Any],
    target: Mapping[str, Any],
    depth: int = 0,
) -> Any:
    """Rebuild the object stored at ``key``.

    ``values`` holds the loaded tensors and objects by key. Where ``target``
    has a non-empty dict at a path, its keys decide the members: members the
    snapshot lacks keep the target's value and members the target lacks are
    dropped (``read_object`` into a dict ``obj_out``). A restore passes no
    target: it hands ``load_state_dict`` the snapshot's own structure.
    """
    if depth > MAX_DEPTH:
        raise ManifestValidationError(f"{key}: nested deeper than {MAX_DEPTH} levels", key)
    entry = entries[key]
    if isinstance(entry, PrimitiveEntry):
        return decode_primitive(entry, key)
    if isinstance(entry, (TensorEntry, ObjectEntry, ShardedEntry)):
        return values[key]
    t_value = target.get(key)
    members: list[tuple[int | str, Any]] = []
    for k in entry.keys:
        members.append((k, inflate(entries, child_key(key, k), values, target, depth + 1)))
    if isinstance(t_value, Mapping) and t_value and entry.type in ("dict", "OrderedDict"):
        stored = {k for k, _ in members}
        members = [(k, v) for k, v in members if k in t_value]
        members += [(k, v) for k, v in t_value.items() if k not in stored]
    if entry.type == "dict":
        return dict(members)
    if entry.type == "OrderedDict":
        return collections.OrderedDict(members)
    items = [v for _, v in members]
    return items if entry.type == "list" else tuple(items)
