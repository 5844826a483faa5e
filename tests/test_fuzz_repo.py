"""The repository fuzzer (tests/machinery/fuzz_repo.py) in CI: a fixed seed, a budget, no failures.

The larger run is documented in docs/fuzz.md::

    python tests/machinery/fuzz_repo.py --seed 1 --cases 5000 --seconds 600
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "machinery"))
import fuzz_repo  # noqa: E402

# Every kind, the store-level ones too (FIFOs, symlinks to /dev/zero, sparse
# 3 GiB files, integers too long to parse).
CI_KINDS = fuzz_repo.ALL_KINDS


def test_fuzzing_a_repository_finds_no_failures(tmp_path):
    summary = fuzz_repo.run(
        seed=20260101, cases=None, seconds=20, workdir=str(tmp_path), kinds=CI_KINDS
    )
    shown = json.dumps(summary["failures"], indent=1, default=str)[:6000]
    assert summary["failed"] == 0, f"{summary['outcomes']}\n{shown}"
    assert summary["cases"] >= 100, summary  # it really ran
    assert summary["outcomes"].get("ok", 0) and summary["outcomes"].get("casnap_error", 0)
    seen = summary["casnap_errors"]
    assert seen.get("IntegrityError") and seen.get("ManifestValidationError"), seen
    assert set(summary["by_kind"]) == set(CI_KINDS), summary["by_kind"]
    if Path("/proc/self/clear_refs").exists():  # every case's peak memory was measured
        assert summary["largest_growth"]["growth"] <= summary["largest_growth"]["bound"]


def test_the_judge_notices_silently_wrong_data(tmp_path):
    # The repository restores fine; only the expectation differs, as it would if a
    # damaged chunk went unnoticed: the fuzzer must call that a failure.
    base = tmp_path / "base"
    states = fuzz_repo.build(base)
    assert fuzz_repo.operate("restore", base, "s2", states) is None
    assert fuzz_repo.operate("export_safetensors", base, "s2", states) is None
    states["s2"]["w"] = states["s2"]["w"].clone()
    states["s2"]["w"][5] += 1
    assert "w" in (fuzz_repo.operate("restore", base, "s2", states) or "")
    assert "w" in (fuzz_repo.operate("export_safetensors", base, "s2", states) or "")
    states["s2"]["step"] = 99
    assert "step" in (fuzz_repo.operate("restore", base, "s2", states) or "")
    assert isinstance(states["s1"]["b"], torch.Tensor)
