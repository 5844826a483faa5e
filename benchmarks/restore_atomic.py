"""Warm in-place restore of this checkout against an earlier revision, in the same run.

    .venv/bin/python benchmarks/restore_atomic.py [--baseline main ...] [--size-gib 1.0]
        [--repeats 5] [--rounds 3] [--workdir bench-out/scratch]

What an all-or-nothing restore costs (docs/pipeline.md, "A failed restore"):
takes the benchmark state (benchmarks/harness.py) once, then, ``--rounds``
times, restores it in place into resident tensors from the page cache in a
fresh process per variant (each ``--baseline``'s ``casnap/``, extracted with
``git archive``, and this checkout's; ``--baseline`` may be repeated),
alternating the variants so that
drift of the machine hits both alike. Each process does one untimed restore
and then ``--repeats`` timed ones. Prints the median of every sample per
variant and the ratio to each baseline; ``--json`` writes them.
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
import json, resource, sys, time
sys.path.insert(0, sys.argv[1])
sys.path.insert(1, sys.argv[2])
import torch
import harness
import casnap
from casnap import Snapshot, StateDict
size, path, repeats = float(sys.argv[3]), sys.argv[4], int(sys.argv[5])
_d, _n, shapes = harness.transformer_shapes(int(size * harness.GiB))
target = {k: torch.zeros(s) for k, s in shapes.items()}
snap = Snapshot(path)
snap.restore({"model": StateDict(target)})  # untimed: warms the page cache and the imports
times = []
for _ in range(repeats):
    t0 = time.perf_counter()
    Snapshot(path).restore({"model": StateDict(target)})
    times.append(time.perf_counter() - t0)
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"casnap": casnap.__file__, "times": times, "max_rss": rss}))
"""


def _run(src: str, size: float, path: str, repeats: int) -> dict:
    from harness import run_child

    return run_child(_CHILD, src, HERE, str(size), path, str(repeats))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument(
        "--baseline",
        action="append",
        default=None,
        help="git revision to compare with (repeatable; default main)",
    )
    p.add_argument("--size-gib", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=5, help="timed restores per process")
    p.add_argument("--rounds", type=int, default=3, help="processes per variant, alternating")
    p.add_argument("--workdir", default=os.path.join(ROOT, "bench-out", "scratch"))
    p.add_argument("--json", default=None, help="write every sample here")
    args = p.parse_args(argv)
    baselines = args.baseline or ["main"]
    sys.path.insert(0, HERE)
    import torch  # noqa: F401  (after argparse: --help stays fast)
    from harness import GiB, make_state, revision_package, scratch_dir, transformer_shapes

    from casnap import Snapshot, StateDict

    with scratch_dir(args.workdir) as work, tempfile.TemporaryDirectory() as tmp:
        variants = {
            f"baseline ({rev})": revision_package(rev, os.path.join(tmp, str(n)))
            for n, rev in enumerate(baselines)
        }
        variants["this checkout"] = ROOT
        _d, _n, shapes = transformer_shapes(int(args.size_gib * GiB))
        path = os.path.join(work, "repo", "s1")
        Snapshot.take(path, {"model": StateDict(make_state(shapes))})
        samples: dict[str, list[float]] = {name: [] for name in variants}
        rss: dict[str, list[int]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, src in variants.items():
                result = _run(src, args.size_gib, path, args.repeats)
                assert result["casnap"].startswith(src), result["casnap"]
                samples[name] += result["times"]
                rss[name].append(result["max_rss"])
    medians = {name: statistics.median(s) for name, s in samples.items()}
    new = medians["this checkout"]
    print(
        f"warm in-place restore of {args.size_gib} GiB, median of "
        f"{args.rounds} x {args.repeats} per variant:"
    )
    for name, med in medians.items():
        lo, hi = min(samples[name]), max(samples[name])
        print(
            f"  {name:24s} {med:6.3f} s  (min {lo:.3f}, max {hi:.3f}), "
            f"max RSS {max(rss[name]) / GiB:.2f} GiB"
        )
    for rev in baselines:
        print(f"  ratio this/baseline ({rev}): {new / medians[f'baseline ({rev})']:.3f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"samples": samples, "max_rss": rss, "medians": medians}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
