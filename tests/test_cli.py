"""The casnap CLI and the manifest-only tools behind it: log, ls, show, diff, du, verify."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import tensor_entry

from casnap import Repository, Session, Snapshot, StateDict
from casnap.cli.app import main
from casnap.ops.history import diff
from casnap.restore.drift import drift
from casnap.store import CountingStore, LocalStore

CHUNK = 64 * 1024


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def repo_dir(tmp_path) -> str:
    """Three snapshots: a big tensor that changes once, a small one, a step counter."""
    root = str(tmp_path / "repo")
    state = StateDict(big=torch.randn(200_000), small=torch.randn(100), step=0)
    opts = {"chunk_size": CHUNK, "delta": False}  # whole chunks: deltas in test_delta.py
    session = Session()  # one training process: each take descends from the previous
    for step in (1, 2, 3):
        state["step"] = step
        if step == 3:
            state["big"][:1000].add_(1.0)  # touches only the first chunk
        Snapshot.take(
            f"{root}/s{step}",
            {"s": state},
            settings=opts,
            metadata={"step": step},
            session=session,
        )
    return root


def chunk_files(root: str) -> list[str]:
    out = []
    for folder, _dirs, files in os.walk(os.path.join(root, ".casnap", "chunks")):
        out += [os.path.join(folder, f) for f in files]
    return sorted(out)


def test_every_command_has_help(capsys):
    for cmd in ["log", "ls", "show", "diff", "du", "verify"]:
        with pytest.raises(SystemExit) as info:
            main([cmd, "--help"])
        assert info.value.code == 0
        assert "usage: casnap " + cmd in capsys.readouterr().out


def test_ls_log_and_show(capsys, repo_dir):
    code, out, _ = run(capsys, "ls", repo_dir, "--json")
    assert code == 0 and json.loads(out) == ["s1", "s2", "s3"]
    code, out, _ = run(capsys, "log", repo_dir, "--json")
    log = json.loads(out)
    assert [e["name"] for e in log] == ["s1", "s2", "s3"]
    assert [e["parents"] for e in log] == [[], ["s1"], ["s2"]]
    assert log[1]["new_bytes"] == 0  # s2 changed only a primitive
    assert 0 < log[2]["new_bytes"] <= CHUNK + 200  # s3 rewrote one chunk
    code, out, _ = run(capsys, "show", f"{repo_dir}/s3")
    assert code == 0 and "0/s/big" in out and "float32" in out and "[200000]" in out
    code, out, _ = run(capsys, "show", f"{repo_dir}/s3", "--json", "--key", "0/s/big")
    assert [e["key"] for e in json.loads(out)["entries"]] == ["0/s/big"]


def test_diff_reads_no_data_without_stats(capsys, repo_dir, tmp_path):
    # Remove every chunk: a diff from manifests alone still works.
    bare = str(tmp_path / "bare")
    shutil.copytree(repo_dir, bare)
    shutil.rmtree(os.path.join(bare, ".casnap", "chunks"))
    shutil.rmtree(os.path.join(bare, ".casnap", "packs"))
    code, out, _ = run(capsys, "diff", f"{bare}/s2", f"{bare}/s3", "--json")
    assert code == 0
    rows = {r["key"]: r for r in json.loads(out)}
    assert rows["0/s/big"]["status"] == "changed" and rows["0/s/big"]["changed_chunks"] == 1
    assert rows["0/s/step"]["status"] == "changed"
    assert "0/s/small" not in rows  # unchanged rows only with --all
    code, out, _ = run(capsys, "diff", f"{bare}/s1", f"{bare}/s2", "--all")
    assert code == 0 and "unchanged" in out


def test_diff_stats_reads_only_changed_chunks(repo_dir):
    store = CountingStore(LocalStore(repo_dir))
    repo = Repository.on_store(store)
    a = repo.storage.read_manifest(repo.resolve("s2"))
    b = repo.storage.read_manifest(repo.resolve("s3"))
    store.reset()
    rows = diff(a, b)
    assert store.requests == {}  # manifests only
    (d,) = drift(repo.storage, a, repo.storage, b, rows)
    assert d.key == "0/s/big" and d.max_abs_diff == pytest.approx(1.0)
    changed = [
        cb
        for ca, cb in zip(
            tensor_entry(a.entries, "0/s/big").chunks, tensor_entry(b.entries, "0/s/big").chunks
        )
        if ca.hash != cb.hash
    ]
    assert len(changed) == 1
    assert store.bytes_read == d.bytes_read == 2 * changed[0].length


def test_diff_between_repositories(capsys, repo_dir, tmp_path):
    other = str(tmp_path / "other")
    state = StateDict(big=torch.zeros(200_000), small=torch.randn(100), step=3)
    Snapshot.take(f"{other}/x", {"s": state}, settings={"chunk_size": CHUNK})
    code, out, _ = run(capsys, "diff", f"{repo_dir}/s3", f"{other}/x", "--stats", "--json")
    rows = {r["key"]: r for r in json.loads(out)}
    assert code == 0 and rows["0/s/big"]["status"] == "changed"
    assert rows["0/s/big"]["rel_l2"] == pytest.approx(1.0)  # b is all zeros


def test_du_reports_what_deleting_each_snapshot_frees(capsys, repo_dir):
    code, out, _ = run(capsys, "du", repo_dir, "--json")
    usage = json.loads(out)
    per = {u["name"]: u for u in usage["per_snapshot"]}
    assert usage["snapshots"] == 3 and usage["dedup_ratio"] > 2.5
    # s1 and s2 share everything (s2 changed only a primitive); s3 alone holds one new chunk
    assert per["s1"]["freed_if_deleted"] == per["s2"]["freed_if_deleted"] == 0
    assert CHUNK <= per["s3"]["freed_if_deleted"] <= CHUNK + 4096


def test_log_shows_branches(capsys, tmp_path):
    root = str(tmp_path / "repo")
    base = StateDict(w=torch.randn(10))
    Snapshot.take(f"{root}/base", {"m": base})
    for branch in ("ft_a", "ft_b"):
        session = Session()  # one fine-tuning process per branch
        tuned = StateDict(w=torch.empty(10))
        Snapshot(f"{root}/base", session=session).restore({"m": tuned})  # descends from base
        tuned["w"].add_(1 if branch == "ft_a" else 2)
        Snapshot.take(f"{root}/{branch}", {"m": tuned}, session=session)
    code, out, _ = run(capsys, "log", root)
    lines = [ln for ln in out.splitlines() if "base" in ln or "ft_" in ln]
    assert code == 0 and len(lines) == 3
    assert lines[1].startswith("*") and "base" in lines[1].split("  ")[-1]
    assert lines[2].startswith("| *") or lines[2].startswith("  *")  # a second lane


def test_verify_clean_repository(capsys, repo_dir):
    code, out, _ = run(capsys, "verify", repo_dir, "--read-data")
    assert code == 0 and out.strip().endswith("OK")


def test_verify_detects_a_deleted_chunk(capsys, repo_dir):
    victim = chunk_files(repo_dir)[0]
    os.unlink(victim)
    code, out, _ = run(capsys, "verify", repo_dir, "--json")
    report = json.loads(out)
    assert code == 1 and not report["ok"]
    (problem,) = report["problems"]
    assert problem["kind"] == "missing-object" and os.path.basename(victim) in problem["subject"]
    assert problem["snapshots"]


def test_verify_detects_a_flipped_bit_only_when_reading_data(capsys, repo_dir):
    victim = chunk_files(repo_dir)[-1]
    with open(victim, "r+b") as fh:
        fh.seek(-7, os.SEEK_END)
        b = fh.read(1)
        fh.seek(-7, os.SEEK_END)
        fh.write(bytes([b[0] ^ 0x10]))
    code, _out, _ = run(capsys, "verify", repo_dir)
    assert code == 0  # existence is fine
    code, out, _ = run(capsys, "verify", repo_dir, "--read-data")
    assert code == 1 and "corrupt-chunk" in out and os.path.basename(victim)[:12] in out


def test_verify_detects_a_ref_naming_a_missing_manifest(capsys, repo_dir):
    repo = Repository(repo_dir)
    mhash = repo.resolve("s2")
    os.unlink(os.path.join(repo_dir, ".casnap", "manifests", mhash[:2], mhash))
    code, out, _ = run(capsys, "verify", repo_dir)
    assert code == 1 and "manifest" in out and "s2" in out


def test_verify_parts_cover_every_chunk_once(capsys, repo_dir, monkeypatch, tmp_path):
    total = json.loads(run(capsys, "verify", repo_dir, "--read-data", "--json")[1])["chunks_read"]
    parts = [
        json.loads(run(capsys, "verify", repo_dir, "--part", f"{k}/3", "--json")[1])
        for k in range(3)
    ]
    assert sum(p["chunks_read"] for p in parts) == total
    monkeypatch.setenv("CASNAP_STATE_DIR", str(tmp_path / "state"))
    seen = [
        json.loads(run(capsys, "verify", repo_dir, "--rotate", "3", "--json")[1])["part"]
        for _ in range(4)
    ]
    assert seen == [[0, 3], [1, 3], [2, 3], [0, 3]]
    with pytest.raises(SystemExit):
        main(["verify", repo_dir, "--part", "3/3"])


def test_missing_repository_exit_code(capsys, tmp_path):
    code, _out, err = run(capsys, "log", str(tmp_path / "nothing"))
    assert code == 3 and "no casnap repository" in err
    code, _out, err = run(capsys, "show", str(tmp_path / "nothing" / "snap"))
    assert code == 3


def test_inspection_commands_do_not_import_torch(repo_dir):
    code = (
        "import sys, casnap.cli.app\n"
        f"for cmd in (['log', {repo_dir!r}], ['du', {repo_dir!r}], ['ls', {repo_dir!r}],"
        f" ['verify', {repo_dir!r}, '--read-data'], ['diff', {repo_dir + '/s1'!r},"
        f" {repo_dir + '/s3'!r}]):\n"
        "    assert casnap.cli.app.main(cmd) == 0\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_diff_of_sharded_entries_compares_shard_chunks_by_content():
    from casnap.format.entries import ChunkRef, ShardedEntry, ShardRecord
    from casnap.format.manifest import Manifest

    def entry(hashes: list[str]) -> ShardedEntry:
        shards = [
            ShardRecord(
                offsets=[i * 2, 0],
                sizes=[2, 4],
                chunk_size=32,
                chunks=[ChunkRef(hash=h * 64, size=32, length=88)],
            )
            for i, h in enumerate(hashes)
        ]
        return ShardedEntry(
            layout="dtensor", dtype="float32", shape=[2 * len(hashes), 4], shards=shards
        )

    a = Manifest(created_at="t", entries={"0/w": entry(["a", "b"])})
    b = Manifest(created_at="t", entries={"0/w": entry(["a", "c"])})
    (row,) = diff(a, b)
    assert row.status == "changed" and row.changed_chunks == 1 and row.changed_bytes == 32
    (same,) = diff(a, a)
    assert same.status == "unchanged" and same.changed_chunks == 0
