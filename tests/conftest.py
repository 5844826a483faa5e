"""Suite-wide fixtures: keep every test's local state (index, verify cursor) in its tmp dir."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _isolated_local_state(tmp_path_factory, monkeypatch):
    state = tmp_path_factory.mktemp("casnap-local")
    monkeypatch.setenv("CASNAP_INDEX_DIR", str(state / "index"))
    monkeypatch.setenv("CASNAP_STATE_DIR", str(state / "state"))
