"""Hostile files in a repository: every byte read is validated before it is trusted.

Each case plants one file in a copy of a small repository (a FIFO, a link to
``/dev/zero``, a sparse 3 GiB file, JSON with a 5,000-digit integer) and runs
the real commands on it in a child process with a wall-clock timeout and an
address-space limit, so that a regression (a read that blocks forever, or one
that grows without bound) fails the test quickly instead of hanging or eating
the machine. Every command must end with casnap's error (the CLI's documented
exit code and a message naming the bad file), never a traceback; gc must
refuse and delete nothing when a root cannot be read.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from casnap import Snapshot, StateDict
from casnap.cli.common import EXIT_ERROR, EXIT_INTEGRITY, EXIT_NOT_FOUND, EXIT_PROBLEMS
from casnap.format.names import hash_bytes

ROOT = Path(__file__).resolve().parents[1]
HUGE_INT = "9" * 5000  # past Python's 4300-digit int(str) limit
AS_LIMIT = 2 << 30  # the child's address space: far below what a 3 GiB read needs
TIMEOUT = 120  # seconds for one child; each command takes well under one

# Runs CLI commands and API calls in-process, one JSON line per call.
CHILD = r"""
import contextlib, io, json, resource, sys, traceback
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
calls = json.loads(sys.argv[2])
import torch
from casnap import CasnapError, Snapshot, StateDict
from casnap.cli.app import main

def api(what, path):
    snap = Snapshot(path)
    if what == "restore":
        snap.restore({"m": StateDict(w=torch.zeros(1000), n=0)})
    else:
        snap.read_object("0/m/w")
    return 0

for call in calls:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = api(call[1], call[2]) if call[0] == "api" else main(call)
        except SystemExit as exc:
            rc = exc.code
        except CasnapError as exc:
            rc = type(exc).__name__
            err.write(str(exc))
        except BaseException:
            rc = "crash"
            err.write(traceback.format_exc())
    print(json.dumps({"call": call, "rc": rc, "out": out.getvalue()[-3000:],
                      "err": err.getvalue()[-3000:]}), flush=True)
