"""The save plan of a distributed take: what each rank holds, and who writes which chunk.

Each rank hashes its chunks locally into a :class:`RankPlan` (keys, entry kinds,
chunk ids; never data), large replicated chunks carrying check ids
(:mod:`casnap.distributed.replica_check`); every rank computes the same
:func:`assign` from the gathered plans: each unique chunk goes to one of the ranks
holding it, balanced by bytes (docs/distributed.md, "The take, step by step").
"""

from __future__ import annotations

import heapq
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from casnap.distributed.replica_check import check_id
from casnap.errors import ReplicaMismatchError, ReplicaMismatchWarning, user_stacklevel
from casnap.format.names import digest_of
from casnap.take.plan import (
    ChunkIds,
    EntryPlan,
    ObjectPlan,
    RankPlan,
    ShardedPlan,
    ShardPlan,
    TensorPlan,
    is_replicated,
    logical,
)
from casnap.torch_io.flatten import Node, ObjectLeaf, TensorLeaf
from casnap.torch_io.sharded import ShardLeaf
from casnap.torch_io.tensors import dtype_name, host_view


@dataclass
class LocalData:
    """This rank's bytes by chunk hash (kept local; only the hashes travel).

    ``owners[h]`` keeps the memory under ``chunks[h]`` alive (a byte view does
    not). ``live`` holds the chunks whose bytes are the caller's own tensor
    memory, which training may change once the take returns: an async take
    copies those it writes (casnap.take.scheduler.stage); copies made while
    hashing (device-to-host, non-contiguous) are already private. ``checked``
    holds the ids that are check ids, not hashes: their writer hashes them.
    """

    chunks: dict[str, memoryview] = field(default_factory=dict)
    owners: dict[str, Any] = field(default_factory=dict)
    live: set[str] = field(default_factory=set)
    checked: set[str] = field(default_factory=set)

    def keep(self, hashes: list[str]) -> None:
        """Drop every chunk but ``hashes`` (those this rank writes), and their memory."""
        wanted = set(hashes)
        self.chunks = {h: v for h, v in self.chunks.items() if h in wanted}
        self.owners = {h: o for h, o in self.owners.items() if h in wanted}
        self.live &= wanted
        self.checked &= wanted


def _chunk_ids(
    view: memoryview,
    chunk_size: int,
    local: LocalData,
    owner: Any = None,
    live: bool = False,
    place: str | None = None,
) -> ChunkIds:
    """Each chunk's blake3 hash, or for a replicated value (``place``: its logical key)
    the check id of each large chunk (:func:`~casnap.distributed.replica_check.check_id`)."""
    n = len(view)
    ids = []
    for i in range(math.ceil(n / chunk_size) if n else 0):
        piece = view[i * chunk_size : (i + 1) * chunk_size]
        checked = check_id(piece, f"{place}\0{i}") if place is not None else None
        if checked is not None:
            h = checked.hex()
            local.checked.add(h)
        else:
            h = digest_of(piece).hex()
        if h not in local.chunks:
            local.chunks[h] = piece
            local.owners[h] = owner
            if live:
                local.live.add(h)
        ids.append((h, len(piece)))
    return tuple(ids)


def _tensor_ids(
    t: torch.Tensor, key: str, chunk_size: int, local: LocalData, replicated: bool = False
) -> ChunkIds:
    """Hash a tensor in place when it is contiguous CPU memory (zero-copy), else a copy;
    a replicated one's large chunks get check ids."""
    view, owner = host_view(t, key)
    live = t.device.type == "cpu" and owner.data_ptr() == t.data_ptr()
    place = logical(key) if replicated else None
    return _chunk_ids(view, chunk_size, local, owner, live, place)


