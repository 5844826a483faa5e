"""Megatron-core's torch_dist strategy against casnap's strategy, same state, one run (issue #27).

A Megatron GPT (local layer spec, CPU, one gloo rank) is saved with
``dist_checkpointing.save`` through each strategy into its own fresh directory:

1. ``first``: into an empty directory / repository;
2. ``unchanged``: the same state again, to the next ``iter_N`` directory;
3. ``sparse change``: after a step that changed the last layer's MLP and the
   final layer norm only;
4. ``load``: ``dist_checkpointing.load`` of the last save into a fresh model.

Time is the wall time of the call; bytes are what a save added below its run
directory (apparent size). Ratios are casnap / torch_dist: below 1 means casnap
is faster or smaller. Both loads are compared bit for bit with the saved state.

Megatron-core 0.16.1's torch_dist writer assumes CUDA in two calls,
``torch.cuda.synchronize()`` and a flag broadcast on
``torch.cuda.current_device()``; for its saves only, those two are patched (a
no-op, and the CPU device). casnap's strategy runs unpatched.

    .venv/bin/python benchmarks/megatron_compare.py [--hidden 768] [--layers 6] [--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import warnings
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (  # noqa: E402
    disk_usage,
    human_bytes,
    machine,
    markdown_table,
    scratch_dir,
    settle,
    write_json,
)

STEPS = ("first", "unchanged", "sparse change", "load")
TOOLS = ("torch_dist", "casnap")


class Samples:
    """(seconds, bytes) per tool and step, over the repeats."""

    def __init__(self) -> None:
        self.runs: dict[tuple[str, str], list[tuple[float, int]]] = {}

    def add(self, tool: str, step: str, seconds: float, nbytes: int) -> None:
        self.runs.setdefault((tool, step), []).append((seconds, nbytes))

    def median(self, tool: str, step: str) -> tuple[float, int]:
        runs = self.runs[(tool, step)]
        secs = sorted(s for s, _ in runs)
        sizes = sorted(b for _, b in runs)
        return secs[len(secs) // 2], sizes[len(sizes) // 2]


@contextlib.contextmanager
def cuda_calls_patched(tool: str) -> Iterator[None]:
    """torch_dist only: its writer's two CUDA calls, made harmless on a CPU machine."""
    if tool != "torch_dist":
        yield
        return
    saved = (torch.cuda.synchronize, torch.cuda.current_device)
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment, return-value]  # a device name
    try:
        yield
    finally:
        torch.cuda.synchronize, torch.cuda.current_device = saved


def build(hidden: int, layers: int, seed: int) -> Any:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    cfg = TransformerConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=8,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
    )
    return GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=8192, max_sequence_length=512)


def strategies(tool: str) -> tuple[Any, Any]:
    if tool == "casnap":
        from casnap.integrations.megatron import CasnapLoadStrategy, CasnapSaveStrategy

        return CasnapSaveStrategy(), CasnapLoadStrategy()
    from megatron.core.dist_checkpointing.strategies.torch import (
        TorchDistLoadShardedStrategy,
        TorchDistSaveShardedStrategy,
    )

    return TorchDistSaveShardedStrategy("torch_dist", 1), TorchDistLoadShardedStrategy()


def one_run(tool: str, root: str, args: argparse.Namespace, samples: Samples) -> bool:
    from megatron.core import dist_checkpointing

    model = build(args.hidden, args.layers, seed=1)
    save_strategy, load_strategy = strategies(tool)
    for it, step in enumerate(STEPS[:3], start=1):
        if step == "sparse change":
            with torch.no_grad():
                model.decoder.layers[-1].mlp.linear_fc1.weight.add_(0.01)
                model.decoder.final_layernorm.weight.mul_(1.01)
        ckpt = os.path.join(root, f"iter_{it:07d}")
        os.makedirs(ckpt)
        before = disk_usage(root)[1]
        settle(cold=False)
        with cuda_calls_patched(tool):
            t0 = time.perf_counter()
            dist_checkpointing.save(
                {"model": model.sharded_state_dict(), "iteration": it},
                ckpt,
                sharded_strategy=save_strategy,
            )
            seconds = time.perf_counter() - t0
        samples.add(tool, step, seconds, disk_usage(root)[1] - before)
    fresh = build(args.hidden, args.layers, seed=2)
    settle(cold=False)
    t0 = time.perf_counter()
    loaded = dist_checkpointing.load(
        {"model": fresh.sharded_state_dict()}, ckpt, sharded_strategy=load_strategy
    )
    samples.add(tool, "load", time.perf_counter() - t0, 0)
    fresh.load_state_dict(loaded["model"], strict=False)
    want, got = model.state_dict(), fresh.state_dict()
    return all(
        torch.equal(want[k], got[k]) for k in want if isinstance(want[k], torch.Tensor)
    ) and bool(want)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workdir", default=os.path.join("bench-out", "scratch"))
    p.add_argument("--out", default=os.path.join("bench-out", "megatron.json"))
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    samples = Samples()
    exact = True
    with scratch_dir(args.workdir) as work:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{os.path.abspath(work)}/pg",
            rank=0,
            world_size=1,
            timeout=timedelta(seconds=600),
        )
        ps.initialize_model_parallel(1, 1)
        model_bytes = sum(
            t.numel() * t.element_size() for t in build(args.hidden, args.layers, 1).parameters()
        )
        for r in range(args.repeats):
            for tool in TOOLS if r % 2 == 0 else TOOLS[::-1]:  # alternate who goes first
                root = os.path.join(work, f"{tool}-{r}")
                os.makedirs(root)
                exact = one_run(tool, root, args, samples) and exact
        dist.destroy_process_group()
    rows, results = [], {}
    for step in STEPS:
        td, cs = samples.median("torch_dist", step), samples.median("casnap", step)
        results[step] = {"torch_dist": td, "casnap": cs}
        byte_ratio = f"{cs[1] / td[1]:.3f}" if td[1] else "-"
        rows.append(
            [
                step,
                f"{td[0]:.3f}",
                f"{cs[0]:.3f}",
                f"{cs[0] / td[0]:.2f}",
                human_bytes(td[1]) if step != "load" else "-",
                human_bytes(cs[1]) if step != "load" else "-",
                byte_ratio if step != "load" else "-",
            ]
        )
    headers = ["step", "torch_dist s", "casnap s", "time casnap/td", "td bytes", "casnap bytes"]
    print(
        f"model {human_bytes(model_bytes)} fp32, medians of {args.repeats}, both loads exact: "
        f"{exact}"
    )
    print(markdown_table([*headers, "bytes casnap/td"], rows))
    write_json(
        args.out,
        {
            "benchmark": "megatron",
            "machine": machine(),
            "args": vars(args),
            "model_bytes": model_bytes,
            "exact": exact,
            "results": results,
        },
    )
    if not exact:
        raise SystemExit("a load did not give back the saved state")


if __name__ == "__main__":
    main()
