"""The commands of the CLI that change a repository: init, rm, retain, gc, tag, export, repair.

Each destructive command plans first and prints the plan; ``--dry-run``
stops there. Like every command, each calls one :class:`casnap.Repository`
method and formats what it returns.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from casnap.cli.common import (
    EXIT_ERROR,
    EXIT_PROBLEMS,
    age,
    emit,
    human,
    open_repo,
    open_snapshot,
    size,
    storage_options,
    table,
)
from casnap.cli.contract import check_output_path
from casnap.cli.progress import progress_bar
from casnap.cli.remote import first_contact
from casnap.errors import ConfigError, ObjectNotFoundError, RetentionError
from casnap.ops.naming import resolve_name, suggest
from casnap.ops.retention import (
    KeepBest,
    KeepEveryStep,
    KeepLast,
    KeepTagged,
    KeepWithin,
    RetentionPolicy,
    RetentionRule,
)
from casnap.repo.tags import tag_names
from casnap.settings import VARIABLES

if TYPE_CHECKING:
    from casnap.gc.reclaim import ReclaimResult

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def duration(text: str) -> float:
    """Seconds from ``90``, ``90s``, ``15m``, ``6h``, ``7d`` or ``2w``."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smhdw]?)", text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration like 90s, 15m, 6h, 7d")
    return float(match.group(1)) * _UNITS[match.group(2) or "s"]


def chunk_size(text: str) -> int:
    """Bytes from ``65536`` or ``4MiB``, within the bounds of the ``chunk_size`` setting."""
    if not text.strip().lstrip("-").isdigit():  # a plain number: the bounds say what is wrong
        size(text)  # "'lots' is not a size like ...": the message every size option gives
    try:
        return int(VARIABLES["chunk_size"].parse(text, "override"))
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc).split(": ", 1)[-1]) from exc


def best(text: str) -> KeepBest:
    n, _, rest = text.partition(":")
    metric, _, mode = rest.partition(":")
    if not n.isdigit() or not metric or mode not in ("", "min", "max"):
        raise argparse.ArgumentTypeError(f"--keep-best wants N:METRIC[:min|max], got {text!r}")
    return KeepBest(int(n), metric, mode or "min")  # type: ignore[arg-type]


def cmd_init(args: argparse.Namespace) -> int:
    from casnap.api.repository import Repository

    options = storage_options(args)
    repo = first_contact(
        args.repo, lambda: Repository.init(args.repo, options, chunk_size=args.chunk_size)
    )
    data = {
        "repo": repo.url,
        "repo_id": repo.storage.config.repo_id,
        "shared": repo.storage.config.shared,
        "chunk_size": repo.storage.config.chunk_size,
    }
    emit(args, data, lambda: f"shared repository at {repo.url}: snapshot paths below it go in it")
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    repo, name = open_snapshot(args, args.snapshot)
    manifest = repo.delete(name)
    reclaimed = repo.reclaim([manifest], wait_seconds=args.wait) if args.prune else None
    data = {"repo": repo.url, "snapshot": name, "manifest": manifest}
    head = f"deleted snapshot {name} from {repo.url}"
    later = f"`casnap rm --prune` or `casnap gc {repo.url}` reclaims its space"
    return _emit_deleted(args, data, head, later, reclaimed)


def _emit_deleted(
    args: argparse.Namespace,
    data: dict[str, Any],
    head: str,
    later: str,
    reclaimed: ReclaimResult | None,
) -> int:
    """Emit what a deletion did: ``head``, then the reclaim, or ``later``: what reclaims it."""
    data["reclaimed"] = reclaimed.to_json() if reclaimed is not None else None
    text = f"{head}; {later}" if reclaimed is None else f"{head}\n{reclaimed.render()}"
    emit(args, data, lambda: text)
    # A deferred prune deleted no data: the refs are gone, the space is not (yet).
    return EXIT_ERROR if reclaimed is not None and reclaimed.deferred is not None else 0


def cmd_retain(args: argparse.Namespace) -> int:
    rules: list[RetentionRule] = []
    if args.keep_last is not None:
        rules.append(KeepLast(args.keep_last))
    if args.keep_every_step is not None:
        rules.append(KeepEveryStep(args.keep_every_step))
    if args.keep_within is not None:
        rules.append(KeepWithin(args.keep_within))
    if args.keep_tagged is not None:
        rules.append(KeepTagged(args.keep_tagged or None))
    rules += args.keep_best or []
    if not rules and not args.allow_delete_all:
        raise ConfigError(
            "retain needs a rule saying what to keep: --keep-last N, --keep-every-step K, "
            "--keep-within DURATION, --keep-tagged [TAG ...] or --keep-best N:METRIC "
            "(--allow-delete-all alone deletes every snapshot)",
            "keep",
        )
    try:
        result = open_repo(args).retain(
            RetentionPolicy(*rules),
            dry_run=args.dry_run,
            allow_delete_all=args.allow_delete_all,
            prune=args.prune,
            wait_seconds=args.wait,
        )
    except RetentionError as exc:  # its message names the Python argument
        message = str(exc).replace("allow_delete_all=True", "--allow-delete-all")
        raise RetentionError(message) from exc
    plan = result.plan
    assert plan is not None  # Repository.retain always returns its plan
    if result.dry_run:
        emit(args, {**plan.to_json(), "dry_run": True}, lambda: plan.render() + "\n(dry run)")
        return 0
    data = {**plan.to_json(), "dry_run": False}
    data.update(deleted=list(result.deleted), skipped=result.skipped)
    head = plan.render() + f"\ndeleted {len(result.deleted)} ref(s)"
    later = "`casnap retain --prune` or `casnap gc` reclaims their space"
    return _emit_deleted(args, data, head, later, result.reclaimed)


