"""Chunks: deduplicating, packing writes and verified, budgeted reads.

:mod:`casnap.chunks.io` writes and reads chunk frames;
:mod:`casnap.chunks.budget` is the byte budget their threads share;
:mod:`casnap.chunks.bounce` the reused page-aligned buffers loose frames are
read into.
"""

from casnap.chunks.budget import ByteBudget
from casnap.chunks.io import (
    BatchItem,
    ChunkBatcher,
    ChunkWriter,
    WriteStats,
    object_name,
    plan_reads,
    read_chunks,
)

__all__ = [
    "BatchItem",
    "ByteBudget",
    "ChunkBatcher",
    "ChunkWriter",
    "WriteStats",
    "object_name",
    "plan_reads",
    "read_chunks",
]
