"""Reading a sharded entry into any target layout, fetching only overlapping chunks.

A target is a set of boxes of the global tensor (a DTensor's or a
ShardedTensor's local shards, or the whole tensor for a plain one). For every
stored shard that overlaps a target box, only the chunks holding the overlap
are fetched: in a row-major shard the overlap is a set of contiguous runs
along the last dimension, and each run maps to a range of chunks.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import torch

from casnap.chunks.target import Buffer, ReadTarget
from casnap.errors import IntegrityError, ShapeMismatchError
from casnap.format.entries import DTYPE_ITEMSIZE, ChunkRef, Quantization, ShardedEntry, ShardRecord
from casnap.torch_io import quantized
from casnap.torch_io.sharded import LocalShard, global_shape, target_regions
from casnap.torch_io.tensors import byte_view, copy_bits, dtype_name, torch_dtype

_MAX_RUNS = 1 << 16  # beyond this many runs, fetch the enclosing byte span instead


def _overlap(
    a_off: tuple[int, ...], a_size: tuple[int, ...], b_off: list[int], b_size: list[int]
) -> tuple[list[int], list[int]] | None:
    lo = [max(x, y) for x, y in zip(a_off, b_off, strict=True)]
    hi = [min(x + s, y + t) for x, s, y, t in zip(a_off, a_size, b_off, b_size, strict=True)]
    if any(h <= low for low, h in zip(lo, hi, strict=True)):
        return None
    return lo, hi


def _byte_runs(shard: ShardRecord, lo: list[int], hi: list[int], itemsize: int) -> list[range]:
    """Byte ranges of the box ``lo``..``hi`` inside ``shard``'s row-major bytes."""
    sizes, offs = shard.sizes, shard.offsets
    if not sizes:
        return [range(0, itemsize)]
    strides = [itemsize * math.prod(sizes[d + 1 :]) for d in range(len(sizes))]
    a = [low - o for low, o in zip(lo, offs, strict=True)]
    b = [h - o for h, o in zip(hi, offs, strict=True)]
    # Trailing dimensions taken whole merge into one run with the dimension before them.
    d = len(sizes) - 1
    while d > 0 and a[d] == 0 and b[d] == sizes[d]:
        d -= 1
    run = (b[d] - a[d]) * strides[d]
    lead = [range(a[i], b[i]) for i in range(d)]
    count = math.prod(len(r) for r in lead)
    base = a[d] * strides[d]
    if count > _MAX_RUNS:
        first = sum(a[i] * strides[i] for i in range(d)) + base
        last = sum((b[i] - 1) * strides[i] for i in range(d)) + base + run
        return [range(first, last)]
    runs = []
    for idx in itertools.product(*lead):
        start = sum(i * s for i, s in zip(idx, strides, strict=False)) + base
        runs.append(range(start, start + run))
    return runs


