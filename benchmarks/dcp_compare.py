"""DCP's FileSystemWriter against casnap's DCP writer, on the same state in one run (issue #15).

Three saves through ``torch.distributed.checkpoint.save`` (one process, no
process group, DCP's default planner), each to a new checkpoint id, for each
writer in its own fresh directory:

1. ``first``: the state into an empty directory / repository;
2. ``unchanged``: the same state again (a periodic save while nothing trained);
3. ``frozen backbone``: only the head changed (the last transformer layer and
   the final layernorm: fine-tuning the top with the rest frozen).

Time is the wall time of ``dcp.save`` (both writers fsync what they write);
bytes are what the save added to its directory (apparent size). Ratios are
casnap / FileSystemWriter, so below 1 means casnap is faster or smaller.
After the run, both last checkpoints are loaded back and compared.

    .venv/bin/python benchmarks/dcp_compare.py [--size-gib 0.5] [--repeats 3] [--small]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (  # noqa: E402
    GiB,
    Samples,
    disk_usage,
    human_bytes,
    machine,
    make_state,
    markdown_table,
    same_state,
    scratch_dir,
    settle,
    state_bytes,
    transformer_shapes,
    write_json,
)

from casnap.integrations.dcp import CasnapReader, CasnapWriter  # noqa: E402

STEPS = ("first", "unchanged", "frozen backbone")
TOOLS = ("FileSystemWriter", "casnap")


def head_keys(state: dict[str, torch.Tensor]) -> list[str]:
    last = max(int(k.split(".")[1]) for k in state if k.startswith("layers."))
    return [k for k in state if k.startswith(f"layers.{last}.") or k.startswith("ln_f.")]


def one_repeat(root: str, base: dict[str, torch.Tensor], samples: Samples) -> dict[str, Any]:
    tuned = dict(base)
    for k in head_keys(base):
        tuned[k] = base[k] + 0.001
    states = {"first": base, "unchanged": base, "frozen backbone": tuned}
    last: dict[str, str] = {}
    for tool in TOOLS:
        folder = os.path.join(root, tool)
        os.makedirs(folder)
        writer = CasnapWriter(os.path.join(folder, "step_0")) if tool == "casnap" else None
        for i, step in enumerate(STEPS):
            ckpt = os.path.join(folder, f"step_{i}")
            state = {"model": states[step]}
            before = disk_usage(folder)[1]
            settle(cold=False)
            # The casnap writer is reused across saves (its session links each save to
            # the last); DCP's writer is made per checkpoint, as its users do.
            target = writer if writer is not None else dcp.FileSystemWriter(ckpt)
            samples.time(
                f"{tool}/{step}",
                functools.partial(dcp.save, state, storage_writer=target, checkpoint_id=ckpt),
            )
            samples.count(f"{tool}/{step}", "bytes", disk_usage(folder)[1] - before)
            last[tool] = ckpt
    return last


def check(last: dict[str, str], want: dict[str, torch.Tensor]) -> bool:
    ok = True
    for tool, ckpt in last.items():
        out = {"model": {k: torch.empty_like(v) for k, v in want.items()}}
        reader = CasnapReader(ckpt) if tool == "casnap" else dcp.FileSystemReader(ckpt)
        dcp.load(out, storage_reader=reader)
        ok = ok and same_state(out["model"], want)
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--small", action="store_true", help="a quick run: 0.05 GiB, 1 repeat")
    parser.add_argument("--workdir", default="bench-out/scratch")
    parser.add_argument("--out", default="bench-out/dcp_compare.json")
    args = parser.parse_args()
    if args.small:
        args.size_gib, args.repeats = 0.05, 1
    warnings.simplefilter("ignore")  # DCP warns that no process group is initialized
    hidden, layers, shapes = transformer_shapes(int(args.size_gib * GiB))
    base = make_state(shapes)
    tuned = {k: (v + 0.001 if k in head_keys(base) else v) for k, v in base.items()}
    samples = Samples()
    loaded_ok = True
    for _ in range(args.repeats):
        with scratch_dir(args.workdir) as root:
            last = one_repeat(root, base, samples)
            loaded_ok = loaded_ok and check(last, tuned)
    rows = []
    for step in STEPS:
        fs, cs = f"FileSystemWriter/{step}", f"casnap/{step}"
        fb, cb = samples.counter(fs, "bytes") or 0, samples.counter(cs, "bytes") or 0
        rows.append(
            [
                step,
                f"{samples.median(fs):.3f}",
                f"{samples.median(cs):.3f}",
                f"{samples.median(cs) / samples.median(fs):.2f}",
                human_bytes(fb),
                human_bytes(cb),
                f"{cb / fb:.4f}" if fb else "",
            ]
        )
    head = sum(base[k].numel() * 4 for k in head_keys(base))
    print(
        f"state: {human_bytes(state_bytes(base))} fp32 (hidden {hidden}, {layers} layers; "
        f"head {human_bytes(head)}), {args.repeats} repeat(s), medians; "
        f"loads bit-exact: {loaded_ok}"
    )
    print(
        markdown_table(
            [
                "save",
                "FS time s",
                "casnap time s",
                "time ratio",
                "FS bytes",
                "casnap bytes",
                "bytes ratio",
            ],
            rows,
        )
    )
    write_json(
        args.out,
        {
            "benchmark": "dcp_compare",
            "machine": machine(),
            "size_bytes": state_bytes(base),
            "loaded_ok": loaded_ok,
            "samples": samples.as_json(),
        },
    )
    if not loaded_ok:
        raise SystemExit("a checkpoint did not load back bit-exact")


if __name__ == "__main__":
    main()
