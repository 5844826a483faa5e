"""Point-in-time copies of the chunks one rank writes in the background of an async take.

Planning hashes the live tensors in place (zero-copy for contiguous CPU
memory). Only after the exchange does a rank know which chunks it writes
(``mine``, from :func:`~casnap.distributed.plan.assign`), and only those
need a copy that training cannot change: a replicated model on N ranks
costs each rank about 1/N of it, not all of it. The copies are
``uint8`` buffers from the session's staging pool, reused from one take to
the next (chunks of one job mostly have the chunk size, so buckets match),
and go back to it when the background part ends.

Staging keeps at most ``limit`` bytes for the background (the staging share
of the memory budget, :func:`casnap.take.job.staging_limit`); the chunks beyond
it are the *overflow*, which the caller writes before ``async_take``
returns. Chunks whose bytes are already private (device-to-host or
non-contiguous copies made while hashing, pickled objects) are not copied
again but count against the limit, since the background keeps them alive.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from casnap.distributed.plan import LocalData
from casnap.torch_io.staging import StagingPool
from casnap.torch_io.tensors import byte_view


@dataclass
class StagedChunks:
    """Buffers to give back when the background part ends, and chunks left to write now."""

    buffers: list[torch.Tensor] = field(default_factory=list)
    overflow: list[str] = field(default_factory=list)
    kept_bytes: int = 0  # bytes the background keeps alive (staged or private)


def stage_chunks(local: LocalData, mine: list[str], limit: int, pool: StagingPool) -> StagedChunks:
    """Copy the live chunks of ``mine`` into pooled buffers, at most ``limit`` bytes kept.

    ``local.chunks`` then points at the copies. Called by every rank of an
    async take, after the exchange, in the caller's thread.
    """
    out = StagedChunks()
    try:
        for h in mine:
            view = local.chunks[h]
            if out.kept_bytes + len(view) > limit:
                out.overflow.append(h)
                continue
            out.kept_bytes += len(view)
            if h in local.live:
                buf = pool.stage(torch.frombuffer(view, dtype=torch.uint8), limit)
                out.buffers.append(buf)
                local.chunks[h], local.owners[h] = byte_view(buf), buf
                local.live.discard(h)
    except BaseException:
        pool.give_back(out.buffers)
        raise
    return out
