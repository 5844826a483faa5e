"""A take's plan: what it may reference without writing, and what it can reuse.

The plan of a take is its parents' manifests: where every chunk lives and
what every entry looks like. :func:`known_chunks` gathers the chunks a take
may reference (the parents', then the local index's); :data:`LAST_PLAN`
keeps the manifest this process committed last, so the next take of the same
structure needs neither to read it back nor to rebuild unchanged entries
(docs/pipeline.md).
"""

from __future__ import annotations

import threading

import torch

from casnap import index
from casnap.errors import CasnapError
from casnap.format.manifest import ChunkRef, Entry, Manifest, TensorEntry
from casnap.index import KnownChunks
from casnap.repo.repository import RepoStorage, manifest_key
from casnap.torch_io.tensors import dtype_name


class LastPlan:
    """The manifest this process last committed, per repository: the next take's plan.

    A take with the same structure as the previous one (the usual every-N-steps
    loop) finds its parent's chunk locations here instead of reading and
    validating the parent manifest again, and reuses every entry whose chunks
    did not change instead of building it anew. Only a manifest this process
    wrote itself is kept (it was validated when built), one per repository.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_repo: dict[str, tuple[str, Manifest]] = {}

    def put(self, repo_id: str, manifest_hash: str, manifest: Manifest) -> None:
        with self._lock:
            self._by_repo[repo_id] = (manifest_hash, manifest)

    def get(self, repo_id: str, manifest_hash: str) -> Manifest | None:
        with self._lock:
            hit = self._by_repo.get(repo_id)
        return hit[1] if hit is not None and hit[0] == manifest_hash else None

    def clear(self) -> None:
        with self._lock:
            self._by_repo.clear()


LAST_PLAN = LastPlan()


def known_chunks(repo: RepoStorage, parents: list[str]) -> KnownChunks:
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
        manifest = LAST_PLAN.get(repo.config.repo_id, parent)
        if manifest is not None and repo.store.exists(manifest_key(parent)):
            # Written by this process, and still stored: gc deletes a manifest before
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