def cmd_gc(args: argparse.Namespace) -> int:
    repo = open_repo(args)
    with progress_bar(args, "gc", unit="objects") as bar:
        result = repo.gc(
            grace_seconds=args.grace, dry_run=args.dry_run, wait_seconds=args.wait, progress=bar
        )
    emit(args, result.to_json(), result.render)
    return 0


def cmd_unlock(args: argparse.Namespace) -> int:
    repo = open_repo(args)
    removed = repo.unlock(force=args.force)
    data = {"repo": repo.url, "removed": removed}
    emit(args, data, lambda: f"removed {removed}" if removed else f"no gc lock in {repo.url}")
    return 0


_TAG_USAGE = {
    "add": "casnap tag REPO add TAG SNAPSHOT",
    "rm": "casnap tag REPO rm TAG",
    "ls": "casnap tag REPO ls",
}


def cmd_tag(args: argparse.Namespace) -> int:
    wanted = {"add": (True, True), "rm": (True, False), "ls": (False, False)}[args.action]
    if wanted != (bool(args.tag), bool(args.snapshot)):
        raise ConfigError(f"tag {args.action} is used as: {_TAG_USAGE[args.action]}", "tag")
    repo = open_repo(args)
    if args.action == "add":
        info = repo.tag(args.tag, resolve_name(repo.storage, args.snapshot))
        emit(args, vars(info), lambda: f"tagged {info.snapshot} as {info.tag}")
    elif args.action == "rm":
        try:
            info = repo.untag(args.tag)
        except ObjectNotFoundError as exc:
            hint = suggest(args.tag, tag_names(repo.storage), f"`casnap tag {repo.url} ls`")
            raise ObjectNotFoundError(f"{exc}{hint}", exc.key) from exc
        emit(args, vars(info), lambda: f"removed tag {info.tag} (was {info.snapshot})")
    else:
        tags = repo.tags()  # in natural order

        def text() -> str:
            rows = [[t, i.snapshot, i.manifest[:12], age(i.created_at)] for t, i in tags.items()]
            return table(rows, ["tag", "snapshot", "manifest", "tagged"]) if rows else "no tags"

        emit(args, {t: vars(i) for t, i in tags.items()}, text)
    return 0


# The suffix picks the format; anything else is refused rather than guessed (an
# ``out.npz`` that is really safetensors would fail far from here).
EXPORT_FORMATS = {".safetensors": "safetensors", ".pt": "torch", ".pth": "torch", ".bin": "torch"}


def export_format(out: str, given: str | None) -> str:
    """The export format: ``--format`` if given, else from the suffix of ``out``
    (ValueError naming the supported suffixes if it says none)."""
    if given:
        return given
    suffix = os.path.splitext(out)[1].lower()
    if suffix not in EXPORT_FORMATS:
        known = ", ".join(EXPORT_FORMATS)
        raise ValueError(
            f"cannot tell the format of {out!r} from its suffix; supported: {known} "
            "(or name one with --format safetensors|torch)"
        )
    return EXPORT_FORMATS[suffix]


def cmd_export(args: argparse.Namespace) -> int:
    check_output_path(args.out)
    try:
        fmt = export_format(args.out, args.format)  # before anything is read
    except ValueError as exc:
        raise ConfigError(f"export: {exc}", "out") from exc
    repo, name = open_snapshot(args, args.snapshot)
    with progress_bar(args, "export") as bar:
        result = repo.export(
            name,
            args.out,
            format=fmt,
            key=args.key,
            memory_budget_bytes=args.memory_budget,
            progress=bar,
        )
    written = os.path.getsize(result.path)  # what is on disk, whatever the writer said
    data = {
        "snapshot": name,
        "out": args.out,
        **dataclasses.asdict(result),
        "format": result.format,
        "file_bytes": written,
    }
    emit(
        args,
        data,
        lambda: f"exported {name} to {args.out} ({result.format}, {human(written)})",
    )
    return 0


