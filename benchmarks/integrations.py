"""casnap's integrations against the checkpointing each framework ships, same state, one run.

    .venv/bin/python benchmarks/integrations.py dcp|torch_checkpointing [--size-gib 0.5] [--small]
    .venv/bin/python benchmarks/integrations.py lightning [--small] [--width 2048] [--layers 15]
        [--steps 24] [--every 4]
    .venv/bin/python benchmarks/integrations.py megatron [--hidden 768] [--layers 6]
    .venv/bin/python benchmarks/integrations.py torchtitan [--size-gib 0.25]
    .venv/bin/python benchmarks/integrations.py deepspeed|accelerate [--width 2048] [--layers 12]
    (each also [--repeats 3] [--workdir bench-out/scratch] [--out JSON])

Each prints a Markdown table of medians, casnap / the framework's own writer (below 1:
casnap faster or smaller), and writes every sample to ``--out`` as JSON. All but
``lightning`` save ``first``, ``unchanged`` and ``sparse change`` (the last layer and the
final norm; ``dcp``: ``frozen backbone``) into a fresh folder per writer and load the last
into a fresh model, compared bit for bit; time is the save call's (every writer fsyncs),
bytes what it added to the folder. ``dcp``: ``dcp.save`` (one process, default planner),
``FileSystemWriter`` against ``CasnapWriter``. ``torch_checkpointing``: its
``CheckpointManager`` with ``LocalFileSystemStorageConfig(use_direct_io=False)`` (O_DIRECT
fails on many file systems) against ``CasnapStorageConfig``. ``lightning``: a short
``Trainer.fit`` per plugin with ``ModelCheckpoint(every_n_train_steps=K, save_top_k=2)``,
for a ``frozen`` model (90% frozen) and a ``full`` one (Adam over everything); time inside
``save_checkpoint`` and ``remove_checkpoint``, written their ``wchar``, on disk the folder
at the end. ``megatron``: a GPT (local layer spec, CPU, one gloo rank), ``torch_dist``
against casnap's strategy (torch_dist's two CUDA calls patched for its saves).
``torchtitan``: its ``CheckpointManager`` and casnap's, built as its Trainer builds them
(AdamW, zeros state, LR scheduler; sync saves). ``deepspeed``, ``accelerate``: Linear
layers whose last alone trains (ZeRO 2 on one gloo rank, CPU accelerator; one process),
``TorchCheckpointEngine`` / ``Accelerator.save_state`` against casnap's; ``sparse change``
follows one more step.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (  # noqa: E402
    GiB,
    MiB,
    Samples,
    disk_usage,
    human_bytes,
    machine,
    make_state,
    markdown_table,
    proc_io,
    same_state,
    scratch_dir,
    settle,
    state_bytes,
    transformer_shapes,
    write_json,
)

State = dict[str, torch.Tensor]
Result = tuple[str, bool | None]
STEPS = ("first", "unchanged", "sparse change")
LOADED = (*STEPS, "load")


def table(samples: Samples, peer: str, steps: tuple[str, ...], counters: tuple[str, ...]) -> str:
    """Per step: the peer's and casnap's median time and each counter, and casnap / peer."""

    def ratio(a: float | None, b: float | None) -> str:
        return f"{a / b:.3f}" if a is not None and b else "-"

    headers = ["step", f"{peer} s", "casnap s", "time ratio"]
    for name in counters:
        headers += [f"{peer} {name}", f"casnap {name}", f"{name} ratio"]
    rows = []
    for step in steps:
        p, c = f"{peer}/{step}", f"casnap/{step}"
        row = [step, f"{samples.median(p):.3f}", f"{samples.median(c):.3f}"]
        row.append(ratio(samples.median(c), samples.median(p)))
        for name in counters:
            a, b = samples.counter(p, name), samples.counter(c, name)
            row += [human_bytes(a) or "-", human_bytes(b) or "-", ratio(b, a)]
        rows.append(row)
    return markdown_table(headers, rows)


def timed_save(samples: Samples, op: str, folder: str, fn: Callable[[], Any]) -> None:
    """``fn`` timed as ``op`` from a settled start, with the bytes it added under ``folder``."""
    before = disk_usage(folder)[1] if os.path.isdir(folder) else 0
    settle(cold=False)
    samples.time(op, fn)
    samples.count(op, "bytes", disk_usage(folder)[1] - before)


def timed_load(samples: Samples, op: str, fn: Callable[[], Any]) -> Any:
    settle(cold=False)
    return samples.time(op, fn)


def alternating(r: int, tools: tuple[str, str]) -> tuple[str, ...]:
    """Both tools, the first one going first on even repeats."""
    return tools if r % 2 == 0 else tools[::-1]


def _head_keys(state: State) -> list[str]:
    last = max(int(k.split(".")[1]) for k in state if k.startswith("layers."))
    return [k for k in state if k.startswith(f"layers.{last}.") or k.startswith("ln_f.")]


def _dense_states(
    args: argparse.Namespace, names: tuple[str, ...]
) -> tuple[str, State, dict[str, State]]:
    """A transformer state, and it for ``names`` (the last with its head changed)."""
    if args.small:
        args.size_gib, args.repeats = 0.05, 1
    hidden, layers, shapes = transformer_shapes(int(args.size_gib * GiB))
    base = make_state(shapes)
    head = _head_keys(base)
    tuned = {k: (v + 0.001 if k in head else v) for k, v in base.items()}
    size = sum(base[k].nbytes for k in head)
    about = f"{human_bytes(state_bytes(base))} fp32 (hidden {hidden}, {layers} layers; head "
    return about + f"{human_bytes(size)})", tuned, dict(zip(names, (base, base, tuned)))


# -- dcp: FileSystemWriter against CasnapWriter; torch_checkpointing ---------------------


def run_dcp(args: argparse.Namespace, samples: Samples) -> Result:
    import torch.distributed.checkpoint as dcp

    from casnap.integrations.dcp import CasnapReader, CasnapWriter

    warnings.simplefilter("ignore")  # DCP warns that no process group is initialized
    about, tuned, states = _dense_states(args, ("first", "unchanged", "frozen backbone"))
    exact = True
    for _ in range(args.repeats):
        with scratch_dir(args.workdir) as root:
            for tool in ("FileSystemWriter", "casnap"):
                folder = os.path.join(root, tool)
                os.makedirs(folder)
                # casnap's writer is reused (its session links each save to the last);
                # DCP's is made per checkpoint, as its users do.
                writer = CasnapWriter(os.path.join(folder, "step_0")) if tool == "casnap" else None
                for i, step in enumerate(states):
                    ckpt = os.path.join(folder, f"step_{i}")
                    target = writer or dcp.FileSystemWriter(ckpt)
                    save = functools.partial(
                        dcp.save, {"model": states[step]}, storage_writer=target, checkpoint_id=ckpt
                    )
                    timed_save(samples, f"{tool}/{step}", folder, save)
                out = {"model": {k: torch.empty_like(v) for k, v in tuned.items()}}
                reader = CasnapReader(ckpt) if tool == "casnap" else dcp.FileSystemReader(ckpt)
                dcp.load(out, storage_reader=reader)
                exact = exact and same_state(out["model"], tuned)
    print(f"state: {about}, {args.repeats} repeat(s), medians")
    return table(samples, "FileSystemWriter", tuple(states), ("bytes",)), exact


def run_torch_checkpointing(args: argparse.Namespace, samples: Samples) -> Result:
    from torch_checkpointing import CheckpointManager
    from torch_checkpointing.config import SyncCheckpointSaverConfig
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    from casnap.integrations.torch_checkpointing import CasnapStorageConfig

    about, tuned, states = _dense_states(args, STEPS)
    exact = True
    for _ in range(args.repeats):
        with scratch_dir(args.workdir) as root:
            for tool in ("LocalFileSystemStorage", "casnap"):
                folder = os.path.join(root, tool)
                os.makedirs(folder)
                own = LocalFileSystemStorageConfig(use_direct_io=False)  # O_DIRECT fails here
                storage = CasnapStorageConfig(folder) if tool == "casnap" else own
                sync = SyncCheckpointSaverConfig()
                manager = CheckpointManager.Config(save=sync, storage_config=storage).build()
                for i, step in enumerate(states):
                    ckpt = os.path.join(folder, f"step_{i}")
                    save = functools.partial(manager.save, ckpt, {"model": states[step]})
                    timed_save(samples, f"{tool}/{step}", folder, save)
                load = functools.partial(manager.load, ckpt, {"model": None})
                out = timed_load(samples, f"{tool}/load", load)
                exact = exact and same_state(out["model"], tuned)
                manager.close()
    print(f"state: {about}, {args.repeats} repeat(s), medians")
    return table(samples, "LocalFileSystemStorage", LOADED, ("bytes",)), exact


# -- lightning: TorchCheckpointIO against CasnapCheckpointIO ------------------------------


def run_lightning(args: argparse.Namespace, samples: Samples) -> Result:
    import lightning as L
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from casnap.integrations.lightning import CasnapCheckpointIO

    class Timed(CheckpointIO):
        """Delegates to ``inner``, adding up the time and bytes of saves and removals."""

        def __init__(self, inner: Any) -> None:
            self.inner, self.seconds, self.written, self.saves = inner, 0.0, 0, 0

        def _measure(self, fn: Callable[..., Any], *a: Any) -> None:
            w0, t0 = proc_io()["wchar"], time.perf_counter()
            fn(*a)
            self.seconds += time.perf_counter() - t0
            self.written += proc_io()["wchar"] - w0

        def save_checkpoint(self, checkpoint: Any, path: Any, storage_options: Any = None) -> None:
            self.saves += 1
            self._measure(self.inner.save_checkpoint, checkpoint, path, storage_options)

        def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: Any = None):
            return self.inner.load_checkpoint(path, map_location, weights_only)

        def remove_checkpoint(self, path: Any) -> None:
            self._measure(self.inner.remove_checkpoint, path)

    class Net(L.LightningModule):
        def __init__(self, frozen: bool) -> None:
            super().__init__()
            w = args.width
            block = (
                torch.nn.Sequential(torch.nn.Linear(w, w), torch.nn.Tanh())
                for _ in range(args.layers)
            )
            self.backbone = torch.nn.Sequential(*block)
            self.head = torch.nn.Linear(w, w)
            if frozen:
                self.backbone.requires_grad_(False)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.head(self.backbone(x)), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=1e-4)

    if args.small:
        args.width, args.layers, args.repeats = 1024, 3, 1
    with scratch_dir(args.workdir) as scratch:
        os.environ["CASNAP_INDEX_DIR"] = os.path.join(scratch, "index")  # not the home dir
        for repeat in range(args.repeats):
            for model in ("frozen", "full"):
                for name, make in (("torch", TorchCheckpointIO), ("casnap", CasnapCheckpointIO)):
                    root = os.path.join(scratch, f"{model}-{name}-{repeat}")
                    settle(cold=False)
                    torch.manual_seed(0)
                    timed = Timed(make())
                    callback = ModelCheckpoint(
                        dirpath=f"{root}/ckpt", every_n_train_steps=args.every, save_top_k=2,
                        monitor="step", mode="max",
                    )  # fmt: skip
                    trainer = L.Trainer(
                        max_steps=args.steps, plugins=[timed], callbacks=[callback],
                        enable_progress_bar=False, logger=False, accelerator="cpu",
                        default_root_dir=root, enable_model_summary=False,
                    )  # fmt: skip
                    w = args.width
                    data = TensorDataset(torch.randn(64, w), torch.randn(64, w))
                    trainer.fit(Net(model == "frozen"), DataLoader(data, batch_size=8))
                    op = f"{name}/{model}"
                    samples.add(op, timed.seconds)
                    samples.count(op, "written", timed.written)
                    samples.count(op, "on disk", disk_usage(f"{root}/ckpt")[0])
                    samples.count(op, "saves", timed.saves)
    params = args.layers * (args.width * args.width + args.width) + args.width * (args.width + 1)
    saves = samples.counter("casnap/full", "saves")
    print(f"{params * 4 / MiB:.0f} MiB of fp32 weights (+ Adam state for the trained part), "
          f"{args.steps} steps, a save every {args.every} ({saves} saves), save_top_k=2, "
          f"median of {args.repeats}")  # fmt: skip
    return table(samples, "torch", ("frozen", "full"), ("written", "on disk")), None  # no load


# -- megatron: torch_dist against casnap's strategy ----------------------------------------


@contextlib.contextmanager
def _cuda_calls_patched(tool: str) -> Iterator[None]:
    """torch_dist only: its writer's two CUDA calls, made harmless on a CPU machine."""
    if tool != "torch_dist":
        yield
        return
    saved = (torch.cuda.synchronize, torch.cuda.current_device)
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment, return-value]  # a name
    try:
        yield
    finally:
        torch.cuda.synchronize, torch.cuda.current_device = saved


