"""``diff`` reads right and a key the snapshot lacks is "not found", through the real
executable: natural key order, values counted (not containers), ``--plot`` prints
a summary whose counts its title repeats, and ``--key``/``export --key`` exit 3
with the nearest keys."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from casnap import Session, Snapshot, StateDict
from casnap.errors import MissingKeyError

REPO_ROOT = Path(__file__).resolve().parents[1]
CASNAP = str(Path(sys.executable).parent / "casnap")


def casnap(cwd: Path, *argv: str) -> tuple[int, str, str]:
    """The real executable running this worktree's code: (exit code, stdout, stderr)."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "CASNAP_INDEX_DIR": str(cwd / "index")}
    done = subprocess.run(
        [CASNAP, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert "Traceback" not in done.stderr, done.stderr
    return done.returncode, done.stdout, done.stderr


@pytest.fixture
def pair(tmp_path) -> tuple[str, str]:
    """Two snapshots of 12 layers: every tensor changes, one scalar stays."""
    state = StateDict(**{f"layer{i}": torch.randn(64) for i in range(12)}, epoch=1)
    session = Session()
    Snapshot.take(str(tmp_path / "repo/a"), {"model": state}, session=session)
    for i in range(12):
        state[f"layer{i}"].add_(1.0)
    Snapshot.take(str(tmp_path / "repo/b"), {"model": state}, session=session)
    return "repo/a", "repo/b"


def listed_keys(out: str) -> list[str]:
    return [line.split()[0] for line in out.splitlines()[2:] if line.startswith("0/")]


def test_diff_lists_keys_in_natural_order(tmp_path, pair):
    code, out, err = casnap(tmp_path, "diff", *pair)
    assert code == 0, err
    keys = listed_keys(out)
    assert keys == [f"0/model/layer{i}" for i in range(12)]  # layer2 before layer10
    code, out, _ = casnap(tmp_path, "diff", *pair, "--json")
    assert [r["key"] for r in json.loads(out)] == keys


def test_diff_counts_values_not_containers(tmp_path, pair):
    code, out, err = casnap(tmp_path, "diff", *pair)
    assert code == 0, err
    assert out.splitlines()[-1] == "13 values: 12 changed, 1 unchanged"  # 12 tensors, epoch
    assert "0/model " not in out + " "  # the container is not a row without --all
    code, out, err = casnap(tmp_path, "diff", *pair, "--all")
    assert code == 0, err
    rows = {line.split()[0]: line.split()[1] for line in out.splitlines()[2:-1]}
    assert rows["0/model"] == "changed"  # every tensor in it changed
    assert rows["0/model/epoch"] == "unchanged"
    assert out.splitlines()[-1] == "13 values: 12 changed, 1 unchanged"
    code, out, _ = casnap(tmp_path, "diff", *pair, "--all", "--json")
    by_key = {r["key"]: r for r in json.loads(out)}
    assert by_key["0/model"]["container"] and by_key["0/model"]["status"] == "changed"


def test_diff_plot_prints_a_summary_its_title_repeats(tmp_path, pair):
    pytest.importorskip("matplotlib")
    from PIL import Image
    from PIL.PngImagePlugin import PngImageFile

    code, out, err = casnap(tmp_path, "diff", *pair, "--plot", "drift.png")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == "13 values: 12 changed, 1 unchanged"
    assert lines[1] == "largest relative changes:" and len(lines) == 7  # five movers
    assert "status" not in out  # no table: the picture is the table
    assert "wrote drift.png" in err
    with Image.open(tmp_path / "drift.png") as image:
        assert isinstance(image, PngImageFile)
        drawn = json.loads(image.text["casnap"])
    assert drawn["summary"].startswith("13 values under 0/model/: 12 changed, 1 unchanged")
    code, out, _ = casnap(tmp_path, "diff", *pair, "--plot", "drift.png", "--json")
    assert len(json.loads(out)) == 12  # --json stays whole


def test_a_missing_key_is_not_found_with_the_nearest_keys(tmp_path, pair):
    a, b = pair
    for argv in (
        ["diff", a, b, "--key", "0/modl"],
        ["show", b, "--key", "0/modl"],
        ["export", b, "out.safetensors", "--key", "0/modl"],
    ):
        code, out, err = casnap(tmp_path, *argv)
        assert code == 3, (argv, out, err)
        line = err.strip()
        assert line.startswith("casnap: error: no entry '0/modl' in the snapshot; did you mean")
        assert "'0/model'" in line, line
    assert not (tmp_path / "out.safetensors").exists()
    code, out, err = casnap(tmp_path, "diff", a, b, "--key", "0/model/layer1")
    assert code == 0 and listed_keys(out) == ["0/model/layer1"], err
    with pytest.raises(MissingKeyError, match="did you mean '0/model/layer1'"):
        Snapshot(str(tmp_path / b)).read_object("0/model/layr1")


def test_every_command_exits_3_for_what_is_not_there(tmp_path, pair):
    """The exit-code table of docs/repository.md: 3 for a missing repository, snapshot,
    tag or key, whichever command meets it, in one ``casnap: error:`` line."""
    a, b = pair
    missing = [
        *([cmd, "nowhere"] for cmd in ("ls", "log", "du", "verify", "gc", "unlock", "repair")),
        ["tag", "nowhere", "ls"],
        ["retain", "nowhere", "--keep-last", "1"],
        ["copy", "nowhere", "elsewhere"],
        ["show", "repo/zz"],
        ["diff", a, "repo/zz"],
        ["export", "repo/zz", "out.pt"],
        ["rm", "repo/zz"],
        ["tag", "repo", "add", "t", "zz"],
        ["tag", "repo", "rm", "zz"],
        ["copy", "repo", "elsewhere", "zz"],
        ["show", b, "--key", "0/zz"],
    ]
    for argv in missing:
        code, _, err = casnap(tmp_path, *argv)
        lines = err.strip().splitlines()
        assert code == 3 and len(lines) == 1 and lines[0].startswith("casnap: error: "), (
            argv,
            code,
            err,
        )
    assert not (tmp_path / "elsewhere").exists() and not (tmp_path / "out.pt").exists()