"""


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if not p.is_dir())


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """s0 (deleted: its manifest and pack are garbage gc would sweep), s1 and s2."""
    root = tmp_path_factory.mktemp("hostile") / "repo"
    for i in range(3):
        state = {"m": StateDict(w=torch.arange(1000.0) + i, n=3)}
        Snapshot.take(f"{root}/s{i}", state, metadata={"step": i})
    (root / ".casnap" / "refs" / "s0").unlink()  # what retain does to a ref
    return root


@pytest.fixture
def repo(source: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "repo"
    shutil.copytree(source, dest, symlinks=True)
    return dest


def _meta(repo: Path) -> Path:
    return repo / ".casnap"


def _ref_manifest(repo: Path, name: str) -> str:
    return str(json.loads((_meta(repo) / "refs" / name).read_bytes())["manifest"])


def _manifest_path(repo: Path, name: str) -> Path:
    m = _ref_manifest(repo, name)
    return _meta(repo) / "manifests" / m[:2] / m


def _pack_path(repo: Path, name: str) -> Path:
    manifest = json.loads(_manifest_path(repo, name).read_bytes())
    (pack,) = {c["pack"] for e in manifest["entries"].values() for c in e.get("chunks", [])}
    return _meta(repo) / "packs" / pack[:2] / pack


# -- what to plant --------------------------------------------------------------


def _fifo(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    os.mkfifo(path)


def _zero(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    os.symlink("/dev/zero", path)


def _sparse(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        fh.truncate(3 << 30)


def _huge_int(path: Path, before: bytes = b'{"x":', after: bytes = b"}") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(before + HUGE_INT.encode() + after)


def _huge_int_manifest(repo: Path) -> str:
    """A manifest whose name is the blake3 of its bytes (so the hash check passes), ref s1 -> it."""
    body = b'{"format_version":"1.0","step":' + HUGE_INT.encode() + b"}"
    name = hash_bytes(body)
    path = _meta(repo) / "manifests" / name[:2] / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(body)
    ref = json.loads((_meta(repo) / "refs" / "s1").read_bytes())
    (_meta(repo) / "refs" / "s1").write_text(json.dumps({**ref, "manifest": name}))
    return name


Plant = Callable[[Path], str]  # plants into the repository, returns what messages must name

LEASE = "leases/0123456789abcdef0123456789abcdef"
DAMAGE = "damaged/" + "ab" * 32 + "/chunk"


def _at(key: str, how: Callable[[Path], None], named: str | None = None) -> Plant:
    def plant(repo: Path) -> str:
        how(_meta(repo) / key)
        return named or key

    return plant


def _manifest(how: Callable[[Path], None]) -> Plant:
    def plant(repo: Path) -> str:
        path = _manifest_path(repo, "s1")
        how(path)
        return path.name

    return plant


def _pack(how: Callable[[Path], None]) -> Plant:
    def plant(repo: Path) -> str:
        path = _pack_path(repo, "s1")
        how(path)
        return path.name

    return plant


def _ref_huge_int(repo: Path) -> str:
    _huge_int(_meta(repo) / "refs" / "s1", b'{"manifest":"' + b"0" * 64 + b'","created_at":', b"}")
    return "s1"


def _config_huge_int(repo: Path) -> str:
    config = (_meta(repo) / "config.json").read_bytes()
    _huge_int(_meta(repo) / "config.json", config[:-1] + b',"chunk_size":', b"}")
    return "config"


def _manifest_huge_int(repo: Path) -> str:
    return _huge_int_manifest(repo)


# case -> (plant, the calls that must refuse with an error naming the file). Every
# other call must succeed: the file is not theirs to read. retain keeps (and
# says so) a snapshot whose manifest it cannot read.
ALL = ["log", "ls", "show", "du", "verify", "gc", "retain", "export", "restore", "read_object"]
READS_S1 = ["log", "show", "du", "verify", "gc", "retain", "export", "restore", "read_object"]
READS_DATA = ["verify", "export", "restore", "read_object"]
READS_TAGS = ["du", "verify", "gc", "retain"]
READS_LEASES = ["gc"]

CASES: dict[str, tuple[Plant, list[str]]] = {
    "ref-huge-int": (_ref_huge_int, READS_S1),
    "ref-fifo": (_at("refs/s1", _fifo), READS_S1),
    "ref-dev-zero": (_at("refs/s1", _zero), READS_S1),
    "ref-sparse-3g": (_at("refs/s1", _sparse), READS_S1),
    "manifest-huge-int": (_manifest_huge_int, READS_S1),
    "manifest-fifo": (_manifest(_fifo), READS_S1),
    "manifest-dev-zero": (_manifest(_zero), READS_S1),
    "manifest-sparse-3g": (_manifest(_sparse), READS_S1),
    "pack-fifo": (_pack(_fifo), READS_DATA),
    "pack-dev-zero": (_pack(_zero), READS_DATA),
    "config-huge-int": (_config_huge_int, ALL),
    "config-fifo": (_at("config.json", _fifo), ALL),
    "config-dev-zero": (_at("config.json", _zero), ALL),
    "config-sparse-3g": (_at("config.json", _sparse), ALL),
    "tag-huge-int": (_at("tags/best", _huge_int, "tag 'best'"), READS_TAGS),
    "tag-fifo": (_at("tags/best", _fifo), READS_TAGS),
    "tag-sparse-3g": (_at("tags/best", _sparse), READS_TAGS),
    "lease-huge-int": (_at(LEASE, _huge_int), READS_LEASES),
    "lease-fifo": (_at(LEASE, _fifo), READS_LEASES),
    "lease-dev-zero": (_at(LEASE, _zero), READS_LEASES),
    "gc-lock-huge-int": (_at("gc.lock", _huge_int), ["gc"]),
    "gc-lock-fifo": (_at("gc.lock", _fifo), ["gc"]),
    "gc-lock-sparse-3g": (_at("gc.lock", _sparse), ["gc"]),
    "gc-epoch-fifo": (_at("gc-epoch", _fifo), ["gc"]),
    "gc-epoch-sparse-3g": (_at("gc-epoch", _sparse), ["gc"]),
    "gc-claim-fifo": (_at("gc-claims/0123", _fifo), []),
    "damage-record-huge-int": (_at(DAMAGE, _huge_int), []),
    "damage-record-fifo": (_at(DAMAGE, _fifo), []),
}


def _calls(repo: Path, tmp_path: Path) -> dict[str, list[Any]]:
    r, s1 = str(repo), str(repo / "s1")
    return {
        "log": ["log", r],
        "ls": ["ls", r],
        "show": ["show", s1],
        "du": ["du", r],
        "verify": ["verify", r, "--read-data"],
        "gc": ["gc", r, "--grace", "0s", "--wait", "0s"],
        "retain": ["retain", r, "--keep-last", "1", "--dry-run"],
        "export": ["export", s1, str(tmp_path / "out.safetensors")],
        "restore": ["api", "restore", s1],
        "read_object": ["api", "read_object", s1],
    }


def run_calls(calls: dict[str, list[Any]]) -> dict[str, dict[str, Any]]:
    """Run ``calls`` in one child (timeout, address-space limit); results by name."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CASNAP_INDEX": "0"}
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(AS_LIMIT), json.dumps(list(calls.values()))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        done = [json.loads(line)["call"] for line in out.splitlines()]
        pytest.fail(f"timed out after {TIMEOUT}s; finished only {done}")
    by_call = {json.dumps(json.loads(line)["call"]): json.loads(line) for line in out.splitlines()}
    results = {name: by_call.get(json.dumps(call)) for name, call in calls.items()}
    missing = [name for name, res in results.items() if res is None]
    assert not missing, f"the child died (rc {proc.returncode}) before {missing}: {err[-3000:]}"
    return results  # type: ignore[return-value]


