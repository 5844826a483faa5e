"""Export a snapshot, or one key of it, to a safetensors file or a ``torch.save`` file.

Both exports stream. The whole file layout (names, dtypes, shapes, offsets) is
planned from the manifest before anything is read; then every chunk is fetched
through the verified reader (:func:`casnap.chunks.read_chunks`) under a
:class:`~casnap.budget.ByteBudget` and written at its offset with ``pwrite``, in
whatever order the chunks arrive. No tensor is ever held whole in memory.

The output is written to a temporary file next to ``out_path``, fsynced and
renamed into place only once complete: a failure (a corrupt chunk raises
:class:`casnap.IntegrityError`) leaves no partial file at ``out_path``.

The ``torch.save`` file is the zip archive PyTorch's own writer produces
(``torch/serialization.py`` ``_save`` with ``caffe2/serialize/inline_container.cc``
and miniz): ``data.pkl`` pickled with protocol 2 and storage persistent ids,
``.format_version``, ``.storage_alignment``, ``byteorder``, one stored record per
tensor ``data/<i>`` whose bytes start on a 64-byte boundary (so
``torch.load(mmap=True)`` maps them in place), ``version`` and
``.data/serialization_id``; local headers carry miniz's ``FB`` padding field and
data descriptors, zip64 where sizes or offsets need it. See docs/export.md.
"""

from __future__ import annotations

import collections
import hashlib
import io
import json
import os
import pickle
import secrets
import struct
import threading
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from casnap.budget import ByteBudget
from casnap.chunks import Buffer, read_chunks
from casnap.errors import MissingKeyError, UnsupportedValueError
from casnap.manifest import (
    DTYPE_ITEMSIZE,
    ChunkRef,
    ContainerEntry,
    Manifest,
    ObjectEntry,
    PrimitiveEntry,
    TensorEntry,
)
from casnap.settings import Settings, default_memory_budget
from casnap.torch_io.flatten import subtree
from casnap.torch_io.tensors import torch_dtype

if TYPE_CHECKING:
    from casnap.snapshot import Snapshot

Progress = Callable[[int, int], None]
PathLike = str | os.PathLike[str]

# casnap dtype name -> safetensors dtype code (what safetensors 0.8 reads back).
SAFETENSORS_DTYPES: dict[str, str] = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "float8_e8m0fnu": "F8_E8M0", "float4_e2m1fn_x2": "F4",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8",
    "bool": "BOOL", "complex64": "C64",
}  # fmt: skip
# torch.save pickles these as legacy typed storages (torch.storage._dtype_to_storage_type_map)
# rebuilt by _rebuild_tensor_v2 ...
TORCH_LEGACY_STORAGES: dict[str, str] = {
    "float64": "DoubleStorage", "float32": "FloatStorage", "float16": "HalfStorage",
    "bfloat16": "BFloat16Storage", "int64": "LongStorage", "int32": "IntStorage",
    "int16": "ShortStorage", "int8": "CharStorage", "uint8": "ByteStorage",
    "bool": "BoolStorage", "complex128": "ComplexDoubleStorage",
    "complex64": "ComplexFloatStorage",
}  # fmt: skip
# ... and these as an UntypedStorage plus the dtype, rebuilt by _rebuild_tensor_v3
# (torch.storage._new_dtypes). Sub-byte int1..int7 / uint1..uint7 are in neither:
# torch.save itself cannot write them.
TORCH_UNTYPED_STORAGE_DTYPES = frozenset({
    "float8_e5m2", "float8_e4m3fn", "float8_e5m2fnuz", "float8_e4m3fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2", "bits8", "bits16", "bits1x8", "bits2x4", "bits4x2", "complex32",
    "uint16", "uint32", "uint64",
})  # fmt: skip


@dataclass(frozen=True)
class ExportResult:
    """What an export wrote."""

    path: str
    format: Literal["safetensors", "torch"]
    names: tuple[str, ...]  # tensor names in the file, in data order
    tensor_bytes: int  # tensor data written
    file_bytes: int  # size of the file
    fetched_bytes: int  # bytes read from the store (frames, as stored)
    peak_buffer_bytes: int  # most bytes the read budget held at once
    skipped: tuple[str, ...] = ()  # non-tensor keys in the selection, not exported


