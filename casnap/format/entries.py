"""Manifest entries: how each value of a snapshot is stored (docs/format.md, "Entries").

One pydantic model per entry ``kind`` (a dense tensor, a primitive, a container,
a pickled object, a sharded tensor), the chunk references they hold, and the
base model and field types every serialized record shares. Each validator
checks an entry's arithmetic (shape x itemsize against its chunks, overflow
checked) so a reader can trust the sizes before it allocates.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    model_validator,
)

from casnap.format.codec import HEADER_SIZE, MAX_CHUNK_SIZE
from casnap.format.floats import decode_float, hex_float
from casnap.format.names import HASH_HEX_LEN

MAX_BYTES = 1 << 62  # largest tensor / object / offset accepted from a manifest

# Element sizes by dtype name (the name is torch's, without "torch.").
# Kept here so that listing, du and verify never need to import torch.
DTYPE_ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
    "complex32": 4,
    "complex64": 8,
    "complex128": 16,
    "bool": 1,
    "uint8": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "bits8": 1,
    "bits16": 2,
    "bits1x8": 1,
    "bits2x4": 1,
    "bits4x2": 1,
    **{f"int{n}": 1 for n in range(1, 8)},
    **{f"uint{n}": 1 for n in range(1, 8)},
}

HashStr = Annotated[
    str, Field(min_length=HASH_HEX_LEN, max_length=HASH_HEX_LEN, pattern=r"^[0-9a-f]{64}$")
]
Size = Annotated[int, Field(ge=0, le=MAX_BYTES), StrictInt]
ChunkSize = Annotated[int, Field(ge=1, le=MAX_CHUNK_SIZE), StrictInt]


class FormatModel(BaseModel):
    """The base of every serialized model: frozen, and unknown fields are refused."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class _PerRank:
    """``replicated`` for entries casnap never replicates across ranks (torchsnapshot's field).

    Only dense tensors are written once for every rank (docs/distributed.md);
    primitives, containers and pickled objects are each rank's own, and a
    sharded entry holds every rank's shards. Read-only: not stored.
    """

    @property
    def replicated(self) -> bool:
        return False


def _no_base(base: ChunkRef | None) -> bool:
    return base is None


class ChunkRef(FormatModel):
    """Where one chunk lives: a loose object (``pack`` is null) or a frame inside a pack.

    ``base``: the frame is a delta against that chunk, which is stored whole:
    a base never has a base of its own, so a read decodes one whole frame and
    one delta. Left out of the JSON when absent, so other references are
    unchanged.
    """

    hash: HashStr
    size: Size  # raw (uncompressed) bytes
    pack: HashStr | None = None
    offset: Size = 0  # frame offset inside the pack; 0 for a loose chunk
    length: Annotated[int, Field(ge=HEADER_SIZE, le=MAX_BYTES), StrictInt]  # frame bytes
    base: ChunkRef | None = Field(default=None, exclude_if=_no_base)

    @property
    def whole(self) -> ChunkRef:
        """The whole frame a read of this chunk decodes: its base, or itself if it has none
        (what a delta of a later version of the chunk is written against)."""
        return self if self.base is None else self.base

    def chain(self) -> list[ChunkRef]:
        """This reference, then its base if it is a delta: every frame a read needs."""
        return [self] if self.base is None else [self, self.base]

    @model_validator(mode="after")
    def _loose_at_zero(self) -> ChunkRef:
        if self.base is not None:
            if self.base.size != self.size or self.base.hash == self.hash:
                raise ValueError("a delta's base is another chunk of the same size")
            if self.base.base is not None:
                raise ValueError("a delta's base is a whole chunk, not a delta: no chains")
        if self.pack is None and self.offset != 0:
            raise ValueError("a loose chunk has offset 0")
        if self.size > MAX_CHUNK_SIZE:
            raise ValueError(f"a chunk holds at most {MAX_CHUNK_SIZE} bytes")
        if self.length > HEADER_SIZE + self.size:
            # A writer stores a chunk raw unless compression makes it smaller, so a
            # longer frame is damage; the bound keeps ranged reads to what is declared.
            raise ValueError(f"frame length {self.length} exceeds header + {self.size} raw bytes")
        return self