REFUSED_EXIT = {EXIT_PROBLEMS, EXIT_NOT_FOUND, EXIT_INTEGRITY, EXIT_ERROR}


@pytest.mark.timeout(TIMEOUT + 60)
@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_file_is_refused_cleanly(case: str, repo: Path, tmp_path: Path) -> None:
    plant, refusing = CASES[case]
    needle = plant(repo)
    before = _files(repo)
    results = run_calls(_calls(repo, tmp_path))
    report = {n: (r["rc"], (r["err"] or r["out"])[-300:]) for n, r in results.items()}
    for name, res in results.items():
        assert res["rc"] != "crash", f"{name} crashed:\n{res['err']}"
        text = res["err"] + res["out"]
        if name == "retain" and case.startswith("manifest-"):
            assert res["rc"] == 0 and "manifest unreadable" in text, report
            assert "0 to delete" in text, report
        elif name not in refusing:
            assert res["rc"] == 0, (name, report)
        elif isinstance(res["rc"], str):  # the API: a CasnapError naming the file
            assert needle in text, (name, report)
        else:
            assert needle in text, (name, report)
            # verify reports what it cannot read (exit 1) unless it cannot open the repository
            want = {EXIT_PROBLEMS} if name == "verify" and "config" not in case else REFUSED_EXIT
            assert res["rc"] in want, (name, report)
    if "gc" in refusing:
        assert _files(repo) == before, "gc deleted something while a root was unreadable"


def test_healthy_repository_passes_every_call(repo: Path, tmp_path: Path) -> None:
    """The control: the same calls succeed on the unmodified copy (and gc sweeps s0)."""
    before = _files(repo)
    results = run_calls(_calls(repo, tmp_path))
    assert {n: r["rc"] for n, r in results.items()} == dict.fromkeys(ALL, 0), results
    assert len(_files(repo)) < len(before)  # s0's manifest and pack were garbage


@pytest.mark.parametrize(
    "body",
    [
        b'{"x":' + HUGE_INT.encode() + b"}",
        b'{"x":-' + HUGE_INT.encode() + b"}",
        b'{"x":NaN}',
        b'{"x":-Infinity}',
        b"[" * 100_000 + b"]" * 100_000,
        b'{"x":"\xff"}',
    ],
    ids=["huge-int", "huge-negative-int", "nan", "infinity", "deep", "not-utf8"],
)
def test_every_record_parser_refuses_bad_json_with_a_casnap_error(body: bytes) -> None:
    from casnap.errors import ManifestValidationError
    from casnap.format.parse import parse_config, parse_damage_record, parse_ref
    from casnap.repo.lease_record import parse_record
    from casnap.repo.tags import _parse_tag

    parsers: list[Callable[[bytes], object]] = [
        parse_config,
        lambda d: parse_ref(d, "s1"),
        lambda d: parse_damage_record(d, DAMAGE),
        lambda d: parse_record(d, LEASE),
        lambda d: _parse_tag("best", d),
    ]
    for parse in parsers:
        with pytest.raises(ManifestValidationError):
            parse(body)
