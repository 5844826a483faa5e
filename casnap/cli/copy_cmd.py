"""``casnap copy SRC DST [SNAPSHOT...]``: replicate snapshots into another repository.

Calls :meth:`casnap.Repository.copy_to` and prints what it did; exit codes as
in docs/copy.md, "The command" (4: some snapshots need a damaged or missing
source object; 5: a name with other content at the destination, or a store
failure: run again, it resumes). Example::

    casnap copy /ckpt/run1 gs://bucket/run1              # every snapshot
    casnap copy /ckpt/run1 gs://bucket/run1 latest best  # a snapshot and a tag's
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from casnap.api.repository import Repository
from casnap.cli.common import emit, key_value, open_repo, options_of, storage_options
from casnap.cli.progress import progress_bar
from casnap.cli.remote import first_contact
from casnap.errors import CopyIntegrityError
from casnap.ops.copy import CopyResult, open_destination
from casnap.ops.naming import resolve_name


def cmd_copy(args: argparse.Namespace) -> int:
    src = open_repo(args)
    names = [resolve_name(src.storage, n) for n in args.snapshots] or None
    dst_options = {**storage_options(args), **options_of(args.dst_storage_option)}
    # The first request to the destination is bounded like every remote opening.
    dst = first_contact(
        args.dst,
        lambda: open_destination(args.dst, dst_options, src.storage, create=not args.dry_run),
    )
    with progress_bar(args, "copy") as bar:
        try:
            result = src.copy_to(
                Repository.of(dst), names, force=args.force, dry_run=args.dry_run, progress=bar
            )
        except CopyIntegrityError as exc:
            if isinstance(exc.result, CopyResult):  # say what was copied before the error line
                emit(args, exc.result.to_json(), exc.result.render)
            raise
    emit(args, result.to_json(), result.render)
    return 0


def register(add: Callable[..., Any]) -> None:
    p = add(
        "copy",
        cmd_copy,
        "copy snapshots to another repository: only missing objects, verified, resumable",
    )
    p.add_argument("repo", metavar="SRC", help="source repository directory or URL")
    p.add_argument("dst", metavar="DST", help="destination repository (created if absent)")
    p.add_argument(
        "snapshots",
        nargs="*",
        metavar="SNAPSHOT",
        help="snapshot names, tags or latest (default: every snapshot)",
    )
    p.add_argument(
        "--force", action="store_true", help="replace a snapshot DST holds with other content"
    )
    p.add_argument("--dry-run", action="store_true", help="print what would be sent, send nothing")
    p.add_argument(
        "--dst-storage-option",
        action="append",
        type=key_value,
        metavar="KEY=VALUE",
        help="an fsspec option for DST only (repeatable); --storage-option applies to both",
    )
