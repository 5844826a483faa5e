"""What reclaiming after retention costs per Checkpointer commit (docs/gc.md).

A Checkpointer with ``KeepLast(KEEP)`` runs until the repository holds KEEP
snapshots and one is retired per commit; each commit's reclaim time
(``last_retention.reclaimed.seconds``) is recorded, and compared with one full
gc plan of the same repository.

    .venv/bin/python benchmarks/reclaim_cost.py [--keep 20] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch

from casnap import Repository, StateDict
from casnap.api.checkpointer import Checkpointer
from casnap.gc.collect import plan_gc
from casnap.ops.retention import KeepLast, RetentionPolicy


def state(step: int) -> StateDict:
    """4 MiB of loose chunks and 256 KiB of packed ones, all new every step."""
    g = torch.Generator().manual_seed(step)
    big = {f"big{i}": torch.randn(1 << 18, generator=g) for i in range(4)}
    small = {f"small{i}": torch.randn(4096, generator=g) for i in range(16)}
    return StateDict({**big, **small})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=int, default=20)
    parser.add_argument("--commits", type=int, default=40, help="measured commits")
    parser.add_argument("--workdir", default="bench-out/scratch")
    args = parser.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    work = tempfile.mkdtemp(dir=args.workdir)
    os.environ.setdefault("CASNAP_INDEX_DIR", os.path.join(work, "index"))
    try:
        root = os.path.join(work, "run")
        ckpt = Checkpointer(root, 1, retention=RetentionPolicy(KeepLast(args.keep)))
        commits, reclaims = [], []
        for step in range(1, args.keep + args.commits + 1):
            started = time.perf_counter()
            ckpt.maybe_take(step, {"m": state(step)})
            elapsed = time.perf_counter() - started
            result = ckpt.last_retention.reclaimed if ckpt.last_retention else None
            if step > args.keep + 1 and result is not None:
                commits.append(elapsed)
                reclaims.append(result.seconds)
        started = time.perf_counter()
        plan_gc(Repository(root).storage, grace_seconds=0)
        full = time.perf_counter() - started
        index = "off" if os.environ.get("CASNAP_INDEX") == "0" else "on"
        print(
            "| snapshots | index | take+retention+reclaim (median) | reclaim (median) "
            "| reclaim (max) | one full gc plan |"
        )
        print("|---|---|---|---|---|---|")
        print(
            f"| {len(ckpt.snapshots())} | {index} | {1e3 * statistics.median(commits):.1f} ms "
            f"| {1e3 * statistics.median(reclaims):.1f} ms | {1e3 * max(reclaims):.1f} ms "
            f"| {1e3 * full:.1f} ms |"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