@contextlib.contextmanager
def one_gloo_rank(work: str) -> Iterator[None]:
    """A process group of this process alone (file rendezvous in ``work``)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{os.path.abspath(work)}/pg", rank=0,
                            world_size=1)  # fmt: skip
    try:
        yield
    finally:
        dist.destroy_process_group()


def _gpt(hidden: int, layers: int, seed: int) -> Any:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    cfg = TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=8,
                            use_cpu_initialization=True, pipeline_dtype=torch.float32)  # fmt: skip
    return GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=8192, max_sequence_length=512)


def _megatron_once(tool: str, root: str, args: argparse.Namespace, samples: Samples) -> bool:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import torch as td

    from casnap.integrations.megatron import CasnapLoadStrategy, CasnapSaveStrategy

    if tool == "casnap":
        save_strategy, load_strategy = CasnapSaveStrategy(), CasnapLoadStrategy()
    else:
        save_strategy = td.TorchDistSaveShardedStrategy("torch_dist", 1)
        load_strategy = td.TorchDistLoadShardedStrategy()
    model = _gpt(args.hidden, args.layers, seed=1)
    for it, step in enumerate(STEPS, start=1):
        if step == "sparse change":
            with torch.no_grad():
                model.decoder.layers[-1].mlp.linear_fc1.weight.add_(0.01)
                model.decoder.final_layernorm.weight.mul_(1.01)
        ckpt = os.path.join(root, f"iter_{it:07d}")
        os.makedirs(ckpt)
        with _cuda_calls_patched(tool):
            state = {"model": model.sharded_state_dict(), "iteration": it}
            save = functools.partial(
                dist_checkpointing.save, state, ckpt, sharded_strategy=save_strategy
            )
            timed_save(samples, f"{tool}/{step}", root, save)
    fresh = _gpt(args.hidden, args.layers, seed=2)
    want = {"model": fresh.sharded_state_dict()}
    load = functools.partial(dist_checkpointing.load, want, ckpt, sharded_strategy=load_strategy)
    fresh.load_state_dict(timed_load(samples, f"{tool}/load", load)["model"], strict=False)
    a, b = model.state_dict(), fresh.state_dict()
    return bool(a) and all(torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor))


def run_megatron(args: argparse.Namespace, samples: Samples) -> Result:
    from megatron.core import parallel_state as ps

    warnings.filterwarnings("ignore")
    exact = True
    with scratch_dir(args.workdir) as work, one_gloo_rank(work):
        ps.initialize_model_parallel(1, 1)
        params = _gpt(args.hidden, args.layers, 1).parameters()
        model_bytes = sum(t.numel() * t.element_size() for t in params)
        for r in range(args.repeats):
            for tool in alternating(r, ("torch_dist", "casnap")):
                root = os.path.join(work, f"{tool}-{r}")
                os.makedirs(root)
                exact = _megatron_once(tool, root, args, samples) and exact
    print(f"model {human_bytes(model_bytes)} fp32, medians of {args.repeats}")
    return table(samples, "torch_dist", LOADED, ("bytes",)), exact


# -- torchtitan: its DCP CheckpointManager against CasnapCheckpointManager -------------


def _titan_once(tool: str, root: str, base: State, head: list[str], samples: Samples) -> bool:
    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import default_adamw

    from casnap.integrations.torchtitan import CasnapCheckpointManager

    def build(state: State) -> tuple[torch.nn.Module, Any]:
        model = torch.nn.Module()
        for k, v in state.items():  # the state as the model's parameters
            model.register_parameter(k.replace(".", "_"), torch.nn.Parameter(v.clone()))
        opts = default_adamw().build(model_parts=[model])
        scheds = LRSchedulersContainer.Config().build(optimizers=opts, training_steps=10)
        manager = CasnapCheckpointManager if tool == "casnap" else CheckpointManager
        config = manager.Config(enable=True, interval=1, keep_latest_k=0)
        return model, config.build(
            dataloader=None, model_parts=[model], optimizers=opts, lr_schedulers=scheds,
            states={}, sd_adapter=None, base_folder=root,
        )  # fmt: skip

    model, ckpt = build(base)
    for step, name in enumerate(STEPS, start=1):
        if name == "sparse change":  # the last layer and the final norm
            with torch.no_grad():
                for k in head:
                    getattr(model, k.replace(".", "_")).add_(0.001)
        timed_save(samples, f"{tool}/{name}", root, functools.partial(ckpt.save, step))
    ckpt.close()
    fresh, loader = build({k: torch.zeros_like(v) for k, v in base.items()})
    timed_load(samples, f"{tool}/load", loader.load)
    loader.close()
    return same_state(dict(fresh.state_dict()), dict(model.state_dict()))


def run_torchtitan(args: argparse.Namespace, samples: Samples) -> Result:
    warnings.filterwarnings("ignore")  # DCP: no process group (one process, as torchtitan's)
    hidden, layers, shapes = transformer_shapes(int(args.size_gib * GiB))
    base = make_state(shapes)
    exact = True
    for r in range(args.repeats):
        for tool in alternating(r, ("torchtitan", "casnap")):
            with scratch_dir(args.workdir) as root:
                exact = _titan_once(tool, root, base, _head_keys(base), samples) and exact
    print(f"model {human_bytes(state_bytes(base))} fp32 (hidden {hidden}, {layers} layers), "
          f"AdamW state as torchtitan creates it (zeros), medians of {args.repeats}")  # fmt: skip
    return table(samples, "torchtitan", LOADED, ("bytes",)), exact


# -- deepspeed and accelerate: the default writer against casnap's on a fine-tune -------


def _frozen_mlp(width: int, layers: int, seed: int) -> torch.nn.Sequential:
    """A stack of Linear layers whose last alone trains (a fine-tune: saves share the rest)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    model[:-1].requires_grad_(False)
    return model


