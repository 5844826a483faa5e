"""The manifest of a snapshot: every rank's entries, its lineage and metadata (docs/format.md).

:class:`Manifest` is the document a ref points to; :class:`RankGroup` and
:class:`GroupedEntries` are how entries several ranks hold as one object are
written once. The entries themselves are in
:mod:`casnap.format.entries`, parsing in :mod:`casnap.format.parse`.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import Field, StrictInt, StrictStr, model_validator

from casnap.format.entries import (
    ChunkRef,
    Entry,
    FormatModel,
    HashStr,
    ShardedEntry,
    ShardRecord,
    chunks_of,
)
from casnap.format.versions import FORMAT_VERSION, Version

# What a manifest may expand to (rank_groups multiply): far above 1,024 ranks x 10,000 keys.
MAX_ENTRIES = 1 << 26
# The keys and shard records rank_groups may expand to, against the manifest's bytes: a
# reader walks each key's entry, so a few hundred bytes must not ask for 2^26 keys of
# 65,536 shards. A 1,024-rank job's grouped entries expand to under 5 per byte.
EXPANSION_FIXED = 1 << 20
EXPANSION_PER_BYTE = 64
MAX_KEY_LENGTH = 4096
# Parts a manifest may list: each names at least one entry, so at most MAX_ENTRIES.
MAX_PARTS = 1 << 20
JsonValue = Any


RankRange = tuple[Annotated[int, Field(ge=0), StrictInt], Annotated[int, Field(ge=0), StrictInt]]
Key = Annotated[str, Field(min_length=1, max_length=MAX_KEY_LENGTH)]


class RankGroup(FormatModel):
    """Entries held alike by several ranks: ``entries[path]`` is the entry of
    the key ``f"{rank}/{path}"`` for every rank in the inclusive ``ranks`` ranges."""

    ranks: list[RankRange] = Field(min_length=1)
    entries: dict[Key, Entry]


class Part(FormatModel):
    """A part of a manifest's entries (docs/format.md, "Manifest parts"): stored once as
    a loose object named by the blake3 of its canonical JSON, shared by every manifest
    that lists it."""

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


class Manifest(FormatModel):
    """One snapshot: every entry of every rank, its lineage and user metadata.

    In memory ``entries`` holds every key (``rank_groups`` is empty: a parsed
    manifest's groups are expanded, each entry object shared by its keys);
    :meth:`to_jsonable` writes a manifest of several ranks with groups.
    """

    format_version: Version = FORMAT_VERSION
    created_at: StrictStr
    world_size: Annotated[int, Field(ge=1), StrictInt] = 1
    parents: list[HashStr] = []
    metadata: dict[str, JsonValue] = {}
    entries: dict[Key, Entry]
    # Read from JSON, expanded by the parser; written by to_jsonable only: never dumped as a field.
    rank_groups: list[RankGroup] = Field(default=[], exclude=True)
    # The parts holding the entries (docs/format.md, "Manifest parts"): read from JSON and
    # merged into ``entries`` by the parser, chosen by the serializer when written
    # (casnap.format.manifest_bytes.split); never dumped as a field.
    parts: list[ChunkRef] = Field(default=[], exclude=True, max_length=MAX_PARTS)

    def to_jsonable(self) -> dict[str, Any]:
        """``model_dump(mode="json")``, with entries several ranks hold as one object
        written once in ``rank_groups`` (a manifest of more than one rank):
        what :func:`casnap.format.manifest_bytes.serialize` writes, as Python values."""
        plain: dict[str, Entry] = self.entries
        groups: list[tuple[list[tuple[int, int]], dict[str, Entry]]] = []
        if self.writes_rank_groups():
            plain, groups = self.rank_groups_split()
        out = self.model_dump(mode="json", exclude={"entries", "rank_groups"})
        out["entries"] = {k: e.model_dump(mode="json") for k, e in plain.items()}
        if groups:
            out["rank_groups"] = [
                {
                    "ranks": [list(r) for r in ranks],
                    "entries": {p: e.model_dump(mode="json") for p, e in held.items()},
                }
                for ranks, held in groups
            ]
        return out

    def writes_rank_groups(self) -> bool:
        """Whether this manifest is written with ``rank_groups`` (a distributed take's)."""
        return self.world_size > 1

    def rank_groups_split(self) -> tuple[dict[str, Entry], Groups]:
        """The entries as :meth:`to_jsonable` writes them: those of one rank, and the groups.

        The coordinator of a distributed take hands them over with the entries
        (:class:`GroupedEntries`); any other dict is grouped here, one pass over its keys.
        """
        entries = self.entries
        if isinstance(entries, GroupedEntries) and entries.intact():
            return entries.plain, entries.groups
        return _group_by_ranks(entries)

    def stored_refs(self) -> list[ChunkRef]:
        """Every stored frame reading this manifest needs: its parts, its chunks and their
        delta bases.

        gc keeps, verify checks and ``du`` counts these; a chunk's bases may
        belong to snapshots that no longer exist, a part to several snapshots.
        """
        refs = self.distinct_refs()
        if any(r.base is not None for r in refs):
            refs = [link for r in refs for link in r.chain()]
        return [*self.parts, *refs] if self.parts else refs

    @model_validator(mode="after")
    def _checked(self) -> Manifest:
        for part in self.parts:  # a part is a whole frame of its own (docs/format.md)
            if part.pack is not None or part.base is not None:
                raise ValueError(f"part {part.hash} is not a loose whole object")
        check_empty_shards(self.world_size, self.entries, *(g.entries for g in self.rank_groups))
        return self

    def expanded(self, size: int | None = None) -> Manifest:
        """This manifest with its ``rank_groups`` merged into ``entries`` (what readers see).

        Raises ``ValueError`` for a group naming a rank outside ``world_size``, a
        key held twice, more than ``MAX_ENTRIES`` keys in all or, for a manifest
        of ``size`` bytes, more keys and shard records than ``EXPANSION_FIXED +
        EXPANSION_PER_BYTE * size``: all checked before any key is added.
        """
        if not self.rank_groups:
            return self
        self._check_expansion(size)
        entries = dict(self.entries)
        for group in self.rank_groups:
            for lo, hi in group.ranks:
                for rank in range(lo, hi + 1):
                    for path, entry in group.entries.items():
                        key = f"{rank}/{path}"
                        if key in entries or len(key) > MAX_KEY_LENGTH:
                            raise ValueError(f"entry {key[:80]!r} is given twice or too long")
                        entries[key] = entry
        return self.model_copy(update={"entries": entries, "rank_groups": []})

    def _check_expansion(self, size: int | None) -> None:
        keys = len(self.entries)
        records = keys
        for group in self.rank_groups:
            weight = sum(1 + len(_shards(e)) for e in group.entries.values())
            for lo, hi in group.ranks:
                if not lo <= hi < self.world_size:
                    raise ValueError(
                        f"rank range [{lo}, {hi}] outside world_size {self.world_size}"
                    )
                keys += (hi - lo + 1) * len(group.entries)
                records += (hi - lo + 1) * weight
        if keys > MAX_ENTRIES:
            raise ValueError(f"rank_groups expand to more than {MAX_ENTRIES} entries")
        limit = None if size is None else EXPANSION_FIXED + EXPANSION_PER_BYTE * size
        if limit is not None and records > limit:
            raise ValueError(
                f"rank_groups expand to {records} keys and shard records, more than the "
                f"{limit} a manifest of {size} bytes may hold"
            )

    def chunk_refs(self) -> list[ChunkRef]:
        """The chunks of every entry (a delta's base is in :meth:`stored_refs`)."""
        return [c for e in self.entries.values() for c in chunks_of(e)]

    def distinct_chunk_refs(self) -> list[tuple[list[ChunkRef], int]]:
        """The chunks of each distinct entry object, with how many keys hold that object.

        A rank-grouped manifest (parsed, or assembled by the coordinator) holds
        one entry object per group for all its ranks' keys: at 1,024 ranks a
        sharded layer's entry stands under every rank's key, and walking
        :meth:`chunk_refs` would visit its chunks 1,024 times. Summing over
        this list with the counts gives the same totals as :meth:`chunk_refs`.
        """
        return [(chunks_of(e), n) for e, n in self.distinct_entries()]

    def distinct_entries(self) -> list[tuple[Entry, int]]:
        """Each distinct entry object, with how many keys hold it (see
        :meth:`distinct_chunk_refs`), in the order the keys first name them."""
        seen: dict[int, list[Any]] = {}
        for e in self.entries.values():
            slot = seen.get(id(e))
            if slot is None:
                seen[id(e)] = [e, 1]
            else:
                slot[1] += 1
        return [(e, n) for e, n in seen.values()]

    def distinct_refs(self) -> list[ChunkRef]:
        """:meth:`chunk_refs` of each distinct entry object once: what a set of the
        chunks needs (dedup, gc, verify), without a grouped manifest's repeats."""
        return [c for refs, _ in self.distinct_chunk_refs() for c in refs]


def check_empty_shards(world_size: int, *held: Mapping[str, Entry]) -> None:
    """Refuse a sharded entry with more empty shards than ``world_size``.

    A rank's local shard of an uneven split may be empty: a take stores at most
    one such box per rank. More is work without data, refused before any read.
    """
    for entries in held:
        for key, e in entries.items():
            if isinstance(e, ShardedEntry) and e.empty_shards > world_size:
                raise ValueError(
                    f"entry {key[:200]!r} has {e.empty_shards} empty shards, more "
                    f"than world_size {world_size}"
                )


def _shards(e: Entry) -> list[ShardRecord]:
    return e.shards if isinstance(e, ShardedEntry) else []


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


def same_entries(a: Mapping[str, Entry], b: Mapping[str, Entry]) -> bool:
    """Whether ``a`` holds the very entry objects of ``b``, under the same keys in order."""
    return (
        len(a) == len(b)
        and all(map(operator.is_, a.values(), b.values()))
        and all(map(operator.eq, a, b))
    )


@dataclass(frozen=True)
class Dumped:
    """A manifest with the JSON text of each entry (for reuse by the next take's serializer)."""

    manifest: Manifest
    texts: Mapping[str, str]  # key -> casnap.format.manifest_bytes.entry_text(key, entry)
