"""casnap take/restore against torch.save/load and torch.distributed.checkpoint, in one run.

    .venv/bin/python benchmarks/take_restore.py [--size-gib 1.0] [--repeats 3]
        [--out bench-out/take_restore.json] [--workdir bench-out/scratch] [--warm]

One fp32 transformer-shaped state dict is built once; every tool saves and
loads it ``--repeats`` times, each into a fresh directory under ``--workdir``
(a real disk, never tmpfs). Before every timed step dirty pages are written
back and, unless ``--warm`` or not permitted, the page cache is dropped, so
"cold" reads come from the disk. Medians are printed as a Markdown table with
ratios against the peer measured in the same run (torch.save + fsync for
writes, torch.load with the same cache state for reads) and written as JSON.
See benchmarks/README.md for how to read the numbers.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from dataclasses import dataclass
from time import perf_counter as _now
from typing import Any

import torch
from harness import (
    GiB,
    Samples,
    disk_usage,
    drop_page_cache,
    empty_like_state,
    filesystem_of,
    fsync_path,
    human_bytes,
    machine,
    make_state,
    markdown_table,
    same_state,
    scratch_dir,
    settle,
    state_bytes,
    transformer_shapes,
    write_json,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

import casnap

# Operation names, in table order. A write's peer is torch.save + fsync; a read's
# peer is torch.load in the same cache state.
SAVE = "torch.save (no fsync)"
SAVE_SYNC = "torch.save + fsync"
LOAD = "torch.load"
DCP_SAVE = "DCP save"
DCP_LOAD = "DCP load (in place)"
TAKE = "casnap take (new repository)"
TAKE_SAME = "casnap take, unchanged state (2nd snapshot)"
TAKE_LAYER = "casnap take, one layer changed"
RESTORE = "casnap restore (in place)"
RESTORE_FRESH = "casnap restore (fresh tensors)"


@dataclass(frozen=True)
class Setup:
    state: dict[str, torch.Tensor]
    changed: dict[str, torch.Tensor]  # the state with every tensor of layer 0 replaced
    target: dict[str, torch.Tensor]  # pre-allocated, resident: where in-place loads land
    cold: bool  # the page cache is dropped before each timed step
    verify: bool


def cached(op: str, s: Setup, warm: bool = False) -> str:
    return f"{op}, {'warm' if warm or not s.cold else 'cold'}"


def bench_torch(s: Setup, work: str, rec: Samples) -> None:
    path = os.path.join(work, "model.pt")
    settle(s.cold)
    t0 = _now()
    torch.save(s.state, path)
    t1 = _now()
    fsync_path(path)
    t2 = _now()
    rec.add(SAVE, t1 - t0)
    rec.add(SAVE_SYNC, t2 - t0)
    used, apparent, _ = disk_usage(work)
    rec.count(SAVE_SYNC, "bytes_written", apparent)
    rec.count(SAVE_SYNC, "disk_growth", used)
    for warm in [False, True] if s.cold else [False]:
        if not warm:
            settle(s.cold)
        loaded = rec.time(cached(LOAD, s, warm), lambda: torch.load(path, weights_only=True))
        _check(s, loaded, LOAD)
        del loaded
    os.remove(path)


def bench_dcp(s: Setup, work: str, rec: Samples) -> None:
    path = os.path.join(work, "dcp")
    settle(s.cold)
    rec.time(DCP_SAVE, lambda: dcp_save(s.state, checkpoint_id=path))
    used, apparent, _ = disk_usage(path)
    rec.count(DCP_SAVE, "bytes_written", apparent)
    rec.count(DCP_SAVE, "disk_growth", used)
    for warm in [False, True] if s.cold else [False]:
        _reset(s)
        if not warm:
            settle(s.cold)
        rec.time(cached(DCP_LOAD, s, warm), lambda: dcp_load(s.target, checkpoint_id=path))
        _check(s, s.target, DCP_LOAD)


def _objects_usage(repo: str) -> tuple[int, int]:
    """(du, apparent) of the chunk and pack objects of the repository at ``repo``."""
    used = apparent = 0
    for sub in ("chunks", "packs"):
        u, a, _ = disk_usage(os.path.join(repo, ".casnap", sub))
        used, apparent = used + u, apparent + a
    return used, apparent


def _take(rec: Samples, op: str, s: Setup, path: str, state: dict[str, torch.Tensor]) -> None:
    repo = os.path.dirname(path)
    before, _ = _objects_usage(repo)
    settle(s.cold)
    snap = rec.time(op, lambda: casnap.Snapshot.take(path, {"model": casnap.StateDict(state)}))
    after, _ = _objects_usage(repo)
    stats = snap.last_take_stats
    rec.count(op, "bytes_written", stats.stored_bytes_written)
    rec.count(op, "raw_bytes_written", stats.raw_bytes_written)
    rec.count(op, "chunks_written", stats.chunks_written)
    rec.count(op, "objects_written", stats.objects_written)
    rec.count(op, "disk_growth", after - before)


def bench_casnap(s: Setup, work: str, rec: Samples) -> None:
    repo = os.path.join(work, "repo")
    step1 = os.path.join(repo, "step_1")
    _take(rec, TAKE, s, step1, s.state)
    for warm in [False, True] if s.cold else [False]:
        _reset(s)
        if not warm:
            settle(s.cold)
        op = cached(RESTORE, s, warm)
        rec.time(op, lambda: casnap.Snapshot(step1).restore({"model": casnap.StateDict(s.target)}))
        _check(s, s.target, RESTORE)

    def restore_fresh() -> dict[str, Any]:
        fresh = {"model": casnap.StateDict(empty_like_state(s.state, touch=False))}
        casnap.Snapshot(step1).restore(fresh)
        return fresh

    settle(s.cold)
    restored = rec.time(cached(RESTORE_FRESH, s), restore_fresh)
    _check(s, restored["model"], RESTORE_FRESH)
    restored.clear()
    _take(rec, TAKE_SAME, s, os.path.join(repo, "step_2"), s.state)
    _take(rec, TAKE_LAYER, s, os.path.join(repo, "step_3"), s.changed)


def _reset(s: Setup) -> None:
    if s.verify:
        for t in s.target.values():
            t.zero_()


def _check(s: Setup, got: dict[str, torch.Tensor], what: str) -> None:
    if s.verify and not same_state(s.state, dict(got)):
        raise SystemExit(f"{what} did not reproduce the saved state")


# -- report ------------------------------------------------------------------

WRITES = [SAVE, SAVE_SYNC, DCP_SAVE, TAKE, TAKE_SAME, TAKE_LAYER]


def table(rec: Samples, nbytes: int, cold: bool) -> str:
    states = ["cold", "warm"] if cold else ["warm"]
    reads = [f"{op}, {c}" for c in states for op in (LOAD, DCP_LOAD, RESTORE)]
    reads.append(f"{RESTORE_FRESH}, {states[0]}")
    rows = [_row(rec, op, nbytes, rec.median(SAVE_SYNC), SAVE_SYNC) for op in WRITES]
    for op in reads:
        peer = f"{LOAD}, {op.rsplit(', ', 1)[1]}"
        rows.append(_row(rec, op, nbytes, rec.median(peer), peer))
    headers = [
        "operation",
        "median s",
        "min–max s",
        "GiB/s",
        "× peer",
        "peer",
        "bytes written",
        "disk growth",
    ]
    return markdown_table(headers, rows)


def _row(rec: Samples, op: str, nbytes: int, peer_s: float, peer: str) -> list[str]:
    med = rec.median(op)
    xs = rec.seconds[op]
    return [
        op,
        f"{med:.3f}",
        f"{min(xs):.3f}–{max(xs):.3f}",
        f"{nbytes / GiB / med:.2f}",
        f"{med / peer_s:.2f}",
        peer if peer != op else "(peer)",
        human_bytes(rec.counter(op, "bytes_written")),
        human_bytes(rec.counter(op, "disk_growth")),
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-gib", type=float, default=1.0, help="state size (default 1.0)")
    p.add_argument("--repeats", type=int, default=3, help="repeats per operation (median)")
    p.add_argument("--out", default="bench-out/take_restore.json")
    p.add_argument(
        "--workdir",
        default="bench-out/scratch",
        help="parent of the scratch directories (must be a real disk)",
    )
    p.add_argument("--warm", action="store_true", help="never drop the page cache")
    p.add_argument("--no-verify", action="store_true", help="skip the bit-exact checks")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", module=r"torch\.distributed")

    d, layers, shapes = transformer_shapes(int(args.size_gib * GiB))
    state = make_state(shapes, seed=0)
    nbytes = state_bytes(state)
    layer0 = {k: v for k, v in make_state(shapes, seed=1).items() if k.startswith("layers.0.")}
    changed = {**state, **layer0}
    why_warm = "--warm given" if args.warm else drop_page_cache()
    cold = why_warm is None
    setup = Setup(state, changed, empty_like_state(state, touch=True), cold, not args.no_verify)
    mnt, fstype = filesystem_of(os.path.abspath(args.workdir))
    print(
        f"state: {len(state)} fp32 tensors, {human_bytes(nbytes)} (hidden {d}, {layers} layers, "
        f"vocab {shapes['embed.weight'][0]}); layer 0 = "
        f"{human_bytes(state_bytes(layer0))}"
    )
    reads = "cold (page cache dropped before each step)" if cold else f"warm: {why_warm}"
    print(f"scratch: {os.path.abspath(args.workdir)} on {fstype} ({mnt}); reads: {reads}")
    print(
        f"repeats: {args.repeats}; torch {torch.__version__}, casnap {casnap.__version__}",
        flush=True,
    )

    rec = Samples()
    for r in range(args.repeats):
        for name, bench in (("torch", bench_torch), ("dcp", bench_dcp), ("casnap", bench_casnap)):
            with scratch_dir(args.workdir) as work:
                bench(setup, work, rec)
            print(f"  repeat {r + 1}/{args.repeats}: {name} done", file=sys.stderr, flush=True)
        setup = Setup(state, changed, setup.target, cold, False)  # verify the first repeat only

    print()
    print(table(rec, nbytes, cold))
    payload = {
        "benchmark": "take_restore",
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "machine": machine(),
        "state": {
            "bytes": nbytes,
            "tensors": len(state),
            "hidden": d,
            "layers": layers,
            "vocab": shapes["embed.weight"][0],
            "dtype": "float32",
            "layer0_bytes": state_bytes(layer0),
        },
        "scratch": {"path": os.path.abspath(args.workdir), "fstype": fstype, "mount": mnt},
        "cache": "cold" if cold else "warm",
        "cache_note": None if cold else why_warm,
        "repeats": args.repeats,
        "peers": {"write": SAVE_SYNC, "read": f"{LOAD} in the same cache state"},
        "results": rec.as_json(),
    }
    write_json(args.out, payload)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
