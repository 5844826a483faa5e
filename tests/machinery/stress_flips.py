"""Phase "flips": damage one chunk or pack file the way a failing disk would, then read.

A pristine repository holds three snapshots of the model (loose raw chunks,
zstd chunks, packed frames). Each case copies it, damages one object (a
flipped bit, a truncation or a zeroed block, all seeded) and lets casnap
find it one way a user would: ``restore``, ``read_object`` or
``verify --read-data`` (API or CLI). Then, whatever that found, every
snapshot using the object is restored again: each must raise
``IntegrityError`` or be bit-exact; data that differs without an error is
"silently wrong". Every few cases a NEW process takes the intact state again
into the damaged repository and the new snapshots must restore bit-exact
(damage is contained: #10 point 1): alternately with the local index of the
machine that took the snapshots and found the damage (the same machine) and
with an index of its own, built from the repository after the damage was
recorded (another machine, or the same one after its index was deleted).
"""

from __future__ import annotations

import random
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from stress_common import (
    CHUNK,
    Deadline,
    app,
    casnap_cli,
    checksums,
    enter_child,
    fast_children,
    model_state,
    restored_sums,
    train_step,
)

KINDS = ("bitflip", "truncate", "zero")
METHODS = ("restore", "read_object", "verify", "verify_cli")


def states() -> dict[str, dict[str, torch.Tensor]]:
    s = model_state(0)
    out = {"s1": {k: v.clone() for k, v in s.items()}}
    for i, name in ((1, "s2"), (2, "s3")):
        train_step(s, i)
        out[name] = {k: v.clone() for k, v in s.items()}
    return out


def fresh_takes(url: str, env: dict[str, str]) -> None:
    """In a new process: take the intact states again, as a training job on the same machine."""
    enter_child(env)
    from casnap import Snapshot

    for name, state in states().items():
        Snapshot.take(f"{url}/fresh_{name}", app(state), settings={"chunk_size": CHUNK})


def damage(path: Path, kind: str, rng: random.Random) -> str:
    data = bytearray(path.read_bytes())
    size = len(data)
    if kind == "truncate":
        cut = rng.randrange(size)
        path.write_bytes(bytes(data[:cut]))
        return f"truncate {size}->{cut}"
    if kind == "zero":
        n = rng.randint(1, min(4096, size))
        at = rng.randrange(size - n + 1)
        if any(data[at : at + n]):
            data[at : at + n] = bytes(n)
            path.write_bytes(bytes(data))
            return f"zero {n}@{at}"
    at, bit = rng.randrange(size), rng.randrange(8)  # or zeros over zeros: flip instead
    data[at] ^= 1 << bit
    path.write_bytes(bytes(data))
    return f"bitflip bit {bit}@{at}"


def object_users(repo: Any, names: list[str]) -> dict[str, list[tuple[str, str]]]:
    """Object key (chunks/.., packs/..) -> the (snapshot, logical key) pairs that read it."""
    from casnap import Snapshot
    from casnap.repo.repository import chunk_key, pack_key

    users: dict[str, list[tuple[str, str]]] = {}
    for name in names:
        for key, entry in Snapshot(f"{repo.url}/{name}").get_manifest().items():
            for ref in getattr(entry, "chunks", None) or ():
                obj = pack_key(ref.pack) if ref.pack else chunk_key(ref.hash)
                if (name, key) not in users.setdefault(obj, []):
                    users[obj].append((name, key))
    return users


def detect(
    method: str,
    repo: Any,
    users: list[tuple[str, str]],
    expected: dict[str, dict[str, torch.Tensor]],
    env: dict[str, str],
) -> str:
    """'detected', 'missed' or 'wrong-error:<type>' for one way of reading."""
    from casnap import IntegrityError, Snapshot

    try:
        if method == "restore":
            for name in sorted({n for n, _ in users}):
                sums = restored_sums(repo, name, expected[name])
                if sums != checksums(expected[name]):
                    return "missed"
        elif method == "read_object":
            for name, key in users:
                got = Snapshot(f"{repo.url}/{name}").read_object(key)
                if not torch.equal(got, expected[name][key.rsplit("/", 1)[-1]]):
                    return "missed"
        elif method == "verify":
            return "missed" if repo.verify(read_data=True).ok else "detected"
        else:
            rc, out = casnap_cli("verify", repo.url, "--read-data", env=env)
            return {0: "missed", 1: "detected"}.get(rc, f"wrong-error:exit {rc}")
    except IntegrityError:
        return "detected"
    except Exception as exc:  # damage reported as something else (#10 point 3)
        return f"wrong-error:{type(exc).__name__}"
    return "missed"


def each_user_fails_or_is_exact(
    repo: Any, users: list[tuple[str, str]], expected: dict[str, dict[str, torch.Tensor]]
) -> str:
    """'exact' (none noticed, all correct), 'error' (IntegrityError), 'silently-wrong', or
    'wrong-error:<type>'; the worst over every snapshot using the object."""
    from casnap import IntegrityError

    worst = "exact"
    for name in sorted({n for n, _ in users}):
        try:
            ok = restored_sums(repo, name, expected[name]) == checksums(expected[name])
        except IntegrityError:
            worst = "error" if worst == "exact" else worst
            continue
        except Exception as exc:
            return f"wrong-error:{type(exc).__name__}"
        if not ok:
            return "silently-wrong"
    return worst


