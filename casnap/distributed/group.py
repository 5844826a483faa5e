"""Process groups, failure propagation and the store rendezvous of a distributed take.

Two channels carry a take's coordination:

* the process group's collectives (:func:`all_gather`), used only while every
  rank is inside the synchronous part of ``take``/``async_take``;
* the c10d store (:class:`Rendezvous`), used by the part that may run in the
  background, so an async take never issues collectives on the training group.

Every exchange carries either a value or the rank's failure, so a failure on
one rank becomes a :class:`DistributedTakeError` naming it on every rank.
"""

from __future__ import annotations

import pickle
import time
import traceback
from dataclasses import dataclass
from typing import Any

from casnap.errors import DistributedTakeError


@dataclass(frozen=True)
class Group:
    """The ranks of one take: ``pg`` is None for a single process."""

    pg: Any
    rank: int
    size: int

    @property
    def distributed(self) -> bool:
        return self.pg is not None and self.size > 1


def resolve_group(pg: Any) -> Group:
    """The group a take or restore runs in: ``pg``, else the default group if initialized."""
    import torch.distributed as dist

    if pg is None:
        if not (dist.is_available() and dist.is_initialized()):
            return Group(None, 0, 1)
        pg = dist.group.WORLD
    return Group(pg, dist.get_rank(pg), dist.get_world_size(pg))


@dataclass(frozen=True)
class Failure:
    """What a rank sends instead of its value when its part failed."""

    rank: int
    text: str
    type_name: str


def failure_of(rank: int, exc: BaseException) -> Failure:
    last = traceback.format_exception_only(type(exc), exc)[-1].strip()
    return Failure(rank, last, type(exc).__name__)


def raise_failures(failures: list[Failure], phase: str) -> None:
    if not failures:
        return
    ranks = tuple(sorted({f.rank for f in failures}))
    detail = "; ".join(f"rank {f.rank}: {f.text}" for f in sorted(failures, key=lambda f: f.rank))
    raise DistributedTakeError(
        f"distributed take failed during {phase} on rank(s) {list(ranks)}: {detail}; "
        "no snapshot was committed",
        ranks,
    )


