"""Sharded entries that ask for more work than they hold are refused when read (issue #41).

A sharded entry's shards tile its tensor: together they hold each element
once, and a rank's empty local shard is at most one per rank. rank_groups may
expand to no more keys and shard records than a fixed bound plus a multiple
of the manifest's bytes. Each is a ``ManifestValidationError`` naming the entry.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from casnap.errors import ManifestValidationError
from casnap.format.names import hash_bytes
from casnap.format.parse import parse_manifest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "machinery"))
import fuzz_repo  # noqa: E402

H = "a" * 64


def _shard(off: int, size: int, cs: int = 4096) -> dict:
    chunks = [{"hash": H, "size": size * 4, "length": 56 + size * 4}] if size else []
    return {"offsets": [off], "sizes": [size], "chunk_size": cs, "chunks": chunks}


def _manifest(shards: list[dict], shape: list[int], **extra: object) -> bytes:
    entry = {"kind": "sharded", "layout": "dtensor", "dtype": "float32", "shape": shape}
    doc: dict[str, object] = {
        "format_version": "1.0",
        "created_at": "t",
        "entries": {"0/m/w": {**entry, "shards": shards}},
    }
    doc.update(extra)
    return json.dumps(doc).encode()


def _parse(data: bytes):
    return parse_manifest(data, hash_bytes(data))


def test_shards_that_tile_the_tensor_are_accepted():
    m = _parse(_manifest([_shard(0, 16), _shard(16, 16), _shard(32, 0)], [32], world_size=4))
    assert len(m.entries["0/m/w"].shards) == 3


@pytest.mark.parametrize(
    ("shards", "words"),
    [
        ([_shard(0, 16), _shard(0, 16), _shard(16, 16)], "overlap"),  # a duplicate
        ([_shard(0, 16)], "16 of the tensor's 32"),  # a gap
        ([_shard(0, 32)] + [_shard(i, 0) for i in range(5)], "5 empty shards"),
    ],
)
def test_shards_that_overlap_leave_gaps_or_are_empty_beyond_the_ranks_are_refused(shards, words):
    with pytest.raises(ManifestValidationError, match=words) as info:
        _parse(_manifest(shards, [32], world_size=2))
    assert "0/m/w" in str(info.value)


def test_many_shards_beside_a_huge_declared_tensor_are_refused():
    # The tensor declares 17,179,869,192 bytes; its 4,096 small shards hold 64 KiB of it.
    shards = [_shard(i * 4, 4) for i in range(4096)]
    with pytest.raises(ManifestValidationError, match="0/m/w.*16384 of the tensor's 4294967298"):
        _parse(_manifest(shards, [4294967298]))


def test_rank_groups_expand_to_at_most_a_multiple_of_the_manifest():
    def grouped(world: int) -> bytes:
        entry = {"kind": "primitive", "type": "int", "value": 1}
        group = {"ranks": [[0, world - 1]], "entries": {"m/a": entry}}
        doc = {"format_version": "1.0", "created_at": "t", "world_size": world}
        return json.dumps({**doc, "entries": {}, "rank_groups": [group]}).encode()

    assert len(_parse(grouped(4096)).entries) == 4096
    with pytest.raises(ManifestValidationError, match="more than the 1.* a manifest of"):
        _parse(grouped(1 << 24))  # 16 M keys from 200 bytes, refused before any is made


# -- the two inputs of issue #41, in a real repository, each operation in a child --------

_CHILD = r"""
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
import fuzz_repo
from casnap import Repository, Snapshot
from casnap.errors import CasnapError

case = Path(sys.argv[1])
ops = {
    "restore": lambda: fuzz_repo.operate("restore", case, "s2", fuzz_repo._states()),
    "read_object": lambda: Snapshot(str(case / "s2")).read_object("0/s/w"),
    "du": lambda: Repository(str(case)).du(),
    "log": lambda: Repository(str(case)).log(),
    "verify": lambda: Repository(str(case)).verify(),
    "export": lambda: Repository(str(case)).export("s2", str(case / "out.safetensors")),
}
out = {}
for name, call in ops.items():
    start = fuzz_repo._reset_peak()
    try:
        call_result = call()
        got = f"returned {str(call_result)[:4000]}"
    except CasnapError as exc:
        got = f"{type(exc).__name__}: {exc}"
    out[name] = {"got": got, "growth": fuzz_repo._growth(start, case).get("growth")}
