"""What the casnap command line shows people (issue #12, point 1, the output part).

Decimal floats, local times with their zone, natural order of names, export's
real size and format check, ``gc --dry-run`` writing nothing, sizes typed with
units, and progress bars with a rate and an ETA on a terminal only. Each case
runs the real ``casnap`` executable in a subprocess; the Python API's progress
callbacks are checked in-process.
"""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import helpers
import pytest
import torch
from helpers import chunk_path

from casnap import Repository, Snapshot, StateDict
from casnap.display import format_size, format_time, natural_key, parse_size
from casnap.format import codec

REPO_ROOT = Path(__file__).resolve().parents[1]
EXE = str(Path(sys.executable).parent / "casnap")
NATURAL = ["step_1", "step_2", "step_100", "step_200", "step_1000"]
CHUNK = 16 * 1024


def casnap(tmp_path: Path, *argv: str, tz: str | None = None) -> subprocess.CompletedProcess[str]:
    """The real executable, running this worktree's code, stdout and stderr captured."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "CASNAP_INDEX_DIR": str(tmp_path / "index")}
    if tz is not None:
        env["TZ"] = tz
    proc = subprocess.run([EXE, *argv], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


@pytest.fixture
def repo_dir(tmp_path: Path) -> str:
    """Five snapshots taken out of name order, with a float and a complex primitive."""
    root = str(tmp_path / "repo")
    repo = Repository.init(root, chunk_size=CHUNK)
    state = StateDict(w=torch.arange(20_000, dtype=torch.float32), lr=0.001, z=complex(1.5, 0.1))
    for name in ("step_100", "step_2", "step_1000", "step_1", "step_200"):
        state["w"][:10] += 1.0
        repo.take(name, {"m": state}, metadata={"step": int(name[5:]), "loss": 0.1 * 3})
    for tag in ("v10", "v9", "v100"):
        repo.tag(tag, "step_2")
    return root


# -- order ----------------------------------------------------------------------


def test_ls_du_and_tags_list_names_in_natural_order(tmp_path, repo_dir):
    ls = casnap(tmp_path, "ls", repo_dir)
    assert ls.returncode == 0 and ls.stdout.split() == NATURAL  # not step_1, step_100, ...
    du = casnap(tmp_path, "du", repo_dir)
    rows = [line.split()[0] for line in du.stdout.splitlines() if line.startswith("step_")]
    assert rows == NATURAL
    tags = casnap(tmp_path, "tag", repo_dir, "ls")
    assert [line.split()[0] for line in tags.stdout.splitlines()[2:]] == ["v9", "v10", "v100"]
    # log is a history: oldest first, whatever the names
    log = json.loads(casnap(tmp_path, "log", repo_dir, "--json").stdout)
    assert [e["name"] for e in log] == ["step_100", "step_2", "step_1000", "step_1", "step_200"]


def test_natural_key_orders_digit_runs_by_value():
    names = ["a10", "a9", "step_01", "step_1", "b", "a", "x" + "9" * 5000, "x1"]
    assert sorted(names, key=natural_key) == [
        "a",
        "a9",
        "a10",
        "b",
        "step_01",
        "step_1",
        "x1",
        "x" + "9" * 5000,
    ]


# -- floats -----------------------------------------------------------------------


def test_show_and_diff_print_floats_in_decimal_and_json_keeps_them_exact(tmp_path, repo_dir):
    show = casnap(tmp_path, "show", f"{repo_dir}/step_2")
    assert show.returncode == 0
    assert "0x1." not in show.stdout and "p-" not in show.stdout
    row = {line.split()[0]: line for line in show.stdout.splitlines() if line.startswith("0/")}
    assert row["0/m/lr"].split()[2] == "0.001"
    assert "(1.5+0.1j)" in row["0/m/z"]
    assert '"loss": 0.30000000000000004' in show.stdout  # metadata: repr, exact
    entries = json.loads(casnap(tmp_path, "show", f"{repo_dir}/step_2", "--json").stdout)
    values = {e["key"]: e.get("value") for e in entries["entries"]}
    assert values["0/m/lr"] == 0.001 and isinstance(values["0/m/lr"], float)
    assert values["0/m/z"] == [1.5, 0.1]

    diff = casnap(tmp_path, "diff", f"{repo_dir}/step_100", f"{repo_dir}/step_200", "--stats")
    changed = next(line for line in diff.stdout.splitlines() if line.startswith("0/m/w"))
    assert changed.split()[-2:] == ["4.00", "8.36e-05"]  # 3 significant digits, decimal
    assert "0x" not in diff.stdout


# -- times ------------------------------------------------------------------------


def test_times_are_shown_in_the_local_zone_with_its_offset(tmp_path, repo_dir):
    created = json.loads(casnap(tmp_path, "log", repo_dir, "--json").stdout)[0]["created_at"]
    t = datetime.fromisoformat(created)
    assert t.utcoffset() == timedelta(0)  # --json: ISO 8601 with its offset

    kolkata = casnap(tmp_path, "log", repo_dir, tz="Asia/Kolkata").stdout
    local = (t + timedelta(hours=5, minutes=30)).strftime("%Y-%m-%d %H:%M:%S")
    assert f"{local} +0530" in kolkata
    utc = casnap(tmp_path, "log", repo_dir, tz="UTC").stdout
    assert f"{t.strftime('%Y-%m-%d %H:%M:%S')} +0000" in utc and "+0530" not in utc

    show = casnap(tmp_path, "show", f"{repo_dir}/step_100", tz="Asia/Kolkata").stdout
    assert f"created {local} +0530" in show.splitlines()[0]
    tags = casnap(tmp_path, "tag", repo_dir, "ls", tz="Asia/Kolkata").stdout
    assert all(line.endswith("+0530") for line in tags.splitlines()[2:])
    plan = casnap(tmp_path, "retain", repo_dir, "--keep-last", "1", "--dry-run", tz="UTC")
    assert f"{t.strftime('%Y-%m-%d %H:%M:%S')} +0000" in plan.stdout


def test_format_time_honours_tz_and_keeps_what_is_not_a_time():
    assert format_time("not a time") == "not a time"
    stamp = datetime(2026, 11, 24, 18, 40, 12, tzinfo=UTC).isoformat()
    assert format_time(stamp).startswith("2026-11-2")  # the local zone of the test process


# -- sizes ------------------------------------------------------------------------


def test_sizes_are_parsed_and_printed_through_bytesize():
    assert parse_size("2GiB") == 2 << 30 and parse_size("4 MiB") == 4 << 20
    assert parse_size(4096) == 4096 and parse_size("1.5GB") == 1_500_000_000
    assert format_size(1536 * 1024) == "1.5 MiB" and format_size(512) == "512 B"
    with pytest.raises(ValueError):
        parse_size("lots")


def test_init_and_export_take_sizes_with_units(tmp_path, repo_dir):
    init = casnap(tmp_path, "init", str(tmp_path / "shared"), "--chunk-size", "1MiB", "--json")
    assert init.returncode == 0 and json.loads(init.stdout)["chunk_size"] == 1 << 20
    bad = casnap(tmp_path, "init", str(tmp_path / "other"), "--chunk-size", "lots")
    assert bad.returncode == 2 and "'lots' is not a size" in bad.stderr
    assert not (tmp_path / "other").exists()

    out = casnap(tmp_path, "export", f"{repo_dir}/step_2", "m.pt", "--memory-budget", "64MiB")
    assert out.returncode == 0, out.stderr
    written = (tmp_path / "m.pt").stat().st_size
    assert out.stdout.strip() == f"exported step_2 to m.pt (torch, {format_size(written)})"


# -- export -----------------------------------------------------------------------


def test_export_prints_the_size_written_and_refuses_an_unknown_suffix(tmp_path, repo_dir):
    out = casnap(tmp_path, "export", f"{repo_dir}/step_2", "w.safetensors", "--json")
    report = json.loads(out.stdout)
    written = (tmp_path / "w.safetensors").stat().st_size
    assert report["format"] == "safetensors" and report["file_bytes"] == written > 80_000

    npz = casnap(tmp_path, "export", f"{repo_dir}/step_2", "out.npz")
    assert npz.returncode == 2 and npz.stdout == ""
    assert "out.npz" in npz.stderr and ".safetensors" in npz.stderr and ".pt" in npz.stderr
    assert not (tmp_path / "out.npz").exists()
    named = casnap(tmp_path, "export", f"{repo_dir}/step_2", "out.npz", "--format", "torch")
    assert named.returncode == 0 and "(torch, " in named.stdout  # an explicit format wins


# -- gc --dry-run -----------------------------------------------------------------


def listing(root: Path) -> dict[str, tuple[int, int]]:
    """Every file and directory under ``root`` with its size and mtime (ns)."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(root))] = (st.st_size if p.is_file() else -1, st.st_mtime_ns)
    return out


