"""Sharded tensors (DTensor, ShardedTensor) as boxes of a global tensor.

A sharded value becomes a :class:`ShardLeaf`: its global shape and dtype, and
this rank's local shards, each with global ``offsets`` and ``sizes``. A
restore target is described the same way (:func:`target_regions`), so reading
is "copy the overlap of every stored box into every target box".
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

from casnap.errors import UnsupportedValueError
from casnap.format.entries import Quantization

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


@dataclass(frozen=True)
class LocalShard:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    tensor: torch.Tensor  # this rank's data for the box, any layout or device
    # A quantized shard (from _custom_tensor_prepare_func): ``tensor`` is its integers.
    quantized: Quantization | None = None


@dataclass(frozen=True)
class ShardLeaf:
    layout: str  # "dtensor" or "sharded_tensor"
    dtype: torch.dtype
    shape: tuple[int, ...]
    shards: tuple[LocalShard, ...]


# A DTensor or ShardedTensor can only exist once its module is imported, and
# importing torch.distributed.tensor costs about 0.9 s: a take of a state
# without them must not pay that, so the types are looked up, never imported.
def _loaded(module: str, name: str) -> type[Any] | None:
    return getattr(sys.modules.get(module), name, None)


def _dtensor_type() -> type[Any] | None:
    return _loaded("torch.distributed.tensor", "DTensor")


def _sharded_tensor_type() -> type[Any] | None:
    return _loaded("torch.distributed._shard.sharded_tensor.api", "ShardedTensor")


def is_sharded(value: Any) -> bool:
    """Whether ``value`` is a DTensor or a ShardedTensor."""
    dt, st = _dtensor_type(), _sharded_tensor_type()
    return (dt is not None and isinstance(value, dt)) or (st is not None and isinstance(value, st))


def _dtensor_box(value: Any, key: str) -> Box:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for p in value.placements:
        if not isinstance(p, (Shard, Replicate)):
            raise UnsupportedValueError(
                f"{key}: DTensor placement {p} cannot be stored; redistribute to "
                "Shard or Replicate first",
                key,
            )
    shape, offsets = compute_local_shape_and_global_offset(
        value.shape, value.device_mesh, value.placements
    )
    return tuple(int(o) for o in offsets), tuple(int(s) for s in shape)


def as_shard_leaf(value: Any, key: str) -> ShardLeaf | None:
    """The shards of a DTensor or ShardedTensor held by this rank, or None for anything else."""
    dt, st = _dtensor_type(), _sharded_tensor_type()
    if dt is not None and isinstance(value, dt):
        offsets, sizes = _dtensor_box(value, key)
        local = value.to_local().detach()
        if tuple(local.shape) != sizes:
            raise UnsupportedValueError(
                f"{key}: DTensor local shard {tuple(local.shape)} does not match its "
                f"placement {sizes} (uneven padding is not supported)",
                key,
            )
        return ShardLeaf(
            "dtensor", value.dtype, tuple(value.shape), (LocalShard(offsets, sizes, local),)
        )
    if st is not None and isinstance(value, st):
        shards = tuple(
            LocalShard(
                tuple(int(o) for o in s.metadata.shard_offsets),
                tuple(int(x) for x in s.metadata.shard_sizes),
                s.tensor.detach(),
            )
            for s in value.local_shards()
        )
        return ShardLeaf("sharded_tensor", value.dtype, tuple(value.size()), shards)
    return None


def target_regions(value: Any, key: str) -> list[LocalShard] | None:
    """The boxes a restore target wants filled, or None if it is not sharded."""
    leaf = as_shard_leaf(value, key)
    return None if leaf is None else list(leaf.shards)


def global_shape(value: Any) -> tuple[int, ...]:
    return tuple(value.size()) if callable(getattr(value, "size", None)) else tuple(value.shape)
