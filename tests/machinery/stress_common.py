"""What the phases of ``stress.py`` share: the model, checksums, the CLI, child processes.

The model is small (about 1.4 MiB) and shaped so that a take writes every kind
of object: loose raw chunks (the embedding and layer weights, 64 KiB chunks),
zstd frames (an int64 counter that compresses) and packed frames (biases and
layernorms). A "training step" changes a few of its tensors in place, so
successive snapshots share most chunks.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import blake3
import torch

ROOT = Path(__file__).resolve().parents[2]
CHUNK = 64 * 1024
LAYERS = 4


def model_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    state = {
        "emb": torch.randn(4096, 64, generator=g),
        "counter": torch.arange(16_384, dtype=torch.int64),
    }
    for i in range(LAYERS):
        state[f"l{i}.w"] = torch.randn(128, 128, generator=g)
        state[f"l{i}.b"] = torch.randn(128, generator=g)
        state[f"l{i}.ln"] = torch.ones(128)
    return state


def train_step(state: dict[str, torch.Tensor], seed: int) -> None:
    """Change the state in place the way a step of training would, partly."""
    g = torch.Generator().manual_seed(seed)
    layer = seed % LAYERS
    state[f"l{layer}.w"].add_(torch.randn(128, 128, generator=g), alpha=0.01)
    state[f"l{layer}.b"].add_(torch.randn(128, generator=g), alpha=0.01)
    row = int(torch.randint(0, 4096 - 64, (1,), generator=g))
    state["emb"][row : row + 64].add_(torch.randn(64, 64, generator=g), alpha=0.01)
    state["counter"].add_(1)


def template(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Targets of the same shapes, filled with a pattern no snapshot holds."""
    return {k: torch.full_like(v, -7) for k, v in state.items()}


def checksums(state: dict[str, torch.Tensor]) -> dict[str, str]:
    return {
        k: blake3.blake3(v.contiguous().numpy().tobytes()).hexdigest()
        for k, v in sorted(state.items())
    }


def app(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    from casnap import StateDict

    return {"m": StateDict(state)}


def restored_sums(repo: Any, name: str, shape_of: dict[str, torch.Tensor]) -> dict[str, str]:
    """Restore ``name`` into fresh targets and return their checksums (raises as restore does)."""
    from casnap import Snapshot

    out = template(shape_of)
    Snapshot(f"{repo.url}/{name}", repository=repo).restore(app(out))
    return checksums(out)


class Sidecar:
    """An append-only JSON-lines record outside the repository, fsynced per line."""

    def __init__(self, path: str | Path) -> None:
        self.fh = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed by the process's death)

    def write(self, **record: Any) -> None:
        self.fh.write(json.dumps(record) + "\n")
        self.fh.flush()
        os.fsync(self.fh.fileno())


def read_sidecar(path: str | Path) -> list[dict[str, Any]]:
    """Complete lines only: a SIGKILL can cut the last one short."""
    if not Path(path).exists():
        return []
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return records


def casnap_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 300
) -> tuple[int, Any]:
    """Run ``casnap ARGS --json`` as a user would; (exit code, parsed JSON or the text)."""
    code = "import sys; from casnap.cli import main; sys.exit(main())"
    full_env = {**os.environ, **(env or {}), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", code, *args, "--json"],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
    )
    try:
        return proc.returncode, json.loads(proc.stdout)
    except json.JSONDecodeError:
        return proc.returncode, (proc.stdout + proc.stderr)[-2000:]


_CONTEXT: Any = None


def fast_children() -> Any:
    """A forkserver context with torch and casnap imported once: children start in
    milliseconds, so a kill can land anywhere in a take rather than in `import torch`."""
    global _CONTEXT
    if _CONTEXT is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(
            ["torch", "casnap.api.snapshot", "casnap.api.checkpointer", "stress_common"]
        )
        _CONTEXT = ctx
    return _CONTEXT


def enter_child(env: dict[str, str]) -> None:
    """First thing in every child: its settings come from the environment it is given."""
    os.environ.update(env)
    torch.set_num_threads(1)


class Deadline:
    """A count, a time limit, or both: whichever ends first."""

    def __init__(self, count: int | None, seconds: float | None) -> None:
        self.count, self.end = count, None if seconds is None else time.monotonic() + seconds
        self.done = 0

    def more(self) -> bool:
        if self.count is not None and self.done >= self.count:
            return False
        return self.end is None or time.monotonic() < self.end
