"""Planning exchange of a distributed take: first take of a structure vs the next (plan cache).

    .venv/bin/python benchmarks/dist_plan.py [--ranks 2] [--tensors 2000] [--repeat 5]

Each rank holds ``--tensors`` small float32 tensors (half replicated, half its
own) and a step counter. Every round clears the plan cache on every rank,
then takes twice into one repository: the *cold* take sends every structure,
the *warm* one only digests. A warm-up round writes the chunks first, so both
measured takes only deduplicate. Prints one JSON line: rank 0's pickled
planning payload, the exchange's wall time (min over ranks: the last rank to
arrive waits for nobody) and the whole take's (max over ranks), medians over
rounds, and warm/cold ratios.
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


def _state(rank: int, tensors: int) -> dict[str, Any]:
    from casnap import StateDict

    g = torch.Generator().manual_seed(0)
    half = tensors // 2
    model = {f"layer{i}.w": torch.randn(256, generator=g) for i in range(half)}
    optim = {f"m{i}": torch.full((256,), float(rank * tensors + i)) for i in range(half)}
    return {"model": StateDict(model), "optim": StateDict(optim, step=0)}


def _over_ranks(seconds: float, op: Any) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return float(t.item())


def _take(root: str, name: str, app: dict[str, Any], session: Any) -> tuple[int, float, float]:
    from casnap import Snapshot

    dist.barrier()
    t0 = time.perf_counter()
    Snapshot.take(f"{root}/{name}", app, replicated=["model/**"], session=session)
    took = time.perf_counter() - t0
    last = session.plan_cache.last
    assert last is not None
    # The exchange of the rank that arrives last includes no waiting for the others.
    exchange = _over_ranks(last.seconds, dist.ReduceOp.MIN)
    return last.payload_bytes, exchange, _over_ranks(took, dist.ReduceOp.MAX)


def worker(rank: int, world: int, out: str, tensors: int, repeat: int) -> None:
    from casnap import Session

    join_group(rank, world, out)
    app = _state(rank, tensors)
    root = str(Path(out, "repo"))
    rows: dict[str, list[Any]] = {"cold": [], "warm": []}
    for i in range(repeat + 1):
        session = Session()  # cold: a new process's; warm: the same one's next take
        app["optim"]["step"] = i
        cold = _take(root, f"c{i}", app, session)
        warm = _take(root, f"w{i}", app, session)
        if i:  # round 0 writes the chunks: warm-up
            rows["cold"].append(cold)
            rows["warm"].append(warm)

    def med(kind: str, col: int) -> float:
        return statistics.median(r[col] for r in rows[kind])

    result = {
        "ranks": world,
        "tensors": tensors,
        "rounds": repeat,
        "payload_bytes_cold": rows["cold"][0][0],
        "payload_bytes_warm": rows["warm"][0][0],
        "payload_warm_over_cold": rows["warm"][0][0] / rows["cold"][0][0],
        "exchange_s_cold": med("cold", 1),
        "exchange_s_warm": med("warm", 1),
        "exchange_warm_over_cold": med("warm", 1) / med("cold", 1),
        "take_s_cold": med("cold", 2),
        "take_s_warm": med("warm", 2),
        "take_warm_over_cold": med("warm", 2) / med("cold", 2),
    }
    finish_rank(rank, out, result)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--tensors", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    result = spawn_ranks(worker, args.ranks, args.tensors, args.repeat)
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
