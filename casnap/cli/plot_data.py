"""What the ``--plot`` pictures show, as plain values: no matplotlib here.

A diff becomes :class:`DiffRow` values in the model's order, one per entry,
or one per module when there are too many entries to label (see
:func:`diff_rows`); a log becomes :class:`LogPoint` values (see
:func:`log_points`). Keeping this apart from the drawing lets the tests and
the picture's metadata say exactly what was drawn.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from casnap.format.entries import ContainerEntry, Entry
from casnap.format.tree import leaf_order
from casnap.ops.history import EntryDiff, LogLine, value_counts
from casnap.ops.retention import SnapshotInfo

# One row per entry up to this many; beyond it entries are grouped by module.
MAX_ROWS = 64
STATUSES = ("changed", "no figure", "added", "removed", "unchanged")


@dataclass(frozen=True)
class DiffRow:
    """One bar of the diff picture: an entry, or a run of entries under one module prefix."""

    label: str  # what the axis shows (the common prefix of all keys removed)
    keys: tuple[str, ...]  # the full entry keys it covers, in model order
    counts: Mapping[str, int]  # status -> entries (``STATUSES``; "no figure": changed, no ratio)
    rel_l2: float | None  # the largest finite relative change among them, if any
    top_key: str | None = None  # the entry that change belongs to


@dataclass(frozen=True)
class DiffPicture:
    rows: tuple[DiffRow, ...]
    prefix: str  # the prefix common to every key, left out of the labels
    grouping: str  # "entry", "module depth N", "runs of module depth N" or "runs of entries"
    top: tuple[tuple[str, float], ...] = field(default=())  # the largest movers, key -> change


def model_order(entries_a: Mapping[str, Entry], entries_b: Mapping[str, Entry]) -> list[str]:
    """The leaves of ``b`` in its state-dict order, with those only ``a`` has placed after
    the entry they followed in ``a``::

        model_order(ma.entries, mb.entries)  # ['0/model/0.weight', '0/model/0.bias', ...]
    """
    order_b = leaf_order(entries_b)
    in_b = set(order_b)
    after: dict[str | None, list[str]] = {}
    previous: str | None = None
    for key in leaf_order(entries_a):
        if key in in_b:
            previous = key
        else:
            after.setdefault(previous, []).append(key)
    out = list(after.get(None, []))
    for key in order_b:
        out.append(key)
        out.extend(after.get(key, []))
    return out


def value_summary(rows: Sequence[EntryDiff], under: str = "") -> str:
    """``64 values: 23 changed, 41 unchanged``: what the text and the picture's title say."""
    counts = value_counts(list(rows))
    total = sum(counts.values())
    what = ", ".join(f"{n} {status}" for status, n in counts.items())
    return f"{total} value{'' if total == 1 else 's'}{under}" + (f": {what}" if what else "")


def _status(row: EntryDiff) -> str:
    if row.status == "changed" and not _finite(row.rel_l2):
        return "no figure"
    return row.status


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value) and value > 0


def _common_prefix(keys: Sequence[str]) -> str:
    """The longest common prefix of ``keys`` that ends at a ``/`` (module names stay whole)."""
    if len(keys) < 2:
        return keys[0].rpartition("/")[0] + "/" if keys and "/" in keys[0] else ""
    prefix = keys[0]
    for key in keys[1:]:
        while not key.startswith(prefix):
            prefix = prefix[:-1]
    return prefix[: prefix.rfind("/") + 1]


_SEGMENT = re.compile(r"[^/.]+")


def _module(label: str, depth: int) -> str:
    """The first ``depth`` segments of a label (segments split at ``/`` and ``.``)."""
    parts = list(_SEGMENT.finditer(label))
    if len(parts) <= depth:
        return label
    return label[: parts[depth - 1].end()]


def _runs(names: Sequence[str]) -> list[list[int]]:
    """Consecutive indices that share a name: groups never reorder the model."""
    out: list[list[int]] = []
    for i, name in enumerate(names):
        if out and names[out[-1][0]] == name:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def _levels(labels: Sequence[str]) -> list[tuple[str, list[tuple[str, list[int]]]]]:
    """Ways to group the entries, finest (one per entry) to coarsest (first segment): each a
    description and its groups, a name and the entries' indices."""
    out = [("entry", [(label, [i]) for i, label in enumerate(labels)])]
    depth = max((len(_SEGMENT.findall(label)) for label in labels), default=1)
    for d in range(depth - 1, 0, -1):
        names = [_module(label, d) for label in labels]
        groups = [(f"{names[r[0]]}.*" if len(r) > 1 else labels[r[0]], r) for r in _runs(names)]
        out.append((f"module depth {d}", groups))
    return out


