"""The long version of #10's crash and fault suite: nothing lost, nothing wrong, nothing hangs.

Five phases, each against real repositories in its own scratch folder:

1. kills: processes taking snapshots (take, async_take, Checkpointer with
   retention) SIGKILLed at random moments; every ref restores to what was
   saved, no committed snapshot is lost, gc removes every leftover.
2. flips: seeded damage (bit flips, truncations, zeroed blocks) in chunk and
   pack files, read by restore / read_object / verify; nothing silently
   wrong, and a fresh take in a new process is not poisoned by it.
3. fuzz: fuzz_repo.py's hostile repository files (skipped if absent).
4. gc: two deduplicating takers beside `casnap gc --grace 0` and `casnap retain`.
5. faults: takes through a store failing 10% of calls, with and without retries.

Usage::

    python tests/machinery/stress.py --quick   # ~35 s: what tests/test_stress_quick.py runs
    python tests/machinery/stress.py --kills 100 --flips 500 --gc-seconds 60 --fault-takes 50
    python tests/machinery/stress.py --minutes 30 --json bench-out/stress.json

Prints a Markdown table of figures and invariants, writes every figure as
JSON (``--json``), and exits 1 if any invariant fails (see docs/stress.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stress_common import ROOT  # noqa: E402

PRESETS = {
    "quick": {"kills": 6, "flips": 40, "fuzz_cases": 50, "gc_seconds": 10.0, "fault_takes": 10},
    "default": {
        "kills": 100,
        "flips": 500,
        "fuzz_cases": 1000,
        "gc_seconds": 60.0,
        "fault_takes": 50,
    },
}
# Shares of --minutes per phase.
SHARES = {"kills": 0.35, "flips": 0.15, "fuzz": 0.15, "gc": 0.20, "faults": 0.15}
FUZZ_TOOL = ROOT / "tests" / "machinery" / "fuzz_repo.py"


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a small run (~1 min), as the test runs it")
    p.add_argument("--minutes", type=float, help="run each phase for its share of this time")
    p.add_argument("--kills", type=int, help="SIGKILLed taking processes")
    p.add_argument("--flips", type=int, help="damaged objects (bit flip, truncation, zeroed block)")
    p.add_argument("--fuzz-cases", type=int, help="hostile repository cases of fuzz_repo.py")
    p.add_argument("--gc-seconds", type=float, help="seconds of takes beside gc and retain")
    p.add_argument("--fault-takes", type=int, help="takes through a store failing 10%% of calls")
    p.add_argument("--phases", default="kills,flips,fuzz,gc,faults", help="comma-separated subset")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", help="scratch folder is made inside this (default: a temp dir)")
    p.add_argument("--json", help="write every figure here")
    p.add_argument("--keep", action="store_true", help="keep the scratch folder")
    return p.parse_args(argv)


def budget(args: argparse.Namespace) -> dict[str, Any]:
    """Counts (``kills`` ...) and time limits (``kills_limit`` ...) per phase: a preset,
    --minutes, then explicit options (which lift that phase's time limit)."""
    chosen: dict[str, Any] = dict(PRESETS["quick" if args.quick else "default"])
    limits: dict[str, Any] = {f"{k}_limit": None for k in SHARES}
    if args.minutes is not None:
        chosen = {
            "kills": None,
            "flips": None,
            "fuzz_cases": None,
            "gc_seconds": args.minutes * 60 * SHARES["gc"],
            "fault_takes": None,
        }
        limits = {f"{k}_limit": args.minutes * 60 * s for k, s in SHARES.items()}
    for key in ("kills", "flips", "fuzz_cases", "gc_seconds", "fault_takes"):
        if getattr(args, key) is not None:
            chosen[key] = getattr(args, key)
            limits[f"{key.split('_')[0]}_limit"] = None
    return {**chosen, **limits}


def load_fuzz_tool() -> Any:
    if not FUZZ_TOOL.exists():
        return None
    spec = importlib.util.spec_from_file_location("fuzz_repo", FUZZ_TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_fuzz(workdir: Path, cases: int | None, seconds: float | None, seed: int) -> dict[str, Any]:
    tool = load_fuzz_tool()
    if tool is None:
        return {"skipped": "fuzz_repo.py not present"}
    result = tool.run(seed=seed, cases=cases, seconds=seconds, workdir=str(workdir))
    return dict(result)


def fuzz_invariants(fig: dict[str, Any]) -> dict[str, bool]:
    if "skipped" in fig:
        return {}
    # fuzz_repo.py's verdict: failures are other exceptions, wrong results, hangs, memory.
    return {"fuzz: every case a correct result or a CasnapError": fig["failed"] == 0}


def run_phases(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    import stress_faults
    import stress_flips
    import stress_gc
    import stress_kills

    plan = budget(args)
    env = {
        "CASNAP_INDEX_DIR": str(root / "index"),
        "CASNAP_STATE_DIR": str(root / "state"),
        "CASNAP_LEASE_TTL": "5",
    }  # a killed take's lease lapses in seconds
    os.environ.update(env)  # this process and the fork server the children come from
    wanted = args.phases.split(",")
    results: dict[str, Any] = {}

    def phase(name: str, call: Any, invariants: Any) -> None:
        if name not in wanted:
            return
        folder = root / name
        folder.mkdir()
        start = time.monotonic()
        print(f"-- {name} ...", file=sys.stderr, flush=True)
        fig = call(folder)
        results[name] = {
            "seconds": round(time.monotonic() - start, 1),
            "figures": fig,
            "invariants": invariants(fig),
        }

    s = args.seed
    phase(
        "kills",
        lambda d: stress_kills.run(d, plan["kills"], plan["kills_limit"], s, env),
        stress_kills.invariants,
    )
    phase(
        "flips",
        lambda d: stress_flips.run(
            d, plan["flips"], plan["flips_limit"], s, env, containment_every=2 if args.quick else 5
        ),
        stress_flips.invariants,
    )
    phase("fuzz", lambda d: run_fuzz(d, plan["fuzz_cases"], plan["fuzz_limit"], s), fuzz_invariants)
    phase("gc", lambda d: stress_gc.run(d, plan["gc_seconds"], s, env), stress_gc.invariants)
    phase(
        "faults",
        lambda d: stress_faults.run(d, plan["fault_takes"], plan["faults_limit"], s),
        stress_faults.invariants,
    )
    return {"plan": plan, "seed": args.seed, "phases": results}


def summary_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    """The figures #10 asks for, one line each."""
    rows: list[tuple[str, str]] = []
    ph = report["phases"]
    if "kills" in ph:
        f = ph["kills"]["figures"]
        rows += [
            (
                "kills: SIGKILLs (take / async_take / checkpointer / checkpointer async)",
                f"{f['kills']} ({' / '.join(str(v) for v in f['by_mode'].values())})",
            ),
            (
                "kills: snapshots committed (sidecar) / refs checked after kills",
                f"{f['committed']} / {f['refs_checked']}",
            ),
            ("kills: refs that landed before their sidecar line", str(f["landed_before_sidecar"])),
            ("kills: snapshots lost", str(len(f["lost"]) + len(f["lost_after_gc"]))),
            (
                "kills: listed refs not restoring exactly",
                str(len(f["broken"]) + len(f["wrong"]) + len(f["broken_after_gc"])),
            ),
            (
                "kills: leftovers before gc (temp files / expired leases)",
                f"{f['leftovers_before_gc'].get('temp_files')} / "
                f"{f['leftovers_before_gc'].get('expired_leases')}",
            ),
            (
                "kills: leftovers after gc --grace 0 (temp files, of them in leases/)",
                f"{f['leftovers_after_gc'].get('temp_files')} "
                f"({f['temp_files_after_gc'].get('leases', 0)})",
            ),
            (
                "kills: leftovers after gc, lease temp files 10 min old",
                str(f["leftovers_after_10min_gc"].get("temp_files")),
            ),
        ]
    if "flips" in ph:
        f = ph["flips"]["figures"]
        rows += [
            (
                "flips: damage injected (bit flip / truncation / zeroed block)",
                f"{f['injected']} ({f['by_kind'].get('bitflip', 0)} / "
                f"{f['by_kind'].get('truncate', 0)} / {f['by_kind'].get('zero', 0)})",
            ),
            (
                "flips: detected by the first read (restore, read_object, verify API/CLI)",
                str(f["detected_first_read"]),
            ),
            ("flips: harmless (no read used the damaged bytes)", str(f["harmless"])),
            ("flips: silently wrong", str(len(f["silently_wrong"]))),
            ("flips: reported as another error than IntegrityError", str(len(f["wrong_errors"]))),
            (
                "flips: fresh takes after damage restored exactly: same machine / another machine",
                f"{f['containment_checks_same'] - len(f['containment_failed_same'])} of "
                f"{f['containment_checks_same']} / "
                f"{f['containment_checks_other'] - len(f['containment_failed_other'])} of "
                f"{f['containment_checks_other']}",
            ),
        ]
    if "fuzz" in ph:
        f = ph["fuzz"]["figures"]
        if "skipped" in f:
            rows.append(("fuzz", f["skipped"]))
        else:
            rows += [
                ("fuzz: cases / seconds", f"{f['cases']} / {f['seconds']}"),
                ("fuzz: outcomes", ", ".join(f"{k} {v}" for k, v in sorted(f["outcomes"].items()))),
                (
                    "fuzz: CasnapErrors",
                    ", ".join(f"{k} {v}" for k, v in sorted(f["casnap_errors"].items())),
                ),
                ("fuzz: failures (other exception, wrong result, hang, memory)", str(f["failed"])),
            ]
    if "gc" in ph:
        f = ph["gc"]["figures"]
        rows += [
            (
                "gc: seconds / takes / gc runs (blocked) / retain runs",
                f"{f['seconds']:.0f} / {f['takes']} / {f['gc_runs']} ({f['gc_blocked']}) / "
                f"{f['retain_runs']}",
            ),
            ("gc: objects swept while takes ran", str(f["gc_deleted_objects"])),
            (
                "gc: snapshots lost / listed refs not restoring",
                f"{len(f['lost'])} / {len(f['damaged_refs']) + len(f['damaged_after_last_gc'])}",
            ),
        ]
    if "faults" in ph:
        f = ph["faults"]["figures"]
        w, wo = f["with_retries"], f["without_retries"]
        rows += [
            (
                "faults: injected (with retries / without)",
                f"{w['faults_injected']} / {wo['faults_injected']}",
            ),
            ("faults: takes succeeded with retries", f"{w['succeeded']} of {w['takes']}"),
            ("faults: takes succeeded without retries", f"{wo['succeeded']} of {wo['takes']}"),
            (
                "faults: listed snapshots not restoring (with / without)",
                f"{len(w['listed_not_restoring'])} / {len(wo['listed_not_restoring'])}",
            ),
        ]
    return rows


def render(report: dict[str, Any]) -> str:
    lines = ["| figure | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in summary_rows(report)]
    lines += ["", "| phase | seconds | invariant | held |", "|---|---|---|---|"]
    for name, result in report["phases"].items():
        for inv, ok in result["invariants"].items():
            lines.append(f"| {name} | {result['seconds']} | {inv} | {'yes' if ok else 'NO'} |")
        if not result["invariants"]:
            lines.append(
                f"| {name} | {result['seconds']} | - | {result['figures'].get('skipped')} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.getLogger("casnap").setLevel(logging.ERROR)  # damage warnings are expected here
    base = Path(args.workdir) if args.workdir else None
    holder = None
    if base is None:
        holder = tempfile.TemporaryDirectory(prefix="casnap-stress-")
        root = Path(holder.name)
    else:
        base.mkdir(parents=True, exist_ok=True)
        root = Path(tempfile.mkdtemp(prefix="casnap-stress-", dir=base))
    start = time.monotonic()
    try:
        report = run_phases(args, root)
    finally:
        if holder is not None and not args.keep:
            holder.cleanup()
        elif not args.keep:
            import shutil

            shutil.rmtree(root, ignore_errors=True)
    report["seconds"] = round(time.monotonic() - start, 1)
    report["command"] = " ".join(["python", "tests/machinery/stress.py", *(argv or sys.argv[1:])])
    report["machine"] = {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "load_average": os.getloadavg(),
    }
    held = all(ok for r in report["phases"].values() for ok in r["invariants"].values())
    report["all_invariants_held"] = held
    print(render(report))
    print(f"\n{report['seconds']} s; all invariants held: {'yes' if held else 'NO'}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    return 0 if held else 1


if __name__ == "__main__":
    sys.exit(main())
