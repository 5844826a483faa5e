"""Amazon S3 (and S3-compatible servers) as an object store, through s3fs.

docs/s3.md says what casnap's contract needs from S3 and where each guarantee
comes from: atomic PUT, create-only by ``If-None-Match: *``, ``replace`` by
``If-Match: <etag>``, and ``conditional_writes`` (``"auto"``, true or false)
for servers without conditional writes. The other ``storage_options`` go to
:class:`s3fs.S3FileSystem`.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from typing import Any, ClassVar
from urllib.parse import urlsplit

from fsspec.asyn import sync

from casnap.errors import (
    ConfigError,
    ObjectChangedError,
    ObjectExistsError,
    ObjectNotFoundError,
    StoreError,
)
from casnap.store.base import Data, changed, join_parts
from casnap.store.fsspec_store import FsspecStore, _status_of
from casnap.store.fsspec_store import _translate as _translate_fsspec

# S3 error codes a repeat of the request may meet with success. 409
# ConditionalRequestConflict: another conditional write to the key was in
# flight; S3 asks the client to retry (the retry then meets 412 or succeeds).
_TRANSIENT_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "TooManyRequestsException",
    "RequestTimeout",
    "InternalError",
    "ServiceUnavailable",
    "ConditionalRequestConflict",
    "OperationAborted",
    "XAmzContentSHA256Mismatch",
}
# botocore's network failures (by name: botocore is imported only with s3fs).
_TRANSIENT_TYPES = {
    "EndpointConnectionError",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "HTTPClientError",
    "ResponseStreamingError",
    "IncompleteReadError",
}
_NOT_FOUND_CODES = {"NoSuchKey", "NotFound", "404"}
_PRECONDITION_FAILED = 412
_PROBED_ATTR = "_casnap_conditional_writes_proven"
_IF_MATCH_PROBED_ATTR = "_casnap_if_match_proven"
_WRONG_ETAG = '"00000000000000000000000000000000"'  # matches no object's ETag
_BOOLEAN_OPTIONS = ("anon", "use_ssl", "conditional_writes", "requester_pays")
_TRUE, _FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}


class S3Store(FsspecStore):
    """Objects below ``s3://bucket/prefix``; create-only puts are S3 conditional writes.

    ``capabilities.atomic_create`` is true unless the store was opened with
    ``conditional_writes=False`` (for a server that lacks them); with the
    default ``"auto"`` a server other than AWS is proven to honour conditional
    writes before the first create-only put, or that put fails.

    Example::

        store = S3Store("s3://bucket/run1", {"endpoint_url": "http://127.0.0.1:5000",
                                             "key": "...", "secret": "..."})
        store.put("a", b"1", create_only=True)
        store.put("a", b"2", create_only=True)  # raises ObjectExistsError
    """

    # A whole object in one GET. Without max_concurrency=1, s3fs first sends a HEAD for
    # the size (to split downloads above its 50 MiB block size): a second request per
    # chunk of every restore, for objects casnap's reader already fetches concurrently.
    _read_whole: ClassVar[dict[str, Any]] = {"max_concurrency": 1}

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        options = _s3_options(storage_options)
        conditional = options.pop("conditional_writes")
        self.conditional_writes: bool = conditional is not False
        # "auto" trusts AWS itself and proves any other server once, before the
        # first create-only put, since a server that ignores the header would
        # silently overwrite (docs/s3.md, "Servers without conditional writes").
        self._probe_pending = conditional == "auto" and _custom_endpoint(options) is not None
        retries = int(options.pop("retries"))
        try:
            from s3fs import S3FileSystem
        except ImportError as exc:
            raise StoreError(
                f"cannot open store {url!r}: s3:// needs s3fs (pip install s3fs: casnap's s3 extra)"
            ) from exc
        try:
            fs = S3FileSystem(**options)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"bad storage options for {url!r}: {exc}", "storage_options") from exc
        # A class attribute in s3fs, not an argument: set on this instance.
        fs.retries = retries
        protocol = url.split("://", 1)[0]
        root = S3FileSystem._strip_protocol(url)
        self._attach(
            fs,
            root,
            url,
            protocol,
            atomic_create=self.conditional_writes,
            conditional_replace=self.conditional_writes,
        )

    def put(self, key: str, data: Data, *, create_only: bool = False, durable: bool = True) -> None:
        try:
            if create_only and self._probe_pending and not vars(self.fs).get(_PROBED_ATTR):
                self._probe_conditional_writes()
            super().put(key, data, create_only=create_only, durable=durable)
        except StoreError as exc:
            if create_only and self.conditional_writes and _refuses_condition(exc):
                raise StoreError(
                    f"the S3 server behind {self.url!r} does not support conditional writes "
                    "(If-None-Match: *), which casnap uses to create objects only once; "
                    "open the repository with the storage option conditional_writes=false "
                    "(create-only is then atomic only within one process; docs/s3.md)",
                    key,
                ) from exc
            raise

    def replace(self, key: str, data: Data, *, expected: bytes | None) -> None:
        if expected is None or not self.conditional_writes:
            super().replace(key, data, expected=expected)  # create-only, or in-process
            return
        path = self._path(key)  # an invalid key fails before any request
        if self._probe_pending and not vars(self.fs).get(_IF_MATCH_PROBED_ATTR):
            self._probe_if_match()
        payload = join_parts(data)
        bucket, name, _ = self.fs.split_path(path)
        try:
            etag = sync(self.fs.loop, _etag_if_holding, self.fs, bucket, name, expected)
            if etag is None:
                raise changed(key)
            self.fs.pipe_file(path, payload, IfMatch=etag)
        except ObjectChangedError:
            raise
        except Exception as exc:
            err = self._translate(exc, key)
            if isinstance(err, (ObjectExistsError, ObjectNotFoundError)):
                raise changed(key) from exc  # 412: written since the GET; 404: deleted
            if _refuses_condition(err):
                raise StoreError(
                    f"the S3 server behind {self.url!r} does not support conditional writes "
                    "(If-Match); open the repository with the storage option "
                    "conditional_writes=false (docs/s3.md)",
                    key,
                ) from exc
            raise err from exc

    def _probe_if_match(self) -> None:
        """Prove that the server refuses a PUT whose ``If-Match`` names another ETag."""
        with self._probe_object() as probe:
            super().put(probe, b"1")
            try:
                self.fs.pipe_file(self._path(probe), b"2", IfMatch=_WRONG_ETAG)
            except Exception as exc:
                if isinstance(self._translate(exc, probe), ObjectExistsError):
                    vars(self.fs)[_IF_MATCH_PROBED_ATTR] = True
                    return
                raise self._translate(exc, probe) from exc
            raise StoreError(
                f"the S3 server behind {self.url!r} ignores conditional writes (If-Match): "
                "a conditional replace overwrote an object; open the repository with the "
                "storage option conditional_writes=false (docs/s3.md)",
                probe,
            )

    @contextlib.contextmanager
    def _probe_object(self) -> Iterator[str]:
        """A fresh key for a probe object, deleted afterwards (a leftover is harmless)."""
        probe = f"conditional-write-probe-{uuid.uuid4().hex}"
        try:
            yield probe
        finally:
            with contextlib.suppress(StoreError):
                self.delete(probe)

    def _probe_conditional_writes(self) -> None:
        """Prove that the server refuses a second conditional PUT of one key (then
        remembered on the s3fs client); raise if it overwrote instead."""
        with self._probe_object() as probe:
            super().put(probe, b"1", create_only=True)
            try:
                super().put(probe, b"2", create_only=True)
            except ObjectExistsError:
                vars(self.fs)[_PROBED_ATTR] = True
                return
            raise StoreError(
                f"the S3 server behind {self.url!r} ignores conditional writes "
                "(If-None-Match: *): a create-only put overwrote an object; open the "
                "repository with the storage option conditional_writes=false (docs/s3.md)",
                probe,
            )

    def _translate(self, exc: Exception, key: str) -> StoreError:
        if isinstance(exc, StoreError):
            return exc
        status, code = _s3_error(exc)
        if code == "NoSuchBucket":
            return ObjectNotFoundError(f"the bucket of {self.url!r} does not exist ({key!r})", key)
        if code in _NOT_FOUND_CODES:
            return ObjectNotFoundError(f"object {key!r} not found", key)
        # 412: a create-only put's "it exists", or a replace's "it changed" (replace
        # reads it so).
        if status == _PRECONDITION_FAILED or code == "PreconditionFailed":
            return ObjectExistsError(f"object {key!r} already exists", key)
        err = _translate_fsspec(exc, key)
        if type(err) is StoreError and (code in _TRANSIENT_CODES or _network_failure(exc)):
            err.transient = True
        return err


async def _etag_if_holding(fs: Any, bucket: str, key: str, expected: bytes) -> str | None:
    """The ETag of the object if it holds exactly ``expected`` (one GET: the bytes and
    the ETag of the same version), else None; a longer object's body is not read."""
    resp = await fs._call_s3("get_object", Bucket=bucket, Key=key)
    body = resp["Body"]
    try:
        if int(resp.get("ContentLength", -1)) != len(expected):
            return None
        current = await body.read()
    finally:
        body.close()
    return str(resp["ETag"]) if current == expected else None


