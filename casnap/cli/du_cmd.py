"""``casnap du REPO``: logical and stored bytes, what deleting each snapshot frees, and
where the rest of what the store holds goes (:func:`casnap.ops.history.du`)."""

from __future__ import annotations

import argparse
import dataclasses

from casnap.cli.common import emit, human, open_repo, table
from casnap.ops.history import Usage


def cmd_du(args: argparse.Namespace) -> int:
    repo = open_repo(args)
    usage = repo.du()
    space = usage.space
    data = {
        "snapshots": usage.snapshots,
        "logical_bytes": usage.logical_bytes,
        "stored_bytes": usage.stored_bytes,
        "dedup_ratio": usage.dedup_ratio,
        "per_snapshot": [
            {
                "name": u.name,
                "logical_bytes": u.logical_bytes,
                "stored_bytes": u.stored_bytes,
                "freed_if_deleted": u.exclusive_bytes,
            }
            for u in usage.per_snapshot
        ],
        "store": {**dataclasses.asdict(space), "total_bytes": space.total_bytes},
        "leftovers": dataclasses.asdict(usage.leftovers),
        "unreferenced": {
            **dataclasses.asdict(usage.unreferenced),
            "hint": usage.unreferenced.describe() if usage.unreferenced else None,
        },
    }
    emit(args, data, lambda: render(usage, local=repo.storage.store.capabilities.local))
    return 0


def render(usage: Usage, local: bool) -> str:
    rows = [
        [u.name, human(u.logical_bytes), human(u.stored_bytes), human(u.exclusive_bytes)]
        for u in usage.per_snapshot
    ]
    head = table(rows, ["snapshot", "logical", "stored", "freed if deleted"], {1, 2, 3})
    out = [
        head,
        "",
        f"{usage.snapshots} snapshots: logical {human(usage.logical_bytes)}, "
        f"stored {human(usage.stored_bytes)}, dedup ratio {usage.dedup_ratio:.2f}x",
        *space_lines(usage, local),
    ]
    left = usage.leftovers
    if left:
        out.append(
            f"left by interrupted takes: {left.temp_files} temp file(s) "
            f"({human(left.temp_bytes)}), {left.expired_leases} expired lease(s); "
            "`casnap gc` removes the expired leases at once and the temp files once "
            "older than its grace period (1h); `casnap gc --grace 0` removes both now"
        )
    if left.live_leases:
        out.append(f"takes in flight now: {left.live_leases}")
    if usage.unreferenced:
        out.append(usage.unreferenced.describe())
    return "\n".join(out)


def space_lines(usage: Usage, local: bool) -> list[str]:
    """What the store holds beyond "stored": a line a part, for the parts it has."""
    space = usage.space
    parts = [
        (space.frame_bytes, "stored: the frames snapshots and tags use, each once, with headers"),
        (space.manifest_bytes, "manifests of the snapshots and tags"),
        (
            space.unused_in_packs,
            "in their packs, frames only deleted snapshots used: gc deletes a pack whole, "
            "once no snapshot uses any of its frames",
        ),
        (space.unreferenced_bytes, "unreferenced: what no ref or tag reaches (below)"),
        (space.temp_bytes, "temp files of interrupted takes (below)"),
    ]
    shown = [(human(n), what) for n, what in parts if n or what.startswith("stored")]
    width = max(len(n) for n, _ in shown)
    lines = [f"the store holds {human(space.total_bytes)}:"]
    lines += [f"  {n.rjust(width)}  {what}" for n, what in shown]
    if local:
        lines.append(
            "(a file system gives each file whole blocks: `du -sh` of the folder says more)"
        )
    return lines
