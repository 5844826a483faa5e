"""Repository fuzzer: damage one file of a real repository, run one operation, judge the outcome.

A worker process builds a small real repository once (three snapshots with
loose and packed chunks, a tag, a stale lease, a damage record, a gc epoch).
Each case copies it, applies one seeded mutation to one file and runs one
operation. The outcome must be a correct result or a ``casnap.CasnapError``:

- ``ok``: the operation returned; tensors it returned or wrote equal the
  originals, unless the mutation legitimately rewrote the manifest
  (``rehash``, ``huge_shape``), which declares other data;
- ``casnap_error``: a CasnapError (counted per class);
- failures: ``other_exception`` (any other exception), ``wrong_result``
  (silently different data), ``hang`` (past the per-case timeout),
  ``blocked`` (a forged lock or lease record held a real take or gc up until
  it gave up) and ``memory`` (MemoryError, or the worker killed). The worker
  runs under RLIMIT_AS (its size after setup plus 2.5 GiB), so a blow-up
  fails fast; an operation whose peak resident memory grows by more than
  ``MEMORY_FIXED`` plus ``MEMORY_PER_BYTE`` times the largest manifest is a
  ``memory`` failure too (issue #41).

The ``hostile_lock`` kind writes a forged ``gc.lock`` or lease (a claim to
the year 9999, times that do not parse) and runs a real take or gc
(``LOCK_OPS``) instead of a read: it must finish, or fail with a
CasnapError other than waiting for the forged record, within the timeout.

Usage::

    python tests/machinery/fuzz_repo.py --seed 1 --cases 5000 --seconds 600
    cd tests/machinery && python -c 'from fuzz_repo import run; print(run(1, 200, 30, "/tmp/fz"))'

Every mutation kind runs by default; ``kinds=`` (``--kinds``) picks some.
``STORE_KINDS`` are those the store's read checks answer (FIFOs, symlinks,
files too large to read, integers too long to parse; docs/format.md,
"Reading untrusted files").
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import queue
import random
import resource
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
KINDS = (
    "bitflip",
    "truncate",
    "zero_block",
    "append_junk",
    "json_value",
    "rehash",
    "huge_shape",
    "bomb",
    "float_overflow",
    "hostile_lock",
    "many_shards",
    "part_value",
)
STORE_KINDS = ("fifo", "symlink_dev_zero", "sparse", "bigint")
ALL_KINDS = KINDS + STORE_KINDS
OPS = (
    "restore",
    "read_object",
    "log",
    "du",
    "verify",
    "gc_dry",
    "retain_dry",
    "export_safetensors",
    "export_torch",
    "diff_stats",
)
# A hostile lock or lease record is judged by what it blocks: a real take and a
# real gc (not a dry run), which must finish or fail within the case timeout.
LOCK_OPS = ("take", "gc")
FAILURES = ("other_exception", "wrong_result", "hang", "blocked", "memory", "fuzzer_error")
_REWRITES = (
    "rehash",
    "huge_shape",
    "float_overflow",
    "many_shards",
    "part_value",
)  # the manifest declares other data
_JSON_DIRS = ("manifests", "refs", "tags", "leases", "damaged")
_SNAPSHOTS = ("s1", "s2", "s3")
_CHUNK = 64 * 1024
_KEEP_DETAILS = 5
# No operation on a repository whose largest manifest is N bytes may grow the
# worker's peak resident memory by more than this plus N times this multiple.
MEMORY_FIXED = 256 << 20
MEMORY_PER_BYTE = 32
HUGE_ELEMENTS = 4294967298  # float32: 17,179,869,192 bytes, as in issue #41


# -- the repository every case starts from ----------------------------------------


def _states() -> dict[str, dict[str, Any]]:
    import torch

    g = torch.Generator().manual_seed(0)
    w = torch.randn(40_000, generator=g)  # three loose chunks of 64 KiB, the last shorter
    out = {}
    for i, name in enumerate(_SNAPSHOTS):
        w = w.clone()
        w[i * 100 : i * 100 + 10] += 1.0  # each snapshot changes the first chunk only
        out[name] = {
            "w": w,
            "z": torch.zeros(30_000, dtype=torch.bfloat16),  # compresses: zstd frames
            "b": torch.randn(100, generator=g),  # packed
            "i": torch.arange(50, dtype=torch.int64) * (i + 1),  # packed, compressible
            "step": i,
            # 140 refs to one zero chunk: the entries' JSON passes 16 KiB, so every
            # manifest holds them in a part (docs/format.md, "Manifest parts")
            "many": torch.zeros(140 * _CHUNK // 4),
        }
    return out


def build(base: Path) -> dict[str, dict[str, Any]]:
    """Create the base repository at ``base``; returns each snapshot's state."""
    from casnap import Repository, Snapshot, StateDict
    from casnap.repo.damage import record_damage
    from casnap.repo.lease_record import LEASES, LeaseRecord

    states = _states()
    for name, state in states.items():
        options = {"chunk_size": _CHUNK}
        Snapshot.take(str(base / name), {"s": StateDict(**state)}, settings=options)
    repo = Repository(str(base))
    repo.tag("best", "s2")
    repo.gc(grace_seconds=0)  # nothing unreachable: writes the gc epoch
    record = LeaseRecord.new("take", 0.001)  # a stale lease of a take that crashed
    repo.storage.store.put(f"{LEASES}/{record.id}", record.to_bytes())
    ref = repo.snapshot("s1").manifest.entries["0/s/b"].chunks[0]  # type: ignore[union-attr]
    record_damage(repo.storage, ref, "planted by the fuzzer")  # a record of a copy that is fine
    return states


