"""Manifest, config and ref models: the serialized format of a repository (docs/format.md).

Pydantic lives here, at the serialization boundary only. Everything read from a
store is untrusted: :func:`parse_manifest` checks size, version, structure and
the arithmetic of every tensor entry before a caller allocates or reads.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    model_validator,
)

from casnap.errors import ManifestValidationError, UnsupportedFormatError
from casnap.format.codec import HEADER_SIZE, MAX_CHUNK_SIZE
from casnap.format.names import HASH_HEX_LEN, check_hash, hash_bytes

FORMAT_MAJOR = 1
FORMAT_VERSION = "1.1"  # 1.1 added the "sharded" entry kind; 1.0 is still read
# 1.2 added a tensor's ``quantized`` field. Only a manifest that uses it says 1.2
# (:func:`format_version_for`), so every other manifest stays readable by 1.1 readers.
QUANTIZED_FORMAT_VERSION = "1.2"
# 2.0 added delta chunks (a chunk reference's ``base``). A reader of major 1
# must refuse such a manifest rather than read a delta frame as damage, so only
# a manifest that holds a delta says 2.0; every other manifest is written as before.
DELTA_FORMAT_VERSION = "2.0"
MANIFEST_MAJORS = (1, 2)  # what this casnap reads; the config stays major 1
# The longest delta chain a reader follows (a writer's bound, CASNAP_DELTA_MAX_CHAIN,
# is at most this): it bounds the recursion of validation and of every read.
MAX_DELTA_CHAIN = 64
# 1.3 added ``rank_groups``: entries that several ranks hold as one value are written
# once, with the ranks holding them (a distributed take of 1,024 ranks otherwise writes
# its sharded entries 1,024 times). Only distributed takes write 1.3 (docs/format.md).
GROUPED_FORMAT_VERSION = "1.3"
# What a manifest may expand to (rank_groups multiply): far above 1,024 ranks x 10,000 keys.
MAX_ENTRIES = 1 << 26
MAX_MANIFEST_BYTES = 1 << 30
# Refs, the config, tags, leases, gc records and damage records are a few
# hundred bytes; a reader refuses anything larger before reading it.
MAX_RECORD_BYTES = 64 << 10
# Python's own default bound on int(str) (sys.get_int_max_str_digits), so no
# record a default Python writer can produce is refused, but a reader stays
# bounded whatever that process-wide setting is.
MAX_INT_DIGITS = 4300
MAX_BYTES = 1 << 62  # largest tensor / object / offset accepted from a manifest
MAX_KEY_LENGTH = 4096

# Element sizes by dtype name (the name is torch's, without "torch.").
# Kept here so that listing, du and verify never need to import torch.
DTYPE_ITEMSIZE: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1,
    "complex32": 4, "complex64": 8, "complex128": 16,
    "bool": 1, "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8,
    "int8": 1, "int16": 2, "int32": 4, "int64": 8,
    "bits8": 1, "bits16": 2, "bits1x8": 1, "bits2x4": 1, "bits4x2": 1,
    **{f"int{n}": 1 for n in range(1, 8)}, **{f"uint{n}": 1 for n in range(1, 8)},
}  # fmt: skip

HashStr = Annotated[str, Field(min_length=HASH_HEX_LEN, max_length=HASH_HEX_LEN,
                               pattern=r"^[0-9a-f]{64}$")]  # fmt: skip
Size = Annotated[int, Field(ge=0, le=MAX_BYTES), StrictInt]
ChunkSize = Annotated[int, Field(ge=1, le=MAX_CHUNK_SIZE), StrictInt]
JsonValue = Any


class _Model(BaseModel):
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


class ChunkRef(_Model):
    """Where one chunk lives: a loose object (``pack`` is null) or a frame inside a pack.

    ``base`` (format 2.0): the frame is a delta against that chunk, which the
    reader rebuilds first (recursively: a base may be a delta too). Left out
    of the JSON when absent, so other references are unchanged.
    """

    hash: HashStr
    size: Size  # raw (uncompressed) bytes
    pack: HashStr | None = None
    offset: Size = 0  # frame offset inside the pack; 0 for a loose chunk
    length: Annotated[int, Field(ge=HEADER_SIZE, le=MAX_BYTES), StrictInt]  # frame bytes
    base: ChunkRef | None = Field(default=None, exclude_if=_no_base)

    @property
    def depth(self) -> int:
        """Delta links to follow to rebuild this chunk: 0 for a whole frame."""
        n, ref = 0, self.base
        while ref is not None:
            n, ref = n + 1, ref.base
        return n

    def chain(self) -> list[ChunkRef]:
        """This reference and its bases, newest first, the whole frame last."""
        out, ref = [self], self.base
        while ref is not None:
            out.append(ref)
            ref = ref.base
        return out

    @model_validator(mode="after")
    def _loose_at_zero(self) -> ChunkRef:
        if self.base is not None:
            if self.base.size != self.size or self.base.hash == self.hash:
                raise ValueError("a delta's base is another chunk of the same size")
            if self.base.depth >= MAX_DELTA_CHAIN:
                raise ValueError(f"a delta chain is at most {MAX_DELTA_CHAIN} links long")
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


# A quantized dtype's integer representation (``int_repr()``), which is what is stored.
QUANTIZED_STORAGE: dict[str, str] = {"qint8": "int8", "quint8": "uint8", "qint32": "int32"}
MAX_CHANNELS = 1 << 24  # per-channel parameters are inline JSON: bound them


class Quantization(_Model):
    """How a quantized tensor's stored integers map back to it (format 1.2).

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
        return self


