"""``casnap diff --plot`` and ``casnap log --plot``: the real executable draws real PNGs.

Each picture records what it drew in its PNG text metadata (key ``casnap``, JSON),
which these tests read back to check the entries it names and their order.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import matplotlib.image
import pytest
import torch
from PIL import Image
from PIL.PngImagePlugin import PngImageFile

from casnap import Repository, Session, Snapshot, StateDict
from casnap.cli.plot_data import diff_rows

REPO_ROOT = Path(__file__).resolve().parents[1]
CASNAP = str(Path(sys.executable).parent / "casnap")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def casnap(tmp_path: Path, *args: str, pythonpath: str = "") -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (pythonpath, str(REPO_ROOT)) if p),
        "CASNAP_INDEX_DIR": str(tmp_path / "index"),
    }
    return subprocess.run(
        [CASNAP, *args], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )


def drawn(path: Path) -> dict:
    """What the picture says it drew, after checking it is a PNG that opens."""
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    pixels = matplotlib.image.imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 200 and pixels.shape[1] > 200
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        assert isinstance(image, PngImageFile)
        return json.loads(image.text["casnap"])


def model_state(layers: int, params: list[str]) -> OrderedDict[str, torch.Tensor]:
    return OrderedDict((f"layers.{i}.{p}", torch.randn(8)) for i in range(layers) for p in params)


def take_pair(root: Path, a: dict, b: dict) -> tuple[str, str]:
    session = Session()
    Snapshot.take(str(root / "a"), {"model": StateDict(**a)}, session=session)
    Snapshot.take(str(root / "b"), {"model": StateDict(**b)}, session=session)
    return str(root / "a"), str(root / "b")


def test_diff_plot_names_every_entry_in_model_order(tmp_path):
    torch.manual_seed(0)
    a = model_state(12, ["weight", "bias"])  # layers.10 sorts before layers.2 by name
    b = OrderedDict((k, v.clone()) for k, v in a.items())
    b["layers.3.weight"] += 1e-4 * torch.randn(8)  # small and large moves: a log axis
    b["layers.11.bias"] += 1.0
    b["layers.5.weight"] = torch.randn(4, 2)  # reshaped: changed, with no ratio
    del b["layers.7.bias"]
    b["head.weight"] = torch.randn(8)
    path_a, path_b = take_pair(tmp_path / "repo", a, b)
    out = casnap(tmp_path, "diff", path_a, path_b, "--plot", "drift.png", "--json")
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr and "wrote drift.png: 25 rows" in out.stderr
    table = {row["key"]: row for row in json.loads(out.stdout)}  # --json stays parseable
    record = drawn(tmp_path / "drift.png")
    assert record["kind"] == "diff" and record["grouping"] == "entry"
    assert record["prefix"] == "0/model/"
    labels = [row["label"] for row in record["rows"]]
    expected = [k for k in a if k != "layers.7.bias"]
    expected.insert(expected.index("layers.7.weight") + 1, "layers.7.bias")  # where it was
    assert labels == expected + ["head.weight"]  # state-dict order, not sorted by name
    rows = {row["label"]: row for row in record["rows"]}
    assert rows["layers.7.bias"]["counts"] == {"removed": 1}
    assert rows["head.weight"]["counts"] == {"added": 1}
    assert rows["layers.5.weight"]["counts"] == {"no figure": 1}
    assert rows["layers.0.weight"]["counts"] == {"unchanged": 1}
    for label in ("layers.3.weight", "layers.11.bias"):
        assert rows[label]["counts"] == {"changed": 1}
        assert rows[label]["rel_l2"] == pytest.approx(table[f"0/model/{label}"]["rel_l2"])
    assert record["log_scale"] is True  # 1e-4 .. 1: four decades


def test_diff_plot_of_300_entries_groups_by_module(tmp_path):
    torch.manual_seed(0)
    params = [f"{m}.{p}" for m in ("q", "k", "v", "o", "up", "down") for p in ("weight", "bias")]
    a = OrderedDict((k, torch.ones(8)) for k in model_state(25, params))  # 300 entries
    # layers 2 and 20-24 move, by 0.01 * the layer's number
    b = OrderedDict(
        (k, v + (0.01 * int(k.split(".")[1]) if k.startswith("layers.2") else 0))
        for k, v in a.items()
    )
    path_a, path_b = take_pair(tmp_path / "repo", a, b)
    out = casnap(tmp_path, "diff", path_a, path_b, "--plot", "big.png")
    assert out.returncode == 0, out.stderr
    record = drawn(tmp_path / "big.png")
    rows = record["rows"]
    assert record["grouping"] == "module depth 2" and len(rows) == 25
    assert [r["label"] for r in rows] == [f"layers.{i}.*  (12)" for i in range(25)]
    # Every entry is drawn once, in model order, and the biggest movers are named.
    assert [k for r in rows for k in r["keys"]] == [f"0/model/{k}" for k in a]
    assert record["top"][0][0].startswith("0/model/layers.24.")
    moved = {r["label"] for r in rows if r["rel_l2"] is not None}
    assert moved == {f"layers.{i}.*  (12)" for i in (2, 20, 21, 22, 23, 24)}
    with Image.open(tmp_path / "big.png") as image:
        assert image.height <= 1900  # 25 rows: the figure grows with rows, not entries


def test_grouping_never_collapses_a_run_into_one_row(tmp_path):
    # Flat names (w0 ... w299) have no modules, and 100 layers make layers.N too many rows
    # and "layers" one: both become even runs of consecutive entries, still in model order.
    torch.manual_seed(0)
    flat = OrderedDict((f"w{i}", torch.randn(4)) for i in range(300))
    deep = model_state(100, list("abcdef"))
    for name, state in (("flat", flat), ("deep", deep)):
        moved = OrderedDict((k, v + 1) for k, v in state.items())
        take_pair(tmp_path / name, state, moved)
        repo = Repository(str(tmp_path / name))
        picture = diff_rows(
            repo.diff("a", "b", stats=True), repo.show("a").entries, repo.show("b").entries
        )
        assert 16 <= len(picture.rows) <= 64
        assert [k for r in picture.rows for k in r.keys] == [f"0/model/{k}" for k in state]
        assert picture.grouping.startswith("runs of")
    assert picture.rows[0].label == "layers.0.* … layers.1.*  (12)"


def test_log_plot_draws_bytes_and_a_metric_skipping_nan(tmp_path):
    root = tmp_path / "run"
    session = Session()
    torch.manual_seed(0)
    state = {f"w{i}": torch.randn(20_000) for i in range(4)}  # random: zstd cannot shrink it
    losses = [2.0, 1.0, "NaN", 0.5, 0.25]
    for k, loss in enumerate(losses):
        state[f"w{k % 4}"] = state[f"w{k % 4}"] + 1
        Snapshot.take(
            str(root / f"step_{(k + 1) * 100}"),
            {"m": StateDict(**state)},
            session=session,
            metadata={"step": (k + 1) * 100, "metrics": {"loss": loss}},
        )
    out = casnap(tmp_path, "log", str(root), "--plot", "run.png", "--metric", "loss")
    assert out.returncode == 0, out.stderr
    assert "step_500" in out.stdout  # the table is still printed
    record = drawn(tmp_path / "run.png")
    assert record["x"] == "step" and record["unit"] == "KiB" and record["metric"] == "loss"
    assert record["snapshots"] == [f"step_{s}" for s in (100, 200, 300, 400, 500)]
    assert record["points"] == [
        ["step_100", 2.0],
        ["step_200", 1.0],
        ["step_400", 0.5],
        ["step_500", 0.25],
    ]
    assert record["skipped"] == ["step_300"]
    # Names the metrics there are when asked for one no snapshot has; --metric needs --plot.
    out = casnap(tmp_path, "log", str(root), "--plot", "x.png", "--metric", "acc")
    assert out.returncode == 2 and out.stderr.strip() == (
        "casnap: error: no snapshot has a metric 'acc' (metrics found: loss)"
    )
    assert not (tmp_path / "x.png").exists()
    out = casnap(tmp_path, "log", str(root), "--metric", "loss")
    assert out.returncode == 2 and "--plot" in out.stderr and "Traceback" not in out.stderr


def test_log_plot_without_steps_uses_the_order(tmp_path):
    for i in range(3):  # no session and no step metadata
        Snapshot.take(str(tmp_path / "run" / f"v{i}"), {"m": StateDict(w=torch.full((10,), i))})
    out = casnap(tmp_path, "log", str(tmp_path / "run"), "--plot", "run.png")
    assert out.returncode == 0, out.stderr
    record = drawn(tmp_path / "run.png")
    assert record["x"] == "order" and record["snapshots"] == ["v0", "v1", "v2"]
    assert record["metric"] is None and record["unit"] == "B"


def test_plot_without_matplotlib_says_which_extra(tmp_path):
    # A matplotlib that cannot be imported, first on the path.
    fake = tmp_path / "no-mpl" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('matplotlib is hidden by the test')\n")
    Snapshot.take(str(tmp_path / "run" / "s1"), {"m": StateDict(w=torch.ones(4))})
    Snapshot.take(str(tmp_path / "run" / "s2"), {"m": StateDict(w=torch.zeros(4))})
    hidden = str(tmp_path / "no-mpl")
    for args in (
        ["log", "run", "--plot", "out.png"],
        ["diff", "run/s1", "run/s2", "--plot", "out.png"],
    ):
        out = casnap(tmp_path, *args, pythonpath=hidden)
        assert out.returncode == 2, out.stderr
        assert out.stderr == (
            "casnap: error: --plot needs matplotlib, which is not installed: "
            "pip install matplotlib (casnap's plot extra)\n"
        )
        assert out.stdout == "" and not (tmp_path / "out.png").exists()
    out = casnap(tmp_path, "log", "run", pythonpath=hidden)  # matplotlib only for --plot
    assert out.returncode == 0 and "s2" in out.stdout


def test_plot_target_is_checked_before_any_work(tmp_path):
    Snapshot.take(str(tmp_path / "run" / "s1"), {"m": StateDict(w=torch.ones(4))})
    (tmp_path / "adir").mkdir()
    for target, message in (
        ("missing/out.png", "no directory"),
        ("adir", "is a directory"),
        ("out.txt", "must end in .png, .svg, .pdf"),
    ):
        out = casnap(tmp_path, "log", "run", "--plot", target)
        assert out.returncode == 2 and message in out.stderr, out.stderr
        assert len(out.stderr.splitlines()) == 1 and out.stdout == ""
