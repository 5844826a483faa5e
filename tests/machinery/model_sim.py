"""A seeded model-based simulator of casnap: random programs over one or two repositories.

Issue #23. A program is a list of operations (plain dicts, so a log replays
exactly): takes with and without a ``casnap.Session`` under random codec,
chunk-size and delta settings, sparse and dense changes of bf16 / fp32 / int
tensors, DCP saves and re-saves to one id, damage to chunk and pack files
(flip, truncate, delete, or a loose chunk re-encoded into another *valid*
frame), verify, repair, restore, read_object, rm, retention, gc, copy to the
second repository, and a second process taking concurrently.

The model keeps, per repository and snapshot name, the tensors taken. After
every operation :meth:`Sim.check` asserts (docs/model.md):

(a) a snapshot whose restore succeeds is bit-exact, and a snapshot whose
    stored copies all decode (checked here, independently of the read path)
    MUST restore: only damage it still needs excuses a refusal;
(b) ``verify(read_data=True)`` flags a snapshot iff its restore fails;
(c) a take of intact live state never references a copy that was recorded
    damaged before the take (a delta base included);
(d) every snapshot that was taken and not removed still has its ref;
(e) a take or DCP save with neither a session nor parents descends from the
    snapshot committed last in its folder.

Nothing here changes casnap; it only drives its public API and reads files.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import subprocess
import sys
import threading
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import casnap
from casnap import CasnapError, Repository, Session, Snapshot, StateDict
from casnap.format import codec
from casnap.format.names import hash_bytes
from casnap.ops.copy import CopyResult
from casnap.repo.damage import list_damage

ROOT = Path(__file__).resolve().parents[2]
KINDS = (
    "take",
    "dcp",
    "damage",
    "verify",
    "repair",
    "restore",
    "read_object",
    "rm",
    "retain",
    "gc",
    "copy",
    "concurrent",
    "shared",
    "fork",
    "exit",
)
WEIGHTS = {
    "take": 24,
    "dcp": 6,
    "damage": 14,
    "verify": 5,
    "repair": 7,
    "restore": 8,
    "read_object": 6,
    "rm": 4,
    "retain": 3,
    "gc": 5,
    "copy": 5,
    "concurrent": 1,
    "shared": 2,
    "fork": 1,
    "exit": 1,
}
CHUNK_SIZES = (16 << 10, 64 << 10, 256 << 10)
MAX_SNAPSHOTS = 14  # per repository; beyond it the oldest is removed (keeps checks cheap)

# The live state: loose chunks (the big tensors, cut by the chunk size) and packed
# ones (the small tensors), in three dtypes; a table changes a few rows at a time.
SHAPES: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "table": ((512, 128), torch.float32),  # 256 KiB, sparse row updates
    "wbf": ((256, 512), torch.bfloat16),  # 256 KiB, zstd-grouped when compressed
    "ids": ((16384,), torch.int64),  # 128 KiB, low-entropy ints: zstd
    "big": ((131072,), torch.float32),  # 512 KiB
    "mid": ((3000,), torch.float32),  # 12 KB: loose at 16 KiB chunks, packed above
    "bias": ((64,), torch.float32),
    "lnb": ((300,), torch.bfloat16),
    "cnt": ((10,), torch.int32),
}

# Rebuilt identically in the concurrent taker's process.
STATE_SRC = """
import torch
def seeded_state(seed, shapes):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, dtype) in shapes.items():
        if dtype.is_floating_point:
            out[name] = torch.randn(shape, generator=g).to(dtype)
        else:
            out[name] = torch.randint(0, 50, shape, generator=g).to(dtype)
    return out
