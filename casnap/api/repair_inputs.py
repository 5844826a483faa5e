"""The sources :meth:`casnap.Repository.repair` is given, besides the repository itself.

Snapshots (names in the repository, or snapshot paths in any repository) are
read through the verified reader; live state (``torch.save`` files, objects
in memory) is cut the way takes cut tensors, with every chunk size the
repository's snapshots used, and loads the torch layer only when given.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from casnap.errors import CasnapError
from casnap.format.entries import TensorEntry
from casnap.ops.repair_sources import ChunkSource, SnapshotSource
from casnap.repo.locate import locate
from casnap.repo.repository import RepoStorage


def repair_sources(
    storage: RepoStorage,
    from_snapshots: Sequence[str],
    from_files: Sequence[str | Path],
    from_states: Sequence[Any],
) -> list[ChunkSource]:
    """The sources, in the order repair asks them: snapshots, then files, then states."""
    sources: list[ChunkSource] = []
    for snap in from_snapshots:
        if "/" not in str(snap) and storage.has_ref(str(snap)):
            other, name = storage, str(snap)
        else:
            other, name = locate(str(snap), None, create=False, existing=True)
        manifest = other.read_manifest(other.resolve(name))
        sources.append(SnapshotSource(other, [manifest], f"snapshot {snap}"))
    if from_files or from_states:
        from casnap.torch_io.live import LiveSource, load_state_file  # the torch layer

        sizes = chunk_sizes(storage)
        for path in from_files:
            sources.append(LiveSource(load_state_file(path), sizes, f"file {path}"))
        for i, state in enumerate(from_states):
            sources.append(LiveSource(state, sizes, f"live state #{i}"))
    return sources


def chunk_sizes(storage: RepoStorage) -> set[int]:
    """Every chunk size the snapshots' tensors were cut with (and the repository's)."""
    sizes = {storage.config.chunk_size}
    for name in storage.list_snapshots():
        try:
            m = storage.read_manifest(storage.resolve(name))
        except CasnapError:
            continue
        sizes.update(e.chunk_size for e in m.entries.values() if isinstance(e, TensorEntry))
    return sizes
