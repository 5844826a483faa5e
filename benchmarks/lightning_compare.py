"""Lightning's default checkpointing (TorchCheckpointIO) against CasnapCheckpointIO.

One short ``Trainer.fit`` of the same model with the same
``ModelCheckpoint(every_n_train_steps=K, save_top_k=2)``, once per plugin, in
the same process, for two models: ``frozen`` (a backbone of 90% of the
parameters is frozen, a fine-tune: successive checkpoints share it) and
``full`` (every parameter trains, Adam: nothing is shared between
checkpoints, so this row shows casnap's overhead). Measured per run:

- checkpoint seconds: time inside the plugin's ``save_checkpoint`` and
  ``remove_checkpoint`` calls (Lightning's own ``dump_checkpoint`` is the same
  for both and not counted);
- bytes written: ``wchar`` of /proc/self/io over those calls (every thread);
- bytes on disk at the end: the checkpoint directory (``du`` blocks).

Prints a Markdown table of medians with casnap / torch ratios and writes the
samples as JSON. Writes only inside a scratch directory (removed afterwards)::

    .venv/bin/python benchmarks/lightning_compare.py --small      # ~1 min
    .venv/bin/python benchmarks/lightning_compare.py              # 256 MiB of weights, 3 repeats
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402
import lightning as L  # noqa: E402
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO  # noqa: E402
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from casnap.integrations.lightning import CasnapCheckpointIO  # noqa: E402


def _wchar() -> int:
    with open("/proc/self/io", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    return 0


class Timed(CheckpointIO):
    """Delegates to ``inner`` and adds up the time and bytes of its saves and removals."""

    def __init__(self, inner: CheckpointIO) -> None:
        self.inner = inner
        self.seconds = 0.0
        self.written = 0
        self.saves = 0

    def _measure(self, fn: Any, *args: Any) -> Any:
        w0, t0 = _wchar(), time.perf_counter()
        out = fn(*args)
        self.seconds += time.perf_counter() - t0
        self.written += _wchar() - w0
        return out

    def save_checkpoint(self, checkpoint: Any, path: Any, storage_options: Any = None) -> None:
        self.saves += 1
        self._measure(self.inner.save_checkpoint, checkpoint, path, storage_options)

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: Any = None) -> Any:
        return self.inner.load_checkpoint(path, map_location, weights_only)

    def remove_checkpoint(self, path: Any) -> None:
        self._measure(self.inner.remove_checkpoint, path)


class Net(L.LightningModule):
    def __init__(self, width: int, layers: int, frozen: bool) -> None:
        super().__init__()
        self.backbone = torch.nn.Sequential(
            *(
                torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh())
                for _ in range(layers)
            )
        )
        self.head = torch.nn.Linear(width, width)
        if frozen:
            self.backbone.requires_grad_(False)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.head(self.backbone(x)), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=1e-4)


def fit_once(root: str, plugin: CheckpointIO, args: argparse.Namespace, frozen: bool) -> dict:
    torch.manual_seed(0)
    model = Net(args.width, args.layers, frozen)
    data = TensorDataset(torch.randn(64, args.width), torch.randn(64, args.width))
    timed = Timed(plugin)
    dirpath = os.path.join(root, "ckpt")
    ckpt = ModelCheckpoint(
        dirpath=dirpath, every_n_train_steps=args.every, save_top_k=2, monitor="step", mode="max"
    )
    trainer = L.Trainer(
        max_steps=args.steps,
        plugins=[timed],
        callbacks=[ckpt],
        enable_progress_bar=False,
        logger=False,
        accelerator="cpu",
        default_root_dir=root,
        enable_model_summary=False,
    )
    t0 = time.perf_counter()
    trainer.fit(model, DataLoader(data, batch_size=8))
    fit_s = time.perf_counter() - t0
    used, apparent, files = harness.disk_usage(dirpath)
    return {
        "fit_s": fit_s,
        "ckpt_s": timed.seconds,
        "written": timed.written,
        "disk": used,
        "apparent": apparent,
        "saves": timed.saves,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="a quick run: 16 MiB, 1 repeat")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=15)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", default="bench-out/scratch")
    parser.add_argument("--out", default="bench-out/lightning_compare.json")
    args = parser.parse_args()
    if args.small:
        args.width, args.layers, args.repeats = 1024, 3, 1
    samples = harness.Samples()
    with harness.scratch_dir(args.workdir) as scratch:
        os.environ["CASNAP_INDEX_DIR"] = os.path.join(scratch, "index")  # not the home dir
        for repeat in range(args.repeats):
            for model in ("frozen", "full"):
                for name, make in (("torch", TorchCheckpointIO), ("casnap", CasnapCheckpointIO)):
                    root = os.path.join(scratch, f"{model}-{name}-{repeat}")
                    harness.settle(cold=False)
                    r = fit_once(root, make(), args, frozen=model == "frozen")
                    op = f"{model}/{name}"
                    samples.add(op, r["ckpt_s"])
                    for key in ("written", "disk", "saves"):
                        samples.count(op, key, r[key])
                    samples.count(op, "fit_ms", int(r["fit_s"] * 1000))
    params = args.layers * (args.width * args.width + args.width) + args.width * (args.width + 1)
    rows = []
    for model in ("frozen", "full"):
        t, c = f"{model}/torch", f"{model}/casnap"

        def ratio(a: float | None, b: float | None) -> str:
            return f"{a / b:.2f}" if a is not None and b else ""

        rows.append(
            [
                model,
                str(samples.counter(c, "saves")),
                f"{samples.median(t):.2f}",
                f"{samples.median(c):.2f}",
                ratio(samples.median(c), samples.median(t)),
                harness.human_bytes(samples.counter(t, "written")),
                harness.human_bytes(samples.counter(c, "written")),
                ratio(samples.counter(c, "written"), samples.counter(t, "written")),
                harness.human_bytes(samples.counter(t, "disk")),
                harness.human_bytes(samples.counter(c, "disk")),
                ratio(samples.counter(c, "disk"), samples.counter(t, "disk")),
            ]
        )
    print(
        f"{params * 4 / harness.MiB:.0f} MiB of fp32 weights (+ Adam state for the trained "
        f"part), {args.steps} steps, a save every {args.every}, save_top_k=2, "
        f"median of {args.repeats}"
    )
    print(
        harness.markdown_table(
            [
                "model",
                "saves",
                "torch ckpt s",
                "casnap ckpt s",
                "time ratio",
                "torch written",
                "casnap written",
                "written ratio",
                "torch on disk",
                "casnap on disk",
                "disk ratio",
            ],
            rows,
        )
    )
    harness.write_json(
        args.out, {"args": vars(args), "machine": harness.machine(), "results": samples.as_json()}
    )


if __name__ == "__main__":
    main()
