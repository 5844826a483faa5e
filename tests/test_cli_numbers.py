"""What ``log`` and ``du`` print matches what happened, seen through the real executable.

``log``'s "new" is what a take added to the repository, whatever wrote it (a
Session take, a take without one, a DCP save, an import); a parent the
repository never held is not "(deleted)"; ``du`` accounts for every byte the
store holds and says how gc frees what it can.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from casnap import Session, Snapshot, StateDict

REPO_ROOT = Path(__file__).resolve().parents[1]
CASNAP = str(Path(sys.executable).parent / "casnap")
MIB = 1 << 20


def casnap(cwd: Path, *argv: str) -> tuple[int, str, str]:
    """The real executable running this worktree's code: (exit code, stdout, stderr)."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "CASNAP_INDEX_DIR": str(cwd / "index")}
    done = subprocess.run(
        [CASNAP, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert "Traceback" not in done.stderr, done.stderr
    return done.returncode, done.stdout, done.stderr


def log_json(cwd: Path, repo: str) -> dict[str, dict]:
    code, out, err = casnap(cwd, "log", repo, "--json")
    assert code == 0, err
    return {line["name"]: line for line in json.loads(out)}


def log_row(cwd: Path, repo: str, name: str) -> str:
    code, out, err = casnap(cwd, "log", repo)
    assert code == 0, err
    return next(line for line in out.splitlines() if f" {name} " in line)


@pytest.fixture(autouse=True)
def _index_here(tmp_path, monkeypatch):
    """Takes in this process share the executable's index folder (as one user's would)."""
    monkeypatch.setenv("CASNAP_INDEX_DIR", str(tmp_path / "index"))


def test_unchanged_retake_without_a_session_adds_nothing(tmp_path):
    state = StateDict(w=torch.randn(MIB // 4))  # 1 MiB of incompressible floats
    Snapshot.take(str(tmp_path / "repo/step_1"), {"m": state})
    Snapshot.take(str(tmp_path / "repo/step_2"), {"m": state})  # no Session: no parent
    lines = log_json(tmp_path, "repo")
    assert lines["step_1"]["new_bytes"] > MIB
    assert lines["step_2"]["new_bytes"] == 0
    assert lines["step_2"]["stored_bytes"] == lines["step_1"]["stored_bytes"]
    row = log_row(tmp_path, "repo", "step_2")
    assert "1.0 MiB  " in row and "  0 B" in row, row  # size 1.0 MiB, new 0 B


def test_dcp_resave_that_writes_nothing_shows_no_new_bytes(tmp_path):
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from casnap.integrations.dcp import CasnapWriter

    model = torch.nn.Linear(512, 512)
    for step in (1, 2):  # a new writer per save, as a script saving every N steps has
        writer = CasnapWriter(str(tmp_path / f"repo/step_{step}"))
        dcp.save({"model": model.state_dict()}, storage_writer=writer)
    lines = log_json(tmp_path, "repo")
    assert lines["step_1"]["new_bytes"] > 512 * 512 * 4 * 0.9
    assert lines["step_2"]["new_bytes"] == 0


def test_import_and_log_agree_on_new_bytes(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    safetensors.save_file({"w": torch.randn(512, 1024)}, str(tmp_path / "m.safetensors"))
    reports = []
    for name in ("v1", "v2"):
        code, out, err = casnap(tmp_path, "--json", "import", "m.safetensors", f"repo/{name}")
        assert code == 0, err
        reports.append(json.loads(out))
    code, out, err = casnap(tmp_path, "import", "m.safetensors", "repo/v3")
    assert code == 0 and "0 B new" in out, (out, err)
    lines = log_json(tmp_path, "repo")
    assert lines["v1"]["new_bytes"] == reports[0]["new_bytes"] > 2 * MIB
    assert lines["v2"]["new_bytes"] == reports[1]["new_bytes"] == 0
    assert lines["v3"]["new_bytes"] == 0
    assert "  0 B" in log_row(tmp_path, "repo", "v3")


def test_parents_deleted_and_never_held_are_told_apart(tmp_path):
    session = Session()
    state = StateDict(w=torch.randn(64 * 1024))
    for step in (1, 2, 3):
        state["w"][:10] += 1
        Snapshot.take(str(tmp_path / f"repo/step_{step}"), {"m": state}, session=session)
    code, _, err = casnap(tmp_path, "copy", "repo", "copy", "step_3")
    assert code == 0, err
    code, _, err = casnap(tmp_path, "rm", "repo/step_1")  # no --prune: its manifest stays
    assert code == 0, err
    assert "(deleted)" in log_row(tmp_path, "repo", "step_2")
    row = log_row(tmp_path, "copy", "step_3")  # the copy never held step_2
    assert "(deleted)" not in row and "(not in this repository)" in row, row
    (copied,) = log_json(tmp_path, "copy").values()
    assert copied["parents_absent"] == copied["parents"] != []
    assert copied["new_bytes"] == copied["stored_bytes"]  # the copy added all of it


def store_files_bytes(repo: Path) -> int:
    """What the repository's manifests, chunk objects and packs hold on disk."""
    meta = repo / ".casnap"
    return sum(
        f.stat().st_size
        for kind in ("manifests", "chunks", "packs")
        for f in (meta / kind).rglob("*")
        if f.is_file()
    )


def test_du_accounts_for_what_the_store_holds(tmp_path):
    """Retention deletes snapshots whose frames share packs with kept ones: gc cannot free
    those packs, and du says where every byte beyond "stored" is."""
    from casnap import Checkpointer, KeepLast, RetentionPolicy

    torch.manual_seed(0)
    # Small tensors go to packs; the same third of them changes every step.
    state = StateDict(**{f"s{i}": torch.randn(300) for i in range(200)})
    ckpt = Checkpointer(
        str(tmp_path / "repo"), every_n_steps=1, retention=RetentionPolicy(KeepLast(2))
    )
    for step in range(1, 6):
        for i in range(0, 200, 3):
            state[f"s{i}"].add_(1)
        ckpt.maybe_take(step, {"m": state})
    ckpt.close()
    code, out, err = casnap(tmp_path, "gc", "repo", "--grace", "0", "--dry-run", "--json")
    assert code == 0 and json.loads(out)["plan"]["bytes_to_free"] == 0, (out, err)

    code, out, err = casnap(tmp_path, "du", "repo", "--json")
    assert code == 0, err
    usage = json.loads(out)
    store = usage["store"]
    assert store["total_bytes"] == store_files_bytes(tmp_path / "repo")
    assert store["frame_bytes"] == usage["stored_bytes"]
    assert store["unused_in_packs"] > 0  # frames of the retired snapshots
    assert (
        usage["stored_bytes"] + store["unused_in_packs"] + store["manifest_bytes"]
        == (store["total_bytes"])
    )

    code, out, err = casnap(tmp_path, "du", "repo")
    assert code == 0, err
    assert "the store holds " in out and "frames only deleted snapshots used" in out
    assert "gc deletes a pack whole" in out and "du -sh" in out


def test_du_says_how_gc_removes_leftovers_and_garbage(tmp_path):
    state = StateDict(w=torch.randn(64 * 1024))
    Snapshot.take(str(tmp_path / "repo/a"), {"m": state})
    state["w"].add_(1)
    Snapshot.take(str(tmp_path / "repo/b"), {"m": state})
    code, _, err = casnap(tmp_path, "rm", "repo/a")  # no --prune: garbage for gc
    assert code == 0, err
    temp = tmp_path / f"repo/.casnap/chunks/ab/{'ab' * 32}~tmp-crashed"  # a dead put's
    temp.parent.mkdir(parents=True, exist_ok=True)
    temp.write_bytes(b"x" * 1000)
    code, out, err = casnap(tmp_path, "du", "repo")
    assert code == 0, err
    left = next(line for line in out.splitlines() if line.startswith("left by interrupted"))
    assert "older than its grace period (1h)" in left and "`casnap gc --grace 0`" in left
    junk = next(line for line in out.splitlines() if line.startswith("unreferenced:"))
    assert "grace period (1h)" in junk and "`casnap gc --grace 0` at once" in junk
    code, out, err = casnap(tmp_path, "du", "repo", "--json")
    store = json.loads(out)["store"]
    assert store["unreferenced_bytes"] > 256 * 1024 and store["temp_bytes"] == 1000
    assert store["total_bytes"] == store_files_bytes(tmp_path / "repo")
    # plain gc keeps them (young); --grace 0 removes them now
    code, out, err = casnap(tmp_path, "gc", "repo")
    assert code == 0, err
    assert json.loads(casnap(tmp_path, "du", "repo", "--json")[1])["store"]["temp_bytes"] == 1000
    code, out, err = casnap(tmp_path, "gc", "repo", "--grace", "0")
    assert code == 0, err
    store = json.loads(casnap(tmp_path, "du", "repo", "--json")[1])["store"]
    assert store["unreferenced_bytes"] == store["temp_bytes"] == 0


@pytest.mark.slow
def test_demo_says_what_its_gc_does(tmp_path):
    """The README's demo: what it says about retention and gc is what they did."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "CASNAP_INDEX_DIR": str(tmp_path / "ix")}
    argv = ["--repo", str(tmp_path / "demo-repo"), "--steps", "150", "--every", "25"]
    done = subprocess.run(
        [sys.executable, "-W", "ignore::UserWarning", str(REPO_ROOT / "tools/demo.py"), *argv],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    said = next(line for line in out.splitlines() if line.startswith("retention deleted"))
    assert "gc has nothing left to free" in said and not said.startswith("retention deleted 0 ")
    gc_line = next(line for line in out.splitlines() if line.startswith("gc of "))
    assert "freed 0 B" in gc_line, gc_line
    assert "weights identical: True" in out
