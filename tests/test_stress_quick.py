"""The crash and fault suite of #10, as a user meets it: `tests/machinery/stress.py --quick`.

One run SIGKILLs processes that take snapshots, damages chunk and pack
files, runs takes beside `casnap gc --grace 0` and `casnap retain`, and
takes through a store that fails 10% of calls (the phases and their figures:
docs/stress.md). The test asserts what a user relies on:
nothing committed is lost, nothing listed is half-written, damage is never
returned as data, gc leaves no leftovers, retries make every take succeed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import pack_path, tensor_entry

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("stress")
    out = work / "stress.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tests" / "machinery" / "stress.py"),
            "--quick",
            # fewer than the preset's 6 kills, 40 flips and 10 s of gc, still above what
            # the tests below require of each phase (3 kills, 30 flips, 20 takes beside gc)
            "--kills",
            "4",
            "--flips",
            "32",
            "--gc-seconds",
            "6",
            "--workdir",
            str(work),
            "--json",
            str(out),
        ],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    report["_stdout"] = proc.stdout
    report["_rc"] = proc.returncode
    return report


@pytest.mark.slow
def test_every_invariant_holds_and_the_exit_code_says_so(quick):
    failed = [
        f"{phase}: {name}"
        for phase, r in quick["phases"].items()
        for name, ok in r["invariants"].items()
        if not ok
    ]
    assert failed == [], quick["_stdout"]
    assert quick["all_invariants_held"] == (not failed)
    assert quick["_rc"] == (1 if failed else 0)
    assert "| kills: snapshots lost | 0 |" in quick["_stdout"]


@pytest.mark.slow
def test_sigkilled_takes_lose_nothing_and_leave_nothing_after_gc(quick):
    f = quick["phases"]["kills"]["figures"]
    assert f["kills"] >= 3 and f["committed"] > 0  # not vacuous: children committed, then died
    assert f["lost"] == [] and f["lost_after_gc"] == []
    assert f["broken"] == [] and f["wrong"] == [] and f["unknown"] == []
    assert f["leftovers_after_gc"]["expired_leases"] == 0
    # gc keeps young temp files of leases (and of gc.lock, gc-claims, config.json) by design
    assert set(f["temp_files_after_gc"]) <= {"leases", "gc-claims", "gc.lock", "config.json"}
    assert f["leftovers_after_10min_gc"]["temp_files"] == 0
    assert f["verify_read_data_exit"] == 0


@pytest.mark.slow
def test_damage_is_an_error_never_wrong_data(quick):
    f = quick["phases"]["flips"]["figures"]
    assert f["injected"] >= 30
    assert f["silently_wrong"] == [] and f["wrong_errors"] == []
    assert f["detected_first_read"] + f["harmless"] == f["injected"]
    assert f["containment_checks_same"] > 0 and f["containment_failed_same"] == []


@pytest.mark.slow
def test_concurrent_gc_and_retain_lose_nothing(quick):
    f = quick["phases"]["gc"]["figures"]
    assert f["takes"] > 20 and f["gc_runs"] > 0 and f["gc_deleted_objects"] > 0
    assert f["lost"] == [] and f["damaged_refs"] == [] and f["missing_objects"] == []


@pytest.mark.slow
def test_retries_make_every_take_succeed_through_transient_faults(quick):
    w = quick["phases"]["faults"]["figures"]["with_retries"]
    wo = quick["phases"]["faults"]["figures"]["without_retries"]
    assert w["faults_injected"] > 0 and w["succeeded"] == w["takes"] >= 10
    assert wo["succeeded"] < wo["takes"]  # the control: the faults are real
    assert w["listed_not_restoring"] == [] and wo["listed_not_restoring"] == []


@pytest.mark.slow
def test_the_fuzz_phase_judges_hostile_files(quick):
    f = quick["phases"]["fuzz"]["figures"]
    assert f["cases"] >= 20 and f["failed"] == 0, f
    assert f["outcomes"].get("casnap_error", 0) > 0  # not vacuous: damage was refused


# -- what the stress found -------------------------------------------------

# w fills whole 64 KiB chunks (loose objects); b is the only small chunk, so a
# pack holds b's frame alone, and packing b again makes a byte-identical pack.
_STATE = """
import torch
from casnap import StateDict
def live_state():
    g = torch.Generator().manual_seed(7)
    return {"m": StateDict(w=torch.randn(6 * 16384, generator=g), b=torch.randn(100, generator=g))}
"""


def _take_in_new_process(url: str, index_dir: Path) -> None:
    code = _STATE + textwrap.dedent(f"""
        from casnap import Snapshot
        Snapshot.take({url!r}, live_state(), settings={{"chunk_size": 65536}})
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CASNAP_INDEX_DIR": str(index_dir)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300)


@pytest.mark.parametrize("machine", ["same", "another"])
def test_a_damaged_pack_is_not_kept_when_its_chunk_is_written_again(tmp_path, machine):
    # The pack holds one frame, so writing the chunk again makes the same pack
    # bytes, hence the same pack name, whatever the order of the take's threads;
    # "another" machine's index never saw the repository.
    from casnap import IntegrityError, Repository, Snapshot, StateDict
    from casnap.repo.damage import list_damage

    ns: dict = {}
    exec(_STATE, ns)
    repo, index = tmp_path / "repo", tmp_path / "index"
    _take_in_new_process(str(repo / "s1"), index)
    ref = tensor_entry(Snapshot(str(repo / "s1")).get_manifest(), "0/m/b").chunks[0]
    assert ref.pack is not None and ref.offset == 0  # the pack's only frame
    pack = pack_path(repo, ref.pack)
    data = bytearray(pack.read_bytes())
    data[ref.length - 3] ^= 0x01
    pack.write_bytes(bytes(data))
    assert not Repository(str(repo)).verify(read_data=True).ok  # found and recorded
    assert len(list_damage(Repository(str(repo)).storage)) == 1

    if machine == "another":
        index = tmp_path / "another-index"
    _take_in_new_process(str(repo / "s2"), index)  # writes b again: it must restore

    expected = ns["live_state"]()["m"]
    target = {"m": StateDict(w=torch.zeros(6 * 16384), b=torch.zeros(100))}
    try:
        Snapshot(str(repo / "s2")).restore(target)
    except IntegrityError as exc:
        pytest.fail(f"s2 references the recorded damaged copy: {exc}")
    assert all(torch.equal(target["m"][k], expected[k]) for k in expected)
    assert (
        tensor_entry(Snapshot(str(repo / "s2")).get_manifest(), "0/m/b").chunks[0].pack == ref.pack
    )
    s1 = {"m": StateDict(w=torch.zeros(6 * 16384), b=torch.zeros(100))}
    Snapshot(str(repo / "s1")).restore(s1)  # the same pack name, good bytes again: s1 heals
    assert all(torch.equal(s1["m"][k], expected[k]) for k in expected)
    assert Repository(str(repo)).verify(read_data=True).ok
    assert list_damage(Repository(str(repo)).storage) == []  # the replacement cleared the record
