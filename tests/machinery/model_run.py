"""Run the model-based test of casnap (tests/machinery/model_sim.py) over many seeds; docs/model.md.

Usage::

    python tests/machinery/model_run.py --seeds 20 --ops 600       # the long run
    python tests/machinery/model_run.py --seed 7 --ops 300 --shrink # one seed, minimal repros
    python tests/machinery/model_run.py --replay bench-out/model.json --violation 0  # a repro

Prints the operations executed, the seeds, how often each operation kind ran
and with which outcome (``take:ok``, ``restore:refused``, ``check:must:ok`` ...),
and every violation with its seed, operation index and the operation log
that leads to it. ``--json FILE`` writes all of it (op logs included);
``--shrink`` first cuts each violating program down to the fewest
operations that still give a violation of the same kind. Exits 1 on any
violation.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import model_sim  # noqa: E402


def describe(op: dict[str, Any]) -> str:
    skip = {"i", "kind", "repo"}
    args = " ".join(f"{k}={v}" for k, v in op.items() if k not in skip)
    return f"#{op['i']} {op['kind']} {op['repo']} {args}"


def shrink(
    seed: int, program: list[dict[str, Any]], kind: str, workdir: Path, budget_s: float
) -> list[dict[str, Any]]:
    """Greedy delta debugging: drop chunks of operations while a ``kind`` violation remains."""
    deadline = time.monotonic() + budget_s

    def fails(prog: list[dict[str, Any]]) -> bool:
        sim = model_sim.run_program(seed, workdir, len(prog), program=prog, max_violations=1)
        return any(v.kind == kind for v in sim.violations)

    prog, n = list(program), 2
    while len(prog) >= 2 and time.monotonic() < deadline:
        size = max(1, len(prog) // n)
        cut = False
        for start in range(0, len(prog), size):
            if time.monotonic() > deadline:
                break
            trial = prog[:start] + prog[start + size :]
            if trial and fails(trial):
                prog, n, cut = trial, max(n - 1, 2), True
                break
        if not cut:
            if size == 1:
                break
            n = min(len(prog), n * 2)
    return prog


def run(
    seeds: list[int],
    ops: int,
    seconds: float | None,
    workdir: Path,
    *,
    do_shrink: bool = False,
    shrink_seconds: float = 300.0,
    weights: dict[str, int] | None = None,
    max_violations: int = 5,
    avoid: frozenset[str] = frozenset(),
) -> dict[str, Any]:
    start = time.monotonic()
    deadline = start + seconds if seconds else None
    counts: dict[str, int] = {}
    violations: list[dict[str, Any]] = []
    executed = 0
    ran: list[int] = []
    for seed in seeds:
        if deadline is not None and time.monotonic() > deadline:
            break
        sim = model_sim.run_program(
            seed,
            workdir / f"seed{seed}",
            ops,
            deadline,
            weights,
            max_violations=max_violations,
            avoid=avoid,
        )
        ran.append(seed)
        executed += len(sim.ops)
        for k, n in sim.counts.items():
            counts[k] = counts.get(k, 0) + n
        seen: set[str] = set()
        for v in sim.violations:
            entry = {**v.__dict__, "ops": sim.ops[: v.op + 1]}
            if do_shrink and v.kind not in seen:
                seen.add(v.kind)
                entry["minimal"] = shrink(
                    seed, entry["ops"], v.kind, workdir / "shrink", shrink_seconds
                )
            violations.append(entry)
    return {
        "seeds": ran,
        "operations": executed,
        "seconds": round(time.monotonic() - start, 1),
        "counts": dict(sorted(counts.items())),
        "violations": violations,
    }


def render(summary: dict[str, Any], log_tail: int = 25) -> str:
    lines = [
        f"operations executed: {summary['operations']} in {summary['seconds']} s",
        f"seeds: {summary['seeds']}",
        "",
        "kind / outcome counts:",
    ]
    kinds = sorted({k.split(":")[0] for k in summary["counts"]})
    for kind in kinds:
        total = summary["counts"].get(kind, 0)
        outcomes = {
            k.split(":", 1)[1]: v for k, v in summary["counts"].items() if k.startswith(kind + ":")
        }
        listed = ", ".join(f"{k}={v}" for k, v in outcomes.items())
        lines.append(f"  {kind:12} {total:6}  {listed}")
    vs = summary["violations"]
    lines += ["", f"violations: {len(vs)}"]
    by_kind: dict[str, int] = {}
    for v in vs:
        by_kind[v["kind"]] = by_kind.get(v["kind"], 0) + 1
    lines += [f"  {k}: {n}" for k, n in sorted(by_kind.items())]
    for v in vs:
        lines += [
            "",
            f"- seed {v['seed']} op {v['op']} [{v['kind']}] {v['subject']}",
            "  " + v["detail"].strip().replace("\n", "\n  "),
        ]
        log = v.get("minimal") or v["ops"][-log_tail:]
        label = "minimal program" if v.get("minimal") else f"last {len(log)} ops"
        lines.append(f"  {label}:")
        lines += [f"    {describe(op)}" for op in log]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=1, help="how many seeds, from --seed on")
    p.add_argument("--seed", type=int, default=1, help="the first seed")
    p.add_argument("--ops", type=int, default=600, help="operations per seed")
    p.add_argument("--seconds", type=float, default=None, help="stop after this long")
    p.add_argument("--shrink", action="store_true", help="minimize each violating program")
    p.add_argument("--shrink-seconds", type=float, default=300.0)
    p.add_argument(
        "--max-violations",
        type=int,
        default=5,
        help="stop a seed after this many violations (they cascade)",
    )
    p.add_argument(
        "--weights",
        default="",
        help="operation weights, e.g. copy=0,damage=30 (others keep theirs)",
    )
    p.add_argument(
        "--avoid",
        default="",
        help="leave out triggers of known bugs: reencode (valid re-encoding as damage), "
        "raw (compression=none); e.g. --avoid reencode,raw --weights copy=0",
    )
    p.add_argument("--replay", type=Path, help="a --json file: replay one violation's ops")
    p.add_argument("--violation", type=int, default=0, help="which violation to --replay")
    p.add_argument("--json", type=Path, help="write the summary (with op logs) here")
    p.add_argument("--workdir", type=Path, default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    if args.workdir is not None:
        return _run(args, p, args.workdir)
    # A folder of its own, removed after a clean run; kept (and named) after a
    # violation, whose repositories are what one looks at next.
    workdir = Path(tempfile.mkdtemp(prefix="casnap-model-"))
    code = 1
    try:
        code = _run(args, p, workdir)
    finally:
        if code == 0:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"the repositories are kept in {workdir}")
    return code


def _run(args: argparse.Namespace, p: argparse.ArgumentParser, workdir: Path) -> int:
    os.environ.setdefault("CASNAP_INDEX_DIR", str(workdir / "index"))
    if args.replay:
        v = json.loads(args.replay.read_text())["violations"][args.violation]
        prog = v.get("minimal") or v["ops"]
        sim = model_sim.run_program(v["seed"], workdir / "replay", len(prog), program=prog)
        for line in (x.line() for x in sim.violations):
            print(line)
        return 1 if sim.violations else 0
    seeds = list(range(args.seed, args.seed + args.seeds))
    weights = dict(model_sim.WEIGHTS)
    for item in filter(None, args.weights.split(",")):
        k, v = item.split("=")
        if k not in weights:
            p.error(f"--weights: unknown kind {k!r}; kinds: {', '.join(model_sim.KINDS)}")
        weights[k] = int(v)
    summary = run(
        seeds,
        args.ops,
        args.seconds,
        workdir,
        do_shrink=args.shrink,
        shrink_seconds=args.shrink_seconds,
        weights=weights,
        max_violations=args.max_violations,
        avoid=frozenset(filter(None, args.avoid.split(","))),
    )
    print(render(summary))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=1, default=str))
    return 1 if summary["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
