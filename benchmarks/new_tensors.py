"""Restore into new tensors: this checkout against earlier revisions and torch.load, in one run.

    .venv/bin/python benchmarks/new_tensors.py [--baseline main ...] [--size-gib 1.0]
        [--repeats 2] [--rounds 5] [--warm] [--workdir bench-out/scratch]

A process that resumes and lets the restore allocate (an empty ``StateDict``),
issue #14 point 3. Takes the benchmark state once and ``torch.save``s it, then,
``--rounds`` times, runs a fresh process per variant (each ``--baseline``'s
``casnap/``, extracted with ``git archive``; this checkout's; ``torch.load`` of
the same state), alternating them so that drift of the machine hits all alike.
Each process does one untimed read (imports, first-call set-up) and then
``--repeats`` timed ones, each after dropping the page cache (as root; unless
``--warm``). Large allocations get fresh pages from the kernel, as in
benchmarks/dense_floor.py. Prints per variant the median wall time and the
median CPU time (user + sys of the process during the read, all threads): on
a shared 2-core machine the CPU time is the steadier of the two.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

_CHILD = r"""
import ctypes, json, resource, sys, time
ctypes.CDLL(None).mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: fresh pages, as in a new process
src, here, path, repeats, warm = sys.argv[1:6]
if src != "torch.load":
    sys.path.insert(0, src)
sys.path.insert(1, here)
import torch
import harness
import casnap

def read():
    if src == "torch.load":
        return torch.load(path, weights_only=True)
    fresh = casnap.StateDict({})
    casnap.Snapshot(path).restore({"model": fresh})
    return fresh

read()
wall, cpu = [], []
for _ in range(int(repeats)):
    if warm != "1":
        harness.drop_page_cache()
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    out = read()
    wall.append(time.perf_counter() - t0)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu.append(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime)
    del out
print(json.dumps({"casnap": casnap.__file__, "wall": wall, "cpu": cpu}))
"""


def _run(src: str, path: str, repeats: int, warm: bool) -> dict:
    from harness import run_child

    return run_child(_CHILD, src, HERE, path, str(repeats), "1" if warm else "0")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument(
        "--baseline",
        action="append",
        default=None,
        help="git revision to compare with (repeatable; default main)",
    )
    p.add_argument("--size-gib", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=2, help="timed reads per process")
    p.add_argument("--rounds", type=int, default=5, help="processes per variant, alternating")
    p.add_argument("--warm", action="store_true", help="keep the page cache")
    p.add_argument("--workdir", default=os.path.join(ROOT, "bench-out", "scratch"))
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    baselines = args.baseline or ["main"]
    sys.path.insert(0, HERE)
    import torch
    from harness import (
        GiB,
        drop_page_cache,
        fsync_path,
        make_state,
        revision_package,
        scratch_dir,
        transformer_shapes,
    )

    from casnap import Snapshot, StateDict

    cold = args.warm or drop_page_cache() is None
    with scratch_dir(args.workdir) as work, tempfile.TemporaryDirectory() as tmp:
        variants = {
            f"casnap {rev}": revision_package(rev, os.path.join(tmp, str(n)))
            for n, rev in enumerate(baselines)
        }
        variants["casnap (this checkout)"] = ROOT
        _d, _n, shapes = transformer_shapes(int(args.size_gib * GiB))
        state = make_state(shapes)
        snap = os.path.join(work, "repo", "s1")
        Snapshot.take(snap, {"model": StateDict(state)})
        pt = os.path.join(work, "state.pt")
        torch.save(state, pt)
        fsync_path(pt)
        del state
        wall: dict[str, list[float]] = {name: [] for name in [*variants, "torch.load"]}
        cpu: dict[str, list[float]] = {name: [] for name in wall}
        for _ in range(args.rounds):
            for name, src in [*variants.items(), ("torch.load", "torch.load")]:
                result = _run(src, pt if src == "torch.load" else snap, args.repeats, args.warm)
                wall[name] += result["wall"]
                cpu[name] += result["cpu"]
    med = {name: (statistics.median(wall[name]), statistics.median(cpu[name])) for name in wall}
    if args.json:
        print(json.dumps({"wall": wall, "cpu": cpu, "cold": not args.warm and cold}))
        return 0
    how = "warm" if args.warm else ("cold" if cold else "cold asked, page cache kept (not root)")
    print(
        f"restore of {args.size_gib} GiB into new tensors, {how}, medians of "
        f"{args.rounds} x {args.repeats} per variant:"
    )
    load = med["torch.load"][0]
    for name, (w, c) in med.items():
        print(
            f"  {name:28s} wall {w:6.3f} s (min {min(wall[name]):.3f})  cpu {c:6.3f} s  "
            f"{w / load:5.2f}x torch.load"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
