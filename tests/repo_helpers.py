"""Repositories whose store counts every request (shared by the dedup, index and plan tests)."""

from __future__ import annotations

from casnap import Repository
from casnap.store import CountingStore, LocalStore


def counted_repo(root: str, chunk_size: int) -> tuple[Repository, CountingStore]:
    """A repository at ``root`` (created if needed) on a :class:`CountingStore`."""
    store = CountingStore(LocalStore(root))
    return Repository.on_store(store, chunk_size=chunk_size), store