def _check_chunks(chunks: list[ChunkRef], nbytes: int, chunk_size: int) -> None:
    expected = math.ceil(nbytes / chunk_size) if nbytes else 0
    if len(chunks) != expected:
        raise ValueError(f"{len(chunks)} chunks for {nbytes} bytes of chunk_size {chunk_size}")
    for i, ref in enumerate(chunks):
        want = min(chunk_size, nbytes - i * chunk_size)
        if ref.size != want:
            raise ValueError(f"chunk {i} holds {ref.size} bytes, expected {want}")


def _dense_nbytes(dtype: str, shape: list[int]) -> int:
    """The bytes of a ``dtype`` tensor of ``shape``; a product that overflows is refused."""
    if dtype not in DTYPE_ITEMSIZE:
        raise ValueError(f"unknown dtype {dtype!r}")
    if len(shape) > 64:
        raise ValueError("more than 64 dimensions")
    nbytes = DTYPE_ITEMSIZE[dtype]
    for dim in shape:
        nbytes *= dim
        if nbytes > MAX_BYTES:
            raise ValueError("tensor size overflows")
    return nbytes


# A quantized dtype's integer representation (``int_repr()``), which is what is stored.
QUANTIZED_STORAGE: dict[str, str] = {"qint8": "int8", "quint8": "uint8", "qint32": "int32"}
MAX_CHANNELS = 1 << 24  # per-channel parameters are inline JSON: bound them


class Quantization(FormatModel):
    """How a quantized tensor's stored integers map back to it.

    The entry's ``dtype`` is the integer representation (``int8`` for
    ``qint8``); ``dtype`` here is the quantized dtype. ``per_tensor_affine``
    has ``scale`` (a float as exact ``float.hex``) and ``zero_point``;
    ``per_channel_affine`` has one scale and zero point per index of ``axis``.
    """

    dtype: Literal["qint8", "quint8", "qint32"]
    qscheme: Literal["per_tensor_affine", "per_channel_affine"]
    scale: StrictStr | None = None
    zero_point: StrictInt | None = None
    axis: Annotated[int, Field(ge=0, le=63), StrictInt] | None = None
    scales: tuple[StrictStr, ...] | None = Field(default=None, max_length=MAX_CHANNELS)
    zero_points: tuple[StrictInt, ...] | None = Field(default=None, max_length=MAX_CHANNELS)

    @model_validator(mode="after")
    def _complete(self) -> Quantization:
        per_tensor = (self.scale, self.zero_point)
        per_channel = (self.axis, self.scales, self.zero_points)
        if self.qscheme == "per_tensor_affine":
            if None in per_tensor or any(v is not None for v in per_channel):
                raise ValueError("per_tensor_affine has scale and zero_point only")
        elif any(v is not None for v in per_tensor) or None in per_channel:
            raise ValueError("per_channel_affine has axis, scales and zero_points only")
        elif len(self.scales or ()) != len(self.zero_points or ()):
            raise ValueError("per_channel_affine needs as many zero_points as scales")
        for text in (self.scale, *(self.scales or ())):
            if text is not None:
                hex_float(text)  # malformed or overflowing: no reader could rebuild it
        return self


def _not_quantized(q: Quantization | None) -> bool:
    return q is None