"""
_ns: dict[str, Any] = {}
exec(STATE_SRC, _ns)
seeded_state = _ns["seeded_state"]


def shapes_src() -> str:
    return repr({k: (s, str(d).replace("torch.", "")) for k, (s, d) in SHAPES.items()})


@dataclass
class Expected:
    tensors: dict[str, torch.Tensor]
    via: str  # "take" or "dcp": how it is restored
    op: int  # the operation that took it


@dataclass
class Violation:
    seed: int
    op: int
    kind: str
    subject: str
    detail: str

    def line(self) -> str:
        return f"seed {self.seed} op {self.op} [{self.kind}] {self.subject}: {self.detail}"


@dataclass
class Verdict:
    restore: str  # "ok", "refused", "wrong", "crash"
    must: bool  # every copy it needs decodes
    detail: str = ""


@dataclass
class RepoModel:
    root: Path
    snaps: dict[str, Expected] = field(default_factory=dict)
    session: Session | None = None
    cache: dict[str, tuple[Any, Verdict | None]] = field(default_factory=dict)
    # When each name's ref was last written: equal numbers for refs written by one
    # operation in an order the model does not fix (a copy, a concurrent take).
    commits: dict[str, int] = field(default_factory=dict)
    clock: int = 0

    def committed(self, *names: str) -> None:
        """``names`` were committed just now, together (their order unknown)."""
        self.clock += 1
        for name in names:
            self.commits[name] = self.clock

    def newest(self, name: str) -> set[str]:
        """The snapshots a take of ``name`` without a session may descend from: the
        last committed in its folder (docs/repository.md, "Parents")."""
        folder = name.rpartition("/")[0]
        mine = [n for n in self.snaps if n != name and n.rpartition("/")[0] == folder]
        if not mine:
            return set()
        last = max(self.commits.get(n, -1) for n in mine)
        return {n for n in mine if self.commits.get(n, -1) == last}

    @property
    def url(self) -> str:
        return str(self.root)


def clone(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.items()}


def zeros_like(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in state.items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype
        and a[k].shape == b[k].shape
        and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8))
        for k in a
    )


def is_refusal(exc: BaseException) -> bool:
    """A CasnapError, or DCP's CheckpointException wrapping only CasnapErrors."""
    if isinstance(exc, CasnapError):
        return True
    failures = getattr(exc, "failures", None)  # DCP: {rank: (exception, stack)}
    if isinstance(failures, dict) and failures:
        inner = [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        return all(isinstance(e, BaseException) and is_refusal(e) for e in inner)
    cause = exc.__cause__ or exc.__context__
    return cause is not None and cause is not exc and isinstance(cause, CasnapError)


def describe(exc: BaseException) -> str:
    """One line; DCP's CheckpointException by the exceptions inside it."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        return "; ".join(f"{type(e).__name__}: {str(e)[:300]}" for e in inner)
    return f"{type(exc).__name__}: {str(exc)[:300]}"


def reraise_interrupt(exc: BaseException) -> None:
    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
        raise exc


# -- the oracle: does every stored copy a snapshot needs decode? ------------------


class Oracle:
    """Reads a repository's files directly (not through casnap's read path)."""

    def __init__(self, root: Path) -> None:
        self.meta = root / ".casnap"
        self.memo: dict[tuple[Any, ...], bytes | None] = {}

    def loose_path(self, h: str) -> Path:
        return self.meta / "chunks" / h[:2] / h

    def pack_path(self, p: str) -> Path:
        return self.meta / "packs" / p[:2] / p

    def value(self, ref: Any) -> tuple[bytes | None, bool]:
        """(raw bytes or None, whether a loose replacement was needed)."""
        key = (ref.hash, ref.pack, ref.offset, ref.length, ref.base.hash if ref.base else None)
        if key in self.memo:
            return self.memo[key], False
        used_fallback = False
        base = None
        base_ok = True
        if ref.base is not None:
            b, fb = self.value(ref.base)
            used_fallback |= fb
            base_ok = b is not None
            base = (bytes.fromhex(ref.base.hash), b) if b is not None else None
        data: bytes | None = None
        if ref.pack is None:
            data = self._decode(self._read(self.loose_path(ref.hash)), ref, None)
        else:
            whole = self._read(self.pack_path(ref.pack))
            if whole is not None:
                frame = whole[ref.offset : ref.offset + ref.length]
                if base_ok:
                    data = self._decode(frame, ref, base)
                if data is None:  # reads fall back to a replacement chunks/<h>
                    data = self._decode(self._read(self.loose_path(ref.hash)), ref, None)
                    used_fallback = data is not None
        self.memo[key] = data
        return data, used_fallback

    @staticmethod
    def _read(path: Path) -> bytes | None:
        try:
            return path.read_bytes() if path.is_file() else None
        except OSError:
            return None

    @staticmethod
    def _decode(frame: bytes | None, ref: Any, base: Any) -> bytes | None:
        if frame is None:
            return None
        try:
            digest = bytes.fromhex(ref.hash)
            return bytes(codec.decode(frame, ref.hash[:12], digest, ref.size, base))
        except CasnapError:
            return None

    def files_of(self, ref: Any) -> list[Path]:
        out = []
        for link in ref.chain():
            out.append(self.loose_path(link.hash))
            if link.pack is not None:
                out.append(self.pack_path(link.pack))
        return out


def refs_of(repo: Repository, name: str) -> list[Any]:
    storage = repo.storage
    return list(storage.read_manifest(storage.resolve(name)).chunk_refs())


def part_files(repo: Repository, name: str) -> list[str]:
    """The files of the parts holding a snapshot's entries (docs/format.md, "Manifest parts")."""
    storage = repo.storage
    parts = storage.read_manifest(storage.resolve(name)).parts
    return [f"chunks/{p.hash[:2]}/{p.hash}" for p in parts]


def copies_of(refs: list[Any]) -> set[tuple[str, str | None]]:
    return {(link.hash, link.pack) for r in refs for link in r.chain()}


# -- the simulator ------------------------------------------------------------------


