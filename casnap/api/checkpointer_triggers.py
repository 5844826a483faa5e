"""When a :class:`~casnap.api.checkpointer.Checkpointer` takes: every N steps, every T
seconds, and on a preemption signal (SIGTERM), each decided the same on every rank.

:class:`Schedule` (either interval triggers; a monotonic, injectable clock
counted from the end of the last take), :class:`PreemptionGuard` (records the
signal; the next take hands it on to the handler that was there before) and
:func:`any_rank` (one exchange per ``maybe_take``, so every rank takes if any
decided to). docs/retention.md, "When it takes", gives the semantics.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterable
from datetime import timedelta
from types import FrameType
from typing import Any

from casnap.distributed.group import all_gather, resolve_group
from casnap.errors import ConfigError, expect_type

Clock = Callable[[], float]
Handler = Callable[[int, FrameType | None], Any] | int | None


class Schedule:
    """The interval triggers: a step multiple of ``every_n_steps``, or at least
    ``every_seconds`` since the last take ended (or since the schedule started).
    Neither given: nothing is ever due (the Checkpointer refuses ``maybe_take``)."""

    def __init__(
        self,
        every_n_steps: int | None,
        every_seconds: float | timedelta | None,
        clock: Clock,
    ) -> None:
        if every_n_steps is not None:
            expect_type(every_n_steps, int, "every_n_steps", "an int or None")
            if every_n_steps < 1:
                raise ConfigError(
                    f"every_n_steps must be at least 1, got {every_n_steps}", "every_n_steps"
                )
        if isinstance(every_seconds, timedelta):
            every_seconds = every_seconds.total_seconds()
        if every_seconds is not None:
            expect_type(every_seconds, (int, float), "every_seconds", "seconds or a timedelta")
            if not every_seconds > 0:  # also refuses NaN
                raise ConfigError(
                    f"every_seconds must be positive, got {every_seconds}", "every_seconds"
                )
        if not callable(clock):
            raise ConfigError(f"clock must be callable, got {clock!r}", "clock")
        self.every_n_steps = every_n_steps
        self.every_seconds = None if every_seconds is None else float(every_seconds)
        self.clock = clock
        self._since = clock()

    def step_due(self, step: int) -> bool:
        """Whether ``step`` is a multiple of ``every_n_steps`` (the same on every rank)."""
        return self.every_n_steps is not None and step % self.every_n_steps == 0

    def time_due(self) -> bool:
        """Whether ``every_seconds`` have passed since the last take (differs between ranks)."""
        return self.every_seconds is not None and self.clock() - self._since >= self.every_seconds

    def restart(self) -> None:
        """A take ended: the time interval counts from now. Counting from the end rather
        than the start means a take slower than the interval cannot make every step a take."""
        self._since = self.clock()


def preemption_signals(value: bool | int | Iterable[int]) -> tuple[signal.Signals, ...]:
    """The signals ``take_on_preemption`` names: ``True`` is SIGTERM, ``False`` none;
    a signal or several (SLURM's ``--signal=USR1@90`` warns with SIGUSR1)."""
    if value is False or value is None:
        return ()
    if value is True:
        return (signal.SIGTERM,)
    items = [value] if isinstance(value, int) else list(value)
    out = []
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int):
            raise ConfigError(
                f"take_on_preemption takes True, a signal or a list of signals, got {item!r}",
                "take_on_preemption",
            )
        try:
            out.append(signal.Signals(item))
        except ValueError as exc:
            raise ConfigError(f"{item} is not a signal", "take_on_preemption") from exc
    return tuple(dict.fromkeys(out))


class PreemptionGuard:
    """Records preemption signals until the checkpointer has taken its snapshot.

    Installed from the main thread (Python runs signal handlers there only).
    The handler does no work: it notes the signal number, and the training
    loop sees it at its next ``maybe_take``. :meth:`honour` then restores the
    previous handlers and gives the signal to the previous one: re-raised
    under the default action (SIGTERM ends the process, exit status 143 in a
    shell), ignored if it was ignored, else that handler is called. If the
    process lives on, the guard is installed again.
    """

    def __init__(self, signals: tuple[signal.Signals, ...]) -> None:
        self.signals = signals
        self.received: int | None = None
        self._previous: dict[int, Handler] = {}

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def install(self) -> None:
        if self.installed:
            return
        if threading.current_thread() is not threading.main_thread():
            raise ConfigError(
                "take_on_preemption needs the checkpointer to be used from the main thread "
                "(Python delivers signals there only)",
                "take_on_preemption",
            )
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._record)

    def _record(self, signum: int, frame: FrameType | None) -> None:
        # Only a note: the loop may be inside a take, an optimizer step or a collective.
        self.received = signum

    def uninstall(self) -> None:
        """Put the previous handlers back (a handler set outside Python reads as the default)."""
        previous, self._previous = self._previous, {}
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)

    def honour(self) -> None:
        """Give the recorded signal to the handler that was installed before this guard."""
        signum, self.received = self.received, None
        if signum is None:
            return
        previous = self._previous.get(signum)
        self.uninstall()
        if previous is None or previous == signal.SIG_DFL:
            signal.raise_signal(signum)  # the default action; for SIGTERM the process ends here
        elif previous != signal.SIG_IGN and callable(previous):
            previous(signum, None)
        self.install()  # still running: keep guarding


def any_rank(flag: bool) -> bool:
    """``flag`` on one process; under an initialized process group, whether any rank's
    ``flag`` is true. Collective: every rank calls it at the same ``maybe_take``."""
    group = resolve_group(None)
    if not group.distributed:
        return flag
    return any(all_gather(group, flag, "the take decision"))
