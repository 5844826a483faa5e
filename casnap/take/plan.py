"""A take's plan: what it may reference without writing, and what it can reuse.

The plan of a take is its parents' manifests: where every chunk lives and
what every entry looks like. :func:`known_chunks` gathers the chunks a take
may reference (the parents', then the local index's); a session's
:class:`~casnap.take.session.LastPlan` keeps the manifest it committed last,
so the next take of the same structure needs neither to read it back nor to
rebuild unchanged entries (docs/pipeline.md).
"""

from __future__ import annotations

import torch

from casnap import index
from casnap.errors import CasnapError
from casnap.format.manifest import ChunkRef, Entry, TensorEntry
from casnap.index import KnownChunks
from casnap.repo.repository import RepoStorage, manifest_key
from casnap.take.session import LastPlan
from casnap.torch_io.tensors import dtype_name


def known_chunks(
    repo: RepoStorage, parents: list[str], last_plan: LastPlan | None = None
) -> KnownChunks:
    """Chunks a take may reference without writing: its parents', and the local index's.

    Called inside the take's gc-exclusion window: opening the index reads the
    store's gc epoch, and index entries are trusted only while no gc has
    swept since (docs/index.md). The parents' chunk locations come from their
    manifests (one get each); every other chunk is looked up in the index by
    the ChunkWriter, so a take in a fresh process probes no chunk the index
    knows. Without the index (``CASNAP_INDEX=0``) this is the parents' chunks only.
    """
    known = KnownChunks(index.open_index(repo))
    summaries = []
    for parent in parents:
        manifest = last_plan.get(repo.config.repo_id, parent) if last_plan else None
        if manifest is not None and repo.store.exists(manifest_key(parent)):
            # Written by this session, and still stored: gc deletes a manifest before
            # its chunks and cannot run while this take's lease is held, so its
            # chunks are all there, exactly as if it had been read back (docs/gc.md).
            known.update((c.hash, c) for c in manifest.chunk_refs())
            continue
        try:
            manifest = repo.read_manifest(parent)
        except CasnapError:
            continue  # a parent that is gone only costs dedup, never correctness
        known.update((c.hash, c) for c in manifest.chunk_refs())
        summaries.append(index.summarize(parent, manifest))
    if known.index is not None and summaries:
        known.index.record_summaries(summaries)  # free for log/du: already read
    return known


def tensor_entry(
    key: str, t: torch.Tensor, chunk_size: int, chunks: list[ChunkRef], previous: Entry | None
) -> TensorEntry:
    """The entry of one tensor; the previous take's own object when nothing changed."""
    dtype, shape = dtype_name(t.dtype, key), list(t.shape)
    if (
        isinstance(previous, TensorEntry)
        and previous.chunks == chunks
        and previous.dtype == dtype
        and previous.shape == shape
        and previous.chunk_size == chunk_size
        and not previous.replicated
    ):
        return previous  # validated when it was built; frozen, so safe to share
    return TensorEntry(dtype=dtype, shape=shape, chunk_size=chunk_size, chunks=chunks)