class TensorEntry(FormatModel):
    """A dense tensor stored as raw little-endian bytes in row-major order.

    A quantized tensor is stored as its integer representation, with
    ``quantized`` saying how to rebuild it; the field is left out of the
    JSON of every other tensor, so their manifests are unchanged.
    """

    kind: Literal["tensor"] = "tensor"
    dtype: StrictStr
    shape: list[Annotated[int, Field(ge=0, le=MAX_BYTES), StrictInt]]
    chunk_size: ChunkSize
    chunks: list[ChunkRef]
    replicated: StrictBool = False
    quantized: Quantization | None = Field(default=None, exclude_if=_not_quantized)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_ITEMSIZE[self.dtype]

    @property
    def type(self) -> str:
        """torchsnapshot's entry type name."""
        return "Tensor"

    @model_validator(mode="after")
    def _arithmetic(self) -> TensorEntry:
        _check_chunks(self.chunks, _dense_nbytes(self.dtype, self.shape), self.chunk_size)
        q = self.quantized
        if q is not None:
            if QUANTIZED_STORAGE[q.dtype] != self.dtype:
                raise ValueError(f"a {q.dtype} tensor is stored as {QUANTIZED_STORAGE[q.dtype]}")
            if q.axis is not None and (
                q.axis >= len(self.shape) or len(q.scales or ()) != self.shape[q.axis]
            ):
                raise ValueError("per-channel parameters do not match the shape")
        return self


PrimitiveType = Literal["int", "float", "bool", "str", "none", "bytes", "complex", "dtype"]


class PrimitiveEntry(_PerRank, FormatModel):
    """A Python scalar stored inline as JSON (floats as exact hex strings)."""

    kind: Literal["primitive"] = "primitive"
    type: PrimitiveType
    value: StrictBool | StrictInt | StrictStr | None | list[StrictStr]

    @model_validator(mode="after")
    def _float_text(self) -> PrimitiveEntry:
        # Refused here, naming the entry, so that no reader meets a float it
        # cannot decode (``0x1p+99999`` would be a bare OverflowError).
        if self.type == "float" and isinstance(self.value, str):
            decode_float(self.value)
        elif self.type == "complex" and isinstance(self.value, list):
            for part in self.value:
                decode_float(part)
        return self

    @property
    def readable(self) -> str | None:
        """A float's value as ``str(value)`` (torchsnapshot's field); None for other types."""
        if self.type != "float" or not isinstance(self.value, str):
            return None
        if self.value.startswith("nan:"):
            return "nan"  # a NaN with a sign or payload (docs/format.md)
        try:
            return str(decode_float(self.value))
        except ValueError:
            return None


class ContainerEntry(_PerRank, FormatModel):
    """A dict, OrderedDict, list or tuple; its members are entries under ``<key>/<member>``."""

    kind: Literal["container"] = "container"
    type: Literal["dict", "OrderedDict", "list", "tuple"]
    keys: list[StrictInt | StrictStr]


class ObjectEntry(_PerRank, FormatModel):
    """An arbitrary Python object, pickled. Loading it needs an explicit opt-in."""

    kind: Literal["object"] = "object"
    serializer: Literal["pickle"]
    type_name: StrictStr
    size: Size
    chunk_size: ChunkSize
    chunks: list[ChunkRef]

    @property
    def type(self) -> str:
        """torchsnapshot's entry type name."""
        return "object"

    @property
    def obj_type(self) -> str:
        """torchsnapshot's name for :attr:`type_name`."""
        return self.type_name

    @model_validator(mode="after")
    def _arithmetic(self) -> ObjectEntry:
        _check_chunks(self.chunks, self.size, self.chunk_size)
        return self


MAX_SHARDS = 1 << 16


class ShardRecord(FormatModel):
    """One stored shard of a sharded tensor: the box ``offsets``..``offsets+sizes``, row-major.

    ``quantized``: the shard is a quantized tensor stored as its
    integer representation, as a quantized tensor entry is; left out otherwise.
    """

    offsets: list[Size]
    sizes: list[Size]
    chunk_size: ChunkSize
    chunks: list[ChunkRef]
    quantized: Quantization | None = Field(default=None, exclude_if=_not_quantized)


