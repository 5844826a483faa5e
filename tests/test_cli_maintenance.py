"""retain, tag, gc and export from the command line."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from casnap import Repository, Snapshot, StateDict
from casnap.cli.app import main


def run(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out


@pytest.fixture
def repo_dir(tmp_path) -> str:
    root = str(tmp_path / "repo")
    state = StateDict(w=torch.randn(100_000), b=torch.randn(10))
    for step in range(1, 7):
        state["w"].add_(1.0)  # every snapshot has its own big chunks
        Snapshot.take(
            f"{root}/s{step}",
            {"m": state},
            settings={"chunk_size": 65536},
            metadata={"step": step, "metrics": {"loss": abs(step - 3.2)}},
        )
    return root


def test_every_maintenance_command_has_help(capsys):
    for cmd in ["retain", "gc", "tag", "export"]:
        with pytest.raises(SystemExit) as info:
            main([cmd, "--help"])
        assert info.value.code == 0 and f"usage: casnap {cmd}" in capsys.readouterr().out


def test_retain_plans_then_deletes_refs_and_gc_reclaims(capsys, repo_dir):
    code, out = run(capsys, "tag", repo_dir, "add", "golden", "s1")
    assert code == 0 and "s1" in out
    args = ["retain", repo_dir, "--keep-last", "2", "--keep-tagged", "--keep-best", "1:loss:min"]
    code, out = run(capsys, *args, "--dry-run", "--json")
    plan = json.loads(out)
    assert code == 0 and sorted(plan["delete"]) == ["s2", "s4"]
    assert Repository(repo_dir).snapshots() == [f"s{i}" for i in range(1, 7)]
    code, out = run(capsys, *args)
    assert code == 0 and Repository(repo_dir).snapshots() == ["s1", "s3", "s5", "s6"]
    before = sum(len(f) for _, _, f in os.walk(os.path.join(repo_dir, ".casnap", "chunks")))
    code, out = run(capsys, "gc", repo_dir, "--grace", "0", "--dry-run", "--json")
    assert code == 0 and json.loads(out)["plan"]["bytes_to_free"] > 0
    code, out = run(capsys, "gc", repo_dir, "--grace", "0", "--json")
    assert code == 0
    after = sum(len(f) for _, _, f in os.walk(os.path.join(repo_dir, ".casnap", "chunks")))
    assert after < before
    code, out = run(capsys, "verify", repo_dir, "--read-data")
    assert code == 0 and "OK" in out
    code, out = run(capsys, "tag", repo_dir, "ls", "--json")
    assert json.loads(out)["golden"]["snapshot"] == "s1"
    code, out = run(capsys, "tag", repo_dir, "rm", "golden")
    assert code == 0 and json.loads(run(capsys, "tag", repo_dir, "ls", "--json")[1]) == {}


def test_retain_refuses_to_delete_everything(capsys, repo_dir):
    code = main(["retain", repo_dir])  # no rule at all: bad usage
    assert code == 2 and "--keep-last" in capsys.readouterr().err
    code = main(["retain", repo_dir, "--keep-tagged"])  # a rule that keeps none of them
    err = capsys.readouterr().err
    assert code == 2 and "--allow-delete-all" in err and "allow_delete_all" not in err
    assert len(Repository(repo_dir).snapshots()) == 6


def test_export_both_formats(capsys, repo_dir, tmp_path):
    out_st = str(tmp_path / "s6.safetensors")
    out_pt = str(tmp_path / "s6.pt")
    assert run(capsys, "export", f"{repo_dir}/s6", out_st)[0] == 0
    assert run(capsys, "export", f"{repo_dir}/s6", out_pt, "--key", "0/m")[0] == 0
    expected = Snapshot(f"{repo_dir}/s6").read_object("0/m")
    st = load_file(out_st)
    pt = torch.load(out_pt, weights_only=True)
    assert torch.equal(st["m/w"], expected["w"]) and torch.equal(pt["w"], expected["w"])
