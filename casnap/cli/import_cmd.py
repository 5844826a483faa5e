"""``casnap import SOURCE SNAPSHOT``: an existing checkpoint as a snapshot of a repository.

SOURCE is a DCP checkpoint directory, a safetensors file, a Hugging Face model
directory (sharded safetensors with their index) or a ``torch.save`` file;
the work is :func:`casnap.integrations.importers.import_checkpoint`'s. A
missing SOURCE exits 3, a path of no known format (or a pickle
``weights_only`` refuses) 2, a truncated or malformed file 4; in each case
nothing is created in the repository.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from casnap.cli.common import emit, human, size, storage_options
from casnap.cli.progress import progress_bar


def cmd_import(args: argparse.Namespace) -> int:
    # Imported when used: the other commands need neither DCP nor the source readers.
    from casnap.integrations.importers import import_checkpoint

    with progress_bar(args, "import") as bar:
        snap = import_checkpoint(
            args.source,
            args.snapshot,
            storage_options=storage_options(args) or None,
            memory_budget_bytes=args.memory_budget,
            progress=bar,
            stateful=args.stateful,
            format=args.format,
        )
    stats = snap.last_take_stats
    assert stats is not None
    record = snap.metadata["import"]
    tensors = sum(1 for e in snap.get_manifest().values() if e.kind == "tensor")
    data = {
        "snapshot": snap.name,
        "repository": snap.repository.url,
        "manifest": snap.manifest_hash,
        "format": record["format"],
        "source": record["path"],
        "tensors": tensors,
        "logical_bytes": stats.raw_bytes,
        # What the import added to the repository: the stored bytes `log` counts as new.
        "new_bytes": stats.stored_bytes_written,
        "raw_bytes_written": stats.raw_bytes_written,
        "stored_bytes_written": stats.stored_bytes_written,
    }
    emit(
        args,
        data,
        lambda: (
            f"imported {record['format']} {record['path']} as {snap.name} in "
            f"{snap.repository.url}: {tensors} tensors, {human(stats.raw_bytes)}, "
            f"{human(stats.stored_bytes_written)} new"
        ),
    )
    return 0


def register(add: Callable[..., Any]) -> None:
    p = add(
        "import",
        cmd_import,
        "bring a DCP, safetensors, Hugging Face or torch.save "
        "checkpoint into a repository as one snapshot (deduplicated)",
    )
    p.add_argument(
        "source",
        help="DCP directory, .safetensors file, Hugging Face model "
        "directory (or its index json), or torch.save file",
    )
    p.add_argument("snapshot", help="snapshot path to create, e.g. /ckpt/base/llama")
    p.add_argument(
        "--format",
        choices=["dcp", "hf", "safetensors", "torch"],
        help="refuse SOURCE unless it is this format (default: detected)",
    )
    p.add_argument(
        "--stateful",
        default="model",
        metavar="NAME",
        help="where a flat source's tensors go (default: model)",
    )
    p.add_argument(
        "--memory-budget",
        type=size,
        metavar="SIZE",
        help="bytes of the source held in memory at once (e.g. 512MiB; default: "
        "CASNAP_MEMORY_BUDGET)",
    )