def _not_quantized(q: Quantization | None) -> bool:
    return q is None


class TensorEntry(_Model):
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
        if self.dtype not in DTYPE_ITEMSIZE:
            raise ValueError(f"unknown dtype {self.dtype!r}")
        if len(self.shape) > 64:
            raise ValueError("more than 64 dimensions")
        nbytes = DTYPE_ITEMSIZE[self.dtype]
        for dim in self.shape:  # overflow-checked product
            nbytes *= dim
            if nbytes > MAX_BYTES:
                raise ValueError("tensor size overflows")
        _check_chunks(self.chunks, nbytes, self.chunk_size)
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


class PrimitiveEntry(_PerRank, _Model):
    """A Python scalar stored inline as JSON (floats as exact hex strings)."""

    kind: Literal["primitive"] = "primitive"
    type: PrimitiveType
    value: StrictBool | StrictInt | StrictStr | None | list[StrictStr]

    @property
    def readable(self) -> str | None:
        """A float's value as ``str(value)`` (torchsnapshot's field); None for other types."""
        if self.type != "float" or not isinstance(self.value, str):
            return None
        if self.value.startswith("nan:"):
            return "nan"  # a NaN with a sign or payload (docs/format.md)
        try:
            return str(float.fromhex(self.value))
        except ValueError:
            return None


class ContainerEntry(_PerRank, _Model):
    """A dict, OrderedDict, list or tuple; its members are entries under ``<key>/<member>``."""

    kind: Literal["container"] = "container"
    type: Literal["dict", "OrderedDict", "list", "tuple"]
    keys: list[StrictInt | StrictStr]


class ObjectEntry(_PerRank, _Model):
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


class ShardRecord(_Model):
    """One stored shard of a sharded tensor: the box ``offsets``..``offsets+sizes``, row-major."""

    offsets: list[Size]
    sizes: list[Size]
    chunk_size: ChunkSize
    chunks: list[ChunkRef]


class ShardedEntry(_PerRank, _Model):
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

    @model_validator(mode="after")
    def _arithmetic(self) -> ShardedEntry:
        if self.dtype not in DTYPE_ITEMSIZE:
            raise ValueError(f"unknown dtype {self.dtype!r}")
        if len(self.shape) > 64:
            raise ValueError("more than 64 dimensions")
        if len(self.shards) > MAX_SHARDS:
            raise ValueError(f"more than {MAX_SHARDS} shards")
        total = DTYPE_ITEMSIZE[self.dtype]
        for dim in self.shape:
            total *= dim
            if total > MAX_BYTES:
                raise ValueError("tensor size overflows")
        for i, shard in enumerate(self.shards):
            if len(shard.offsets) != len(self.shape) or len(shard.sizes) != len(self.shape):
                raise ValueError(f"shard {i} has a different rank than the tensor")
            nbytes = DTYPE_ITEMSIZE[self.dtype]
            for off, size, dim in zip(shard.offsets, shard.sizes, self.shape, strict=True):
                if off + size > dim:
                    raise ValueError(f"shard {i} lies outside the tensor")
                nbytes *= size
            _check_chunks(shard.chunks, nbytes, shard.chunk_size)
        return self


