"""The model-based test (issue #23): one seeded random program over two repositories.

tests/machinery/model_sim.py runs takes (with and without a Session, random codec,
chunk and delta settings), DCP saves, damage (flips, truncations, deletions,
valid re-encodings), verify, repair, restore, read_object, rm, retention, gc,
copy and a concurrent taker, and checks after every operation that every
restore that succeeds is bit-exact, that a snapshot whose stored copies all
decode restores, that ``verify --read-data`` agrees with restore, that a
take after recorded damage is whole, that nothing taken is lost, and that a
take or DCP save without a session descends from the snapshot committed last
in its folder (docs/model.md). Fixed seed; ``CASNAP_MODEL_SECONDS`` (default 30) bounds
the time, ``CASNAP_MODEL_SEED`` and ``CASNAP_MODEL_OPS`` pick another program.
The long run is ``tests/machinery/model_run.py``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "machinery"))
import model_run  # noqa: E402
import model_sim  # noqa: E402

SEED = int(os.environ.get("CASNAP_MODEL_SEED", "20231"))
SECONDS = float(os.environ.get("CASNAP_MODEL_SECONDS", "30"))
OPS = int(os.environ.get("CASNAP_MODEL_OPS", "100000"))  # the time budget ends the run


def test_every_invariant_holds_after_every_operation_of_a_seeded_program(tmp_path):
    start = time.monotonic()
    sim = model_sim.run_program(SEED, tmp_path / "model", OPS, start + SECONDS)
    summary = {
        "seeds": [SEED],
        "operations": len(sim.ops),
        "seconds": 0,
        "counts": sim.counts,
        "violations": [{**v.__dict__, "ops": sim.ops[: v.op + 1]} for v in sim.violations],
    }
    report = model_run.render(summary)
    print(report)
    # The program did real work: every operation kind that needs no luck ran.
    assert len(sim.ops) >= 20, report
    assert sim.counts.get("take:ok", 0) > 0 and sim.counts.get("check:must:ok", 0) > 0, report
    assert not sim.violations, report


def test_the_oracle_accepts_a_valid_re_encoding_and_refuses_a_flipped_byte(tmp_path):
    """The model's own ground truth: another valid frame of the same bytes is not damage."""
    sim = model_sim.Sim(5, tmp_path)
    sim.apply(
        {
            "i": 0,
            "kind": "take",
            "repo": "A",
            "mutate": {"how": "none", "seed": 1},
            "compression": "auto",
            "zstd_level": 1,
            "chunk_size": 64 << 10,
            "delta": False,
            "name": "s0",
            "mode": "none",
            "parent": None,
        }
    )
    assert sim.must_restore("A", "s0")
    loose = next(p for p in (tmp_path / "A/.casnap/chunks").rglob("*") if p.is_file())
    frame = loose.read_bytes()
    other = model_sim.reencode(frame, 3, 4)
    assert other is not None and other != frame
    loose.write_bytes(other)
    assert sim.must_restore("A", "s0")
    damaged = bytearray(frame)
    damaged[-1] ^= 1
    loose.write_bytes(bytes(damaged))
    assert not sim.must_restore("A", "s0")