@dataclass(frozen=True)
class ExportItem:
    """One tensor to export: its name in the file, its logical key and its entry."""

    name: str
    key: str
    entry: TensorEntry


# -- what to export ------------------------------------------------------------


def resolve_key(manifest: Manifest, key: str) -> str:
    """``key`` as a logical key of the snapshot; ``model/...`` means ``0/model/...`` when
    every entry is rank 0."""
    entries = manifest.entries
    if key in entries:
        return key
    if f"0/{key}" in entries and all(k.startswith("0/") for k in entries):
        return f"0/{key}"
    near = [k for k in entries if k.endswith(key) or key in k][:8]
    hint = f"; did you mean {', '.join(repr(k) for k in near)}?" if near else ""
    raise MissingKeyError(f"no entry {key!r} in the snapshot{hint}", key)


def _roots(entries: dict[str, Any]) -> list[str]:
    """Top-level keys (``<rank>/<app key>``) ordered by rank, then key."""

    def rank_then_key(k: str) -> tuple[int, str]:
        rank = k.split("/", 1)[0]
        return (int(rank) if rank.isdigit() else -1, k)

    return sorted((k for k in entries if k.rsplit("/", 1)[0] not in entries), key=rank_then_key)


def select(manifest: Manifest, key: str | None) -> tuple[list[ExportItem], list[str]]:
    """The tensors to export, named by the rule of docs/export.md, and the skipped keys.

    Tensors come in state-dict order (each container's member order), not in the
    manifest's sorted key order.
    """
    entries = manifest.entries
    if key is None:
        order: list[str] = []
        for root in _roots(entries):
            order.extend(subtree(entries, root))
        seen = set(order)
        order += sorted(k for k in entries if k not in seen)  # unlisted entries, if any
        strip = 2 if all(k.startswith("0/") for k in entries) else 0
        named = [(k[strip:], k) for k in order]
    else:
        k = resolve_key(manifest, key)
        entry = entries[k]
        if isinstance(entry, TensorEntry):
            return [ExportItem(k.rsplit("/", 1)[-1], k, entry)], []
        if isinstance(entry, PrimitiveEntry):
            what = f"a primitive ({entry.type})"
        elif isinstance(entry, ObjectEntry):
            what = f"a pickled {entry.type_name}"
        else:
            what = ""
        if what:
            raise UnsupportedValueError(
                f"{k}: is {what}, not a tensor or a container of tensors; "
                "export writes tensors only",
                k,
            )
        named = [(sub[len(k) + 1 :], sub) for sub in subtree(entries, k)[1:]]
    items: list[ExportItem] = []
    skipped: list[str] = []
    for name, k in named:
        entry = entries[k]
        if isinstance(entry, TensorEntry):
            items.append(ExportItem(name, k, entry))
        elif not isinstance(entry, ContainerEntry):
            skipped.append(k)
    if key is not None and not items:
        raise UnsupportedValueError(f"{key}: holds no tensors to export", key)
    return items, skipped


# -- streaming chunks into a file ----------------------------------------------


@contextmanager
def _atomic_output(out_path: PathLike) -> Iterator[int]:
    """A file descriptor of a temporary file that becomes ``out_path`` on success only."""
    final = os.path.abspath(os.fspath(out_path))
    directory, base = os.path.split(final)
    tmp = os.path.join(directory, f".{base}.{secrets.token_hex(6)}.casnap-tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    done = False
    try:
        yield fd
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, final)
        done = True
    finally:
        if fd >= 0:
            os.close(fd)
        if not done:
            os.unlink(tmp)
    try:  # make the rename durable
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass  # not every platform can open or fsync a directory


