"""What a DCP save's ranks wrote, and the manifest entries made from it.

A rank's ``WriteResult`` carries a :class:`StoredTensor` or :class:`StoredBytes`
(its ``storage_data``); the coordinator turns DCP's metadata and the results
for one value into its manifest entry (:func:`entry_of`). Split from
:mod:`casnap.integrations.dcp_writer`.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from casnap.errors import UnsupportedValueError
from casnap.format.entries import (
    ChunkRef,
    Entry,
    ObjectEntry,
    PrimitiveEntry,
    ShardedEntry,
    ShardRecord,
    TensorEntry,
)
from casnap.torch_io.flatten import encode_primitive
from casnap.torch_io.tensors import dtype_name


@dataclass(frozen=True)
class StoredTensor:
    """A tensor item as written (a WriteResult's ``storage_data``)."""

    dtype: str
    sizes: tuple[int, ...]
    chunk_size: int
    chunks: tuple[ChunkRef, ...]


@dataclass(frozen=True)
class StoredBytes:
    """A non-tensor item: inline as a primitive, or DCP's ``torch.save`` bytes as chunks."""

    primitive: PrimitiveEntry | None
    size: int
    chunk_size: int
    chunks: tuple[ChunkRef, ...]


def primitive_of(raw: bytes) -> PrimitiveEntry | None:
    """A JSON scalar stored inline instead of DCP's ``torch.save`` bytes, when it is one.

    The bytes were made by this process's planner a moment ago; ``weights_only``
    loads plain Python values only, and anything else stays DCP's bytes.
    """
    try:
        value = torch.load(io.BytesIO(raw), weights_only=True)
    except Exception:
        return None
    if isinstance(value, torch.dtype):
        return None  # DCP hands loaded bytes back as they were; keep them exact
    return encode_primitive(value)


def entry_of(fqn: str, md: Any, mine: list[tuple[Any, Any]]) -> Entry:
    """The manifest entry of one DCP value, from its metadata and the ranks' results for it."""
    if isinstance(md, BytesStorageMetadata):
        if len(mine) != 1 or not isinstance(mine[0][1], StoredBytes):
            raise UnsupportedValueError(f"{fqn}: DCP reported {len(mine)} writes of one value")
        s = mine[0][1]
        if s.primitive is not None:
            return s.primitive
        return ObjectEntry(
            serializer="pickle",
            type_name="torch.save",
            size=s.size,
            chunk_size=s.chunk_size,
            chunks=list(s.chunks),
        )
    assert isinstance(md, TensorStorageMetadata)
    dtype = dtype_name(md.properties.dtype, fqn)
    shape = list(md.size)
    shards = []
    by_offset = {tuple(idx.offset or ()): s for idx, s in mine}
    for chunk in md.chunks:
        box = by_offset.get(tuple(chunk.offsets))
        if not isinstance(box, StoredTensor):
            raise UnsupportedValueError(f"{fqn}: no write of the box at {list(chunk.offsets)}")
        shards.append(
            ShardRecord(
                offsets=list(chunk.offsets),
                sizes=list(chunk.sizes),
                chunk_size=box.chunk_size,
                chunks=list(box.chunks),
            )
        )
    if len(shards) == 1 and not any(shards[0].offsets) and shards[0].sizes == shape:
        one = shards[0]
        return TensorEntry(dtype=dtype, shape=shape, chunk_size=one.chunk_size, chunks=one.chunks)
    return ShardedEntry(layout="dtensor", dtype=dtype, shape=shape, shards=shards)
