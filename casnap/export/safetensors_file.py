"""Export to a safetensors file: the JSON header, then every tensor's bytes.

Tensors are laid out largest element size first, so each starts aligned to
its element size; the header is padded so the data starts 8-byte aligned, as
safetensors writes it. See docs/export.md.
"""

from __future__ import annotations

import json
import struct
from typing import Any

from casnap.errors import UnsupportedValueError
from casnap.export.select import ExportItem, ExportSource, plan_export
from casnap.export.stream import ExportResult, PathLike, Progress, atomic_output, pwrite_all, stream
from casnap.format.entries import DTYPE_ITEMSIZE

# casnap dtype name -> safetensors dtype code (what safetensors 0.8 reads back).
SAFETENSORS_DTYPES: dict[str, str] = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "float8_e8m0fnu": "F8_E8M0",
    "float4_e2m1fn_x2": "F4",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint64": "U64",
    "uint32": "U32",
    "uint16": "U16",
    "uint8": "U8",
    "bool": "BOOL",
    "complex64": "C64",
}


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
    snapshot: ExportSource,
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
    items, skipped, info = plan_export(snapshot, key)
    # Largest elements first, so every tensor starts aligned to its element size.
    items.sort(key=lambda it: -DTYPE_ITEMSIZE[it.entry.dtype])
    header = _safetensors_header(items, {"format": "pt", **info})
    offsets, pos = [], len(header)
    for item in items:
        offsets.append(pos)
        pos += item.entry.nbytes
    with atomic_output(out_path, pos) as fd:
        pwrite_all(fd, header, 0)
        fetched, peak, _ = stream(snapshot, items, offsets, fd, memory_budget_bytes, progress)
    return ExportResult.of(out_path, "safetensors", items, (fetched, peak), pos, skipped)
