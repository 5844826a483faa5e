"""Object stores: the contract and its backends."""

from __future__ import annotations

from typing import Any

from casnap.store.base import Capabilities, ObjectStore, PrefixStore, check_key
from casnap.store.counting import CountingStore
from casnap.store.fsspec_store import FsspecStore
from casnap.store.local import LocalStore

__all__ = [
    "Capabilities",
    "CountingStore",
    "FsspecStore",
    "LocalStore",
    "ObjectStore",
    "PrefixStore",
    "check_key",
    "open_store",
]


def open_store(url: str, storage_options: dict[str, Any] | None = None) -> ObjectStore:
    """The store for ``url``: a local directory for plain paths and ``file://``, else fsspec."""
    if url.startswith("file://"):
        url = url[len("file://") :]
    if "://" not in url:
        return LocalStore(url)
    return FsspecStore(url, storage_options)
