"""The checkpoints ``casnap import`` reads, as nested state whose tensors load lazily.

Each reader validates its source completely before anything is read for the
take (headers, offsets, the index, DCP's metadata, the pickle of a
``torch.save`` file), so bad input fails before a repository is touched.
Tensors become :class:`SourceTensor` values: dtype, shape and a ``load()``
that produces the bytes only when the take's scheduler has budget for them
(:func:`casnap.take.scheduler.lazy_request`); docs/import.md, "Memory", says
how each format is read and its memory given back (DCP:
:mod:`casnap.integrations.import_dcp`).
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import math
import mmap
import os
import pickle
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from casnap.errors import DamagedSourceError, SourceFormatError, SourceNotFoundError
from casnap.torch_io.tensors import host_view

log = logging.getLogger(__name__)

Load = Callable[[], tuple[memoryview, Any]]

# safetensors' own limit on the JSON header (the format's spec).
MAX_HEADER_BYTES = 100_000_000
_PAGE = mmap.PAGESIZE


@dataclass(frozen=True)
class SourceTensor:
    """A tensor of the source: its dtype and shape now, its bytes when ``load()`` runs."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    load: Load

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class Source:
    """A checkpoint opened for import: the state to take and what to record about it."""

    format: str  # "safetensors", "hf", "dcp", "torch"
    path: str
    state: dict[str, Any]  # stateful name -> nested containers of SourceTensor / values
    info: dict[str, Any] = field(default_factory=dict)  # JSON, recorded in the metadata
    closers: list[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        for close in reversed(self.closers):
            close()
        self.closers.clear()


# -- dropping pages once hashed ------------------------------------------------------


def _span(start: int, length: int) -> tuple[int, int]:
    """``[start, start+length)`` widened to whole pages."""
    lo = start - start % _PAGE
    hi = start + length
    hi += -hi % _PAGE
    return lo, hi - lo


class _FilePages:
    """Owner of a view into a Python mmap: drops the view's pages when released.

    The scheduler keeps the owner until the request's last chunk is hashed
    and written (:class:`casnap.take.scheduler._Release`); the pages are read
    only, so a later touch (a pack written after) re-reads them from the file.
    """

    def __init__(self, mm: mmap.mmap, start: int, length: int) -> None:
        self._mm, self._start, self._length = mm, start, length

    def __del__(self) -> None:
        if self._length and hasattr(mmap, "MADV_DONTNEED"):
            lo, n = _span(self._start, self._length)
            try:
                self._mm.madvise(mmap.MADV_DONTNEED, lo, min(n, len(self._mm) - lo))
            except (OSError, ValueError):
                pass  # closed already, or a platform without it: only memory is at stake


@functools.cache
def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def _madvise_dontneed(address: int, length: int) -> None:
    """Drop the pages of a read-only file mapping made by torch (no Python mmap to ask)."""
    if not length or not hasattr(mmap, "MADV_DONTNEED"):
        return
    try:
        _libc().madvise(*_span(address, length), mmap.MADV_DONTNEED)
    except (OSError, AttributeError):
        pass


def release_free_memory() -> None:
    """Ask glibc to return freed heap memory to the system (``malloc_trim``; elsewhere a no-op)."""
    try:
        _libc().malloc_trim(0)
    except (OSError, AttributeError):
        pass


class _TorchPages:
    """Owner of a tensor of torch's (private, never written) mapping of a ``torch.save``
    file: drops its storage's pages when released; keeps the copy, if one was made."""

    def __init__(self, tensor: torch.Tensor, held: Any) -> None:
        storage = tensor.untyped_storage()
        self._address, self._length = storage.data_ptr(), storage.nbytes()
        self._held = held

    def __del__(self) -> None:
        self._held = None
        _madvise_dontneed(self._address, self._length)


# -- finding out what a path is ----------------------------------------------------------


def detect(path: str) -> str:
    """``"dcp"``, ``"hf"``, ``"safetensors"``, ``"torch"`` or ``"torch-legacy"`` for ``path``."""
    p = Path(path)
    if not p.exists():
        raise SourceNotFoundError(f"{path}: no such file or directory", path)
    if p.is_dir():
        if (p / ".metadata").is_file():
            return "dcp"
        if any(p.glob("*.safetensors")) or any(p.glob("*.safetensors.index.json")):
            return "hf"
        raise SourceFormatError(
            f"{path}: a directory with neither a DCP .metadata file nor *.safetensors files",
            "source",
        )
    if p.name.endswith(".safetensors.index.json"):
        return "hf"
    try:
        with open(p, "rb") as fh:
            head = fh.read(9)
    except OSError as exc:
        raise SourceFormatError(f"{path}: cannot be read: {exc.strerror or exc}", "source") from exc
    if head.startswith(b"PK\x03\x04"):
        return "torch"
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return "torch-legacy"  # a pickle stream: torch.save's format before the zip one
    if len(head) == 9 and head[8:9] == b"{":
        return "safetensors"
    raise SourceFormatError(
        f"{path}: not a safetensors file, a torch.save file, a Hugging Face model directory "
        "or a DCP checkpoint directory",
        "source",
    )


# -- safetensors -----------------------------------------------------------------

_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def damaged(path: str, what: str) -> DamagedSourceError:
    return DamagedSourceError(f"{path}: {what}", path)


def safetensors_header(path: str) -> tuple[dict[str, Any], int, int]:
    """The validated header of a safetensors file: (entries by name, data start, file size).

    Every tensor's dtype, shape and offsets are checked against each other and
    the file's size, so a truncated file is refused before anything is read.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        prefix = fh.read(8)
        if len(prefix) < 8:
            raise damaged(path, f"truncated safetensors file ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", prefix)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise damaged(
                path, f"truncated or not safetensors: header of {n} bytes declared, file has {size}"
            )
        raw = fh.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise damaged(path, f"safetensors header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise damaged(path, "safetensors header is not a JSON object")
    start, entries = 8 + n, {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        entries[name] = _checked_entry(path, name, e, size - start)
    return entries, start, size


_Entry = tuple[torch.dtype, tuple[int, ...], int, int]


def _checked_entry(path: str, name: str, e: Any, data_len: int) -> _Entry:
    if not isinstance(e, dict) or not {"dtype", "shape", "data_offsets"} <= e.keys():
        raise damaged(path, f"tensor {name!r}: malformed header entry")
    dtype = _ST_DTYPES.get(e["dtype"])
    if dtype is None:
        raise SourceFormatError(
            f"{path}: tensor {name!r} has dtype {e['dtype']!r}, which casnap does not store",
            "source",
        )
    shape, offsets = e["shape"], e["data_offsets"]
    ints = all(
        isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in [*shape, *offsets]
    )
    if not (isinstance(shape, list) and isinstance(offsets, list) and len(offsets) == 2 and ints):
        raise damaged(path, f"tensor {name!r}: malformed shape or data_offsets")
    begin, end = offsets
    nbytes = math.prod(shape) * dtype.itemsize
    if end - begin != nbytes:
        raise damaged(
            path,
            f"tensor {name!r}: offsets span {end - begin} bytes, its dtype and shape need {nbytes}",
        )
    if end > data_len:
        raise damaged(
            path,
            f"truncated: tensor {name!r} ends at byte {end} of the data, the file holds {data_len}",
        )
    return dtype, tuple(shape), begin, end


def _mapped(path: str, size: int, source: Source) -> mmap.mmap | None:
    if size == 0:
        return None
    with open(path, "rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    source.closers.append(mm.close)
    return mm


def _view_loader(mm: mmap.mmap | None, start: int, length: int) -> Load:
    def load() -> tuple[memoryview, Any]:
        if mm is None or length == 0:
            return memoryview(b""), None
        return memoryview(mm)[start : start + length], _FilePages(mm, start, length)

    return load


def safetensors_tensors(path: str, source: Source) -> dict[str, SourceTensor]:
    """The tensors of one safetensors file, each a zero-copy view of the mapped file."""
    entries, start, size = safetensors_header(path)
    mm = _mapped(path, size, source)
    return {
        name: SourceTensor(dtype, shape, _view_loader(mm, start + begin, end - begin))
        for name, (dtype, shape, begin, end) in entries.items()
    }


def safetensors_metadata(path: str) -> dict[str, str]:
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        meta = json.loads(fh.read(n)).get("__metadata__") or {}
    return {str(k): str(v) for k, v in meta.items()} if isinstance(meta, dict) else {}


def open_safetensors(path: str, stateful: str) -> Source:
    source = Source("safetensors", os.path.abspath(path), {})
    try:
        tensors = safetensors_tensors(path, source)
        source.state = {stateful: tensors}
        if meta := safetensors_metadata(path):
            source.info["safetensors_metadata"] = meta
    except BaseException:
        source.close()
        raise
    return source


# -- Hugging Face model directories ------------------------------------------------------

_INDEX = "model.safetensors.index.json"


def _shard_files(root: Path, index: Path | None) -> tuple[list[Path], dict[str, str] | None]:
    if index is None:
        files = sorted(root.glob("*.safetensors"))
        return files, None
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
        weight_map = data["weight_map"]
        assert isinstance(weight_map, dict)
    except (OSError, ValueError, KeyError, AssertionError, TypeError) as exc:
        raise damaged(str(index), f"not a safetensors index (no weight_map): {exc}") from exc
    files = []
    for name, file in weight_map.items():
        if not isinstance(file, str) or Path(file).name != file or file in ("", ".", ".."):
            raise damaged(
                str(index), f"weight_map names {file!r} for {name!r}, not a file beside the index"
            )
        if not (root / file).is_file():
            raise damaged(str(index), f"weight_map names {file} for {name!r}, which is missing")
        if root / file not in files:
            files.append(root / file)
    return sorted(files), {str(k): str(v) for k, v in weight_map.items()}


def open_hf(path: str, stateful: str) -> Source:
    """A directory of ``*.safetensors`` with its ``model.safetensors.index.json`` (or a
    single ``model.safetensors``), its ``config.json`` recorded in the metadata."""
    p = Path(path)
    root, index = (p.parent, p) if p.is_file() else (p, p / _INDEX)
    if not index.is_file():
        indexes = sorted(root.glob("*.safetensors.index.json"))
        index = indexes[0] if len(indexes) == 1 else None  # type: ignore[assignment]
    files, weight_map = _shard_files(root, index)
    source = Source("hf", os.path.abspath(root), {})
    try:
        tensors: dict[str, SourceTensor] = {}
        for file in files:
            for name, tensor in safetensors_tensors(str(file), source).items():
                if name in tensors:
                    raise damaged(str(root), f"tensor {name!r} is in more than one shard")
                tensors[name] = tensor
        for name, shard in (weight_map or {}).items():
            if name not in tensors:
                raise damaged(str(index), f"weight_map puts {name!r} in {shard}, which lacks it")
        source.state = {stateful: dict(sorted(tensors.items()))}
        source.info["files"] = [f.name for f in files]
        if index is not None:
            source.info["index"] = index.name
        config = root / "config.json"
        if config.is_file():
            try:
                source.info["config"] = json.loads(config.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                log.warning("%s: not recorded, not JSON: %s", config, exc)
    except BaseException:
        source.close()
        raise
    return source


# -- torch.save files -----------------------------------------------------------------

_GLOBAL = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")


def refused_pickle(path: str, exc: Exception) -> SourceFormatError:
    text = str(exc)
    found = _GLOBAL.search(text)
    what = f"a pickled {found.group(1)}" if found else "a pickled object"
    return SourceFormatError(
        f"{path}: holds {what}, which torch.load(weights_only=True) refuses; import reads "
        "only tensors, containers and primitives (save the state_dict instead)",
        "source",
    )


def torch_load(path: str, legacy: bool) -> Any:
    """``torch.load(path, weights_only=True)``, memory-mapped unless the file is legacy."""
    try:
        if legacy:
            size = os.path.getsize(path)
            log.warning(
                "%s: a legacy (non-zip) torch.save file is read whole into memory "
                "(%d bytes); the memory budget does not bound it",
                path,
                size,
            )
            return torch.load(path, map_location="cpu", weights_only=True)
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as exc:
        if "weights_only" in str(exc) or "Weights only" in str(exc):
            raise refused_pickle(path, exc) from exc
        raise damaged(path, f"torch.load failed: {first_line(exc)}") from exc
    except (RuntimeError, EOFError, ValueError, OSError) as exc:
        raise damaged(path, f"torch.load failed: {first_line(exc)}") from exc


def first_line(exc: BaseException) -> str:
    return next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)


def _mapped_tensor_loader(tensor: torch.Tensor) -> Load:
    def load() -> tuple[memoryview, Any]:
        view, owner = host_view(tensor)
        return view, _TorchPages(tensor, owner)

    return load


def _lazy_tensors(value: Any, depth: int = 0) -> Any:
    """``value`` with every plain CPU tensor replaced by a :class:`SourceTensor` view of it."""
    if depth > 64:
        return value  # flatten refuses it with its own message
    if type(value) in (torch.Tensor, torch.nn.Parameter) and value.layout == torch.strided:
        return SourceTensor(value.dtype, tuple(value.shape), _mapped_tensor_loader(value))
    if isinstance(value, dict):
        return type(value)((k, _lazy_tensors(v, depth + 1)) for k, v in value.items())
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_lazy_tensors(v, depth + 1) for v in value)
    return value


def open_torch(path: str, stateful: str, legacy: bool) -> Source:
    """A ``torch.save`` file. A dict of dicts (``{"model": ..., "optimizer": ...}``) keeps
    its top-level keys as the statefuls; anything else goes under ``stateful``."""
    obj = torch_load(path, legacy)
    if not legacy:
        obj = _lazy_tensors(obj)  # views of torch's mapping, paged in as hashed
    nested = (
        isinstance(obj, dict)
        and obj
        and all(isinstance(k, str) and k for k in obj)
        and any(isinstance(v, dict) for v in obj.values())
    )
    state = dict(obj) if nested else {stateful: obj}
    fmt = "torch-legacy" if legacy else "torch"
    return Source(fmt, os.path.abspath(path), state)
