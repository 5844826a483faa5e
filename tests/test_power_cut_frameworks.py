"""Power cuts under the frameworks' backends: DeepSpeed, Accelerate, torch_checkpointing, DCP.

A child process (``python tests/test_power_cut_frameworks.py BACKEND MNT TMP NAME MODE``)
first checks what the earlier children left: every save in the log loads
bit-exact through the framework's own load path (DeepSpeed's
``load_checkpoint`` by tag and through its ``latest``, Accelerate's
``load_state``, torch_checkpointing's ``CheckpointManager.load``, ``dcp.load``
by ``casnap://`` id), the checkpoint the framework would pick as latest is
whole and not older than the last save that returned, and ``casnap verify
--read-data`` is clean. Then it trains a tiny model and saves every step into
a repository on tests/test_power_cut.py's ext4 (with the index and state
folder there), logging each save that returned (its state kept on another
file system before the save began). The power is cut right after its N-th
save returned (``after:N``), or by the test at a random moment (``random``);
``once``: one save after the check, loaded back, and exit. Root only.
"""

from __future__ import annotations

import io
import json
import os
import random
import subprocess
import sys
import time
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from test_power_cut import _differs, _mount, cut, ext4  # noqa: E402, F401  (ext4: the fixture)
from test_torchtitan_crash import CUT, _lines, power  # noqa: E402

BACKENDS = ("deepspeed", "accelerate", "torch_checkpointing", "dcp")
NEEDS = {"deepspeed": "deepspeed", "accelerate": "accelerate", "dcp": "fsspec"}
NEEDS["torch_checkpointing"] = "torch_checkpointing"  # the package each backend needs


# -- the backends: each saves, loads a save by name, and says what it would resume from ----
class _DeepSpeed:
    def __init__(self, root: Path, tmp: Path, seed: int) -> None:
        import torch.distributed as dist
        from deepspeed_helpers import engine, quiet

        from casnap.integrations.deepspeed import CasnapCheckpointEngine

        dist.init_process_group(
            "gloo", init_method=f"file://{tmp}/pg-{os.getpid()}", rank=0, world_size=1
        )
        quiet(0, 1)
        self.ckpt, self.step = str(root / "ds"), 0
        self.eng = engine(1, seed=seed)
        self.eng.checkpoint_engine = CasnapCheckpointEngine()

    def train(self) -> None:
        from deepspeed_helpers import train

        train(self.eng, 1, 0, self.step)
        self.step += 1

    def next_name(self, prefix: str) -> str:
        return f"{prefix}-{self.step}"

    def save(self, name: str) -> None:
        self.eng.save_checkpoint(self.ckpt, tag=name)

    def state(self) -> dict[str, Any]:
        from deepspeed_helpers import params

        return {
            "model": params(self.eng),
            "adam": self.eng.optimizer.optimizer.state_dict()["state"],
            "steps": self.eng.global_steps,
        }

    def load(self, name: str | None) -> str | None:
        """Load tag ``name`` (None: the tag in ``latest``); the tag loaded."""
        path, _ = self.eng.load_checkpoint(self.ckpt, tag=name)
        return None if path is None else os.path.basename(os.path.dirname(path))


class _Accelerate:
    def __init__(self, root: Path, tmp: Path, seed: int) -> None:
        from accelerate_helpers import setup

        from casnap.integrations.accelerate import checkpoint_folders

        self.root = root / "acc"
        self.parts = setup(str(self.root), seed=seed)
        done = checkpoint_folders(str(self.root / "checkpoints"))  # a resumed run's naming
        self.parts[0].project_configuration.iteration = 1 + max(
            (int(f.rsplit("_", 1)[1]) for f in done), default=-1
        )

    def train(self) -> None:
        from accelerate_helpers import train

        train(self.parts, 1)  # the loader's first batch each time: the state is what counts

    def next_name(self, prefix: str) -> str:
        return f"checkpoint_{self.parts[0].project_configuration.iteration}"

    def save(self, name: str) -> None:
        assert os.path.basename(self.parts[0].save_state()) == name

    def state(self) -> dict[str, Any]:
        from accelerate_helpers import params

        acc, model, opt, _, _, counter = self.parts
        return {"model": params(model), "adam": opt.state_dict()["state"], "n": counter.n}

    def load(self, name: str | None) -> str | None:
        from casnap.integrations.accelerate import _pointer, checkpoint_folders

        folder = None if name is None else str(self.root / "checkpoints" / name)
        if name is None:  # load_state() picks the newest complete folder: which one, for us
            folders = checkpoint_folders(str(self.root / "checkpoints"))
            if not folders:
                return None
            name = os.path.basename(([f for f in folders if _pointer(f)] or folders)[-1])
        self.parts[0].load_state(folder)
        return name


