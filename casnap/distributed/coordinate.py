"""The coordinator's step of a distributed take, pure: gathered messages in, plan and entries out.

Every rank runs :func:`coordinate` on the gathered planning messages (the
same input, so the same answer); rank 0 runs :func:`assemble_entries` once
every chunk is written. Neither communicates, so the real take and
``benchmarks/plan_scale.py`` run the same code. Work that grows with the
plans' contents is done once per distinct *body* (replicas send equal
bodies), so no step costs ranks x chunks (docs/distributed.md, "Planning at scale").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from casnap.distributed.plan import assign_sized, settle_replicas
from casnap.distributed.plan_cache import Gathered, join
from casnap.format.entries import ChunkRef, Entry, PrimitiveEntry
from casnap.format.manifest import (
    MAX_KEY_LENGTH,
    GroupedEntries,
    Groups,
    Manifest,
    rank_ranges,
)
from casnap.python_gc import python_gc_paused
from casnap.repo.repository import now_iso
from casnap.take.plan import RankPlan, build_entries


@dataclass(frozen=True)
class Planned:
    """The plan of a distributed take, as every rank computes it.

    ``plans``: one per distinct body (the lowest rank's); ``members[i]``: the
    ranks ``plans[i]`` stands for; ``rep_of[r]``: the index of rank r's plan;
    ``primitives[r]``: rank r's primitive values (outside the body).
    """

    plans: list[RankPlan]
    members: list[list[int]]
    rep_of: list[int]
    primitives: list[tuple[tuple[str, object], ...]]
    writers: dict[str, int]  # unique chunk -> writing rank
    load: list[int]  # bytes assigned to each rank
    sizes: dict[str, int]  # unique chunk -> raw size


def coordinate(gathered: Gathered, mode: str) -> Planned:
    """Plans, replica check and writer assignment from the gathered messages (every rank).

    ``mode`` is rank 0's ``replica_mismatch`` ("warn" or "error"), as for
    :func:`~casnap.distributed.plan.settle_replicas`.
    """
    with python_gc_paused():  # many tuples and models, no cycles (casnap.python_gc)
        return _coordinate(gathered, mode)


def _coordinate(gathered: Gathered, mode: str) -> Planned:
    messages = gathered.messages
    by_body: dict[bytes, int] = {}
    reps: list[int] = []  # rank whose plan stands for each body
    rep_of: list[int] = []
    for m in messages:
        i = by_body.setdefault(m.body or m.rank.to_bytes(8, "big"), len(reps))
        if i == len(reps):
            reps.append(m.rank)
        rep_of.append(i)
    members: list[list[int]] = [[] for _ in reps]
    for r, i in enumerate(rep_of):
        members[i].append(r)
    plans = [join(gathered.structure(r), messages[r].content) for r in reps]
    by_rank = {p.rank: ms for p, ms in zip(plans, members)}
    plans = settle_replicas(plans, mode, by_rank)
    writers, load, sizes = assign_sized(plans, by_rank)
    prims = [m.content.primitives for m in messages]
    return Planned(plans, members, rep_of, prims, writers, load, sizes)


def assemble_entries(
    planned: Planned, refs: Mapping[str, ChunkRef], previous: Mapping[str, Entry] | None = None
) -> GroupedEntries:
    """Every rank's manifest entries (rank 0, once every chunk is written).

    The entries of each distinct plan are built once
    (:func:`~casnap.take.plan.build_entries`); each member rank's keys name
    the same objects, except its own primitive values. The result also says
    how the manifest writes them (:class:`~casnap.format.manifest.GroupedEntries`),
    found per plan rather than per key.
    """
    with python_gc_paused():  # many tuples and models, no cycles (casnap.python_gc)
        built = build_entries(planned.plans, dict(refs), previous)
        tails: list[list[str]] = []
        objs: list[list[Entry]] = []
        for p in planned.plans:
            prefix = f"{p.rank}/"
            for key in p.entries:
                if not key.startswith(prefix):  # flatten names every key after its rank
                    raise ValueError(f"rank {p.rank} planned a key of another rank: {key!r}")
            tails.append([key[len(prefix) :] for key in p.entries])
            objs.append([built[key] for key in p.entries])
        entries = GroupedEntries()
        # (path, entry object) -> the lists of ranks holding it: a plan's members as one list
        holders: dict[tuple[str, int], list[list[int]]] = {}
        held: dict[int, Entry] = {}
        for i, p in enumerate(planned.plans):
            own = planned.primitives[p.rank]
            alike = [r for r in planned.members[i] if planned.primitives[r] == own]
            for r in alike:
                prefix = f"{r}/"
                dict.update(entries, zip([prefix + t for t in tails[i]], objs[i]))
            for t, e in zip(tails[i], objs[i]):
                holders.setdefault((t, id(e)), []).append(alike)
                held[id(e)] = e
            for r in planned.members[i]:
                if planned.primitives[r] != own:
                    _add_own(entries, holders, held, r, tails[i], objs[i], planned.primitives[r])
        entries.plain, entries.groups = _groups(holders, held)
        entries.seal()
        return entries


def _add_own(
    entries: GroupedEntries,
    holders: dict[tuple[str, int], list[list[int]]],
    held: dict[int, Entry],
    rank: int,
    tails: list[str],
    objs: list[Entry],
    primitives: tuple[tuple[str, object], ...],
) -> None:
    """The keys of a rank whose primitive values differ from its plan's: its own values."""
    values = iter(primitives)
    for t, e in zip(tails, objs):
        if isinstance(e, PrimitiveEntry):
            kind, value = next(values)
            e = PrimitiveEntry(type=kind, value=value)  # type: ignore[arg-type]
            held[id(e)] = e
        dict.__setitem__(entries, f"{rank}/{t}", e)
        holders.setdefault((t, id(e)), []).append([rank])


def _groups(
    holders: dict[tuple[str, int], list[list[int]]], held: dict[int, Entry]
) -> tuple[dict[str, Entry], Groups]:
    """What grouping the keys by (path, entry object) finds (the manifest's
    ``_group_by_ranks``), from the lists of ranks holding each: one sort per
    distinct combination of lists, not one per key."""
    ranks_of: dict[tuple[int, ...], tuple[int, ...]] = {}  # ids of the lists -> their ranks
    plain: dict[str, Entry] = {}
    by_ranks: dict[tuple[int, ...], dict[str, Entry]] = {}
    for (path, oid), lists in holders.items():
        sig = tuple(map(id, lists))
        ranks = ranks_of.get(sig)
        if ranks is None:
            ranks = ranks_of[sig] = tuple(sorted(r for rs in lists for r in rs))
        if len(ranks) == 1:
            plain[f"{ranks[0]}/{path}"] = held[oid]
        elif ranks:
            by_ranks.setdefault(ranks, {})[path] = held[oid]
    return plain, [(rank_ranges(list(r)), paths) for r, paths in sorted(by_ranks.items())]


def manifest_of(
    entries: dict[str, Entry], world_size: int, parents: list[str], metadata: dict[str, Any]
) -> Manifest:
    """The manifest of built entries, validated without validating each entry again.

    Every entry object was validated when it was built (pydantic models,
    frozen); a world of 1,024 ranks names the same objects from hundreds of
    thousands of keys, and revalidating each would cost seconds. The rest is
    validated as usual (the shell), and the keys are checked here: per path
    of a group when ``entries`` come from :func:`assemble_entries`.
    """
    with python_gc_paused():  # many tuples and models, no cycles (casnap.python_gc)
        if isinstance(entries, GroupedEntries) and entries.intact():
            _check_keys(entries.plain)
            for ranks, held in entries.groups:
                prefix = len(f"{ranks[-1][1]}/")  # the group's longest rank number, and "/"
                if prefix + max(map(len, held), default=0) > MAX_KEY_LENGTH:
                    _check_keys(entries)  # names the key
        else:
            _check_keys(entries)
        shell = Manifest(  # written with rank groups: one copy per value
            created_at=now_iso(),
            world_size=world_size,
            parents=parents,
            metadata=metadata,
            entries={},
        )
        return shell.model_copy(update={"entries": entries})


def _check_keys(entries: Mapping[str, Entry]) -> None:
    for key in entries:
        if not 0 < len(key) <= MAX_KEY_LENGTH:
            raise ValueError(f"manifest key of {len(key)} characters: {key[:80]!r}")
