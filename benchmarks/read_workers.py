"""Cold restore time against the number of concurrent reads, next to torch.load.

    .venv/bin/python benchmarks/read_workers.py [--size-gib 1.0] [--repeats 4]
        [--workers 4,8,12] [--workdir bench-out/scratch]

Takes one state into a fresh repository and writes the same state with
torch.save, then, ``--repeats`` rounds, drops the page cache before each
step and restores it in place with ``CASNAP_IO_WORKERS`` set to each count,
and loads the torch.save file, and reads that file's bytes with one plain
read (the disk's floor for this many bytes). Rounds interleave the variants so that drift
of the machine hits all of them alike. Prints medians and ratios to torch.load.
This chose ``DEFAULT_READ_WORKERS`` (casnap/settings.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import suite_states as st
import torch
from harness import GiB, drop_page_cache, scratch_dir

from casnap import Snapshot, StateDict


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--size-gib", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--workers", default="4,8,12")
    p.add_argument("--workdir", default="bench-out/scratch")
    args = p.parse_args(argv)
    counts = [int(w) for w in args.workers.split(",")]
    size = int(args.size_gib * GiB)
    shapes = st.model_shapes(size, st.pick_hidden(size))
    with scratch_dir(args.workdir) as work:
        state = st.build(shapes)
        Snapshot.take(os.path.join(work, "repo", "s0"), {"model": StateDict(state)})
        torch.save(state, os.path.join(work, "t.pt"))
        del state
        target = {k: torch.empty(s) for k, s in shapes.items()}
        times: dict[str, list[float]] = {f"casnap, {n} readers": [] for n in counts}
        times["torch.load"] = []
        times["plain read of the .pt file"] = []  # the disk's floor for these bytes
        for _ in range(args.repeats):
            for name in times:
                why = drop_page_cache()
                if why:
                    print(f"page cache not dropped ({why}): figures are warm", file=sys.stderr)
                t0 = time.perf_counter()
                if name == "torch.load":
                    torch.load(os.path.join(work, "t.pt"), weights_only=True)
                elif name.startswith("plain read"):
                    with open(os.path.join(work, "t.pt"), "rb") as fh:
                        fh.read()
                else:
                    os.environ["CASNAP_IO_WORKERS"] = name.split(", ")[1].split()[0]
                    snap = Snapshot(os.path.join(work, "repo", "s0"))
                    snap.restore({"model": StateDict(target)})
                times[name].append(time.perf_counter() - t0)
        os.environ.pop("CASNAP_IO_WORKERS", None)
    base = statistics.median(times["torch.load"])
    print(f"cold restore of {args.size_gib} GiB, medians of {args.repeats}:")
    for name, samples in times.items():
        med = statistics.median(samples)
        print(f"  {name:26s} {med:6.3f} s  {med / base:5.2f}x torch.load")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
