"""Hostile sizes in frames and manifests are refused before anything large is allocated.

Each risky read runs in a child process whose address space is limited
(RLIMIT_AS: what it uses after importing casnap, plus 2 GiB) with a timeout,
so a regression fails fast with a MemoryError or a hang instead of
exhausting the machine. The child reports the exception it got; the test
asserts it is the CasnapError a user should see.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import zstandard
from helpers import tensor_entry

from casnap import IntegrityError, Snapshot, StateDict
from casnap.errors import ManifestValidationError, OutputSpaceError, TooLargeError
from casnap.format import codec
from casnap.format.json_text import canonical_json
from casnap.format.manifest_bytes import serialize
from casnap.format.names import hash_bytes

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20
GiB = 1 << 30


def take(tmp_path: Path, state: dict[str, torch.Tensor], chunk_size: int = MiB) -> Snapshot:
    return Snapshot.take(
        str(tmp_path / "repo" / "s1"),
        {"s": StateDict(**state)},
        settings={"chunk_size": chunk_size},
    )


def casnap_dir(tmp_path: Path) -> Path:
    return tmp_path / "repo" / ".casnap"


def rewrite_manifest(tmp_path: Path, snap: Snapshot, change) -> None:
    """Apply ``change`` to the manifest's JSON, store it under its new hash, point the ref at it."""
    root = casnap_dir(tmp_path)
    doc = json.loads(serialize(snap.manifest))
    change(doc)
    blob = canonical_json(doc)
    name = hash_bytes(blob)
    (root / "manifests" / name[:2]).mkdir(exist_ok=True)
    (root / "manifests" / name[:2] / name).write_bytes(blob)
    ref = json.loads((root / "refs" / "s1").read_text())
    ref["manifest"] = name
    (root / "refs" / "s1").write_text(json.dumps(ref))


def bomb(size: int, declare: bool = True) -> bytes:
    """zstd of ``size`` zero bytes (about size/32768 bytes), optionally declaring the size."""
    cobj = zstandard.ZstdCompressor(level=1, write_content_size=declare).compressobj(
        size=size if declare else -1
    )
    step = 64 * MiB
    parts = [cobj.compress(bytes(step)) for _ in range(size // step)]
    return b"".join([*parts, cobj.flush()])


def frame(
    raw_length: int, payload: bytes, digest_hex: str, codec_id: int = codec.CODEC_ZSTD
) -> bytes:
    head = codec.HEADER.pack(
        codec.MAGIC,
        codec.FRAME_VERSION,
        codec_id,
        0,
        raw_length,
        len(payload),
        bytes.fromhex(digest_hex),
    )
    return head + payload


def run_limited(tmp_path: Path, body: str, *, fsize: int | None = None) -> dict:
    """Run ``body`` (which sets ``result``) in a child with RLIMIT_AS = usage + 2 GiB.

    Returns ``{"ok": True, ...}`` or the exception's class names, message and
    object name. The child is killed after 120 s (a hang fails the test).
    """
    script = textwrap.dedent("""
        import json, os, resource, signal, sys
        import torch, casnap
        from casnap import Snapshot
        from casnap.export import export_safetensors, export_torch
        used = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (used + (2 << 30), used + (2 << 30)))
        FSIZE = {fsize}
        if FSIZE:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (FSIZE, FSIZE))
        repo = sys.argv[1]
        out = {{"ok": True}}
        try:
        {body}
        except BaseException as exc:
            out = {{"ok": False, "types": [c.__name__ for c in type(exc).__mro__],
                    "message": str(exc), "object_name": getattr(exc, "object_name", None)}}
        print("RESULT " + json.dumps(out))
    """).format(fsize=fsize, body=textwrap.indent(textwrap.dedent(body), " " * 8))
    env = dict(os.environ, PYTHONPATH=str(ROOT), MALLOC_ARENA_MAX="2")
    proc = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "repo")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"child died (rc {proc.returncode}): {proc.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT ") :])


