"""A byte budget shared by the threads of one take or restore."""

from __future__ import annotations

import threading

from casnap.errors import ConfigError, expect_type
from casnap.settings import default_memory_budget


class ByteBudget:
    """Blocks ``acquire(n)`` while more than ``limit`` bytes are held.

    A request larger than the whole limit is admitted alone (when nothing else
    is held), so a single oversized chunk cannot deadlock the pipeline.
    ``peak`` records the most bytes ever held at once.
    """

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ConfigError(f"memory budget must be positive, got {limit}", "memory_budget_bytes")
        self.limit = limit
        self.held = 0
        self.peak = 0
        self._cond = threading.Condition()

    def acquire(self, n: int) -> None:
        with self._cond:
            while self.held and self.held + n > self.limit:
                self._cond.wait()
            self.held += n
            self.peak = max(self.peak, self.held)

    def release(self, n: int) -> None:
        with self._cond:
            self.held -= n
            self._cond.notify_all()


def check_budget(memory_budget_bytes: int | None) -> int:
    """The memory budget of a take, restore or export: the argument, else the default.

    A budget that is not a positive int is refused with a CasnapError.
    """
    if memory_budget_bytes is not None:
        expect_type(memory_budget_bytes, int, "memory_budget_bytes", "a number of bytes (int)")
    if memory_budget_bytes is not None and memory_budget_bytes <= 0:
        raise ConfigError(
            f"memory_budget_bytes must be positive, got {memory_budget_bytes}",
            "memory_budget_bytes",
        )
    return memory_budget_bytes or default_memory_budget()