def _group(labels: Sequence[str], max_rows: int) -> tuple[list[tuple[str, list[int]]], str]:
    """The rows: the finest grouping with at most ``max_rows`` groups, unless that is so
    coarse it shows little (fewer than a quarter of ``max_rows``, as when 100 layers make
    ``layers.N`` too many and ``layers`` one row); then the next finer grouping's groups
    are merged, in order, into even runs."""
    levels = _levels(labels)
    fits = [i for i, (_, groups) in enumerate(levels) if len(groups) <= max_rows]
    if fits and (fits[0] == 0 or len(levels[fits[0]][1]) >= max_rows // 4):
        how, groups = levels[fits[0]]
        return [(f"{n}  ({len(ix)})" if len(ix) > 1 else n, ix) for n, ix in groups], how
    how, groups = levels[fits[0] - 1] if fits else levels[-1]
    size = math.ceil(len(groups) / max_rows)
    out = []
    for i in range(0, len(groups), size):
        part = groups[i : i + size]
        ix = [j for _, g in part for j in g]
        name = part[0][0] if len(part) == 1 else f"{part[0][0]} … {part[-1][0]}"
        out.append((f"{name}  ({len(ix)})" if len(ix) > 1 else name, ix))
    return out, "runs of " + ("entries" if how == "entry" else how)


def diff_rows(
    rows: Sequence[EntryDiff],
    entries_a: Mapping[str, Entry],
    entries_b: Mapping[str, Entry],
    max_rows: int = MAX_ROWS,
    top: int = 5,
) -> DiffPicture:
    """The diff's leaves (containers left out) as rows in the model's order.

    Up to ``max_rows`` entries get a row each. Beyond that, entries are grouped
    by module: the finest prefix depth (``layers.12.attn`` before ``layers.12``
    before ``layers``) that needs no more than ``max_rows`` rows, and a row
    shows the largest change in its group. When no depth fits, or the one that
    fits is too coarse to show much, consecutive groups are merged into even
    runs (``layers.0.* … layers.3.*``); groups never reorder the model.
    """
    by_key = {r.key: r for r in rows}
    is_container = {
        k for k, e in (*entries_a.items(), *entries_b.items()) if isinstance(e, ContainerEntry)
    }
    keys = [k for k in model_order(entries_a, entries_b) if k in by_key and k not in is_container]
    keys += sorted(k for k in by_key if k not in set(keys) and k not in is_container)
    prefix = _common_prefix(keys)
    labels = [k[len(prefix) :] or k for k in keys]
    movers = sorted(
        ((k, by_key[k].rel_l2 or 0.0) for k in keys if _finite(by_key[k].rel_l2)),
        key=lambda kv: -kv[1],
    )[:top]
    groups, grouping = _group(labels, max_rows)
    out = []
    for label, group in groups:
        members = [by_key[keys[i]] for i in group]
        counts = {s: 0 for s in STATUSES}
        for m in members:
            counts[_status(m)] += 1
        best = max(
            (m for m in members if _finite(m.rel_l2)), default=None, key=lambda m: m.rel_l2 or 0.0
        )
        out.append(
            DiffRow(
                label,
                tuple(keys[i] for i in group),
                counts,
                best.rel_l2 if best else None,
                best.key if best else None,
            )
        )
    return DiffPicture(tuple(out), prefix, grouping, tuple(movers))


@dataclass(frozen=True)
class LogPoint:
    name: str
    x: float  # the step, or the position oldest first when steps cannot order the run
    new_bytes: int
    shared_bytes: int  # stored bytes an earlier snapshot (or a parent) already held
    metric: float | None  # None: absent; NaN or infinite: stored but not drawable


def metric_names(lines: Sequence[LogLine]) -> list[str]:
    """Names a ``--metric`` could use: numeric values in ``metadata["metrics"]`` or the top
    level of the metadata (``step`` left out)."""
    names: set[str] = set()
    for line in lines:
        info = SnapshotInfo(line.name, line.manifest, line.created_at, line.step, line.metadata, ())
        metrics = line.metadata.get("metrics")
        candidates = list(line.metadata) + (list(metrics) if isinstance(metrics, dict) else [])
        names.update(n for n in candidates if n != "step" and info.metric(n) is not None)
    return sorted(names)


def log_points(lines: Sequence[LogLine], metric: str | None) -> tuple[list[LogPoint], str]:
    """One point per snapshot, oldest first, and what x is ("step" or "order").

    x is the step when every snapshot has one and no two share it (branches or
    fine-tunes of one base repeat steps); otherwise the snapshots' order.
    The metric is read as retention reads it (``metadata["metrics"][name]``,
    else ``metadata[name]``, with ``"NaN"`` meaning NaN).
    """
    steps = [line.step for line in lines]
    by_step = all(s is not None for s in steps) and len(set(steps)) == len(steps)
    out = []
    for i, line in enumerate(lines):
        info = SnapshotInfo(line.name, line.manifest, line.created_at, line.step, line.metadata, ())
        shared = max(line.stored_bytes - line.new_bytes, 0)
        x = float(line.step) if by_step and line.step is not None else float(i + 1)
        value = info.metric(metric) if metric else None
        out.append(LogPoint(line.name, x, line.new_bytes, shared, value))
    return out, "step" if by_step else "order"