def _pwrite_all(fd: int, data: Buffer, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _stream(
    snapshot: Snapshot,
    items: list[ExportItem],
    offsets: list[int],
    fd: int,
    memory_budget_bytes: int | None,
    progress: Progress | None,
    with_crc: bool = False,
) -> tuple[int, int, list[int]]:
    """Fetch every chunk of ``items`` and write item ``j``'s bytes at ``offsets[j]``.

    Returns the bytes fetched, the budget's peak and (``with_crc``) each chunk's CRC-32.
    """
    refs: list[ChunkRef] = []
    dest: list[int] = []
    for item, base in zip(items, offsets):
        for c, ref in enumerate(item.entry.chunks):
            refs.append(ref)
            dest.append(base + c * item.entry.chunk_size)
    crcs = [0] * len(refs)
    total = sum(item.entry.nbytes for item in items)
    done = 0
    failures: list[BaseException] = []
    lock = threading.Lock()

    def sink(i: int, data: Buffer) -> None:
        nonlocal done
        if failures:
            return  # the export has failed; let the reader drain
        try:
            _pwrite_all(fd, data, dest[i])
            if with_crc:
                crcs[i] = zlib.crc32(data)
            with lock:
                done += len(data)
                if progress is not None:
                    progress(done, total)
        except Exception as exc:  # a full disk, or the progress callback
            with lock:
                failures.append(exc)

    budget = ByteBudget(memory_budget_bytes or default_memory_budget())
    fetched = 0
    if refs:
        workers = Settings.from_env().io_workers
        with ThreadPoolExecutor(workers, thread_name_prefix="casnap-export") as pool:
            fetched = read_chunks(snapshot.repository, refs, sink, pool, budget)
    if failures:
        raise failures[0]
    return fetched, budget.peak, crcs


def _plan(
    snapshot: Snapshot, key: str | None
) -> tuple[list[ExportItem], list[str], dict[str, str]]:
    """The items and skipped keys of the selection, and what identifies it."""
    manifest = snapshot.manifest
    if key is not None:
        key = resolve_key(manifest, key)
    items, skipped = select(manifest, key)
    info = {
        "casnap.snapshot": snapshot.name,
        "casnap.manifest": snapshot.manifest_hash,
    }
    if "step" in manifest.metadata:
        info["casnap.step"] = json.dumps(manifest.metadata["step"])
    if key is not None:
        info["casnap.key"] = key
    return items, skipped, info


# -- safetensors ---------------------------------------------------------------


def _safetensors_header(items: list[ExportItem], metadata: dict[str, str]) -> bytes:
    header: dict[str, Any] = {"__metadata__": metadata}
    start = 0
    for item in items:
        dtype, shape = item.entry.dtype, list(item.entry.shape)
        code = SAFETENSORS_DTYPES.get(dtype)
        if code is None:
            raise UnsupportedValueError(
                f"{item.key}: safetensors has no dtype for {dtype} "
                f"(it stores {', '.join(sorted(SAFETENSORS_DTYPES))})",
                item.key,
            )
        if code == "F4":  # safetensors counts 4-bit values: two per float4_e2m1fn_x2 element
            if not shape:
                raise UnsupportedValueError(
                    f"{item.key}: a 0-dim float4_e2m1fn_x2 tensor has no safetensors shape",
                    item.key,
                )
            shape[-1] *= 2
        if item.name in header:
            raise UnsupportedValueError(
                f"{item.key}: name {item.name!r} is reserved or used twice", item.key
            )
        end = start + item.entry.nbytes
        header[item.name] = {"dtype": code, "shape": shape, "data_offsets": [start, end]}
        start = end
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(raw)) + raw


def export_safetensors(
    snapshot: Snapshot,
    out_path: PathLike,
    *,
    key: str | None = None,
    memory_budget_bytes: int | None = None,
    progress: Progress | None = None,
) -> ExportResult:
    """Write the tensors of ``snapshot`` (or of one ``key``) to a safetensors file.

    Names follow docs/export.md: ``model/0.weight`` for a single-rank snapshot,
    names relative to ``key`` when one is given. ``__metadata__`` holds
    ``format: pt`` and the snapshot's name, manifest hash, step and key.
    ``progress(bytes_done, bytes_total)`` is called as data lands (from I/O
    threads, one call at a time). Non-tensor entries are skipped and listed in
    the result.

    Example::

        snap = Snapshot("/ckpt/run1/step_100")
        export_safetensors(snap, "model.safetensors", key="model")
        safetensors.torch.load_file("model.safetensors")["0.weight"]
    """
    items, skipped, info = _plan(snapshot, key)
    # Largest elements first, so every tensor starts aligned to its element size.
    items.sort(key=lambda it: -DTYPE_ITEMSIZE[it.entry.dtype])
    header = _safetensors_header(items, {"format": "pt", **info})
    offsets, pos = [], len(header)
    for item in items:
        offsets.append(pos)
        pos += item.entry.nbytes
    with _atomic_output(out_path) as fd:
        os.ftruncate(fd, pos)
        _pwrite_all(fd, header, 0)
        fetched, peak, _ = _stream(snapshot, items, offsets, fd, memory_budget_bytes, progress)
    return ExportResult(
        os.fspath(out_path), "safetensors", tuple(it.name for it in items),
        pos - len(header), pos, fetched, peak, tuple(skipped),
    )  # fmt: skip


