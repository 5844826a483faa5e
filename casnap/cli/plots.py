"""The ``--plot`` pictures of ``casnap diff`` and ``casnap log``, drawn with matplotlib.

matplotlib is the optional ``plot`` extra (``pip install '.[plot]'`` in a checkout):
it is imported here only, and only when a picture is asked for, and drawn
with the Agg canvas on a ``Figure`` of its own (no pyplot, so no global
state and no display needed). What a picture shows is computed in
:mod:`casnap.cli.plot_data`; the PNG's text metadata records it under the
key ``casnap`` (JSON), so a script or a test can read which entries a
picture names without looking at it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from casnap.cli.common import human
from casnap.cli.plot_data import (
    STATUSES,
    DiffPicture,
    diff_rows,
    log_points,
    value_summary,
)
from casnap.format.entries import Entry
from casnap.ops.history import EntryDiff, LogLine

INSTALL = "pip install matplotlib (casnap's plot extra)"
FORMATS = (".png", ".svg", ".pdf")

# Okabe-Ito colours: told apart with the common colour-vision deficiencies.
COLORS = {
    "changed": "#0072B2",
    "no figure": "#E69F00",
    "added": "#009E73",
    "removed": "#D55E00",
    "unchanged": "#C8C8C8",
    "shared": "#9DB9D3",
}
LEGEND = {
    "changed": "changed",
    "no figure": "changed, no ratio (not numeric, reshaped, or ‖A‖ = 0)",
    "added": "added in B",
    "removed": "removed in B",
    "unchanged": "unchanged",
}
ROW_INCHES = 0.22  # one diff row: fits an 8 pt label with air around it
MAX_LABEL = 64  # characters; longer labels lose their middle


def problem(path: str) -> str | None:
    """Why ``--plot path`` cannot be drawn, in one line, or ``None``: checked before any
    work so a missing extra or a bad path never costs a diff's reads."""
    try:
        import matplotlib.backends.backend_agg  # noqa: F401
    except ImportError:
        return f"--plot needs matplotlib, which is not installed: {INSTALL}"
    if os.path.isdir(path):
        return f"--plot {path!r} is a directory; name a file in it"
    if os.path.splitext(path)[1].lower() not in FORMATS:
        return f"--plot {path!r}: the file name must end in {', '.join(FORMATS)}"
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        return f"--plot {path!r}: no directory {parent!r}"
    return None


def _figure(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Any, path: str, title: str, record: dict[str, Any]) -> None:
    # Only PNG takes free-form text keys; SVG and PDF keep the title.
    png = path.lower().endswith(".png")
    meta = {"Title": title}
    if png:
        meta["casnap"] = json.dumps(record)
    fig.savefig(path, metadata=meta)


def _shorten(label: str, limit: int = MAX_LABEL) -> str:
    """``label`` with its middle replaced by "…" when longer than ``limit``: both ends name it."""
    if len(label) <= limit:
        return label
    half = (limit - 1) // 2
    return label[:half] + "…" + label[-(limit - 1 - half) :]


def _log_scale(values: Sequence[float]) -> bool:
    """A log axis when the positive values span two decades or more."""
    positive = [v for v in values if v > 0 and math.isfinite(v)]
    return len(positive) >= 2 and max(positive) >= 100 * min(positive)


