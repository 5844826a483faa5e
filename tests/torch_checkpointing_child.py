"""A process for tests/test_torch_checkpointing.py: a save killed just before its rename.

``python torch_checkpointing_child.py ROOT``: saves ``ROOT/run/step_1``, then
``ROOT/run/step_2`` through torch_checkpointing's ``CheckpointManager`` over casnap,
stopping after every file of step_2 was stored, just before the rename (the
commit), writing ``ROOT/ready``; the test SIGKILLs it there.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig

from casnap.integrations import torch_checkpointing as casnap_tc

warnings.filterwarnings("ignore")


def main(root: Path) -> None:
    run = root / "run"
    config = CheckpointManager.Config(
        save=SyncCheckpointSaverConfig(),
        storage_config=casnap_tc.CasnapStorageConfig(str(run)),
    )
    manager = config.build()
    manager.save(str(run / "step_1"), {"model": {"w": torch.ones(256, 256)}})

    def stop(*args: Any, **kwargs: Any) -> None:
        (root / "ready").write_text("x")
        time.sleep(600)

    setattr(casnap_tc.CasnapStorage, "_commit", stop)  # noqa: B010  (mypy: a method)
    manager.save(str(run / "step_2"), {"model": {"w": torch.full((256, 256), 2.0)}})


if __name__ == "__main__":
    main(Path(sys.argv[1]))