Entry = Annotated[
    TensorEntry | PrimitiveEntry | ContainerEntry | ObjectEntry | ShardedEntry,
    Field(discriminator="kind"),
]
DataEntry = TensorEntry | ObjectEntry


RankRange = tuple[Annotated[int, Field(ge=0), StrictInt], Annotated[int, Field(ge=0), StrictInt]]
Key = Annotated[str, Field(min_length=1, max_length=MAX_KEY_LENGTH)]


class RankGroup(_Model):
    """Entries held alike by several ranks (format 1.3): ``entries[path]`` is the entry of
    the key ``f"{rank}/{path}"`` for every rank in the inclusive ``ranks`` ranges."""

    ranks: list[RankRange] = Field(min_length=1)
    entries: dict[Key, Entry]


Groups = list[tuple[list[tuple[int, int]], dict[str, Entry]]]  # (rank ranges, {path: entry})


class GroupedEntries(dict[str, Entry]):
    """Every key's entry (to any reader, a plain dict), with how they are written in groups.

    ``plain``: the keys that one rank's entry object alone holds; ``groups``:
    the paths several ranks hold as one object, with those ranks' ranges, in
    the order written: exactly what grouping the keys by (path, entry
    object) finds (:func:`_group_by_ranks`), known to the coordinator of a
    distributed take (:func:`casnap.distributed.coordinate.assemble_entries`)
    without a pass over hundreds of thousands of keys. Like the manifest that
    holds it, never changed once built; one that was changed (its length no
    longer matches) is grouped again from its keys.
    """

    __slots__ = ("plain", "groups", "_count")

    def __init__(self, plain: dict[str, Entry] | None = None, groups: Groups | None = None):
        super().__init__()
        self.plain: dict[str, Entry] = plain if plain is not None else {}
        self.groups: Groups = groups if groups is not None else []
        self._count = -1

    def seal(self) -> None:
        """Record that the keys are complete (called by the builder once it filled them)."""
        self._count = len(self)

    def intact(self) -> bool:
        """Whether ``plain`` and ``groups`` describe these keys (none added or removed)."""
        return self._count == len(self)