def _files(base: Path) -> list[str]:
    """Every file of the repository, in an order that does not depend on timestamps.

    Manifest names hash their ``created_at`` and the lease's name is random,
    so they sort by owner instead: the same seed picks the same file in
    every run.
    """
    root = base / ".casnap"
    owner = {m: names[0] for m, names in _owners(base).items()}

    def stable(rel: str) -> str:
        name = Path(rel).name
        if "/manifests/" in rel:
            return f".casnap/manifests/{owner.get(name, name)}"
        return ".casnap/leases/" if "/leases/" in rel else rel

    return sorted((str(p.relative_to(base)) for p in root.rglob("*") if p.is_file()), key=stable)


# -- mutations ---------------------------------------------------------------------


def _hostile_value(rng: random.Random) -> Any:
    pick = rng.randrange(12)
    if pick == 0:
        return rng.choice([2**62, 2**63, 2**64 + 1, 2**70, 10**30])
    if pick == 1:
        return rng.choice([-1, -(2**63), 0])
    if pick == 2:
        return rng.choice([[2**31] * 4, [2**40], [10**18, 10**18], [1] * 65, [-5]])
    if pick == 3:
        return f"{_DEEP}{rng.choice([100, 3000, 200_000])}"
    if pick == 4:
        return "x" * rng.choice([0, 1, 5000, 1 << 20])
    if pick == 5:
        return rng.choice([None, True, False, 1.5, 1e308, {}, [], {"kind": "tensor"}])
    if pick == 6:
        return rng.choice(["float32", "int4", "bool", "complex128", "nope"])
    if pick == 7:
        return "f" * 64  # a well-formed hash of nothing
    if pick == 8:
        return rng.randrange(-10, 1 << 20)
    return rng.choice([rng.random(), "1.0", "2.0", "../../etc/passwd", "a/../../b"])


_DEEP = "__casnap_fuzz_deep__"  # a placeholder for nesting too deep to build as objects


def _dumps(doc: Any, canonical: bool = False) -> bytes:
    """``doc`` as JSON, with each deep-nesting placeholder expanded into ``[[...0...]]``."""
    from casnap.format.json_text import canonical_json

    blob = canonical_json(doc) if canonical else json.dumps(doc).encode()
    while (at := blob.find(_DEEP.encode())) >= 0:
        end = blob.index(b'"', at)
        depth = int(blob[at + len(_DEEP) : end])
        blob = blob[: at - 1] + b"[" * depth + b"0" + b"]" * depth + blob[end + 1 :]
    return blob


