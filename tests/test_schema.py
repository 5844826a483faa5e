"""The committed JSON Schemas match the models; real manifests validate against them."""

from __future__ import annotations

import glob
import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import torch

from casnap import Snapshot, StateDict
from casnap.format.parse import json_schemas

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", sorted(json_schemas()))
def test_schema_files_match_the_models(name):
    committed = json.loads((ROOT / "schema" / name).read_text())
    assert committed == json_schemas()[name], f"schema/{name} drifted: run tools/export_schema.py"


def test_export_tool_check_mode_passes_on_a_clean_tree():
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "export_schema.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


def test_a_real_manifest_validates_against_the_committed_schema(tmp_path):
    state = StateDict(w=torch.randn(3, 4), n=3, f=0.5, s="x", l=[1, (2, None)], b=b"\x00")
    Snapshot.take(str(tmp_path / "repo" / "s1"), {"s": state})
    schema = json.loads((ROOT / "schema" / "manifest-v1.schema.json").read_text())
    (path,) = glob.glob(str(tmp_path / "repo" / ".casnap" / "manifests" / "*" / "*"))
    jsonschema.validate(json.loads(Path(path).read_bytes()), schema)
    config = json.loads((tmp_path / "repo" / ".casnap" / "config.json").read_text())
    jsonschema.validate(config, json.loads((ROOT / "schema" / "config-v1.schema.json").read_text()))


def test_refs_and_tags_short_and_long_validate_against_the_committed_schemas(tmp_path):
    from casnap import Repository

    repo = Repository.init(str(tmp_path / "repo"))
    for name in ("s1", "é" * 60):  # a flat key, and a hashed one whose record says its name
        repo.take(name, {"s": StateDict(w=torch.zeros(2))})
        repo.tag(f"t-{name}", name)
    meta = tmp_path / "repo" / ".casnap"
    for folder, schema_name, field in (("refs", "ref", "name"), ("tags", "tag", "tag")):
        schema = json.loads((ROOT / "schema" / f"{schema_name}-v1.schema.json").read_text())
        records = [json.loads(p.read_bytes()) for p in sorted((meta / folder).iterdir())]
        assert len(records) == 2 and sum(field in r for r in records) == 1
        for record in records:
            jsonschema.validate(record, schema)
