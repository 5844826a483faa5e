"""History operations against their floor as a repository ages (issue 39, point 1).

    .venv/bin/python benchmarks/history.py --sizes 1000,2000 [--chunk-kib 256] [--baseline DIR]

One repository of snapshots through one ``Session``: 16 fp32 tensors of 16
chunks, 10% of the chunks ``+= 1.0`` before each take (so deltas). 4 KiB chunks
(a 1 MiB state, the default) keep the issue's chunk and reference counts and
build 10,000 snapshots in minutes; ``--chunk-kib 256`` is its 64 MiB state. At
each size (a copy kept per size under ``--workdir``, grown from the last) each
command runs through the CLI, best of ``--repeats`` in CPU seconds, its start-up (``casnap ls``
of 10 snapshots) subtracted, beside its floor in this process (FLOORS) and a
``--baseline`` checkout. Prints a markdown table, writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from harness import ROOT, markdown_table, write_json

import casnap
from casnap import Session, Snapshot, StateDict

TENSORS, CHUNKS = 16, 16
OPS = {"log": ["log"], "du": ["du"], "verify": ["verify"], "gc": ["gc", "--grace", "0"]}
OPS["retain"] = ["retain", "--keep-last", "10", "--dry-run"]
META = ("refs", "manifests")  # what a floor parses beside the listing
# Per command, its floor: the folder it lists ("": all), those it parses, whether it
# reads the index's summary lines.
FLOORS = {"log": ("refs", ("refs",), True), "du": ("", ("refs",), True)}


def build(repo: Path, upto: int, chunk: int, state: dict[str, torch.Tensor] | None) -> Any:
    """Take snapshots ``s00000``... until the repository holds ``upto``; the state lives on."""
    names = sorted(p.name for p in (repo / ".casnap" / "refs").glob("s*")) if repo.exists() else []
    if state is None:
        g = torch.Generator().manual_seed(0)
        state = {f"t{i:02d}": torch.randn(CHUNKS * chunk // 4, generator=g) for i in range(TENSORS)}
        if names:  # resume: the newest snapshot's values
            Snapshot(str(repo / names[-1])).restore({"m": StateDict(state)})
    session, rng = Session(), torch.Generator().manual_seed(len(names) + 1)
    opts = {"chunk_size": chunk}
    for i in range(len(names), upto):
        if i:
            picked = torch.randperm(TENSORS * CHUNKS, generator=rng)[: TENSORS * CHUNKS // 10]
            for c in picked.tolist():
                t, k = divmod(c, CHUNKS)
                state[f"t{t:02d}"][k * chunk // 4 : (k + 1) * chunk // 4] += 1.0
        model, step = {"m": StateDict(state)}, {"step": i}
        Snapshot.take(
            str(repo / f"s{i:05d}"), model, None, None, opts, session=session, metadata=step
        )
    return state


def cpu() -> float:
    """CPU seconds of this process and its waited-for children: on a shared machine
    wall time measures the neighbours, CPU time (warm, local disk) the work."""
    own, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def cli(args: list[str], env: dict[str, str]) -> float:
    t0 = cpu()
    code = "import sys; from casnap.cli.app import main; sys.exit(main())"
    subprocess.run(  # -P: casnap from PYTHONPATH, never from the current folder
        [sys.executable, "-P", "-c", code, *args], env=env, check=True, stdout=subprocess.DEVNULL
    )
    return cpu() - t0


def best(fn: Any, repeats: int) -> float:
    return min(fn() for _ in range(repeats))


def floor(repo: Path, top: str, parsed: tuple[str, ...], lines: bool) -> float:
    """List ``top`` with sizes, read and parse every file of ``parsed``; with ``lines``
    also read each summary line the index holds."""
    t0 = cpu()
    base = repo / ".casnap"
    files = [os.path.join(d, f) for d, _, names in os.walk(base / top) for f in names]
    sizes = {f: os.stat(f).st_size for f in files}
    for f in sizes:
        if Path(f).relative_to(base).parts[0] in parsed:
            json.loads(Path(f).read_bytes())
    if lines:
        from casnap.index import open_index
        from casnap.repo.repository import RepoStorage

        index = open_index(RepoStorage.open(str(repo)), chunks=False)
        assert index is not None, "the benchmark needs the index (CASNAP_INDEX unset)"
        with index._env.begin(db=index._env.manifests, buffers=True) as txn:
            sum(len(v) for k, v in txn.cursor() if len(k) == 33)  # lines, not summaries
    return cpu() - t0


def measure(repo: Path, tiny: Path, repeats: int, envs: dict[str, dict[str, str]]) -> Any:
    out: dict[str, Any] = {}
    for side, env in envs.items():
        for args in OPS.values():  # warm: the index's summaries, the page cache
            cli([*args, str(repo)], env)
        out[f"startup_{side}"] = best(lambda e=env: cli(["ls", str(tiny)], e), repeats)
    for op, args in OPS.items():
        f = best(lambda o=op: floor(repo, *FLOORS.get(o, ("", META, False))), repeats)
        out[op] = {"floor_s": f}
        for side, env in envs.items():
            t = best(lambda a=args, e=env: cli([*a, str(repo)], e), repeats)
            t = out[op][side] = t - out[f"startup_{side}"]
            out[op][f"{side}_ratio"] = t / f
    files = [p for p in (repo / ".casnap").rglob("*") if p.is_file()]
    meta = [p for p in files if p.relative_to(repo / ".casnap").parts[0] not in ("chunks", "packs")]
    out["metadata_bytes"] = sum(p.stat().st_size for p in meta)
    out["chunk_objects"] = len(files) - len(meta)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1000,2000", help="snapshot counts, ascending")
    ap.add_argument("--chunk-kib", type=int, default=4, help="256: the issue's 64 MiB state")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", default="bench-out/scratch/history")
    ap.add_argument("--baseline", help="another checkout to time beside this one")
    ap.add_argument("--keep", action="store_true", help="keep the repository (to grow it later)")
    ap.add_argument("--out", default="bench-out/history.json")
    a = ap.parse_args()
    work, last = Path(a.workdir), None
    tiny = work / "tiny"
    env = dict(os.environ, CASNAP_INDEX_DIR=str(work / "index"), PYTHONPATH=ROOT)
    os.environ.update(env)
    envs = {"casnap": env}
    if a.baseline:  # another checkout, with its own index
        base = str(Path(a.baseline).resolve())
        envs["baseline"] = dict(env, PYTHONPATH=base, CASNAP_INDEX_DIR=str(work / "index-base"))
    if not tiny.exists():
        work.mkdir(parents=True, exist_ok=True)
        build(tiny, 10, 4096, None)
    state, rows, results = None, [], {"casnap": casnap.__file__, "chunk_kib": a.chunk_kib}
    prev: dict[str, Any] | None = None
    for n in (int(s) for s in a.sizes.split(",")):
        t0 = time.perf_counter()
        repo = work / f"repo-{a.chunk_kib}k-{n}"  # kept per size: a later run measures it again
        if not repo.exists() and last is not None:
            shutil.copytree(last, repo)
        state = build(repo, n, a.chunk_kib * 1024, state if last is not None else None)
        last = repo
        built = time.perf_counter() - t0
        got = results[str(n)] = measure(repo, tiny, a.repeats, envs)
        for op in OPS:
            g = got[op]
            growth = f"{g['casnap'] / prev[op]['casnap']:.2f}x" if prev else ""
            row = [f"{n:,}", op, f"{g['casnap']:.3f}", f"{g['floor_s']:.3f}"]
            row += [f"{g['casnap_ratio']:.2f}x", growth]
            if a.baseline:
                row += [f"{g['baseline']:.3f}", f"{g['baseline_ratio']:.2f}x"]
            rows.append(row)
        prev = got
        meta = f"{got['metadata_bytes'] / 2**20:.1f} MiB metadata"
        print(f"{n:,}: {got['chunk_objects']:,} chunk objects, {meta}, built in {built:.0f} s")
    head = ["snapshots", "command", "time s", "floor s", "time/floor", "growth"]
    head += ["baseline s", "baseline/floor"] if a.baseline else []
    print(markdown_table(head, rows))
    write_json(a.out, results)
    if not a.keep:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
