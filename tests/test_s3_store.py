"""The store contract on s3:// against a real S3 API server (moto's) on localhost.

Run: ``pytest -q tests/test_s3_store.py`` (marker ``s3``).
"""

from __future__ import annotations

import asyncio
import http.server
import socket
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import pytest
from s3_server import S3Bucket, s3_bucket, s3_server  # noqa: F401  (fixtures)

from casnap import settings
from casnap.errors import (
    ConfigError,
    ObjectChangedError,
    ObjectExistsError,
    ObjectNotFoundError,
    StoreError,
)
from casnap.store import ObjectStore, RetryingStore, S3Store, open_store
from casnap.store.testing import StoreConformance
from casnap.store.testing_replace import race as _race

pytestmark = pytest.mark.s3


def _store(bucket: S3Bucket, **extra: object) -> S3Store:
    """A store below a new prefix; stores with the same options share one s3fs client."""
    return S3Store(f"{bucket.url}/{uuid.uuid4().hex}", {**bucket.options, **extra})


class TestS3Store(StoreConformance):
    """Conditional writes on: create-only is the server's If-None-Match decision."""

    @pytest.fixture
    def store(self, s3_bucket: S3Bucket) -> S3Store:  # noqa: F811
        return _store(s3_bucket)

    def reopen(self, store: ObjectStore) -> ObjectStore:
        # A separate s3fs instance (s3fs caches them by arguments): a shared one
        # would hide stale caches and share the in-process create lock.
        assert isinstance(store, S3Store)
        return S3Store(store.url, {**self._options(store), "skip_instance_cache": True})

    @staticmethod
    def _options(store: S3Store) -> dict[str, object]:
        fs = store.fs
        return {"endpoint_url": fs.endpoint_url, "key": fs.key, "secret": fs.secret}

    def test_is_atomic_create(self, store: S3Store) -> None:
        assert store.capabilities.atomic_create


class TestS3StoreWithoutConditionalWrites(StoreConformance):
    """``conditional_writes=False`` (a server without them): the contract still holds
    within one process, and the store does not claim atomic create."""

    @pytest.fixture
    def store(self, s3_bucket: S3Bucket) -> S3Store:  # noqa: F811
        return _store(s3_bucket, conditional_writes=False)

    def reopen(self, store: ObjectStore) -> ObjectStore:
        assert isinstance(store, S3Store)
        fs = store.fs
        options = {"endpoint_url": fs.endpoint_url, "key": fs.key, "secret": fs.secret}
        return S3Store(
            store.url, {**options, "conditional_writes": False, "skip_instance_cache": True}
        )

    def test_is_not_atomic_create(self, store: S3Store) -> None:
        assert not store.capabilities.atomic_create


# -- create-only across independent clients --------------------------------------


def test_concurrent_create_only_from_independent_clients_has_one_winner(s3_bucket):  # noqa: F811
    # Each writer has its own S3 client and no lock in common: only the server's
    # If-None-Match check can make exactly one of them win.
    first = _store(s3_bucket)
    n = 8
    writers = [
        S3Store(first.url, {**s3_bucket.options, "skip_instance_cache": True}) for _ in range(n)
    ]
    for round_ in range(10):
        key = f"race/{round_}"
        outcomes = _race(n, partial(_create, writers, key))
        winners = [i for i, o in enumerate(outcomes) if o is None]
        assert len(winners) == 1, outcomes
        assert all(isinstance(o, ObjectExistsError) for o in outcomes if o is not None), outcomes
        assert first.get(key) == f"writer {winners[0]}".encode()


def _create(writers: list[S3Store], key: str, i: int) -> None:
    writers[i].put(key, f"writer {i}".encode(), create_only=True)


def test_create_only_refuses_an_object_written_by_another_s3_client(s3_bucket):  # noqa: F811
    import s3fs

    store = _store(s3_bucket)
    other = s3fs.S3FileSystem(**s3_bucket.options, skip_instance_cache=True)
    other.pipe_file(f"{store.root}/refs/main", b"theirs")
    with pytest.raises(ObjectExistsError) as info:
        store.put("refs/main", b"ours", create_only=True)
    assert info.value.key == "refs/main" and not info.value.transient
    assert store.get("refs/main") == b"theirs"


