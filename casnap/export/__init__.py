"""Export a snapshot, or one key of it, to a safetensors file or a ``torch.save`` file.

Both exports stream. The whole file layout (names, dtypes, shapes, offsets) is
planned from the manifest before anything is read; then every chunk is fetched
through the verified reader (:func:`casnap.chunks.read.read_chunks`) under a
:class:`~casnap.chunks.budget.ByteBudget` and written at its offset with ``pwrite``, in
whatever order the chunks arrive. No tensor is ever held whole in memory.

The output is written to a temporary file next to ``out_path``, fsynced and
renamed into place only once complete: a failure (a corrupt chunk raises
:class:`casnap.IntegrityError`) leaves no partial file at ``out_path``.

This module is the public entry point; the code lives in
:mod:`casnap.export.select` (what is exported, under which names),
:mod:`casnap.export.stream` (streaming into the file under the budget),
:mod:`casnap.export.safetensors_file` (the safetensors writer),
:mod:`casnap.export.torch_file` (the ``torch.save`` pickle and writer) and
:mod:`casnap.export.torch_zip` (its zip archive, laid out as PyTorch's writer
does). See docs/export.md.

Example::

    from casnap.export import export_safetensors, export_torch

    export_safetensors(Snapshot("/ckpt/run1/step_100"), "model.safetensors", key="model")
"""

from __future__ import annotations

from casnap.export.safetensors_file import SAFETENSORS_DTYPES, export_safetensors
from casnap.export.select import ExportItem, resolve_key, select
from casnap.export.stream import ExportResult, PathLike, Progress
from casnap.export.torch_file import (
    TORCH_LEGACY_STORAGES,
    TORCH_UNTYPED_STORAGE_DTYPES,
    contiguous_strides,
    export_torch,
    torch_pickle,
)
from casnap.export.torch_zip import (
    ZipPlan,
    ZipRecord,
    crc32_combine,
    plan_torch_archive,
    write_torch_archive,
)

__all__ = [
    "SAFETENSORS_DTYPES",
    "TORCH_LEGACY_STORAGES",
    "TORCH_UNTYPED_STORAGE_DTYPES",
    "ExportItem",
    "ExportResult",
    "PathLike",
    "Progress",
    "ZipPlan",
    "ZipRecord",
    "contiguous_strides",
    "crc32_combine",
    "export_safetensors",
    "export_torch",
    "plan_torch_archive",
    "resolve_key",
    "select",
    "torch_pickle",
    "write_torch_archive",
]
