"""Export to safetensors and torch.save files: what the readers get back, bit for bit.

Tensors are compared by raw bytes (NaN payloads and -0.0 included), never by value.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
import subprocess
import sys
import textwrap
import zipfile
import zlib
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from helpers import flip_byte
from torch.utils.serialization import config as torch_serialization_config

from casnap import IntegrityError, Snapshot, StateDict
from casnap.errors import MissingKeyError, UnsupportedValueError
from casnap.export import (
    SAFETENSORS_DTYPES,
    TORCH_LEGACY_STORAGES,
    TORCH_UNTYPED_STORAGE_DTYPES,
    ExportItem,
    crc32_combine,
    export_safetensors,
    export_torch,
    plan_torch_archive,
    select,
    torch_pickle,
    write_torch_archive,
)
from casnap.format.entries import DTYPE_ITEMSIZE, ChunkRef, ContainerEntry, TensorEntry
from casnap.format.manifest import Manifest

CHUNK = 4096
pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")


def raw(t: torch.Tensor) -> bytes:
    """The bytes of ``t`` in row-major order."""
    t = t.detach().reshape(-1)
    if not t.is_contiguous():
        t = t.contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()) if t.numel() else b""


def random_bits(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """``n`` elements of ``dtype`` with random bit patterns (NaNs with payloads included)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g).view(dtype)


def take(tmp_path: Path, name: str, state: dict[str, Any]) -> Snapshot:
    Snapshot.take(str(tmp_path / "repo" / name), state, settings={"chunk_size": CHUNK})
    return Snapshot(str(tmp_path / "repo" / name))  # a fresh reader, manifest from disk


def mixed_state() -> dict[str, torch.Tensor]:
    """Every kind of tensor the tests care about: dtypes, layouts, sizes, chunking."""
    base = random_bits(6 * 8, torch.float32, 1).reshape(6, 8)
    return {
        "f32": random_bits(37, torch.float32, 2),
        "bf16": random_bits(33, torch.bfloat16, 3).reshape(3, 11),
        "f16": random_bits(10, torch.float16, 4),
        "f64": random_bits(9, torch.float64, 5),
        "i64": random_bits(5, torch.int64, 6),
        "i32": random_bits(5, torch.int32, 7),
        "i16": random_bits(5, torch.int16, 8),
        "i8": random_bits(5, torch.int8, 9),
        "u8": random_bits(7, torch.uint8, 10),
        "flag": torch.tensor([True, False, True]),
        "f8e4": random_bits(12, torch.float8_e4m3fn, 11).reshape(3, 4),
        "f8e5": random_bits(12, torch.float8_e5m2, 12),
        "transposed": base.t(),  # non-contiguous source
        "empty": torch.zeros(0, 3),
        "scalar": torch.tensor(-0.0),
        "scalar_bf16": torch.tensor(1.5, dtype=torch.bfloat16),
        "multi_chunk": random_bits(10_000, torch.float32, 13),  # 40 KB = 10 chunks of 4 KiB
    }