class ShardedEntry(_PerRank, FormatModel):
    """A tensor stored as shards with global offsets (a DTensor or a ShardedTensor).

    Every rank's key holds the same entry: the global shape and every unique
    shard of the job, so a restore onto any world size or placement finds the
    shards that overlap its own (docs/distributed.md).
    """

    kind: Literal["sharded"] = "sharded"
    layout: Literal["dtensor", "sharded_tensor"]
    dtype: StrictStr
    shape: list[Annotated[int, Field(ge=0, le=MAX_BYTES), StrictInt]]
    shards: list[ShardRecord]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_ITEMSIZE[self.dtype]

    @property
    def type(self) -> str:
        """torchsnapshot's entry type name."""
        return "ShardedTensor"

    @property
    def empty_shards(self) -> int:
        """How many shards hold no element (a rank's empty local shard of an uneven split)."""
        return sum(1 for s in self.shards if 0 in s.sizes)

    @model_validator(mode="after")
    def _arithmetic(self) -> ShardedEntry:
        elements = _dense_nbytes(self.dtype, self.shape) // DTYPE_ITEMSIZE[self.dtype]
        itemsize = DTYPE_ITEMSIZE[self.dtype]
        if len(self.shards) > MAX_SHARDS:
            raise ValueError(f"more than {MAX_SHARDS} shards")
        held = 0
        for i, shard in enumerate(self.shards):
            if len(shard.offsets) != len(self.shape) or len(shard.sizes) != len(self.shape):
                raise ValueError(f"shard {i} has a different rank than the tensor")
            volume = 1
            for off, size, dim in zip(shard.offsets, shard.sizes, self.shape, strict=True):
                if off + size > dim:
                    raise ValueError(f"shard {i} lies outside the tensor")
                volume *= size
            held += volume
            if held > elements:
                # Every shard a take writes is a distinct box of the tensor, so together
                # they hold each element once: more is overlap (and more work and
                # staging than the tensor itself), refused before any is read.
                raise ValueError(
                    f"shards 0..{i} hold {held} elements, more than the tensor's {elements}: "
                    "they overlap"
                )
            _check_chunks(shard.chunks, volume * itemsize, shard.chunk_size)
        if held != elements:
            raise ValueError(
                f"the shards hold {held} of the tensor's {elements} elements; "
                "a sharded entry holds every shard of the tensor"
            )
        _check_quantized_shards(self)
        return self

    @property
    def quantized_shards(self) -> bool:
        """Whether the shards are quantized tensors (every shard or none is)."""
        return bool(self.shards) and self.shards[0].quantized is not None


def _check_quantized_shards(entry: ShardedEntry) -> None:
    """Every shard quantized or none; one quantized dtype and qscheme, stored as ``dtype``."""
    kinds = {(q.dtype, q.qscheme) if q else None for q in (s.quantized for s in entry.shards)}
    if len(kinds) > 1:
        raise ValueError("the shards of a sharded entry mix quantizations")
    for i, shard in enumerate(entry.shards):
        q = shard.quantized
        if q is None:
            continue
        if QUANTIZED_STORAGE[q.dtype] != entry.dtype:
            raise ValueError(f"a {q.dtype} shard is stored as {QUANTIZED_STORAGE[q.dtype]}")
        if q.axis is not None and (
            q.axis >= len(shard.sizes) or len(q.scales or ()) != shard.sizes[q.axis]
        ):
            raise ValueError(f"shard {i}: per-channel parameters do not match its sizes")


Entry = Annotated[
    TensorEntry | PrimitiveEntry | ContainerEntry | ObjectEntry | ShardedEntry,
    Field(discriminator="kind"),
]


# The entries that never hold a chunk (chunks_of is empty): a type test, per entry of a
# manifest, cheaper than the call.
CHUNKLESS = (ContainerEntry, PrimitiveEntry)


def with_chunks(entries: Mapping[str, Entry]) -> dict[str, Entry]:
    """The entries that may hold chunks, by key, in order (the ``CHUNKLESS`` left out):
    an unchanged re-take's are its parent's objects, its containers and primitives
    new ones (casnap.index's memos compare them with ``same_entries``)."""
    return {k: e for k, e in entries.items() if type(e) not in CHUNKLESS}


def chunks_of(e: Entry) -> list[ChunkRef]:
    """The chunks an entry holds (none for a primitive or a container); not their delta bases."""
    if isinstance(e, (TensorEntry, ObjectEntry)):
        return e.chunks
    if isinstance(e, ShardedEntry):
        return [c for shard in e.shards for c in shard.chunks]
    return []