class Sim:
    def __init__(
        self,
        seed: int,
        workdir: Path,
        *,
        weights: dict[str, int] | None = None,
        avoid: frozenset[str] = frozenset(),
    ) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.workdir = workdir
        self.weights = dict(weights or WEIGHTS)
        # Triggers of a known bug to leave out, so that a run can look past it:
        # "reencode" (damage by a valid re-encoding), "raw" (compression="none").
        self.avoid = avoid
        self.repos = {"A": RepoModel(workdir / "A"), "B": RepoModel(workdir / "B")}
        for r in self.repos.values():
            Repository.init(r.url, chunk_size=64 << 10)
        self.live = seeded_state(seed, SHAPES)
        self.ops: list[dict[str, Any]] = []
        self.violations: list[Violation] = []
        self.counts: dict[str, int] = {}  # "kind" and "kind:outcome" -> times
        self.op_index = 0
        self._refs: dict[tuple[str, str], tuple[list[Any], list[Path], set[Any]]] = {}

    # -- bookkeeping ----------------------------------------------------------
    def count(self, key: str) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1

    def violate(self, kind: str, subject: str, detail: str) -> None:
        v = Violation(self.seed, self.op_index, kind, subject, detail)
        self.violations.append(v)

    def handle(self, name: str) -> Repository:
        return Repository(self.repos[name].url)

    # -- generating an operation ---------------------------------------------
    def next_op(self) -> dict[str, Any]:
        rng = self.rng
        kinds = [k for k in KINDS if self.weights.get(k, 0) > 0]
        kind = rng.choices(kinds, [self.weights[k] for k in kinds])[0]
        i = len(self.ops)
        repo = "A" if rng.random() < 0.85 else "B"
        snaps = sorted(self.repos[repo].snaps)
        pick = rng.choice(snaps) if snaps else None
        op: dict[str, Any] = {"i": i, "kind": kind, "repo": repo}
        if kind in ("take", "dcp", "concurrent"):
            op["mutate"] = self._mutation()
            op["compression"] = rng.choice(["auto", "auto", "none"])
            if "raw" in self.avoid:
                op["compression"] = "auto"
            op["zstd_level"] = rng.choice([1, 1, 3, -1, 9])
            op["chunk_size"] = 64 << 10 if rng.random() < 0.7 else rng.choice(CHUNK_SIZES)
            op["delta"] = rng.random() < 0.7
        if kind == "take":
            # a few runs in folders of their own: a take never descends from another's
            op["name"] = f"s{i}" if rng.random() < 0.7 else f"r{rng.randint(0, 1)}/s{i}"
            op["mode"] = rng.choice(
                ["session", "session", "session", "none", "none", "async", "parents", "fresh"]
            )
            op["parent"] = pick
        elif kind == "dcp":
            op["id"] = rng.choice(["d0", "d0", "d1"])
        elif kind == "damage":
            op.update(self._damage_target(repo, rng))
        elif kind == "verify":
            op["read_data"] = rng.random() < 0.5
        elif kind == "repair":
            op["source"] = rng.choice(
                ["none", "live", "snapshot-state", "snapshot-state", "other-repo"]
            )
            op["name"] = pick
            others = sorted(self.repos["B" if repo == "A" else "A"].snaps)
            op["other"] = rng.choice(others) if others else None
            op["read_data"] = rng.random() < 0.3
        elif kind in ("restore", "read_object"):
            op["name"] = pick
            op["via"] = rng.choice(["plain", "session", "repo"])
            op["adopt"] = rng.random() < 0.3
            op["key"] = rng.choice(sorted(SHAPES))
        elif kind == "rm":
            op["name"] = pick
            op["prune"] = rng.random() < 0.3
        elif kind == "retain":
            op["keep"] = rng.randint(2, 8)
            op["prune"] = rng.random() < 0.3
        elif kind == "copy":
            op["repo"] = "A" if rng.random() < 0.8 else "B"
            src = sorted(self.repos[op["repo"]].snaps)
            op["names"] = rng.sample(src, min(len(src), rng.randint(1, 3))) if src else []
        elif kind == "concurrent":
            op["repo"] = "A"
            op["name"] = f"s{i}"
            op["sub_name"] = f"p{i}"
            op["sub_seed"] = self.seed * 100_003 + i
            op["main"] = rng.choice(["take", "gc"])
        elif kind == "shared":
            op["repo"] = "A"
            op["threads"] = rng.randint(2, 3)
            op["takes"] = rng.randint(1, 3)
            op["seed"] = self.seed * 100_019 + i
            op["chunk_size"] = rng.choice(CHUNK_SIZES)
        elif kind == "fork":
            op["repo"] = "A"
            op["seed"] = self.seed * 100_043 + i
            op["during"] = rng.choice(["take", "async"])
            op["child"] = rng.choice(["nothing", "take"])
            op["exit"] = rng.choice(["normal", "_exit"])
        elif kind == "exit":
            op["repo"] = "A"
            op["seed"] = self.seed * 100_057 + i
        return op

    def _mutation(self) -> dict[str, Any]:
        rng = self.rng
        how = rng.choice(["none", "sparse", "sparse", "sparse", "dense", "revert"])
        m: dict[str, Any] = {"how": how, "seed": rng.randrange(1 << 30)}
        if how == "sparse":
            m["tensor"] = rng.choice(["table", "table", "wbf", "ids", "big", "mid", "bias"])
            rows = SHAPES[m["tensor"]][0][0]
            m["rows"] = sorted(rng.sample(range(rows), min(rows, rng.randint(1, 4))))
        elif how == "dense":
            m["tensors"] = rng.sample(sorted(SHAPES), rng.randint(1, 3))
        elif how == "revert":
            names = sorted(self.repos["A"].snaps)
            m["to"] = rng.choice(names) if names else None
        return m

    def _damage_target(self, repo: str, rng: random.Random) -> dict[str, Any]:
        meta = self.repos[repo].root / ".casnap"
        files = sorted(
            str(p.relative_to(meta))
            for sub in ("chunks", "packs")
            for p in (meta / sub).rglob("*")
            if p.is_file()
        )
        snaps = sorted(self.repos[repo].snaps)
        referenced: list[str] = []
        if snaps and rng.random() < 0.75:
            picked = rng.choice(snaps)
            try:
                refs = refs_of(self.handle(repo), picked)
                referenced += part_files(self.handle(repo), picked)  # a part is damaged too
            except CasnapError:
                refs = []
            for r in refs:
                for link in r.chain():
                    referenced.append(
                        f"packs/{link.pack[:2]}/{link.pack}"
                        if link.pack
                        else f"chunks/{link.hash[:2]}/{link.hash}"
                    )
        pool = sorted(set(referenced)) or files
        how = rng.choice(["flip", "flip", "truncate", "delete", "reencode", "reencode", "reencode"])
        if how == "reencode" and "reencode" in self.avoid:
            how = "flip"
        if how == "reencode":
            loose = [f for f in pool if f.startswith("chunks/")] or [
                f for f in files if f.startswith("chunks/")
            ]
            pool = loose or pool
        return {
            "file": rng.choice(pool) if pool else None,
            "how": how,
            "where": rng.random(),
            "level": rng.choice([1, 3, 19, -3]),
            "elem": rng.choice([0, 2, 4]),
        }

    # -- executing ------------------------------------------------------------
    def apply(self, op: dict[str, Any]) -> None:
        self.op_index = op["i"]
        self.ops.append(op)
        kind = op["kind"]
        self.count(kind)
        try:
            outcome = getattr(self, f"op_{kind}")(op) or "done"
        except BaseException as exc:  # noqa: BLE001 - a non-casnap error is a finding
            if is_refusal(exc):
                outcome = f"refused:{type(exc).__name__}"
            else:
                outcome = "crash"
                self.violate("crash", kind, "".join(traceback.format_exception(exc))[-1500:])
        self.count(f"{kind}:{outcome}")

    def _settings(self, op: dict[str, Any]) -> Any:
        return casnap.settings.override(
            compression=op["compression"], zstd_level=op["zstd_level"], delta=op["delta"]
        )

    def _mutate(self, m: dict[str, Any]) -> None:
        g = torch.Generator().manual_seed(m["seed"])
        how = m["how"]
        if how == "sparse":
            t = self.live[m["tensor"]]
            for r in m["rows"]:
                fresh = torch.randn(t[r].shape, generator=g) * 3
                t[r] = fresh.to(t.dtype) if t.dtype.is_floating_point else fresh.abs().to(t.dtype)
        elif how == "dense":
            for name in m["tensors"]:
                shape, dtype = SHAPES[name]
                if dtype.is_floating_point:
                    self.live[name] = torch.randn(shape, generator=g).to(dtype)
                else:
                    self.live[name] = torch.randint(0, 50, shape, generator=g).to(dtype)
        elif how == "revert" and m.get("to") in self.repos["A"].snaps:
            self.live = clone(self.repos["A"].snaps[m["to"]].tensors)

    def records(self, repo: str) -> set[tuple[str, str | None]]:
        return {(c.chunk, c.pack) for c in list_damage(self.handle(repo).storage)}

    def op_take(self, op: dict[str, Any]) -> str:
        rm = self.repos[op["repo"]]
        self._mutate(op["mutate"])
        kw: dict[str, Any] = {"metadata": {"step": op["i"]}}
        mode = op["mode"]
        if mode == "fresh":
            rm.session = None
        if mode in ("session", "fresh"):
            rm.session = rm.session or Session()
            kw["session"] = rm.session
        if mode == "parents" and op.get("parent") in rm.snaps:
            kw["parents"] = [self.handle(op["repo"]).storage.resolve(op["parent"])]
        before = self.records(op["repo"])
        self._trim(op["repo"])
        auto = "session" not in kw and "parents" not in kw  # the newest in its folder
        newest = rm.newest(op["name"])
        path, app_state = f"{rm.url}/{op['name']}", {"m": StateDict(**self.live)}
        kw.update(repository=rm.url, settings={"chunk_size": op["chunk_size"]})
        with self._settings(op):
            if mode == "async":
                snap = Snapshot.async_take(path, app_state, **kw).wait()
            else:
                snap = Snapshot.take(path, app_state, **kw)
        rm.snaps[op["name"]] = Expected(clone(self.live), "take", op["i"])
        rm.committed(op["name"])
        if auto:
            self._check_parent(op["repo"], op["name"], snap.manifest.parents, newest)
        self._check_fresh(op["repo"], op["name"], before)
        return "ok"

    def _check_parent(self, repo: str, name: str, parents: list[str], newest: set[str]) -> None:
        """(e): a take or DCP save with no parent given and no session descends from the
        last snapshot committed in its folder, or from none when the folder is empty."""
        handle = self.handle(repo).storage
        allowed = {handle.resolve(n) for n in newest if handle.has_ref(n)}
        if (parents == [] and not allowed) or (len(parents) == 1 and parents[0] in allowed):
            return
        names = {
            h: n for n in self.repos[repo].snaps if handle.has_ref(n) for h in [handle.resolve(n)]
        }
        got = [names.get(p, p[:12]) for p in parents]
        self.violate(
            "wrong-parent", f"{repo}/{name}", f"parents {got}, expected one of {sorted(newest)}"
        )

    def op_dcp(self, op: dict[str, Any]) -> str:
        import torch.distributed.checkpoint as dcp

        from casnap.integrations.dcp import HISTORY_SEP, CasnapWriter

        rm = self.repos[op["repo"]]
        self._mutate(op["mutate"])
        repo = self.handle(op["repo"])
        storage = repo.storage
        old = storage.resolve(op["id"]) if storage.has_ref(op["id"]) else None
        before = self.records(op["repo"])
        self._trim(op["repo"])
        current = storage.resolve(op["id"]) if storage.has_ref(op["id"]) else None  # after trim
        newest = rm.newest(op["id"])
        writer = CasnapWriter(
            f"{rm.url}/{op['id']}",
            metadata={"step": op["i"]},
            settings={"chunk_size": op["chunk_size"]},
            repository=rm.url,
        )
        with self._settings(op):
            dcp.save({"model": dict(self.live)}, storage_writer=writer)
        if old is not None and op["id"] in rm.snaps:
            history = f"{op['id']}{HISTORY_SEP}{old[:12]}"
            rm.snaps[history] = rm.snaps.pop(op["id"])
            rm.committed(history)
        rm.snaps[op["id"]] = Expected(clone(self.live), "dcp", op["i"])
        rm.committed(op["id"])
        if writer.last_manifest is not None:
            parents = storage.read_manifest(writer.last_manifest).parents
            if current is not None and parents != [current]:  # a re-save: the one it replaced
                self.violate("wrong-parent", f"{op['repo']}/{op['id']}", "not the replaced save")
            elif current is None:
                self._check_parent(op["repo"], op["id"], parents, newest)
        self._check_fresh(op["repo"], op["id"], before)
        return "resave" if old is not None else "ok"

    def _trim(self, repo: str, room: int = 1) -> None:
        """Keep at most MAX_SNAPSHOTS per repository once ``room`` more are taken (the
        oldest goes, ref only)."""
        rm = self.repos[repo]
        while rm.snaps and len(rm.snaps) + room > MAX_SNAPSHOTS:
            oldest = min(rm.snaps, key=lambda n: rm.snaps[n].op)
            self.handle(repo).delete(oldest)
            del rm.snaps[oldest]
            self.count("trim")

    def _check_fresh(self, repo: str, name: str, before: set[Any]) -> None:
        """(c): a new snapshot of intact live state names no copy recorded damaged before."""
        oracle = Oracle(self.repos[repo].root)
        refs = refs_of(self.handle(repo), name)
        for r in refs:
            for link in r.chain():
                data, _ = oracle.value(link)
                if data is None and (link.hash, link.pack) in before:
                    where = f"pack {link.pack[:12]}" if link.pack else "loose"
                    role = "delta base" if link is not r else "chunk"
                    self.violate(
                        "take-reused-damaged",
                        f"{repo}/{name}",
                        f"{role} {link.hash[:12]} ({where}) was recorded damaged "
                        f"before this take and is still damaged",
                    )
                    return

    def op_damage(self, op: dict[str, Any]) -> str:
        if not op.get("file"):
            return "nothing"
        path = self.repos[op["repo"]].root / ".casnap" / op["file"]
        if not path.is_file():
            return "gone"
        data = bytearray(path.read_bytes())
        how = op["how"]
        if how == "reencode":
            fresh = reencode(bytes(data), op["level"], op["elem"])
            if fresh is None:
                how = "flip"
            else:
                _write(path, fresh)
                return "reencode"
        if how == "flip" and data:
            data[int(op["where"] * len(data))] ^= 0x01 << (op["i"] % 8)
            _write(path, bytes(data))
        elif how == "truncate":
            _write(path, bytes(data[: int(op["where"] * len(data))]))
        elif how == "delete":
            path.unlink()
        return how

    def op_verify(self, op: dict[str, Any]) -> str:
        report = self.handle(op["repo"]).verify(read_data=op["read_data"])
        return "ok" if report.ok else "problems"

    def op_repair(self, op: dict[str, Any]) -> str:
        rm = self.repos[op["repo"]]
        repo = self.handle(op["repo"])
        kw: dict[str, Any] = {"read_data": op["read_data"]}
        src = op["source"]
        if src == "live":
            kw["from_states"] = [{"m": StateDict(**clone(self.live))}]
        elif src == "snapshot-state" and op.get("name") in rm.snaps:
            exp = rm.snaps[op["name"]]
            state = dict(exp.tensors)
            kw["from_states"] = [
                {"m": StateDict(**state)} if exp.via == "take" else {"model": state}
            ]
        elif src == "other-repo" and op.get("other"):
            other = self.repos["B" if op["repo"] == "A" else "A"]
            if op["other"] in other.snaps:
                kw["from_snapshots"] = [f"{other.url}/{op['other']}"]
        result = repo.repair(**kw)
        # Repair's own verdict: a snapshot it calls ok or repaired must restore.
        for root in result.roots:
            claims_ok = root.status in ("ok", "repaired")
            if root.kind == "snapshot" and claims_ok and root.name in rm.snaps:
                v = self.restore_verdict(op["repo"], root.name)
                if v.restore != "ok":
                    self.violate(
                        "repair-claims-ok",
                        f"{op['repo']}/{root.name}",
                        f"repair said {root.status}, restore: {v.restore} {v.detail}",
                    )
        return "ok" if result.ok else "unrecoverable"

    def op_restore(self, op: dict[str, Any]) -> str:
        rm = self.repos[op["repo"]]
        name = op.get("name")
        if name not in rm.snaps:
            return "nothing"
        exp = rm.snaps[name]
        if exp.via == "dcp" or op["via"] == "plain":
            v = self.restore_verdict(op["repo"], name)
        else:
            target = {"m": StateDict(**zeros_like(exp.tensors))}
            try:
                if op["via"] == "session":
                    rm.session = rm.session or Session()
                    Snapshot(
                        f"{rm.url}/{name}",
                        repository=rm.url,
                        session=rm.session,
                    ).restore(target)
                else:
                    self.handle(op["repo"]).snapshot(name).restore(target)
                got = dict(target["m"])
                v = Verdict("ok" if same(got, exp.tensors) else "wrong", True)
            except BaseException as exc:  # noqa: BLE001
                reraise_interrupt(exc)
                v = Verdict("refused" if is_refusal(exc) else "crash", True, repr(exc)[:300])
        self._judge(op["repo"], name, v)
        if v.restore == "ok" and op["adopt"]:
            self.live = clone(exp.tensors)  # resume from it
        return v.restore

    def op_read_object(self, op: dict[str, Any]) -> str:
        rm = self.repos[op["repo"]]
        name = op.get("name")
        if name not in rm.snaps:
            return "nothing"
        exp = rm.snaps[name]
        key = f"0/{'m' if exp.via == 'take' else 'model'}/{op['key']}"
        try:
            got = Snapshot(f"{rm.url}/{name}", repository=rm.url).read_object(key)
        except BaseException as exc:  # noqa: BLE001
            reraise_interrupt(exc)
            v = Verdict("refused" if is_refusal(exc) else "crash", True, repr(exc)[:300])
        else:
            ok = same({"t": got}, {"t": exp.tensors[op["key"]]})
            v = Verdict("ok" if ok else "wrong", True, "" if ok else f"key {key}")
        if v.restore != "ok":
            self._judge(op["repo"], name, v, what="read_object")
        return v.restore

    def op_rm(self, op: dict[str, Any]) -> str:
        rm = self.repos[op["repo"]]
        if op.get("name") not in rm.snaps:
            return "nothing"
        repo = self.handle(op["repo"])
        manifest = repo.delete(op["name"])
        del rm.snaps[op["name"]]
        if op["prune"]:
            repo.reclaim([manifest], wait_seconds=5)
            return "pruned"
        return "ok"

    def op_retain(self, op: dict[str, Any]) -> str:
        from casnap import KeepLast, RetentionPolicy

        rm = self.repos[op["repo"]]
        if not rm.snaps:
            return "nothing"
        result = self.handle(op["repo"]).retain(
            RetentionPolicy(KeepLast(op["keep"])), prune=op["prune"], wait_seconds=5
        )
        for name in result.deleted:
            rm.snaps.pop(name, None)
        return f"deleted{min(len(result.deleted), 3)}"

    def op_gc(self, op: dict[str, Any]) -> str:
        result = self.handle(op["repo"]).gc(grace_seconds=0, wait_seconds=5)
        return "freed" if result.bytes_freed else "nothing"

    def op_copy(self, op: dict[str, Any]) -> str:
        src_name, dst_name = op["repo"], "B" if op["repo"] == "A" else "A"
        src, dst = self.repos[src_name], self.repos[dst_name]
        names = [n for n in op["names"] if n in src.snaps]
        if not names:
            return "nothing"
        while dst.snaps and len(dst.snaps) + len(names) > MAX_SNAPSHOTS:
            oldest = min(dst.snaps, key=lambda n: dst.snaps[n].op)
            self.handle(dst_name).delete(oldest)
            del dst.snaps[oldest]
        failed: dict[str, str] = {}
        try:
            result = self.handle(src_name).copy_to(dst.url, names, force=True)
        except casnap.errors.CopyIntegrityError as exc:
            assert isinstance(exc.result, CopyResult)  # what the copy sent before it failed
            result, failed = exc.result, exc.failed
        for name in (*result.copied, *result.present):
            dst.snaps[name] = Expected(
                clone(src.snaps[name].tensors), src.snaps[name].via, src.snaps[name].op
            )
        if result.copied:
            dst.committed(*result.copied)
        for name in failed:
            # Copy sends every object the manifest names, each checked on its own
            # (docs/copy.md): a pack against its name, so one damaged frame refuses every
            # snapshot in it, and a delta's base even where a restore reads the chunk
            # from a stand-in chunks/<h>.
            if self.must_restore(src_name, name) and not self._damaged_object(src_name, name):
                self.violate(
                    "copy-refused-intact",
                    f"{src_name}/{name}",
                    f"copy refused it ({failed[name][:200]}) though every copy decodes",
                )
        return "partial" if failed else "ok"

    def _damaged_object(self, repo: str, name: str) -> bool:
        """Whether an object snapshot ``name``'s manifest names (delta bases included) is
        damaged or gone on its own: a pack that no longer matches its name, a loose
        chunk that does not decode."""
        try:
            refs = refs_of(self.handle(repo), name)
        except CasnapError:
            return False
        oracle = Oracle(self.repos[repo].root)
        for link in {link for r in refs for link in r.chain()}:
            if link.pack is not None:
                data = oracle._read(oracle.pack_path(link.pack))
                if data is None or hash_bytes(data) != link.pack:
                    return True
            elif oracle._decode(oracle._read(oracle.loose_path(link.hash)), link, None) is None:
                return True
        return False

    def op_concurrent(self, op: dict[str, Any]) -> str:
        rm = self.repos[op["repo"]]
        self._trim(op["repo"])
        self._trim(op["repo"])
        code = STATE_SRC + (
            "\nimport torch\nfrom casnap import Snapshot, StateDict\n"
            f"shapes = {{k: (s, getattr(torch, d)) for k, (s, d) in {shapes_src()}.items()}}\n"
            f"Snapshot.take({rm.url + '/' + op['sub_name']!r}, "
            f"{{'m': StateDict(**seeded_state({op['sub_seed']}, shapes))}}, "
            f"repository={rm.url!r}, settings={{'chunk_size': {op['chunk_size']}}})\n"
        )
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        proc = subprocess.Popen(
            [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        try:
            if op["main"] == "take":
                self.op_take({**op, "mode": "session", "parent": None})
            else:
                self.handle(op["repo"]).gc(grace_seconds=0, wait_seconds=30)
        finally:
            out, _ = proc.communicate(timeout=300)
        if proc.returncode == 0:
            theirs = seeded_state(op["sub_seed"], SHAPES)
            rm.snaps[op["sub_name"]] = Expected(theirs, "take", op["i"])
            together = [n for n in (op["sub_name"], op["name"]) if n in rm.snaps]
            rm.committed(*together)  # which ref came last is not known
            return f"both-{op['main']}"
        self.violate(
            "concurrent-take-failed",
            f"{op['repo']}/{op['sub_name']}",
            out.decode(errors="replace")[-800:],
        )
        return "sub-failed"

    def op_shared(self, op: dict[str, Any]) -> str:
        """Several threads take through one ``Repository`` object (one store): each take,
        the moment it returns, restores bit-exact (issue #40)."""
        rm = self.repos[op["repo"]]
        self._trim(op["repo"], op["threads"] * op["takes"])
        shared = self.handle(op["repo"])
        settings = {"chunk_size": op["chunk_size"]}
        taken: dict[str, dict[str, torch.Tensor]] = {}
        late: list[str] = []

        def taker(t: int) -> None:
            for k in range(op["takes"]):
                name = f"t{op['i']}_{t}_{k}"
                state = seeded_state(op["seed"] + 31 * t + k, SHAPES)
                app = {"m": StateDict(**state)}
                Snapshot.take(f"{rm.url}/{name}", app, repository=shared, settings=settings)
                taken[name] = state
                got = {"m": StateDict(**zeros_like(state))}
                try:
                    Snapshot(f"{rm.url}/{name}", repository=shared).restore(got)
                except BaseException as exc:  # noqa: BLE001 - the finding
                    late.append(f"{name}: {describe(exc)}")
                    continue
                if not same(dict(got["m"]), state):
                    late.append(f"{name}: other bytes")

        errors: list[BaseException] = []

        def run(t: int) -> None:
            try:
                taker(t)
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(t,)) for t in range(op["threads"])]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        for name, state in taken.items():
            rm.snaps[name] = Expected(state, "take", op["i"])
        rm.committed(*taken)
        for detail in late:
            self.violate("returned-before-whole", f"{op['repo']}/{detail.split(':')[0]}", detail)
        if errors:
            raise errors[0]
        return "ok"

    def _script(self, op: dict[str, Any], body: str) -> tuple[int | None, str]:
        """Run ``body`` in a child Python with the model's seeded states; (exit code, output),
        exit code None if it hung past a minute."""
        code = (
            STATE_SRC
            + (
                "\nimport os, sys, threading, torch\nfrom casnap import Snapshot, StateDict\n"
                f"shapes = {{k: (s, getattr(torch, d)) for k, (s, d) in {shapes_src()}.items()}}\n"
                f"url = {self.repos[op['repo']].url!r}\n"
            )
            + body
        )
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        try:
            out = subprocess.run(
                [sys.executable, "-c", code], env=env, capture_output=True, timeout=60
            )
        except subprocess.TimeoutExpired as exc:
            return None, (exc.stdout or b"").decode(errors="replace")[-800:]
        return out.returncode, (out.stdout + out.stderr).decode(errors="replace")[-800:]

    def op_fork(self, op: dict[str, Any]) -> str:
        """The process forks while a take (or an async take's commit) runs; the child takes
        into the same repository or does nothing, and exits normally or by ``os._exit``."""
        rm = self.repos[op["repo"]]
        self._trim(op["repo"], 2)
        mine, child = f"f{op['i']}", f"c{op['i']}"
        start = (
            "job = Snapshot.async_take(path, app)\nend = job.wait\n"
            if op["during"] == "async"
            else "job = threading.Thread(target=Snapshot.take, args=(path, app))\n"
            "job.start()\nend = job.join\n"
        )
        child_take = (
            f"    Snapshot.take(url + '/{child}', "
            f"{{'m': StateDict(**seeded_state({op['seed'] + 1}, shapes))}})\n"
            if op["child"] == "take"
            else ""
        )
        leave = "    sys.exit(0)\n" if op["exit"] == "normal" else "    os._exit(0)\n"
        # A training script forks after its first snapshots, with every module imported:
        # a child that needs a module a parent thread was importing at the fork waits for
        # it for ever (CPython's import locks), whatever casnap does. Then the child as a
        # DataLoader worker sets torch to one thread (torch's pool is not fork-safe).
        warm = f"{rm.root.parent}/warm-{op['i']}"
        body = (
            f"warm = {{'m': StateDict(**seeded_state({op['seed'] + 2}, shapes))}}\n"
            f"Snapshot.take({warm!r} + '/w1', warm)\n"
            f"Snapshot.async_take({warm!r} + '/w2', warm).wait()\n"
            f"path = url + '/{mine}'\n"
            f"app = {{'m': StateDict(**seeded_state({op['seed']}, shapes))}}\n"
            + start
            + "pid = os.fork()\nif pid == 0:\n    torch.set_num_threads(1)\n"
            + child_take
            + leave
            + "_, status = os.waitpid(pid, 0)\nend()\n"
            f"import shutil\nshutil.rmtree({warm!r})\n"
            "sys.exit(os.waitstatus_to_exitcode(status))\n"
        )
        code, out = self._script(op, body)
        if code is None:
            self.violate("hang", f"{op['repo']}/{mine}", f"fork during a take hung: {out}")
            return "hung"
        if code != 0:
            self.violate("fork-failed", f"{op['repo']}/{mine}", out)
            return "failed"
        rm.snaps[mine] = Expected(seeded_state(op["seed"], SHAPES), "take", op["i"])
        names = [mine]
        if op["child"] == "take":
            rm.snaps[child] = Expected(seeded_state(op["seed"] + 1, SHAPES), "take", op["i"])
            names.append(child)
        rm.committed(*names)
        return f"{op['during']}-{op['child']}"

    def op_exit(self, op: dict[str, Any]) -> str:
        """A process ends with an async take pending (no ``wait()``): its snapshot lands."""
        rm = self.repos[op["repo"]]
        self._trim(op["repo"])
        name = f"x{op['i']}"
        body = (
            f"Snapshot.async_take(url + '/{name}', "
            f"{{'m': StateDict(**seeded_state({op['seed']}, shapes))}})\n"
        )
        code, out = self._script(op, body)
        if code != 0:
            self.violate("exit-failed", f"{op['repo']}/{name}", f"exit code {code}: {out}")
            return "failed"
        rm.snaps[name] = Expected(seeded_state(op["seed"], SHAPES), "take", op["i"])
        rm.committed(name)
        return "ok"

    # -- the invariants -------------------------------------------------------
    def restore_verdict(self, repo: str, name: str) -> Verdict:
        rm = self.repos[repo]
        exp = rm.snaps[name]
        path = f"{rm.url}/{name}"
        try:
            if exp.via == "dcp":
                import torch.distributed.checkpoint as dcp

                from casnap.integrations.dcp import CasnapReader

                target: dict[str, Any] = {"model": zeros_like(exp.tensors)}
                dcp.load(
                    target,
                    storage_reader=CasnapReader(path, repository=rm.url),
                )
                got = target["model"]
            else:
                st = {"m": StateDict(**zeros_like(exp.tensors))}
                Snapshot(path, repository=rm.url).restore(st)
                got = dict(st["m"])
        except BaseException as exc:  # noqa: BLE001
            reraise_interrupt(exc)
            return Verdict("refused" if is_refusal(exc) else "crash", True, describe(exc))
        if not same(got, exp.tensors):
            bad = [
                k
                for k in exp.tensors
                if not same({k: got.get(k, torch.empty(0))}, {k: exp.tensors[k]})
            ]
            return Verdict("wrong", True, f"keys differ: {bad}")
        return Verdict("ok", True)

    def must_restore(self, repo: str, name: str) -> bool:
        oracle = Oracle(self.repos[repo].root)
        try:
            refs = self.manifest_refs(repo, self.handle(repo).storage.resolve(name))[0]
        except CasnapError:
            return False
        return all(oracle.value(r)[0] is not None for r in refs)

    def manifest_refs(self, repo: str, manifest: str) -> tuple[list[Any], list[Path], set[Any]]:
        """A manifest's chunk references, the files they and its parts read, their copies
        (memoized: manifests are immutable and never damaged here; their parts may be)."""
        key = (repo, manifest)
        if key not in self._refs:
            oracle = Oracle(self.repos[repo].root)
            read = self.handle(repo).storage.read_manifest(manifest)
            refs = list(read.chunk_refs())
            paths = sorted(
                {p for r in refs for p in oracle.files_of(r)}
                | {oracle.loose_path(part.hash) for part in read.parts}
            )
            self._refs[key] = (refs, paths, copies_of(refs))
        return self._refs[key]

    def fingerprint(self, repo: str, name: str, records: set[Any]) -> Any:
        manifest = self.handle(repo).storage.resolve(name)
        _, paths, copies = self.manifest_refs(repo, manifest)
        stats: list[tuple[Any, ...]] = []
        for p in paths:
            try:
                s = p.stat()
                stats.append((str(p), s.st_size, s.st_mtime_ns, s.st_ino))
            except OSError:
                stats.append((str(p), None))
        return (manifest, tuple(stats), tuple(sorted(str(c) for c in records if c in copies)))

    def _judge(self, repo: str, name: str, v: Verdict, what: str = "restore") -> None:
        subject = f"{repo}/{name}"
        if v.restore == "wrong":
            self.violate("wrong-bytes", subject, f"{what} returned other bytes: {v.detail}")
        elif v.restore == "crash":
            self.violate("crash", subject, f"{what}: {v.detail}")
        elif v.restore == "refused" and self.must_restore(repo, name):
            self.violate(
                "must-restore",
                subject,
                f"{what} refused though every copy it needs decodes: {v.detail}",
            )

    def check(self) -> None:
        for repo, rm in self.repos.items():
            refs = set(self.handle(repo).snapshots())
            for name in sorted(set(rm.snaps) - refs):  # (d)
                self.violate("lost", f"{repo}/{name}", "taken, never removed, but has no ref")
                del rm.snaps[name]
            for name in sorted(refs - set(rm.snaps)):
                self.violate("phantom", f"{repo}/{name}", "a ref the model never saw taken")
            records = self.records(repo)
            prints = {n: self.fingerprint(repo, n, records) for n in sorted(rm.snaps)}
            changed = [n for n in prints if rm.cache.get(n, (None,))[0] != prints[n]]
            if not changed:
                continue
            report = self.handle(repo).verify(read_data=True)
            flagged = {s for p in report.problems for s in p.snapshots}
            for name in changed:
                v = self.restore_verdict(repo, name)
                self._judge(repo, name, v)
                if (v.restore == "ok") == (name in flagged):  # (b)
                    why = [
                        f"{p.kind} {p.subject[:16]}: {p.detail[:160]}"
                        for p in report.problems
                        if name in p.snapshots
                    ]
                    self.violate(
                        "verify-disagrees",
                        f"{repo}/{name}",
                        f"restore {v.restore} ({v.detail[:200]}), verify --read-data {why or 'ok'}",
                    )
                self.count(
                    f"check:{'must' if self.must_restore(repo, name) else 'damaged'}:{v.restore}"
                )
            records = self.records(repo)  # the reads above may have recorded damage
            rm.cache = {n: (self.fingerprint(repo, n, records), None) for n in rm.snaps}


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".model-tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def reencode(frame: bytes, level: int, elem: int) -> bytes | None:
    """Another valid frame of the same bytes (raw <-> zstd / zstd-grouped), or None."""
    try:
        hdr = codec.parse_header(frame, "model")
        if hdr.codec == codec.CODEC_DELTA:
            return None
        raw = bytes(codec.decode(frame, "model", hdr.digest, hdr.raw_length))
    except CasnapError:
        return None
    if hdr.codec == codec.CODEC_RAW:
        choice = codec.CODEC_ZSTD_GROUPED if elem and len(raw) % elem == 0 else codec.CODEC_ZSTD
        head, body = codec.encode(raw, hdr.digest, level=level, elem_size=elem, choice=choice)
    else:
        head, body = codec.encode(raw, hdr.digest, compress=False)
    out = head + bytes(body)
    return None if out == frame else out


