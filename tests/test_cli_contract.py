"""The command line's contract, run as a person runs it: the real ``casnap`` executable.

Each case asserts the exit code of the documented table (2 usage, 3 not found,
4 integrity, 5 other, 141 closed pipe), that no traceback is shown, and the
line a person reads. Issue #12 point 1: each case below was seen failing.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from gcs_server import gcs_bucket, gcs_server  # noqa: F401  (fixtures)

from casnap import Repository, Session, Snapshot, StateDict

REPO_ROOT = Path(__file__).resolve().parents[1]
CASNAP = str(Path(sys.executable).parent / "casnap")
STEPS = (100, 200, 1000)  # by name step_1000 sorts before step_200; by step it is the newest


def casnap(
    cwd: Path,
    *argv: str,
    env: dict[str, str] | None = None,
    timeout: float = 120,
    traceback: bool = False,
) -> tuple[int, str, str]:
    """Run the real executable with this worktree's code; (code, stdout, stderr)."""
    full_env = {
        **os.environ,
        "PYTHONPATH": str(REPO_ROOT),
        "CASNAP_INDEX_DIR": str(cwd / "index"),
        **(env or {}),
    }
    done = subprocess.run(
        [CASNAP, *argv], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout
    )
    assert ("Traceback" in done.stderr) == traceback, done.stderr
    return done.returncode, done.stdout, done.stderr


