"""Write requests with declared memory costs, staged and executed under one budget.

Every take, single-process or distributed, turns what it writes into
:class:`WriteRequest` values: the bytes of one tensor, pickled object or
(in a distributed take) one chunk this rank was assigned, with what reading
them costs in memory. The same two functions then run them:

- :func:`stage` (async takes only, in the caller's thread): copies the
  requests whose bytes are the caller's own memory into the session's
  staging pool, up to the staging share of the budget, so that training may
  change the live tensors once ``async_take`` returns. Requests beyond the
  share stay *live*: they are written first, and ``async_take`` returns only
  once their bytes are consumed (:attr:`Scheduler.live_consumed`).
- :class:`Scheduler` (the commit, in the caller's or a background thread):
  hands each request's chunks to the :class:`~casnap.chunks.ChunkWriter`,
  holding the request's copy cost in the :class:`~casnap.chunks.ByteBudget`
  until its last chunk is written or packed, and batching small chunks.

torchsnapshot's ``io_types.py``/``scheduler.py`` are the model: requests
declare their cost, one scheduler keeps the sum under the budget.
"""

from __future__ import annotations

import ctypes
import math
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from casnap.chunks.budget import ByteBudget
from casnap.chunks.write import ChunkWriter
from casnap.format.entries import ChunkRef
from casnap.settings import Settings
from casnap.torch_io.staging import PieceCopy, StagingFull, StagingPool, raw_bytes
from casnap.torch_io.tensors import byte_view, host_view

# Single-chunk requests below the pack limit go to the writer in groups of up
# to this many bytes or requests, each group one work item (ChunkWriter.add_small).
SMALL_GROUP_BYTES = 1 << 20
SMALL_GROUP_ITEMS = 1024


# Not frozen: a frozen dataclass sets each field through object.__setattr__, which made
# building one 1.6 us instead of 0.35 us, and a take builds one per tensor (20,000 small
# tensors: 25 ms). Never changed once built: stage() makes a new one with replace().
@dataclass(slots=True, eq=False)
class WriteRequest:
    """The bytes of one value to write, cut into chunks of the take's chunk size.

    ``tensor`` requests read a tensor's bytes when scheduled (``cost`` is the
    contiguous host copy that needs, 0 for contiguous CPU memory); ``data``
    requests are bytes at hand (a pickled payload, or one chunk of a
    distributed take, whose ``digests`` the planner computed). ``live``: the
    bytes are the caller's own memory, which training may change once an
    async take returns.
    """

    key: str
    nbytes: int
    cost: int = 0
    elem_size: int = 0  # floats compress better with their bytes grouped (codec)
    live: bool = False
    tensor: torch.Tensor | None = None
    data: memoryview | None = None
    owner: Any = None  # keeps ``data``'s memory alive
    digests: Sequence[bytes] | None = None
    # Reads the bytes when the request is scheduled (an import streaming a file):
    # called under the budget (``cost``), the result dropped after the last chunk.
    load: Callable[[], tuple[memoryview, Any]] | None = None

    def view(self) -> tuple[memoryview, Any]:
        """The bytes and what keeps them alive (a host copy for non-contiguous tensors)."""
        if self.load is not None:
            return self.load()
        if self.tensor is not None:
            return host_view(self.tensor, self.key)
        assert self.data is not None
        return self.data, self.owner


def tensor_request(key: str, tensor: torch.Tensor) -> WriteRequest:
    """A request for one tensor's bytes (row-major), staged or copied when scheduled."""
    nbytes = tensor.nbytes
    in_place = (
        tensor.is_cpu  # not .device.type: that builds a device object, per tensor
        and tensor.is_contiguous()
        and not tensor.is_conj()
        and not tensor.is_neg()
    )
    elem = tensor.element_size() if tensor.dtype.is_floating_point else 0
    return WriteRequest(key, nbytes, 0 if in_place else nbytes, elem, True, tensor=tensor)


def data_request(
    key: str,
    data: memoryview,
    owner: Any = None,
    *,
    live: bool = False,
    digests: Sequence[bytes] | None = None,
) -> WriteRequest:
    """A request for bytes at hand (``live``: they are the caller's tensor memory)."""
    return WriteRequest(key, len(data), live=live, data=data, owner=owner, digests=digests)


