"""Async take of a CUDA state: casnap's async_take against DCP's async_save.

    .venv/bin/python benchmarks/gpu_take.py [--gib 2] [--repeat 3] [--dir /path]

``--gib`` GiB of bf16 CUDA tensors (64 MiB matrices and small vectors), per system and
round into a fresh directory: *blocked* is how long the call holds the caller (the copy to
host), *total* until durable, *throughput* bytes over total. casnap runs through one
``Session`` (round 1 pins its staging buffers and is reported apart). The floor of
*blocked* is a copy into pinned host buffers allocated once (``copy_to_reused_pinned_s``;
``blocked_vs_copy``). Prints one JSON line: medians of rounds 2.., casnap/DCP ratios.
Without CUDA it prints that it skips, as JSON, and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import Future
from typing import Any

import torch

MiB = 1 << 20


def _state(gib: float) -> dict[str, torch.Tensor]:
    """bf16 tensors on the GPU: 64 MiB matrices plus a small vector after each."""
    state: dict[str, torch.Tensor] = {}
    left, i = int(gib * (1 << 30)), 0
    while left > 0:
        rows = max(1, min(64 * MiB, left) // (4096 * 2))
        state[f"layer{i}.weight"] = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
        state[f"layer{i}.bias"] = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
        left -= rows * 4096 * 2 + 4096 * 2
        i += 1
    torch.cuda.synchronize()
    return state


def _casnap_round(
    root: str, state: dict[str, torch.Tensor], session: Any, i: int
) -> dict[str, float]:
    from casnap import Snapshot, StateDict

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    pending = Snapshot.async_take(
        f"{root}/casnap/r{i}", {"model": StateDict(state)}, session=session
    )
    blocked = time.perf_counter() - t0
    pending.wait()
    return {"blocked_s": blocked, "total_s": time.perf_counter() - t0}


def _dcp_round(root: str, state: dict[str, torch.Tensor], i: int) -> dict[str, float]:
    import torch.distributed.checkpoint as dcp

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    future = dcp.async_save({"model": state}, checkpoint_id=f"{root}/dcp/r{i}")
    blocked = time.perf_counter() - t0
    assert isinstance(future, Future)  # no async_stager: the plain upload future
    future.result()
    return {"blocked_s": blocked, "total_s": time.perf_counter() - t0}


def _copy_round(state: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> float:
    """The floor for *blocked*: copy the state into pinned host buffers reused per round."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for key, t in state.items():
        buffers[key].copy_(t, non_blocking=True)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def _init_group(root: str) -> None:
    import torch.distributed as dist

    if not dist.is_initialized():  # DCP's async_save needs a group with a CPU backend
        dist.init_process_group(
            "cpu:gloo,cuda:nccl", init_method=f"file://{root}/pg", rank=0, world_size=1
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"benchmark": "gpu_take", "skipped": "no CUDA device: skip"}))
        return 0
    root = tempfile.mkdtemp(prefix="casnap-gpu-", dir=args.dir)
    try:
        from casnap import Session

        _init_group(root)
        state = _state(args.gib)
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        session = Session()
        rows: dict[str, list[dict[str, float]]] = {"casnap": [], "dcp": []}
        buffers = {k: torch.empty_like(t, device="cpu").pin_memory() for k, t in state.items()}
        copies: list[float] = []
        for i in range(args.repeat + 1):
            copies.append(_copy_round(state, buffers))
            rows["casnap"].append(_casnap_round(root, state, session, i))
            rows["dcp"].append(_dcp_round(root, state, i))
            for sub in ("casnap", "dcp"):
                shutil.rmtree(f"{root}/{sub}", ignore_errors=True)  # fresh directories
        out: dict[str, Any] = {
            "benchmark": "gpu_take",
            "device": torch.cuda.get_device_name(),
            "state_bytes": nbytes,
            "rounds": args.repeat,
            "casnap_first_round": rows["casnap"][0],
            "dcp_first_round": rows["dcp"][0],
            "pinned_bytes": session.staging.pinned_bytes,
        }
        for system, got in rows.items():
            for col in ("blocked_s", "total_s"):
                out[f"{system}_{col}"] = statistics.median(r[col] for r in got[1:])
            out[f"{system}_gib_per_s"] = nbytes / (1 << 30) / out[f"{system}_total_s"]
        out["copy_to_reused_pinned_s"] = statistics.median(copies[1:])
        out["blocked_ratio"] = out["casnap_blocked_s"] / out["dcp_blocked_s"]
        out["blocked_vs_copy"] = out["casnap_blocked_s"] / out["copy_to_reused_pinned_s"]
        out["total_ratio"] = out["casnap_total_s"] / out["dcp_total_s"]
        print(json.dumps(out))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():  # an NCCL group left to the interpreter's exit can hang it
            dist.destroy_process_group()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
