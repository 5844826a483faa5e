"""Export a snapshot, or one key of it, to a safetensors file or a ``torch.save`` file.

Both exports stream: the file layout is planned from the manifest, then each
chunk is fetched verified under a byte budget and written at its offset; the
file appears at ``out_path`` only once complete (docs/export.md). The code
lives in :mod:`~casnap.export.select`, :mod:`~casnap.export.stream`,
:mod:`~casnap.export.safetensors_file`, :mod:`~casnap.export.torch_file` and
:mod:`~casnap.export.torch_zip`. Example::

    export_safetensors(Snapshot("/ckpt/run1/step_100"), "model.safetensors", key="model")
"""

from __future__ import annotations

from casnap.export.safetensors_file import SAFETENSORS_DTYPES, export_safetensors
from casnap.export.select import ExportItem, ExportSource, resolve_key, select
from casnap.export.stream import ExportResult, PathLike, Progress
from casnap.export.torch_file import (
    TORCH_LEGACY_STORAGES,
    TORCH_UNTYPED_STORAGE_DTYPES,
    export_torch,
    torch_pickle,
)
from casnap.export.torch_zip import crc32_combine, plan_torch_archive, write_torch_archive

__all__ = [
    "SAFETENSORS_DTYPES",
    "TORCH_LEGACY_STORAGES",
    "TORCH_UNTYPED_STORAGE_DTYPES",
    "ExportItem",
    "ExportResult",
    "ExportSource",
    "PathLike",
    "Progress",
    "crc32_combine",
    "export_safetensors",
    "export_torch",
    "plan_torch_archive",
    "resolve_key",
    "select",
    "torch_pickle",
    "write_torch_archive",
]