class Manifest(_Model):
    """One snapshot: every entry of every rank, its lineage and user metadata.

    In memory ``entries`` holds every key (``rank_groups`` is empty: a parsed
    manifest's groups are expanded, each entry object shared by its keys);
    :meth:`to_jsonable` writes a manifest of format 1.3 or later with groups.
    """

    format_version: StrictStr = FORMAT_VERSION
    created_at: StrictStr
    world_size: Annotated[int, Field(ge=1), StrictInt] = 1
    parents: list[HashStr] = []
    metadata: dict[str, JsonValue] = {}
    entries: dict[Key, Entry]
    # Read from JSON, expanded by the parser; written by to_jsonable only: never dumped as a field.
    rank_groups: list[RankGroup] = Field(default=[], exclude=True)

    def to_bytes(self, texts: Mapping[str, str] | None = None) -> bytes:
        """The canonical JSON bytes (``texts``: this manifest's entry texts, see
        :func:`casnap.format.manifest_bytes.entry_texts`)."""
        from casnap.format.grouped_bytes import grouped_bytes  # they build on this module
        from casnap.format.manifest_bytes import manifest_bytes

        if self.writes_rank_groups():  # a distributed take's: its ranks share entry objects
            return grouped_bytes(self, *self._rank_groups())
        return manifest_bytes(self, texts)

    def to_jsonable(self) -> dict[str, Any]:
        """``model_dump(mode="json")``, with entries several ranks hold as one object
        written once in ``rank_groups`` (format 1.3 and later, more than one rank):
        what :meth:`to_bytes` writes, as Python values."""
        plain: dict[str, Entry] = self.entries
        groups: list[tuple[list[tuple[int, int]], dict[str, Entry]]] = []
        if self.writes_rank_groups():
            plain, groups = self._rank_groups()
        out = self.model_dump(mode="json", exclude={"entries", "rank_groups"})
        out["entries"] = {k: e.model_dump(mode="json") for k, e in plain.items()}
        if groups:
            out["rank_groups"] = [
                {"ranks": [list(r) for r in ranks],
                 "entries": {p: e.model_dump(mode="json") for p, e in held.items()}}
                for ranks, held in groups
            ]  # fmt: skip
        return out

    def writes_rank_groups(self) -> bool:
        """Whether this manifest is written with ``rank_groups`` (a distributed take's)."""
        return self.world_size > 1 and _version_at_least(
            self.format_version, GROUPED_FORMAT_VERSION
        )

    def _rank_groups(self) -> tuple[dict[str, Entry], Groups]:
        """The entries as :meth:`to_jsonable` writes them: those of one rank, and the groups.

        The coordinator of a distributed take hands them over with the entries
        (:class:`GroupedEntries`); any other dict is grouped here, one pass over its keys.
        """
        entries = self.entries
        if isinstance(entries, GroupedEntries) and entries.intact():
            return entries.plain, entries.groups
        return _group_by_ranks(entries)

    def stored_refs(self) -> list[ChunkRef]:
        """Every stored frame reading this manifest needs: its chunks and their delta bases.

        gc keeps, verify checks and ``du`` counts these; a chunk's bases may
        belong to snapshots that no longer exist.
        """
        refs = self.distinct_refs()
        if not any(r.base is not None for r in refs):
            return refs
        return [link for r in refs for link in r.chain()]

    def expanded(self) -> Manifest:
        """This manifest with its ``rank_groups`` merged into ``entries`` (what readers see).

        Raises ``ValueError`` for a group naming a rank outside ``world_size``, a
        key held twice, or more than ``MAX_ENTRIES`` keys in all.
        """
        if not self.rank_groups:
            return self
        entries = dict(self.entries)
        total = len(entries)
        for group in self.rank_groups:
            for lo, hi in group.ranks:
                if not lo <= hi < self.world_size:
                    raise ValueError(
                        f"rank range [{lo}, {hi}] outside world_size {self.world_size}"
                    )
                total += (hi - lo + 1) * len(group.entries)
                if total > MAX_ENTRIES:
                    raise ValueError(f"rank_groups expand to more than {MAX_ENTRIES} entries")
                for rank in range(lo, hi + 1):
                    for path, entry in group.entries.items():
                        key = f"{rank}/{path}"
                        if key in entries or len(key) > MAX_KEY_LENGTH:
                            raise ValueError(f"entry {key[:80]!r} is given twice or too long")
                        entries[key] = entry
        return self.model_copy(update={"entries": entries, "rank_groups": []})

    def chunk_refs(self) -> list[ChunkRef]:
        """The chunks of every entry (a delta's base is in :meth:`stored_refs`)."""
        return [c for e in self.entries.values() for c in _chunks_of(e)]

    def distinct_chunk_refs(self) -> list[tuple[list[ChunkRef], int]]:
        """The chunks of each distinct entry object, with how many keys hold that object.

        A rank-grouped manifest (parsed, or assembled by the coordinator) holds
        one entry object per group for all its ranks' keys: at 1,024 ranks a
        sharded layer's entry stands under every rank's key, and walking
        :meth:`chunk_refs` would visit its chunks 1,024 times. Summing over
        this list with the counts gives the same totals as :meth:`chunk_refs`.
        """
        seen: dict[int, list[Any]] = {}
        for e in self.entries.values():
            slot = seen.get(id(e))
            if slot is None:
                seen[id(e)] = [e, 1]
            else:
                slot[1] += 1
        return [(_chunks_of(e), n) for e, n in seen.values()]

    def distinct_refs(self) -> list[ChunkRef]:
        """:meth:`chunk_refs` of each distinct entry object once: what a set of the
        chunks needs (dedup, gc, verify), without a grouped manifest's repeats."""
        return [c for refs, _ in self.distinct_chunk_refs() for c in refs]


def _chunks_of(e: Entry) -> list[ChunkRef]:
    if isinstance(e, (TensorEntry, ObjectEntry)):
        return e.chunks
    if isinstance(e, ShardedEntry):
        return [c for shard in e.shards for c in shard.chunks]
    return []


def _version_at_least(version: str, than: str) -> bool:
    try:
        return tuple(map(int, version.split("."))) >= tuple(map(int, than.split(".")))
    except ValueError:
        return False


