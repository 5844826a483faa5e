"""``casnap diff A B``: per value, added, removed, changed or unchanged
(:meth:`casnap.Repository.diff`), with drift figures (``--stats``) and a picture
(``--plot``, drawn by :mod:`casnap.cli.plots`).

The summary counts values (tensors, primitives, objects), never the containers
holding them; a container is listed only with ``--all``, as ``changed`` when
anything below it changed. With ``--plot`` the text is the summary and the
largest movers (the picture is the table); ``--json`` stays whole.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from casnap.cli import plots
from casnap.cli.common import cannot_write, emit, human, note, open_snapshot, table, usage
from casnap.cli.plot_data import value_summary
from casnap.display import format_float


def cmd_diff(args: argparse.Namespace) -> int:
    if args.plot and (why := plots.problem(args.plot)):
        return usage(why)
    repo_a, name_a = open_snapshot(args, args.a)
    repo_b, name_b = open_snapshot(args, args.b)
    # The picture's bars are the drift figures: --plot reads the changed chunks as --stats does.
    stats = args.stats or bool(args.plot)
    rows = repo_a.diff(name_a, name_b, stats=stats, other=repo_b, key=args.key)
    top: tuple[tuple[str, float], ...] = ()
    if args.plot:
        entries_a, entries_b = repo_a.show(name_a).entries, repo_b.show(name_b).entries
        try:
            picture = plots.write_diff_plot(
                args.plot, rows, entries_a, entries_b, f"{args.a} → {args.b}"
            )
        except OSError as exc:
            return cannot_write(args.plot, exc)
        how = "one per entry" if picture.grouping == "entry" else f"grouped by {picture.grouping}"
        note(f"wrote {args.plot}: {len(picture.rows)} rows, {how}")
        top = picture.top
    shown = [r for r in rows if args.all or (r.status != "unchanged" and not r.container)]
    data = []
    for r in shown:
        item: dict[str, Any] = {
            "key": r.key,
            "status": r.status,
            "container": r.container,
            "changed_bytes": r.changed_bytes,
            "changed_chunks": r.changed_chunks,
        }
        if r.rel_l2 is not None:
            item.update(max_abs_diff=r.max_abs_diff, rel_l2=r.rel_l2)
        data.append(item)

    def text() -> str:
        summary = value_summary(rows)
        if args.plot:  # the picture is the table; here what it says in one glance
            width = max((len(key) for key, _ in top), default=0)
            movers = [f"  {key.ljust(width)}  {format_float(rel, 3)}" for key, rel in top]
            return "\n".join([summary] + (["largest relative changes:", *movers] if movers else []))
        header = ["key", "status", "changed", "chunks"]
        if args.stats:
            header += ["max |b-a|", "rel L2"]
        out = []
        for r in shown:
            row = [
                r.key,
                r.status,
                human(r.changed_bytes) if r.changed_bytes else "",
                str(r.changed_chunks) if r.changed_chunks else "",
            ]
            if args.stats:
                row += (
                    [format_float(r.max_abs_diff or 0.0, 3), format_float(r.rel_l2, 3)]
                    if r.rel_l2 is not None
                    else ["", ""]
                )
            out.append(row)
        return (table(out, header, {2, 3, 4, 5}) + "\n" if out else "") + summary

    emit(args, data, text)
    return 0


def register(add: Callable[..., Any]) -> None:
    p = add("diff", cmd_diff, "per value: added, removed, changed or unchanged (manifests only)")
    p.add_argument("a", help="snapshot path")
    p.add_argument("b", help="snapshot path (may be in another repository)")
    p.add_argument("--key", help="only this entry and what is below it")
    p.add_argument(
        "--stats",
        action="store_true",
        help="numeric drift per changed tensor (reads only the changed chunks)",
    )
    p.add_argument(
        "--all", action="store_true", help="also list unchanged values and the containers"
    )
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        help="draw each entry's relative change in model order and print a summary instead "
        "of the table (reads the changed chunks as --stats does; needs casnap[plot])",
    )