class _TorchCheckpointing:
    def __init__(self, root: Path, tmp: Path, seed: int) -> None:
        from test_torch_checkpointing import _manager, _Run

        from casnap.integrations.torch_checkpointing import CasnapStorageConfig

        self.root = root / "tc"
        self.run, self.manager = _Run(seed), _manager(self.root)
        self.storage = CasnapStorageConfig(str(self.root)).create_storage()

    def train(self) -> None:
        self.run.train(1)

    def next_name(self, prefix: str) -> str:
        return f"{prefix}-{self.run.step}"

    def save(self, name: str) -> None:
        self.manager.save(str(self.root / name), self.run.payload())

    def state(self) -> Any:
        return self.run.payload()

    def load(self, name: str | None) -> str | None:
        from test_torch_checkpointing import _load

        if name is None:  # the newest checkpoint the library lists
            names = self.storage.ls(self.root) if self.storage.exists(self.root) else []
            if not names:
                return None
            name = max(names, key=_order)
        self.run.restore(_load(self.manager, self.root / name))
        return name


class _DCP:
    def __init__(self, root: Path, tmp: Path, seed: int) -> None:
        import fsspec

        from casnap.integrations.dcp_fs import CasnapFileSystem

        fsspec.register_implementation("casnap", CasnapFileSystem, clobber=True)
        self.root, self.seed, self.step = root / "dcp", seed, 0
        self.loaded: dict[str, Any] | None = None

    def train(self) -> None:
        self.step += 1

    def next_name(self, prefix: str) -> str:
        return f"{prefix}-{self.step}"

    def save(self, name: str) -> None:
        import torch.distributed.checkpoint as dcp
        from test_dcp_fs import _state

        dcp.save(_state(self.seed * 1000 + self.step), checkpoint_id=f"casnap://{self.root}/{name}")

    def state(self) -> Any:
        from test_dcp_fs import _state

        return self.loaded if self.loaded is not None else _state(self.seed * 1000 + self.step)

    def load(self, name: str | None) -> str | None:
        import torch.distributed.checkpoint as dcp
        from test_dcp_fs import _blank

        import casnap

        if name is None:  # the newest snapshot: what `casnap log` shows first
            if not (self.root / ".casnap").exists():
                return None
            names = casnap.Repository(str(self.root)).snapshots()
            if not names:
                return None
            name = max(names, key=_order)
        self.loaded = _blank()
        dcp.load(self.loaded, checkpoint_id=f"casnap://{self.root}/{name}")
        return name


KINDS = {
    "deepspeed": _DeepSpeed,
    "accelerate": _Accelerate,
    "torch_checkpointing": _TorchCheckpointing,
    "dcp": _DCP,
}
REPOS = {"deepspeed": "ds", "accelerate": "acc/checkpoints", "torch_checkpointing": "tc"}
REPOS["dcp"] = "dcp"


def _order(name: str) -> tuple[int, ...]:
    """Saves in the order they were made: ``c<child>-<step>`` or ``checkpoint_<n>``."""
    if name.startswith("checkpoint_"):
        return (int(name.rsplit("_", 1)[1]),)
    child, step = name.split("-")
    return (int(child[1:]), int(step))


# -- the child: check what is there, then save until the cut -------------------------------
def _check(backend: str, b: Any, mnt: Path, tmp: Path) -> list[str]:
    """What the cuts lost of the saves logged, and whether the latest is whole."""
    from casnap.cli.app import main as cli

    saved, problems = [x for x in _lines(tmp / "saved.log") if x != CUT], []
    for name in saved:
        try:
            if b.load(name) != name:
                problems.append(f"{name}: not found")
                continue
        except Exception as exc:
            problems.append(f"{name}: {exc!r}")
            continue
        if where := _differs(
            b.state(), torch.load(tmp / "want" / f"{name}.pt", weights_only=False)
        ):
            problems.append(f"{name}: loads, but differs at {where}")
    try:
        latest = b.load(None)
    except Exception as exc:
        return [*problems, f"latest: {exc!r}"]
    if saved and (latest is None or _order(latest) < _order(saved[-1])):
        problems.append(f"latest is {latest}, older than {saved[-1]}, which returned")
    elif latest is not None:
        want = torch.load(tmp / "want" / f"{latest}.pt", weights_only=False)
        if where := _differs(b.state(), want):
            problems.append(f"latest {latest}: loads, but differs at {where}")
    out = io.StringIO()
    with redirect_stdout(out):
        code = cli(["verify", "--read-data", "--json", str(mnt / REPOS[backend])]) if saved else 0
    return problems + ([f"verify: {out.getvalue()}"] if code != 0 else [])