def run_program(
    seed: int,
    workdir: Path,
    ops: int,
    deadline: float | None = None,
    weights: dict[str, int] | None = None,
    program: list[dict[str, Any]] | None = None,
    max_violations: int = 5,
    avoid: frozenset[str] = frozenset(),
) -> Sim:
    """Run ``ops`` generated operations (or exactly ``program``) with a check after each."""
    log = logging.getLogger("casnap")
    level, threads = log.level, torch.get_num_threads()
    torch.set_num_threads(1)
    log.setLevel(logging.ERROR)  # damage warnings are expected here
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            return _run(seed, workdir, ops, deadline, weights, program, max_violations, avoid)
    finally:  # a test run after this one in the same process sees casnap's warnings again
        log.setLevel(level)
        torch.set_num_threads(threads)


def _run(
    seed: int,
    workdir: Path,
    ops: int,
    deadline: float | None,
    weights: dict[str, int] | None,
    program: list[dict[str, Any]] | None,
    max_violations: int,
    avoid: frozenset[str],
) -> Sim:
    import time

    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    sim = Sim(seed, workdir, weights=weights, avoid=avoid)
    n = len(program) if program is not None else ops
    for k in range(n):
        if deadline is not None and time.monotonic() > deadline:
            break
        op = program[k] if program is not None else sim.next_op()
        sim.apply(op)
        try:
            sim.check()
        except BaseException as exc:  # noqa: BLE001
            reraise_interrupt(exc)
            sim.violate("check-crash", op["kind"], "".join(traceback.format_exception(exc))[-1500:])
        if len(sim.violations) >= max_violations:
            break
    return sim
