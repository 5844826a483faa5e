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
from casnap.format.manifest import json_schemas

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", sorted(json_schemas()))
def test_schema_files_match_the_models(name):
    committed = json.loads((ROOT / "schema" / name).read_text())
    assert committed == json_schemas()[name], f"schema/{name} drifted: run tools/export_schema.py"


def test_export_tool_check_mode_passes_on_a_clean_tree():
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "export_schema.py"), "--check"],
                            capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 0, result.stderr


def test_a_real_manifest_validates_against_the_committed_schema(tmp_path):
    state = StateDict(w=torch.randn(3, 4), n=3, f=0.5, s="x", l=[1, (2, None)], b=b"\x00")
    Snapshot.take(str(tmp_path / "repo" / "s1"), {"s": state})
    schema = json.loads((ROOT / "schema" / "manifest-v1.schema.json").read_text())
    (path,) = glob.glob(str(tmp_path / "repo" / ".casnap" / "manifests" / "*" / "*"))
    jsonschema.validate(json.loads(Path(path).read_bytes()), schema)
    config = json.loads((tmp_path / "repo" / ".casnap" / "config.json").read_text())
    jsonschema.validate(config, json.loads((ROOT / "schema" / "config-v1.schema.json").read_text()))
