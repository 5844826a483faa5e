"""What benchmarks/suite.py prints: the Markdown table, the targets, the PNG plot."""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Callable
from typing import Any

from harness import GiB, MiB, human_bytes, markdown_table

Payload = dict[str, Any]
PEER = "torch.save"
CASNAP = "casnap"
PEER_TITLES = {"torch.save": "torch.save/load"}


def versions() -> dict[str, str]:
    out = {}
    for dist in ("torch", "safetensors", "torchsnapshot", "casnap", "matplotlib"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "absent"
    return out


# -- reading results ---------------------------------------------------------------


def _entry(p: Payload, scenario: str, system: str) -> dict[str, Any] | None:
    entry: dict[str, Any] | None = p["results"].get(f"{scenario}|{system}")
    return entry


def seconds(p: Payload, scenario: str, system: str) -> float | None:
    e = _entry(p, scenario, system)
    return None if e is None or "median_s" not in e else float(e["median_s"])


def counter(p: Payload, scenario: str, system: str, name: str) -> int | None:
    e = _entry(p, scenario, system)
    return None if e is None or name not in e else int(e[name])


def samples(p: Payload, scenario: str, system: str, name: str) -> list[float]:
    e = _entry(p, scenario, system) or {}
    key = "samples_s" if name == "seconds" else name + "_samples"
    return list(e.get(key, []))


def series_totals(p: Payload, system: str) -> tuple[int, int, float] | None:
    """(bytes written over the series, bytes stored at its end, median s of takes 2..n)."""
    written = samples(p, "series", system, "bytes_written")
    if not written:
        return None
    secs = samples(p, "series", system, "seconds")
    rest = sorted(secs[1:]) or secs
    stored = counter(p, "series", system, "stored_bytes") or 0
    return int(sum(written)), stored, rest[len(rest) // 2]


# -- targets -----------------------------------------------------------------------


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def targets(p: Payload) -> list[dict[str, Any]]:
    """The lead's targets, each as value, limit and whether it is met (None: not measured)."""
    budget = p["args"]["memory_budget_mib"] * MiB
    out: list[dict[str, Any]] = []

    def add(name: str, value: float | None, limit: float, at_most: bool, shown: str) -> None:
        met = None if value is None else (value <= limit if at_most else value >= limit)
        shown = "scenario not run" if value is None else shown
        out.append({"target": name, "value": value, "limit": limit, "met": met, "shown": shown})

    v = _ratio(seconds(p, "take", CASNAP), seconds(p, "take", PEER))
    add("full take ≤ torch.save + fsync", v, 1.0, True, _x(v, "torch.save"))
    for sc, cache in (("restore", "cold"), ("restore-warm", "warm")):
        v = _ratio(seconds(p, sc, CASNAP), seconds(p, sc, PEER))
        add(f"restore ≤ torch.load ({cache} cache)", v, 1.0, True, _x(v, "torch.load"))
        v = _ratio(seconds(p, sc, CASNAP), seconds(p, sc, "torchsnapshot"))
        name = f"restore ≤ 1/3 of torchsnapshot's ({cache} cache)"
        add(name, v, 1 / 3, True, _x(v, "torchsnapshot"))
    v = _ratio(seconds(p, "retake", PEER), seconds(p, "retake", CASNAP))
    add("unchanged re-take ≥ 5× faster than torch.save", v, 5.0, False, _x(v, "faster"))
    v = _ratio(seconds(p, "frozen", PEER), seconds(p, "frozen", CASNAP))
    add("frozen-backbone take ≥ 3× faster than torch.save", v, 3.0, False, _x(v, "faster"))
    written = counter(p, "frozen", CASNAP, "bytes_written")
    changed = counter(p, "frozen", CASNAP, "changed_bytes")
    manifest = counter(p, "frozen", CASNAP, "manifest_bytes")
    need = None if changed is None or manifest is None else changed + manifest
    v = _ratio(written, need)
    shown = f"{_x(v, '')} ({human_bytes(written)} for {human_bytes(changed)} changed + "
    shown += f"{human_bytes(manifest)} manifest)"
    add("frozen-backbone bytes written ≤ 1.05 × (changed + manifest)", v, 1.05, True, shown)
    v = _ratio(seconds(p, "async-blocked", CASNAP), seconds(p, "take", CASNAP))
    add("async_take blocks ≤ 25% of a sync take", v, 0.25, True, _pct(v))
    for kind in ("take", "restore", "async"):
        extra = counter(p, f"rss-{kind}", CASNAP, "extra_bytes")
        v = _ratio(extra, budget)
        shown = f"{human_bytes(extra)} = {_x(v, 'budget')} ({human_bytes(budget)})"
        add(f"peak RSS above live state, {kind} ≤ budget + 10%", v, 1.10, True, shown)
    read = counter(p, "read_object", CASNAP, "read_bytes")
    args = p["args"]
    info = p["info"].get("read_object", {})
    v = None if read is None else read / MiB
    name = f"read_object of {human_bytes(info.get('tensor_bytes', args['read_tensor_mib'] * MiB))}"
    name += f" from {human_bytes(info.get('snapshot_bytes', int(args['read_size_gib'] * GiB)))}"
    add(name + " reads ≤ 17 MiB", v, 17.0, True, f"{human_bytes(read)} from disk")
    raw = p["info"].get("bf16", {}).get("raw_bytes")
    v = _ratio(counter(p, "bf16", CASNAP, "bytes_written"), raw)
    add("bf16 weights stored ≤ 0.75 × raw (compression on)", v, 0.75, True, _x(v, "raw"))
    return out


def _x(v: float | None, what: str) -> str:
    return "not measured" if v is None else f"{v:.2f}× {what}".rstrip()


def _pct(v: float | None) -> str:
    return "not measured" if v is None else f"{100 * v:.0f}%"


# -- the table ---------------------------------------------------------------------

Cell = Callable[[Payload, str], float | None]


def _rows(p: Payload) -> list[tuple[str, str, Cell, str]]:
    """(scenario, metric, value of a system, unit) in table order."""
    info = p["info"]

    def sec(sc: str) -> Cell:
        return lambda q, s: seconds(q, sc, s)

    def cnt(sc: str, name: str) -> Cell:
        return lambda q, s: _float(counter(q, sc, s, name))

    def share(sc: str) -> str:
        i = info.get(sc, {})
        if not i.get("state_bytes"):
            return ""
        pct = 100 * i["changed_bytes"] / i["state_bytes"]
        return f" ({human_bytes(i['changed_bytes'])} changed, {pct:.2f}%)"

    rows: list[tuple[str, str, Cell, str]] = [
        ("full take (durable)", "median", sec("take"), "s"),
        ("full take (durable)", "bytes written", cnt("take", "bytes_written"), "B"),
        ("restore (cold cache)", "median", sec("restore"), "s"),
        ("restore (warm cache)", "median", sec("restore-warm"), "s"),
    ]
    labels = {
        "retake": "re-take, unchanged",
        "frozen": "frozen backbone, top layers trained",
        "lora": "LoRA adapters on a frozen base",
        "sparse": "sparse: 1% of embedding rows",
        "all": "all parameters change",
    }
    for sc, label in labels.items():
        rows.append((label + share(sc), "median", sec(sc), "s"))
        rows.append((label, "bytes written", cnt(sc, "bytes_written"), "B"))
    ser = info.get("series", {})
    n = ser.get("snapshots", "n")
    title = f"{n} successive snapshots ({ser.get('pattern', '')})"
    rows += [
        (title, "bytes written", lambda q, s: _pick(series_totals(q, s), 0), "B"),
        (title, "bytes stored", lambda q, s: _pick(series_totals(q, s), 1), "B"),
        (title, "median s of takes 2..n", lambda q, s: _pick(series_totals(q, s), 2), "s"),
        ("async take", "blocked (until it returns)", sec("async-blocked"), "s"),
        ("async take", "until durable", sec("async-total"), "s"),
        ("peak RSS above live state", "take", cnt("rss-take", "extra_bytes"), "B"),
        ("peak RSS above live state", "restore", cnt("rss-restore", "extra_bytes"), "B"),
        ("peak RSS above live state", "async take", cnt("rss-async", "extra_bytes"), "B"),
    ]
    ro = info.get("read_object", {})
    title = (
        f"read one {human_bytes(ro.get('tensor_bytes'))} tensor of "
        f"{human_bytes(ro.get('snapshot_bytes'))}"
    )
    rows += [
        (title, "bytes read from disk", cnt("read_object", "read_bytes"), "B"),
        (title, "median (cold)", sec("read_object"), "s"),
    ]
    raw = info.get("bf16", {}).get("raw_bytes")
    stored: Cell = lambda q, s: _ratio(_float(counter(q, "bf16", s, "bytes_written")), raw)  # noqa: E731
    rows.append((f"bf16 weights ({human_bytes(raw)})", "stored ÷ raw", stored, "×"))
    return rows


def _float(v: int | None) -> float | None:
    return None if v is None else float(v)


def _pick(t: tuple[int, int, float] | None, i: int) -> float | None:
    return None if t is None else float(t[i])


def _fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "–"
    return human_bytes(int(v)) if unit == "B" else f"{v:.3f}"


def table(p: Payload) -> str:
    systems = list(p["systems"])
    headers = ["scenario", "metric", *(PEER_TITLES.get(s, s) for s in systems)]
    show_ratio = PEER in systems and CASNAP in systems
    if show_ratio:
        headers.append("casnap ÷ torch")
    rows = []
    for scenario, metric, cell, unit in _rows(p):
        values = [cell(p, s) for s in systems]
        if all(v is None for v in values):
            continue
        row = [scenario, f"{metric} ({unit})" if unit in ("s", "×") else metric]
        row += [_fmt(v, unit) for v in values]
        if show_ratio:
            r = _ratio(cell(p, CASNAP), cell(p, PEER))
            row.append("" if unit == "×" or r is None else f"{r:.2f}×")
        rows.append(row)
    return markdown_table(headers, rows)


def markdown(p: Payload) -> str:
    m, s = p["machine"], p["info"]["state"]
    v = p["versions"]
    lines = [
        "# casnap suite",
        "",
        f"`{p['command']}`",
        "",
        f"State: {s['tensors']} fp32 tensors, {human_bytes(s['bytes'])} (hidden {s['hidden']}, "
        f"{s['layers']} layers, 32k vocab). Medians of {p['args']['repeats']}; "
        f"{p['cache']} page cache; {p['scratch']['fstype']}; {m.get('cpus')} cores; "
        f"torch {v['torch']}, safetensors {v['safetensors']}, torchsnapshot "
        f"{v['torchsnapshot']}, casnap {v['casnap']} ({m.get('casnap_commit', '?')[:9]}"
        f"{', dirty' if m.get('casnap_dirty') else ''}). "
        f"RSS probes: casnap memory budget {human_bytes(p['args']['memory_budget_mib'] * MiB)}. "
        f"Wall time {p['wall_seconds']:.0f} s; load average {p['loadavg']['start'][0]:.1f} "
        f"at the start, {p['loadavg']['end'][0]:.1f} at the end (2 cores: above 2, other "
        "processes shared the machine).",
        "",
        table(p),
        "",
        "Peers write a full file or folder for every snapshot; casnap takes successive "
        "snapshots into one repository. torch.save/safetensors restore into fresh tensors, "
        "DCP/torchsnapshot/casnap in place; safetensors' load_file maps the file, so its warm "
        "restore copies nothing (a model's load_state_dict would add the copy, as the RSS row "
        "shows). casnap's async_take reuses its staging buffers from the second take in a "
        "process on. Methods: benchmarks/README.md (suite.py).",
        "",
        "## Targets",
        "",
    ]
    for t in p["targets"]:
        mark = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
        lines.append(f"- {t['target']}: **{mark}** ({t['shown']})")
    lines += _delta_lines(p["info"].get("delta"))
    lines.append("")
    return "\n".join(lines)


def _delta_lines(d: dict[str, Any] | None) -> list[str]:
    """Issue #13's targets, from benchmarks/delta.py's figures (``--scenarios delta``)."""
    if not d:
        return []
    shown = {
        "sparse": (
            "sparse 1% rows: bytes written ≤ 3× changed",
            lambda r: (
                f"{r['on']['over_changed']:.2f}× changed, off {r['off']['over_changed']:.1f}×"
            ),
        ),
        "bf16": (
            "bf16 fine-tuned: bytes written ≤ 0.55 × raw",
            lambda r: f"{r['on']['over_raw']:.3f}× raw, off {r['off']['over_raw']:.3f}×",
        ),
        "series": (
            "restore of the newest of a series: deltas on ≤ 1.2 × off",
            lambda r: f"{r['restore_on_over_off']:.2f}×",
        ),
        "all": (
            "all parameters changed: take time on ≤ 1.0 × off",
            lambda r: f"{r['take_on_over_off']:.2f}×",
        ),
    }
    out = ["", "## Delta chunks (benchmarks/delta.py)", ""]
    for name, (what, fmt) in shown.items():
        if name in d:
            mark = "met" if d[name]["target"]["met"] else "NOT met"
            out.append(f"- {what}: **{mark}** ({fmt(d[name])})")
    return out


# -- the plot ----------------------------------------------------------------------

COLORS = {
    "torch.save": "#4c72b0",
    "safetensors": "#dd8452",
    "DCP": "#55a868",
    "torchsnapshot": "#c44e52",
    "casnap": "#8172b3",
}


def plot(p: Payload, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = list(p["systems"])
    fig, axes = plt.subplots(2, 3, figsize=(18, 9.5))
    times = ["take", "restore", "restore-warm", "retake", "frozen", "lora", "sparse", "all"]

    def sec(sc: str, s: str) -> float | None:
        return seconds(p, sc, s)

    def mib(name: str) -> Callable[[str, str], float | None]:
        return lambda sc, s: _mib(counter(p, sc, s, name))

    _bars(axes[0][0], systems, times, sec, "median seconds (lower is better)")
    written = ["take", "retake", "frozen", "lora", "sparse", "all"]
    _bars(axes[0][1], systems, written, mib("bytes_written"), "MiB written per snapshot (log)")
    ax = axes[0][2]
    for s in systems:
        ws = samples(p, "series", s, "bytes_written")
        if ws:
            total, acc = [], 0.0
            for w in ws:
                acc += w
                total.append(acc / GiB)
            ax.plot(range(1, len(total) + 1), total, marker="o", label=s, color=COLORS.get(s))
    ax.set_title(f"GiB on disk after n snapshots ({p['info'].get('series', {}).get('pattern')})")
    ax.set_xlabel("snapshots")
    if ax.lines:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "not run", ha="center", va="center", transform=ax.transAxes)
    with_async = [s for s in systems if seconds(p, "async-blocked", s) is not None]
    groups = ["async-blocked", "async-total", "take"]
    _bars(axes[1][0], with_async, groups, sec, "async take: blocked / until durable / sync (s)")
    groups = ["rss-take", "rss-restore", "rss-async"]
    _bars(axes[1][1], systems, groups, mib("extra_bytes"), "peak RSS above live state (MiB)")
    budget = p["args"]["memory_budget_mib"] * 1.1
    axes[1][1].axhline(
        budget, color="grey", linestyle="--", linewidth=1, label="casnap budget + 10%"
    )
    if axes[1][1].patches:
        axes[1][1].legend(fontsize=7)
    title = "read one tensor: MiB read from disk (log)"
    _bars(axes[1][2], systems, ["read_object"], mib("read_bytes"), title)
    fig.suptitle(
        f"casnap suite: {human_bytes(p['info']['state']['bytes'])} fp32 state, "
        f"{p['cache']} cache, medians of {p['args']['repeats']}"
    )
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _mib(v: int | None) -> float | None:
    return None if v is None else v / MiB


def _bars(
    ax: Any,
    systems: list[str],
    groups: list[str],
    value: Callable[[str, str], float | None],
    title: str,
) -> None:
    """Bars per group and system, on a log axis when the title says so."""
    log = title.endswith("(log)")
    width = 0.8 / max(1, len(systems))
    ax.set_title(title, fontsize=10)
    if all(value(sc, s) is None for sc in groups for s in systems):
        ax.text(0.5, 0.5, "not run", ha="center", va="center", transform=ax.transAxes)
        return
    for i, s in enumerate(systems):
        xs, ys = [], []
        for g, sc in enumerate(groups):
            v = value(sc, s)
            if v is not None:
                xs.append(g + (i - (len(systems) - 1) / 2) * width)
                ys.append(max(v, 1e-3) if log else v)
        ax.bar(xs, ys, width, label=s, color=COLORS.get(s))
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, fontsize=8)
    if log:
        ax.set_yscale("log")
    ax.legend(fontsize=7)