def assert_raised(out: dict, cls: type[BaseException]) -> dict:
    assert not out["ok"], "the hostile read succeeded"
    assert cls.__name__ in out["types"], out
    assert "CasnapError" in out["types"], out
    return out


def compressed_length(tmp_path: Path, snap: Snapshot, payload: int) -> None:
    def change(doc):
        doc["entries"]["0/s/w"]["chunks"][0]["length"] = codec.HEADER_SIZE + payload

    rewrite_manifest(tmp_path, snap, change)


def loose_ref(snap: Snapshot, key: str = "0/s/w"):
    ref = tensor_entry(snap.get_manifest(), key).chunks[0]
    assert ref.pack is None
    return ref


# -- decompression bombs ----------------------------------------------------------


def test_zstd_bomb_in_a_loose_chunk_is_refused_before_decompressing(tmp_path):
    snap = take(tmp_path, {"w": torch.randn(MiB // 4)})
    ref = loose_ref(snap)
    path = casnap_dir(tmp_path) / "chunks" / ref.hash[:2] / ref.hash
    payload = bomb(3 * GiB)  # ~100 KB that declares 3 GiB
    assert len(payload) < ref.size
    path.write_bytes(frame(ref.size, payload, ref.hash))
    compressed_length(tmp_path, snap, len(payload))  # as a compressed chunk's ref reads
    out = assert_raised(
        run_limited(
            tmp_path,
            """
        Snapshot(repo + "/s1").read_object("0/s/w")
    """,
        ),
        IntegrityError,
    )
    assert out["object_name"] == f"chunks/{ref.hash[:2]}/{ref.hash}"
    assert "declares 3221225472 bytes" in out["message"]
    # contained like any damage: recorded for the next take
    assert (casnap_dir(tmp_path) / "damaged" / ref.hash / "chunk").exists()


def test_zstd_bomb_without_a_declared_size_stops_at_the_frame_size(tmp_path):
    snap = take(tmp_path, {"w": torch.randn(MiB // 4)})
    ref = loose_ref(snap)
    path = casnap_dir(tmp_path) / "chunks" / ref.hash[:2] / ref.hash
    payload = bomb(3 * GiB, declare=False)
    path.write_bytes(frame(ref.size, payload, ref.hash))
    compressed_length(tmp_path, snap, len(payload))
    out = assert_raised(
        run_limited(
            tmp_path,
            """
        Snapshot(repo + "/s1").restore({"s": casnap.StateDict(w=torch.zeros(1 << 18))})
    """,
        ),
        IntegrityError,
    )
    assert out["object_name"] == f"chunks/{ref.hash[:2]}/{ref.hash}"


def test_zstd_bomb_in_a_pack_frame_is_refused(tmp_path):
    # 200 KiB: below the pack limit of a 1 MiB chunk size, large enough to hide a bomb
    snap = take(tmp_path, {"w": torch.randn(MiB // 4), "b": torch.randn(50_000)})
    ref = tensor_entry(snap.get_manifest(), "0/s/b").chunks[0]
    assert ref.pack is not None
    pack = casnap_dir(tmp_path) / "packs" / ref.pack[:2] / ref.pack
    blob = pack.read_bytes()
    new = frame(ref.size, bomb(3 * GiB), ref.hash)
    pack.write_bytes(blob[: ref.offset] + new + blob[ref.offset + ref.length :])

    def point_at_bomb(doc):
        for c in doc["entries"]["0/s/b"]["chunks"]:
            c["length"] = len(new)

    rewrite_manifest(tmp_path, snap, point_at_bomb)
    out = assert_raised(
        run_limited(
            tmp_path,
            """
        Snapshot(repo + "/s1").read_object("0/s/b")
    """,
        ),
        IntegrityError,
    )
    assert out["object_name"] == f"packs/{ref.pack[:2]}/{ref.pack}"


def test_frame_declaring_more_than_a_chunk_is_refused_before_reading_its_payload():
    digest = "ab" * 32
    n = codec.MAX_CHUNK_SIZE + 1
    huge = codec.HEADER.pack(codec.MAGIC, 1, codec.CODEC_RAW, 0, n, n, bytes.fromhex(digest))
    with pytest.raises(IntegrityError, match="more than the largest chunk"):
        codec.parse_header(huge, "chunks/ab/x")
    longer = frame(10, b"x" * 11, digest)  # a payload longer than its raw bytes
    with pytest.raises(IntegrityError, match="larger than its 10 raw bytes"):
        codec.decode(longer, "chunks/ab/x", bytes.fromhex(digest), 10)


# -- sizes declared by a manifest -----------------------------------------------


def _declare(tmp_path: Path, snap: Snapshot, key: str, nbytes: int, *, chunk: int = GiB) -> None:
    """Make tensor ``key`` declare ``nbytes`` (float32), consistently chunked: a valid manifest."""

    def change(doc):
        e = doc["entries"][key]
        first = e["chunks"][0]
        e["shape"], e["chunk_size"] = [nbytes // 4], chunk
        e["chunks"] = [
            dict(first, size=min(chunk, nbytes - i * chunk)) for i in range(-(-nbytes // chunk))
        ]

    rewrite_manifest(tmp_path, snap, change)


def test_huge_declared_tensor_is_refused_before_allocating(tmp_path):
    snap = take(tmp_path, {"w": torch.randn(MiB // 4)})
    _declare(tmp_path, snap, "0/s/w", 8 * GiB)  # more than the child may allocate
    out = assert_raised(
        run_limited(
            tmp_path,
            """
        Snapshot(repo + "/s1").read_object("0/s/w")
    """,
        ),
        TooLargeError,
    )
    assert "0/s/w" in out["message"] and "declares 8589934592 bytes" in out["message"]
    assert "MemoryError" in out["types"]


def test_huge_declared_tensor_in_a_restore_is_refused_and_the_target_is_untouched(tmp_path):
    snap = take(tmp_path, {"w": torch.randn(MiB // 4), "b": torch.randn(10)})
    _declare(tmp_path, snap, "0/s/w", 1 << 40)  # 1 TiB: beyond any machine's memory
    out = assert_raised(
        run_limited(
            tmp_path,
            """
        b = torch.full((10,), 7.0)
        try:
            Snapshot(repo + "/s1").restore({"s": casnap.StateDict(w=None, b=b)}, strict=False)
        finally:
            assert torch.equal(b, torch.full((10,), 7.0)), "the target changed"
    """,
        ),
        TooLargeError,
    )
    assert "declares 1099511627776 bytes" in out["message"]


def test_huge_pickled_object_is_refused_before_allocating(tmp_path):
    snap = Snapshot.take(
        str(tmp_path / "repo" / "s1"), {"s": StateDict(o={1, 2, 3})}, allow_pickle=True
    )
    key = next(k for k, e in snap.get_manifest().items() if e.kind == "object")

    def change(doc):
        e = doc["entries"][key]
        nbytes, chunk = 6 * GiB, GiB
        e["size"], e["chunk_size"] = nbytes, chunk
        e["chunks"] = [dict(e["chunks"][0], size=chunk) for _ in range(nbytes // chunk)]

    rewrite_manifest(tmp_path, snap, change)
    out = assert_raised(
        run_limited(
            tmp_path,
            f"""
        Snapshot(repo + "/s1").read_object({key!r}, allow_pickle=True)
    """,
        ),
        TooLargeError,
    )
    assert "declares 6442450944 bytes" in out["message"]


def test_chunk_ref_with_a_huge_frame_length_is_refused_by_the_manifest_check(tmp_path):
    snap = take(tmp_path, {"w": torch.randn(MiB // 4), "b": torch.randn(10)})
    assert tensor_entry(snap.get_manifest(), "0/s/b").chunks[0].pack is not None

    def change(doc):
        doc["entries"]["0/s/b"]["chunks"][0]["length"] = 1 << 40  # a 1 TiB ranged read

    rewrite_manifest(tmp_path, snap, change)
    out = assert_raised(
        run_limited(
            tmp_path,
            """
        Snapshot(repo + "/s1").read_object("0/s/b")
    """,
        ),
        ManifestValidationError,
    )
    assert "exceeds header" in out["message"]


# -- export ------------------------------------------------------------------------


def test_export_of_a_huge_declared_tensor_is_refused_before_writing(tmp_path):
    snap = take(tmp_path, {"w": torch.randn(MiB // 4)})
    # Far more than the free space (1 TiB more than twice it), in whole 1 GiB chunks: a
    # fixed 1 PiB would be a manifest of a million chunk records, slow to write and read.
    free = shutil.disk_usage(tmp_path).free
    declared = -(-(2 * free + (1 << 40)) // GiB) * GiB
    _declare(tmp_path, snap, "0/s/w", declared)
    (tmp_path / "out").mkdir()
    for fn in ("export_safetensors", "export_torch"):
        out = assert_raised(
            run_limited(
                tmp_path,
                f"""
            {fn}(Snapshot(repo + "/s1"), repo + "/../out/model")
        """,
            ),
            OutputSpaceError,
        )
        written = int(out["message"].split("would write ")[1].split()[0])
        assert declared <= written < declared + MiB and "free" in out["message"]
        assert "OSError" in out["types"]
    assert os.listdir(tmp_path / "out") == []


def test_export_larger_than_the_file_size_limit_is_a_clean_error_with_no_file_left(tmp_path):
    snap = take(tmp_path, {"w": torch.randn(MiB)})  # 4 MiB of data
    assert tensor_entry(snap.get_manifest(), "0/s/w").nbytes == 4 * MiB
    (tmp_path / "out").mkdir()
    out = assert_raised(
        run_limited(
            tmp_path,
            """
        export_safetensors(Snapshot(repo + "/s1"), repo + "/../out/model.safetensors")
    """,
            fsize=MiB,
        ),
        OutputSpaceError,
    )
    assert "File too large" in out["message"]
    assert os.listdir(tmp_path / "out") == []


@pytest.mark.parametrize(
    "entry",
    [
        {"kind": "primitive", "type": "float", "value": "0x1p+99999"},
        {"kind": "primitive", "type": "complex", "value": ["0x1p+0", "-0x1p+99999"]},
    ],
)
def test_an_overflowing_float_primitive_is_a_manifest_error_naming_the_entry(tmp_path, entry):
    # float.fromhex("0x1p+99999") raises OverflowError: every reader must see
    # casnap's error instead, from the manifest check.
    snap = Snapshot.take(str(tmp_path / "repo" / "s1"), {"s": StateDict(w=torch.ones(4), lr=0.5)})
    rewrite_manifest(tmp_path, snap, lambda doc: doc["entries"].__setitem__("0/s/lr", entry))
    path = str(tmp_path / "repo" / "s1")
    for read in (
        lambda: Snapshot(path).restore({"s": StateDict(w=torch.zeros(4), lr=0.0)}),
        lambda: Snapshot(path).restore({"s": StateDict(w=torch.zeros(4), lr=0.0)}, strict=False),
        lambda: Snapshot(path).read_object("0/s/lr"),
        lambda: Snapshot(path).read_object("0/s/w"),
    ):
        with pytest.raises(ManifestValidationError, match=r"0/s/lr.*overflows"):
            read()


def test_an_overflowing_quantization_scale_is_a_manifest_error(tmp_path):
    q = torch.quantize_per_tensor(torch.ones(4), scale=0.5, zero_point=0, dtype=torch.qint8)
    snap = Snapshot.take(str(tmp_path / "repo" / "s1"), {"s": StateDict(q=q)})

    def change(doc):
        doc["entries"]["0/s/q"]["quantized"]["scale"] = "0x1p+99999"

    rewrite_manifest(tmp_path, snap, change)
    with pytest.raises(ManifestValidationError, match=r"0/s/q.*overflows"):
        Snapshot(str(tmp_path / "repo" / "s1")).read_object("0/s/q")
