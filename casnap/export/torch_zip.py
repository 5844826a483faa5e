"""The zip archive of a ``torch.save`` file, laid out before any tensor is read.

It is the archive PyTorch's own writer produces (``torch/serialization.py``
``_save`` with ``caffe2/serialize/inline_container.cc`` and miniz); its records
are listed in docs/export.md. A streamed record's CRC-32 is combined from its
chunks' CRCs (:func:`crc32_combine`).
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from dataclasses import dataclass

from casnap.export.stream import pwrite_all
from casnap.format.entries import TensorEntry

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
        head = struct.pack(
            "<IHHHHHIIIHH",
            0x04034B50,
            0,
            self.flags,
            0,
            0,
            0,
            0,
            size32,
            size32,
            len(self.name),
            len(extra),
        )
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
        head = struct.pack(
            "<IHHHHHHIIIHHHHHII",
            0x02014B50,
            0,
            45 if extra else 0,
            self.flags,
            0,
            0,
            0,
            self.crc,
            size32,
            size32,
            len(self.name),
            len(extra),
            0,
            0,
            0,
            0,
            min(self.header_offset, _U32),
        )
        return head + self.name + extra


class ZipLayout:
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
        eocd = struct.pack(
            "<IHHHHIIH",
            0x06054B50,
            0,
            0,
            min(n, 0xFFFF),
            min(n, 0xFFFF),
            min(len(cd), _U32),
            min(at, _U32),
            0,
        )
        return cd + eocd64 + locator + eocd


def plan_torch_archive(pkl: bytes, storage_sizes: list[int]) -> tuple[ZipLayout, list[bytes]]:
    """The archive's layout and the bytes of its small records (in plan order; the
    storages' entries are empty placeholders)."""
    plan = ZipLayout()
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


def _serialization_id(plan: ZipLayout) -> bytes:
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
    fd: int, plan: ZipLayout, small: list[bytes], storage_crcs: dict[int, int]
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
            pwrite_all(fd, record.local_header(), record.header_offset)
            pwrite_all(fd, record.descriptor(), record.data_offset + record.size)
        else:
            pwrite_all(fd, record.local_header() + body + record.descriptor(), record.header_offset)
    pwrite_all(fd, plan.directory(), plan.cursor)


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


def fold_crcs(chunk_crcs: list[int], entry: TensorEntry) -> int:
    """CRC-32 of the bytes of ``entry`` from the CRC-32s of its chunks, in order."""
    crc, ops = 0, {}
    for c, chunk_crc in enumerate(chunk_crcs):
        size = entry.chunks[c].size
        if size not in ops:
            ops[size] = _x8nmodp(size)
        crc = _multmodp(ops[size], crc) ^ chunk_crc
    return crc