def rank_ranges(ranks: list[int]) -> list[tuple[int, int]]:
    """Ascending ranks as inclusive ranges: [0, 1, 2, 5] -> [(0, 2), (5, 5)]."""
    out: list[tuple[int, int]] = []
    for r in ranks:
        if out and out[-1][1] == r - 1:
            out[-1] = (out[-1][0], r)
        else:
            out.append((r, r))
    return out


def _group_by_ranks(entries: dict[str, Entry]) -> tuple[dict[str, Entry], Groups]:
    """Entries as (keys held by one rank, groups of paths several ranks hold as one object).

    Identity, not equality, decides (an entry object shared by the keys of
    several ranks: what a distributed take builds), so this costs one pass.
    """
    holders: dict[tuple[str, int], list[int]] = {}
    objects: dict[int, Entry] = {}
    plain: dict[str, Entry] = {}
    rank_of: dict[str, int] = {}  # each rank's prefix parsed once, not once per key
    for key, entry in entries.items():
        prefix, sep, path = key.partition("/")
        rank = rank_of.get(prefix)
        if rank is None:
            if not sep or not prefix.isdigit() or str(int(prefix)) != prefix:
                plain[key] = entry
                continue
            rank = rank_of[prefix] = int(prefix)
        where = (path, id(entry))
        held = holders.get(where)
        if held is None:
            holders[where] = [rank]
            objects[id(entry)] = entry
        else:
            held.append(rank)
    by_ranks: dict[tuple[int, ...], dict[str, Entry]] = {}
    for (path, oid), ranks in holders.items():
        if len(ranks) == 1:
            plain[f"{ranks[0]}/{path}"] = objects[oid]
        else:
            by_ranks.setdefault(tuple(sorted(ranks)), {})[path] = objects[oid]
    groups = [(rank_ranges(list(r)), held) for r, held in sorted(by_ranks.items())]
    return plain, groups


def format_version_for(entries: dict[str, Entry]) -> str:
    """The format a manifest of ``entries`` is written in: the oldest that can hold them."""
    if any(c.base is not None for e in entries.values() for c in _chunks_of(e)):
        return DELTA_FORMAT_VERSION
    quantized = any(isinstance(e, TensorEntry) and e.quantized is not None
                    for e in entries.values())  # fmt: skip
    return QUANTIZED_FORMAT_VERSION if quantized else FORMAT_VERSION


@dataclass(frozen=True)
class Dumped:
    """A manifest with the JSON text of each entry (for reuse by the next take's serializer)."""

    manifest: Manifest
    texts: Mapping[str, str]  # key -> casnap.format.manifest_bytes.entry_text(key, entry)


class RepoConfig(_Model):
    """``.casnap/config.json``: written once when the repository is created."""

    format_version: StrictStr = FORMAT_VERSION
    repo_id: StrictStr
    hash: Literal["blake3"] = "blake3"
    chunk_size: Annotated[int, Field(ge=4096, le=1 << 30), StrictInt]
    created_at: StrictStr
    # Created on purpose (``casnap init``, ``Repository.init``) to hold the runs
    # below it; absent (older repositories, and those a take created) is false.
    shared: StrictBool = False


class Ref(_Model):
    """``.casnap/refs/<name>``: the commit point of a snapshot."""

    manifest: HashStr
    created_at: StrictStr
    # The snapshot's name, only in a ref stored under a hashed key (a name too long
    # for a flat key, names.name_key): the key alone cannot be decoded back to it.
    name: StrictStr | None = None


class TagRecord(_Model):
    """``.casnap/tags/<tag>``: a pin on the manifest a snapshot had when it was tagged."""

    snapshot: StrictStr
    manifest: HashStr
    created_at: StrictStr
    # The tag's name, only in a tag stored under a hashed key (as Ref.name).
    tag: StrictStr | None = None


def record_bytes(record: Ref | TagRecord) -> bytes:
    """A ref or tag as stored: canonical JSON without the name fields that are None,
    so a record under a flat key is the same bytes as before those fields existed."""
    return canonical_json(record.model_dump(exclude_none=True))


class DamageRecord(_Model):
    """``.casnap/damaged/<chunk>/<pack or "chunk">``: a read found this copy of a chunk damaged.

    The key alone says which copy (takes only list the folder); the body is
    for people and a later ``repair`` (docs/damage.md).
    """

    chunk: HashStr
    pack: HashStr | None  # None: the loose object chunks/<chunk>
    detected_at: StrictStr
    detail: StrictStr


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")  # fmt: skip


