"""One measurement in a fresh process, for benchmarks/suite.py: peak RSS or bytes read.

    python benchmarks/suite_probe.py rss-take|rss-restore|rss-async SYSTEM PATH SIZE_BYTES HIDDEN
    python benchmarks/suite_probe.py read SYSTEM PATH KEY ROWS COLS WARM_PATH

Prints one JSON object on the last line of stdout. Peak RSS: build the live state (the
weights, or a zero-filled target), reset the high-water mark (``/proc/self/clear_refs`` ←
5), run the one operation; ``extra_bytes`` = ``VmHWM`` − the ``VmRSS`` before it
(``ru_maxrss`` beside it). torch.load and safetensors load, copy into the model, drop the
dict. Bytes read: after a read from a warm-up snapshot of the same system, drop the page
cache and read one tensor; ``read_bytes`` (block device) and ``rchar`` (read() calls, not
mmap) from ``/proc/self/io`` around it.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import sys
import time

import suite_states
import torch
from harness import drop_page_cache, proc_io
from suite_systems import SYSTEMS


def _status(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5\n")
        return True
    except OSError:
        return False


def _measure_peak(op: object, live: dict[str, torch.Tensor]) -> dict[str, object]:
    """Peak RSS of ``op()`` above the RSS before it, next to ``live``'s bytes."""
    gc.collect()
    reset = _reset_peak()
    base = _status("VmRSS")
    t0 = time.perf_counter()
    op()  # type: ignore[operator]
    seconds = time.perf_counter() - t0
    peak = _status("VmHWM")
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if not reset:
        peak = maxrss
    return {
        "baseline_rss": base,
        "peak_rss": peak,
        "extra_bytes": peak - base,
        "ru_maxrss": maxrss,
        "peak_reset": reset,
        "seconds": seconds,
        "memory_budget_env": os.environ.get("CASNAP_MEMORY_BUDGET"),
        "live_bytes": suite_states.nbytes(live),
    }


def rss_take(system: str, path: str, size: int, hidden: int) -> dict[str, object]:
    state = suite_states.build(suite_states.model_shapes(size, hidden))
    return _measure_peak(lambda: SYSTEMS[system].save(state, path), state)


def rss_async(system: str, path: str, size: int, hidden: int) -> dict[str, object]:
    """Peak RSS of an async save from its call until it is durable (staging included)."""
    state = suite_states.build(suite_states.model_shapes(size, hidden))
    sys_ = SYSTEMS[system]

    blocked: list[float] = []

    def save() -> None:
        t0 = time.perf_counter()
        pending = sys_.async_save(state, path)
        blocked.append(time.perf_counter() - t0)
        assert pending is not None, f"{system} has no async save"
        pending.wait()

    out = _measure_peak(save, state)
    out["blocked_seconds"] = blocked[0]
    return out


def rss_restore(system: str, path: str, size: int, hidden: int) -> dict[str, object]:
    target = suite_states.target_like(
        {k: torch.empty(s) for k, s in suite_states.model_shapes(size, hidden).items()}
    )
    sys_ = SYSTEMS[system]

    def restore() -> None:
        loaded = sys_.load(path, target)
        if not sys_.in_place:  # what model.load_state_dict(torch.load(...)) does
            for k, t in target.items():
                t.copy_(loaded[k])
        del loaded

    out = _measure_peak(restore, target)
    probe = "layers.0.attn.qkv.weight"
    out["restored_nonzero"] = bool(target[probe].abs().sum() > 0)
    return out


def read(system: str, path: str, key: str, rows: int, cols: int, warm: str) -> dict[str, object]:
    sys_ = SYSTEMS[system]
    like = torch.empty((rows, cols))
    sys_.read_one(warm, key, torch.empty((4, cols)))  # imports and first-call set-up
    counting = None
    if system == "casnap":
        # Count what casnap itself asks of its store, next to what the kernel reads.
        import casnap
        from casnap.store import CountingStore, LocalStore

        repo_root = os.path.dirname(path)
        counting = CountingStore(LocalStore(repo_root))
        repo = casnap.Repository.on_store(counting)

        def one() -> torch.Tensor:
            out: torch.Tensor = casnap.Snapshot(path, repository=repo).read_object(f"0/model/{key}")
            return out

        counting.reset()
    else:

        def one() -> torch.Tensor:
            return sys_.read_one(path, key, like)

    gc.collect()
    dropped = drop_page_cache() is None
    before = proc_io()
    t0 = time.perf_counter()
    got = one()
    seconds = time.perf_counter() - t0
    after = proc_io()
    expected = suite_states.probe_tensor(rows, cols)
    out: dict[str, object] = {
        "read_bytes": after["read_bytes"] - before["read_bytes"],
        "rchar": after["rchar"] - before["rchar"],
        "seconds": seconds,
        "cache_dropped": dropped,
        "correct": bool(torch.equal(got, expected)),
    }
    if counting is not None:
        out["store_bytes_read"] = counting.bytes_read
        out["store_requests"] = dict(counting.requests)
    return out


def main(argv: list[str]) -> int:
    cmd, system, path, *rest = argv
    if cmd == "rss-take":
        result = rss_take(system, path, int(rest[0]), int(rest[1]))
    elif cmd == "rss-async":
        result = rss_async(system, path, int(rest[0]), int(rest[1]))
    elif cmd == "rss-restore":
        result = rss_restore(system, path, int(rest[0]), int(rest[1]))
    elif cmd == "read":
        result = read(system, path, rest[0], int(rest[1]), int(rest[2]), rest[3])
    else:
        raise SystemExit(f"unknown probe {cmd!r}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")
    raise SystemExit(main(sys.argv[1:]))