def _batch(width: int) -> torch.Tensor:
    """Eight random rows: a gradient whose rows differ (one row of ones repeats them)."""
    return torch.randn(8, width, generator=torch.Generator().manual_seed(width))


def _finetune(
    args: argparse.Namespace, samples: Samples, work: str, peer: str, hooks: dict[str, Any]
) -> tuple[bool, str]:
    """Per repeat and tool: build, step, the three saves, a load into a fresh build.

    ``hooks``: ``build(tool, seed)`` -> (handle, module), ``step(handle)``,
    ``save(handle, root, i)`` and ``load(handle, root)``.
    """
    exact = True
    for r in range(args.repeats):
        for tool in (peer, "casnap"):
            root, (obj, module) = os.path.join(work, f"{tool}-{r}"), hooks["build"](tool, 0)
            hooks["step"](obj)  # the optimizer state exists from the first save on
            for i, name in enumerate(STEPS):
                if name == "sparse change":
                    hooks["step"](obj)  # the last layer and its optimizer state change
                save = functools.partial(hooks["save"], obj, root, i)
                timed_save(samples, f"{tool}/{name}", root, save)
            want = {k: v.clone() for k, v in module.state_dict().items()}
            fresh, fmodule = hooks["build"](tool, 1)
            timed_load(samples, f"{tool}/load", functools.partial(hooks["load"], fresh, root))
            exact = exact and same_state(want, dict(fmodule.state_dict()))
    mib = args.width * (args.width + 1) * args.layers * 4 / MiB
    return exact, f"{mib:.0f} MiB fp32, last layer trained"