class ShardedSink(ReadTarget):
    """Plans and performs the read of one sharded entry into ``target``.

    Construction validates (dtype, global shape, coverage) without modifying
    anything; :meth:`needed` lists the chunks to fetch, :meth:`consume` receives
    them (the read's target: :class:`~casnap.chunks.target.ReadTarget`) and
    :meth:`copy_out` copies the overlaps into the target.
    """

    def __init__(self, key: str, entry: ShardedEntry, target: Any) -> None:
        self.key = key
        self.entry = entry
        self.dtype = torch_dtype(entry.dtype)
        self.itemsize = DTYPE_ITEMSIZE[entry.dtype]
        regions = target_regions(target, key) if target is not None else None
        # Quantized shards (docs/format.md, "Quantized tensors"): a plain target, or
        # none, gets the whole tensor once read, as from a quantized tensor entry;
        # otherwise each target box receives the dequantized values.
        self._whole_q: Quantization | None = None
        self._land: torch.Tensor | None = None
        self._dequantize = entry.quantized_shards
        if entry.quantized_shards:
            _check_quantized(key, entry, target)
            q = _uniform(entry)
            if regions is None and (q is not None or target is None):
                self._whole_q, self._land, self._dequantize, target = q, target, False, None
        self.in_place = target is not None  # the target's boxes change as shards are copied out
        if target is not None:
            if not entry.quantized_shards:
                _check(key, entry, target)
            if regions is None:
                regions = [LocalShard((0,) * len(entry.shape), tuple(entry.shape), target)]
            self._result = target
        else:
            # Allocated by materialize(), once the reader has checked what
            # the whole read allocates against the memory ceiling (fresh_bytes).
            whole = torch.empty(entry.shape, dtype=self.dtype, device="meta")
            regions = [LocalShard((0,) * len(entry.shape), tuple(entry.shape), whole)]
            self._result = whole
        # (target region, stored shard index, overlap lo, hi)
        self.copies: list[tuple[LocalShard, int, list[int], list[int]]] = []
        chunks: dict[int, set[int]] = {}
        for region in regions:
            covered = 0
            for si, shard in enumerate(entry.shards):
                box = _overlap(region.offsets, region.sizes, shard.offsets, shard.sizes)
                if box is None:
                    continue
                lo, hi = box
                covered += math.prod(h - low for low, h in zip(lo, hi, strict=True))
                self.copies.append((region, si, lo, hi))
                cs = shard.chunk_size
                for run in _byte_runs(shard, lo, hi, self.itemsize):
                    if len(run):
                        chunks.setdefault(si, set()).update(
                            range(run.start // cs, (run.stop - 1) // cs + 1)
                        )
            if covered != math.prod(region.sizes):
                raise IntegrityError(
                    f"{key}: the stored shards do not cover the target box at offsets "
                    f"{list(region.offsets)} sizes {list(region.sizes)}",
                    key,
                )
        self._needed = [(si, ci) for si in sorted(chunks) for ci in sorted(chunks[si])]
        self._buffers: dict[int, tuple[torch.Tensor, memoryview]] = {}

    def needed(self) -> list[tuple[int, ChunkRef]]:
        """(route id, chunk) pairs to fetch; route ids are handed back to :meth:`consume`."""
        return [(i, self.entry.shards[si].chunks[ci]) for i, (si, ci) in enumerate(self._needed)]

    def needed_of(self, shards: set[int]) -> list[tuple[int, ChunkRef]]:
        """:meth:`needed`, restricted to the chunks of the stored shards ``shards``."""
        return [
            (i, self.entry.shards[si].chunks[ci])
            for i, (si, ci) in enumerate(self._needed)
            if si in shards
        ]

    def shard_units(self) -> list[tuple[int, int]]:
        """(stored shard, staging bytes) of every stored shard this read needs.

        A stored shard is staged whole (the overlap boxes are sliced out of it),
        so a reader bounded by a memory budget stages a group of shards at a
        time: :meth:`allocate`, fetch :meth:`needed_of`, :meth:`copy_out`.
        """
        shards = sorted({si for si, _ in self._needed})
        return [(si, math.prod(self.entry.shards[si].sizes) * self.itemsize) for si in shards]

    def _buffer(self, si: int) -> tuple[torch.Tensor, memoryview]:
        if si not in self._buffers:
            t = torch.empty(self.entry.shards[si].sizes, dtype=self.dtype)
            self._buffers[si] = (t, byte_view(t))
        return self._buffers[si]

    @property
    def fresh_bytes(self) -> int:
        """Bytes of the new tensor this read returns (0 when restoring into a target)."""
        return 0 if self.in_place else self.entry.nbytes

    def materialize(self) -> None:
        """Allocate the new tensor this read returns (a no-op when restoring into a target)."""
        if self._result.device.type != "meta":
            return
        whole = torch.empty(self.entry.shape, dtype=self.dtype)
        self.copies = [
            (LocalShard(r.offsets, r.sizes, whole) if r.tensor is self._result else r, si, lo, hi)
            for r, si, lo, hi in self.copies
        ]
        self._result = whole

    @property
    def result(self) -> Any:
        """The read value: the target, or the new tensor (quantized shards: rebuilt, landed)."""
        if self._whole_q is not None:
            value = quantized.rebuild(self._result, self._whole_q)
            self._result = quantized.land_value(value, self._whole_q, self._land)
            self._whole_q = None
        return self._result

    def allocate(self, shards: set[int]) -> None:
        """Allocate the staging buffers of ``shards`` (before their reads start, one thread)."""
        self.materialize()
        for si in sorted(shards):
            self._buffer(si)

    def consume(self, route: int, data: Buffer) -> None:
        si, ci = self._needed[route]
        cs = self.entry.shards[si].chunk_size
        view = self._buffers[si][1]
        view[ci * cs : ci * cs + len(data)] = data

    def copy_out(self, shards: set[int]) -> None:
        """Copy the overlaps of ``shards`` (fetched) into the target and free their buffers."""
        for region, si, lo, hi in self.copies:
            if si not in shards:
                continue
            src_t = self._buffer(si)[0]
            shard = self.entry.shards[si]
            if self._dequantize and shard.quantized is not None:
                src_t = quantized.rebuild(src_t, shard.quantized).dequantize()
            src = src_t[_box(lo, hi, shard.offsets)]
            dst = region.tensor[_box(lo, hi, region.offsets)]
            if self._dequantize:
                with torch.no_grad():
                    dst.copy_(src)
            else:
                copy_bits(dst, src)
        for si in shards:
            self._buffers.pop(si, None)


def _box(lo: list[int], hi: list[int], offsets: Sequence[int]) -> tuple[slice, ...]:
    """The global box ``lo``..``hi`` as slices of a tensor that starts at ``offsets``."""
    return tuple(slice(low - o, h - o) for low, h, o in zip(lo, hi, offsets, strict=True))


def _check(key: str, entry: ShardedEntry, target: Any) -> None:
    shape = list(global_shape(target))
    tdtype = target.dtype
    if shape != list(entry.shape) or tdtype != torch_dtype(entry.dtype):
        raise ShapeMismatchError(
            f"{key}: snapshot holds {entry.dtype}{list(entry.shape)}, the target is "
            f"{dtype_name(tdtype, key)}{shape}",
            key,
        )


def _uniform(entry: ShardedEntry) -> Quantization | None:
    """The quantization every shard shares, if one set of parameters rebuilds the whole."""
    first = entry.shards[0].quantized
    if first is None or any(s.quantized != first for s in entry.shards):
        return None
    if first.axis is not None and len(first.scales or ()) != entry.shape[first.axis]:
        return None  # per-channel parameters of a part of the axis
    return first


def _check_quantized(key: str, entry: ShardedEntry, target: Any) -> None:
    """Raise before anything is read if ``target`` cannot receive quantized shards."""
    q = entry.shards[0].quantized
    assert q is not None
    if target is None:
        if _uniform(entry) is None:
            raise ShapeMismatchError(
                f"{key}: its shards are {q.dtype} with different parameters, so no one "
                "quantized tensor holds them; read it into a floating-point tensor "
                "(obj_out) to receive the dequantized values",
                key,
            )
        return
    shape = list(global_shape(target))
    plain = target_regions(target, key) is None
    whole = plain and target.is_quantized and _uniform(entry) is not None
    if shape != list(entry.shape) or not (whole or target.dtype.is_floating_point):
        raise ShapeMismatchError(
            f"{key}: snapshot holds {q.dtype}{list(entry.shape)} shards; a "
            f"{str(target.dtype).removeprefix('torch.')}{shape} target can receive neither "
            "them nor their dequantized values",
            key,
        )