def build_local(
    nodes: dict[str, Node], rank: int, chunk_size: int, replicated: list[str]
) -> tuple[RankPlan, LocalData]:
    """Hash this rank's state into its plan (called by every rank, no communication).

    Nothing is staged here, not even for an async take: only the chunks this
    rank ends up writing need a point-in-time copy, and that is known only
    after the exchange (:func:`assign`).
    """
    local = LocalData()
    entries: dict[str, EntryPlan] = {}
    for key, node in nodes.items():
        if isinstance(node, TensorLeaf):
            t = node.tensor
            rep = is_replicated(key, replicated)
            entries[key] = TensorPlan(
                dtype_name(t.dtype, key),
                tuple(t.shape),
                rep,
                _tensor_ids(t, key, chunk_size, local, rep),
                node.quantized,
            )
        elif isinstance(node, ObjectLeaf):
            entries[key] = ObjectPlan(
                node.type_name,
                len(node.payload),
                _chunk_ids(memoryview(node.payload), chunk_size, local),
            )
        elif isinstance(node, ShardLeaf):
            shards = tuple(
                ShardPlan(
                    s.offsets, s.sizes, _tensor_ids(s.tensor, key, chunk_size, local), s.quantized
                )
                for s in node.shards
            )
            entries[key] = ShardedPlan(node.layout, dtype_name(node.dtype, key), node.shape, shards)
        else:
            entries[key] = node
    return RankPlan(rank, chunk_size, entries), local


Members = Mapping[int, Sequence[int]]  # a plan's rank -> every rank holding that very plan


def assign(
    plans: list[RankPlan], members: Members | None = None
) -> tuple[dict[str, int], list[int]]:
    """Writer rank of every unique chunk, and the bytes assigned to each rank
    (:func:`assign_sized`, without the sizes)."""
    writer, load, _ = assign_sized(plans, members)
    return writer, load


def assign_sized(
    plans: list[RankPlan], members: Members | None = None
) -> tuple[dict[str, int], list[int], dict[str, int]]:
    """Writer rank of every unique chunk, the bytes assigned to each rank, each chunk's size.

    Deterministic from the plans alone, so every rank computes the same answer;
    the rule is docs/distributed.md's ("The take, step by step", "Planning at
    scale"). ``members`` maps a plan's rank to all the ranks whose plan it
    stands for (:mod:`casnap.distributed.coordinate`); by default its own.
    """
    holders: dict[str, list[int]] = {}  # chunk -> indices of the plans holding it
    sizes: dict[str, int] = {}
    for i, p in enumerate(plans):
        for ids in id_lists(p):
            for h, size in ids:
                seen = holders.get(h)
                if seen is None:
                    holders[h] = [i]
                elif seen[-1] != i:
                    seen.append(i)
                sizes[h] = size
    ranks_of = [sorted(members[p.rank]) if members else [p.rank] for p in plans]
    world = max((r for rs in ranks_of for r in rs), default=0) + 1
    groups: dict[tuple[int, ...], list[str]] = {}
    for h, idx in holders.items():
        groups.setdefault(tuple(idx), []).append(h)
    load = [0] * world
    writer: dict[str, int] = {}
    # Single-holder groups first: their chunks have no choice, and the rest balance around them.
    order = sorted(groups, key=lambda g: (len(g) > 1 or len(ranks_of[g[0]]) > 1, g))
    for g in order:
        ranks = sorted({r for i in g for r in ranks_of[i]})
        chunks = sorted(groups[g])  # then largest first (a stable sort): ties by hash
        chunks.sort(key=sizes.__getitem__, reverse=True)
        if len(ranks) == 1:
            (r,) = ranks
            for h in chunks:
                writer[h] = r
                load[r] += sizes[h]
            continue
        heap = [(load[r], r) for r in ranks]
        heapq.heapify(heap)
        for h in chunks:
            _, r = heapq.heappop(heap)
            writer[h] = r
            load[r] += sizes[h]
            heapq.heappush(heap, (load[r], r))
    return writer, load, sizes


def id_lists(plan: RankPlan) -> list[ChunkIds]:
    """The chunk ids of each tensor, object and shard of ``plan`` (none copied)."""
    out: list[ChunkIds] = []
    for e in plan.entries.values():
        if isinstance(e, (TensorPlan, ObjectPlan)):
            out.append(e.chunks)
        elif isinstance(e, ShardedPlan):
            out.extend([s.chunks for s in e.shards])
    return out


