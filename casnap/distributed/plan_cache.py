"""The planning exchange, reusing the previous take's plans when the structure is unchanged.

:func:`exchange_plans` is collective: every rank of the group calls it once
per take, in the planning phase, in the same order. A rank whose structure
fingerprint matches its cached one sends only its content; one ``all_gather``
(two when the ranks' caches disagree) gives every rank the same plans, and
every rank stores the same new cache entry. The protocol is in
docs/distributed.md, "Plan reuse across takes". The cache is a
:class:`casnap.Session`'s ``plan_cache``, keyed by (group size, rank,
repository id); a stale entry costs the second gather, never a wrong plan.
"""

from __future__ import annotations

import json
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import blake3

from casnap.distributed.group import Failure, Group, all_gather
from casnap.distributed.plan import id_lists
from casnap.format.entries import ContainerEntry, PrimitiveEntry
from casnap.take.plan import (
    ChunkIds,
    EntryPlan,
    ObjectPlan,
    RankPlan,
    ShardedPlan,
    ShardPlan,
    TensorPlan,
)
from casnap.take.session import KeyedCache

DIGEST = 32  # bytes of one chunk digest in a content


@dataclass(frozen=True)
class PrimitiveSlot:
    """Where a primitive entry sits in a structure (its value travels in the content)."""


SlotPlan = TensorPlan | ObjectPlan | ShardedPlan | ContainerEntry | PrimitiveSlot


@dataclass(frozen=True)
class Structure:
    """A plan without its content: chunk ids keep their sizes, their hashes are blank."""

    rank: int
    chunk_size: int
    entries: tuple[tuple[str, SlotPlan], ...]


@dataclass(frozen=True)
class Content:
    """What changes between takes of one structure: chunk digests and primitive values."""

    digests: bytes  # DIGEST bytes per chunk, in the structure's order
    primitives: tuple[tuple[str, Any], ...]  # (type, value) per primitive entry, in order


@dataclass(frozen=True)
class PlanMessage:
    """One rank's part of the planning gather; ``structure`` is None when compact.

    ``structure`` travels pickled and is unpickled only where it is needed:
    the coordinator decodes one structure per distinct ``body`` (replicas of
    an HSDP or DDP job send equal bodies), not one per rank.
    ``body`` names the plan up to its rank: blake3 of the rank-free structure
    fingerprint and the chunk digests (primitive values excluded).
    """

    rank: int
    fingerprint: bytes
    cached: bytes | None  # digest of this rank's cached all-rank structures, if any
    structure: bytes | None  # a pickled Structure
    content: Content
    body: bytes = b""


@dataclass(frozen=True)
class CachedPlans:
    """Every rank's structure (pickled) from the last take of one job, as every rank stored it."""

    structures: tuple[bytes, ...]
    fingerprints: tuple[bytes, ...]
    digest: bytes


@dataclass(frozen=True)
class ExchangeStats:
    """How the last exchange went on this rank (for tests and benchmarks/dist_plan.py).

    ``mode``: "full" (no rank reused its structure), "reused" (plans rebuilt
    from the cache) or "fallback" (a second gather of structures).
    """

    mode: str
    payload_bytes: int  # this rank's pickled message in the first gather
    second_bytes: int  # this rank's pickled message in the second gather (0: none)
    gathers: int
    seconds: float


CacheKey = tuple[int, int, str]  # (group size, rank, repository id)


PlanCache = KeyedCache[Any, Any]  # CacheKey -> CachedPlans; ``last``: ExchangeStats


def _hollow(ids: ChunkIds) -> ChunkIds:
    return tuple(("", n) for _, n in ids)


def _with_ids(
    e: TensorPlan | ObjectPlan | ShardedPlan, ids: Callable[[ChunkIds], ChunkIds]
) -> TensorPlan | ObjectPlan | ShardedPlan:
    """``e`` with the chunk ids of each tensor, object or shard replaced by ``ids(them)``."""
    if isinstance(e, TensorPlan):
        return TensorPlan(e.dtype, e.shape, e.replicated, ids(e.chunks), e.quantized)
    if isinstance(e, ObjectPlan):
        return ObjectPlan(e.type_name, e.size, ids(e.chunks))
    shards = tuple(ShardPlan(s.offsets, s.sizes, ids(s.chunks), s.quantized) for s in e.shards)
    return ShardedPlan(e.layout, e.dtype, e.shape, shards)


