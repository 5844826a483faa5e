"""Restore and read_object: validate everything first, then read only what is needed.

A restore plans before it touches anything: every requested stateful is
matched against the manifest, shapes and dtypes of in-place targets are
checked, pickled entries are refused without the opt-in, and with
``strict=True`` keys must match. Only then are chunks read (in place into
existing tensors where possible) and ``load_state_dict`` called with the
state dict the snapshot holds, RNG state last.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from casnap.chunks.budget import ByteBudget, allocating, check_allocation, check_budget
from casnap.chunks.read import read_chunks
from casnap.chunks.target import Chunked, Discard, ReadTarget, Routes
from casnap.errors import (
    MissingKeyError,
    ObjectLoadError,
    PickleNotAllowedError,
    UnsupportedValueError,
)
from casnap.format.entries import ChunkRef, ObjectEntry, ShardedEntry, TensorEntry
from casnap.format.manifest import Manifest
from casnap.format.names import escape_key
from casnap.format.tree import missing_key, subtree
from casnap.repo.repository import RepoStorage
from casnap.restore.keys import check_keys, failed_load_note
from casnap.restore.progress import Progress, counted
from casnap.restore.reshard import ShardedSink
from casnap.restore.undo import Guarded, Undo, UndoPool
from casnap.settings import read_workers_for
from casnap.torch_io import quantized
from casnap.torch_io.flatten import inflate, leaves_of
from casnap.torch_io.stateful import RNGState
from casnap.torch_io.tensors import TensorSink, check_target, fills_in_place


@dataclass
class _Load:
    """What one read must fetch: tensors (with in-place targets) and pickled objects."""

    tensors: dict[str, tuple[TensorEntry, torch.Tensor | None]]
    objects: dict[str, ObjectEntry]
    sharded: dict[str, ShardedSink]
    # Quantized entries, read as fresh integer tensors, then landed in these targets.
    quantized: dict[str, torch.Tensor | None] = field(default_factory=dict)


def _plan_subtree(
    manifest: Manifest,
    key: str,
    target: dict[str, Any],
    allow_pickle: bool,
    load: _Load,
) -> list[str]:
    """Add the reads under ``key`` to ``load``; return the keys found in the snapshot."""
    keys = subtree(manifest.entries, key)
    for k in keys:
        entry = manifest.entries[k]
        if isinstance(entry, TensorEntry) and entry.quantized is not None:
            dest = target.get(k)
            dest = dest if isinstance(dest, torch.Tensor) else None
            if dest is not None:
                quantized.check_target(k, dest, entry)
            load.tensors[k] = (entry, None)
            load.quantized[k] = dest
        elif isinstance(entry, TensorEntry):
            dest = target.get(k)
            if isinstance(dest, torch.Tensor):
                check_target(k, dest, entry.dtype, entry.shape)
                load.tensors[k] = (entry, dest)
            else:
                load.tensors[k] = (entry, None)
        elif isinstance(entry, ShardedEntry):
            load.sharded[k] = ShardedSink(k, entry, target.get(k))  # validates the target
        elif isinstance(entry, ObjectEntry):
            if not allow_pickle:
                raise PickleNotAllowedError(
                    f"{k}: this entry is a pickled {entry.type_name}; loading it runs code "
                    "from the snapshot. Pass allow_pickle=True only for snapshots you trust",
                    k,
                )
            load.objects[k] = entry
    return keys


def check_app_state(app_state: Mapping[str, Any]) -> None:
    """Raise if an ``app_state`` key is not a string or a value lacks ``state_dict()`` or
    ``load_state_dict()`` (a ``TypeError``): needs no snapshot, so it runs before any read."""
    for key, stateful in app_state.items():
        if not isinstance(key, str) or not key:
            raise UnsupportedValueError(f"app_state keys must be non-empty strings, got {key!r}")
        for method in ("state_dict", "load_state_dict"):
            if not callable(getattr(stateful, method, None)):
                raise UnsupportedValueError(
                    f"app_state[{key!r}] is a {type(stateful).__name__} without {method}(); "
                    "wrap plain values in casnap.StateDict",
                    key,
                )


def _rank_independent(manifest: Manifest, prefix: str) -> bool:
    """Whether every data entry below ``prefix`` is replicated or sharded."""
    for k in subtree(manifest.entries, prefix):
        entry = manifest.entries[k]
        if isinstance(entry, ObjectEntry):
            return False
        if isinstance(entry, TensorEntry) and not entry.replicated:
            return False
    return True


def rank_prefix(manifest: Manifest, key: str, rank: int) -> str:
    """Where ``rank`` finds app_state ``key`` (docs/distributed.md, elasticity rules).

    Its own ``<rank>/<key>`` if saved; else, for a rank the saving job did not
    have, rank 0's copy when everything below it is replicated or sharded.
    Per-rank state of a rank that was never saved raises before anything is read.
    """
    own = f"{rank}/{escape_key(key)}"
    if own in manifest.entries or rank == 0:
        return own
    fallback = f"0/{escape_key(key)}"
    if fallback not in manifest.entries:
        return own
    if _rank_independent(manifest, fallback):
        return fallback
    raise MissingKeyError(
        f"app_state key {key!r} holds per-rank state, and rank {rank} has none in this "
        f"snapshot (taken with world_size {manifest.world_size}); per-rank state restores "
        "only onto the rank that saved it",
        own,
    )


def restore_state(
    repo: RepoStorage,
    manifest: Manifest,
    app_state: Mapping[str, Any],
    *,
    rank: int,
    strict: bool,
    allow_pickle: bool,
    memory_budget_bytes: int | None,
    progress: Progress | None = None,
) -> None:
    """Load ``manifest`` into ``app_state``: validate all, read all, then ``load_state_dict``.

    Each stateful gets the state dict the snapshot holds for it (as
    torchsnapshot builds it): members its current state lacks are
    materialized, a member it holds as a tensor of the stored dtype and shape
    receives the bytes in place (the state dict hands it that same tensor),
    and its ``load_state_dict`` decides what to accept. ``strict`` adds
    casnap's key check: the target's keys and the snapshot's must match,
    checked before anything is read.
    """
    check_app_state(app_state)
    plans: list[tuple[str, Any, str]] = []
    load = _Load({}, {}, {})
    for key, stateful in app_state.items():
        prefix = rank_prefix(manifest, key, rank)
        if prefix not in manifest.entries:
            raise MissingKeyError(
                f"app_state key {key!r} is not in the snapshot (looked for {prefix!r}); "
                "restore a subset of the app_state the snapshot was taken with",
                key,
            )
        target: dict[str, Any] = {}
        leaves_of(stateful.state_dict(), prefix, target)
        stored = _plan_subtree(manifest, prefix, target, allow_pickle, load)
        if strict:
            check_keys(manifest, key, stored, target)
        plans.append((key, stateful, prefix))
    values = load_values(repo, load, memory_budget_bytes, progress)
    # RNG state goes last so that no other load_state_dict can consume randomness after it.
    plans.sort(key=lambda p: isinstance(p[1], RNGState))
    for n, (key, stateful, prefix) in enumerate(plans):
        state = inflate(manifest.entries, prefix, values, {})  # the snapshot's own structure
        try:
            stateful.load_state_dict(state)
        except Exception as exc:
            exc.add_note(failed_load_note(key, [p[0] for p in plans[:n]]))
            raise


@dataclass
class _Reads:
    """One batch of chunk reads: the read's target, under which budget.

    How plain and sharded entries split the budget into batches:
    docs/pipeline.md, "A failed restore" (its "Memory" paragraph). Every batch
    runs through the same verified reader (:func:`casnap.chunks.read_chunks`).
    """

    refs: list[ChunkRef]
    target: ReadTarget
    budget: ByteBudget
    undo: tuple[UndoPool, int] | None = None  # the pool's limit while this batch reads
    staged: list[tuple[ShardedSink, set[int]]] = field(default_factory=list)

    def run(self, repo: RepoStorage, pool: ThreadPoolExecutor) -> None:
        if self.undo is not None:
            self.undo[0].limit = self.undo[1]
        for sink, shards in self.staged:
            sink.allocate(shards)
        if self.refs:
            read_chunks(repo, self.refs, self.target, pool, self.budget)
        for sink, shards in self.staged:
            sink.copy_out(shards)


def _verify_first(refs: list[ChunkRef], limit: int) -> _Reads:
    """Reads that only verify (the bytes are dropped): for targets no budget can keep whole."""
    return _Reads(refs, Discard(), ByteBudget(limit))


def load_values(
    repo: RepoStorage,
    load: _Load,
    memory_budget_bytes: int | None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Read every planned tensor, object and sharded entry; returns them by key.

    ``progress(done_bytes, total_bytes)`` is called as chunks verify and land.

    The one read path of restore and ``read_object``: plain and sharded
    entries become batches of reads (:class:`_Reads`) run one after another
    through the verified reader, each under its share of the budget. A read
    that fails leaves every target tensor at its previous value or the
    snapshot's, never a mix (docs/pipeline.md, "A failed restore").
    """
    limit = check_budget(memory_budget_bytes)
    check_allocation(_allocations(load), "this read")
    sinks: dict[str, TensorSink] = {}
    for k, (e, dest) in load.tensors.items():
        with allocating(k, e.nbytes):
            sinks[k] = TensorSink(e.dtype, e.shape, e.chunk_size, dest)
    blobs: dict[str, bytearray] = {}
    for k, o in load.objects.items():
        with allocating(k, o.size):
            blobs[k] = bytearray(o.size)
    for k, s in load.sharded.items():
        with allocating(k, s.fresh_bytes):
            s.materialize()
    undo = Undo()
    # Pickled objects first, unpickled before any tensor is written: unpickling
    # can fail on verified bytes too (a class that no longer exists), and then
    # no target has been touched.
    objs = list(load.objects)
    first = [_plain_batch(load, objs, sinks, blobs, limit, undo, {}, 0)] if objs else []
    batches = [*_plain_reads(load, sinks, blobs, limit, undo), *_sharded_reads(load.sharded, limit)]
    if progress is not None:
        both = counted([*first, *batches], progress)  # one running total over both
        first, batches = both[: len(first)], both[len(first) :]
    workers = read_workers_for(repo.root.capabilities.local)
    try:
        with ThreadPoolExecutor(workers, thread_name_prefix="casnap-r") as pool:
            for reads in first:
                reads.run(repo, pool)
            objects = {key: _unpickle(key, blob) for key, blob in blobs.items()}
            for reads in batches:
                reads.run(repo, pool)
    except BaseException:
        undo.rollback()  # every reader has stopped: the pool was shut down
        raise
    values: dict[str, Any] = {k: s.finish() for k, s in sinks.items()}
    for k, dest in load.quantized.items():
        values[k] = quantized.land(load.tensors[k][0], values[k], dest)
    values.update((k, s.result) for k, s in load.sharded.items())
    values.update(objects)
    return values