def all_gather(group: Group, value: Any, phase: str) -> list[Any]:
    """Every rank's ``value`` (a :class:`Failure` for a failed rank), or raise on every rank.

    Collective: every rank of ``group`` calls it, in the same order. A rank that
    never arrives makes the others fail when the group's timeout expires.
    """
    if not group.distributed:
        values = [value]
    else:
        try:
            data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # sent as this rank's failure: every rank learns it now
            data = pickle.dumps(failure_of(group.rank, exc), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            gathered = _gather_bytes(group, data)
        except Exception as exc:  # a dead or stuck rank: gloo reports a timeout or reset
            raise DistributedTakeError(
                f"distributed take failed during {phase}: the process group did not "
                f"complete a collective ({exc}); another rank has stopped or timed out"
            ) from exc
        values = [pickle.loads(d) for d in gathered]  # this job's own ranks sent them
    raise_failures([v for v in values if isinstance(v, Failure)], phase)
    return values


def any_rank(flag: bool, phase: str) -> bool:
    """Whether ``flag`` is true on any rank of the default group (on one process: ``flag``).
    Collective: every rank calls it at the same point."""
    return any(all_gather(resolve_group(None), flag, phase))


def _slot_bytes(world: int) -> int:
    """Bytes per rank in the first gather: 16 KiB up to 16 ranks, then less, so a gather
    stays at 256 KiB in all (512 KiB at 1,024 ranks). A take's start message (~260 B
    with one parent) and a session's planning message (~800 B for 16 MiB a rank of DDP
    weights) fit; a first take's plan of many tensors may not (two gathers, as before)."""
    return max(512, min(16 * 1024, (256 * 1024) // world))


def _gather_bytes(group: Group, data: bytes) -> list[bytes]:
    """Every rank's ``data``, in one collective when each fits :func:`_slot_bytes`.

    ``all_gather_object`` always issues two (the sizes, then the padded data),
    and on a loaded machine each collective costs milliseconds (~4 ms with 4
    ranks on 2 cores, measured), so a take paid that twice per exchange. Each
    rank sends its length and, when it fits, its data; when some rank's did
    not, a second gather of the longest length carries them all. Every rank
    sees every length, so all agree on whether that second gather happens and
    on its size.
    """
    import torch
    import torch.distributed as dist

    # As all_gather_object chooses: CUDA tensors for an NCCL group (the current device).
    choose = getattr(dist.distributed_c10d, "_get_object_coll_device", None)  # private
    if choose is not None:
        device = choose(group.pg)
    else:
        device = "cuda" if dist.get_backend(group.pg) == "nccl" else "cpu"

    def gather(slot: int, payload: bytes, length: int) -> list[torch.Tensor]:
        mine = torch.zeros(8 + slot, dtype=torch.uint8)
        mine[:8] = torch.tensor([length], dtype=torch.int64).view(torch.uint8)
        if payload:
            mine[8 : 8 + len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        sent = mine.to(device)
        got = [torch.empty_like(sent) for _ in range(group.size)]
        dist.all_gather(got, sent, group=group.pg)
        return got if sent.device.type == "cpu" else list(torch.stack(got).cpu())  # one copy

    slot = _slot_bytes(group.size)
    first = gather(slot, data if len(data) <= slot else b"", len(data))
    lengths = [int(t[:8].view(torch.int64)) for t in first]
    longest = max(lengths)
    if longest > slot:  # those that did not fit, padded to the longest
        second = gather(longest, data if len(data) > slot else b"", len(data))
        first = [b if n > slot else a for n, a, b in zip(lengths, first, second)]
    return [t[8 : 8 + n].numpy().tobytes() for n, t in zip(lengths, first)]


def _poll_cap(world: int) -> float:
    """Longest sleep between two polls of the store, in seconds.

    A poll that sleeps past the moment the value arrives is pure latency on
    every take (with a 50 ms cap it was a tenth of a 4-rank take), while each
    waiting rank's poll is a request to the one c10d store server. 5 ms up to
    32 ranks (a few hundred requests a second in all); beyond that the cap
    grows with the world size, so the store sees at most ~6,400 polls a second
    however many ranks wait.
    """
    return 0.005 * max(1.0, world / 32)


class Rendezvous:
    """Keyed exchange through the c10d store, for the background part of a take.

    ``post`` sets ``<prefix>/<name>/<rank>``; ``collect`` polls until the given
    ranks have posted, or the deadline passes. A single-process take uses a dict.
    """

    def __init__(self, group: Group, take_id: str, store: Any = None) -> None:
        self.group = group
        self.prefix = f"casnap/take/{take_id}"
        self._local: dict[str, bytes] = {}
        self.store = store
        if store is None and group.distributed:
            import torch.distributed as dist

            self.store = dist.distributed_c10d._get_default_store()

    def _key(self, name: str, rank: int) -> str:
        return f"{self.prefix}/{name}/{rank}"

    def post(self, name: str, rank: int, value: Any) -> None:
        data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        if self.store is None:
            self._local[self._key(name, rank)] = data
        else:
            self.store.set(self._key(name, rank), data)

    def _has(self, key: str) -> bool:
        if self.store is None:
            return key in self._local
        return bool(self.store.check([key]))

    def _get(self, key: str) -> Any:
        data = self._local[key] if self.store is None else self.store.get(key)
        return pickle.loads(data)  # written by this job's own ranks

    def discard(self, name: str, rank: int) -> None:
        """Forget what ``rank`` posted as ``name`` (a long job posts under many names)."""
        key = self._key(name, rank)
        if self.store is None:
            self._local.pop(key, None)
        else:
            self.store.delete_key(key)

    def collect(
        self, name: str, ranks: list[int], timeout: float
    ) -> tuple[dict[int, Any], list[int]]:
        """Posted values by rank, and the ranks still missing at the deadline; or as soon
        as a posted value is a :class:`Failure` (the take is lost: waiting is pointless)."""
        deadline = time.monotonic() + timeout
        got: dict[int, Any] = {}
        delay, cap = 0.001, _poll_cap(self.group.size)
        while True:
            for r in ranks:
                if r not in got and self._has(self._key(name, r)):
                    got[r] = self._get(self._key(name, r))
                    if isinstance(got[r], Failure):
                        return got, [x for x in ranks if x not in got]
            missing = [r for r in ranks if r not in got]
            if not missing or time.monotonic() >= deadline:
                return got, missing
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 1.5, cap)
