"""Settings: one table, one parsing policy, an override block (docs/settings.md)."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest
import torch
from helpers import tensor_entry

import casnap
from casnap import ConfigError, Snapshot, StateDict, settings, settings_kinds
from casnap.repo.repository import RepoStorage

ROOT = Path(__file__).resolve().parent.parent
BAD = {"size": "lots", "int": "four", "float": "soon", "bool": "maybe", "choice": "lz4"}


def _chunk_size(root: Path, name: str) -> int:
    repo = RepoStorage.open(str(root))
    return tensor_entry(repo.read_manifest(repo.resolve(name)).entries, "0/s/w").chunk_size


def test_every_variable_the_code_reads_is_in_the_table_and_the_docs() -> None:
    used: set[str] = set()
    for path in (ROOT / "casnap").rglob("*.py"):
        used |= set(re.findall(r"CASNAP_[A-Z_]+", path.read_text()))
    table = {v.env for v in settings.VARIABLES.values()}
    assert used <= table | {"CASNAP_"}, used - table
    docs = (ROOT / "docs" / "settings.md").read_text()
    for env in table:
        assert f"`{env}`" in docs, env


def test_only_the_settings_module_reads_the_environment_for_casnap_variables() -> None:
    readers = []
    for path in (ROOT / "casnap").rglob("*.py"):
        if path.name == "settings.py":
            continue
        for line in path.read_text().splitlines():
            if "environ" in line and "CASNAP_" in line:
                readers.append(f"{path.relative_to(ROOT)}: {line.strip()}")
    assert readers == []


@pytest.mark.parametrize("var", [v for v in settings.VARIABLES.values() if v.kind in BAD], ids=str)
def test_a_bad_value_is_a_config_error_naming_the_variable(
    var: settings_kinds.Variable, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(var.env, BAD[var.kind])
    with pytest.raises(ConfigError, match=var.env) as info:
        settings.get(var.name)
    assert info.value.name == var.env
    assert isinstance(info.value, ValueError)


def test_out_of_range_values_are_refused_with_their_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CASNAP_CHUNK_SIZE", "100")
    with pytest.raises(ConfigError, match=r"CASNAP_CHUNK_SIZE='100': must be at least 4096"):
        settings.get("chunk_size")
    monkeypatch.setenv("CASNAP_IO_WORKERS", "0")
    with pytest.raises(ConfigError, match="at least 1"):
        settings.io_workers_for(local=True)
    monkeypatch.setenv("CASNAP_LEASE_TTL", "nan")
    with pytest.raises(ConfigError, match="CASNAP_LEASE_TTL"):
        settings.lease_ttl()


def test_sizes_take_units_and_booleans_take_words(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CASNAP_MEMORY_BUDGET", "2GiB")
    assert settings.default_memory_budget() == 2 << 30
    monkeypatch.setenv("CASNAP_CHUNK_SIZE", " 65536 ")
    assert settings.get("chunk_size") == 65536
    for word, value in [("off", False), ("No", False), ("1", True), ("true", True)]:
        monkeypatch.setenv("CASNAP_INDEX", word)
        assert settings.index_enabled() is value
    monkeypatch.setenv("CASNAP_INDEX", "")  # empty is unset
    assert settings.index_enabled() is True


def test_a_take_with_a_bad_variable_fails_before_creating_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CASNAP_COMPRESSION", "lz4")
    with pytest.raises(ConfigError, match="CASNAP_COMPRESSION='lz4': expected one of auto, none"):
        Snapshot.take(str(tmp_path / "s"), {"s": StateDict(w=torch.zeros(4))})
    assert not (tmp_path / "s").exists()


def test_override_applies_inside_the_block_and_wins_over_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CASNAP_CHUNK_SIZE", "8192")
    state = {"s": StateDict(w=torch.arange(20000, dtype=torch.float32))}
    with casnap.settings.override(chunk_size="16KiB"):
        assert settings.get("chunk_size") == 16384
        Snapshot.take(str(tmp_path / "a"), state)
    Snapshot.take(str(tmp_path / "b"), state)
    assert _chunk_size(tmp_path, "a") == 16384
    assert _chunk_size(tmp_path, "b") == 8192


def test_overrides_nest_and_restore_even_on_error() -> None:
    with settings.override(zstd_level=3):
        with pytest.raises(RuntimeError), settings.override(zstd_level=5, compression="none"):
            assert settings.get("zstd_level") == 5
            raise RuntimeError("boom")
        assert settings.get("zstd_level") == 3
        assert settings.get("compression") == "auto"
        with settings.override(zstd_level=None):  # None removes the outer override
            assert settings.get("zstd_level") == settings.DEFAULT_ZSTD_LEVEL
    assert not settings.is_set("zstd_level")


def test_override_checks_values_and_names_up_front() -> None:
    with (
        pytest.raises(ConfigError, match="unknown setting 'chunksize'"),
        settings.override(chunksize=1),
    ):
        pytest.fail("the block must not run")
    with pytest.raises(ConfigError, match="chunk_size='big'"), settings.override(chunk_size="big"):
        pytest.fail("the block must not run")


def test_an_override_is_not_seen_by_other_threads() -> None:
    seen: list[int] = []
    ready, done = threading.Event(), threading.Event()

    def other() -> None:
        ready.wait()
        seen.append(settings.get("zstd_level"))
        done.set()

    t = threading.Thread(target=other)
    t.start()
    with settings.override(zstd_level=9):
        ready.set()
        done.wait()
    t.join()
    assert seen == [settings.DEFAULT_ZSTD_LEVEL]


def test_an_async_take_keeps_the_override_it_started_under(tmp_path: Path) -> None:
    state = {"s": StateDict(w=torch.arange(20000, dtype=torch.float32))}
    with settings.override(chunk_size="16KiB"):
        pending = Snapshot.async_take(str(tmp_path / "a"), state)
    pending.wait()
    assert _chunk_size(tmp_path, "a") == 16384


def test_storage_options_are_checked_like_variables(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="chunk_size=12"):
        Snapshot.take(
            str(tmp_path / "s"),
            {"s": StateDict(w=torch.zeros(4))},
            settings={"chunk_size": 12},
        )