def expected_names(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {f"{prefix}{k}": v for k, v in state.items()}


def load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(str(path))


def load_torch(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def load_torch_mmap(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True, mmap=True)


def load_torch_mmap_computed_offsets(path: Path) -> dict[str, torch.Tensor]:
    """torch.load's fast path: storage offsets computed from miniz's layout rules, checked
    against the zip headers (TORCH_SERIALIZATION_DEBUG)."""
    old = os.environ.get("TORCH_SERIALIZATION_DEBUG")
    os.environ["TORCH_SERIALIZATION_DEBUG"] = "1"
    try:
        patch = torch_serialization_config.patch  # type: ignore[attr-defined]  # made at import
        with patch({"load.calculate_storage_offsets": True}):
            return torch.load(path, weights_only=True, mmap=True)
    finally:
        if old is None:
            del os.environ["TORCH_SERIALIZATION_DEBUG"]
        else:
            os.environ["TORCH_SERIALIZATION_DEBUG"] = old


READERS = {
    "safetensors": (export_safetensors, [load_safetensors]),
    "torch": (export_torch, [load_torch, load_torch_mmap, load_torch_mmap_computed_offsets]),
}


def assert_same(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(loaded) == set(expected)
    for name, want in expected.items():
        got = loaded[name]
        assert got.dtype == want.dtype, name
        assert tuple(got.shape) == tuple(want.shape), name
        assert raw(got) == raw(want), name


# -- round trips ---------------------------------------------------------------


@pytest.mark.parametrize("fmt", sorted(READERS))
def test_whole_snapshot_reads_back_bit_exact(tmp_path, fmt):
    state = mixed_state()
    small = {"w": random_bits(4, torch.float32, 20), "b": random_bits(2, torch.float32, 21)}
    snap = take(tmp_path, "s1", {"m": StateDict(**state), "p": StateDict(**small, step=7)})
    packed = snap.manifest.entries["0/p/w"]
    assert isinstance(packed, TensorEntry) and packed.chunks[0].pack is not None
    assert len(snap.manifest.entries["0/m/multi_chunk"].chunks) == 10  # type: ignore[union-attr]

    export, readers = READERS[fmt]
    out = tmp_path / f"out.{fmt}"
    result = export(snap, out)

    expected = {**expected_names(state, "m/"), **expected_names(small, "p/")}
    for read in readers:
        assert_same(read(out), expected)
    assert set(result.names) == set(expected)
    assert result.skipped == ("0/p/step",)
    assert result.file_bytes == out.stat().st_size
    assert result.tensor_bytes == sum(t.numel() * t.element_size() for t in expected.values())
    assert [p.name for p in tmp_path.iterdir() if "casnap-tmp" in p.name] == []


@pytest.mark.parametrize("fmt", sorted(READERS))
def test_one_container_key_is_named_relative_to_it(tmp_path, fmt):
    state = {"a": random_bits(3, torch.float32, 1), "b": random_bits(70, torch.int16, 2)}
    snap = take(tmp_path, "s1", {"model": StateDict(**state), "other": StateDict(x=torch.ones(2))})
    export, readers = READERS[fmt]
    for key in ("0/model", "model"):  # the rank may be left out when every entry is rank 0
        out = tmp_path / f"{key.replace('/', '_')}.{fmt}"
        result = export(snap, out, key=key)
        assert sorted(result.names) == ["a", "b"]
        for read in readers:
            assert_same(read(out), state)


@pytest.mark.parametrize("fmt", sorted(READERS))
def test_one_tensor_key_is_named_by_its_last_component(tmp_path, fmt):
    w = random_bits(9000, torch.bfloat16, 5).reshape(90, 100)
    snap = take(tmp_path, "s1", {"model": StateDict(**{"layer.weight": w, "other": w[:1]})})
    export, readers = READERS[fmt]
    out = tmp_path / f"w.{fmt}"
    result = export(snap, out, key="0/model/layer.weight")
    assert result.names == ("layer.weight",)
    for read in readers:
        assert_same(read(out), {"layer.weight": w})


def test_names_follow_state_dict_order_and_keep_the_rank_when_several_ranks():
    def tensor() -> TensorEntry:
        return TensorEntry(dtype="float32", shape=[0], chunk_size=CHUNK, chunks=[])

    def manifest(ranks: list[int]) -> Manifest:
        entries: dict[str, Any] = {}
        for r in ranks:
            entries[f"{r}/model"] = ContainerEntry(type="dict", keys=["z", "a%2Fb"])
            entries[f"{r}/model/z"] = tensor()
            entries[f"{r}/model/a%252Fb"] = tensor()
        return Manifest(created_at="now", world_size=len(ranks), entries=entries)

    items, _ = select(manifest([0]), None)
    assert [i.name for i in items] == ["model/z", "model/a%252Fb"]  # member order, escaped
    items, _ = select(manifest([1, 0, 10, 2]), None)
    assert [i.name for i in items][::2] == ["0/model/z", "1/model/z", "2/model/z", "10/model/z"]
    items, _ = select(manifest([0, 1]), "1/model")
    assert [i.name for i in items] == ["z", "a%252Fb"]


def test_exports_are_deterministic_from_the_taking_and_a_reopened_snapshot(tmp_path):
    state = {"m": StateDict(**mixed_state()), "n": StateDict(z=torch.ones(3))}
    taken = Snapshot.take(str(tmp_path / "repo" / "s1"), state)
    reopened = Snapshot(str(tmp_path / "repo" / "s1"))
    for export in (export_safetensors, export_torch):
        a, b = tmp_path / "a", tmp_path / "b"
        export(taken, a)
        export(reopened, b)
        assert a.read_bytes() == b.read_bytes()


# -- file formats ---------------------------------------------------------------


def test_torch_file_is_torch_saves_own_layout(tmp_path):
    """Byte for byte what torch.save writes for the same dict, up to the serialization id."""
    state = mixed_state()
    snap = take(tmp_path, "s1", {"m": StateDict(**state)})
    ours = tmp_path / "ours.pt"
    result = export_torch(snap, ours, key="m")
    theirs = tmp_path / "archive"  # torch.save names the zip folder after the file's stem
    torch.save({name: state[name].contiguous() for name in result.names}, theirs)

    a, b = zipfile.ZipFile(ours), zipfile.ZipFile(theirs)
    assert a.testzip() is None  # every CRC-32 is right
    assert [(i.filename, i.header_offset, i.file_size) for i in a.infolist()] == [
        (i.filename, i.header_offset, i.file_size) for i in b.infolist()
    ]
    id_record = a.getinfo("archive/.data/serialization_id")
    assert (
        ours.read_bytes()[: id_record.header_offset]
        == (theirs.read_bytes()[: id_record.header_offset])
    )
    assert a.read(id_record).isdigit() and len(a.read(id_record)) == 40
    with open(ours, "rb") as fh:  # every storage starts on a 64-byte boundary
        for info in a.infolist():
            fh.seek(info.header_offset + 26)
            name_len, extra_len = struct.unpack("<HH", fh.read(4))
            assert (info.header_offset + 30 + name_len + extra_len) % 64 == 0


def test_safetensors_header_and_alignment(tmp_path):
    state = {"u8": torch.arange(3, dtype=torch.uint8), "f64": random_bits(3, torch.float64, 1)}
    snap = Snapshot.take(
        str(tmp_path / "repo" / "s1"), {"m": StateDict(**state)}, metadata={"step": 1200}
    )
    out = tmp_path / "m.safetensors"
    export_safetensors(snap, out, key="m")
    data = out.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    assert (8 + n) % 8 == 0
    header = json.loads(data[8 : 8 + n])
    assert header["__metadata__"] == {
        "format": "pt",
        "casnap.snapshot": "s1",
        "casnap.manifest": snap.manifest_hash,
        "casnap.step": "1200",
        "casnap.key": "0/m",
    }
    # larger elements first, so each tensor is aligned to its element size
    assert header["f64"] == {"dtype": "F64", "shape": [3], "data_offsets": [0, 24]}
    assert header["u8"] == {"dtype": "U8", "shape": [3], "data_offsets": [24, 27]}
    assert len(data) == 8 + n + 27


# -- every dtype ------------------------------------------------------------------

ALL_DTYPES = {n: getattr(torch, n) for n in DTYPE_ITEMSIZE if hasattr(torch, n)}


def test_dtype_tables_match_the_installed_torch():
    legacy = {
        name: torch.storage._dtype_to_storage_type_map()[dt]
        for name, dt in ALL_DTYPES.items()
        if dt in torch.storage._dtype_to_storage_type_map()
    }
    assert legacy == TORCH_LEGACY_STORAGES
    new = {name for name, dt in ALL_DTYPES.items() if dt in torch.storage._new_dtypes()}
    assert new == TORCH_UNTYPED_STORAGE_DTYPES


@pytest.mark.parametrize("fmt", sorted(READERS))
def test_every_dtype_the_format_can_hold_reads_back(tmp_path, fmt):
    table = (
        SAFETENSORS_DTYPES
        if fmt == "safetensors"
        else (set(TORCH_LEGACY_STORAGES) | TORCH_UNTYPED_STORAGE_DTYPES)
    )
    state = {name: random_bits(6, ALL_DTYPES[name], i) for i, name in enumerate(sorted(table))}
    state = {k: v.reshape(2, 3) for k, v in state.items()}
    state["bool"] = torch.tensor([[True, False, True], [False, False, True]])
    snap = take(tmp_path, "s1", {"m": StateDict(**state)})
    export, readers = READERS[fmt]
    export(snap, tmp_path / "out", key="m")
    for read in readers:
        assert_same(read(tmp_path / "out"), state)


@pytest.mark.parametrize(
    ("fmt", "dtype"),
    [
        ("safetensors", torch.complex128),
        ("safetensors", torch.bits8),
        ("torch", torch.int4),  # type: ignore[attr-defined]  # in torch, missing from its stubs
    ],
)
def test_unsupported_dtype_names_the_key_and_writes_nothing(tmp_path, fmt, dtype):
    odd = (
        torch.zeros(4, dtype=torch.uint8).view(dtype)
        if dtype.itemsize == 1
        else (torch.zeros(4, dtype=dtype))
    )
    snap = take(tmp_path, "s1", {"m": StateDict(ok=torch.ones(2), odd=odd)})
    out = tmp_path / "out"
    with pytest.raises(UnsupportedValueError, match=r"0/m/odd.*" + str(dtype).split(".")[1]):
        READERS[fmt][0](snap, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["repo"]


# -- failures -----------------------------------------------------------------------


@pytest.mark.parametrize("fmt", sorted(READERS))
@pytest.mark.parametrize("where", ["loose", "pack"])
def test_corrupt_chunk_raises_integrity_error_and_leaves_no_output(tmp_path, fmt, where):
    snap = take(tmp_path, "s1", {"m": StateDict(big=torch.randn(10_000), small=torch.randn(8))})
    entry = snap.manifest.entries["0/m/big" if where == "loose" else "0/m/small"]
    assert isinstance(entry, TensorEntry)
    ref = entry.chunks[3 if where == "loose" else 0]
    assert (ref.pack is None) == (where == "loose")
    store = tmp_path / "repo" / ".casnap"
    if ref.pack is None:
        path = store / "chunks" / ref.hash[:2] / ref.hash
        flip_byte(path, path.stat().st_size - 5)
    else:
        flip_byte(store / "packs" / ref.pack[:2] / ref.pack, ref.offset + ref.length - 2)
    out = tmp_path / "out"
    out.write_bytes(b"an older export")
    with pytest.raises(IntegrityError):
        READERS[fmt][0](snap, out)
    assert out.read_bytes() == b"an older export"  # untouched, never half-replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "repo"]  # no temp file left


@pytest.mark.parametrize("fmt", sorted(READERS))
def test_non_tensor_keys_are_refused_clearly(tmp_path, fmt):
    snap = Snapshot.take(
        str(tmp_path / "repo" / "s1"),
        {"m": StateDict(w=torch.ones(2), step=3, cfg={"lr": 0.1})},
        allow_pickle=True,
    )
    export = READERS[fmt][0]
    with pytest.raises(UnsupportedValueError, match=r"0/m/step: is a primitive \(int\)"):
        export(snap, tmp_path / "out", key="0/m/step")
    with pytest.raises(UnsupportedValueError, match="0/m/cfg: holds no tensors"):
        export(snap, tmp_path / "out", key="0/m/cfg")
    with pytest.raises(MissingKeyError, match="no entry 'm/x'"):
        export(snap, tmp_path / "out", key="m/x")
    assert not (tmp_path / "out").exists()


def test_a_failing_progress_callback_aborts_the_export(tmp_path):
    snap = take(tmp_path, "s1", {"m": StateDict(w=torch.randn(10_000))})

    def cancel(done: int, total: int) -> None:
        raise KeyError("cancelled")

    with pytest.raises(KeyError, match="cancelled"):
        export_torch(snap, tmp_path / "out", progress=cancel)
    assert not (tmp_path / "out").exists()


# -- memory -----------------------------------------------------------------------------


def test_read_buffers_stay_under_the_budget_and_progress_reaches_the_total(tmp_path):
    snap = take(tmp_path, "s1", {"m": StateDict(w=torch.randn(200_000), v=torch.randn(50_000))})
    budget = 4 * 2 * CHUNK  # four chunks (raw + frame each) in flight at most
    calls: list[tuple[int, int]] = []
    for export in (export_safetensors, export_torch):
        calls.clear()
        result = export(
            snap,
            tmp_path / "out",
            memory_budget_bytes=budget,
            progress=lambda d, t: calls.append((d, t)),
        )
        assert 0 < result.peak_buffer_bytes <= budget
        assert result.fetched_bytes >= result.tensor_bytes  # random floats stay raw
        dones = [d for d, _ in calls]
        assert dones == sorted(dones) and calls[-1] == (1_000_000, 1_000_000)
        assert len(calls) == len(snap.manifest.entries["0/m/w"].chunks) + 49  # type: ignore[union-attr]


MEASURE = textwrap.dedent(
    """
    import json, sys
    from casnap import Snapshot
    from casnap.export import export_safetensors, export_torch

    def status(field):
        with open("/proc/self/status") as fh:
            return next(int(l.split()[1]) * 1024 for l in fh if l.startswith(field + ":"))

    path, out = sys.argv[1:3]
    snap = Snapshot(path)
    snap.manifest
    before = status("VmRSS")
    # VmHWM, not ru_maxrss: Linux carries the parent's peak RSS into ru_maxrss across exec.
    growth = {}
    export_safetensors(snap, out + ".safetensors", memory_budget_bytes=16 << 20)
    growth["safetensors"] = status("VmHWM") - before
    export_torch(snap, out + ".pt", memory_budget_bytes=16 << 20)
    growth["torch"] = status("VmHWM") - before
    state = snap.read_object("0/m")  # the control, last: everything in memory at once
    growth["load"] = status("VmHWM") - before
    print(json.dumps(growth))
    """
)


@pytest.mark.slow  # a subprocess importing torch: ~10 s on a slow machine
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_peak_memory_of_an_export_is_far_below_the_snapshot_size(tmp_path):
    size = 200 << 20
    g = torch.Generator().manual_seed(0)
    parts = {
        f"t{i}": torch.empty(size // 4 // 8, dtype=torch.int64).random_(generator=g)
        for i in range(4)
    }
    Snapshot.take(str(tmp_path / "repo" / "big"), {"m": StateDict(**parts)})
    del parts

    cmd = [sys.executable, "-c", MEASURE, str(tmp_path / "repo" / "big"), str(tmp_path / "out")]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=300)
    growth = json.loads(done.stdout.strip().splitlines()[-1])
    print(
        f"RSS growth over {size >> 20} MiB, 16 MiB budget: "
        + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in growth.items())
    )
    assert growth["safetensors"] < size / 2
    assert growth["torch"] < size / 2
    assert growth["load"] > size * 0.9  # the measurement does see a full load
    assert (tmp_path / "out.pt").stat().st_size > size


# -- zip64 and CRC -------------------------------------------------------------------------


def test_crc32_combine_matches_zlib():
    a, b = os.urandom(5000), os.urandom(4096 * 3 + 17)
    for cut in (0, 1, 4096, len(b)):
        head, tail = a + b[:cut], b[cut:]
        assert crc32_combine(zlib.crc32(head), zlib.crc32(tail), len(tail)) == zlib.crc32(a + b)


def _zeros_crc(n: int) -> int:
    """CRC-32 of ``n`` zero bytes without allocating them."""
    block, crc, step = zlib.crc32(bytes(1 << 20)), 0, 1 << 20
    while n >= step:
        crc, n = crc32_combine(crc, block, step), n - step
    return crc32_combine(crc, zlib.crc32(bytes(n)), n)


def test_torch_archive_past_4_gib_uses_zip64_where_torch_expects_it(tmp_path):
    """A sparse file: a 4 GiB + 64 B storage of zeros, then a small one past the 4 GiB mark."""
    big = (1 << 32) + 64
    refs = [
        ChunkRef(hash="0" * 64, size=min(1 << 30, big - i * (1 << 30)), length=100)
        for i in range(5)
    ]
    items = [
        ExportItem(
            "big", "0/big", TensorEntry(dtype="uint8", shape=[big], chunk_size=1 << 30, chunks=refs)
        ),
        ExportItem(
            "small",
            "0/small",
            TensorEntry(
                dtype="int16",
                shape=[4],
                chunk_size=CHUNK,
                chunks=[ChunkRef(hash="0" * 64, size=8, length=64)],
            ),
        ),
    ]
    plan, small = plan_torch_archive(torch_pickle(items), [big, 8])
    small_data = struct.pack("<4h", 1, -2, 3, -4)
    out = tmp_path / "big.pt"
    with open(out, "wb") as fh:
        fh.truncate(plan.cursor + len(plan.directory()))
        fd = fh.fileno()
        os.pwrite(fd, small_data, plan.records[5].data_offset)
        write_torch_archive(fd, plan, small, {4: _zeros_crc(big), 5: zlib.crc32(small_data)})

    infos = {i.filename: i for i in zipfile.ZipFile(out).infolist()}
    assert infos["archive/data/0"].file_size == big
    assert infos["archive/data/1"].header_offset > 1 << 32
    assert zipfile.ZipFile(out).read("archive/data/1") == small_data  # CRC checked
    for load in (load_torch_mmap, load_torch_mmap_computed_offsets):
        loaded = load(out)
        assert loaded["big"].shape == (big,) and loaded["big"].dtype == torch.uint8
        assert loaded["small"].tolist() == [1, -2, 3, -4]
