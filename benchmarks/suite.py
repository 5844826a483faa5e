"""casnap against torch.save, safetensors, DCP and torchsnapshot, scenario by scenario, in one run.

    .venv/bin/python benchmarks/suite.py [--size-gib 1.0] [--repeats 3]
        [--scenarios take,restore,...] [--systems casnap,torch.save,...]
        [--out bench-out/suite] [--workdir bench-out/scratch] [--warm]

Writes ``suite.json`` (every sample), ``suite.md`` (the table and the
targets) and ``suite.png`` into ``--out``. Scenarios (all by default):

  take, restore   full save of the state into an empty place; load it back (cold, then warm)
  retake          the same state again (casnap: a 2nd snapshot in the repository)
  frozen          the top layers (~10% of bytes) changed, the backbone frozen
  lora            LoRA adapters changed on a frozen base
  sparse          1% of the embedding's rows changed
  all             every parameter changed
  series          --series successive snapshots (--series-pattern), bytes written and stored
  async           time until async_take / async_save returns, against a sync take
  rss             peak RSS above the live state, take and restore, each in a fresh process
  read_object     one --read-tensor-mib tensor out of a --read-size-gib snapshot, fresh process
  bf16            a bf16 weight matrix: bytes stored over raw bytes
  delta           casnap with delta chunks on against off (benchmarks/delta.py; not by default)

See benchmarks/README.md ("suite.py") for the methods and how to read the numbers.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import suite_report
import suite_states as st
import torch
from harness import (
    GiB,
    MiB,
    Samples,
    comma_list,
    disk_usage,
    drop_page_cache,
    filesystem_of,
    machine,
    manifest_file,
    proc_io,
    same_state,
    scratch_dir,
    settle,
    write_json,
)
from suite_systems import CASNAP, PEER, SYSTEMS, System, system_root

SCENARIOS = ("take", "restore", "retake", "frozen", "lora", "sparse", "all", "series", "async",
             "rss", "read_object", "bf16", "delta")  # fmt: skip
INCREMENTAL = {"retake": "unchanged"} | {k: k for k in ("frozen", "lora", "sparse", "all")}
PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "suite_probe.py")


@dataclass
class Run:
    args: argparse.Namespace
    systems: list[System]
    state: st.State
    target: st.State  # resident, zero-filled: where in-place loads land
    cold: bool
    rec: Samples = field(default_factory=Samples)
    info: dict[str, Any] = field(default_factory=dict)  # per-scenario facts for the report

    @property
    def verify(self) -> bool:
        return not self.args.no_verify

    def op(self, scenario: str, system: System | str) -> str:
        return f"{scenario}|{system if isinstance(system, str) else system.name}"


def timed_save(
    run: Run,
    scenario: str,
    system: System,
    root: str,
    path: str,
    state: st.State,
    cold: bool = True,
) -> Any:
    """Save durably after settling the disk; record seconds and what the folder grew by."""
    settle(run.cold and cold)
    before_used, before_apparent, _ = disk_usage(root)
    io0 = proc_io()["write_bytes"]
    t0 = time.perf_counter()
    result = system.save(state, path)
    seconds = time.perf_counter() - t0
    io1 = proc_io()["write_bytes"]
    used, apparent, _ = disk_usage(root)
    op = run.op(scenario, system)
    run.rec.add(op, seconds)
    run.rec.count(op, "bytes_written", used - before_used)
    run.rec.count(op, "apparent_bytes_written", apparent - before_apparent)
    run.rec.count(op, "io_write_bytes", io1 - io0)
    stats = getattr(result, "last_take_stats", None)
    if stats is not None:
        run.rec.count(op, "stored_bytes_written", stats.stored_bytes_written)
        run.rec.count(op, "chunks_written", stats.chunks_written)
        run.rec.count(op, "objects_written", stats.objects_written)
        manifest = manifest_file(root, result)
        if manifest is not None:
            run.rec.count(op, "manifest_bytes", os.path.getsize(manifest))
    return result


def _check(run: Run, want: st.State, got: st.State, what: str) -> None:
    if not same_state(want, got):
        raise SystemExit(f"{what} did not reproduce the saved state")


# -- scenarios -----------------------------------------------------------------


def take_restore(run: Run) -> None:
    for r in range(run.args.repeats):
        for system in run.systems:
            with scratch_dir(run.args.workdir) as work:
                root = system_root(work, system)
                path = system.path(root, 0)
                timed_save(run, "take", system, root, path, run.state)
                verify = run.verify and r == 0
                if verify and system.in_place:
                    for t in run.target.values():
                        t.zero_()
                settle(run.cold)
                op = run.op("restore", system)
                load = functools.partial(system.load, path, run.target)
                loaded = run.rec.time(op, load)
                if verify:
                    _check(run, run.state, loaded, f"{system.name} load")
                del loaded
                gc.collect()
                op = run.op("restore-warm", system)  # again, from the page cache
                loaded = run.rec.time(op, load)
                del loaded
            _progress(f"take/restore {r + 1}/{run.args.repeats}: {system.name}")


def incremental(run: Run, scenario: str) -> None:
    """A snapshot after one training step, taken ``--repeats`` times (one step each).

    casnap takes the starting state once and then each step into the same
    repository, as a training run would. Peers write a full file per step, the
    same work as their full take: torch.save (the peer of every ratio) repeats,
    the others save once.
    """
    pattern = INCREMENTAL[scenario]
    base = st.start_state(pattern, run.state)
    steps = [st.derive(pattern, base, r) for r in range(run.args.repeats)]
    changed, size = steps[0].changed_bytes, st.nbytes(steps[0].state)
    run.info[scenario] = {"changed_bytes": changed, "pattern": pattern, "state_bytes": size}
    for system in run.systems:
        with scratch_dir(run.args.workdir) as work:
            root = system_root(work, system)
            if system.name == CASNAP:
                settle(False)
                system.save(base, system.path(root, 0))
            repeats = run.args.repeats if system.name in (CASNAP, PEER) else 1
            for r, step in enumerate(steps[:repeats]):
                path = system.path(root, r + 1)
                timed_save(run, scenario, system, root, path, step.state)
                run.rec.count(run.op(scenario, system), "changed_bytes", step.changed_bytes)
                if system.name == CASNAP and run.verify and r == 0:
                    target = st.target_like(step.state)
                    _check(run, step.state, system.load(path, target), f"casnap {scenario}")
                    del target
        _progress(f"{scenario}: {system.name}")
    del steps


def series(run: Run) -> None:
    pattern, n = run.args.series_pattern, run.args.series
    run.info["series"] = {"pattern": pattern, "snapshots": n, "changed_bytes": []}
    for system in run.systems:
        with scratch_dir(run.args.workdir) as work:
            root = system_root(work, system)
            state = st.start_state(pattern, run.state)
            for i in range(n):
                if i:
                    step = st.derive(pattern, state, i - 1)
                    state = step.state
                    if system is run.systems[0]:
                        run.info["series"]["changed_bytes"].append(step.changed_bytes)
                timed_save(run, "series", system, root, system.path(root, i), state, cold=False)
            used, _apparent, files = disk_usage(root)
            run.rec.count(run.op("series", system), "stored_bytes", used)
            run.rec.count(run.op("series", system), "files", files)
            del state
        _progress(f"series: {system.name}")


def async_take(run: Run) -> None:
    """Time until async_take / async_save returns, and until it is durable.

    The synchronous reference is the same system's full take (the take
    scenario, same state, same settling); measured here only when that
    scenario is not run.
    """
    systems = [s for s in run.systems if s.has_async]
    for r in range(run.args.repeats):
        for system in systems:
            if "take" not in run.args.scenarios:
                with scratch_dir(run.args.workdir) as work:
                    root = system_root(work, system)
                    timed_save(run, "take", system, root, system.path(root, 0), run.state)
            with scratch_dir(run.args.workdir) as work:
                root = system_root(work, system)
                settle(run.cold)
                t0 = time.perf_counter()
                pending = system.async_save(run.state, system.path(root, 0))
                t1 = time.perf_counter()
                assert pending is not None
                pending.wait()
                t2 = time.perf_counter()
                run.rec.add(run.op("async-blocked", system), t1 - t0)
                run.rec.add(run.op("async-total", system), t2 - t0)
            _progress(f"async {r + 1}/{run.args.repeats}: {system.name}")


def _probe(run: Run, *argv: str) -> dict[str, Any]:
    env = dict(os.environ, CASNAP_MEMORY_BUDGET=str(run.args.memory_budget_mib * MiB))
    here = os.path.dirname(PROBE)
    env["PYTHONPATH"] = here + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run(
        [sys.executable, PROBE, *argv], capture_output=True, text=True, env=env, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"probe {argv[:2]} failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def rss(run: Run) -> None:
    size = int(run.args.size_gib * GiB)
    hidden = st.pick_hidden(size)
    run.info["rss"] = {"memory_budget_bytes": run.args.memory_budget_mib * MiB}
    for system in run.systems:
        with scratch_dir(run.args.workdir) as work:
            path = system.path(system_root(work, system), 0)
            kinds = ["take", "restore"] + (["async"] if system.has_async else [])
            for kind in kinds:
                # No page-cache drop: RSS does not depend on it, and a cold
                # cache would only make the new process re-read torch itself.
                settle(False)
                if kind == "async":  # a fresh repository: nothing to dedup against
                    path = system.path(system_root(os.path.join(work, "async"), system), 0)
                out = _probe(run, f"rss-{kind}", system.name, path, str(size), str(hidden))
                op = run.op(f"rss-{kind}", system)
                run.rec.add(op, out["seconds"])
                for name in ("extra_bytes", "peak_rss", "baseline_rss", "ru_maxrss", "live_bytes"):
                    run.rec.count(op, name, out[name])
                if "blocked_seconds" in out:  # under the budget: blocked time, first call
                    run.rec.count(op, "blocked_us", int(out["blocked_seconds"] * 1e6))
                if kind == "restore" and not out["restored_nonzero"]:
                    raise SystemExit(f"{system.name}: the RSS probe's restore left zeros")
        _progress(f"rss: {system.name}")


def read_object(run: Run) -> None:
    total, tensor = int(run.args.read_size_gib * GiB), run.args.read_tensor_mib * MiB
    big = st.read_state(total, tensor)
    rows = tensor // (4 * st.PROBE_COLS)
    run.info["read_object"] = {"snapshot_bytes": st.nbytes(big), "tensor_bytes": tensor}
    warm = {st.PROBE_KEY: st.probe_tensor(4), "other": torch.zeros(8)}
    for system in run.systems:
        with scratch_dir(run.args.workdir) as work:
            path = system.path(system_root(work, system), 0)
            system.save(big, path)
            warm_root = os.path.join(work, "warm")
            os.makedirs(warm_root)
            warm_path = system.path(warm_root, 0)
            system.save(warm, warm_path)
            for _ in range(run.args.read_repeats):
                settle(False)  # the probe drops the page cache itself, after its imports
                argv = (st.PROBE_KEY, str(rows), str(st.PROBE_COLS), warm_path)
                out = _probe(run, "read", system.name, path, *argv)
                if not out["correct"]:
                    raise SystemExit(f"{system.name}: read_object returned the wrong tensor")
                op = run.op("read_object", system)
                run.rec.add(op, out["seconds"])
                for name in ("read_bytes", "rchar", "store_bytes_read"):
                    if name in out:
                        run.rec.count(op, name, out[name])
                run.info["read_object"]["cache_dropped"] = out["cache_dropped"]
        _progress(f"read_object: {system.name}")
    del big


def delta(run: Run) -> None:
    """benchmarks/delta.py at the suite's size: its figures go to ``info["delta"]``."""
    import delta as delta_bench  # benchmarks/delta.py

    size_mib = max(16, int(run.args.size_gib * 1024) // 4)
    argv = f"--size-mib {size_mib} --bf16-mib {run.args.bf16_mib // 2} --repeats "
    argv += f"{run.args.repeats} --series {run.args.series}"
    args = delta_bench.parser().parse_args([*argv.split(), "--workdir", run.args.workdir])
    args.scenarios = list(delta_bench.SCENARIOS)
    run.info["delta"] = delta_bench.measure(args)
    _progress("delta: casnap on/off")


def bf16(run: Run) -> None:
    weights = st.bf16_weight(run.args.bf16_mib * MiB)
    run.info["bf16"] = {"raw_bytes": st.nbytes(weights), "shape": list(weights["mlp.weight"].shape)}
    for system in run.systems:
        with scratch_dir(run.args.workdir) as work:
            root = system_root(work, system)
            timed_save(run, "bf16", system, root, system.path(root, 0), weights)
        _progress(f"bf16: {system.name}")


# -- driver ----------------------------------------------------------------------


def warm_up(systems: list[System], workdir: str) -> None:
    """Save and load a tiny state with each system: lazy imports stay out of the timings."""
    tiny = {"x": torch.zeros(16)}
    for system in systems:
        with scratch_dir(workdir) as work:
            root = system_root(work, system)
            system.save(tiny, system.path(root, 0))
            system.load(system.path(root, 0), {"x": torch.empty(16)})


def _progress(msg: str) -> None:
    print(f"  [{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--size-gib", type=float, default=1.0, help="state size (default 1.0)")
    p.add_argument("--repeats", type=int, default=3, help="repeats per timed step (median)")
    default = ",".join(s for s in SCENARIOS if s != "delta")
    p.add_argument("--scenarios", default=default, help=f"subset of {','.join(SCENARIOS)}")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"subset of {','.join(SYSTEMS)}")
    p.add_argument("--out", default="bench-out/suite", help="folder for suite.json/.md/.png")
    p.add_argument("--workdir", default="bench-out/scratch", help="scratch parent (a real disk)")
    p.add_argument("--series", type=int, default=10, help="snapshots in the series scenario")
    p.add_argument("--series-pattern", default="frozen", choices=st.PATTERNS)
    p.add_argument(
        "--memory-budget-mib", type=int, default=256, help="CASNAP_MEMORY_BUDGET of the RSS probes"
    )
    p.add_argument("--read-size-gib", type=float, default=2.0)
    p.add_argument("--read-tensor-mib", type=int, default=16)
    p.add_argument("--read-repeats", type=int, default=1, help="fresh-process reads per system")
    p.add_argument("--bf16-mib", type=int, default=256)
    p.add_argument("--warm", action="store_true", help="never drop the page cache")
    p.add_argument("--no-verify", action="store_true", help="skip the bit-exact checks")
    args = p.parse_args(argv)
    try:
        args.scenarios = comma_list(args.scenarios, SCENARIOS)
        args.systems = comma_list(args.systems, list(SYSTEMS))
    except argparse.ArgumentTypeError as exc:
        p.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    started = time.perf_counter()
    load_before = os.getloadavg()
    size = int(args.size_gib * GiB)
    hidden = st.pick_hidden(size)
    state = st.build(st.model_shapes(size, hidden))
    why_warm = "--warm given" if args.warm else drop_page_cache()
    mnt, fstype = filesystem_of(os.path.abspath(args.workdir))
    systems = [SYSTEMS[name] for name in SYSTEMS if name in args.systems]
    warm_up(systems, args.workdir)
    run = Run(args, systems, state, st.target_like(state), cold=why_warm is None)
    layers = st.layer_count(state)
    run.info["state"] = {"bytes": st.nbytes(state), "tensors": len(state), "hidden": hidden}
    run.info["state"] |= {"layers": layers, "dtype": "float32"}
    print(
        f"state: {len(state)} fp32 tensors, {st.nbytes(state) / MiB:.0f} MiB (hidden {hidden}, "
        f"{layers} layers); scratch {args.workdir} on {fstype}; "
        f"{'cold' if run.cold else 'warm: ' + str(why_warm)}",
        flush=True,
    )
    timings: dict[str, float] = {}
    for scenario in args.scenarios:
        if scenario == "restore" and "take" in args.scenarios:
            continue  # measured together with take
        t0 = time.perf_counter()
        if scenario in ("take", "restore"):
            take_restore(run)
        elif scenario in INCREMENTAL:
            incremental(run, scenario)
        else:
            by_name = {"series": series, "async": async_take, "rss": rss}
            by_name |= {"read_object": read_object, "bf16": bf16, "delta": delta}
            by_name[scenario](run)
        timings[scenario] = time.perf_counter() - t0
        gc.collect()
    payload: dict[str, Any] = {
        "benchmark": "suite",
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "machine": machine(),
        "versions": suite_report.versions(),
        "scratch": {"path": os.path.abspath(args.workdir), "fstype": fstype, "mount": mnt},
        "cache": "cold" if run.cold else "warm",
        "cache_note": why_warm,
        "args": {k: v for k, v in vars(args).items()},
        "systems": {s.name: {"save": s.save_op, "load": s.load_op} for s in systems},
        "info": run.info,
        "results": run.rec.as_json(),
        "scenario_seconds": timings,
        "wall_seconds": time.perf_counter() - started,
        "loadavg": {"start": load_before, "end": os.getloadavg()},
    }
    payload["targets"] = suite_report.targets(payload)
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, "suite.json"), payload)
    md = suite_report.markdown(payload)
    with open(os.path.join(args.out, "suite.md"), "w", encoding="utf-8") as fh:
        fh.write(md)
    suite_report.plot(payload, os.path.join(args.out, "suite.png"))
    print(md)
    print(f"wrote {args.out}/suite.json, suite.md, suite.png ({payload['wall_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
