"""A real S3 API server (moto's server mode) on localhost, for tests that speak S3.

Import the fixtures into a test module (``from s3_server import s3_bucket,
s3_server``); tests that use them carry ``@pytest.mark.s3``.

``s3_server`` starts :class:`moto.server.ThreadedMotoServer` once per session on
a free port of 127.0.0.1: the same HTTP server and S3 request handling as the
``moto_server`` command, in a thread of the test process, so nothing outlives
the session. ``s3_bucket`` is one bucket for the session, with the URL and the
storage options that reach it; each test works below a prefix of its own.

Two things this module takes care of:

- Credentials and endpoint are passed explicitly, and the ``AWS_*`` variables
  of the machine running the tests are cleared for the session, so a developer's
  profile or real credentials are never used or sent anywhere.
- werkzeug logs every request to stderr; its logger is raised to WARNING so a
  test's output shows what the test printed.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

KEY, SECRET = "casnap-test-key", "casnap-test-secret"


@dataclass(frozen=True)
class S3Bucket:
    """A bucket on the local server: ``url`` is ``s3://name``, ``options`` reach it."""

    name: str
    endpoint: str
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"s3://{self.name}"

    def cli_options(self) -> list[str]:
        """The same options as ``--storage-option`` arguments of the ``casnap`` command."""
        args: list[str] = []
        for key, value in self.options.items():
            args += ["--storage-option", f"{key}={value}"]
        return args


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """The endpoint URL (``http://127.0.0.1:PORT``) of a moto S3 server for the session."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    with pytest.MonkeyPatch.context() as mp:
        for name in [n for n in os.environ if n.startswith("AWS_")]:
            mp.delenv(name)
        # No shared config or credentials file either (~/.aws), and a region.
        mp.setenv("AWS_CONFIG_FILE", os.devnull)
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        try:
            yield f"http://{host}:{port}"
        finally:
            server.stop()


@pytest.fixture(scope="session")
def s3_bucket(s3_server: str) -> S3Bucket:
    """An empty bucket on the server; tests isolate themselves by prefix (as on GCS)."""
    import s3fs

    options = {"endpoint_url": s3_server, "key": KEY, "secret": SECRET}
    name = f"casnap-{uuid.uuid4().hex[:16]}"
    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    fs.mkdir(name)
    return S3Bucket(name, s3_server, options)
