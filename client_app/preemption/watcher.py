"""The watcher thread: polls the notice sources and calls ``on_notice(reason)`` once."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

from boinc_dl.client_app.preemption.notices import (
    AWS_BASE_URL,
    ENV_METADATA_URL,
    ENV_NOTICE_FILE,
    ENV_PROVIDER,
    GCP_BASE_URL,
    LINK_LOCAL_URL,
    PROBE_TIMEOUT,
    PROVIDERS,
    AwsSpotSource,
    GcpPreemptedSource,
    NoticeFileSource,
    NoticeSource,
    Signal,
    detect_provider,
)

log = logging.getLogger(__name__)

class Watcher:
    """Runs each :class:`NoticeSource` in its own daemon thread and fires ``on_notice`` once.

    Attributes for the client and for measurements:

    - ``noticed``: :class:`threading.Event`, set when the first notice arrives (before
      ``on_notice`` runs, on the watcher thread);
    - ``reason``, ``noticed_at`` (epoch seconds), ``deadline`` (epoch seconds the VM is
      expected to go, if the cloud says so);
    - ``rebalance`` / ``rebalance_reason``: the AWS early warning, reported separately;
    - ``errors``: how many polls failed (each retried after backoff);
    - :meth:`notice_latency`: seconds from a given moment (when a signal was raised) to the
      notice.

    ``on_notice`` and ``on_rebalance`` run on a watcher thread; exceptions they raise are
    logged, not propagated.
    """

    def __init__(
        self,
        sources: Sequence[NoticeSource],
        on_notice: Callable[[str], None],
        interval: float = 2.0,
        on_rebalance: Callable[[str], None] | None = None,
        max_backoff: float | None = None,
    ) -> None:
        if interval <= 0:
            raise ValueError("interval must be > 0")
        if not sources:
            raise ValueError("a watcher needs at least one source")
        self.sources = list(sources)
        self.on_notice = on_notice
        self.on_rebalance = on_rebalance
        self.interval = float(interval)
        self.max_backoff = float(max_backoff) if max_backoff is not None else 5.0 * self.interval
        self.noticed = threading.Event()
        self.rebalance = threading.Event()
        self.reason: str | None = None
        self.rebalance_reason: str | None = None
        self.noticed_at: float | None = None
        self.deadline: float | None = None
        self.errors = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def provider(self) -> str:
        """Names of the watched sources, e.g. ``"aws-spot+notice-file"``."""
        return "+".join(s.name for s in self.sources)

    @property
    def running(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    def start(self) -> Watcher:
        if self._threads:
            return self
        for source in self.sources:
            thread = threading.Thread(
                target=self._run, args=(source,), name=f"bdl-preempt-{source.name}", daemon=True
            )
            self._threads.append(thread)
            thread.start()
        log.debug("preemption watcher started: %s every %.1fs", self.provider, self.interval)
        return self

    def stop(self, timeout: float = 2.0) -> None:
        """Stop polling (aborting any hanging GET) and wait up to ``timeout`` for the threads."""
        self._stop.set()
        self._close_sources()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a notice arrives (True) or ``timeout`` passes (False)."""
        return self.noticed.wait(timeout)

    def notice_latency(self, since: float) -> float | None:
        """Seconds from ``since`` (epoch, e.g. when the signal was raised) to the notice."""
        return None if self.noticed_at is None else self.noticed_at - since

    def __enter__(self) -> Watcher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _close_sources(self) -> None:
        for source in self.sources:
            with contextlib.suppress(Exception):
                source.close()

    def _run(self, source: NoticeSource) -> None:
        failures = 0
        while not self._stop.is_set() and not self.noticed.is_set():
            try:
                signals = source.poll()
            except Exception as exc:  # network errors, bad bodies: never end the thread
                if self._stop.is_set() or self.noticed.is_set():
                    break
                failures += 1
                with self._lock:
                    self.errors += 1
                delay = min(self.interval * 2 ** (failures - 1), self.max_backoff)
                log.debug(
                    "%s: %s: %s (retry in %.2fs)", source.name, type(exc).__name__, exc, delay
                )
                self._stop.wait(delay)
                continue
            failures = 0
            for signal in signals:
                self._deliver(signal)
            if self.noticed.is_set():
                break
            self._stop.wait(source.next_delay(self.interval))

    def _deliver(self, signal: Signal) -> None:
        if signal.kind == "rebalance":
            with self._lock:
                if self.rebalance.is_set():
                    return
                self.rebalance_reason = signal.reason
                self.rebalance.set()
            log.info("rebalance recommendation: %s", signal.reason)
            self._call(self.on_rebalance, signal.reason)
            return
        with self._lock:
            if self.noticed.is_set():
                return
            self.reason = signal.reason
            self.noticed_at = time.time()
            self.deadline = signal.deadline
            self.noticed.set()
        log.warning("preemption notice: %s", signal.reason)
        self._close_sources()  # wake the other threads (hanging GETs) so they exit
        self._call(self.on_notice, signal.reason)

    @staticmethod
    def _call(callback: Callable[[str], None] | None, reason: str) -> None:
        if callback is None:
            return
        try:
            callback(reason)
        except Exception:
            log.exception("preemption callback failed")



def start_watcher(
    on_notice: Callable[[str], None],
    provider: str | None = None,
    base_url: str | None = None,
    interval: float = 2.0,
    *,
    on_rebalance: Callable[[str], None] | None = None,
    notice_file: str | os.PathLike[str] | None = None,
    probe_timeout: float = PROBE_TIMEOUT,
) -> Watcher | None:
    """Start watching for a preemption notice; None when there is nothing to watch.

    ``provider`` (or ``BDL_PREEMPT_PROVIDER``) is ``"aws"``, ``"gcp"``, ``"none"`` or
    ``"auto"``/None to detect; an explicit cloud is trusted without probing. ``base_url`` (or
    ``BDL_METADATA_URL``) replaces the metadata service's address. ``notice_file`` (or
    ``BDL_PREEMPT_NOTICE_FILE``) adds the local backend's file signal. ``on_notice`` is called
    once, on a watcher thread, with a short reason such as
    ``"aws-spot: terminate at 2026-01-02T03:04:05Z"``; AWS rebalance recommendations go to
    ``on_rebalance``. AWS is polled every ``interval`` seconds; GCP answers through a
    hanging GET as soon as the value flips.
    """
    base_url = base_url or os.environ.get(ENV_METADATA_URL) or None
    chosen = (provider or os.environ.get(ENV_PROVIDER) or "auto").strip().lower()
    if chosen not in PROVIDERS:
        raise ValueError(f"unknown preemption provider {chosen!r}; expected one of {PROVIDERS}")
    notice_file = notice_file or os.environ.get(ENV_NOTICE_FILE) or None

    gcp_url = base_url or GCP_BASE_URL
    if chosen == "auto":
        started = time.monotonic()
        detected = detect_provider(base_url, probe_timeout)
        log.debug("metadata detection: %s in %.2fs", detected, time.monotonic() - started)
        chosen = detected or "none"
        gcp_url = base_url or LINK_LOCAL_URL  # detected on the address: no DNS needed

    sources: list[NoticeSource] = []
    if chosen == "aws":
        sources.append(AwsSpotSource(base_url or AWS_BASE_URL))
    elif chosen == "gcp":
        sources.append(GcpPreemptedSource(gcp_url))
    if notice_file:
        sources.append(NoticeFileSource(notice_file))
    if not sources:
        return None
    return Watcher(sources, on_notice, interval=interval, on_rebalance=on_rebalance).start()


# --- BOINC: report the task lost so the server re-issues it at once --------------------