def run(
    workdir: Path,
    flips: int | None,
    seconds: float | None,
    seed: int,
    env: dict[str, str],
    containment_every: int = 5,
) -> dict[str, Any]:
    from casnap import Repository, Snapshot, settings

    expected = states()
    pristine = workdir / "pristine"
    with settings.override(index_dir=str(workdir / "pristine-index")):
        for name, state in expected.items():
            Snapshot.take(f"{pristine}/{name}", app(state), settings={"chunk_size": CHUNK})
        users = object_users(Repository(str(pristine)), list(expected))
    objects = sorted(users)
    rng = random.Random(seed)
    ctx = fast_children()
    limit = Deadline(flips, seconds)
    fig: dict[str, Any] = {
        "injected": 0,
        "by_kind": Counter(),
        "by_object": Counter(),
        "first_read": Counter(),
        "after": Counter(),
        "silently_wrong": [],
        "wrong_errors": [],
        "objects": len(objects),
    }
    for where in ("same", "other"):
        fig[f"containment_checks_{where}"], fig[f"containment_failed_{where}"] = 0, []
    while limit.more():
        case = limit.done
        limit.done += 1
        failures_before = _failures(fig)
        obj = rng.choice(objects)
        kind, method = rng.choice(KINDS), rng.choice(METHODS)
        # A new folder, and so a new index, per case: an index this process still holds open
        # must never describe another case's repository (the copies share one repo id).
        folder = workdir / f"case{case}"
        contain = bool(containment_every) and case % containment_every == 0
        # Containment alternately on this machine (the index of the process that took the
        # snapshots, from before the damage) and on another (an index of its own, built from
        # the repository after the damage). An index is tied to its repository's path, so a
        # copy of the pristine repository is "another machine" for the pristine index.
        where = "same" if contain and (case // containment_every) % 2 == 0 else "other"
        case_env = {**env, "CASNAP_INDEX_DIR": str(folder / "index")}
        if where == "same":
            with settings.override(index_dir=case_env["CASNAP_INDEX_DIR"]):
                for name, state in expected.items():
                    Snapshot.take(
                        f"{folder / 'repo'}/{name}",
                        app(state),
                        settings={"chunk_size": CHUNK},
                    )
        else:
            shutil.copytree(pristine, folder / "repo")
        what = damage(folder / "repo" / ".casnap" / obj, kind, rng)
        fig["injected"] += 1
        fig["by_kind"][kind] += 1
        fig["by_object"][obj.split("/")[0]] += 1
        with settings.override(index_dir=case_env["CASNAP_INDEX_DIR"]):
            repo = Repository(str(folder / "repo"))
            found = detect(method, repo, users[obj], expected, case_env)
            fig["first_read"][f"{method}: {found}"] += 1
            after = each_user_fails_or_is_exact(repo, users[obj], expected)
            fig["after"][after] += 1
            label = f"case {case}: {obj} {what} ({method})"
            if after == "silently-wrong":
                fig["silently_wrong"].append(label)
            if after.startswith("wrong-error") or found.startswith("wrong-error"):
                fig["wrong_errors"].append(f"{label}: {found} / {after}")
            if contain:
                fig[f"containment_checks_{where}"] += 1
                proc = ctx.Process(target=fresh_takes, args=(repo.url, case_env))
                proc.start()
                proc.join(300)
                bad = [] if proc.exitcode == 0 else [f"take exit {proc.exitcode}"]
                for name, state in expected.items():
                    try:
                        if restored_sums(repo, f"fresh_{name}", state) != checksums(state):
                            bad.append(f"fresh_{name} differs")
                    except Exception as exc:
                        bad.append(f"fresh_{name}: {type(exc).__name__}: {exc}")
                if bad:
                    fig[f"containment_failed_{where}"].append(f"{label}: {bad}")
        if _failures(fig) == failures_before:
            shutil.rmtree(folder, ignore_errors=True)  # a failing case stays for --keep
    shutil.rmtree(pristine, ignore_errors=True)
    for key in ("by_kind", "by_object", "first_read", "after"):
        fig[key] = dict(sorted(fig[key].items()))
    detected = sum(n for k, n in fig["first_read"].items() if k.endswith(": detected"))
    fig["detected_first_read"] = detected
    fig["detected_any_read"] = fig["after"].get("error", 0)
    fig["harmless"] = fig["after"].get("exact", 0)
    return fig


def _failures(fig: dict[str, Any]) -> int:
    keys = ("silently_wrong", "wrong_errors", "containment_failed_same", "containment_failed_other")
    return sum(len(fig[k]) for k in keys)


def invariants(fig: dict[str, Any]) -> dict[str, bool]:
    return {
        "nothing silently wrong": not fig["silently_wrong"],
        "damage reported as IntegrityError": not fig["wrong_errors"],
        "damage contained: a new process on the same machine": not fig["containment_failed_same"],
        "damage contained: a new process on another machine (own index)": not fig[
            "containment_failed_other"
        ],
    }