def run_deepspeed(args: argparse.Namespace, samples: Samples) -> Result:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import logging

    import deepspeed.ops

    from casnap.integrations.deepspeed import CasnapCheckpointEngine

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # gloo: nothing compiled
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 2}}
    cfg["optimizer"] = {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}}

    def build(tool: str, seed: int) -> tuple[Any, Any]:
        model = _frozen_mlp(args.width, args.layers, seed)
        params = [p for p in model.parameters() if p.requires_grad]
        eng = deepspeed.initialize(model=model, model_parameters=params, config=cfg)[0]
        if tool == "casnap":
            eng.checkpoint_engine = CasnapCheckpointEngine()
        return eng, eng.module

    def step(eng: Any) -> None:
        eng.backward(eng(_batch(args.width)).square().mean())
        eng.step()

    save = lambda e, root, i: e.save_checkpoint(root, f"t{i}")  # noqa: E731
    hooks = {"build": build, "step": step, "save": save, "load": lambda e, r: e.load_checkpoint(r)}
    with scratch_dir(args.workdir) as work, one_gloo_rank(work):
        exact, about = _finetune(args, samples, work, "TorchCheckpointEngine", hooks)
    print(f"{about} (ZeRO 2, one rank), medians of {args.repeats}")
    return table(samples, "TorchCheckpointEngine", LOADED, ("bytes",)), exact


