"""A state of many small tensors: re-take time against torch.save.

    .venv/bin/python benchmarks/small_tensors.py [--tensors 5000] [--numel 256] [--repeats 5]
        [--workdir bench-out/scratch]

Per-chunk overheads (a future per chunk, a work item per chunk, building
and validating one manifest entry per tensor) decide this case, not
bandwidth: 5,000 tensors of 1 KiB are 5 MB. Takes the state once, then
``--repeats`` unchanged re-takes into the same repository (each one's parent
is the previous: the every-N-steps loop), against torch.save + fsync of the
same state. Prints medians and the ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from harness import scratch_dir

from casnap import Session, Snapshot, StateDict


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--tensors", type=int, default=5000)
    p.add_argument("--numel", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--workdir", default="bench-out/scratch")
    args = p.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    state = {f"layer{i}.weight": torch.randn(args.numel, generator=g) for i in range(args.tensors)}
    app = {"model": StateDict(state)}
    retake, save = [], []
    session = Session()  # one training process: each re-take's parent is the previous
    with scratch_dir(args.workdir) as work:
        t0 = time.perf_counter()
        Snapshot.take(os.path.join(work, "repo", "s0"), app, session=session)
        first = time.perf_counter() - t0
        for i in range(1, args.repeats + 1):
            t0 = time.perf_counter()
            Snapshot.take(os.path.join(work, "repo", f"s{i}"), app, session=session)
            retake.append(time.perf_counter() - t0)
            path = os.path.join(work, f"t{i}.pt")
            t0 = time.perf_counter()
            torch.save(state, path)
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
            save.append(time.perf_counter() - t0)
    r, s = statistics.median(retake), statistics.median(save)
    print(f"{args.tensors} tensors of {args.numel * 4} B, medians of {args.repeats}:")
    print(f"  casnap first take      {first:6.3f} s")
    print(f"  casnap unchanged take  {r:6.3f} s  {r / s:5.2f}x torch.save")
    print(f"  torch.save + fsync     {s:6.3f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