# -- errors: what is transient ---------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as s:  # a port nobody listens on once this closes
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_refused_connection_is_transient_and_retried_to_the_bound(s3_server):  # noqa: F811
    url = f"http://127.0.0.1:{_closed_port()}"
    options = {
        "endpoint_url": url,
        "key": "k",
        "secret": "s",
        "skip_instance_cache": True,
        "config_kwargs": {"retries": {"max_attempts": 1}},
    }
    with pytest.raises(StoreError) as info:
        S3Store("s3://nobody/x", options).get("a")
    assert info.value.transient and info.value.key == "a"
    with settings.override(store_retries=2, store_retry_delay=0.0):
        store = open_store("s3://nobody/x", options)
        assert isinstance(store, RetryingStore)
        with pytest.raises(StoreError, match="gave up after 3 attempts") as info:
            store.exists("a")
    assert info.value.transient


def test_missing_objects_and_buckets_are_not_found_and_not_transient(s3_bucket):  # noqa: F811
    store = _store(s3_bucket)
    with pytest.raises(ObjectNotFoundError) as info:
        store.get("nope")
    assert not info.value.transient
    gone = S3Store(
        f"s3://casnap-missing-{uuid.uuid4().hex[:8]}/x",
        {**s3_bucket.options, "skip_instance_cache": True},
    )
    with pytest.raises(ObjectNotFoundError, match="bucket .* does not exist"):
        gone.get("a")
    with pytest.raises(ObjectNotFoundError, match="bucket .* does not exist"):
        gone.put("a", b"x")
    assert not gone.exists("a")


