"""casnap's Megatron-core strategies with the real library, one rank (gloo, CPU).

A 2-layer Megatron GPT is built in a spawned rank process (Megatron keeps its
parallel layout in module globals); its sharded state dict, plus common state
and a ShardedObject, is saved through ``dist_checkpointing.save`` with
:class:`CasnapSaveStrategy` and loaded back with ``dist_checkpointing.load``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_harness import run_ranks
from megatron_helpers import (
    build,
    check_loaded,
    env_quiet,
    full_tensors,
    main_boxes,
    megatron_missing,
    sharded_state,
)

REPO = str(Path(__file__).resolve().parents[1])

pytestmark = pytest.mark.skipif(megatron_missing() is not None, reason=str(megatron_missing()))


def _save_twice_and_load(rank: int, world: int, root: str) -> dict[str, Any]:
    env_quiet()
    from megatron.core import dist_checkpointing

    from casnap.integrations.megatron import CasnapLoadStrategy, CasnapSaveStrategy, load_common

    model = build(tp=1)
    strategy = CasnapSaveStrategy()
    out: dict[str, Any] = {"stats": [], "boxes": []}
    _torch_dist_save(sharded_state(model, 1), os.path.join(root + "-torch_dist", "iter_0000001"))
    for it, step in ((1, 1), (2, 2), (3, 2)):
        if it == 2:  # a training step that changed a few tensors
            with torch.no_grad():
                model.decoder.layers[1].mlp.linear_fc1.weight.add_(1.0)
                model.decoder.final_layernorm.bias.sub_(0.5)
        ckpt = os.path.join(root, f"iter_{it:07d}")
        os.makedirs(ckpt, exist_ok=True)
        sd = sharded_state(model, step)
        out["boxes"].append(main_boxes(sd))
        dist_checkpointing.save(sd, ckpt, sharded_strategy=strategy)
        out["stats"].append(strategy.last_write_stats)
    loads = []
    for it in (1, 2):
        ckpt = os.path.join(root, f"iter_{it:07d}")
        template = sharded_state(build_like(model), 0)
        explicit = dist_checkpointing.load(template, ckpt, sharded_strategy=CasnapLoadStrategy())
        template = sharded_state(build_like(model), 0)
        default = dist_checkpointing.load(template, ckpt)  # found from metadata.json
        loads.append((explicit, default, sharded_state(build_like(model), 0)))
    out["checked"] = []
    for i, (explicit, default, template) in enumerate(loads):
        full = full_tensors([out["boxes"][i]])
        out["checked"].append(check_loaded(explicit, template, full))
        check_loaded(default, template, full)
        assert explicit["step"] == i + 1 and default["step"] == i + 1  # common state
        assert explicit["rng"] == {"tp_rank": 0, "seed": 7}  # the ShardedObject
    # the snapshot's own copy of common.pt, for a directory that lost it
    assert load_common(os.path.join(root, "iter_0000002"))["step"] == 2
    return out


def _torch_dist_save(sd: dict[str, Any], ckpt: str) -> None:
    """Megatron's own torch_dist save, which assumes CUDA in two calls: patched here only."""
    from megatron.core import dist_checkpointing

    os.makedirs(ckpt)
    cuda = (torch.cuda.synchronize, torch.cuda.current_device)
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment, return-value]  # a device name
    try:
        dist_checkpointing.save(sd, ckpt)  # the default: torch_dist
    finally:
        torch.cuda.synchronize, torch.cuda.current_device = cuda


def build_like(model: Any) -> Any:
    """A fresh model of the same layout with other values (what a load must overwrite)."""
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    return build(tp=1, seed=99)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("megatron") / "run1"
    root.mkdir()
    [outcome] = run_ranks(1, _save_twice_and_load, str(root), timeout=600)
    assert outcome.error_type == "", outcome.error_text
    return root, outcome.value


def test_saves_and_loads_bit_exact_through_dist_checkpointing(saved: Any) -> None:
    _, out = saved
    assert out["checked"][0] == out["checked"][1] > 20  # every ShardedTensor of the model


