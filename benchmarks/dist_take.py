"""4-rank take of a DDP model: casnap vs torch.distributed.checkpoint, same state, same run.

    .venv/bin/python benchmarks/dist_take.py [--ranks 4] [--mib 64] [--repeat 3]

Prints one JSON line: per-rank bytes written by casnap, and the median wall time
of a take (fresh directory each time, max over ranks) for casnap and DCP.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from harness import finish_rank, join_group, spawn_ranks


def _timed(fn: Any) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def worker(rank: int, world: int, out: str, mib: int, repeat: int) -> None:
    import torch.distributed.checkpoint as dcp

    from casnap import Snapshot

    join_group(rank, world, out)
    torch.manual_seed(0)
    layers = max(1, mib // 4)  # 1024x1024 float32 = 4 MiB each
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(layers)])
    )
    base = Path(out)
    casnap_times, dcp_times, per_rank = [], [], None
    for i in range(repeat):

        def take(i: int = i) -> None:
            nonlocal per_rank
            snap = Snapshot.take(str(base / f"casnap{i}" / "s"), {"model": model})
            per_rank = [s.raw_bytes_written for s in snap.last_take_rank_stats or []]

        casnap_times.append(_timed(take))
        dcp_times.append(
            _timed(
                lambda i=i: dcp.save(
                    {"model": model.state_dict()}, checkpoint_id=str(base / f"dcp{i}")
                )
            )  # fmt: skip
        )
    result = {
        "ranks": world, "model_mib": layers * 4,
        "casnap_bytes_per_rank": per_rank,
        "casnap_take_s": statistics.median(casnap_times),
        "dcp_save_s": statistics.median(dcp_times),
        "casnap_over_dcp": statistics.median(casnap_times) / statistics.median(dcp_times),
    }  # fmt: skip
    finish_rank(rank, out, result)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    result = spawn_ranks(worker, args.ranks, args.mib, args.repeat)
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
