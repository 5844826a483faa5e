"""4-rank take of a DDP model: casnap vs torch.distributed.checkpoint, same state, same run.

    .venv/bin/python benchmarks/dist_take.py [--ranks 4] [--mib 64] [--repeat 7]
        [--mode both|fresh|series]

Each repeat times one casnap take and one DCP save (``sync_files=True``) of the same DDP
state back to back, a barrier before and after each (the slowest rank's time). ``fresh``:
every take into a new repository; ``series``: into one through one ``Session``, every
weight changed before each take (the first is a warm-up, not counted). Prints one JSON
line per mode: casnap's bytes per rank and their max/mean, the median take and save, the
median of the paired per-repeat ratios, and the median CPU time of all ranks together.
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


def _timed(fn: Any) -> tuple[float, float]:
    """Wall seconds from a barrier before ``fn`` to one after it (the slowest rank's
    time), and the CPU seconds this rank's process spent in ``fn`` (all threads)."""
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    cpu = time.process_time() - c0
    dist.barrier()
    return time.perf_counter() - t0, cpu


def _run_mode(mode: str, model: Any, base: Path, repeat: int) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from casnap import Session, Snapshot

    series = mode == "series"
    session = Session() if series else None
    casnap_times, dcp_times, per_rank = [], [], None
    cpu: list[tuple[float, float]] = []  # this rank's (casnap, DCP) CPU seconds per repeat
    for i in range(repeat + series):  # a series has a warm-up round
        if series:
            with torch.no_grad():  # every chunk changes, as after a training step
                for p in model.parameters():
                    p.add_(1.0)
        path = base / mode / "repo" / f"step{i}" if series else base / mode / f"r{i}" / "s"

        def take(path: Path = path) -> None:
            nonlocal per_rank
            snap = Snapshot.take(str(path), {"model": model}, session=session)
            per_rank = [s.raw_bytes_written for s in snap.last_take_rank_stats or []]

        def save(i: int = i) -> None:
            folder = str(base / mode / f"dcp{i}")
            writer = FileSystemWriter(folder, sync_files=True)
            dcp.save({"model": model.state_dict()}, storage_writer=writer)

        (c, c_cpu), (d, d_cpu) = _timed(take), _timed(save)
        if series and i == 0:
            continue  # warm-up: creates the repository and its index
        casnap_times.append(c)
        dcp_times.append(d)
        cpu.append((c_cpu, d_cpu))
    assert per_rank
    ranks_cpu: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks_cpu, cpu)
    casnap_cpu = [sum(r[k][0] for r in ranks_cpu) for k in range(len(cpu))]
    dcp_cpu = [sum(r[k][1] for r in ranks_cpu) for k in range(len(cpu))]
    return {
        "casnap_bytes_per_rank": per_rank,
        "max_over_mean_bytes": max(per_rank) / statistics.mean(per_rank),
        "casnap_take_s": statistics.median(casnap_times),
        "dcp_save_s": statistics.median(dcp_times),
        "casnap_over_dcp": statistics.median(c / d for c, d in zip(casnap_times, dcp_times)),
        "casnap_samples_s": casnap_times,
        "dcp_samples_s": dcp_times,
        # CPU seconds of all ranks' processes together: the ranks share the cores, so
        # this is what a take costs the machine, steadier than the wall time.
        "casnap_cpu_s": statistics.median(casnap_cpu),
        "dcp_cpu_s": statistics.median(dcp_cpu),
    }


def worker(rank: int, world: int, out: str, mib: int, repeat: int, modes: list[str]) -> None:
    join_group(rank, world, out)
    torch.manual_seed(0)
    layers = max(1, mib // 4)  # 1024x1024 float32 = 4 MiB each
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(layers)])
    )
    result: dict[str, Any] = {"ranks": world, "model_mib": layers * 4, "repeat": repeat}
    for mode in modes:
        result[mode] = _run_mode(mode, model, Path(out), repeat)
    finish_rank(rank, out, result)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--mode", choices=("both", "fresh", "series"), default="both")
    args = ap.parse_args()
    modes = ["fresh", "series"] if args.mode == "both" else [args.mode]
    result = spawn_ranks(worker, args.ranks, args.mib, args.repeat, modes)
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