def _s3_options(storage_options: dict[str, Any] | None) -> dict[str, Any]:
    """s3fs's options with casnap's defaults, booleans given as text read as booleans."""
    options: dict[str, Any] = {
        # A listing cached by one handle goes stale when another process
        # writes; gc decides what to delete from listings.
        "use_listings_cache": False,
        # One retry policy, RetryingStore's (bounded, documented): s3fs would
        # otherwise repeat each failed call 5 times inside every casnap attempt.
        "retries": 1,
        "conditional_writes": "auto",
        **(storage_options or {}),
    }
    for name in _BOOLEAN_OPTIONS:
        value = options.get(name)
        if name == "conditional_writes" and (
            value is None or (isinstance(value, str) and value.strip().lower() == "auto")
        ):
            options[name] = "auto"
        elif isinstance(value, str):
            word = value.strip().lower()
            if word not in _TRUE | _FALSE:
                allowed = "true, false or auto" if name == "conditional_writes" else "true or false"
                raise ConfigError(f"storage option {name}={value!r} is not {allowed}", name)
            options[name] = word in _TRUE
    return options


def _custom_endpoint(options: dict[str, Any]) -> str | None:
    """The endpoint the client will talk to if it is not AWS itself (None for AWS)."""
    endpoint = (
        options.get("endpoint_url")
        or (options.get("client_kwargs") or {}).get("endpoint_url")
        or os.environ.get("AWS_ENDPOINT_URL_S3")
        or os.environ.get("AWS_ENDPOINT_URL")
    )
    if not endpoint:
        return None
    host = urlsplit(str(endpoint)).hostname or ""
    return None if host == "amazonaws.com" or host.endswith(".amazonaws.com") else str(endpoint)


def _s3_error(exc: BaseException) -> tuple[int | None, str | None]:
    """The HTTP status and S3 error code of a failure, from the botocore response s3fs keeps."""
    err: BaseException | None = exc
    for _ in range(4):  # StoreError -> s3fs's OSError -> botocore's ClientError
        if err is None:
            break
        response = getattr(err, "response", None)
        if isinstance(response, dict):
            code = response.get("Error", {}).get("Code")
            return _status_of(err), str(code) if code is not None else None
        err = err.__cause__
    return _status_of(exc), None


def _network_failure(exc: BaseException) -> bool:
    err: BaseException | None = exc
    while err is not None:
        if any(t.__name__ in _TRANSIENT_TYPES for t in type(err).__mro__):
            return True
        err = err.__cause__
    return False


def _refuses_condition(exc: StoreError) -> bool:
    """Whether a create-only put failed because the server does not do conditional writes."""
    status, code = _s3_error(exc)
    return status == 501 or code == "NotImplemented"
