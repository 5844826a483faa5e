"""Phase "gc": deduplicating takes in two processes beside `casnap gc --grace 0` and `retain`.

The scenario of tests/test_gc_stress.py (its states, checksums and checks are
imported from there), run for a time instead of a number of rounds, with the
CLI as a user runs it in the maintenance loop: `casnap gc --grace 0` after
every pause and `casnap retain --keep-last 6` every other time. Afterwards
every listed snapshot must restore bit-exact to what its taker recorded, no
manifest may name a missing object, and every snapshot a taker committed is
either listed or was deleted by a taker's or `retain`'s decision (none lost).
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from stress_common import ROOT, Deadline, casnap_cli, enter_child, fast_children

sys.path.insert(0, str(ROOT / "tests"))
from test_gc_stress import CHUNK, checksums, damaged_refs, missing_objects, state_for  # noqa: E402

TAKERS = 2


def taker(url: str, k: int, seconds: float, out: str, env: dict[str, str]) -> None:
    enter_child(env)
    from casnap import CasnapError, Repository, Snapshot

    repo = Repository(url)
    opts: dict[str, Any] = {"repository": repo, "settings": {"chunk_size": CHUNK}}
    mine: list[tuple[int, str, str]] = []
    deleted: list[str] = []
    end = time.monotonic() + seconds
    with open(out, "a", encoding="utf-8") as log:
        rnd = 0
        while time.monotonic() < end:
            name = f"t{k}/r{rnd:05d}"
            state = state_for(k, rnd)
            # Every fourth take dedups against a deleted snapshot's manifest: its objects
            # are garbage by then, and gc may be sweeping them right now.
            parents = [deleted[-1]] if rnd % 4 == 3 and deleted else None
            snap = Snapshot.take(f"{url}/{name}", {"s": state}, **opts, parents=parents)
            log.write(json.dumps({"ev": "commit", "name": name, "sums": checksums(state)}) + "\n")
            mine.append((rnd, snap.manifest_hash, name))
            for r, m, n in mine[:-2]:  # keep the last two, and every fifth
                if r % 5 and m not in deleted:
                    try:
                        repo.delete(n)
                    except CasnapError:
                        pass  # `casnap retain` deleted it first
                    deleted.append(m)
                    log.write(json.dumps({"ev": "delete", "name": n}) + "\n")
            log.flush()
            rnd += 1


def run(workdir: Path, seconds: float, seed: int, env: dict[str, str]) -> dict[str, Any]:
    from casnap import Repository

    url = str(workdir / "repo")
    repo = Repository.init(url, chunk_size=CHUNK)
    env = {**env, "CASNAP_LEASE_TTL": "30"}  # nothing is killed here: leases must not lapse
    ctx = fast_children()
    logs = [str(workdir / f"taker{k}.jsonl") for k in range(TAKERS)]
    procs = [ctx.Process(target=taker, args=(url, k, seconds, logs[k], env)) for k in range(TAKERS)]
    for p in procs:
        p.start()
    rng = random.Random(seed)
    fig: dict[str, Any] = {
        "seconds": seconds,
        "gc_runs": 0,
        "gc_blocked": 0,
        "gc_errors": [],
        "gc_deleted_objects": 0,
        "gc_waited_for_takes": 0,
        "retain_runs": 0,
        "retain_errors": [],
    }
    retained_away: set[str] = set()
    limit = Deadline(None, None)  # counts rounds; the takers stop themselves after `seconds`
    while any(p.is_alive() for p in procs):
        rc, out = casnap_cli("gc", url, "--grace", "0", "--wait", "2s", env=env)
        if rc == 0 and isinstance(out, dict):
            fig["gc_runs"] += 1
            fig["gc_deleted_objects"] += out["deleted_chunks"] + out["deleted_packs"]
            fig["gc_waited_for_takes"] += out["waited_for_takes"] > 0
        elif "GcBlocked" in str(out) or "blocked" in str(out):
            fig["gc_blocked"] += 1
        else:
            fig["gc_errors"].append(str(out)[-300:])
        if limit.done % 2:
            rc, out = casnap_cli("retain", url, "--keep-last", "6", env=env)
            if rc == 0 and isinstance(out, dict):
                fig["retain_runs"] += 1
                retained_away.update(out["deleted"])
            else:
                fig["retain_errors"].append(str(out)[-300:])
        limit.done += 1
        time.sleep(rng.random() * 0.2)  # gaps in which takes can get in
    for p in procs:
        p.join(120)
    fig["taker_exit_codes"] = [p.exitcode for p in procs]
    expected: dict[str, dict[str, str]] = {}
    by_takers: set[str] = set()
    for log in logs:
        for line in Path(log).read_text().splitlines():
            record = json.loads(line)
            if record["ev"] == "commit":
                expected[record["name"]] = record["sums"]
            else:
                by_takers.add(record["name"])
    listed = set(repo.snapshots())
    fig["takes"] = len(expected)
    fig["deleted_by_takers"] = len(by_takers)
    fig["deleted_by_retain"] = len(retained_away)
    fig["listed_at_end"] = len(listed)
    fig["lost"] = sorted(set(expected) - listed - by_takers - retained_away)
    fig["damaged_refs"] = damaged_refs(repo.storage, expected)
    fig["missing_objects"] = missing_objects(repo.storage)
    rc, _ = casnap_cli("gc", url, "--grace", "0", env=env)  # a last gc with nothing running
    fig["damaged_after_last_gc"] = damaged_refs(repo.storage, expected)
    fig["missing_after_last_gc"] = missing_objects(repo.storage)
    return fig


def invariants(fig: dict[str, Any]) -> dict[str, bool]:
    return {
        "takers finished": fig["taker_exit_codes"] == [0] * TAKERS,
        "no snapshot lost": not fig["lost"],
        "every listed ref restores exactly": not fig["damaged_refs"]
        and not fig["damaged_after_last_gc"],
        "no manifest names a missing object": not fig["missing_objects"]
        and not fig["missing_after_last_gc"],
        "gc and retain never failed": not fig["gc_errors"] and not fig["retain_errors"],
        "gc swept while takes ran": fig["gc_runs"] > 0 and fig["gc_deleted_objects"] > 0,
    }