def content_of(plan: RankPlan) -> Content:
    """The chunk digests and primitive values of ``plan``, in entry order."""
    hexes = [h for ids in id_lists(plan) for h, _ in ids]
    prims = [(e.type, e.value) for e in plan.entries.values() if isinstance(e, PrimitiveEntry)]
    return Content(bytes.fromhex("".join(hexes)), tuple(prims))


def _slot(e: EntryPlan) -> SlotPlan:
    if isinstance(e, (TensorPlan, ObjectPlan, ShardedPlan)):
        return _with_ids(e, _hollow)
    return PrimitiveSlot() if isinstance(e, PrimitiveEntry) else e


def split(plan: RankPlan) -> tuple[Structure, Content]:
    """A plan's structure and content; :func:`join` puts them back together exactly."""
    slots = tuple((key, _slot(e)) for key, e in plan.entries.items())
    return Structure(plan.rank, plan.chunk_size, slots), content_of(plan)


class _Filler:
    """Hands out a content's digests and primitive values in the structure's order."""

    def __init__(self, content: Content) -> None:
        self.hexes = content.digests.hex()  # one conversion, then slices
        self.primitives = content.primitives
        self.at = 0
        self.prim = 0

    def ids(self, hollow: ChunkIds) -> ChunkIds:
        width, at = 2 * DIGEST, self.at
        end = at + width * len(hollow)
        if end > len(self.hexes):
            raise ValueError("plan content holds fewer chunk digests than its structure")
        hexes = self.hexes
        self.at = end
        return tuple(
            (hexes[at + i * width : at + (i + 1) * width], n) for i, (_, n) in enumerate(hollow)
        )

    def primitive(self) -> PrimitiveEntry:
        kind, value = self.primitives[self.prim]
        self.prim += 1
        return PrimitiveEntry(type=kind, value=value)  # type: ignore[arg-type]

    def check_used(self) -> None:
        if self.at != len(self.hexes) or self.prim != len(self.primitives):
            raise ValueError("plan content does not match its structure")

    def entry(self, slot: SlotPlan) -> EntryPlan:
        if isinstance(slot, (TensorPlan, ObjectPlan, ShardedPlan)):
            return _with_ids(slot, self.ids)
        return self.primitive() if isinstance(slot, PrimitiveSlot) else slot


def join(structure: Structure, content: Content) -> RankPlan:
    """The plan that :func:`split` took apart into ``structure`` and ``content``."""
    fill = _Filler(content)
    entries = {key: fill.entry(slot) for key, slot in structure.entries}
    fill.check_used()
    return RankPlan(structure.rank, structure.chunk_size, entries)


def _sizes(ids: ChunkIds) -> list[int]:
    return [n for _, n in ids]


def _canonical(slot: SlotPlan | EntryPlan) -> list[Any]:
    """The JSON form of one entry's structure (chunk hashes and primitive values left out)."""
    if isinstance(slot, TensorPlan):
        out = ["t", slot.dtype, list(slot.shape), slot.replicated, _sizes(slot.chunks)]
        # Quantization parameters count as structure: a change costs a full exchange.
        return out if slot.quantized is None else [*out, slot.quantized.model_dump(mode="json")]
    if isinstance(slot, ObjectPlan):
        return ["o", slot.type_name, slot.size, _sizes(slot.chunks)]
    if isinstance(slot, ShardedPlan):
        boxes = [
            [list(s.offsets), list(s.sizes), _sizes(s.chunks)]
            # Quantization parameters count as structure, as for a tensor.
            + ([] if s.quantized is None else [s.quantized.model_dump(mode="json")])
            for s in slot.shards
        ]
        return ["s", slot.layout, slot.dtype, list(slot.shape), boxes]
    if isinstance(slot, ContainerEntry):
        return ["c", slot.type, list(slot.keys)]  # ints stay ints, strings strings
    return ["p"]


def _fingerprints(of: Structure | RankPlan) -> tuple[bytes, bytes]:
    """(fingerprint, rank-free fingerprint) of a structure: see :func:`fingerprint`."""
    items = of.entries.items() if isinstance(of, RankPlan) else of.entries
    doc = [of.chunk_size, [[k.partition("/")[2], _canonical(s)] for k, s in items]]
    text = json.dumps(doc, ensure_ascii=True, separators=(",", ":"))
    free = blake3.blake3(text.encode("ascii")).digest()
    return blake3.blake3(f"{of.rank}:".encode("ascii") + free).digest(), free