def child(backend: str, mnt: Path, tmp: Path, prefix: str, mode: str) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    seed = int(prefix[1:])
    b: Any = KINDS[backend](mnt, tmp, seed)
    problems = _check(backend, b, mnt, tmp)
    (tmp / f"problems-{prefix}.json").write_text(json.dumps(problems))
    if problems:
        sys.exit(3)
    b.loaded = None  # DCP: the state is made, not loaded (the others train on from it)
    for n in range(1, 10_000):
        b.train()
        name = b.next_name(prefix)
        torch.save(b.state(), tmp / "want" / f"{name}.pt")  # before the save: a save the
        b.save(name)  # cut caught after its commit still has what it should hold
        with open(tmp / "saved.log", "a") as fh:
            fh.write(f"{name}\n")
        if mode == f"after:{n}":
            cut(mnt)
            with open(tmp / "saved.log", "a") as fh:
                fh.write(CUT + "\n")
            time.sleep(600)
        if mode == "once":
            problems = _check(backend, b, mnt, tmp)
            (tmp / f"problems-{prefix}.json").write_text(json.dumps(problems))
            sys.exit(3 if problems else 0)
        time.sleep(random.random() * 0.1)


# -- the test ------------------------------------------------------------------------
class Cuts:
    def __init__(self, backend: str, image: Path, mnt: Path, tmp: Path) -> None:
        self.backend, self.image, self.mnt, self.tmp = backend, image, mnt, tmp
        (tmp / "want").mkdir()
        self.children = 0
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)]),
            "CASNAP_INDEX_DIR": str(mnt / "index"),
            "CASNAP_STATE_DIR": str(mnt / "state"),
            "DS_ACCELERATOR": "cpu",
        }

    def _saved(self) -> int:
        return sum(x != CUT for x in _lines(self.tmp / "saved.log"))

    def run(self, mode: str, rng: random.Random) -> list[str]:
        """One child in ``mode``; what its check found (after ``once``: also of its save)."""
        prefix, log = f"c{self.children}", self.tmp / "saved.log"
        self.children += 1
        argv = [sys.executable, __file__, self.backend, str(self.mnt), str(self.tmp), prefix, mode]
        proc = subprocess.Popen(argv, env=self.env)
        problems = self.tmp / f"problems-{prefix}.json"
        try:
            before, deadline = self._saved(), time.monotonic() + 180
            while proc.poll() is None and not (
                CUT in _lines(log)
                if mode.startswith("after")
                else mode == "random" and self._saved() >= before + 2
            ):
                assert time.monotonic() < deadline, "the saves made no progress"
                time.sleep(0.01)
            alive = proc.poll() is None
            if mode == "random" and alive:
                time.sleep(rng.random() * 0.3)  # mid-save, mid-commit or between saves
                cut(self.mnt)
            if mode == "once":
                proc.wait(180)
        finally:
            proc.kill()
            proc.wait(60)
        found = json.loads(problems.read_text()) if problems.exists() else ["the child died"]
        if mode != "once" and not found:
            assert alive, f"the child ended ({proc.returncode}) before the cut"
            log.write_text("".join(f"{x}\n" for x in _lines(log) if x != CUT))
            subprocess.run(["umount", str(self.mnt)], check=True)
            _mount(self.image, self.mnt)  # the journal replays
        return found


@power
@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_save_that_returned_survives_power_cuts_and_latest_is_whole(
    ext4,  # noqa: F811
    tmp_path,
    backend,
):
    pytest.importorskip(NEEDS[backend])
    image, mnt = ext4
    cuts, rng = Cuts(backend, image, mnt, tmp_path), random.Random(backend)
    for mode in (f"after:{rng.randint(1, 2)}", "random"):
        assert cuts.run(mode, rng) == [], mode
    assert cuts.run("once", rng) == []  # checked after the last cut, then a new save, checked
    assert cuts._saved() >= 4


if __name__ == "__main__":
    child(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4], sys.argv[5])
