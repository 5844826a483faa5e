"""Write the golden repository tests/data/golden-v1 (run once per format version; commit it).

Every future casnap must read this repository bit-exact: tests/test_golden.py
rebuilds the expected state with `golden_state()` and compares.
"""

from __future__ import annotations

import collections
import shutil
from pathlib import Path
from typing import Any

import torch

GOLDEN = Path(__file__).resolve().parent.parent / "tests" / "data" / "golden-v1"


def golden_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(20261122)
    return {
        "weights": torch.randn(64, 300, generator=g),  # several 16 KiB chunks, loose
        "bias": torch.randn(7, generator=g).to(torch.bfloat16),  # packed
        "mask": torch.rand(5, 5, generator=g) > 0.5,
        "ids": torch.randint(-(2**40), 2**40, (9,), generator=g),
        "z": torch.complex(torch.randn(3, generator=g), torch.randn(3, generator=g)),
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "meta": collections.OrderedDict(
            step=1234, lr=3e-4, name="golden/π", flags=(True, False, None),
            blob=b"\x00\xff", c=complex(1.5, -2.0), nan=float("nan"), neg0=-0.0,
            nested={"a": [1, 2.5, "x"], 7: "int key"},
        ),
    }  # fmt: skip


def main() -> None:
    from casnap import Snapshot, StateDict

    if GOLDEN.exists():
        shutil.rmtree(GOLDEN)
    opts = {"chunk_size": 16 * 1024}
    state = StateDict(golden_state())
    Snapshot.take(str(GOLDEN / "first"), {"state": state}, storage_options=opts,
                  metadata={"step": 1, "note": "golden v1"}, parents=[])  # fmt: skip
    state["weights"][3].add_(1.0)  # a second snapshot sharing most chunks
    Snapshot.take(str(GOLDEN / "second"), {"state": state}, storage_options=opts,
                  metadata={"step": 2})  # fmt: skip
    print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    main()
