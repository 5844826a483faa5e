"""Run a function on N CPU processes joined by a gloo process group (for ``-m dist`` tests).

``run_ranks(n, fn, *args)`` starts ``n`` processes; each initializes gloo over
a FileStore, calls ``fn(rank, world_size, *args)`` and reports its return
value or its exception. Returns one :class:`Outcome` per rank, in rank order.

The processes come from a fork server that has imported torch once (the
``forkserver`` start method with torch preloaded), so a rank starts in a
fraction of a second instead of importing torch again as a spawned process
does; nothing else is preloaded, so casnap and the test module are imported
fresh in each rank. Each rank takes the caller's environment and working
directory as they are at the call (a test's ``monkeypatch.setenv`` reaches
the ranks as it did with ``spawn``).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import tempfile
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

PG_TIMEOUT = 30.0


@dataclass
class Outcome:
    value: Any = None
    error: BaseException | None = None
    error_type: str = ""
    error_text: str = ""


def _child(
    rank: int,
    world: int,
    init: str,
    out: str,
    env: dict[str, str],
    call: bytes,
) -> None:
    os.environ.clear()  # the caller's environment now, not the fork server's at its start
    os.environ.update(env)
    import torch.distributed as dist

    os.environ.setdefault("CASNAP_DIST_TIMEOUT", "20")
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=PG_TIMEOUT),
    )
    try:
        fn, args = pickle.loads(call)  # after the environment: this imports the test module
        outcome = Outcome(value=fn(rank, world, *args))
    except BaseException as exc:  # reported to the parent, which asserts on it
        try:
            pickle.dumps(exc)
            kept: BaseException | None = exc
        except Exception:
            kept = None
        outcome = Outcome(None, kept, type(exc).__name__, "".join(traceback.format_exception(exc)))
    Path(out, f"{rank}.pkl").write_bytes(pickle.dumps(outcome))
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def run_ranks(world: int, fn: Any, *args: Any, timeout: float = 120.0) -> list[Outcome]:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    with tempfile.TemporaryDirectory(prefix="casnap-dist-") as tmp:
        init = str(Path(tmp, "init"))
        env, call = dict(os.environ), pickle.dumps((fn, args))
        procs = [
            ctx.Process(target=_child, args=(r, world, init, tmp, env, call)) for r in range(world)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        outcomes = []
        for r in range(world):
            f = Path(tmp, f"{r}.pkl")
            if f.exists():
                outcomes.append(pickle.loads(f.read_bytes()))
            else:
                outcomes.append(Outcome(None, None, "NoReport", f"rank {r} reported nothing"))
        return outcomes


def values(outcomes: list[Outcome]) -> list[Any]:
    """Every rank's return value; fails with every rank's traceback if any rank raised."""
    bad = [(r, o) for r, o in enumerate(outcomes) if o.error_type]
    if bad:
        raise AssertionError("\n".join(f"rank {r}: {o.error_text}" for r, o in bad))
    return [o.value for o in outcomes]