def _unpickle(key: str, blob: bytearray) -> Any:
    """A pickled entry's object (only reached with ``allow_pickle=True``)."""
    try:
        return pickle.loads(blob)
    except Exception as exc:
        raise ObjectLoadError(
            f"{key}: the pickled object cannot be loaded here: {exc!r} (its bytes verify; "
            "is the class it needs importable?)",
            key,
        ) from exc


def _allocations(load: _Load) -> dict[str, int]:
    """Bytes each planned entry makes the read allocate, known from the manifest alone.

    New tensors, staging copies of targets that cannot be filled in place,
    pickled objects' bytes, new sharded tensors and the largest stored shard
    staged for one. A manifest is untrusted: these are checked against the
    memory ceiling before the first allocation.
    """
    needs: dict[str, int] = {}
    for k, (entry, dest) in load.tensors.items():
        if dest is None or not fills_in_place(dest):
            needs[k] = entry.nbytes
    for k, obj in load.objects.items():
        needs[k] = obj.size
    for k, sink in load.sharded.items():
        staged = max((n for _si, n in sink.shard_units()), default=0)
        needs[k] = sink.fresh_bytes + staged
    return needs


def _plain_reads(
    load: _Load,
    sinks: dict[str, TensorSink],
    blobs: dict[str, bytearray],
    limit: int,
    undo: Undo,
) -> list[_Reads]:
    """The reads of every plain tensor, in batches (pickled objects: :func:`load_values`):
    a batch's in-place tensors fit half the budget, a larger one is verified first
    (docs/pipeline.md, "A failed restore")."""
    share = max(1, limit // 2)
    guarded: dict[str, int] = {}  # in-place tensor -> its bytes, the most it may save
    oversized: list[ChunkRef] = []
    for key, (entry, _dest) in load.tensors.items():
        sink = sinks[key]
        if sink.target is None or sink.buffer is not sink.target or not entry.chunks:
            continue  # a fresh tensor, or staged and copied in once complete
        if entry.nbytes > share:
            oversized.extend(entry.chunks)
        else:
            guarded[key] = entry.nbytes
    batches: list[_Reads] = [_verify_first(oversized, limit)] if oversized else []
    group: list[str] = []
    saved = 0
    keys = list(load.tensors)  # pickled objects are read before, on their own
    for n, key in enumerate(keys):
        group.append(key)
        saved += guarded.get(key, 0)
        nxt = guarded.get(keys[n + 1], 0) if n + 1 < len(keys) else None
        if nxt is None or saved + nxt > share:
            batches.append(_plain_batch(load, group, sinks, blobs, limit, undo, guarded, saved))
            group, saved = [], 0
    return batches


def _plain_batch(
    load: _Load,
    keys: list[str],
    sinks: dict[str, TensorSink],
    blobs: dict[str, bytearray],
    limit: int,
    undo: Undo,
    guarded: dict[str, int],
    saved: int,
) -> _Reads:
    """The reads of ``keys``: a guarded tensor keeps what its chunks overwrite."""
    refs: list[ChunkRef] = []
    parts: list[tuple[ReadTarget, int]] = []
    for key in keys:
        target: ReadTarget
        if key in load.tensors:
            entry: TensorEntry | ObjectEntry = load.tensors[key][0]
            target = sinks[key]
            if key in guarded:
                guard = undo.guard(sinks[key].view, entry.chunk_size, len(entry.chunks))
                target = Guarded(sinks[key], guard)
        else:
            entry = load.objects[key]
            target = Chunked(blobs[key], entry.chunk_size)
        refs.extend(entry.chunks)
        parts.extend((target, i) for i in range(len(entry.chunks)))
    budget = ByteBudget(max(1, limit - saved))
    return _Reads(refs, Routes(parts), budget, undo=(undo.pool, saved))


def _sharded_reads(sharded: Mapping[str, ShardedSink], limit: int) -> list[_Reads]:
    """Batches of stored shards whose staging fits half the budget (reads get the rest).

    Each stored shard that overlaps the target is staged whole (one larger than
    half the budget alone). An in-place target whose shards span several
    batches is verified first (docs/pipeline.md, "A failed restore").
    """
    units = [(key, si, n) for key, s in sharded.items() for si, n in s.shard_units()]
    share = max(1, limit // 2)
    groups: list[dict[str, set[int]]] = []
    group: dict[str, set[int]] = {}
    staged = 0
    for i, (key, si, nbytes) in enumerate(units):
        group.setdefault(key, set()).add(si)
        staged += nbytes
        last = i == len(units) - 1
        if last or staged + units[i + 1][2] > share:
            groups.append(group)
            group, staged = {}, 0
    spread = [k for k, s in sharded.items() if s.in_place and sum(k in g for g in groups) > 1]
    verify = [ref for k in spread for _route, ref in sharded[k].needed()]
    batches = [_verify_first(verify, limit)] if verify else []
    reads_budget = max(1, limit - share)
    batches += [_shard_batch(sharded, g, ByteBudget(reads_budget)) for g in groups]
    return batches


def _shard_batch(
    sharded: Mapping[str, ShardedSink], group: dict[str, set[int]], budget: ByteBudget
) -> _Reads:
    """The reads of the stored shards ``group`` names, staged before and copied out after."""
    refs: list[ChunkRef] = []
    parts: list[tuple[ReadTarget, int]] = []
    for key, shards in group.items():
        for route, ref in sharded[key].needed_of(shards):
            refs.append(ref)
            parts.append((sharded[key], route))
    staged = [(sharded[key], shards) for key, shards in group.items()]
    return _Reads(refs, Routes(parts), budget, staged=staged)


def read_entry(
    repo: RepoStorage,
    manifest: Manifest,
    path: str,
    obj_out: Any,
    *,
    allow_pickle: bool,
    memory_budget_bytes: int | None,
) -> Any:
    if path not in manifest.entries:
        raise missing_key(path, manifest.entries)  # naming the nearest keys
    target: dict[str, Any] = {}
    if obj_out is not None:
        leaves_of(obj_out, path, target)
    load = _Load({}, {}, {})
    _plan_subtree(manifest, path, target, allow_pickle, load)
    values = load_values(repo, load, memory_budget_bytes)
    result = inflate(manifest.entries, path, values, target)
    if isinstance(obj_out, dict) and isinstance(result, dict) and obj_out is not result:
        obj_out.update(result)
        return obj_out
    return result