def test_gc_dry_run_writes_nothing(tmp_path, repo_dir):
    root = Path(repo_dir)
    Repository(repo_dir).delete("step_1")  # garbage for the plan to list
    before = listing(root)
    dry = casnap(tmp_path, "gc", repo_dir, "--grace", "0", "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    plan = json.loads(dry.stdout)
    assert plan["dry_run"] and plan["plan"]["bytes_to_free"] > 0
    assert listing(root) == before  # no lock, no epoch, no lease, nothing touched

    # Through a store that counts requests: reads and listings only.
    repo, store = helpers.counted_repo(repo_dir, CHUNK)
    store.reset()
    assert repo.gc(grace_seconds=0, dry_run=True).plan.bytes_to_free > 0
    assert store.requests["put"] == 0 and store.requests["delete"] == 0
    assert store.written_keys == []


# -- progress: the Python API -----------------------------------------------------


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def __call__(self, done: int, total: int) -> None:
        self.calls.append((done, total))

    def check(self, total: int | None = None) -> None:
        """Called, ``done`` never decreasing, one total, ending at it."""
        assert self.calls
        dones = [d for d, _ in self.calls]
        totals = {t for _, t in self.calls}
        assert dones == sorted(dones) and len(totals) == 1
        assert dones[-1] == totals.pop() == (total if total is not None else dones[-1])


def test_take_restore_verify_export_and_repair_report_bytes(tmp_path):
    root = str(tmp_path / "repo")
    repo = Repository.init(root, chunk_size=CHUNK)
    state = {"m": StateDict(w=torch.randn(50_000), b=torch.randn(10))}
    nbytes = (50_000 + 10) * 4

    took = Recorder()
    Snapshot.take(f"{root}/s1", state, progress=took)
    took.check(nbytes)
    assert len(took.calls) > 3  # per chunk, not once at the end

    restored = Recorder()
    target = {"m": StateDict(w=torch.zeros(50_000), b=torch.zeros(10))}
    Snapshot(f"{root}/s1").restore(target, progress=restored)
    restored.check(nbytes)
    assert torch.equal(target["m"]["w"], state["m"]["w"])

    verified = Recorder()
    assert repo.verify(read_data=True, progress=verified).ok
    verified.check(nbytes)

    exported = Recorder()
    repo.export("s1", tmp_path / "s1.safetensors", progress=exported)
    exported.check(nbytes)

    # One damaged loose chunk, repaired from the state in memory: bytes of that chunk.
    ref = next(
        r for r in repo.storage.read_manifest(repo.resolve("s1")).chunk_refs() if r.pack is None
    )
    path = chunk_path(Path(root), ref.hash)
    data = bytearray(path.read_bytes())
    data[codec.HEADER_SIZE + 5] ^= 1
    path.write_bytes(bytes(data))
    repaired = Recorder()
    assert repo.repair(from_states=[state], read_data=True, progress=repaired).ok
    phases = [
        t for i, (_, t) in enumerate(repaired.calls) if i == 0 or t != repaired.calls[i - 1][1]
    ]
    assert phases[0] == nbytes and phases[-1] == ref.size  # re-hash all, then write one chunk
    assert repaired.calls[-1] == (ref.size, ref.size)


def test_a_progress_that_is_not_callable_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(TypeError):
        Snapshot.take(str(tmp_path / "repo" / "s1"), {"m": StateDict(x=1)}, progress=5)  # type: ignore[arg-type]
    assert not (tmp_path / "repo").exists()


# -- progress: the terminal -------------------------------------------------------


def on_a_terminal(tmp_path: Path, *argv: str) -> tuple[int, str]:
    """Run the executable with stdout and stderr on a pseudo-terminal; what it drew."""
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO_ROOT),
        "CASNAP_INDEX_DIR": str(tmp_path / "index"),
        "COLUMNS": "160",
        "TERM": "xterm",
    }
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [EXE, *argv], cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    drawn = b"".join(chunks).decode(errors="replace")
    return proc.wait(timeout=60), re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", drawn)  # no colours


RATE = re.compile(r"\d+(\.\d)? (B|KiB|MiB|GiB)/s")


def test_a_terminal_gets_a_bar_with_bytes_rate_elapsed_and_eta(tmp_path, repo_dir):
    code, drawn = on_a_terminal(tmp_path, "verify", repo_dir, "--read-data")
    assert code == 0, drawn
    assert "verify" in drawn and "━" in drawn
    assert RATE.search(drawn), drawn
    assert re.search(r"\d+\.\d/\d+\.\d KiB", drawn)  # bytes done of the total
    assert re.search(r"elapsed 0:00:0\d eta 0:00:00", drawn)  # the finished bar

    code, drawn = on_a_terminal(tmp_path, "gc", repo_dir, "--dry-run")
    assert code == 0 and re.search(r"\d+/\d+ .*objects/s", drawn), drawn

    # No bar for --json, for -q (where the command line has it), or off a terminal.
    code, drawn = on_a_terminal(tmp_path, "verify", repo_dir, "--read-data", "--json")
    assert code == 0 and "━" not in drawn and json.loads(drawn)["ok"]
    piped = casnap(tmp_path, "verify", repo_dir, "--read-data")
    assert piped.returncode == 0 and piped.stderr == "" and "━" not in piped.stdout