# -- torch.save: data.pkl -------------------------------------------------------


class _StorageRef:
    """Pickled as the persistent id torch.save gives a storage."""

    def __init__(self, pid: tuple[Any, ...]) -> None:
        self.pid = pid


class _Rebuild:
    """Pickled as ``rebuild(*args)``, the reduction torch.Tensor.__reduce_ex__ returns."""

    def __init__(self, rebuild: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.rebuild = rebuild
        self.args = args

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return self.rebuild, self.args


class _TorchPickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        return obj.pid if isinstance(obj, _StorageRef) else None


def contiguous_strides(shape: list[int]) -> tuple[int, ...]:
    """Row-major strides as torch computes them (a zero dimension counts as one)."""
    strides, acc = [], 1
    for dim in reversed(shape):
        strides.append(acc)
        acc *= max(dim, 1)
    return tuple(reversed(strides))


def torch_pickle(items: list[ExportItem]) -> bytes:
    """``data.pkl``: a dict name -> tensor, pickled as torch.save pickles it.

    Storage ``i`` (record ``data/<i>``) holds item ``i``.
    """
    state: dict[str, _Rebuild] = {}
    for i, item in enumerate(items):
        dtype, shape = item.entry.dtype, list(item.entry.shape)
        legacy = TORCH_LEGACY_STORAGES.get(dtype)
        if legacy is not None:
            numel = item.entry.nbytes // DTYPE_ITEMSIZE[dtype]
            storage = _StorageRef(("storage", getattr(torch, legacy), str(i), "cpu", numel))
            rebuild: Callable[..., Any] = torch._utils._rebuild_tensor_v2
            extra: tuple[Any, ...] = ()
        elif dtype in TORCH_UNTYPED_STORAGE_DTYPES:
            pid = ("storage", torch.UntypedStorage, str(i), "cpu", item.entry.nbytes)
            storage = _StorageRef(pid)
            rebuild = torch._utils._rebuild_tensor_v3
            extra = (torch_dtype(dtype),)
        else:
            raise UnsupportedValueError(
                f"{item.key}: torch.save cannot write tensors of dtype {dtype}", item.key
            )
        args = (storage, 0, tuple(shape), contiguous_strides(shape), False)
        state[item.name] = _Rebuild(rebuild, (*args, collections.OrderedDict(), *extra))
    buf = io.BytesIO()
    _TorchPickler(buf, protocol=2).dump(state)
    return buf.getvalue()


# -- torch.save: the zip archive --------------------------------------------------

_U32 = 0xFFFFFFFF
_ALIGNMENT = 64  # torch.utils.serialization.config.save.storage_alignment
_ARCHIVE = "archive/"  # the folder torch.save uses when writing to a stream
_FLAG_UTF8 = 0x800
_FLAG_DESCRIPTOR = 0x8


@dataclass
class ZipRecord:
    """One stored (uncompressed) member laid out as miniz lays it out for PyTorch."""

    name: bytes
    size: int
    header_offset: int
    crc: int = 0

    @property
    def zip64(self) -> bool:
        return self.size >= _U32 or self.header_offset >= _U32

    def _zip64_fields(self) -> list[int]:
        big = [self.size, self.size] if self.size >= _U32 else []
        return big + ([self.header_offset] if self.header_offset >= _U32 else [])

    def _zip64_extra(self) -> bytes:
        fields = self._zip64_fields()
        if not fields:
            return b""
        return struct.pack(f"<HH{len(fields)}Q", 1, 8 * len(fields), *fields)

    @property
    def flags(self) -> int:
        return _FLAG_UTF8 | (_FLAG_DESCRIPTOR if self.size else 0)

    def local_header(self) -> bytes:
        # Data start padded to the alignment with an "FB" extra field after the zip64
        # one, exactly as caffe2/serialize getPadding computes it.
        extra = self._zip64_extra()
        start = self.header_offset + 30 + len(self.name) + len(extra) + 4
        pad = -start % _ALIGNMENT
        extra += b"FB" + struct.pack("<H", pad) + b"Z" * pad
        size32 = _U32 if self.size >= _U32 else 0
        head = struct.pack("<IHHHHHIIIHH", 0x04034B50, 0, self.flags, 0, 0, 0, 0, size32,
                           size32, len(self.name), len(extra))  # fmt: skip
        return head + self.name + extra

    @property
    def data_offset(self) -> int:
        return self.header_offset + len(self.local_header())

    def descriptor(self) -> bytes:
        if not self.size:
            return b""
        if self.zip64:
            return struct.pack("<IIQQ", 0x08074B50, self.crc, self.size, self.size)
        return struct.pack("<IIII", 0x08074B50, self.crc, self.size, self.size)

    @property
    def end(self) -> int:
        return self.data_offset + self.size + len(self.descriptor())

    def central_header(self) -> bytes:
        extra = self._zip64_extra()
        size32 = min(self.size, _U32)
        head = struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 0, 45 if extra else 0, self.flags,
                           0, 0, 0, self.crc, size32, size32, len(self.name), len(extra), 0, 0,
                           0, 0, min(self.header_offset, _U32))  # fmt: skip
        return head + self.name + extra