def run_accelerate(args: argparse.Namespace, samples: Samples) -> Result:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState, PartialState

    from casnap.integrations.accelerate import CasnapAccelerator

    def build(tool: str, seed: int) -> tuple[Any, Any]:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        PartialState._reset_state()
        acc = (CasnapAccelerator if tool == "casnap" else Accelerator)(cpu=True)
        model = _frozen_mlp(args.width, args.layers, seed)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        model, opt = acc.prepare(model, opt)
        return (acc, model, opt), model

    def step(handle: tuple[Any, Any, Any]) -> None:
        acc, model, opt = handle
        acc.backward(model(_batch(args.width)).square().mean())
        opt.step()
        opt.zero_grad()

    def ckpt(root: str, i: int = len(STEPS) - 1) -> str:
        return os.path.join(root, f"checkpoint_{i}")  # the load reads the last

    save = lambda h, root, i: h[0].save_state(ckpt(root, i))  # noqa: E731
    hooks = {
        "build": build,
        "step": step,
        "save": save,
        "load": lambda h, r: h[0].load_state(ckpt(r)),
    }
    with scratch_dir(args.workdir) as work:
        exact, about = _finetune(args, samples, work, "Accelerator", hooks)
    print(f"{about} (one process), medians of {args.repeats}")
    return table(samples, "Accelerator", LOADED, ("bytes",)), exact


