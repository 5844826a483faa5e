"""Phase "kills": SIGKILL processes that take snapshots, then check what is left.

Each child takes snapshots of the changing model into ONE repository in one
of four ways (``Snapshot.take``; ``Snapshot.async_take`` with the live model
changed while the snapshot is written; a ``Checkpointer`` with retention,
sync or async) until the parent SIGKILLs it at a seeded random moment.
Before each take the child appends ``intent`` (the name and the checksums of
the state it is saving) to a sidecar file outside the repository, and after
the commit ``commit`` (with the refs retention retired), each line fsynced.

After each kill the parent checks the child's refs: every ref must restore
to its intent's checksums (no half-written snapshot is visible), and every
committed, unretired snapshot must still be there (none lost). A commit can
land before its sidecar line: such a ref is counted, and checked like the rest.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path
from typing import Any

from stress_common import (
    CHUNK,
    Deadline,
    Sidecar,
    app,
    casnap_cli,
    checksums,
    enter_child,
    fast_children,
    model_state,
    read_sidecar,
    restored_sums,
    train_step,
)

MODES = ("take", "async_take", "checkpointer", "checkpointer_async")
KEEP_LAST = 3


def child(url: str, k: int, mode: str, sidecar: str, env: dict[str, str]) -> None:
    enter_child(env)
    from casnap import Checkpointer, KeepLast, RetentionPolicy, Session, Snapshot

    state = model_state(0)  # every run starts from the same base: runs dedup against each other
    for s in range(k % 7):
        train_step(state, 1_000_000 + s)
    log = Sidecar(sidecar)
    opts = {"chunk_size": CHUNK}
    session = Session()
    ckpt = None
    if mode.startswith("checkpointer"):
        ckpt = Checkpointer(
            url,
            1,
            retention=RetentionPolicy(KeepLast(KEEP_LAST)),
            async_take=mode.endswith("async"),
            name_format=step_format(k),
            settings=opts,
            session=session,
        )
    for step in range(10**6):
        train_step(state, k * 10_000 + step)
        name = step_format(k).format(step=step)
        log.write(ev="intent", name=name, sums=checksums(state))
        retired: list[str] = []
        if mode == "take":
            Snapshot.take(f"{url}/{name}", app(state), settings=opts, session=session)
        elif mode == "async_take":
            pending = Snapshot.async_take(
                f"{url}/{name}", app(state), settings=opts, session=session
            )
            train_step(state, -(k * 10_000 + step))  # the next step runs while it is written
            pending.wait()
        else:
            assert ckpt is not None
            ckpt.maybe_take(step, app(state))
            if mode.endswith("async"):
                train_step(state, -(k * 10_000 + step))
            ckpt.wait()
            if ckpt.last_retention is not None:
                retired = list(ckpt.last_retention.deleted)
        log.write(ev="commit", name=name, retired=retired)


def step_format(k: int) -> str:
    return f"k{k:04d}/step_{{step:06d}}"


def check_run(repo: Any, k: int, mode: str, sidecar: str) -> dict[str, Any]:
    """What the parent finds of run ``k`` after its kill."""
    records = read_sidecar(sidecar)
    intents = {r["name"]: r["sums"] for r in records if r["ev"] == "intent"}
    commits = [r["name"] for r in records if r["ev"] == "commit"]
    retired = {n for r in records if r["ev"] == "commit" for n in r["retired"]}
    prefix = f"k{k:04d}/"
    refs = [n for n in repo.snapshots() if n.startswith(prefix)]
    shapes = model_state(0)
    broken, wrong, unknown = [], [], []
    for name in refs:
        if name not in intents:
            unknown.append(name)
            continue
        try:
            sums = restored_sums(repo, name, shapes)
        except Exception as exc:  # any failure of a listed ref is a visible half-snapshot
            broken.append(f"{name}: {type(exc).__name__}: {exc}")
            continue
        if sums != intents[name]:
            wrong.append(name)
    must = [n for n in commits if n not in retired]
    if mode.startswith("checkpointer") and len(must) >= KEEP_LAST:
        # The commit after the last sidecar line may have retired this one.
        must.remove(must[-KEEP_LAST])
    lost = [n for n in must if n not in refs]
    return {
        "committed": len(commits),
        "refs": len(refs),
        "lost": lost,
        "broken": broken,
        "wrong": wrong,
        "unknown": unknown,
        "landed_before_sidecar": len(set(refs) - set(commits)),
    }


def leftovers(url: str, env: dict[str, str]) -> dict[str, Any]:
    rc, usage = casnap_cli("du", url, env=env)
    if rc != 0 or not isinstance(usage, dict):
        return {"error": str(usage)}
    return dict(usage["leftovers"])


def temp_files_by_folder(url: str) -> dict[str, int]:
    """Temp files of interrupted puts, by folder of .casnap (what du adds up)."""
    counts: dict[str, int] = {}
    for path in Path(url, ".casnap").rglob("*~tmp-*"):
        folder = path.relative_to(Path(url, ".casnap")).parts[0].partition("~tmp-")[0]
        counts[folder] = counts.get(folder, 0) + 1
    return counts


# Where a temp file may be a live writer's (a take's lease, a rival gc's lock or
# claim, a repository being made): gc keeps those ten minutes (casnap/gc/plan.py).
KEPT_YOUNG = {"leases", "gc-claims", "gc.lock", "config.json"}


def age_lease_temp_files(url: str, seconds: float) -> int:
    """Make the temp files gc keeps while young look ``seconds`` older."""
    n = 0
    meta = Path(url, ".casnap")
    for path in [
        p
        for p in meta.rglob("*~tmp-*")
        if p.relative_to(meta).parts[0].partition("~tmp-")[0] in KEPT_YOUNG
    ]:
        st = path.stat()
        os.utime(path, (st.st_atime - seconds, st.st_mtime - seconds))
        n += 1
    return n


def run(
    workdir: Path,
    kills: int | None,
    seconds: float | None,
    seed: int,
    env: dict[str, str],
    gc_every: int = 10,
) -> dict[str, Any]:
    from casnap import Repository

    url = str(workdir / "repo")
    repo = Repository.init(url, chunk_size=CHUNK)
    ctx = fast_children()
    rng = random.Random(seed)
    limit = Deadline(kills, seconds)
    fig: dict[str, Any] = {
        "kills": 0,
        "exited_early": 0,
        "committed": 0,
        "refs_checked": 0,
        "landed_before_sidecar": 0,
        "lost": [],
        "broken": [],
        "wrong": [],
        "unknown": [],
        "gc_runs": 0,
        "gc_failures": [],
        "by_mode": {m: 0 for m in MODES},
    }
    sidecars = {}
    while limit.more():
        k = limit.done
        mode = rng.choice(MODES)
        sidecar = str(workdir / f"run{k:04d}.jsonl")
        sidecars[k] = (mode, sidecar)
        proc = ctx.Process(target=child, args=(url, k, mode, sidecar, env))
        proc.start()
        time.sleep(rng.uniform(0.02, 0.8))
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
            fig["kills"] += 1
            fig["by_mode"][mode] += 1
        else:
            fig["exited_early"] += 1
        proc.join()
        limit.done += 1
        found = check_run(repo, k, mode, sidecar)
        fig["committed"] += found["committed"]
        fig["refs_checked"] += found["refs"]
        fig["landed_before_sidecar"] += found["landed_before_sidecar"]
        for key in ("lost", "broken", "wrong", "unknown"):
            fig[key] += found[key]
        if gc_every and limit.done % gc_every == 0:  # gc between kills: a dead take's lease
            rc, out = casnap_cli("gc", url, "--grace", "0", "--wait", "60s", env=env)
            fig["gc_runs"] += 1
            if rc != 0:
                fig["gc_failures"].append(str(out)[-300:])
    time.sleep(float(env["CASNAP_LEASE_TTL"]) + 1)  # the last child's lease expires
    fig["leftovers_before_gc"] = leftovers(url, env)
    fig["temp_files_before_gc"] = temp_files_by_folder(url)
    rc, out = casnap_cli("gc", url, "--grace", "0", "--wait", "60s", env=env)
    fig["final_gc"] = (
        {k: v for k, v in out.items() if k != "plan"}
        if rc == 0 and isinstance(out, dict)
        else {"error": str(out)[-300:]}
    )
    fig["leftovers_after_gc"] = leftovers(url, env)
    fig["temp_files_after_gc"] = temp_files_by_folder(url)
    # gc keeps temp files in leases/ (and KEPT_YOUNG's others) for 10 minutes (a take may
    # be writing its lease now): age them as ten minutes would, then gc again.
    fig["lease_temp_files_aged"] = age_lease_temp_files(url, 601)
    rc, out = casnap_cli("gc", url, "--grace", "0", "--wait", "60s", env=env)
    fig["leftovers_after_10min_gc"] = leftovers(url, env)
    # Everything still listed, after all gcs, restores to what its child saved.
    final = [check_run(repo, k, mode, sc) for k, (mode, sc) in sidecars.items()]
    fig["lost_after_gc"] = [n for f in final for n in f["lost"]]
    fig["broken_after_gc"] = [b for f in final for b in f["broken"] + f["wrong"]]
    fig["snapshots_at_end"] = len(repo.snapshots())
    rc, out = casnap_cli("verify", url, "--read-data", env=env)
    fig["verify_read_data_exit"] = rc
    if rc != 0:
        fig["verify_problems"] = str(out)[-1000:]
    return fig


def invariants(fig: dict[str, Any]) -> dict[str, bool]:
    after = fig["leftovers_after_gc"]
    after10 = fig["leftovers_after_10min_gc"]
    return {
        "no snapshot lost": not fig["lost"] and not fig["lost_after_gc"],
        "every listed ref restores exactly": not (
            fig["broken"] or fig["wrong"] or fig["unknown"] or fig["broken_after_gc"]
        ),
        "gc removes leftovers (leases/ after 10 min)": after10.get("temp_files") == 0
        and after10.get("expired_leases") == 0
        and after.get("expired_leases") == 0
        and set(fig["temp_files_after_gc"]) <= KEPT_YOUNG,
        "verify --read-data clean": fig["verify_read_data_exit"] == 0,
        "gc never failed": not fig["gc_failures"],
    }
