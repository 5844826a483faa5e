"""Chunks: deduplicating, packing writes and verified, budgeted reads.

:mod:`casnap.chunks.write` deduplicates and schedules chunk writes and
:mod:`casnap.chunks.frames` stores their frames (loose objects and packs);
:mod:`casnap.chunks.read` fetches, decodes and verifies them for one
:mod:`~casnap.chunks.target`;
:mod:`casnap.chunks.budget` is the byte budget their threads share;
:mod:`casnap.chunks.bounce` the reused page-aligned buffers loose frames are
read into.
"""

from casnap.chunks.budget import ByteBudget
from casnap.chunks.frames import WriteStats
from casnap.chunks.read import object_name, plan_reads, read_chunks
from casnap.chunks.target import ReadTarget
from casnap.chunks.write import ChunkWriter

__all__ = [
    "ByteBudget",
    "ChunkWriter",
    "ReadTarget",
    "WriteStats",
    "object_name",
    "plan_reads",
    "read_chunks",
]
