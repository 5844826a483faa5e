"""How long an async take of a changed CPU state blocks, without a Session and with one.

    .venv/bin/python benchmarks/async_staging.py [--mib 256] [--rounds 7] [--workdir DIR]

The state (16 tensors) changes (``+= 1``) before every round, which times: the floor, a
copy of the state into buffers reused from round to round; ``Snapshot.async_take(
f"{root}/step_{n}", app)`` without a session (torchsnapshot's loop); the same through one
Session. A take is timed until it returns, its write waited for after. Round 0 warms up.
Prints medians and ratios to the floor (issue #39 point 4: at most 1.2x without a session).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from harness import scratch_dir

from casnap import Session, Snapshot, StateDict


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--workdir", default="bench-out/scratch")
    args = p.parse_args(argv)
    state = {f"w{i}": torch.randn(args.mib << 14) for i in range(16)}  # 16 x mib/16 MiB
    floor = [torch.empty_like(t) for t in state.values()]
    app, session = {"m": StateDict(state)}, Session()
    times: dict[str, list[float]] = {"copy": [], "alone": [], "session": []}
    with scratch_dir(args.workdir) as work:
        for n in range(args.rounds + 1):
            for t in state.values():
                t += 1
            t0 = time.perf_counter()
            for buf, t in zip(floor, state.values(), strict=True):
                buf.copy_(t)
            t1 = time.perf_counter()
            pending = Snapshot.async_take(f"{work}/a/step_{n}", app)
            t2 = time.perf_counter()
            pending.wait()
            t3 = time.perf_counter()
            pending = Snapshot.async_take(f"{work}/s/step_{n}", app, session=session)
            t4 = time.perf_counter()
            pending.wait()
            for key, dt in zip(times, (t1 - t0, t2 - t1, t4 - t3), strict=True):
                times[key] += [dt] if n else []
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{args.mib} MiB in 16 tensors, changed each round; medians of {args.rounds}:")
    print(f"  copy into reused buffers     {med['copy'] * 1e3:7.1f} ms (the floor)")
    for key, what in (("alone", "without a session"), ("session", "through a Session")):
        print(f"  async_take {what:17} {med[key] * 1e3:7.1f} ms  {med[key] / med['copy']:5.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