print(json.dumps(out))
"""


class _Pick(random.Random):
    """A seeded generator whose ``random()`` answers ``value`` (picks one branch)."""

    def __init__(self, value: float) -> None:
        super().__init__(0)
        self.value = value

    def random(self) -> float:
        return self.value


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fuzz-base")
    fuzz_repo.build(root)
    return root


@pytest.mark.parametrize(
    ("how", "pick", "count"),
    # 65,535 empty shards; 16,384 that leave a gap in a 16 GiB tensor, beside a 16 GiB one
    [("empty", 0.9, 65535), ("huge", 0.6, 16384)],
    ids=["many_shards", "many_shards_beside_a_huge_tensor"],
)
def test_a_small_hostile_manifest_is_refused_within_256_mib(base, tmp_path, how, pick, count):
    case = tmp_path / "case"
    shutil.copytree(base, case)
    old = {v[0]: k for k, v in fuzz_repo._owners(case).items()}["s2"]
    doc = json.loads((case / ".casnap" / "manifests" / old[:2] / old).read_bytes())
    fuzz_repo._inline_parts(case, doc)  # the entries of its parts, inline (both are read)
    what = fuzz_repo.many_shards(_Pick(pick), doc, how, count)
    name = fuzz_repo._write_manifest(case, old, doc)
    size = (case / ".casnap" / "manifests" / name[:2] / name).stat().st_size
    assert size < 8 << 20, (what, size)
    env = {**os.environ, "CASNAP_INDEX_DIR": str(tmp_path / "index")}
    child = [sys.executable, "-c", _CHILD, str(case), str(ROOT / "tests" / "machinery")]
    done = subprocess.run(child, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.splitlines()[-1])
    for op, r in results.items():
        # verify reports an unreadable manifest among its problems instead of raising.
        refused = "returned" if op == "verify" else "ManifestValidationError"
        assert r["got"].startswith(refused) and "0/s/w" in r["got"], (op, r)
        assert r["growth"] is None or r["growth"] < 256 << 20, (op, r)


def test_one_refused_copy_named_by_many_refs_is_recorded_once(tmp_path, monkeypatch):
    """A read of thousands of refs to one loose chunk (every shard of a hostile entry
    naming it) whose object is refused records that copy damaged once, not per ref:
    40,000 records, each an fsynced put, made such a read hang."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from casnap import Repository, Snapshot, StateDict
    from casnap.chunks import read
    from casnap.chunks.budget import ByteBudget
    from casnap.chunks.target import Consumer
    from casnap.errors import ObjectRefusedError

    root = tmp_path / "repo"
    snap = Snapshot.take(str(root / "s"), {"m": StateDict(w=torch.randn(1 << 18))})
    ref = snap.manifest.chunk_refs()[0]
    assert ref.pack is None  # a 1 MiB tensor is stored loose
    path = root / ".casnap" / "chunks" / ref.hash[:2] / ref.hash
    path.unlink()
    os.mkfifo(path)  # what casnap refuses to read
    calls: list[object] = []
    real = getattr(read, "contain")  # noqa: B009 (the name read.py calls, patched below)

    def counted(*args: object) -> None:
        calls.append(args)
        real(*args)

    monkeypatch.setattr(read, "contain", counted)
    repo = Repository(str(root)).storage
    with ThreadPoolExecutor(2) as pool, pytest.raises(ObjectRefusedError):
        read.read_chunks(
            repo, [ref] * 5000, Consumer(lambda i, data: None), pool, ByteBudget(1 << 30)
        )
    assert len(calls) == 1
    assert len(list((root / ".casnap" / "damaged").rglob("*"))) == 2  # its folder and record