def replica_divergence(
    plans: list[RankPlan], members: Members | None = None
) -> tuple[dict[str, list[list[int]]], bool]:
    """Replicated values and shard boxes that differ across ranks: key -> groups of ranks
    holding equal values; and whether every difference is one each rank's entry can keep
    (any tensor; a shard box of the same dtype, shape and size: see
    :func:`casnap.take.plan.build_entries`).

    Pure: every rank computes the same answer from the gathered plans.
    """
    seen: dict[str, dict[Any, list[int]]] = {}
    form: dict[str, set[Any]] = {}  # dtype and shape of each value, without its bytes
    for p in plans:
        ranks = list(members[p.rank]) if members else [p.rank]
        for key, entry in p.entries.items():
            if isinstance(entry, TensorPlan) and entry.replicated:
                value: Any = (entry.dtype, entry.shape, entry.quantized, entry.chunks)
                seen.setdefault(logical(key), {}).setdefault(value, []).extend(ranks)
            elif isinstance(entry, ShardedPlan):
                for s in entry.shards:
                    box = f"{logical(key)}[offsets={list(s.offsets)}]"
                    value = (entry.dtype, entry.shape, s.sizes, s.chunks, s.quantized)
                    seen.setdefault(box, {}).setdefault(value, []).extend(ranks)
                    form.setdefault(box, set()).add(value[:3])
    bad = {k: sorted(sorted(g) for g in v.values()) for k, v in seen.items() if len(v) > 1}
    return bad, all(len(form.get(k, ())) <= 1 for k in bad)


def _per_rank(plans: list[RankPlan], keys: set[str]) -> list[RankPlan]:
    """``plans`` with the tensors of logical ``keys`` as per-rank state (not replicated)."""
    if not keys:
        return plans
    return [
        RankPlan(
            p.rank,
            p.chunk_size,
            {
                k: replace(e, replicated=False)
                if isinstance(e, TensorPlan) and e.replicated and logical(k) in keys
                else e
                for k, e in p.entries.items()
            },
        )
        for p in plans
    ]


def undeclared_replicas(plans: list[RankPlan], members: Members | None = None) -> set[str]:
    """Logical keys some rank declared replicated that not every rank declared so.

    torchsnapshot 0.1.0 treats a path as replicated only when every rank's
    ``replicated`` names it (and the path exists on every rank); so does casnap,
    key by key. Pure: every rank computes the same answer from the gathered plans.
    """
    world = sum(len(members[p.rank]) for p in plans) if members else len(plans)
    declared: dict[str, int] = {}
    for p in plans:
        weight = len(members[p.rank]) if members else 1
        for key, entry in p.entries.items():
            if isinstance(entry, TensorPlan) and entry.replicated:
                name = logical(key)
                declared[name] = declared.get(name, 0) + weight
    return {k for k, n in declared.items() if n < world}


def settle_replicas(
    plans: list[RankPlan], mode: str, members: Members | None = None
) -> list[RankPlan]:
    """The plans to commit once replicated values are compared across ranks.

    Called by every rank after the planning exchange, with rank 0's ``mode``.
    A tensor some rank did not declare replicated is per-rank state on every
    rank (:func:`undeclared_replicas`). Values that differ: with ``mode="warn"``
    a :class:`ReplicaMismatchWarning` and plans in which they are per-rank
    state; with ``mode="error"``, or shard boxes that differ in dtype or shape,
    :class:`ReplicaMismatchError` (docs/distributed.md, "Replicated state").
    """
    plans = _per_rank(plans, undeclared_replicas(plans, members))
    bad, keepable = replica_divergence(plans, members)
    if not bad:
        return plans
    listed = "; ".join(f"{k}: ranks {' vs '.join(map(str, g))}" for k, g in sorted(bad.items()))
    if mode == "error" or not keepable:
        why = "" if keepable else " in dtype or shape of a shard"
        raise ReplicaMismatchError(
            f"values declared replicated differ between ranks{why} ({listed}); nothing was "
            "written. Make them equal, or take them as per-rank state (not replicated)",
            bad,
        )
    warnings.warn(
        ReplicaMismatchWarning(
            f"casnap: values declared replicated differ between ranks ({listed}); each "
            "rank's own value is stored and restores onto that rank (per-rank state). "
            "Set replica_mismatch='error' (CASNAP_REPLICA_MISMATCH) to fail such a take",
            bad,
        ),
        stacklevel=user_stacklevel(),  # the user's line calling take
    )
    return _per_rank(plans, set(bad))
