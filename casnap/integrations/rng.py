"""NumPy's global RNG as a stateful, for the integrations whose libraries seed and save it.

The Hugging Face Trainer and Accelerate save ``np.random``'s state beside
torch's and Python's (which :class:`casnap.RNGState` holds); this is the
third, stored as a tensor of its key and a few numbers (no pickle).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["NumpyRNGState"]


class NumpyRNGState:
    """NumPy's global RNG (``np.random``) as a stateful."""

    def state_dict(self) -> dict[str, Any]:
        kind, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
        return {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        keys = state["keys"].numpy().astype(np.uint32)
        np.random.set_state((state["kind"], keys, state["pos"], state["has_gauss"], state["gauss"]))
