"""Stop a run on SIGTERM and SIGHUP exactly as on Ctrl-C.

A foreground run owns a private Redis, slot processes and assimilators. Python turns
SIGINT into :class:`KeyboardInterrupt`, whose ``finally`` blocks stop all of them;
SIGTERM (``kill``, systemd, a container stop) and SIGHUP (a closed terminal or SSH
session) would otherwise end the process at once and orphan its children. Inside
:func:`stop_on_signals` all three raise :class:`RunStopped` (a KeyboardInterrupt) in
the main thread once; later signals are ignored so that a second Ctrl-C cannot cut
the clean-up short (it is bounded: a few seconds).

The handler raises wherever the main thread is. Where that is a ``__del__`` or a
weakref callback, Python cannot propagate it: it prints it ("Exception ignored in") and
carries on. So the run loop also calls :func:`raise_if_stopped` at every step, and such
a swallowed stop is not printed.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

#: The signals that stop a run cleanly.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class RunStopped(KeyboardInterrupt):
    """A run was asked to stop by ``signum``."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        """The shell's convention for a process ended by a signal: 128 + its number."""
        return 128 + self.signum


#: The signals received inside the innermost active :func:`stop_on_signals` (None outside).
_received: list[int] | None = None


def raise_if_stopped() -> None:
    """Raise :class:`RunStopped` if a stop signal came since :func:`stop_on_signals` began:
    the run loop calls it at every step, so a stop whose exception Python swallowed (raised
    inside a ``__del__``) still stops the run."""
    if _received:
        raise RunStopped(_received[0])


def _quiet_swallowed_stop(default: object) -> object:
    """An ``sys.unraisablehook`` that drops a :class:`RunStopped` (the run loop raises it
    again) and hands every other unraisable exception to ``default``."""
    def hook(unraisable: object) -> None:
        if isinstance(getattr(unraisable, "exc_value", None), RunStopped):
            return
        default(unraisable)  # type: ignore[operator]
    return hook


@contextmanager
def stop_on_signals(signals: tuple[int, ...] = STOP_SIGNALS) -> Iterator[list[int]]:
    """Raise :class:`RunStopped` in the main thread on the first of ``signals``.

    Yields the list of signals received (empty until one arrives). Outside the main
    thread (where Python cannot install handlers) it changes nothing.
    """
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def handler(signum: int, _frame: FrameType | None) -> None:
        received.append(signum)
        if len(received) == 1:
            raise RunStopped(signum)
        # Already stopping: let the clean-up finish.

    global _received
    outer, outer_hook = _received, sys.unraisablehook
    previous = {s: signal.signal(s, handler) for s in signals}
    _received, sys.unraisablehook = received, _quiet_swallowed_stop(outer_hook)
    try:
        yield received
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        _received, sys.unraisablehook = outer, outer_hook