def lazy_request(
    key: str, nbytes: int, load: Callable[[], tuple[memoryview, Any]], elem_size: int = 0
) -> WriteRequest:
    """A request whose bytes ``load()`` produces when it is scheduled, not before.

    Its cost is ``nbytes``: the scheduler calls ``load`` (in its submitting
    thread) only once the budget has room, and drops what ``load`` returned
    after the last chunk, so a source far larger than the budget streams
    through it (:mod:`casnap.integrations.importers`).
    """
    return WriteRequest(key, nbytes, nbytes, elem_size, False, load=load)


@dataclass
class Staged:
    """What :func:`stage` did: the requests to run, and the buffers to give back after."""

    requests: list[WriteRequest]
    buffers: list[torch.Tensor] = field(default_factory=list)
    kept_bytes: int = 0  # bytes the background keeps alive (staged or private)


def stage(requests: Iterable[WriteRequest], limit: int, pool: StagingPool) -> Staged:
    """Copy live requests into ``pool`` buffers while at most ``limit`` bytes are kept.

    Requests whose bytes are already private (a pickled payload, a host copy
    made while hashing) are not copied again but count against ``limit``,
    since the background keeps them alive. Requests past the limit keep
    ``live=True``: the scheduler writes them first. On failure the buffers
    staged so far go back to the pool.
    """
    out = Staged([])
    copies: list[PieceCopy] = []  # device copies in flight: all waited for before returning
    try:
        for req in requests:
            if out.kept_bytes + req.nbytes > limit:
                out.requests.append(req if req.live else replace(req, live=False))
                continue
            if not req.live:
                out.kept_bytes += req.nbytes
                out.requests.append(req)
                continue
            try:
                if req.tensor is not None and pool.uses_device_path(req.tensor):
                    raw = raw_bytes(req.tensor)
                    copy = pool.copy_piece(raw, 0, req.nbytes, limit, pool.next_slot())
                    copies.append(copy)
                    buf = copy.buffer.view(req.tensor.dtype).view(req.tensor.shape)
                    staged = replace(req, tensor=buf, cost=0, live=False)
                elif req.tensor is not None:
                    buf = pool.stage(req.tensor, limit)
                    staged = replace(req, tensor=buf, cost=0, live=False)
                else:
                    assert req.data is not None
                    buf = pool.stage(torch.frombuffer(req.data, dtype=torch.uint8), limit)
                    staged = replace(req, data=byte_view(buf), owner=buf, cost=0, live=False)
            except StagingFull:  # buffers of an earlier take still in use: stays live
                out.requests.append(req)
                continue
            out.kept_bytes += req.nbytes
            out.requests.append(staged)
            out.buffers.append(buf)
        for copy in copies:  # the copies overlap each other; the caller may go on after this
            copy.wait()
    except BaseException:
        for copy in copies:
            copy.wait()
        pool.give_back(out.buffers)
        raise
    return out


