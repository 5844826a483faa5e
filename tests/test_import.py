"""``casnap import`` and ``import_checkpoint``: existing checkpoints as snapshots (#15 point 2).

Every fixture is written here with the real libraries (``dcp.save`` with
``FileSystemWriter``, ``safetensors.torch.save_file``, ``torch.save``); the
command line runs as the real ``casnap`` executable.
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import take_stats
from safetensors.torch import save_file
from test_cli_contract import casnap, error_line

from casnap import Repository, Snapshot
from casnap.integrations.importers import (
    DamagedSourceError,
    SourceFormatError,
    SourceNotFoundError,
    import_checkpoint,
)

REPO_ROOT = Path(__file__).resolve().parents[1]


def tensors(seed: int = 0, n: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {f"layers.{i}.weight": torch.randn(64, 32, generator=g) for i in range(n)}
    out["embed.weight"] = torch.randn(100, 16, generator=g).to(torch.bfloat16)
    out["steps"] = torch.arange(7, dtype=torch.int64)
    return out


def assert_same(snap: Snapshot, expected: dict[str, torch.Tensor], prefix: str = "0/model") -> None:
    for name, t in expected.items():
        got = snap.read_object(f"{prefix}/{name}")
        assert got.dtype == t.dtype and torch.equal(got, t), name


def dcp_save(state: dict, path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)


# -- each source round-trips ---------------------------------------------------------


def test_safetensors_file_round_trips_and_records_its_source(tmp_path):
    t = tensors()
    save_file(t, tmp_path / "m.safetensors", metadata={"format": "pt"})
    seen = []
    snap = import_checkpoint(
        tmp_path / "m.safetensors",
        tmp_path / "repo" / "v1",
        metadata={"step": 0},
        progress=lambda d, n: seen.append((d, n)),
    )
    assert_same(snap, t)
    meta = Snapshot(str(tmp_path / "repo" / "v1")).metadata
    assert meta["step"] == 0
    assert meta["import"] == {
        "format": "safetensors",
        "path": str(tmp_path / "m.safetensors"),
        "safetensors_metadata": {"format": "pt"},
    }
    total = sum(x.numel() * x.element_size() for x in t.values())
    assert seen[-1] == (total, total)


def test_restore_into_a_module(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    save_file(model.state_dict(), tmp_path / "m.safetensors")
    import_checkpoint(tmp_path / "m.safetensors", tmp_path / "repo" / "v1")
    other = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    Snapshot(str(tmp_path / "repo" / "v1")).restore({"model": other}, strict=True)
    for (k, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), k


def test_hf_sharded_directory_with_index(tmp_path):
    t = tensors(n=6)
    names = sorted(t)
    hf = tmp_path / "hf"
    hf.mkdir()
    shards = {
        "model-00001-of-00002.safetensors": names[:3],
        "model-00002-of-00002.safetensors": names[3:],
    }
    for file, keys in shards.items():
        save_file({k: t[k] for k in keys}, hf / file)
    weight_map = {k: f for f, keys in shards.items() for k in keys}
    (hf / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 1}, "weight_map": weight_map})
    )
    config = {"model_type": "llama", "hidden_size": 16}
    (hf / "config.json").write_text(json.dumps(config))
    snap = import_checkpoint(hf, tmp_path / "repo" / "hf")
    assert_same(snap, t)
    assert set(snap.read_object("0/model")) == set(t)
    record = snap.metadata["import"]
    assert record["format"] == "hf" and record["config"] == config
    assert record["files"] == sorted(shards) and record["index"] == "model.safetensors.index.json"


def test_hf_index_naming_a_missing_tensor_is_refused(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"a": torch.ones(2)}, hf / "s1.safetensors")
    (hf / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors"}})
    )
    with pytest.raises(DamagedSourceError, match="'b'"):
        import_checkpoint(hf, tmp_path / "repo" / "x")
    assert not (tmp_path / "repo").exists()


def test_dcp_directory_keeps_its_nesting(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "extra": {"step": 7, "tags": ["a", "b"]}}
    dcp_save(state, tmp_path / "ckpt")
    snap = import_checkpoint(tmp_path / "ckpt", tmp_path / "repo" / "dcp")
    assert snap.read_object("0/extra") == {"step": 7, "tags": ["a", "b"]}
    other = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    Snapshot(str(tmp_path / "repo" / "dcp")).restore({"model": other})
    for (k, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), k
    assert snap.metadata["import"]["format"] == "dcp"


def test_torch_save_file_dict_of_dicts_and_flat(tmp_path):
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    torch.save(
        {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 3},
        tmp_path / "ckpt.pt",
    )
    snap = import_checkpoint(tmp_path / "ckpt.pt", tmp_path / "repo" / "full")
    assert snap.read_object("0/epoch") == 3
    model2, opt2 = torch.nn.Linear(8, 4), None
    opt2 = torch.optim.Adam(model2.parameters())
    Snapshot(str(tmp_path / "repo" / "full")).restore({"model": model2, "optimizer": opt2})
    assert torch.equal(model2.weight, model.weight)
    moment = opt.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], moment)
    t = tensors()
    torch.save(t, tmp_path / "flat.pt")
    assert_same(import_checkpoint(tmp_path / "flat.pt", tmp_path / "repo" / "flat"), t)


def test_legacy_torch_save_file_is_read_whole(tmp_path, caplog):
    t = tensors()
    torch.save(t, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    with caplog.at_level("WARNING"):
        snap = import_checkpoint(tmp_path / "old.pt", tmp_path / "repo" / "old")
    assert_same(snap, t)
    assert snap.metadata["import"]["format"] == "torch-legacy"
    assert "read whole into memory" in caplog.text


# -- dedup ---------------------------------------------------------------------------


def test_reimport_and_shared_tensors_write_nothing_twice(tmp_path):
    big = {f"w{i}": torch.randn(256, 256) for i in range(4)}  # 256 KiB each: loose chunks
    save_file(big, tmp_path / "base.safetensors")
    first = import_checkpoint(tmp_path / "base.safetensors", tmp_path / "repo" / "a")
    assert take_stats(first).raw_bytes_written == 4 * 256 * 256 * 4
    again = import_checkpoint(tmp_path / "base.safetensors", tmp_path / "repo" / "b")
    assert take_stats(again).raw_bytes_written == 0
    assert take_stats(again).stored_bytes_written == 0
    # a fine-tune: one tensor changed, one added, in a differently laid out file
    tuned = {**big, "w1": big["w1"] + 1, "head": torch.randn(256, 256)}
    save_file(dict(reversed(tuned.items())), tmp_path / "tuned.safetensors")
    third = import_checkpoint(tmp_path / "tuned.safetensors", tmp_path / "repo" / "c")
    assert take_stats(third).raw_bytes_written == 2 * 256 * 256 * 4
    du = Repository(str(tmp_path / "repo")).du()
    assert du.logical_bytes == (4 + 4 + 5) * 256 * 256 * 4
    assert du.stored_bytes < 6.2 * 256 * 256 * 4  # 6 distinct tensors stored once each


# -- bad input through the real executable -------------------------------------------


def test_cli_imports_and_reports(tmp_path):
    save_file(tensors(), tmp_path / "m.safetensors")
    code, out, err = casnap(tmp_path, "--json", "import", "m.safetensors", "repo/v1")
    assert code == 0, err
    data = json.loads(out)
    assert data["format"] == "safetensors" and data["tensors"] == 6
    assert data["raw_bytes_written"] == data["logical_bytes"] > 0
    assert data["new_bytes"] == data["stored_bytes_written"] > 0  # what `log` shows as new
    code, out, err = casnap(tmp_path, "import", "m.safetensors", "repo/v2")
    assert code == 0 and "6 tensors" in out and "0 B new" in out, (out, err)


class Opaque:
    """A class ``weights_only`` loading refuses."""


def _nothing_committed(tmp_path: Path) -> None:
    refs = tmp_path / "repo" / ".casnap" / "refs"
    assert not refs.exists() or not any(refs.rglob("*"))


@pytest.mark.parametrize(
    "case, code, words",
    [
        ("missing", 3, "no such file or directory"),
        ("not-a-checkpoint", 2, "not a safetensors file, a torch.save file"),
        ("empty-dir", 2, "neither a DCP .metadata file nor *.safetensors"),
        ("truncated", 4, "truncated: tensor"),
        ("pickle", 2, "holds a pickled test_import.Opaque"),
        ("counter", 2, "holds a collections.Counter, which casnap stores only by pickling"),
        ("truncated-zip", 4, "torch.load failed"),
    ],
)
def test_cli_bad_input(tmp_path, case, code, words):
    save_file(tensors(), tmp_path / "good.safetensors")
    src = {
        "missing": "nope.safetensors",
        "not-a-checkpoint": "notes.txt",
        "empty-dir": "d",
        "truncated": "cut.safetensors",
        "pickle": "obj.pt",
        "truncated-zip": "cut.pt",
        "counter": "counter.pt",
    }[case]
    (tmp_path / "notes.txt").write_text("hello, not a checkpoint\n")
    (tmp_path / "d").mkdir()
    data = (tmp_path / "good.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
    torch.save({"w": torch.ones(2), "o": Opaque()}, tmp_path / "obj.pt")
    torch.save({"w": torch.ones(2), "c": collections.Counter("ab")}, tmp_path / "counter.pt")
    torch.save(tensors(), tmp_path / "full.pt")
    (tmp_path / "cut.pt").write_bytes((tmp_path / "full.pt").read_bytes()[:2000])
    got, out, err = casnap(tmp_path, "import", src, "repo/x")
    assert got == code, err
    assert words in error_line(err) and out == ""
    _nothing_committed(tmp_path)


def test_dcp_metadata_that_would_run_code_is_refused(tmp_path):
    dcp_save({"model": {"w": torch.ones(3)}}, tmp_path / "ckpt")
    (tmp_path / "ckpt" / ".metadata").write_bytes(
        b"cos\nsystem\n(S'touch " + str(tmp_path / "pwned").encode() + b"'\ntR."
    )
    with pytest.raises(SourceFormatError, match="os.system"):
        import_checkpoint(tmp_path / "ckpt", tmp_path / "repo" / "x")
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "repo").exists()


def test_python_errors_are_the_builtin_kinds(tmp_path):
    with pytest.raises(FileNotFoundError):
        import_checkpoint(tmp_path / "missing", tmp_path / "repo" / "x")
    assert issubclass(SourceNotFoundError, FileNotFoundError)
    assert issubclass(SourceFormatError, ValueError) and issubclass(DamagedSourceError, ValueError)


# -- memory ------------------------------------------------------------------------

# VmHWM, this process's peak RSS (ru_maxrss would include what the forking pytest held).
_MEASURE = """
import re, sys, psutil, torch, torch.distributed.checkpoint
from casnap.integrations.importers import import_checkpoint
base = psutil.Process().memory_info().rss
import_checkpoint(sys.argv[1], sys.argv[2], memory_budget_bytes=int(sys.argv[3]))
status = open("/proc/self/status").read()
print(int(re.search(r"VmHWM:\\s+(\\d+) kB", status).group(1)) * 1024 - base)
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux's VmHWM")
@pytest.mark.parametrize("kind", ["safetensors", "torch", "dcp"])
def test_peak_memory_is_bounded_by_the_budget_not_the_checkpoint(tmp_path, kind):
    """A 96 MiB checkpoint imported under an 8 MiB budget: the process grows by the
    budget plus a constant (about 3-12 MiB seen), not by the checkpoint. Without
    dropping hashed pages it grew by the whole file (safetensors, torch)."""
    g = torch.Generator().manual_seed(1)
    state = {f"layer.{i}.weight": torch.randn(1024, 1024, generator=g) for i in range(24)}
    src = tmp_path / {"safetensors": "m.safetensors", "torch": "m.pt", "dcp": "ckpt"}[kind]
    if kind == "safetensors":
        save_file(state, src)
    elif kind == "torch":
        torch.save(state, src)
    else:
        dcp_save({"model": state}, src)
    del state
    budget = 8 << 20
    done = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(src), str(tmp_path / "r" / "x"), str(budget)],
        capture_output=True,
        text=True,
        timeout=300,
        env={
            "PYTHONPATH": str(REPO_ROOT),
            "PATH": "/usr/bin:/bin",
            "CASNAP_INDEX_DIR": str(tmp_path / "index"),
        },
    )
    assert done.returncode == 0, done.stderr
    grew = int(done.stdout.split()[-1])
    assert grew < budget + (24 << 20), f"grew {grew >> 20} MiB importing 96 MiB"