def write_diff_plot(
    path: str,
    rows: Sequence[EntryDiff],
    entries_a: Mapping[str, Entry],
    entries_b: Mapping[str, Entry],
    title: str,
) -> DiffPicture:
    """Draw which entries moved from A to B and by how much; returns what was drawn.

    One horizontal bar per entry (or per module when there are more than
    :data:`casnap.cli.plot_data.MAX_ROWS`), top to bottom in the model's order,
    its length the relative change ‖B−A‖/‖A‖ over the changed chunks, on a
    log axis when the values span two decades. A narrow strip on the left
    colours each row by status (for a group: the share of each status)::

        rows = repo.diff("step_1", "step_2", stats=True)
        write_diff_plot("drift.png", rows, repo.show("step_1").entries,
                        repo.show("step_2").entries, "step_1 → step_2")
    """
    picture = diff_rows(rows, entries_a, entries_b)
    shown = picture.rows
    grouped = picture.grouping != "entry"
    n = max(len(shown), 1)
    notes = len(picture.top) + 1 if grouped and picture.top else 0
    fig = _figure(11.0, 1.9 + ROW_INCHES * n + 0.17 * notes)
    strip, main = fig.subplots(1, 2, sharey=True, gridspec_kw={"width_ratios": [1, 10]})
    y = list(range(len(shown)))
    left = [0.0] * len(shown)
    for status in STATUSES:
        share = [r.counts[status] / len(r.keys) for r in shown]
        if any(share):
            strip.barh(y, share, left=left, height=0.8, color=COLORS[status], label=LEGEND[status])
        left = [a + b for a, b in zip(left, share)]
    strip.set_xlim(0, 1)
    strip.set_xticks([])
    strip.set_xlabel("status")
    strip.set_yticks(y, [_shorten(r.label) for r in shown], fontsize=8)
    strip.set_ylim(len(shown) - 0.5, -0.5)  # model order, top to bottom
    for side in ("top", "right", "bottom"):
        strip.spines[side].set_visible(False)
    values = [r.rel_l2 for r in shown if r.rel_l2 is not None]
    log = _log_scale(values)
    base = 10 ** math.floor(math.log10(min(values))) if log else 0.0
    for i, r in enumerate(shown):
        if r.rel_l2 is not None:
            main.barh(i, r.rel_l2 - base, left=base, height=0.8, color=COLORS["changed"])
            main.text(r.rel_l2, i, f" {r.rel_l2:.2g}", va="center", fontsize=7, color="#333333")
    if log:
        main.set_xscale("log")
        main.set_xlim(base, max(values) * 4)
    elif values:
        main.set_xlim(0, max(values) * 1.15)
    else:
        main.set_xlim(0, 1)
        main.text(
            0.5,
            (len(shown) - 1) / 2,
            "no entry has a relative change to draw",
            ha="center",
            va="center",
            color="#555555",
        )
    what = "largest relative change in the group" if grouped else "relative change"
    main.set_xlabel(
        f"{what}  $\\|B-A\\|\\,/\\,\\|A\\|$  over the changed chunks"
        + ("  (log scale)" if log else "")
    )
    main.grid(axis="x", alpha=0.3)
    main.tick_params(axis="y", length=0)
    main.spines[["top", "right"]].set_visible(False)
    # The counts the text prints (values, not containers); "no figure" is part of "changed".
    no_figure = sum(r.counts["no figure"] for r in shown)
    how = (
        "one row per entry" if not grouped else f"{len(shown)} rows: grouped by {picture.grouping}"
    )
    under = f" under {picture.prefix}" if picture.prefix else ""
    heading = value_summary(rows, under) + (
        f" ({no_figure} changed with no figure)" if no_figure else ""
    )
    heading += f"; {how}, model order"
    fig.suptitle(f"casnap diff {_shorten(title, 120)}\n{heading}", fontsize=10)
    # Above the bars, attached to an axes: constrained layout then keeps it clear of the
    # title and of the note below (a figure legend "outside" overlaps the suptitle).
    handles, names = strip.get_legend_handles_labels()
    main.legend(
        handles,
        names,
        loc="lower center",
        bbox_to_anchor=(0.45, 1.0),
        ncols=3,
        fontsize=8,
        frameon=False,
    )
    if notes:
        fig.supxlabel(
            "largest relative changes:\n"
            + "\n".join(f"{_shorten(k[len(picture.prefix) :])}  {v:.3g}" for k, v in picture.top),
            fontsize=8,
            ha="left",
            x=0.02,
        )
    _save(
        fig,
        path,
        f"casnap diff {title}",
        {
            "kind": "diff",
            "summary": heading,
            "prefix": picture.prefix,
            "grouping": picture.grouping,
            "log_scale": log,
            "rows": [
                {
                    "label": r.label,
                    "keys": list(r.keys),
                    "rel_l2": r.rel_l2,
                    "counts": {s: c for s, c in r.counts.items() if c},
                }
                for r in shown
            ],
            "top": [list(kv) for kv in picture.top],
        },
    )
    return picture


_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def _binary_unit(largest: float) -> tuple[str, float]:
    power = 0
    while power < len(_UNITS) - 1 and largest >= 1024 ** (power + 1):
        power += 1
    return _UNITS[power], float(1024**power)


