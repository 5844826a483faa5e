"""Where the restore of the newest of a delta series spends its CPU, per stage (#26).

    .venv/bin/python benchmarks/delta_stages.py [--size-mib 128] [--series 10]
        [--repeats 10] [--workdir bench-out/scratch] [--floor]

Builds the ``series`` scenario of benchmarks/delta.py (an fp32 table, 1% of
its rows scaled per snapshot) with deltas on and off, then restores the
newest snapshot in place ``--repeats`` times each, the on and off restores
alternating, with the read path's stages wrapped to add up their thread CPU
time (``time.thread_time``: the time a stage ran on a core, whatever else
runs on the machine) and wall time. Prints, per restore, the process CPU
and wall time and each stage's CPU and wall, and the on/off ratios. On a
shared machine the CPU figures are the steady ones; the wall of a stage
that waits (the ``rebuilds`` semaphore, the GIL) says how much it waited.

``--floor`` times, instead, each step of the two paths alone on one thread,
over the newest snapshot's own chunks and frames (median of ``--repeats``):
what the deltas-off path must do (map, hash, copy into the tensor) and what
a rebuild adds to it (fetch, decode, copy the changed pages, XOR). Their
sum over the off path's work is the ratio a restore would reach with no
overhead at all: no thread, GIL or Python cost beyond these calls.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from delta import _sparse_step, _table, _take
from harness import MiB, scratch_dir

import casnap
import casnap.chunks.read as read_mod
import casnap.chunks.rebuild as rebuild_mod
import casnap.format.delta as delta_mod
import casnap.restore.undo as undo_mod
from casnap.chunks.stored import frame_limit
from casnap.format import codec
from casnap.format.names import digest_of
from casnap.repo.repository import chunk_key

_CPU: collections.defaultdict[str, float] = collections.defaultdict(float)  # seconds
_WALL: collections.defaultdict[str, float] = collections.defaultdict(float)
_CALLS: collections.Counter[str] = collections.Counter()

# (module or class, attribute, label): the stages of the two in-place paths.
STAGES: list[tuple[Any, str, str]] = [
    (rebuild_mod, "fetch_chain", "delta frames fetched"),
    (rebuild_mod, "link_runs", "delta frames decoded"),
    (rebuild_mod, "fault_for_writing", "changed pages copied"),
    (delta_mod.DeltaRuns, "xor_into", "deltas XORed"),
    (rebuild_mod, "digest_of", "rebuilt chunk hashed"),
    (read_mod, "patch_in_place", "rebuild (all of the above)"),
    (read_mod, "decode_frame", "whole chunk verified (off)"),
    (undo_mod.TensorUndo, "_copy_in", "copied into the tensor"),
    (read_mod._Reader, "run", "worker, per chunk"),
]


def _wrap(owner: Any, name: str, label: str) -> None:
    inner: Callable[..., Any] = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return inner(*args, **kwargs)
        finally:
            _CPU[label] += time.thread_time() - c0
            _WALL[label] += time.perf_counter() - t0
            _CALLS[label] += 1

    setattr(owner, name, timed)


def _series(work: str, size_mib: int, series: int, delta: bool) -> torch.Tensor:
    state = _table(size_mib * MiB)
    session = casnap.Session()
    for i in range(series):
        if i:
            state, _ = _sparse_step(state, i)
        _take(f"{work}/s{i}", {"emb": state}, session, delta)
    return state


class _Steps:
    """Thread CPU seconds per named step, added up over calls (``--floor``)."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = {}

    def run(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        c0 = time.thread_time()
        out = fn(*args, **kwargs)
        self.cpu[name] = self.cpu.get(name, 0.0) + time.thread_time() - c0
        return out


def _floor_once(path: str, target: torch.Tensor) -> dict[str, float]:
    """Each step of the restore of ``path`` alone, on this thread, chunk after chunk:
    the deltas-off path's map, hash and copy, and what a chain's rebuild adds (on a
    private mapping, as the restore does). Seconds per step."""
    repo, manifest = casnap.Snapshot(path)._load()
    entry = manifest.entries["0/m/emb"]
    dst = target.data_ptr()
    steps = _Steps()
    at = 0
    for ref in entry.chunks:  # type: ignore[union-attr]
        chain = ref.chain()
        whole, links = chain[-1], chain[:-1]
        rebuilt = bool(links)
        frame = steps.run(
            "map", repo.store.map, chunk_key(whole.hash), frame_limit(whole), private=rebuilt
        )
        view = memoryview(frame)[codec.HEADER_SIZE :]
        if rebuilt:
            raws = steps.run("+ fetch the deltas", rebuild_mod.fetch_chain, repo, links)
            for raw, link in zip(raws, links, strict=True):
                runs = steps.run("+ decode", rebuild_mod.link_runs, raw, link)
                steps.run("+ copy the changed pages", rebuild_mod.fault_for_writing, view, runs)
                steps.run("+ XOR", runs.xor_into, view)
        if steps.run("hash", digest_of, view).hex() != ref.hash:
            raise SystemExit(f"{path}: chunk {ref.hash} did not rebuild")
        src = np.frombuffer(frame, np.uint8).ctypes.data  # read-only or private alike
        steps.run(
            "copy into the tensor", ctypes.memmove, dst + at, src + codec.HEADER_SIZE, len(view)
        )
        at += len(view)
        view.release()
    return steps.cpu


def _both_series(work: str, args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """The series with deltas ``on`` and ``off`` under ``work``: each one's newest state."""
    return {m: _series(f"{work}/{m}", args.size_mib, args.series, m == "on") for m in ("on", "off")}


def floor(args: argparse.Namespace) -> int:
    with scratch_dir(args.workdir) as work:
        newest = _both_series(work, args)
        target = torch.zeros_like(newest["on"])
        runs: dict[str, dict[str, list[float]]] = {"on": {}, "off": {}}
        for r in range(args.repeats + 1):
            for mode in ("on", "off"):
                steps = _floor_once(f"{work}/{mode}/s{args.series - 1}", target)
                if not torch.equal(target, newest[mode]):
                    raise SystemExit(f"{mode}: the steps did not reproduce the newest state")
                if r:
                    for k, v in steps.items():
                        runs[mode].setdefault(k, []).append(v)
    med = _report(runs, args, "each step alone on one thread", "ms of CPU per restore")
    if med is not None:
        on, off = sum(med["on"].values()), sum(med["off"].values())
        print(f"  on/off, the sums of the steps: {on / off:.2f}")
    return 0


def _report(
    runs: dict[str, dict[str, list[float]]], args: argparse.Namespace, what: str, unit: str
) -> dict[str, dict[str, float]] | None:
    """Print the medians of ``runs`` (seconds): as JSON with ``--json`` (then None), else
    as a table in milliseconds, returning the medians for the ratios below it."""
    med = {m: {k: statistics.median(v) for k, v in runs[m].items()} for m in runs}
    if args.json:
        print(json.dumps(med))
        return None
    print(
        f"{what}, newest of {args.series} snapshots, {args.size_mib} MiB, "
        f"medians of {args.repeats} ({unit}):"
    )
    for mode in ("on", "off"):
        print(f"  deltas {mode}:")
        for key, value in med[mode].items():
            print(f"    {key:40s} {value * 1e3:8.1f}")
    return med


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--size-mib", type=int, default=128)
    p.add_argument("--series", type=int, default=10)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--workdir", default="bench-out/scratch")
    p.add_argument("--json", action="store_true")
    p.add_argument("--floor", action="store_true", help="each step alone, on one thread")
    args = p.parse_args(argv)
    if args.floor:
        return floor(args)
    for owner, name, label in STAGES:
        _wrap(owner, name, label)
    runs: dict[str, dict[str, list[float]]] = {"on": {}, "off": {}}
    with scratch_dir(args.workdir) as work:
        newest = _both_series(work, args)
        target = {"emb": torch.zeros_like(newest["on"])}
        for r in range(args.repeats + 1):
            for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):
                target["emb"].zero_()
                for tally in (_CPU, _WALL, _CALLS):
                    tally.clear()
                t0, c0 = time.perf_counter(), time.process_time()
                snap = casnap.Snapshot(f"{work}/{mode}/s{args.series - 1}")
                snap.restore({"m": casnap.StateDict(target)})
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                if not torch.equal(target["emb"], newest[mode]):
                    raise SystemExit(f"{mode}: the restore did not reproduce the newest state")
                if r == 0:
                    continue  # first-call set-up
                got = runs[mode]
                got.setdefault("restore wall", []).append(wall)
                got.setdefault("restore cpu", []).append(cpu)
                for label in _CPU:
                    got.setdefault(f"{label} cpu", []).append(_CPU[label])
                    got.setdefault(f"{label} wall", []).append(_WALL[label])
    med = _report(runs, args, "restore", "ms per restore; stage wall adds up over threads")
    if med is not None:
        for key in ("restore wall", "restore cpu"):
            print(f"  on/off {key}: {med['on'][key] / med['off'][key]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
