"""Object stores: the contract and its backends."""

from __future__ import annotations

from typing import Any

from casnap.store.base import (
    Capabilities,
    ObjectInfo,
    ObjectStore,
    PrefixStore,
    WrapperStore,
    check_key,
)
from casnap.store.counting import CountingStore
from casnap.store.fsspec_store import FsspecStore
from casnap.store.local import LocalStore
from casnap.store.retry import RetryingStore, RetryPolicy
from casnap.store.s3_store import S3Store

__all__ = [
    "Capabilities",
    "CountingStore",
    "FsspecStore",
    "LocalStore",
    "ObjectInfo",
    "ObjectStore",
    "PrefixStore",
    "RetryPolicy",
    "RetryingStore",
    "S3Store",
    "WrapperStore",
    "check_key",
    "open_store",
]


def open_store(url: str, storage_options: dict[str, Any] | None = None) -> ObjectStore:
    """The store for ``url``: a local directory for plain paths and ``file://``,
    :class:`S3Store` for ``s3://`` (S3 conditional writes), else fsspec.

    Remote stores come wrapped in a :class:`RetryingStore` (transient failures
    retried with backoff, ``store_retries`` times); a local disk's failures are
    not transient, so it is used as it is.
    """
    if url.startswith("file://"):
        url = url[len("file://") :]
    if "://" not in url:
        return LocalStore(url)
    if url.startswith(("s3://", "s3a://")):
        return RetryingStore(S3Store(url, storage_options))
    return RetryingStore(FsspecStore(url, storage_options))
