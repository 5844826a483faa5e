"""Bring an existing checkpoint into a casnap repository as one snapshot (docs/import.md).

Sources (detected from the path, :mod:`casnap.integrations.import_sources`):
a DCP checkpoint directory, a safetensors file, a Hugging Face model directory
and a ``torch.save`` file (read with ``weights_only=True``). The import is a
take like any other, and its bytes stream within the take's budget. Example::

    snap = import_checkpoint("llama/", "/ckpt/base/llama")  # HF directory
    Snapshot("/ckpt/base/llama").restore({"model": model})
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from casnap.api.snapshot import Snapshot
from casnap.chunks.budget import ByteBudget, check_budget
from casnap.errors import (
    ConfigError,
    DamagedSourceError,
    PickleNotAllowedError,
    SourceFormatError,
    SourceNotFoundError,
    UnsupportedValueError,
    as_path,
    expect_type,
)
from casnap.format.entries import ContainerEntry
from casnap.format.names import escape_key
from casnap.format.tree import child_key
from casnap.integrations.import_dcp import open_dcp
from casnap.integrations.import_sources import (
    Source,
    SourceTensor,
    detect,
    open_hf,
    open_safetensors,
    open_torch,
)
from casnap.take.job import TakeJob
from casnap.take.scheduler import WriteRequest, lazy_request, tensor_request
from casnap.take.target import TakeOptions, resolve_target
from casnap.torch_io.flatten import MAX_DEPTH, Node, TensorLeaf, flatten
from casnap.torch_io.staging import StagingPool
from casnap.torch_io.tensors import dtype_name

__all__ = [
    "DamagedSourceError",
    "SourceFormatError",
    "SourceNotFoundError",
    "import_checkpoint",
    "open_source",
]

Progress = Callable[[int, int], None]
FORMATS = ("dcp", "hf", "safetensors", "torch")
# The key of the snapshot's metadata that records where an import came from.
SOURCE_KEY = "import"


def open_source(source: str, stateful: str = "model", format: str | None = None) -> Source:
    """Open and validate ``source`` (nothing is read beyond headers and small values yet).

    ``format`` forces one of :data:`FORMATS` instead of detecting it. The
    caller closes the result (:meth:`Source.close`).
    """
    kind = detect(source)
    if format is not None:
        if format not in FORMATS:
            raise ConfigError(
                f"format must be one of {', '.join(FORMATS)}, got {format!r}", "format"
            )
        if format != kind.removesuffix("-legacy"):
            raise SourceFormatError(f"{source}: is not {format} (it looks like {kind})", "source")
    if kind == "dcp":
        return open_dcp(source, stateful)
    if kind == "hf":
        return open_hf(source, stateful)
    if kind == "safetensors":
        return open_safetensors(source, stateful)
    return open_torch(source, stateful, legacy=kind == "torch-legacy")


def import_checkpoint(
    source: str,
    snapshot_path: str,
    *,
    storage_options: dict[str, Any] | None = None,
    settings: dict[str, Any] | None = None,
    repository: Any = None,
    memory_budget_bytes: int | None = None,
    metadata: dict[str, Any] | None = None,
    progress: Progress | None = None,
    stateful: str = "model",
    format: str | None = None,
) -> Snapshot:
    """Import the checkpoint at ``source`` as the snapshot at ``snapshot_path``.

    Tensor names become keys of one stateful, ``stateful`` (``"model"``), or keep
    the nesting of a DCP save or a ``torch.save`` dict of dicts; the metadata is
    ``metadata`` plus ``"import"`` (docs/import.md, "Sources and their keys").
    ``format`` forces one of :data:`FORMATS` instead of detecting it.
    ``storage_options``, ``settings``, ``repository``, ``memory_budget_bytes``
    and ``progress`` as for
    :meth:`casnap.Snapshot.take`.

    Raises :class:`SourceNotFoundError` (a ``FileNotFoundError``) for a missing
    path, :class:`SourceFormatError` (a ``ValueError``) for a path of no known
    format or a pickle ``weights_only`` refuses, :class:`DamagedSourceError`
    (a :class:`casnap.IntegrityError`) for a truncated or malformed file; all
    before a repository is created or written.

    Example::

        snap = import_checkpoint("model.safetensors", "/ckpt/base/v1", metadata={"step": 0})
        snap.metadata["import"]["format"]  # "safetensors"
    """
    source = as_path(source, "source")
    snapshot_path = as_path(snapshot_path, "snapshot_path")
    expect_type(stateful, str, "stateful", "a stateful name such as 'model'")
    if not stateful or "/" in stateful:
        raise ConfigError(
            f"stateful must be a non-empty name without '/', got {stateful!r}", "stateful"
        )
    if progress is not None and not callable(progress):
        expect_type(progress, type(None), "progress", "a callable progress(done, total) or None")
    if metadata is not None:
        expect_type(metadata, Mapping, "metadata", "a dict or None")
        if SOURCE_KEY in metadata:
            raise ConfigError(f"metadata key {SOURCE_KEY!r} is the import's own record", "metadata")
    budget = ByteBudget(check_budget(memory_budget_bytes))
    options = TakeOptions.of(storage_options, settings, repository)
    opened = open_source(source, stateful, format)
    try:
        nodes, requests = plan_nodes(opened.state)
        record = {"format": opened.format, "path": opened.path, **opened.info}
        meta = {**(metadata or {}), SOURCE_KEY: record}
        # Only now, with the source validated, is the repository found or created.
        target = resolve_target(snapshot_path, options, meta, None, None)
        # A take without a session: fresh and auto-parent as any (docs/repository.md).
        job = TakeJob.of(target, nodes, requests, budget, None, StagingPool(idle_limit=0))
        job.live_consumed.set()  # nothing is staged: the take blocks until committed
        job.progress = progress
        result = job.run()
    finally:
        opened.close()
    return Snapshot._from_result(snapshot_path, None, storage_options, result, None)


def plan_nodes(state: Mapping[str, Any]) -> tuple[dict[str, Node], list[WriteRequest]]:
    """The take's flat nodes and write requests for an opened source's state.

    A :class:`SourceTensor` becomes a tensor node (a meta tensor: dtype and
    shape, no data) and a lazy request; everything else goes through the
    take's own :func:`~casnap.torch_io.flatten.flatten` (pickled objects refused).
    """
    nodes: dict[str, Node] = {}
    lazy: dict[str, WriteRequest] = {}
    for name, value in state.items():
        if not isinstance(name, str) or not name:
            raise UnsupportedValueError(f"stateful names must be non-empty strings, got {name!r}")
        _walk(value, f"0/{escape_key(name)}", nodes, lazy, 0)
    requests = []
    for key, node in nodes.items():
        if key in lazy:
            requests.append(lazy[key])
        elif isinstance(node, TensorLeaf):  # a tensor already in memory (a legacy file, DCP bytes)
            requests.append(tensor_request(key, node.tensor))
    return nodes, requests


def _walk(
    value: Any, key: str, nodes: dict[str, Node], lazy: dict[str, WriteRequest], depth: int
) -> None:
    if depth > MAX_DEPTH:
        raise UnsupportedValueError(f"{key}: nested deeper than {MAX_DEPTH} levels", key)
    if isinstance(value, SourceTensor):
        dtype_name(value.dtype, key)  # refuses a dtype casnap cannot store, before writing
        nodes[key] = TensorLeaf(torch.empty(value.shape, dtype=value.dtype, device="meta"))
        elem = value.dtype.itemsize if value.dtype.is_floating_point else 0
        lazy[key] = lazy_request(key, value.nbytes, value.load, elem)
        return
    if isinstance(value, (dict, list, tuple)) and not hasattr(value, "_fields") and _lazy(value):
        items = list(value.items()) if isinstance(value, dict) else list(enumerate(value))
        ctype = (
            "OrderedDict"
            if type(value).__name__ == "OrderedDict"
            else "dict"
            if isinstance(value, dict)
            else type(value).__name__
        )
        keys = [k for k, _ in items]
        if any(isinstance(k, bool) or not isinstance(k, (int, str)) for k in keys):
            raise UnsupportedValueError(f"{key}: container keys must be str or int", key)
        nodes[key] = ContainerEntry(type=ctype, keys=keys)  # type: ignore[arg-type]
        for k, member in items:
            _walk(member, child_key(key, k), nodes, lazy, depth + 1)
        return
    try:
        flatten(value, key, False, nodes, depth)  # primitives, loaded tensors, plain containers
    except PickleNotAllowedError as exc:  # weights_only let it through (a Counter, a set)
        what = f"{type(value).__module__}.{type(value).__qualname__}"
        raise SourceFormatError(
            f"{exc.key or key}: the source holds a {what}, which casnap stores only by "
            "pickling it, and import does not pickle",
            "source",
        ) from exc


def _lazy(value: Any, depth: int = 0) -> bool:
    """Whether a container holds a :class:`SourceTensor` somewhere below."""
    if isinstance(value, SourceTensor):
        return True
    if depth > MAX_DEPTH:
        return False
    members = value.values() if isinstance(value, dict) else value
    if isinstance(value, (dict, list, tuple)):
        return any(_lazy(v, depth + 1) for v in members)
    return False