def error_line(err: str) -> str:
    """The one error line: exactly one line on stderr, in casnap's form."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("casnap: error: "), err
    return lines[0]


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    """step_100, step_200, step_1000 (metadata step), and tag "best" on step_200."""
    root = tmp_path_factory.mktemp("contract") / "repo"
    session = Session()
    for step in STEPS:
        state = StateDict(w=torch.full((8,), float(step)))
        Snapshot.take(f"{root}/step_{step}", {"m": state}, metadata={"step": step}, session=session)
    Repository(str(root)).tag("best", "step_200")
    return root


# -- the cases seen in the issue ---------------------------------------------------


def test_export_into_a_missing_directory_or_onto_a_directory_is_usage(repo, tmp_path):
    code, _, err = casnap(tmp_path, "export", f"{repo}/step_100", "nodir/out.safetensors")
    assert code == 2 and "nodir does not exist" in error_line(err)
    code, _, err = casnap(tmp_path, "export", f"{repo}/step_100", str(tmp_path))
    assert code == 2 and "is a directory" in error_line(err)
    assert [p.name for p in tmp_path.iterdir() if p.name != "index"] == []  # not a temp file


def test_verify_rotate_wants_a_positive_count(repo, tmp_path):
    for bad in ("-3", "0", "x"):
        code, _, err = casnap(tmp_path, "verify", str(repo), "--rotate", bad)
        assert code == 2 and "argument --rotate: wants a whole number of parts >= 1" in err


def test_output_closed_early_exits_quietly(repo, tmp_path):
    # `casnap show ... --json | head -1`, with the reader gone before casnap writes.
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "CASNAP_INDEX_DIR": str(tmp_path)}
    proc = subprocess.Popen(
        [CASNAP, "show", f"{repo}/step_100", "--json"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141
    assert err == ""  # no traceback, not even "Exception ignored"


def test_output_through_head_keeps_the_first_line(repo, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "CASNAP_INDEX_DIR": str(tmp_path)}
    done = subprocess.run(
        f"'{CASNAP}' show '{repo}/step_100' --json | head -1",
        shell=True,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout == "{\n" and done.stderr == ""


def test_a_malformed_storage_option_is_usage_before_or_after_the_command(repo, tmp_path):
    for argv in (
        ["ls", str(repo), "--storage-option", "foo"],
        ["--storage-option", "foo", "ls", str(repo)],
    ):
        code, _, err = casnap(tmp_path, *argv)
        assert code == 2 and "--storage-option: wants KEY=VALUE, got 'foo'" in err


def test_init_with_a_chunk_size_out_of_bounds_is_usage(tmp_path):
    code, _, err = casnap(tmp_path, "init", str(tmp_path / "new"), "--chunk-size", "0")
    assert code == 2 and "argument --chunk-size: must be at least 4096 bytes" in err
    assert not (tmp_path / "new").exists()


def test_tag_with_a_missing_argument_is_usage(repo, tmp_path):
    code, _, err = casnap(tmp_path, "tag", "run1", "add")
    assert code == 2 and "casnap tag REPO add TAG SNAPSHOT" in error_line(err)
    code, _, err = casnap(tmp_path, "tag", str(repo), "rm")
    assert code == 2 and "casnap tag REPO rm TAG" in error_line(err)


def test_removing_a_missing_tag_is_not_found_with_a_suggestion(repo, tmp_path):
    code, _, err = casnap(tmp_path, "tag", str(repo), "rm", "nosuch")
    assert code == 3 and "no tag 'nosuch'" in error_line(err)
    code, _, err = casnap(tmp_path, "tag", str(repo), "rm", "bets")
    assert code == 3 and "did you mean 'best'?" in error_line(err)


def test_retain_without_a_rule_is_usage_in_the_cli_s_own_words(repo, tmp_path):
    code, _, err = casnap(tmp_path, "retain", str(repo))
    line = error_line(err)
    assert code == 2 and "--keep-last" in line and "allow_delete_all" not in line
    assert Repository(str(repo)).snapshots() == ["step_100", "step_200", "step_1000"]


# -- new: --version, global options anywhere, -v/-q ----------------------------------


def test_version_comes_from_the_installed_metadata(tmp_path):
    code, out, _ = casnap(tmp_path, "--version")
    assert code == 0 and out.strip() == f"casnap {importlib.metadata.version('casnap')}"


def test_global_options_go_before_or_after_the_command(repo, tmp_path):
    _, before, _ = casnap(tmp_path, "--json", "ls", str(repo))
    _, after, _ = casnap(tmp_path, "ls", str(repo), "--json")
    assert before == after and json.loads(before) == ["step_100", "step_200", "step_1000"]


def test_verbose_shows_the_traceback_and_quiet_only_errors(repo, tmp_path):
    code, _, err = casnap(tmp_path, "-v", "show", f"{repo}/nosuch", traceback=True)
    assert code == 3 and err.strip().splitlines()[-1].startswith("casnap: error: no snapshot")
    # An index that cannot live where CASNAP_INDEX_DIR says logs a warning (and runs on).
    (tmp_path / "file").write_text("")
    env = {"CASNAP_INDEX_DIR": str(tmp_path / "file" / "index")}
    code, out, err = casnap(tmp_path, "log", str(repo), env=env)
    assert code == 0 and "step_1000" in out and err.startswith("casnap: warning: casnap index")
    code, out, err = casnap(tmp_path, "log", str(repo), "-q", env=env)
    assert code == 0 and "step_1000" in out and err == ""


# -- naming a snapshot: latest, tags, did you mean -----------------------------------


def test_latest_is_the_newest_by_step_and_a_tag_names_its_snapshot(repo, tmp_path):
    code, out, _ = casnap(tmp_path, "show", f"{repo}/latest", "--json")
    assert code == 0 and json.loads(out)["name"] == "step_1000"  # not step_200, last by name
    code, out, _ = casnap(tmp_path, "show", f"{repo}/best", "--json")
    assert code == 0 and json.loads(out)["name"] == "step_200"
    code, out, _ = casnap(tmp_path, "diff", f"{repo}/best", f"{repo}/latest", "--json")
    assert code == 0 and [r["status"] for r in json.loads(out)] == ["changed"]
    code, _, _ = casnap(tmp_path, "export", f"{repo}/latest", "out.safetensors")
    assert code == 0 and (tmp_path / "out.safetensors").stat().st_size > 0


def test_an_unknown_name_suggests_close_snapshot_and_tag_names(repo, tmp_path):
    code, _, err = casnap(tmp_path, "show", f"{repo}/step_10")
    line = error_line(err)
    assert code == 3 and "no snapshot or tag 'step_10'" in line and "did you mean" in line
    assert "'step_100'" in line
    code, _, err = casnap(tmp_path, "diff", f"{repo}/step_100", f"{repo}/bset")
    assert code == 3 and "did you mean 'best'?" in error_line(err)
    code, _, err = casnap(tmp_path, "show", f"{repo}/zzz")
    assert code == 3 and "`casnap ls" in error_line(err)


def test_names_before_tags_before_latest_and_rm_latest(tmp_path):
    root = tmp_path / "r"
    for step in (1, 2, 3):
        Snapshot.take(
            f"{root}/s{step}", {"m": StateDict(w=torch.ones(2) * step)}, metadata={"step": step}
        )
    repo = Repository(str(root))
    repo.tag("s1", "s3")  # a tag named like a snapshot: the snapshot wins
    repo.tag("latest", "s2")  # a tag named latest: the tag wins over the newest
    code, out, _ = casnap(tmp_path, "show", f"{root}/s1", "--json")
    assert code == 0 and json.loads(out)["name"] == "s1"
    code, out, _ = casnap(tmp_path, "show", f"{root}/latest", "--json")
    assert code == 0 and json.loads(out)["name"] == "s2"
    repo.untag("latest")
    code, out, _ = casnap(tmp_path, "rm", f"{root}/latest", "--json")
    assert code == 0 and json.loads(out)["snapshot"] == "s3"
    assert repo.snapshots() == ["s1", "s2"]
    # The tag "s1" was on s3, which is gone: the name still means snapshot s1, and
    # a tag whose snapshot is gone says so.
    repo.tag("gone", "s2")
    repo.delete("s2")
    code, _, err = casnap(tmp_path, "show", f"{root}/gone")
    assert code == 3 and "tag 'gone' pins snapshot 's2'" in error_line(err)


# -- remote errors: bounded in time, one line ----------------------------------------


def _remote(tmp_path: Path, endpoint: str, timeout: str) -> tuple[int, str, float]:
    pytest.importorskip("gcsfs")
    env = {"STORAGE_EMULATOR_HOST": endpoint, "CASNAP_REMOTE_TIMEOUT": timeout}
    start = time.monotonic()
    code, _, err = casnap(tmp_path, "ls", "gs://bucket/run1", env=env, timeout=90)
    return code, error_line(err), time.monotonic() - start


def test_a_refused_connection_is_one_line_within_the_timeout(tmp_path):
    with socket.socket() as s:  # a port nobody listens on once this closes
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, line, took = _remote(tmp_path, f"http://127.0.0.1:{port}", "6")
    assert code == 5 and took < 60  # gcsfs alone retries for ~30 s, then casnap 4 more times
    assert "no answer from gs://bucket/run1 within 6 s" in line
    assert f"127.0.0.1:{port}" in line and "CASNAP_REMOTE_TIMEOUT" in line
    assert "(last cause seen: " in line  # the words docs/repository.md quotes


def test_a_server_that_never_answers_is_one_line_within_the_timeout(tmp_path):
    with socket.socket() as s:  # accepts connections (the backlog) and never answers
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        code, line, took = _remote(tmp_path, f"http://127.0.0.1:{s.getsockname()[1]}", "2")
    assert code == 5 and took < 60
    assert "no answer from gs://bucket/run1 within 2 s" in line


@pytest.mark.gcs
def test_a_remote_that_answers_works_through_the_bound(gcs_bucket, tmp_path):  # noqa: F811
    url = f"gs://{gcs_bucket}/{uuid.uuid4().hex}/repo"
    for step in (100, 1000, 200):
        Snapshot.take(
            f"{url}/step_{step}", {"m": StateDict(w=torch.ones(4) * step)}, metadata={"step": step}
        )
    env = {"CASNAP_REMOTE_TIMEOUT": "60"}  # os.environ names the emulator (the fixture)
    code, out, _ = casnap(tmp_path, "--json", "ls", url, env=env)
    assert code == 0 and json.loads(out) == ["step_100", "step_200", "step_1000"]
    code, out, _ = casnap(tmp_path, "show", f"{url}/latest", "--json", env=env)
    assert code == 0 and json.loads(out)["name"] == "step_1000"