def cmd_repair(args: argparse.Namespace) -> int:
    repo = open_repo(args)
    with progress_bar(args, "repair") as bar:
        result = repo.repair(
            from_snapshots=args.from_snapshot or (),
            from_files=args.from_file or (),
            read_data=args.read_data,
            dry_run=args.dry_run,
            progress=bar,
        )
    emit(args, result.to_json(), result.render)
    return 0 if result.ok else EXIT_PROBLEMS


def _prune_arguments(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--prune",
        action="store_true",
        help=f"then delete what only {what} reached, without gc's grace period "
        "(like restic's forget --prune; safe beside running takes)",
    )
    p.add_argument(
        "--wait",
        type=duration,
        default=60.0,
        metavar="DURATION",
        help="with --prune: how long to wait for takes in flight (default 60s)",
    )


def register(add: Callable[..., Any]) -> None:
    p = add("init", cmd_init, "create a repository shared by the snapshot paths below it")
    p.add_argument("repo", help="repository directory or URL, e.g. /ckpt")
    p.add_argument(
        "--chunk-size",
        type=chunk_size,
        metavar="SIZE",
        help="default chunk size (4 KiB to 1 GiB, e.g. 4MiB or 4194304)",
    )
    p = add("rm", cmd_rm, "delete one snapshot (--prune: and the space only it used)")
    p.add_argument("snapshot", help="snapshot path, e.g. /ckpt/run1/step_100")
    _prune_arguments(p, "the deleted snapshot")
    p = add(
        "retain",
        cmd_retain,
        "delete the refs a retention policy does not keep (--prune: and their space)",
    )
    p.add_argument("repo", help="repository directory or URL")
    p.add_argument("--keep-last", type=int, metavar="N", help="the newest N snapshots")
    p.add_argument("--keep-every-step", type=int, metavar="K", help="steps divisible by K")
    p.add_argument(
        "--keep-within",
        type=duration,
        metavar="DURATION",
        help="snapshots younger than this (90s, 15m, 6h, 7d, 2w)",
    )
    p.add_argument(
        "--keep-tagged", nargs="*", metavar="TAG", help="tagged snapshots (any tag, or those named)"
    )
    p.add_argument(
        "--keep-best",
        type=best,
        action="append",
        metavar="N:METRIC[:min|max]",
        help="the N best by a metric in the metadata (repeatable)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the plan, delete nothing")
    p.add_argument(
        "--allow-delete-all", action="store_true", help="permit a plan that deletes every snapshot"
    )
    _prune_arguments(p, "the deleted snapshots")
    p = add("gc", cmd_gc, "delete objects no ref or tag reaches (safe beside running takes)")
    p.add_argument("repo", help="repository directory or URL")
    p.add_argument(
        "--grace",
        type=duration,
        default=3600.0,
        metavar="DURATION",
        help="keep unreachable objects younger than this (default 1h)",
    )
    p.add_argument(
        "--wait",
        type=duration,
        default=60.0,
        metavar="DURATION",
        help="how long to wait for takes in flight (default 60s)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the plan, delete nothing")
    p = add("unlock", cmd_unlock, "remove a stale or damaged gc lock (a live one needs --force)")
    p.add_argument("repo", help="repository directory or URL")
    p.add_argument(
        "--force", action="store_true", help="remove it even if live (only if no gc is running)"
    )
    p = add("tag", cmd_tag, "pin a snapshot under a tag (add), unpin (rm), or list tags (ls)")
    p.add_argument("repo", help="repository directory or URL")
    p.add_argument("action", choices=["add", "rm", "ls"])
    p.add_argument("tag", nargs="?", default="", help="the tag")
    p.add_argument("snapshot", nargs="?", help="the snapshot name (for add)")
    p = add(
        "repair",
        cmd_repair,
        "write good copies of damaged or missing chunks; exit 1 if snapshots stay unrecoverable",
    )
    p.add_argument("repo", help="repository directory or URL")
    p.add_argument(
        "--from-snapshot",
        action="append",
        metavar="SNAPSHOT",
        help="a snapshot holding the chunks: a name here, or a path in any repository (repeatable)",
    )
    p.add_argument(
        "--from",
        dest="from_file",
        action="append",
        metavar="FILE",
        help="live state saved with torch.save, e.g. the model you still hold (repeatable)",
    )
    p.add_argument(
        "--read-data",
        action="store_true",
        help="first re-hash every chunk to find unrecorded damage",
    )
    p.add_argument("--dry-run", action="store_true", help="print the plan, write nothing")
    p = add("export", cmd_export, "write a snapshot (or one key) as safetensors or torch.save")
    p.add_argument("snapshot", help="snapshot path")
    p.add_argument(
        "out", help="output file: .safetensors, or .pt/.pth/.bin for torch.save (others refused)"
    )
    p.add_argument("--format", choices=["safetensors", "torch"])
    p.add_argument("--key", help="export only this entry (and what is below it)")
    p.add_argument(
        "--memory-budget",
        type=size,
        metavar="SIZE",
        help="bound on in-flight buffers, e.g. 2GiB (default: CASNAP_MEMORY_BUDGET)",
    )