@pytest.mark.parametrize(
    ("status", "code", "transient"),
    [
        (503, "SlowDown", True),
        (500, "InternalError", True),
        (429, "TooManyRequestsException", True),
        (400, "RequestTimeout", True),
        (409, "ConditionalRequestConflict", True),
        (403, "AccessDenied", False),
        (400, "InvalidArgument", False),
    ],
)
def test_s3_error_codes_are_classified(status, code, transient):
    # The ClientError botocore raises for such an answer, as s3fs hands it on.
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    response = {
        "Error": {"Code": code, "Message": "m"},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    raised = translate_boto_error(ClientError(response, "PutObject"))
    store = S3Store("s3://bucket/x", {"anon": True})
    err = store._translate(raised, "k")
    assert err.transient is transient
    assert type(err) is StoreError and err.key == "k"


class _OldServer(http.server.BaseHTTPRequestHandler):
    """An S3 server from before conditional writes: it refuses ``If-None-Match`` on
    PUT with 501 NotImplemented (as S3 does for a header it does not implement),
    or, with ``ignore`` set, ignores it and overwrites. It keeps no objects."""

    ignore = False
    # HTTP/1.1, so that the client's "Expect: 100-continue" is answered before the body.
    protocol_version = "HTTP/1.1"

    def do_PUT(self) -> None:  # noqa: N802  (http.server's naming)
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if "If-None-Match" in self.headers and not self.ignore:
            body = (
                b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>NotImplemented</Code>"
                b"<Message>A header you provided implies functionality that is not "
                b"implemented</Message></Error>"
            )
            self._answer(501, body)
        else:
            self._answer(200, b"")

    def do_DELETE(self) -> None:  # noqa: N802
        self._answer(204, b"")

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("ETag", '"0"')
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


class _IgnoringServer(_OldServer):
    ignore = True


@contextmanager
def _serve(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        thread.join()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("handler", "says"),
    [(_OldServer, "does not support conditional writes"), (_IgnoringServer, "ignores")],
)
def test_a_server_without_conditional_writes_fails_the_create_naming_the_fix(handler, says):
    with _serve(handler) as endpoint:
        options = {"endpoint_url": endpoint, "key": "k", "secret": "s"}
        store = S3Store("s3://old/repo", {**options, "skip_instance_cache": True})
        store.put("chunk", b"x")  # a plain PUT works
        with pytest.raises(StoreError, match="conditional_writes=false") as info:
            store.put("refs/main", b"x", create_only=True)
        assert says in str(info.value) and not info.value.transient
        # The fix named: create-only is then check-then-write (TestS3StoreWithout-
        # ConditionalWrites), and atomic_create is not claimed.
        fallback = S3Store("s3://old/repo", {**options, "conditional_writes": "false"})
        assert not fallback.capabilities.atomic_create


def test_conditional_writes_are_proven_once_per_client_and_leave_nothing(s3_bucket):  # noqa: F811
    store = S3Store(
        f"{s3_bucket.url}/{uuid.uuid4().hex}", {**s3_bucket.options, "skip_instance_cache": True}
    )
    assert store._probe_pending
    store.put("a", b"1", create_only=True)
    assert vars(store.fs).get("_casnap_conditional_writes_proven") is True
    assert sorted(store.list()) == ["a"]  # the probe object is gone
    aws = S3Store("s3://bucket/x", {"anon": True, "skip_instance_cache": True})
    assert not aws._probe_pending and aws.capabilities.atomic_create  # AWS itself is trusted


# -- options ---------------------------------------------------------------------


def test_options_given_as_text_on_the_command_line_are_read_as_booleans(s3_bucket):  # noqa: F811
    store = _store(s3_bucket, conditional_writes="false", use_ssl="False")
    assert not store.capabilities.atomic_create and store.conditional_writes is False
    store.put("a", b"1", create_only=True)
    with pytest.raises(ObjectExistsError):
        store.put("a", b"2", create_only=True)
    assert _store(s3_bucket, conditional_writes="Auto").capabilities.atomic_create
    with pytest.raises(ConfigError, match="conditional_writes='maybe'"):
        _store(s3_bucket, conditional_writes="maybe")


def test_the_usual_aws_environment_variables_reach_the_server(s3_bucket, monkeypatch):  # noqa: F811
    writer = _store(s3_bucket)
    writer.put("k", b"from options")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_bucket.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_bucket.options["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_bucket.options["secret"])
    store = open_store(writer.url, {"skip_instance_cache": True})
    assert store.get("k") == b"from options"


def test_a_whole_object_get_is_one_request(s3_bucket):  # noqa: F811
    # s3fs sends a HEAD before a whole-object GET unless told not to split it:
    # that doubled the requests of every restore (benchmarks/remote.py).
    store = _store(s3_bucket)
    store.put("chunks/ab/x", b"payload" * 100)
    calls: list[str] = []
    inner = store.fs._call_s3

    async def counted(method, *args, **kwargs):
        calls.append(method if isinstance(method, str) else method.__name__)
        return await inner(method, *args, **kwargs)

    store.fs._call_s3 = counted
    assert store.get("chunks/ab/x") == b"payload" * 100
    assert calls == ["get_object"]


def test_replace_fails_when_written_after_it_read(s3_bucket, monkeypatch):  # noqa: F811
    # Another client overwrites the object between the replace's GET and its PUT:
    # only the server's If-Match check can refuse the PUT then.
    import casnap.store.s3_store as s3_module

    store = _store(s3_bucket)
    other = S3Store(store.url, {**s3_bucket.options, "skip_instance_cache": True})
    store.put("refs/main", b"old")
    read = s3_module._etag_if_holding

    async def read_then_overwrite(*args: object) -> str | None:
        etag = await read(*args)  # type: ignore[arg-type]
        await asyncio.get_running_loop().run_in_executor(None, other.put, "refs/main", b"theirs")
        return etag

    monkeypatch.setattr(s3_module, "_etag_if_holding", read_then_overwrite)
    with pytest.raises(ObjectChangedError):
        store.replace("refs/main", b"mine", expected=b"old")
    assert other.get("refs/main") == b"theirs"


def test_replace_is_proven_once_on_a_server_other_than_aws(s3_bucket):  # noqa: F811
    store = _store(s3_bucket)
    assert store._probe_pending and store.capabilities.conditional_replace
    store.put("refs/main", b"old")
    store.replace("refs/main", b"new", expected=b"old")
    assert store.get("refs/main") == b"new"
    assert sorted(store.list()) == ["refs/main"]  # the probe object is gone
