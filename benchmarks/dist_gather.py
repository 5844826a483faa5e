"""One small all-rank exchange: casnap's ``all_gather`` against ``all_gather_object``.

    .venv/bin/python benchmarks/dist_gather.py [--ranks 4] [--bytes 3000] [--repeat 60]

A distributed take exchanges twice while every rank waits (the start, then the
plans), each a gather of one small pickled value per rank. Each repeat is one
barrier, then one gather; the figure is the median over repeats of the slowest
rank's time, in milliseconds, for both ways in the same run (alternated, twice
each). Prints one JSON line with the ratio casnap/all_gather_object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from harness import finish_rank, join_group, spawn_ranks


def _worker(rank: int, world: int, out: str, size: int, repeat: int) -> None:
    import torch.distributed as dist

    from casnap.distributed.group import all_gather, resolve_group

    join_group(rank, world, out)
    group = resolve_group(None)
    value = {"plan": b"x" * size, "rank": rank}
    ways: list[tuple[str, Any]] = [
        ("all_gather_object", lambda: dist.all_gather_object([None] * world, value)),
        ("casnap", lambda: all_gather(group, value, "benchmark")),
    ]
    samples: dict[str, list[float]] = {name: [] for name, _ in ways}
    for name, fn in ways * 2:
        mine = []
        for _ in range(repeat):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            mine.append(time.perf_counter() - t0)
        every: list[Any] = [None] * world
        dist.all_gather_object(every, mine)
        samples[name] += [max(e[i] for e in every) for i in range(repeat)]
    ms = {name: round(statistics.median(s) * 1e3, 2) for name, s in samples.items()}
    result = {
        "ranks": world,
        "bytes": size,
        "ms": ms,
        "ratio": ms["casnap"] / ms["all_gather_object"],
    }
    finish_rank(rank, out, result)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--bytes", type=int, default=3000)
    ap.add_argument("--repeat", type=int, default=60)
    args = ap.parse_args()
    print(json.dumps(spawn_ranks(_worker, args.ranks, args.bytes, args.repeat)))


if __name__ == "__main__":
    main()
