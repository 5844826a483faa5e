"""Numeric drift between two snapshots, reading only the chunks that differ."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from casnap.chunks.budget import ByteBudget, check_budget
from casnap.chunks.read import read_chunks
from casnap.chunks.target import Consumer
from casnap.format.entries import ChunkRef, TensorEntry
from casnap.format.manifest import Manifest
from casnap.ops.history import EntryDiff
from casnap.repo.repository import RepoStorage
from casnap.settings import DEFAULT_IO_WORKERS
from casnap.torch_io.tensors import torch_dtype


@dataclass(frozen=True)
class Drift:
    key: str
    max_abs_diff: float
    rel_l2: float  # ||b - a|| / ||a|| over the changed chunks
    bytes_read: int


def _values(
    repo: RepoStorage, refs: list[ChunkRef], dtype: torch.dtype, budget: ByteBudget
) -> list[torch.Tensor]:
    out: list[torch.Tensor | None] = [None] * len(refs)

    def sink(i: int, data: bytes | bytearray | memoryview) -> None:
        out[i] = torch.frombuffer(bytearray(data), dtype=dtype)

    with ThreadPoolExecutor(DEFAULT_IO_WORKERS) as pool:
        read_chunks(repo, refs, Consumer(sink), pool, budget)
    return [t for t in out if t is not None]


def drift(
    repo_a: RepoStorage,
    a: Manifest,
    repo_b: RepoStorage,
    b: Manifest,
    rows: list[EntryDiff],
    memory_budget_bytes: int | None = None,
) -> list[Drift]:
    """Per changed tensor of equal dtype, shape and chunking: max |b-a| and relative L2.

    Only the chunks whose hashes differ are read, from each side; unchanged
    chunks contribute nothing to the difference, so the max is exact and the
    relative L2 is measured over the changed region. Non-numeric dtypes
    (bool, sub-byte, float8) are compared after conversion to float64 where
    torch can convert them, and skipped otherwise.
    """
    budget = ByteBudget(check_budget(memory_budget_bytes))
    out = []
    for row in rows:
        ea, eb = a.entries.get(row.key), b.entries.get(row.key)
        if row.status != "changed" or not isinstance(ea, TensorEntry):
            continue
        if not isinstance(eb, TensorEntry) or (ea.dtype, ea.shape, ea.chunk_size) != (
            eb.dtype,
            eb.shape,
            eb.chunk_size,
        ):
            continue
        pairs = [(ca, cb) for ca, cb in zip(ea.chunks, eb.chunks) if ca.hash != cb.hash]
        dtype = torch_dtype(ea.dtype)
        try:
            torch.zeros(1, dtype=dtype).to(torch.float64)
        except (RuntimeError, TypeError):
            continue
        max_abs, diff_sq, base_sq, read = 0.0, 0.0, 0.0, 0
        # Bound the in-flight chunks of both sides by the budget.
        step = max(1, budget.limit // (2 * max(ea.chunk_size, 1)))
        for i in range(0, len(pairs), step):
            group = pairs[i : i + step]
            va = _values(repo_a, [p[0] for p in group], dtype, budget)
            vb = _values(repo_b, [p[1] for p in group], dtype, budget)
            read += sum(p[0].length + p[1].length for p in group)
            for x, y in zip(va, vb):
                target = torch.complex128 if x.is_complex() else torch.float64
                xf, yf = x.to(target), y.to(target)
                d, base = (yf - xf).abs(), xf.abs()
                if d.numel():
                    max_abs = max(max_abs, float(d.max()))
                diff_sq += float((d * d).sum())
                base_sq += float((base * base).sum())
        rel = math.sqrt(diff_sq) / math.sqrt(base_sq) if base_sq else math.inf if diff_sq else 0.0
        out.append(Drift(row.key, max_abs, rel, read))
    return out