class Scheduler:
    """Runs write requests through one :class:`ChunkWriter` under one byte budget.

    ``live_consumed`` is set once every chunk of every request marked ``live``
    has been written or packed (at once if there are none), also when the
    take fails: an ``async_take`` waiting on it must never hang.
    ``progress(done_bytes, total_bytes)``, when given, is called (from writer
    threads) as each chunk is hashed and written, deduplicated or packed.
    """

    def __init__(
        self,
        writer: ChunkWriter,
        settings: Settings,
        budget: ByteBudget,
        live_consumed: threading.Event | None = None,
        progress: Callable[[int, int], None] | None = None,
        staging: StagingPool | None = None,
        staged_bytes: int = 0,
    ) -> None:
        self.writer = writer
        self.staging = staging  # device tensors are copied through its pinned buffers
        if staged_bytes:
            # Buffers an async take staged hold their share of the budget until the end,
            # so copies made now fit in the rest; never all of it: a chunk must still fit.
            budget.acquire(min(staged_bytes, max(0, budget.limit - settings.chunk_size)))
        self.settings = settings
        self.budget = budget
        self.live_consumed = live_consumed if live_consumed is not None else threading.Event()
        self._live = _Countdown(self.live_consumed)
        self._progress = progress
        self._done = self._total = 0
        self._lock = threading.Lock()

    def run(self, requests: Sequence[WriteRequest]) -> Written:
        """Write every request (live ones first); returns each request's chunk refs by key."""
        futures: dict[str, list[Future[ChunkRef]]] = {}
        small: list[tuple[list[str], Future[list[str]]]] = []
        try:
            ordered = [r for r in requests if r.live] + [r for r in requests if not r.live]
            self._total = sum(r.nbytes for r in ordered)
            limit = self.settings.pack_limit
            # A few groups' copies fit the budget at once, while hashing runs behind.
            group_limit = max(1, min(SMALL_GROUP_BYTES, self.budget.limit // 4))
            group: list[WriteRequest] = []
            group_bytes = 0
            for req in ordered:
                if req.nbytes == 0:  # an empty tensor: no chunk
                    futures[req.key] = []
                elif req.nbytes < limit:  # one chunk: the pack limit is below the chunk size
                    group.append(req)
                    group_bytes += req.nbytes
                    if group_bytes >= group_limit or len(group) >= SMALL_GROUP_ITEMS:
                        small.append(self._submit_small(group, group_bytes))
                        group, group_bytes = [], 0
                else:
                    futures[req.key] = self._submit(req)
            if group:
                small.append(self._submit_small(group, group_bytes))
            self._live.arm()
            self.writer.finish([f for fs in futures.values() for f in fs])
        finally:
            self.live_consumed.set()
        out = Written({key: [f.result() for f in fs] for key, fs in futures.items()})
        ref_of = self.writer.ref_of
        for keys, work in small:
            for key, h in zip(keys, work.result(), strict=True):
                out.single[key] = ref_of(h)
        return out

    def _submit_small(
        self, group: list[WriteRequest], nbytes: int
    ) -> tuple[list[str], Future[list[str]]]:
        """One work item for many single-chunk requests, their bytes copied here.

        Copying a small tensor's bytes (one ``string_at``) costs less than
        viewing them in place, and frees it at once: training may change a live
        tensor as soon as this returns. The copies are held in the budget until
        the work item is done.
        """
        self.budget.acquire(nbytes)
        try:
            data = [_copy_of(req) for req in group]
        except BaseException:
            self.budget.release(nbytes)
            raise
        digests = None
        if any(req.digests for req in group):
            digests = [req.digests[0] if req.digests else None for req in group]
        work = self.writer.add_small(data, [req.elem_size for req in group], digests)
        work.add_done_callback(self._small_done(nbytes))
        return [req.key for req in group], work

    def _small_done(self, nbytes: int) -> Callable[[Future[list[str]]], None]:
        progress = self._progress

        def done(_work: Future[list[str]]) -> None:
            self.budget.release(nbytes)
            if progress is not None:
                with self._lock:
                    self._done += nbytes
                    progress(self._done, self._total)

        return done

    def _submit(self, req: WriteRequest) -> list[Future[ChunkRef]]:
        """One future per chunk of a request of at least the pack limit (never empty)."""
        cs = self.settings.chunk_size
        count = math.ceil(req.nbytes / cs)
        pool = self.staging
        # A live tensor on the device path (a staged one is host memory of the pool already).
        if (
            req.live
            and req.tensor is not None
            and pool is not None
            and pool.uses_device_path(req.tensor)
        ):
            return self._submit_pieces(req, pool)
        if req.cost:
            self.budget.acquire(req.cost)  # the host copy stays under the budget
        view, owner = req.view()
        live = self._live if req.live else None
        if live is not None:
            live.add(count)
        release = _Release(count, self.budget, req.cost, owner, live)
        digests = req.digests
        return [
            self.writer.add(
                view[i * cs : (i + 1) * cs],
                self._counted(release, min(cs, req.nbytes - i * cs)),
                req.elem_size,
                digests[i] if digests else None,
                self.writer.base_of(req.key, i, cs) if req.tensor is not None else None,
            )
            for i in range(count)
        ]

    def _submit_pieces(self, req: WriteRequest, pool: StagingPool) -> list[Future[ChunkRef]]:
        """A device tensor, copied chunk by chunk into pool buffers one piece ahead of the
        writer: chunk i is handed to a worker once its own copy landed, while chunk i+1
        copies. Each piece holds its bytes of the budget until its chunk is written."""
        assert req.tensor is not None
        cs, n = self.settings.chunk_size, req.nbytes
        count = math.ceil(n / cs)
        raw, slot = raw_bytes(req.tensor), pool.next_slot()
        live = self._live if req.live else None
        if live is not None:
            live.add(count)
        futures: list[Future[ChunkRef]] = []

        def submit(i: int, piece: PieceCopy) -> None:
            piece.wait()  # this chunk's copy only: the next one keeps running
            if live is not None:
                live.done()  # in a private host buffer now: training may change the tensor
            size = len(piece.view)

            def done() -> None:
                piece.give_back()
                self.budget.release(size)

            digest = req.digests[i] if req.digests else None
            on_done = self._counted(done, size)
            futures.append(self.writer.add(piece.view, on_done, req.elem_size, digest))

        ahead: deque[tuple[int, PieceCopy]] = deque()
        for i in range(count):
            size = min(cs, n - i * cs)
            self.budget.acquire(size)
            try:
                ahead.append((i, pool.copy_piece(raw, i * cs, i * cs + size, slot=slot)))
            except BaseException:
                self.budget.release(size)
                raise
            # One piece ahead, unless two pieces do not fit the budget (it would wait forever).
            if len(ahead) > 1 or 2 * cs > self.budget.limit:
                submit(*ahead.popleft())
        while ahead:
            submit(*ahead.popleft())
        return futures

    def _counted(self, release: Callable[[], None], nbytes: int) -> Callable[[], None]:
        """``release``, then this chunk's bytes reported to ``progress`` (if any)."""
        progress = self._progress
        if progress is None:
            return release

        def done() -> None:
            release()
            with self._lock:  # in order: the callback sees done_bytes increase
                self._done += nbytes
                progress(self._done, self._total)

        return done


def _copy_of(req: WriteRequest) -> bytes | memoryview:
    """A small request's bytes, as a private copy unless they are private already."""
    t = req.tensor
    if t is not None:
        if req.cost == 0:  # contiguous CPU memory: tensor_request and stage() checked
            return ctypes.string_at(t.data_ptr(), req.nbytes)
        view, _owner = host_view(t, req.key)
        return bytes(view)
    if req.load is not None:  # a lazy request (an import's mapped file): loaded now, copied
        view, _owner = req.load()
        return bytes(view)
    assert req.data is not None
    return bytes(req.data) if req.live else req.data


class Written(Mapping[str, list[ChunkRef]]):
    """Each request's chunk refs by key, as :meth:`Scheduler.run` returns them.

    A single-chunk request's list is made when asked for: an unchanged
    re-take compares it with the previous entry's and drops it, so 20,000
    small tensors leave no 20,000 lists behind for the garbage collector.
    """

    def __init__(self, lists: dict[str, list[ChunkRef]]) -> None:
        self.lists = lists
        self.single: dict[str, ChunkRef] = {}

    def __getitem__(self, key: str) -> list[ChunkRef]:
        ref = self.single.get(key)
        return [ref] if ref is not None else self.lists[key]

    def __iter__(self) -> Iterator[str]:
        yield from self.lists
        yield from self.single

    def __len__(self) -> int:
        return len(self.lists) + len(self.single)

    def __contains__(self, key: object) -> bool:
        return key in self.single or key in self.lists

    def get(self, key: str, default: Any = None) -> Any:
        # Mapping.get goes through __getitem__ and a KeyError: a take asks once per tensor.
        ref = self.single.get(key)
        if ref is not None:
            return [ref]
        return self.lists.get(key, default)


class _Release:
    """Called once per chunk of a request: counts live chunks, frees the copy after the last."""

    def __init__(
        self, count: int, budget: ByteBudget, cost: int, owner: Any, live: _Countdown | None
    ) -> None:
        self._left = count
        self._lock = threading.Lock()
        self._budget = budget
        self._cost = cost
        self._owner: Any = owner  # the staged copy stays alive until the last chunk
        self._live = live

    def __call__(self) -> None:
        if self._live is not None:
            self._live.done()  # this chunk's bytes are hashed and written or packed
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            if self._cost:
                self._budget.release(self._cost)
            self._owner = None


class _Countdown:
    """Sets ``event`` once every added chunk is done and :meth:`arm` was called."""

    def __init__(self, event: threading.Event) -> None:
        self._event = event
        self._lock = threading.Lock()
        self._left = 0
        self._armed = False

    def add(self, n: int) -> None:
        with self._lock:
            self._left += n

    def done(self) -> None:
        with self._lock:
            self._left -= 1
            fire = self._armed and self._left == 0
        if fire:
            self._event.set()

    def arm(self) -> None:
        """Every chunk has been added: from now on, zero means finished."""
        with self._lock:
            self._armed = True
            fire = self._left == 0
        if fire:
            self._event.set()