def check_version(version: str, what: str, majors: tuple[int, ...] = (FORMAT_MAJOR,)) -> None:
    try:
        major = int(version.split(".", 1)[0])
    except ValueError as exc:
        raise UnsupportedFormatError(f"{what}: malformed format_version {version!r}") from exc
    if major not in majors:
        shown = " and ".join(str(m) for m in majors)
        raise UnsupportedFormatError(
            f"{what} has format version {version}; this casnap reads major version "
            f"{shown} only — upgrade casnap to read it"
        )


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(text.lstrip('-'))} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number (casnap never writes it)")


def load_json(data: bytes, what: str) -> Any:
    """Untrusted JSON of a repository record; every failure is a ManifestValidationError.

    Integers are bounded (``MAX_INT_DIGITS``) and ``NaN``/``Infinity`` refused,
    so no record can make the parser raise a bare ``ValueError`` or spend
    quadratic time converting digits.
    """
    try:
        return json.loads(data, parse_int=_bounded_int, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError too
        raise ManifestValidationError(f"{what}: not valid JSON: {exc}", what) from exc


def _parse(
    model: type[_Model],
    data: bytes,
    what: str,
    *,
    versioned: bool = False,
    majors: tuple[int, ...] = (FORMAT_MAJOR,),
) -> Any:
    raw = load_json(data, what)
    if versioned and isinstance(raw, dict) and "format_version" not in raw:
        # A default would read any document as the current version (docs/format.md).
        raise ManifestValidationError(
            f"{what} has no format_version; every casnap manifest and config names its "
            "format, so this is not one (or it is damaged)",
            what,
        )
    if isinstance(raw, dict) and isinstance(raw.get("format_version"), str):
        check_version(raw["format_version"], what, majors)
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ManifestValidationError(
            f"{what} is malformed at {where}: {first['msg']} ({exc.error_count()} problem(s))",
            what,
        ) from exc


def parse_manifest(data: bytes, name: str) -> Manifest:
    """Validate an untrusted manifest; ``name`` is its hash, checked against the bytes."""
    check_hash(name, "manifest name")
    what = f"manifest {name}"
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestValidationError(f"{what} is larger than {MAX_MANIFEST_BYTES} bytes", name)
    if hash_bytes(data) != name:
        raise ManifestValidationError(f"{what}: blake3 digest mismatch (corrupt)", name)
    manifest: Manifest = _parse(Manifest, data, what, versioned=True, majors=MANIFEST_MAJORS)
    try:
        manifest = manifest.expanded()
    except ValueError as exc:
        raise ManifestValidationError(f"{what} is malformed at rank_groups: {exc}", name) from exc
    _check_delta_version(manifest, what)
    return manifest


def _check_delta_version(manifest: Manifest, what: str) -> None:
    """A delta reference in a manifest of major 1 is refused: major-1 readers cannot read it."""
    if manifest.format_version.split(".", 1)[0] == "1" and any(
        r.base is not None for r in manifest.distinct_refs()
    ):
        raise ManifestValidationError(
            f"{what} has format version {manifest.format_version} but holds delta chunks "
            f"(format {DELTA_FORMAT_VERSION})",
            what,
        )


def parse_config(data: bytes) -> RepoConfig:
    what = "repository config .casnap/config.json"
    config: RepoConfig = _parse(RepoConfig, data, what, versioned=True)
    return config


def parse_ref(data: bytes, name: str) -> Ref:
    ref: Ref = _parse(Ref, data, f"ref {name!r}")
    return ref


def parse_damage_record(data: bytes, key: str) -> DamageRecord:
    record: DamageRecord = _parse(DamageRecord, data, f"damage record {key!r}")
    return record


def json_schemas() -> dict[str, dict[str, Any]]:
    """The JSON Schemas exported into ``schema/`` (see tools/export_schema.py)."""
    return {
        "manifest-v1.schema.json": Manifest.model_json_schema(),
        "config-v1.schema.json": RepoConfig.model_json_schema(),
        "ref-v1.schema.json": Ref.model_json_schema(),
        "tag-v1.schema.json": TagRecord.model_json_schema(),
        "damage-v1.schema.json": DamageRecord.model_json_schema(),
    }
