"""The ``casnap`` command line: log, ls, show, diff, du, verify, retain, gc, tag, export,
repair.

Each command opens a :class:`casnap.Repository` and calls one of its methods
(docs/repository.md has the map); this package only parses arguments,
formats the results and maps errors to exit codes (:mod:`casnap.cli.contract`).
Tables for people by default, ``--json`` for scripts; global options go
before or after the command.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from casnap.api.repository import Repository
from casnap.cli import copy_cmd, diff_cmd, du_cmd, import_cmd, maintenance, plots
from casnap.cli.common import (
    EXIT_PROBLEMS,
    age,
    cannot_write,
    emit,
    human,
    note,
    open_repo,
    open_snapshot,
    parent_label,
    primitive_value,
    storage_options,
    table,
    usage,
)
from casnap.cli.contract import (
    add_global_options,
    closed_pipe,
    merge_global_options,
    run_command,
    version,
)
from casnap.cli.plot_data import metric_names
from casnap.cli.progress import progress_bar
from casnap.errors import (
    IntegrityError,
    RepositoryNotFoundError,
    UnsupportedFormatError,
)
from casnap.format.entries import (
    ContainerEntry,
    ObjectEntry,
    PrimitiveEntry,
    ShardedEntry,
    TensorEntry,
)
from casnap.ops.history import graph_lanes
from casnap.ops.verify import Problem, verify_config_failure

# -- commands -------------------------------------------------------------


def cmd_log(args: argparse.Namespace) -> int:
    if args.metric and not args.plot:
        return usage("--metric chooses what --plot draws; give --plot FILE.png too")
    if args.plot and (why := plots.problem(args.plot)):
        return usage(why)
    repo = open_repo(args)
    lines = repo.log()
    if args.metric and args.metric not in (known := metric_names(lines)):
        return usage(
            f"no snapshot has a metric {args.metric!r} "
            f"(metrics found: {', '.join(known) or 'none'})"
        )
    if args.plot:
        try:
            drawn = plots.write_log_plot(args.plot, lines, args.metric, args.repo)
        except OSError as exc:
            return cannot_write(args.plot, exc)
        note(f"wrote {args.plot}: {len(lines)} snapshots by {drawn['x']}")
    lanes = graph_lanes(lines)
    names = {line.manifest: line.name for line in lines}
    data = []
    for ln in lines:
        row = dataclasses.asdict(ln)
        del row["metadata"]  # `casnap show` gives it
        data.append({**row, "parents": [names.get(p, p) for p in ln.parents]})

    def text() -> str:
        rows = [
            [
                lane,
                ln.name,
                "" if ln.step is None else str(ln.step),
                age(ln.created_at),
                human(ln.logical_bytes),
                human(ln.new_bytes),
                ", ".join(parent_label(p, names, ln.parents_absent) for p in ln.parents),
            ]
            for lane, ln in zip(lanes, lines)
        ]
        if not rows:
            return f"no snapshots in {repo.url}"
        return table(rows, ["", "snapshot", "step", "time", "size", "new", "parents"], {2, 4, 5})

    emit(args, data, text)
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    repo = open_repo(args)
    names = repo.snapshots()
    emit(args, names, lambda: "\n".join(names) or f"no snapshots in {repo.url}")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    repo, name = open_snapshot(args, args.snapshot)
    view = repo.show(name, key=args.key or None)
    rows, data = [], []
    for key, e in view.entries.items():
        if isinstance(e, TensorEntry):
            desc = [key, "tensor", e.dtype, str(list(e.shape)), human(e.nbytes)]
            data.append(
                {
                    "key": key,
                    "kind": "tensor",
                    "dtype": e.dtype,
                    "shape": e.shape,
                    "bytes": e.nbytes,
                    "chunks": len(e.chunks),
                }
            )
        elif isinstance(e, ObjectEntry):
            desc = [key, "object", e.type_name, "", human(e.size)]
            data.append({"key": key, "kind": "object", "type": e.type_name, "bytes": e.size})
        elif isinstance(e, ShardedEntry):
            desc = [
                key,
                f"sharded ({e.layout}, {len(e.shards)} shards)",
                e.dtype,
                str(list(e.shape)),
                human(e.nbytes),
            ]
            data.append(
                {
                    "key": key,
                    "kind": "sharded",
                    "layout": e.layout,
                    "dtype": e.dtype,
                    "shape": e.shape,
                    "bytes": e.nbytes,
                    "shards": len(e.shards),
                }
            )
        elif isinstance(e, PrimitiveEntry):
            value, shown = primitive_value(e)
            desc = [key, e.type, shown if len(shown) <= 40 else shown[:39] + "…", "", ""]
            data.append({"key": key, "kind": "primitive", "type": e.type, "value": value})
        else:
            assert isinstance(e, ContainerEntry)
            if not args.all:
                continue
            desc = [key, e.type, f"{len(e.keys)} members", "", ""]
            data.append({"key": key, "kind": "container", "type": e.type, "keys": e.keys})
        rows.append(desc)
    head = (
        f"snapshot {name}  manifest {view.manifest[:16]}  created {age(view.created_at)}  "
        f"world size {view.world_size}\nmetadata {json.dumps(view.metadata)}\n"
    )
    emit(
        args,
        {
            "name": name,
            "manifest": view.manifest,
            "created_at": view.created_at,
            "metadata": view.metadata,
            "parents": list(view.parents),
            "entries": data,
        },
        lambda: head + table(rows, ["key", "kind", "dtype/type", "shape", "size"], {4}),
    )
    return 0


def _part(text: str) -> tuple[int, int]:
    k, sep, n = text.partition("/")
    try:
        part = (int(k), int(n))
    except ValueError:
        part = (-1, 0)
    if not sep or not (part[1] >= 1 and 0 <= part[0] < part[1]):
        raise argparse.ArgumentTypeError(f"--part wants K/N with 0 <= K < N, got {text!r}")
    return part


def _count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"wants a whole number of parts >= 1, got {text!r}")
    return n


def cmd_verify(args: argparse.Namespace) -> int:
    part = args.part
    try:
        repo = open_repo(args)
    except (RepositoryNotFoundError, IntegrityError, UnsupportedFormatError) as exc:
        # A damaged or deleted config is a problem verify reports, not an error it dies of.
        # A foreign format version is one too: damage or a newer casnap, this casnap
        # cannot vouch for the repository either way (the detail says which to suspect).
        found = verify_config_failure(args.repo, storage_options(args), exc)
        if found is None:
            raise
        report = found
    else:
        if args.rotate:
            part = _next_part(repo, args.rotate)
        with progress_bar(args, "verify") as bar:
            report = repo.verify(read_data=args.read_data, part=part, progress=bar)

    def text() -> str:
        lines = [render_problem(p) for p in report.problems]
        scope = (
            f", re-hashed {report.chunks_read} chunks ({human(report.bytes_read)})"
            + (f", part {part[0]}/{part[1]}" if part else "")
            if report.chunks_read or part
            else ""
        )
        tags = f", {report.tags} tags" if report.tags else ""
        lines.append(
            f"{report.snapshots} snapshots{tags}, {report.manifests} manifests, "
            f"{report.chunks} chunks{scope}: "
            + ("OK" if report.ok else f"{len(report.problems)} problem(s)")
        )
        if report.unreferenced:  # space, not damage: the exit code ignores it
            lines.append(report.unreferenced.describe())
        return "\n".join(lines)

    emit(args, {**report.to_json(), "part": list(part) if part else None}, text)
    return 0 if report.ok else EXIT_PROBLEMS


def render_problem(p: Problem) -> str:
    """One line per problem: what, where, why, and which snapshots and tags it affects."""
    held = [f"snapshots: {', '.join(p.snapshots)}"] if p.snapshots else []
    held += [f"tags: {', '.join(p.tags)}"] if p.tags else []
    return f"{p.kind}: {p.subject}: {p.detail}" + (f" ({'; '.join(held)})" if held else "")


def _next_part(repo: Repository, n: int) -> tuple[int, int]:
    """The next of ``n`` parts for this repository, remembered in a local state file."""
    from casnap.settings import state_dir

    base = state_dir()
    state = base / "verify" / f"{repo.storage.config.repo_id}-{n}"
    try:
        k = (int(state.read_text()) + 1) % n
    except (OSError, ValueError):
        k = 0
    state.parent.mkdir(parents=True, exist_ok=True)
    state.write_text(str(k))
    return (k, n)


# -- entry point ------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="casnap",
        description="Inspect and maintain casnap repositories. A snapshot is named by its "
        "path (REPO/NAME), by a tag (REPO/TAG) or as REPO/latest.",
        epilog="exit codes: 0 ok, 1 problems found, 2 usage, 3 not found, 4 integrity, "
        "5 other error, 141 output closed early",
    )
    parser.add_argument("--version", action="version", version=f"casnap {version()}")
    add_global_options(parser, after=False)
    common = argparse.ArgumentParser(add_help=False)
    add_global_options(common, after=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, func: Callable[[argparse.Namespace], int], help: str) -> Any:
        p = sub.add_parser(name, parents=[common], help=help, description=help)
        p.set_defaults(func=func)
        return p

    p = add("log", cmd_log, "snapshots oldest first, with lineage, step, size and new bytes")
    p.add_argument("repo", help="repository directory or URL")
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        help="also draw bytes added and shared per snapshot over the steps (needs casnap[plot])",
    )
    p.add_argument(
        "--metric",
        metavar="NAME",
        help="with --plot: draw metadata['metrics'][NAME] (or metadata[NAME]) in a second panel",
    )
    p = add("ls", cmd_ls, "list the snapshot names of a repository")
    p.add_argument("repo", help="repository directory or URL")
    p = add("show", cmd_show, "the entries of a snapshot with dtype, shape and size")
    p.add_argument("snapshot", help="snapshot path, e.g. /ckpt/run1/step_100")
    p.add_argument("--key", help="only this entry and what is below it")
    p.add_argument("--all", action="store_true", help="also list containers")
    diff_cmd.register(add)
    p = add(
        "du", du_cmd.cmd_du, "logical and stored bytes, dedup ratio, what deleting each would free"
    )
    p.add_argument("repo", help="repository directory or URL")
    p = add("verify", cmd_verify, "check refs, manifests and chunks; exit 1 on any problem")
    p.add_argument("repo", help="repository directory or URL")
    p.add_argument("--read-data", action="store_true", help="re-hash every chunk's data")
    group = p.add_mutually_exclusive_group()
    group.add_argument(
        "--part",
        type=_part,
        metavar="K/N",
        help="re-hash only part K of N of the chunks (implies --read-data)",
    )
    group.add_argument(
        "--rotate",
        type=_count,
        metavar="N",
        help="re-hash the next part of N each run (implies --read-data)",
    )
    maintenance.register(add)
    copy_cmd.register(add)
    import_cmd.register(add)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``casnap ARGV``; the exit code (casnap/cli/contract.py has the table)."""
    try:
        args = build_parser().parse_args(argv)  # bad usage: argparse exits 2
    except BrokenPipeError:  # --help into a closed pipe
        return closed_pipe()
    merge_global_options(args)
    return run_command(args, args.func)


if __name__ == "__main__":
    sys.exit(main())