RUNS: dict[str, tuple[Callable[[argparse.Namespace, Samples], Result], str, dict[str, Any]]] = {
    "dcp": (run_dcp, "DCP's FileSystemWriter against casnap's DCP writer",
            {"size-gib": 0.5, "small": "a quick run: 0.05 GiB, 1 repeat"}),
    "lightning": (run_lightning, "TorchCheckpointIO against CasnapCheckpointIO",
                  {"small": "a quick run: 16 MiB, 1 repeat", "width": 2048, "layers": 15,
                   "steps": 24, "every": 4}),
    "megatron": (run_megatron, "Megatron-core's torch_dist against casnap's strategy",
                 {"hidden": 768, "layers": 6}),
    "torch_checkpointing": (run_torch_checkpointing, "its local storage against casnap's",
                            {"size-gib": 0.5, "small": "a quick run: 0.05 GiB, 1 repeat"}),
    "torchtitan": (run_torchtitan, "torchtitan's CheckpointManager against casnap's",
                   {"size-gib": 0.25}),
    "deepspeed": (run_deepspeed, "TorchCheckpointEngine against CasnapCheckpointEngine",
                  {"width": 2048, "layers": 12}),
    "accelerate": (run_accelerate, "Accelerator.save_state against CasnapAccelerator's",
                   {"width": 2048, "layers": 12}),
}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    sub = parser.add_subparsers(dest="framework", required=True)
    for name, (_, what, options) in RUNS.items():
        p = sub.add_parser(name, help=what)
        for flag, value in options.items():
            if isinstance(value, str):  # a switch, with its help
                p.add_argument(f"--{flag}", action="store_true", help=value)
            else:
                p.add_argument(f"--{flag}", type=type(value), default=value)
        p.add_argument("--repeats", type=int, default=3)
        p.add_argument("--workdir", default="bench-out/scratch")
        p.add_argument("--out", help="JSON path (default bench-out/<framework>.json)")
    args = parser.parse_args(argv)
    samples = Samples()
    text, exact = RUNS[args.framework][0](args, samples)
    print(text if exact is None else f"{text}\nloads bit-exact: {exact}")
    write_json(
        args.out or f"bench-out/{args.framework}.json",
        {"benchmark": args.framework, "machine": machine(), "args": vars(args), "exact": exact}
        | {"samples": samples.as_json()},
    )
    if exact is False:
        raise SystemExit("a checkpoint did not load back bit-exact")


if __name__ == "__main__":
    main()
