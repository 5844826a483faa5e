"""Reading a DCP checkpoint directory (``FileSystemWriter``) for ``casnap import``.

``.metadata`` is a pickle; DCP's own reader unpickles it with ``pickle.load``.
Import reads it with an unpickler that admits only DCP's metadata classes,
torch dtypes, sizes and layouts, so a directory cannot run code. Non-tensor
values (steps, scheduler state) are DCP ``BYTE_IO`` items, ``torch.save``
streams: they are read now with ``weights_only=True`` (DCP's planner would
not). Each tensor is read later, when the take's budget has room, by a
``dcp.load`` of that one tensor (``no_dist=True``) into a fresh tensor, so
DCP's own reader handles its byte layouts, transforms and shards.
"""

from __future__ import annotations

import io
import os
import pickle
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from casnap.errors import SourceFormatError
from casnap.integrations.import_sources import (
    Load,
    Source,
    SourceTensor,
    damaged,
    first_line,
    refused_pickle,
    release_free_memory,
)
from casnap.torch_io.tensors import byte_view


def _dcp_classes() -> set[tuple[str, str]]:
    return {
        ("collections", "OrderedDict"),
        ("torch", "Size"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "Path"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("builtins", "slice"),
        ("builtins", "complex"),
        ("torch.serialization", "_get_layout"),
    }  # a layout by its name


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` is a pickle: admit DCP's own classes, torch dtypes and sizes only."""

    def find_class(self, module: str, name: str) -> Any:
        ok = module.startswith("torch.distributed.checkpoint.") or (module, name) in _dcp_classes()
        ok = ok or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        ok = ok or (module == "torch" and name in ("strided", "contiguous_format"))
        if not ok:
            raise pickle.UnpicklingError(f"DCP metadata holds a pickled {module}.{name}")
        return super().find_class(module, name)


def read_dcp_metadata(path: str) -> Any:
    """The validated ``Metadata`` of a DCP directory, without running arbitrary pickle code."""
    from torch.distributed.checkpoint.metadata import Metadata

    meta_file = Path(path) / ".metadata"
    try:
        with open(meta_file, "rb") as fh:
            metadata = _MetadataUnpickler(fh).load()
    except pickle.UnpicklingError as exc:
        raise SourceFormatError(
            f"{meta_file}: {exc}, which import does not unpickle", "source"
        ) from exc
    except (
        EOFError,
        ValueError,
        TypeError,
        AttributeError,
        ImportError,
        IndexError,
        KeyError,
    ) as exc:
        raise damaged(str(meta_file), f"not DCP metadata: {first_line(exc)}") from exc
    if not isinstance(metadata, Metadata):
        raise damaged(str(meta_file), f"not DCP metadata (a {type(metadata).__name__})")
    return metadata


@contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns on every ``no_dist`` call that it assumes one process: import means it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


def _dcp_reader(path: str, metadata: Any) -> Any:
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    class _Reader(FileSystemReader):  # the metadata read (and vetted) once, not per load
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return metadata

    return _Reader(path)


def _dcp_planner(path: str, loaded: dict[str, Any], refused: list[SourceFormatError]) -> Any:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class _Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            # DCP's own planner unpickles with weights_only=False; import never does.
            fqn = read_item.dest_index.fqn
            try:
                loaded[fqn] = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as exc:
                refused.append(refused_pickle(f"{path}: value {fqn!r}", exc))
                raise

    return _Planner(flatten_state_dict=False)


def _dcp_loader(
    path: str, metadata: Any, fqn: str, dtype: torch.dtype, shape: tuple[int, ...]
) -> Load:
    def load() -> tuple[memoryview, Any]:
        from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

        out = torch.empty(shape, dtype=dtype)
        try:
            with _quiet():
                dcp_load(
                    {fqn: out},
                    storage_reader=_dcp_reader(path, metadata),
                    planner=_dcp_planner(path, {}, []),
                    no_dist=True,
                )
        except Exception as exc:  # a .distcp file truncated or changed since the save
            raise damaged(path, f"reading tensor {fqn!r} failed: {first_line(exc)}") from exc
        return byte_view(out), _Loaded(out)

    return load


class _Loaded:
    """Owner of a tensor DCP read: once released, the allocator gives its memory back.

    glibc's malloc raises its mmap threshold after the first large free, so
    the copies DCP makes (each a tensor's size) are served from arenas that
    keep them: without the trim a 256 MiB checkpoint grew the process by
    150 MiB under a 16 MiB budget.
    """

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor: torch.Tensor | None = tensor

    def __del__(self) -> None:
        self._tensor = None
        release_free_memory()


def _nest(flat: dict[str, Any], paths: dict[str, tuple[Any, ...]]) -> dict[str, Any]:
    """DCP's flat FQNs back into the nesting the save flattened (its ``planner_data``)."""
    root: dict[Any, Any] = {}
    for fqn, value in flat.items():
        path = tuple(paths.get(fqn) or (fqn,))
        node = root
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise damaged(fqn, "DCP metadata nests a value under another value")
        node[path[-1]] = value
    nested: dict[str, Any] = _lists(root)
    return nested


def _lists(value: Any) -> Any:
    """Dicts keyed 0..n-1 (lists DCP flattened, such as param_groups) as lists again."""
    if not isinstance(value, dict):
        return value
    items = {k: _lists(v) for k, v in value.items()}
    if (
        items
        and all(isinstance(k, int) for k in items)
        and sorted(items) == list(range(len(items)))
    ):
        return [items[i] for i in range(len(items))]
    return items


def open_dcp(path: str, stateful: str) -> Source:
    """A DCP checkpoint directory (FileSystemWriter): tensors lazily, bytes items now.

    The save's nesting comes back from the metadata: ``{"model": {...}}`` saved
    as FQN ``model.fc.weight`` is key ``fc.weight`` of stateful ``model``. A
    checkpoint saved without that mapping (``flatten_state_dict=False``) keeps
    its top-level keys as statefuls.
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    metadata = read_dcp_metadata(path)
    flat: dict[str, Any] = {}
    byte_items: list[str] = []
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            dtype, shape = md.properties.dtype, tuple(int(x) for x in md.size)
            flat[fqn] = SourceTensor(dtype, shape, _dcp_loader(path, metadata, fqn, dtype, shape))
        elif isinstance(md, BytesStorageMetadata):
            byte_items.append(fqn)
    if byte_items:  # small values (steps, scheduler state): read now, before the take
        loaded: dict[str, Any] = {}
        refused: list[SourceFormatError] = []
        try:
            with _quiet():
                dcp_load(
                    {fqn: None for fqn in byte_items},
                    storage_reader=_dcp_reader(path, metadata),
                    planner=_dcp_planner(path, loaded, refused),
                    no_dist=True,
                )
        except Exception as exc:  # DCP wraps what its planner raised (CheckpointException)
            if refused:
                raise refused[0] from exc
            raise damaged(
                path, f"reading DCP's non-tensor values failed: {first_line(exc)}"
            ) from exc
        flat.update(loaded)
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    state = _nest(flat, paths)
    if any(not isinstance(k, str) or not k for k in state):
        state = {stateful: state}
    version = getattr(metadata, "version", None)
    return Source("dcp", os.path.abspath(path), state, {"dcp_version": version} if version else {})