def test_a_step_writes_only_what_changed_and_an_unchanged_resave_nothing(saved: Any) -> None:
    _, out = saved
    first, changed, unchanged = out["stats"]
    assert first.raw_bytes_written > 100_000  # the whole model
    # fc1 of layer 1 (64 KiB) and the final layer norm's bias changed, plus common.pt
    assert 0 < changed.raw_bytes_written < first.raw_bytes_written / 3
    assert unchanged.chunks_written == 0 and unchanged.stored_bytes_written == 0


def test_each_save_is_a_snapshot_casnap_tools_work_on(saved: Any) -> None:
    from casnap.api.repository import Repository

    root, _ = saved
    repo = Repository(str(root))
    assert sorted(repo.snapshots()) == ["iter_0000001", "iter_0000002", "iter_0000003"]
    log = {line.name: line for line in repo.log()}
    assert [log[f"iter_000000{i}"].step for i in (1, 2, 3)] == [1, 2, 3]
    assert log["iter_0000003"].new_bytes == 0
    report = repo.verify(read_data=True)
    assert report.ok, report
    changed = {d.key for d in repo.diff("iter_0000001", "iter_0000002") if d.status == "changed"}
    # layers are stacked by Megatron (a prepended axis): one entry holds every layer's fc1
    assert changed == {
        "0/model.decoder.layers.mlp.linear_fc1.weight",
        "0/model.decoder.final_layernorm.bias",
        "0/__megatron_common__.pt",  # the step in the common state
    }
    same = repo.diff("iter_0000002", "iter_0000003")
    assert all(d.status == "unchanged" for d in same), same
    # the directory Megatron wrote: its metadata, common.pt and casnap's pointer
    files = sorted(os.listdir(root / "iter_0000002"))
    assert files == ["casnap.json", "common.pt", "metadata.json"]


def test_casnap_import_reads_a_torch_dist_checkpoint_bit_exact(saved: Any) -> None:
    from casnap.api.repository import Repository
    from casnap.api.snapshot import Snapshot

    root, out = saved
    src = Path(f"{root}-torch_dist") / "iter_0000001"
    assert (src / ".metadata").exists() and (src / "common.pt").exists()
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "from casnap.cli import main; main()",
            "import",
            str(src),
            str(root / "td_iter_0000001"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    assert done.returncode == 0, done.stderr
    full = full_tensors([out["boxes"][0]])
    snap = Snapshot(str(root / "td_iter_0000001"))
    for key, tensor in full.items():  # Megatron's sharded keys, under rank 0
        assert torch.equal(snap.read_object(f"0/{key}"), tensor), key
    repo = Repository(str(root))
    assert repo.log()[-1].name == "td_iter_0000001" and repo.verify(read_data=True).ok


def test_du_retention_and_gc_keep_what_remains_readable(saved: Any, tmp_path: Path) -> None:
    """The maintenance commands on Megatron saves, on a copy of the repository."""
    import shutil

    from casnap.api.repository import Repository
    from casnap.ops.retention import KeepLast, RetentionPolicy

    root, _ = saved
    copy = tmp_path / "run1"
    shutil.copytree(root, copy)
    repo = Repository(str(copy))
    for other in [n for n in repo.snapshots() if not n.startswith("iter_")]:
        repo.delete(other)  # an import test may have added its own snapshot to this repository
    keep = repo.snapshot("iter_0000003")
    keys = [k for k in keep.get_manifest() if k.startswith("0/model.") and "_extra" not in k]
    before = {k: keep.read_object(k) for k in keys}
    usage = repo.du()
    assert usage.snapshots == 3 and usage.logical_bytes > 2 * usage.stored_bytes  # dedup
    result = repo.retain(RetentionPolicy(KeepLast(1)))
    assert sorted(result.deleted) == ["iter_0000001", "iter_0000002"]
    freed = repo.gc(grace_seconds=0)
    assert freed.bytes_freed > 0  # what only the older saves used
    assert repo.snapshots() == ["iter_0000003"] and repo.verify(read_data=True).ok
    keep = repo.snapshot("iter_0000003")
    assert all(torch.equal(keep.read_object(k), before[k]) for k in keys)