def _nodes(doc: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [path]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _nodes(v, (*path, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _nodes(v, (*path, i))
    return out


def _replace(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    node = doc
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    return doc


def _write_manifest(case: Path, old: str, doc: Any) -> str:
    """Store ``doc`` under its blake3 name and point every ref and tag at ``old`` to it."""
    from casnap.format.names import hash_bytes

    blob = _dumps(doc, canonical=True)
    name = hash_bytes(blob)
    folder = case / ".casnap" / "manifests" / name[:2]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(blob)
    for sub in ("refs", "tags"):
        for p in (case / ".casnap" / sub).rglob("*"):
            if p.is_file():
                text = p.read_text()
                if old in text:
                    p.write_text(text.replace(old, name))
    return name


def _part_path(case: Path, h: str) -> Path:
    return case / ".casnap" / "chunks" / h[:2] / h


def _read_part(case: Path, ref: dict[str, Any]) -> Any:
    from casnap.format import codec

    h = ref["hash"]
    frame = _part_path(case, h).read_bytes()
    return json.loads(bytes(codec.decode(frame, h, bytes.fromhex(h), ref["size"])))


def _write_part(case: Path, part: Any) -> dict[str, Any]:
    """Store ``part`` as a part frame under its blake3 name; returns its reference."""
    from casnap.format import codec
    from casnap.format.names import digest_of

    raw = _dumps(part, canonical=True)
    digest = digest_of(raw)
    header, payload = codec.encode(raw, digest)
    frame = header + bytes(payload)
    path = _part_path(case, digest.hex())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(frame)
    return {"hash": digest.hex(), "size": len(raw), "pack": None, "offset": 0, "length": len(frame)}


def _inline_parts(case: Path, doc: Any) -> None:
    """Merge a manifest's parts into its entries (a reader accepts both), so that the
    rewrites of entries find them."""
    for ref in doc.pop("parts", None) or []:
        doc["entries"].update(_read_part(case, ref)["entries"])


def _part_value(rng: random.Random, case: Path, rel: str, doc: Any) -> str:
    """A hostile value somewhere in one of the manifest's parts, both rehashed."""
    parts = doc.get("parts") or []
    if not parts:
        return "no part"
    at = rng.randrange(len(parts))
    part = _read_part(case, parts[at])
    node = rng.choice(_nodes(part))
    value = _hostile_value(rng)
    parts[at] = _write_part(case, _replace(part, node, value))
    name = _write_manifest(case, Path(rel).name, doc)
    return f"part {at}: set {list(node)[:8]} to {repr(value)[:60]}, rehashed as {name[:12]}"


def _huge_shape(rng: random.Random, doc: Any) -> None:
    tensors = [k for k, e in doc["entries"].items() if e.get("kind") == "tensor"]
    e = doc["entries"][rng.choice(tensors)]
    chunk = 1 << 30
    nbytes = rng.choice([3 << 30, 1 << 36, 1 << 45, 1 << 55])
    e["dtype"], e["shape"], e["chunk_size"] = "uint8", [nbytes], chunk
    if rng.random() < 0.8:  # consistent: passes validation, so the readers must refuse it
        first = e["chunks"][0] if e["chunks"] else {"hash": "f" * 64, "length": 56}
        n = min(-(-nbytes // chunk), 4096)
        e["shape"] = [n * chunk] if nbytes > n * chunk else [nbytes]
        size = e["shape"][0]
        e["chunks"] = [dict(first, size=min(chunk, size - i * chunk), length=56) for i in range(n)]


def _no_base(ref: dict[str, Any], **changes: Any) -> dict[str, Any]:
    return {**{k: v for k, v in ref.items() if k != "base"}, **changes}


def many_shards(
    rng: random.Random, doc: Any, how: str | None = None, count: int | None = None
) -> str:
    """Turn the tensor ``0/s/w`` into a sharded entry of very many shards (issue #41).

    ``how``: ``empty`` (its real shard and thousands of empty ones), ``overlap``
    (copies of its real shard), ``split`` (1,000 or 40,000 small shards with consistent
    chunk lists: valid, so the readers must refuse their chunks) or ``huge``
    (a tensor of 17,179,869,192 bytes whose many shards leave a gap, or tile it
    with a consistent 16 GiB shard; mostly beside the dense ``0/s/z`` declaring
    as much).
    """
    how = how or rng.choice(["empty", "overlap", "split", "huge"])
    e = doc["entries"]["0/s/w"]
    real = {
        "offsets": [0],
        "sizes": e["shape"],
        "chunk_size": e["chunk_size"],
        "chunks": e["chunks"],
    }
    n, shape = e["shape"][0], list(e["shape"])
    first = e["chunks"][0]
    if how == "empty":
        count = count or rng.choice([2, 1000, 65535])
        shards = [real] + [
            {"offsets": [rng.randrange(n + 1)], "sizes": [0], "chunk_size": 4096, "chunks": []}
            for _ in range(count)
        ]
    elif how == "overlap":
        shards = [real] * rng.choice([2, 100, 4096])
    elif how == "split":
        count = count or rng.choice([1000, 40000])
        step = -(-n // count)
        shards = [
            {
                "offsets": [i],
                "sizes": [min(step, n - i)],
                "chunk_size": 4 * step,
                "chunks": [_no_base(first, size=4 * min(step, n - i), length=56)],
            }
            for i in range(0, n, step)
        ]
    else:
        shape = [HUGE_ELEMENTS]
        count = count or rng.choice([1000, 65535])
        tiny = [
            {
                "offsets": [i],
                "sizes": [1],
                "chunk_size": 4,
                "chunks": [_no_base(first, size=4, length=56)],
            }
            for i in range(count)
        ]
        rest, cs = 4 * (HUGE_ELEMENTS - count), 1 << 30
        big = {
            "offsets": [count],
            "sizes": [HUGE_ELEMENTS - count],
            "chunk_size": cs,
            "chunks": [
                _no_base(first, size=min(cs, rest - i), length=56) for i in range(0, rest, cs)
            ],
        }
        shards = [*tiny, big] if rng.random() < 0.5 else tiny
        if rng.random() < 0.7:
            z = doc["entries"]["0/s/z"]
            z["dtype"], z["shape"], z["chunk_size"] = "float32", [HUGE_ELEMENTS], cs
            z["chunks"] = [
                _no_base(z["chunks"][0], size=min(cs, 4 * HUGE_ELEMENTS - i), length=56)
                for i in range(0, 4 * HUGE_ELEMENTS, cs)
            ]
    doc["entries"]["0/s/w"] = {
        "kind": "sharded",
        "layout": "dtensor",
        "dtype": "float32",
        "shape": shape,
        "shards": shards,
    }
    return f"{how}: {len(shards)} shards of a float32{shape}"


def _float_overflow(rng: random.Random, doc: Any) -> str:
    """Turn the int primitive ``step`` into a float (or complex) whose hex text overflows."""
    text = rng.choice(["0x1p+99999", "-0x1.fp+1024", "0x1p+1024", "0x1.0p+" + "9" * 30])
    entry: dict[str, Any] = {"kind": "primitive", "type": "float", "value": text}
    if rng.random() < 0.3:
        entry = {"kind": "primitive", "type": "complex", "value": ["0x1p+0", text]}
    doc["entries"]["0/s/step"] = entry
    return text


# Records a writer of the repository could leave as gc.lock or as a lease: the
# one of issue #23, claims far beyond any lease's life, times that do not parse.
_HOSTILE_RECORDS = (
    {"created_at": "x", "expires_at": "9999-01-01"},
    {"expires_at": "9999-12-31T23:59:59+00:00"},
    {"expires_at": "2999-01-01T00:00:00"},
    {"created_at": "", "expires_at": "9999-01-01T00:00:00Z"},
    {"expires_at": "9999-12-31T23:59:59-23:59"},
    {"expires_at": "not a time"},
    {"pid": -1, "host": "", "expires_at": "9999-01-01"},
)


def _hostile_record(rng: random.Random) -> bytes:
    base = {
        "id": "a",
        "kind": "gc",
        "created_at": "2024-01-01T00:00:00+00:00",
        "expires_at": "",
        "host": "h",
        "pid": 1,
    }
    return json.dumps({**base, **rng.choice(_HOSTILE_RECORDS)}).encode()


_BOMB: bytes | None = None


def _bomb() -> bytes:
    """zstd of 3 GiB of zeros (about 100 KB), declaring its size."""
    global _BOMB
    if _BOMB is None:
        import zstandard

        cobj = zstandard.ZstdCompressor(level=1).compressobj(size=3 << 30)
        zeros = bytes(64 << 20)
        _BOMB = b"".join([*(cobj.compress(zeros) for _ in range(48)), cobj.flush()])
    return _BOMB


def _bomb_frame(rng: random.Random, old: bytes) -> bytes:
    """A frame whose zstd payload inflates to 3 GiB, replacing the frame ``old`` starts with.

    Mostly it keeps the old frame's digest and raw length, as a forger matching
    the manifest would; else it declares more than a chunk holds.
    """
    from casnap.format import codec

    digest = old[24:56] if len(old) >= 56 else bytes(32)
    payload = _bomb()
    same = int.from_bytes(old[8:16], "little") if len(old) >= 56 else 0
    raw_length = rng.choice([same, same, same, len(payload) + 1, _CHUNK + 1, 3 << 30, 1 << 40])
    head = codec.HEADER.pack(codec.MAGIC, 1, codec.CODEC_ZSTD, 0, raw_length, len(payload), digest)
    return head + payload


def mutate(rng: random.Random, case: Path, rel: str, kind: str) -> str:
    """Apply mutation ``kind`` to file ``rel`` of the repository copy ``case``; describe it."""
    path = case / rel
    data = path.read_bytes()
    n = len(data)
    if kind == "bitflip":
        buf = bytearray(data)
        where = [rng.randrange(n) for _ in range(rng.randint(1, 8))] if n else []
        for i in where:
            buf[i] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(buf))
        return f"flipped bits at {where[:8]}"
    if kind == "truncate":
        size = rng.randrange(n) if n else 0
        path.write_bytes(data[:size])
        return f"truncated to {size} of {n}"
    if kind == "zero_block":
        start = rng.randrange(n) if n else 0
        length = rng.randint(1, 4096)
        path.write_bytes(data[:start] + bytes(min(length, n - start)) + data[start + length :])
        return f"zeroed {length} bytes at {start}"
    if kind == "append_junk":
        junk = rng.randbytes(rng.randint(1, 4096))
        path.write_bytes(data + junk)
        return f"appended {len(junk)} bytes"
    if kind == "bomb":
        at = 0
        if "/packs/" in rel and n > 56:
            at = rng.choice([i for i in range(n - 3) if data[i : i + 4] == b"CSNF"] or [0])
        frame = _bomb_frame(rng, data[at:])
        path.write_bytes(data[:at] + frame + data[at + len(frame) :])
        return f"zstd bomb frame at {at}"
    if kind == "hostile_lock":  # ``rel`` is the stale lease; the record goes there or to gc.lock
        record = _hostile_record(rng)
        lock = path if rng.random() < 0.3 else case / ".casnap" / "gc.lock"
        lock.write_bytes(record)
        return f"{lock.relative_to(case)} = {record.decode()[:120]}"
    if kind == "fifo":
        path.unlink()
        os.mkfifo(path)
        return "replaced by a FIFO"
    if kind == "symlink_dev_zero":
        path.unlink()
        path.symlink_to("/dev/zero")
        return "replaced by a symlink to /dev/zero"
    if kind == "sparse":
        with open(path, "r+b") as fh:
            fh.truncate(3 << 30)
        return "extended to a sparse 3 GiB file"
    doc = json.loads(data)  # the JSON kinds (the file was chosen as JSON)
    if kind == "bigint":
        text = data.decode()
        digits = "9" * rng.choice([5000, 100_000])
        nums = [
            i for i, c in enumerate(text) if c.isdigit() and (i == 0 or not text[i - 1].isalnum())
        ]
        at = rng.choice(nums) if nums else 0
        path.write_text(text[:at] + digits + text[at:])
        return f"a {len(digits)}-digit integer at {at}"
    if kind == "part_value":
        return _part_value(rng, case, rel, doc)
    if kind in _REWRITES:
        _inline_parts(case, doc)
    node = rng.choice(_nodes(doc))
    if kind == "huge_shape":
        _huge_shape(rng, doc)
        name = _write_manifest(case, Path(rel).name, doc)
        return f"huge shape, rehashed as {name[:12]}"
    if kind == "many_shards":
        text = many_shards(rng, doc)
        name = _write_manifest(case, Path(rel).name, doc)
        return f"0/s/w {text}, rehashed as {name[:12]}"
    if kind == "float_overflow":
        text = _float_overflow(rng, doc)
        name = _write_manifest(case, Path(rel).name, doc)
        return f"primitive 0/s/step = {text[:40]}, rehashed as {name[:12]}"
    value = _hostile_value(rng)
    doc = _replace(doc, node, value)
    shown = repr(value)[:60]
    if kind == "rehash":
        name = _write_manifest(case, Path(rel).name, doc)
        return f"set {list(node)[:8]} to {shown}, rehashed as {name[:12]}"
    path.write_bytes(_dumps(doc))
    return f"set {list(node)[:8]} to {shown}"


def _applicable(rel: str, kind: str) -> bool:
    folder = rel.split("/")[1] if "/" in rel else ""
    is_json = folder in _JSON_DIRS or rel.endswith(("config.json", "gc-epoch"))
    if kind in ("json_value", "bigint"):
        return is_json
    if kind in _REWRITES:
        return folder == "manifests"
    if kind == "hostile_lock":
        return folder == "leases"
    if kind == "bomb":
        return folder in ("chunks", "packs")
    return True


# -- operations and their verdicts ------------------------------------------------


def _same(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        return bool(torch.equal(a.view(torch.uint8) if a.dtype == torch.bool else a, b))
    return bool(a == b)


def operate(op: str, case: Path, snap: str, states: dict[str, dict[str, Any]]) -> str | None:
    """Run ``op``; return None when its result is right, else what is wrong with it."""
    import torch

    from casnap import KeepLast, Repository, RetentionPolicy, Snapshot, StateDict

    want = states[snap]
    if op == "restore":
        target = StateDict(
            **{
                k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1
                for k, v in want.items()
            }
        )
        Snapshot(str(case / snap)).restore({"s": target})
        bad = [k for k, v in want.items() if not _same(target[k], v)]
        return f"restored wrong values for {bad}" if bad else None
    if op == "read_object":
        key = random.Random(snap).choice(["w", "z", "b", "i"])
        got = Snapshot(str(case / snap)).read_object(f"0/s/{key}")
        return None if _same(got, want[key]) else f"read_object returned a wrong {key}"
    if op == "take":  # a new snapshot beside the others: it must not wait forever
        state = {k: v + 1 if isinstance(v, torch.Tensor) else v for k, v in want.items()}
        Snapshot.take(str(case / "new"), {"s": StateDict(**state)})
        target = StateDict(
            **{
                k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1
                for k, v in state.items()
            }
        )
        Snapshot(str(case / "new")).restore({"s": target})
        bad = [k for k, v in state.items() if not _same(target[k], v)]
        return f"the new snapshot restored wrong values for {bad}" if bad else None
    repo = Repository(str(case))
    if op == "gc":
        repo.gc(grace_seconds=0, wait_seconds=2)
        return None
    if op == "log":
        repo.log()
    elif op == "du":
        repo.du()
    elif op == "verify":
        repo.verify(read_data=True)
    elif op == "gc_dry":
        repo.gc(dry_run=True, grace_seconds=0, wait_seconds=0)
    elif op == "diff_stats":  # reads the changed chunks of both sides (drift)
        repo.diff("s1", snap, stats=True)
    elif op == "retain_dry":
        repo.retain(RetentionPolicy(KeepLast(1)), dry_run=True)
    elif op in ("export_safetensors", "export_torch"):
        out = case / ("out.safetensors" if op == "export_safetensors" else "out.pt")
        repo.export(snap, str(out))
        if op == "export_safetensors":
            from safetensors.torch import load_file

            got = load_file(str(out))
        else:
            got = torch.load(str(out), weights_only=True)
        bad = [k for k in ("w", "z", "b", "i") if not _same(got.get(f"s/{k}"), want[k])]
        return f"exported wrong tensors {bad}" if bad else None
    return None


# Reads of data find more than listings do.
_OP_WEIGHT = {"restore": 3, "read_object": 2, "verify": 2, "export_safetensors": 2}


def _owners(base: Path) -> dict[str, list[str]]:
    """Manifest hash -> the snapshots whose ref names it (the tag counts for s2)."""
    out: dict[str, list[str]] = {}
    for name in _SNAPSHOTS:
        ref = json.loads((base / ".casnap" / "refs" / name).read_text())
        out.setdefault(ref["manifest"], []).append(name)
    return out


class _Timeout(BaseException):
    """The per-case alarm (a BaseException: no ``except Exception`` in casnap swallows it)."""


def _on_alarm(_sig: int, _frame: Any) -> None:
    raise _Timeout()


def run_case(
    seed: int,
    index: int,
    base: Path,
    work: Path,
    states: dict[str, Any],
    kinds: tuple[str, ...],
    ops: tuple[str, ...],
    timeout: float,
) -> dict[str, Any]:
    """Case ``index`` of ``seed``: deterministic mutation and operation, judged."""
    from casnap.errors import CasnapError, GcBlockedError, GcBusyError

    rng = random.Random(f"{seed}:{index}")
    files = _files(base)
    kind = rng.choice(kinds)
    rel = rng.choice([f for f in files if _applicable(f, kind)] or files)
    if kind == "hostile_lock":
        op = rng.choice(LOCK_OPS)
    else:
        op = rng.choices(ops, [_OP_WEIGHT.get(o, 1) for o in ops])[0]
    owners = _owners(base).get(Path(rel).name, [])
    snap = rng.choice(owners) if owners and rng.random() < 0.8 else rng.choice(_SNAPSHOTS)
    case = work / f"case{index}"
    shutil.rmtree(case, ignore_errors=True)
    shutil.copytree(base, case, symlinks=True)
    info: dict[str, Any] = {"case": index, "kind": kind, "file": rel, "op": op, "snapshot": snap}
    try:
        info["mutation"] = mutate(rng, case, rel, kind)
        print("PLAN " + json.dumps(info), flush=True)  # the driver's account if this case hangs
    except Exception:
        _remove(case)
        info.update(outcome="fuzzer_error", detail=traceback.format_exc(limit=-6))
        return info
    start = _reset_peak()
    try:
        signal.setitimer(signal.ITIMER_REAL, timeout)
        try:
            wrong = operate(op, case, snap, states)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            info.update(_growth(start, case))
        if wrong and kind not in _REWRITES:
            info.update(outcome="wrong_result", detail=wrong)
        else:
            info["outcome"] = "ok"
    except _Timeout:
        info.update(outcome="hang", detail=f"no result within {timeout} s")
    except CasnapError as exc:
        if (
            kind == "hostile_lock"
            and isinstance(exc, (GcBusyError, GcBlockedError))
            and not _damaged_record(case, rel)
        ):
            # A forged record held a real gc (or take) up: bounded, but wrong. (One
            # that is not a record at all is refused, naming it: docs/gc.md.)
            info.update(outcome="blocked", error=type(exc).__name__, detail=str(exc)[:500])
        else:
            info.update(outcome="casnap_error", error=type(exc).__name__)
    except MemoryError:
        info.update(outcome="memory", detail=traceback.format_exc(limit=-6))
    except Exception as exc:
        info.update(
            outcome="other_exception",
            error=type(exc).__name__,
            detail=traceback.format_exc(limit=-8),
        )
    finally:
        _remove(case)
    bound = info.get("bound")
    if info.get("outcome") not in FAILURES and bound and info["growth"] > bound:
        info.update(
            outcome="memory",
            detail=f"peak resident memory grew by {info['growth']} bytes, more than {bound} "
            f"({MEMORY_FIXED} + {MEMORY_PER_BYTE} x its {info['manifest_bytes']}-byte manifest)",
        )
    return info


def _status(field: str) -> int | None:
    """A ``/proc/self/status`` field in bytes (VmRSS, VmHWM); None where there is none."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def _reset_peak() -> int | None:
    """Reset this process's peak resident memory (VmHWM) and return its resident memory now.

    None where the kernel does not allow it (then no memory bound is checked).
    """
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None
    return _status("VmRSS")


def _growth(start: int | None, case: Path) -> dict[str, Any]:
    """The case's peak memory growth and its bound (from the largest manifest of ``case``)."""
    peak = _status("VmHWM")
    if start is None or peak is None:
        return {}
    sizes = [p.stat().st_size for p in (case / ".casnap" / "manifests").rglob("*") if p.is_file()]
    n = max(sizes, default=0)
    return {
        "growth": max(0, peak - start),
        "manifest_bytes": n,
        "bound": MEMORY_FIXED + MEMORY_PER_BYTE * n,
    }


def _damaged_record(case: Path, rel: str) -> bool:
    """Whether the planted record (gc.lock, else the lease ``rel``) is not a record at all."""
    from casnap.errors import CasnapError
    from casnap.repo.lease_record import parse_record

    lock = case / ".casnap" / "gc.lock"
    path = lock if lock.exists() else case / rel
    try:
        parse_record(path.read_bytes(), rel)
    except CasnapError:
        return True
    return False


def _remove(case: Path) -> None:
    for p in sorted(case.rglob("*"), reverse=True) if case.exists() else []:
        try:
            if p.is_symlink() or not p.is_dir() or stat.S_ISFIFO(p.lstat().st_mode):
                p.unlink()
        except OSError:
            pass
    shutil.rmtree(case, ignore_errors=True)


# -- the worker and the driver ----------------------------------------------------


def _worker(config: dict[str, Any]) -> None:
    """Build the base repository, then answer case numbers read from stdin, one per line."""
    work = Path(config["workdir"])
    base = work / f"base-{os.getpid()}"
    shutil.rmtree(base, ignore_errors=True)
    states = build(base)
    _bomb()
    used = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = used + int(config["headroom"])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    stacks = open(work / f"stacks-{os.getpid()}", "w")  # noqa: SIM115 (lives with the worker)
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)  # for a hang's report
    print("READY", flush=True)
    for line in sys.stdin:
        index = int(line)
        info = run_case(
            config["seed"],
            index,
            base,
            work,
            states,
            tuple(config["kinds"]),
            tuple(config["ops"]),
            float(config["timeout"]),
        )
        print("CASE " + json.dumps(info, default=str), flush=True)


class _Worker:
    def __init__(self, config: dict[str, Any]) -> None:
        env = dict(
            os.environ,
            PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            MALLOC_ARENA_MAX="2",
            CASNAP_INDEX_DIR=str(Path(config["workdir"]) / "index"),
            CASNAP_IO_WORKERS="2",
            PYTHONWARNINGS="ignore",
        )
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        self.workdir = config["workdir"]
        self.plan: dict[str, Any] = {}
        # A reader thread, not select() on the buffered pipe: a readline that
        # buffered two lines (PLAN and CASE) would leave select() waiting for
        # bytes already read, and a case that answered would look like a hang.
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for text in self.proc.stdout:
            self.lines.put(text)
        self.lines.put("")  # end of output: the worker died

    def line(self, timeout: float) -> str | None:
        """The next protocol line, or None if the worker died or said nothing in time."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                text = self.lines.get(timeout=left)
            except queue.Empty:
                return None
            if not text:
                return None
            if text.startswith("PLAN "):
                self.plan = json.loads(text[len("PLAN ") :])
            elif text.startswith(("READY", "CASE ")):
                return text
        return None

    def ask(self, index: int) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{index}\n")
        self.proc.stdin.flush()

    def stacks(self) -> str:
        """Every thread's stack of a stuck worker (faulthandler, on SIGUSR1)."""
        path = Path(self.workdir) / f"stacks-{self.proc.pid}"
        self.proc.send_signal(signal.SIGUSR1)
        time.sleep(1.0)
        try:
            return path.read_text()[-8000:]
        except OSError:
            return ""

    def stop(self) -> None:
        (Path(self.workdir) / f"stacks-{self.proc.pid}").unlink(missing_ok=True)
        self.proc.kill()
        self.proc.wait()


def run(
    seed: int,
    cases: int | None,
    seconds: float | None,
    workdir: str,
    *,
    kinds: tuple[str, ...] | list[str] | None = None,
    ops: tuple[str, ...] | None = None,
    case_timeout: float = 20.0,
    headroom: int = 5 << 29,
) -> dict[str, Any]:
    """Fuzz ``cases`` cases (None: unbounded) for at most ``seconds`` (None: unbounded).

    Returns counts by outcome (``outcomes``), by CasnapError class
    (``casnap_errors``), by mutation kind (``by_kind``), ``failed`` (the
    number of failures) and the first few failures in ``failures``. A case's
    mutation depends only on ``seed`` and its number, so a failure replays
    with the same seed.
    """
    if cases is None and seconds is None:
        raise ValueError("give cases, seconds or both")
    kinds = tuple(kinds or ALL_KINDS)
    unknown = set(kinds) - set(ALL_KINDS)
    if unknown:
        raise ValueError(f"unknown mutation kinds {sorted(unknown)}")
    Path(workdir).mkdir(parents=True, exist_ok=True)
    config = {
        "seed": seed,
        "workdir": workdir,
        "kinds": kinds,
        "ops": tuple(ops or OPS),
        "timeout": case_timeout,
        "headroom": headroom,
    }
    start = time.monotonic()
    outcomes: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    by_kind: dict[str, Counter[str]] = {}
    failures: list[dict[str, Any]] = []
    worker: _Worker | None = None
    largest: dict[str, Any] = {}  # the case whose peak memory grew most
    index = 0
    try:
        while cases is None or index < cases:
            if seconds is not None and time.monotonic() - start >= seconds:
                break
            if worker is None:
                worker = _Worker(config)
                if worker.line(300) is None:
                    raise RuntimeError("the fuzz worker did not start")
            worker.plan = {}
            worker.ask(index)
            text = worker.line(case_timeout + 30)
            if text is None:  # killed for memory, crashed, or stuck beyond the alarm
                died = worker.proc.poll() is not None
                info = {
                    **worker.plan,
                    "case": index,
                    "outcome": "memory" if died else "hang",
                    "detail": "the worker died" if died else "no answer",
                }
                if not died:
                    info["stacks"] = worker.stacks()
                worker.stop()
                worker = None
            else:
                info = json.loads(text[len("CASE ") :])
                if info["outcome"] in ("hang", "memory"):
                    worker.stop()  # threads may still be stuck: start afresh
                    worker = None
            outcome = info["outcome"]
            if info.get("growth") is not None and info["growth"] >= largest.get("growth", -1):
                largest = {
                    k: info.get(k)
                    for k in ("growth", "bound", "manifest_bytes", "case", "kind", "op")
                }
            outcomes[outcome] += 1
            by_kind.setdefault(info.get("kind", "?"), Counter())[outcome] += 1
            if outcome == "casnap_error":
                errors[info["error"]] += 1
            if outcome in FAILURES and len(failures) < _KEEP_DETAILS:
                failures.append(info)
            index += 1
    finally:
        if worker is not None:
            worker.stop()
        for p in Path(workdir).glob("base-*"):
            shutil.rmtree(p, ignore_errors=True)
    return {
        "seed": seed,
        "cases": index,
        "seconds": round(time.monotonic() - start, 1),
        "outcomes": dict(outcomes),
        "casnap_errors": dict(errors),
        "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
        "failed": sum(outcomes[f] for f in FAILURES),
        "failures": failures,
        "largest_growth": largest,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--cases", type=int, default=None)
    parser.add_argument("--seconds", type=float, default=None)
    parser.add_argument("--workdir", default=None, help="scratch folder (default: a temp dir)")
    parser.add_argument(
        "--kinds",
        default=None,
        help=f"comma-separated mutation kinds (default: all: {','.join(ALL_KINDS)})",
    )
    parser.add_argument("--ops", default=None, help=f"comma-separated ({','.join(OPS)})")
    parser.add_argument("--case-timeout", type=float, default=20.0)
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        _worker(json.loads(args.worker))
        return 0
    if args.cases is None and args.seconds is None:
        args.cases = 500
    kinds = (
        ALL_KINDS if args.kinds == "all" else tuple(args.kinds.split(",")) if args.kinds else None
    )
    ops = tuple(args.ops.split(",")) if args.ops else None
    import tempfile

    with tempfile.TemporaryDirectory(prefix="casnap-fuzz-", dir=args.workdir) as work:
        summary = run(
            args.seed,
            args.cases,
            args.seconds,
            work,
            kinds=kinds,
            ops=ops,
            case_timeout=args.case_timeout,
        )
    if args.json:
        print(json.dumps(summary, indent=1, default=str))
    else:
        print(f"seed {summary['seed']}: {summary['cases']} cases in {summary['seconds']} s")
        print("outcomes:", json.dumps(summary["outcomes"], sort_keys=True))
        print("casnap errors:", json.dumps(summary["casnap_errors"], sort_keys=True))
        for kind, counts in summary["by_kind"].items():
            print(f"  {kind:18} {json.dumps(counts, sort_keys=True)}")
        for f in summary["failures"]:
            print(
                f"FAILURE case {f['case']}: {f.get('kind')} on {f.get('file')} "
                f"({f.get('mutation')}), {f.get('op')} {f.get('snapshot')}: {f['outcome']} "
                f"{f.get('error', '')}\n{f.get('detail', '')}"
            )
        g = summary["largest_growth"]
        if g:
            print(
                f"largest memory growth: {g['growth'] >> 20} MiB (bound {g['bound'] >> 20} MiB, "
                f"manifest {g['manifest_bytes']} bytes), case {g['case']}: {g['kind']}, {g['op']}"
            )
        print(f"failures: {summary['failed']}")
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
