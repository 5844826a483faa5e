"""The repository's size on disk during a Checkpointer loop with retention (issue #11).

The issue's scenario: 6 saves of a 24 MiB state that changes every step, with
``RetentionPolicy(KeepLast(2), KeepBest(1, "loss"))``. Run twice in the same
process: with reclaim (the default) and with ``reclaim=False`` followed by a
``casnap gc`` with its default grace period (what retention did before). Prints
the size after each save and the ratio of the final sizes, as JSON lines.

    .venv/bin/python benchmarks/retention_disk.py [--saves 6] [--mib 24] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch

from casnap import Repository, StateDict
from casnap.api.checkpointer import Checkpointer
from casnap.ops.retention import KeepBest, KeepLast, RetentionPolicy


def disk_bytes(root: str) -> int:
    """What ``du --apparent-size`` counts: every file below ``root``."""
    total = 0
    for folder, _dirs, files in os.walk(root):
        total += sum(os.lstat(os.path.join(folder, f)).st_size for f in files)
    return total


def state(step: int, mib: int) -> StateDict:
    g = torch.Generator().manual_seed(step)
    return StateDict({f"w{i}": torch.randn(1 << 18, generator=g) for i in range(mib)})


def run(root: str, saves: int, mib: int, reclaim: bool) -> dict[str, object]:
    policy = RetentionPolicy(KeepLast(2), KeepBest(1, "loss"))
    ckpt = Checkpointer(root, 1, retention=policy, reclaim=reclaim)
    sizes = []
    for step in range(1, saves + 1):
        loss = 1.0 / step if step != 2 else 0.01  # step 2 stays the best
        ckpt.maybe_take(step, {"m": state(step, mib)}, metrics={"loss": loss})
        sizes.append(disk_bytes(root))
    gc_freed = None
    if not reclaim:
        gc_freed = Repository(root).gc().bytes_freed  # default grace period: 1 h
    return {
        "reclaim": reclaim,
        "kept": ckpt.snapshots(),
        "mib_after_each_save": [round(s / 2**20, 1) for s in sizes],
        "gc_freed_mib": None if gc_freed is None else round(gc_freed / 2**20, 1),
        "final_mib": round(disk_bytes(root) / 2**20, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=6)
    parser.add_argument("--mib", type=int, default=24)
    parser.add_argument("--workdir", default="bench-out/scratch")
    args = parser.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        os.environ["CASNAP_INDEX_DIR"] = os.path.join(tmp, "index")  # not the home directory
        results = [
            run(os.path.join(tmp, f"run-{flag}"), args.saves, args.mib, flag)
            for flag in (True, False)
        ]
    for r in results:
        print(json.dumps(r))
    with_reclaim, without = (float(r["final_mib"]) for r in results)  # type: ignore[arg-type]
    print(json.dumps({"final_size_ratio_reclaim_vs_refs_only": round(with_reclaim / without, 3)}))


if __name__ == "__main__":
    main()
