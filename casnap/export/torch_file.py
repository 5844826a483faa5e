"""Export to a ``torch.save`` file: ``data.pkl`` pickled as torch.save pickles it.

The pickle is a dict name -> tensor whose storages are persistent ids naming
the archive's ``data/<i>`` records; :mod:`casnap.export.torch_zip` lays out
the zip archive around it, and each tensor's CRC-32 is folded from its
chunks' CRCs as they stream in. See docs/export.md.
"""

from __future__ import annotations

import collections
import io
import pickle
from collections.abc import Callable
from typing import Any

import torch

from casnap.errors import UnsupportedValueError
from casnap.export.select import ExportItem, ExportSource, plan_export
from casnap.export.stream import ExportResult, PathLike, Progress, atomic_output, stream
from casnap.export.torch_zip import fold_crcs, plan_torch_archive, write_torch_archive
from casnap.format.entries import DTYPE_ITEMSIZE
from casnap.torch_io.tensors import torch_dtype

# torch.save pickles these as legacy typed storages (torch.storage._dtype_to_storage_type_map)
# rebuilt by _rebuild_tensor_v2 ...
TORCH_LEGACY_STORAGES: dict[str, str] = {
    "float64": "DoubleStorage",
    "float32": "FloatStorage",
    "float16": "HalfStorage",
    "bfloat16": "BFloat16Storage",
    "int64": "LongStorage",
    "int32": "IntStorage",
    "int16": "ShortStorage",
    "int8": "CharStorage",
    "uint8": "ByteStorage",
    "bool": "BoolStorage",
    "complex128": "ComplexDoubleStorage",
    "complex64": "ComplexFloatStorage",
}
# ... and these as an UntypedStorage plus the dtype, rebuilt by _rebuild_tensor_v3
# (torch.storage._new_dtypes). Sub-byte int1..int7 / uint1..uint7 are in neither:
# torch.save itself cannot write them.
TORCH_UNTYPED_STORAGE_DTYPES = frozenset(
    {
        "float8_e5m2",
        "float8_e4m3fn",
        "float8_e5m2fnuz",
        "float8_e4m3fnuz",
        "float8_e8m0fnu",
        "float4_e2m1fn_x2",
        "bits8",
        "bits16",
        "bits1x8",
        "bits2x4",
        "bits4x2",
        "complex32",
        "uint16",
        "uint32",
        "uint64",
    }
)


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


def export_torch(
    snapshot: ExportSource,
    out_path: PathLike,
    *,
    key: str | None = None,
    memory_budget_bytes: int | None = None,
    progress: Progress | None = None,
) -> ExportResult:
    """Write the tensors of ``snapshot`` (or of one ``key``) as a ``torch.save`` file of a
    dict name -> tensor, readable by ``torch.load(path, weights_only=True)`` (and with
    ``mmap=True``). Names, ``progress`` and skipped entries as for
    :func:`casnap.export.export_safetensors`.

    Example::

        export_torch(Snapshot("/ckpt/run1/step_100"), "model.pt", key="model")
        model.load_state_dict(torch.load("model.pt", weights_only=True))
    """
    items, skipped, _ = plan_export(snapshot, key)
    plan, small = plan_torch_archive(torch_pickle(items), [it.entry.nbytes for it in items])
    first = 4  # records before data/0
    offsets = [plan.records[first + j].data_offset for j in range(len(items))]
    total = plan.cursor + len(plan.directory())
    with atomic_output(out_path, total) as fd:
        fetched, peak, chunk_crcs = stream(
            snapshot, items, offsets, fd, memory_budget_bytes, progress, with_crc=True
        )
        crcs: dict[int, int] = {}
        pos = 0
        for j, item in enumerate(items):
            n = len(item.entry.chunks)
            crcs[first + j] = fold_crcs(chunk_crcs[pos : pos + n], item.entry)
            pos += n
        write_torch_archive(fd, plan, small, crcs)
    return ExportResult.of(out_path, "torch", items, (fetched, peak), total, skipped)