class ZipPlan:
    """Offsets of every member of a torch.save archive, known before any data is read."""

    def __init__(self) -> None:
        self.records: list[ZipRecord] = []
        self.cursor = 0

    def add(self, name: str, size: int) -> ZipRecord:
        record = ZipRecord((_ARCHIVE + name).encode("utf-8"), size, self.cursor)
        self.records.append(record)
        self.cursor = record.end
        return record

    def directory(self) -> bytes:
        """Central directory, zip64 end record and locator, end record (miniz writes all)."""
        cd = b"".join(r.central_header() for r in self.records)
        n, at = len(self.records), self.cursor
        eocd64 = struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 0x031E, 45, 0, 0, n, n, len(cd), at)
        locator = struct.pack("<IIQI", 0x07064B50, 0, at + len(cd), 1)
        eocd = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, min(n, 0xFFFF), min(n, 0xFFFF),
                           min(len(cd), _U32), min(at, _U32), 0)  # fmt: skip
        return cd + eocd64 + locator + eocd


def plan_torch_archive(pkl: bytes, storage_sizes: list[int]) -> tuple[ZipPlan, list[bytes]]:
    """The archive's layout and the bytes of its small records (in plan order; the
    storages' entries are empty placeholders)."""
    plan = ZipPlan()
    small: list[bytes] = []
    alignment = str(_ALIGNMENT).encode()
    head = [("data.pkl", pkl), (".format_version", b"1"), (".storage_alignment", alignment)]
    # casnap's bytes are little-endian whatever the host, so "byteorder" is always little.
    for name, body in [*head, ("byteorder", b"little")]:
        plan.add(name, len(body))
        small.append(body)
    for i, size in enumerate(storage_sizes):
        plan.add(f"data/{i}", size)
        small.append(b"")
    for name, body in [("version", b"3\n"), (".data/serialization_id", b"0" * 40)]:
        plan.add(name, len(body))
        small.append(body)
    return plan, small


def _serialization_id(plan: ZipPlan) -> bytes:
    """40 digits as PyTorch writes them: 20 of a hash of the record names (PyTorch's uses
    std::hash, so this half differs), then 20 of the records' CRCs combined with
    c10::hash_combine (this half equals torch.save's for the same tensors)."""
    names = b"\0".join(r.name for r in plan.records[:-1])
    first = int.from_bytes(hashlib.blake2b(names, digest_size=8).digest(), "little")
    combined = 0
    for r in plan.records[:-1]:
        if r.size:  # records with a data descriptor
            combined ^= (r.crc + 0x9E3779B9 + (combined << 6) + (combined >> 2)) % (1 << 64)
    return f"{first:020d}{combined:020d}".encode()


