"""A distributed take and restore of CUDA state: two gloo ranks sharing one GPU.

The CUDA case is skipped without CUDA (this project's CI machine has none) and
runs on a lent GPU machine through ``benchmarks/gpu_device_run.sh``; the same
scenario on CPU tensors runs everywhere, so the scenario itself is checked.
The multi-rank path stages CUDA tensors to the host itself
(casnap/distributed/take.py), apart from the single-process path that
tests/test_staging_gpu_path.py covers.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist_harness import run_ranks, values

pytestmark = pytest.mark.dist


def _state(rank: int, dev: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)  # the same replicated weights on every rank
    return {
        "w": torch.randn(1024, 1024, generator=gen).to(dev),  # 4 MiB: a chunk per MiB
        "b": torch.randn(4096, generator=gen).to(dev, torch.bfloat16),
        "mine": torch.full((3, 5), float(rank), device=dev),  # per rank
        "strided": torch.arange(64.0).reshape(8, 8).to(dev).t(),  # not contiguous
    }


def scenario(rank: int, world: int, root: str, dev: str) -> dict[str, Any]:
    from casnap import Session, Snapshot, StateDict
    from casnap.distributed import ReplicaMismatchError

    opts = {"chunk_size": 1 << 20}
    state = _state(rank, dev)
    expected = {k: v.cpu().clone() for k, v in state.items()}
    app = {"s": StateDict(state)}
    session = Session()
    Snapshot.take(f"{root}/s1", app, replicated=["s/w", "s/b"], settings=opts)
    pending = Snapshot.async_take(
        f"{root}/s2", app, replicated=["s/w", "s/b"], settings=opts, session=session
    )
    state["w"].mul_(-1.0)  # after async_take returned: never in s2
    pending.wait()

    out: dict[str, Any] = {}
    for name in ("s1", "s2"):
        target = {k: torch.zeros_like(v) for k, v in _state(rank, dev).items()}
        Snapshot(f"{root}/{name}").restore({"s": StateDict(target)})
        for k, v in target.items():
            assert v.device.type == dev, k
            assert torch.equal(v.cpu(), expected[k]), (name, k)
        on_cpu = {k: torch.zeros_like(v, device="cpu") for k, v in _state(rank, dev).items()}
        Snapshot(f"{root}/{name}").restore({"s": StateDict(on_cpu)})  # across devices
        out[name] = all(torch.equal(on_cpu[k], expected[k]) for k in expected)
    # Replicas that differ between ranks are found on the GPU too.
    bad = StateDict(r=torch.full((4,), 1.0 + rank, device=dev))
    strict = {**opts, "replica_mismatch": "error"}
    try:
        Snapshot.take(f"{root}/bad", {"bad": bad}, replicated=["bad/**"], settings=strict)
        out["mismatch"] = ""
    except ReplicaMismatchError as exc:
        out["mismatch"] = str(exc)
    return out


@pytest.mark.parametrize(
    "dev",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ),
    ],
)
def test_two_ranks_take_and_restore_device_state_bit_exact(tmp_path: Any, dev: str) -> None:
    outs = values(run_ranks(2, scenario, str(tmp_path / "repo"), dev))
    for out in outs:
        assert out["s1"] and out["s2"]
        assert "bad/r" in out["mismatch"]
