"""Suite-wide fixtures: keep every test's local state (index, verify cursor) in its tmp dir."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _isolated_local_state(tmp_path_factory, monkeypatch):
    state = tmp_path_factory.mktemp("casnap-local")
    monkeypatch.setenv("CASNAP_INDEX_DIR", str(state / "index"))
    monkeypatch.setenv("CASNAP_STATE_DIR", str(state / "state"))


@pytest.fixture(scope="session")
def megatron_two_ranks(tmp_path_factory) -> dict:
    """test_megatron_dist.py's and test_megatron_async.py's scenarios in one launch of two ranks.

    Each rank imports Megatron-core (seconds); one launch for both files imports it once per
    rank. Returns ``{"layouts": (root, values), "async": (root, values)}``, one root each.
    """
    from dist_harness import run_ranks
    from megatron_helpers import two_rank_scenarios

    roots = {}
    for name in ("layouts", "async"):
        roots[name] = tmp_path_factory.mktemp(f"megatron-{name}") / "run1"
        roots[name].mkdir()
    outcomes = run_ranks(
        2, two_rank_scenarios, str(roots["layouts"]), str(roots["async"]), timeout=900
    )
    for o in outcomes:
        assert o.error_type == "", o.error_text
    return {name: (roots[name], [o.value[name] for o in outcomes]) for name in roots}