def write_torch_archive(
    fd: int, plan: ZipPlan, small: list[bytes], storage_crcs: dict[int, int]
) -> None:
    """Write everything but the storages' bytes: headers, small records, descriptors and
    the directory. ``storage_crcs`` maps a record's index to the CRC-32 of its bytes."""
    bodies = list(small)
    for i, (record, body) in enumerate(zip(plan.records, bodies)):
        record.crc = storage_crcs[i] if i in storage_crcs else zlib.crc32(body)
    bodies[-1] = _serialization_id(plan)
    plan.records[-1].crc = zlib.crc32(bodies[-1])
    for i, (record, body) in enumerate(zip(plan.records, bodies)):
        if i in storage_crcs:  # the data between header and descriptor is streamed
            _pwrite_all(fd, record.local_header(), record.header_offset)
            _pwrite_all(fd, record.descriptor(), record.data_offset + record.size)
        else:
            _pwrite_all(
                fd, record.local_header() + body + record.descriptor(), record.header_offset
            )
    _pwrite_all(fd, plan.directory(), plan.cursor)


def export_torch(
    snapshot: Snapshot,
    out_path: PathLike,
    *,
    key: str | None = None,
    memory_budget_bytes: int | None = None,
    progress: Progress | None = None,
) -> ExportResult:
    """Write the tensors of ``snapshot`` (or of one ``key``) as a ``torch.save`` file of a
    dict name -> tensor, readable by ``torch.load(path, weights_only=True)`` (and with
    ``mmap=True``). Names, ``progress`` and skipped entries as for
    :func:`export_safetensors`.

    Example::

        export_torch(Snapshot("/ckpt/run1/step_100"), "model.pt", key="model")
        model.load_state_dict(torch.load("model.pt", weights_only=True))
    """
    items, skipped, _ = _plan(snapshot, key)
    plan, small = plan_torch_archive(torch_pickle(items), [it.entry.nbytes for it in items])
    first = 4  # records before data/0
    offsets = [plan.records[first + j].data_offset for j in range(len(items))]
    total = plan.cursor + len(plan.directory())
    with _atomic_output(out_path) as fd:
        os.ftruncate(fd, total)
        fetched, peak, chunk_crcs = _stream(
            snapshot, items, offsets, fd, memory_budget_bytes, progress, with_crc=True
        )
        crcs: dict[int, int] = {}
        pos = 0
        for j, item in enumerate(items):
            n = len(item.entry.chunks)
            crcs[first + j] = _fold_crcs(chunk_crcs[pos : pos + n], item.entry)
            pos += n
        write_torch_archive(fd, plan, small, crcs)
    return ExportResult(
        os.fspath(out_path), "torch", tuple(it.name for it in items),
        sum(it.entry.nbytes for it in items), total, fetched, peak, tuple(skipped),
    )  # fmt: skip


# -- CRC-32 of a tensor from the CRCs of its chunks ------------------------------
# zlib's crc32_combine (not exposed by Python's zlib), after zlib 1.2.12's crc32.c:
# polynomials over GF(2) in reflected bit order, x^(2^k) mod p tabulated.

_CRC_POLY = 0xEDB88320


def _multmodp(a: int, b: int) -> int:
    """a(x) * b(x) modulo the CRC-32 polynomial."""
    product, m = 0, 1 << 31
    while m and a & (2 * m - 1):  # bits of a at or below m remain
        if a & m:
            product ^= b
        m >>= 1
        b = (b >> 1) ^ _CRC_POLY if b & 1 else b >> 1
    return product


def _x2n_table() -> tuple[int, ...]:
    p, table = 1 << 30, []  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return tuple(table)


_X2N = _x2n_table()


def _x8nmodp(n: int) -> int:
    """x^(8n) modulo the polynomial: the operator that shifts a CRC past n zero bytes."""
    p, k = 1 << 31, 3
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)``."""
    return _multmodp(_x8nmodp(len2), crc1) ^ crc2


def _fold_crcs(chunk_crcs: list[int], entry: TensorEntry) -> int:
    crc, ops = 0, {}
    for c, chunk_crc in enumerate(chunk_crcs):
        size = entry.chunks[c].size
        if size not in ops:
            ops[size] = _x8nmodp(size)
        crc = _multmodp(ops[size], crc) ^ chunk_crc
    return crc