def fingerprint(of: Structure | RankPlan) -> bytes:
    """blake3 of the structure's canonical JSON: equal structures, equal fingerprints.

    A plan's fingerprint is its structure's, computed without building the
    structure. It names the rank too; the keys' rank prefix is left out of the
    JSON, so two ranks holding the same structure share the rank-free part.
    """
    return _fingerprints(of)[0]


def body_of(free: bytes, content: Content) -> bytes:
    """What a plan is up to its rank: equal bodies have equal entries but for the rank
    prefix of their keys (and the values of primitive entries, which travel apart)."""
    return blake3.blake3(free + content.digests).digest()


def _cached_entry(structures: list[bytes], fingerprints: list[bytes]) -> CachedPlans:
    digest = blake3.blake3(b"".join(fingerprints)).digest()
    return CachedPlans(tuple(structures), tuple(fingerprints), digest)


def _pickled(value: Any) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def message_of(plan: RankPlan, cached: CachedPlans | None = None) -> PlanMessage:
    """What a rank sends for ``plan``: compact when ``cached`` holds its structure."""
    fp, free = _fingerprints(plan)
    reuse = cached is not None and cached.fingerprints[plan.rank] == fp
    structure = None if reuse else _pickled(split(plan)[0])  # built only when it must travel
    digest = cached.digest if cached is not None else None
    content = content_of(plan)
    return PlanMessage(plan.rank, fp, digest, structure, content, body_of(free, content))


def _reusable(messages: list[PlanMessage]) -> bool:
    """Whether every rank can fill the compact messages from its own cache.

    Decided from the gathered messages only, so every rank decides the same.
    """
    digests = {m.cached for m in messages}
    return len(digests) == 1 and None not in digests


def _gather_bytes(group: Group, value: Any, phase: str) -> tuple[list[Any], int]:
    """``all_gather`` of ``value`` pickled once here (its size is the payload we report)."""
    if isinstance(value, Failure):
        return all_gather(group, value, phase), 0
    data = _pickled(value)
    got = all_gather(group, data, phase)
    return [pickle.loads(d) for d in got], len(data)  # this job's own ranks wrote them


@dataclass(frozen=True)
class Gathered:
    """Every rank's planning message, with every structure at hand (pickled)."""

    messages: list[PlanMessage]
    structures: list[bytes]

    def structure(self, rank: int) -> Structure:
        decoded: Structure = pickle.loads(self.structures[rank])  # this job's own ranks sent it
        return decoded


def exchange_plans(
    group: Group, plan: RankPlan | Failure, key: CacheKey | None, cache: PlanCache | None
) -> Gathered:
    """Every rank's planning message, in rank order (collective; see the module docstring).

    Every rank calls it once per take with its own plan, or its
    :class:`Failure` (then every rank raises ``DistributedTakeError``). One
    gather when every rank sent its structure or every cache agrees; two
    otherwise. ``cache`` is the session's (None: no session, nothing reused).
    The plans are built from it by :func:`casnap.distributed.coordinate.coordinate`.
    """
    if cache is None:
        key = None
    t0 = time.perf_counter()
    cached = cache.get(key) if cache and key is not None and not isinstance(plan, Failure) else None
    mine = plan if isinstance(plan, Failure) else message_of(plan, cached)
    messages, sent = _gather_bytes(group, mine, "planning")
    structures: list[bytes | None] = [m.structure for m in messages]
    mode, second = "full", 0
    if any(s is None for s in structures):
        if _reusable(messages):
            assert cached is not None  # the digest this rank sent names its own cache
            mode = "reused"
            structures = [
                s if s is not None else cached.structures[i] for i, s in enumerate(structures)
            ]
        else:
            mode = "fallback"
            own = None
            if structures[group.rank] is None:  # compact: this rank's own cache holds it
                assert cached is not None
                own = cached.structures[group.rank]
            again, second = _gather_bytes(group, own, "planning (structures)")
            structures = [s if s is not None else again[i] for i, s in enumerate(structures)]
    full = [s for s in structures if s is not None]
    if cache is not None and key is not None:
        cache.put(key, _cached_entry(full, [m.fingerprint for m in messages]))
    gathers = 1 if mode != "fallback" else 2
    if cache is not None:
        cache.last = ExchangeStats(mode, sent, second, gathers, time.perf_counter() - t0)
    return Gathered(messages, full)