def write_log_plot(
    path: str, lines: Sequence[LogLine], metric: str | None, title: str
) -> dict[str, Any]:
    """Draw a run over time: stored bytes per snapshot split into added and shared (stacked
    bars), and ``metric`` from the metadata in a panel below; returns what was drawn.

    x is the step (or the order, see :func:`casnap.cli.plot_data.log_points`); NaN
    and infinite metric values are skipped and counted in the legend. A metric no
    snapshot has draws an empty panel (:func:`casnap.cli.plot_data.metric_names`
    lists those there are)::

        write_log_plot("run.png", repo.log(), "loss", "/ckpt/run1")
    """
    points, xkind = log_points(lines, metric)
    fig = _figure(10.0, 6.8 if metric else 4.4)
    axes = fig.subplots(2 if metric else 1, 1, sharex=True, squeeze=False)[:, 0]
    ax = axes[0]
    xs = [p.x for p in points]
    gaps = [b - a for a, b in zip(sorted(xs), sorted(xs)[1:]) if b > a]
    width = 0.8 * min(gaps) if gaps else 0.8
    unit, scale = _binary_unit(max((p.new_bytes + p.shared_bytes for p in points), default=0))
    new = [p.new_bytes / scale for p in points]
    shared = [p.shared_bytes / scale for p in points]
    ax.bar(xs, new, width, color=COLORS["changed"], label="added: bytes this snapshot added")
    ax.bar(
        xs,
        shared,
        width,
        bottom=new,
        color=COLORS["shared"],
        label="shared: bytes already stored by earlier snapshots",
    )
    ax.set_ylabel(f"stored bytes per snapshot ({unit})")
    # Headroom: a full bar must not look cut off (the stacked bars' bottoms are sticky
    # edges, so autoscaling alone puts the tallest bar at the frame).
    ax.set_ylim(0, max((a + b for a, b in zip(new, shared)), default=0) * 1.08 or 1)
    # Above the bars, never over them (constrained layout makes room for it).
    if points:
        ax.legend(fontsize=8, loc="lower left", bbox_to_anchor=(0, 1.0), ncols=2, frameon=False)
    else:
        ax.text(0.5, 0.5, "no snapshots", ha="center", va="center", transform=ax.transAxes)
        ax.set_xticks([])
    ax.grid(axis="y", alpha=0.3)
    record: dict[str, Any] = {
        "kind": "log",
        "x": xkind,
        "unit": unit,
        "snapshots": [p.name for p in points],
        "metric": metric,
    }
    if metric:
        mx = axes[1]
        good = [p for p in points if p.metric is not None and math.isfinite(p.metric)]
        skipped = [p.name for p in points if p.metric is not None and not math.isfinite(p.metric)]
        label = metric + (f"  ({len(skipped)} skipped)" if skipped else "")
        mx.plot(
            [p.x for p in good],
            [p.metric for p in good],
            marker="o",
            markersize=4,
            color="#D55E00",
            label=label,
        )
        if skipped:  # where they were, on the axis: a gap in the line alone is easy to miss
            mx.plot(
                [p.x for p in points if p.name in skipped],
                [0.0] * len(skipped),
                "x",
                color="#555555",
                clip_on=False,
                transform=mx.get_xaxis_transform(),
                label="NaN or infinite (not drawn)",
            )
        if _log_scale([p.metric for p in good if p.metric is not None]) and all(
            p.metric is not None and p.metric > 0 for p in good
        ):
            mx.set_yscale("log")
        mx.set_ylabel(metric)
        mx.legend(fontsize=8, loc="best", frameon=False)
        mx.grid(alpha=0.3)
        record.update(points=[[p.name, p.metric] for p in good], skipped=skipped)
    bottom = axes[-1]
    if xkind == "step":
        bottom.set_xlabel("step")
    else:
        bottom.set_xlabel("snapshot, oldest first (steps missing or repeated)")
        if len(points) <= 40:
            bottom.set_xticks(
                xs, [_shorten(p.name) for p in points], rotation=45, ha="right", fontsize=8
            )
    written = human(sum(p.new_bytes for p in points))
    fig.suptitle(
        f"casnap log {_shorten(title, 90)}: {len(points)} snapshots, {written} written in all",
        fontsize=10,
    )
    _save(fig, path, f"casnap log {title}", record)
    return record
