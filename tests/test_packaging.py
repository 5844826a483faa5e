"""What a user installing casnap with pip gets: the package, its typing marker, the CLI."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_ships_py_typed_and_the_casnap_command(tmp_path):
    # Build from a copy: setuptools writes build/ and *.egg-info next to the sources.
    src = tmp_path / "src"
    shutil.copytree(ROOT / "casnap", src / "casnap", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    out = tmp_path / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--disable-pip-version-check",
            "-w",
            str(out),
            str(src),
        ],
        check=True,
        cwd=tmp_path,
        timeout=300,
    )
    (wheel,) = out.glob("casnap-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "casnap/py.typed" in names
    assert "casnap/cli/app.py" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    entry_text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "casnap = casnap.cli:main" in entry_text
    # fsspec finds casnap:// through it in every process (docs/dcp.md)
    assert "[fsspec.specs]\ncasnap = casnap.integrations.dcp_fs:CasnapFileSystem" in entry_text


def test_the_source_tree_marks_the_package_typed():
    assert (ROOT / "casnap" / "py.typed").is_file()
    assert 'casnap = ["py.typed"]' in (ROOT / "pyproject.toml").read_text()


def test_install_words_name_what_pip_can_install():
    """casnap is on no package index: `pip install 'casnap[lightning]'` finds nothing. What
    the README, the docs and casnap's own messages tell a user to run installs from a
    checkout (`.[extra]`) or a git URL (`casnap[extra] @ git+...`), with extras that exist."""
    import re

    import pytest

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    )
    texts = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    texts += sorted((ROOT / "casnap").rglob("*.py"))
    named = 0
    for path in texts:
        for line in path.read_text().splitlines():
            for command in re.findall(r"pip install ([^`#\n]*)", line):
                by_name = r"""(^|\s)['"]?casnap(\[[^\]]*\])?(?!\s*@)['"]?(\s|$)"""
                assert not re.search(by_name, command), f"{path.name}: {line.strip()}"
                for listed in re.findall(r"\[([a-z0-9_,-]+)\]", command):
                    named += 1
                    assert set(listed.split(",")) <= extras, f"{path.name}: {line.strip()}"
    assert named >= 5  # the README and docs do name extras
