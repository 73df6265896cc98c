"""A stop signal that lands inside a ``__del__``: Python swallows the exception the
handler raises there ("Exception ignored in"), so the run loop must still see it."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from boinc_dl.server.run.signals import RunStopped, raise_if_stopped, stop_on_signals


class _SignalledWhileCollected:
    """An object whose finaliser is running when SIGINT arrives."""

    def __del__(self) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)  # the handler runs here, inside __del__


def test_a_stop_swallowed_inside_a_finaliser_is_raised_by_the_run_loop_and_not_printed(capfd) -> None:
    raise_if_stopped()  # outside the context: nothing to raise
    with stop_on_signals() as received:
        _SignalledWhileCollected()  # collected at once: the handler's exception is swallowed
        assert received == [signal.SIGINT]
        with pytest.raises(RunStopped) as e:
            raise_if_stopped()  # what the run loop calls at every step
        assert e.value.signum == signal.SIGINT
    assert "Traceback" not in capfd.readouterr().err  # swallowed quietly, raised again above
    raise_if_stopped()  # the context is over: nothing pending


def test_other_unraisable_exceptions_still_reach_the_previous_hook(monkeypatch) -> None:
    seen: list[object] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_value))

    class Broken:
        def __del__(self) -> None:
            raise ValueError("not a stop")

    with stop_on_signals():
        Broken()
    assert [type(x) for x in seen] == [ValueError]
    assert sys.unraisablehook is not None
