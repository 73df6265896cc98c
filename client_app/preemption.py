"""Preemption notices: watch the cloud's interruption signal, then report the unit lost.

A spot/preemptible VM gets a short warning before it is reclaimed: AWS posts a spot
``instance-action`` in the instance metadata service about two minutes ahead, GCP flips
``instance/preempted`` to ``TRUE`` about 30 seconds ahead. :func:`start_watcher` starts a
background :class:`Watcher` that notices either signal (or, for the local backend, a notice
file appearing) and calls ``on_notice(reason)`` once. The client app then checkpoints and
reports the unit lost so that the server re-issues it at once instead of after its deadline:

- on BOINC, :func:`report_lost_to_boinc` aborts the task through ``boinccmd --task URL NAME
  abort`` and then forces a scheduler RPC with ``boinccmd --project URL update`` so that the
  aborted result reaches the server before the VM goes away;
- on the local backend, the client exits with status 75 (``EX_TEMPFAIL``).

Off the cloud (laptops, volunteers) detection costs one parallel probe with a 0.3 s timeout
and :func:`start_watcher` returns ``None``. Network errors never stop a watcher: they are
logged at debug level and retried with exponential backoff.

Environment:

``BDL_METADATA_URL``
    base URL of the metadata service (overrides the cloud's address; tests point it at a
    local HTTP server).
``BDL_PREEMPT_PROVIDER``
    ``auto`` (default), ``aws``, ``gcp`` or ``none`` (no cloud watching).
``BDL_PREEMPT_NOTICE_FILE``
    a path; the watcher also fires when this file appears (local backend's simulated notice).
"""

from __future__ import annotations

import contextlib
import html
import json
import logging
import os
import re
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.client import HTTPConnection, HTTPSConnection
from pathlib import Path
from urllib.parse import urlencode, urlsplit

log = logging.getLogger(__name__)

ENV_METADATA_URL = "BDL_METADATA_URL"
ENV_PROVIDER = "BDL_PREEMPT_PROVIDER"
ENV_NOTICE_FILE = "BDL_PREEMPT_NOTICE_FILE"

#: AWS IMDS and GCP metadata server both answer on the link-local address.
LINK_LOCAL_URL = "http://169.254.169.254"
AWS_BASE_URL = LINK_LOCAL_URL
GCP_BASE_URL = "http://metadata.google.internal"
PROVIDERS = ("auto", "aws", "gcp", "none")
PROBE_TIMEOUT = 0.3

#: Exit status of a client that stopped because of a preemption notice (``EX_TEMPFAIL``).
EXIT_PREEMPTED = 75

_MAX_BODY = 64 * 1024


class MetadataError(Exception):
    """The metadata service answered, but not in the expected way."""


@dataclass(frozen=True)
class Signal:
    """One observation from a notice source.

    ``kind`` is ``"notice"`` (the VM is going away) or ``"rebalance"`` (AWS early warning);
    ``deadline`` is the epoch time the VM is expected to go, when the cloud says so.
    """

    kind: str
    reason: str
    deadline: float | None = None


@dataclass
class _Reply:
    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)


class _MetadataHttp:
    """Minimal HTTP client for a metadata service.

    One short-lived connection per request, a per-request timeout, and :meth:`close`, which
    aborts requests in flight from another thread (needed to stop a hanging GET promptly).
    """

    def __init__(self, base_url: str) -> None:
        if "://" not in base_url:
            base_url = "http://" + base_url
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                f"metadata URL must be http(s)://host[:port][/prefix], got {base_url!r}"
            )
        self.base_url = base_url.rstrip("/")
        self._host = parts.hostname
        self._port = parts.port
        self._prefix = parts.path.rstrip("/")
        self._conn_cls = HTTPSConnection if parts.scheme == "https" else HTTPConnection
        self._lock = threading.Lock()
        self._active: set[HTTPConnection] = set()
        self._closed = False

    def request(
        self, method: str, path: str, headers: dict[str, str] | None = None, timeout: float = 2.0
    ) -> _Reply:
        conn = self._conn_cls(self._host, self._port, timeout=timeout)
        with self._lock:
            if self._closed:
                raise ConnectionAbortedError("metadata client closed")
            self._active.add(conn)
        try:
            conn.request(method, self._prefix + path, headers=headers or {})
            resp = conn.getresponse()
            body = resp.read(_MAX_BODY)
            return _Reply(resp.status, body, {k.lower(): v for k, v in resp.getheaders()})
        finally:
            with self._lock:
                self._active.discard(conn)
            conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = list(self._active)
        for conn in conns:
            sock = conn.sock
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


def _parse_utc(text: str) -> float | None:
    """Epoch seconds of an ISO-8601 time such as ``2026-01-02T03:04:05Z`` (None if unparsable)."""
    try:
        dt = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        return None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp()


class NoticeSource:
    """A signal to watch. :meth:`poll` checks once (it may block, e.g. a hanging GET)."""

    name = "source"

    def poll(self) -> list[Signal]:
        raise NotImplementedError

    def next_delay(self, interval: float) -> float:
        """Seconds to wait before the next :meth:`poll` after a successful one."""
        return interval

    def close(self) -> None:
        """Abort a blocking :meth:`poll` in progress; the source is not used afterwards."""


class AwsSpotSource(NoticeSource):
    """AWS spot interruption notice through IMDSv2.

    Each poll GETs ``/latest/meta-data/spot/instance-action`` with a session token (404: no
    interruption; 200: JSON ``{"action": "terminate"|"stop"|"hibernate", "time": ...}``). The
    token is PUT for ``token_ttl`` seconds and renewed a margin before it expires, and at once
    when the service answers 401. Until it has been seen, the rebalance recommendation
    (``/latest/meta-data/events/recommendations/rebalance``) is checked too and reported as a
    separate ``"rebalance"`` signal; errors on that optional check never delay the notice.
    """

    name = "aws-spot"
    TOKEN_PATH = "/latest/api/token"
    ACTION_PATH = "/latest/meta-data/spot/instance-action"
    REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
    TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
    TOKEN_HEADER = "X-aws-ec2-metadata-token"

    def __init__(
        self,
        base_url: str = AWS_BASE_URL,
        token_ttl: int = 21600,
        timeout: float = 2.0,
        rebalance: bool = True,
    ) -> None:
        if not 1 <= int(token_ttl) <= 21600:
            raise ValueError("IMDSv2 token TTL must be between 1 and 21600 seconds")
        self._http = _MetadataHttp(base_url)
        self.token_ttl = int(token_ttl)
        self.timeout = timeout
        self.rebalance = rebalance
        # Renew a minute early (a quarter of the TTL for short test TTLs).
        self._margin = min(60.0, self.token_ttl / 4)
        self._token: str | None = None
        self._token_expiry = 0.0
        self._rebalance_seen = False
        self.token_refreshes = 0

    def _refresh_token(self) -> None:
        issued = time.monotonic()
        reply = self._http.request(
            "PUT", self.TOKEN_PATH, {self.TTL_HEADER: str(self.token_ttl)}, self.timeout
        )
        token = reply.body.strip()
        if reply.status != 200 or not token:
            raise MetadataError(f"IMDSv2 token request answered HTTP {reply.status}")
        self._token = token.decode("ascii")
        self._token_expiry = issued + self.token_ttl
        self.token_refreshes += 1

    def _get(self, path: str) -> _Reply:
        if self._token is None or time.monotonic() >= self._token_expiry - self._margin:
            self._refresh_token()
        assert self._token is not None
        reply = self._http.request("GET", path, {self.TOKEN_HEADER: self._token}, self.timeout)
        if reply.status == 401:  # token expired or revoked: renew once and retry
            log.debug("%s: token rejected (401), renewing", self.name)
            self._token = None
            self._refresh_token()
            reply = self._http.request("GET", path, {self.TOKEN_HEADER: self._token}, self.timeout)
        return reply

    def poll(self) -> list[Signal]:
        reply = self._get(self.ACTION_PATH)
        if reply.status == 200:
            return [self._parse_action(reply.body)]
        if reply.status != 404:
            raise MetadataError(f"instance-action answered HTTP {reply.status}")
        if self.rebalance and not self._rebalance_seen:
            try:
                return self._check_rebalance()
            except Exception as exc:  # optional signal: never hold up the notice
                log.debug("%s: rebalance check failed: %s", self.name, exc)
        return []

    def _parse_action(self, body: bytes) -> Signal:
        try:
            data = json.loads(body.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise MetadataError(f"instance-action body is not JSON: {body[:60]!r}") from exc
        if not isinstance(data, dict) or not isinstance(data.get("action"), str):
            raise MetadataError(f"instance-action body has no action: {body[:60]!r}")
        when = data.get("time") if isinstance(data.get("time"), str) else ""
        reason = f"aws-spot: {data['action']}" + (f" at {when}" if when else "")
        return Signal("notice", reason, _parse_utc(when) if when else None)

    def _check_rebalance(self) -> list[Signal]:
        reply = self._get(self.REBALANCE_PATH)
        if reply.status == 404:
            return []
        if reply.status != 200:
            raise MetadataError(f"rebalance answered HTTP {reply.status}")
        try:
            when = json.loads(reply.body.decode("utf-8")).get("noticeTime", "")
        except (UnicodeDecodeError, ValueError, AttributeError) as exc:
            raise MetadataError(f"rebalance body is not JSON: {reply.body[:60]!r}") from exc
        self._rebalance_seen = True
        when = when if isinstance(when, str) else ""
        return [
            Signal("rebalance", "aws-rebalance: recommendation" + (f" at {when}" if when else ""))
        ]

    def close(self) -> None:
        self._http.close()


class GcpPreemptedSource(NoticeSource):
    """GCP preemption through ``/computeMetadata/v1/instance/preempted`` ("TRUE"/"FALSE").

    After one plain read, it waits with a hanging GET (``wait_for_change=true`` plus the last
    ``ETag``, so no change between two reads is missed, and ``timeout_sec``): the answer comes
    the moment the value flips. After ``max_wait_failures`` consecutive failed hanging GETs, or
    if the server sends no ETag, it falls back to plain polling every ``interval``.
    """

    name = "gcp-preempted"
    PATH = "/computeMetadata/v1/instance/preempted"
    HEADERS = {"Metadata-Flavor": "Google"}

    def __init__(
        self,
        base_url: str = GCP_BASE_URL,
        wait: bool = True,
        wait_timeout: int = 60,
        timeout: float = 2.0,
        max_wait_failures: int = 2,
    ) -> None:
        self._http = _MetadataHttp(base_url)
        self.wait = wait
        self.wait_timeout = int(wait_timeout)
        self.timeout = timeout
        self.max_wait_failures = max_wait_failures
        self._etag: str | None = None
        self._wait_failures = 0
        self._last_was_hanging = False
        self._last_elapsed = 0.0
        self.hanging_gets = 0

    def poll(self) -> list[Signal]:
        hanging = self.wait and self._etag is not None
        if hanging:
            query = urlencode(
                {
                    "wait_for_change": "true",
                    "last_etag": self._etag,
                    "timeout_sec": self.wait_timeout,
                }
            )
            path, timeout = f"{self.PATH}?{query}", self.wait_timeout + 5.0
            self.hanging_gets += 1
        else:
            path, timeout = self.PATH, self.timeout
        started = time.monotonic()
        try:
            reply = self._http.request("GET", path, self.HEADERS, timeout)
            if reply.status != 200:
                raise MetadataError(f"preempted answered HTTP {reply.status}")
            value = reply.body.decode("ascii", "replace").strip().upper()
            if value not in ("TRUE", "FALSE"):
                raise MetadataError(f"preempted answered {value[:40]!r}")
        except Exception:
            if hanging:
                self._wait_failures += 1
                if self._wait_failures >= self.max_wait_failures:
                    log.debug("%s: hanging GET keeps failing, falling back to polling", self.name)
                    self.wait = False
            raise
        finally:
            self._last_elapsed = time.monotonic() - started
            self._last_was_hanging = hanging
        if hanging:
            self._wait_failures = 0
        self._etag = reply.headers.get("etag") or None
        if value == "TRUE":
            return [Signal("notice", "gcp-preempted: instance preempted", time.time() + 30.0)]
        return []

    def next_delay(self, interval: float) -> float:
        if not (self.wait and self._etag is not None):
            return interval
        if not self._last_was_hanging:
            return 0.0  # primed with a plain read: start waiting at once
        # A hanging GET that really waited re-arms at once; a server that answers at once
        # (ignoring wait_for_change) is paced like polling.
        if self._last_elapsed >= 0.5 * min(self.wait_timeout, interval):
            return 0.0
        return max(0.0, interval - self._last_elapsed)

    def close(self) -> None:
        self._http.close()


class NoticeFileSource(NoticeSource):
    """Fires when ``path`` exists (the local backend's simulated preemption notice).

    The first line of the file, if any, is appended to the reason.
    """

    name = "notice-file"

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def poll(self) -> list[Signal]:
        if not self.path.exists():
            return []
        detail = ""
        with contextlib.suppress(OSError):
            text = self.path.read_text(encoding="utf-8", errors="replace")
            detail = text.strip().splitlines()[0][:200] if text.strip() else ""
        reason = f"notice-file: {self.path}" + (f": {detail}" if detail else "")
        return [Signal("notice", reason)]


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


def _probe_aws(base_url: str, timeout: float) -> bool:
    reply = _MetadataHttp(base_url).request(
        "PUT", AwsSpotSource.TOKEN_PATH, {AwsSpotSource.TTL_HEADER: "60"}, timeout
    )
    return reply.status == 200 and bool(reply.body.strip())


def _probe_gcp(base_url: str, timeout: float) -> bool:
    reply = _MetadataHttp(base_url).request(
        "GET", GcpPreemptedSource.PATH, GcpPreemptedSource.HEADERS, timeout
    )
    return reply.status == 200 and reply.headers.get("metadata-flavor", "").lower() == "google"


def detect_provider(base_url: str | None = None, timeout: float = PROBE_TIMEOUT) -> str | None:
    """Which cloud's metadata service answers at ``base_url``: ``"aws"``, ``"gcp"`` or None.

    Both probes run in parallel against the link-local address (no DNS lookup), so a machine
    off the cloud pays at most about ``timeout`` seconds. AWS wins if both answer.
    """
    url = base_url or LINK_LOCAL_URL
    found: dict[str, bool] = {}

    def probe(name: str, fn: Callable[[str, float], bool]) -> None:
        try:
            found[name] = fn(url, timeout)
        except Exception as exc:
            log.debug("no %s metadata at %s: %s", name, url, exc)

    threads = [
        threading.Thread(target=probe, args=(name, fn), daemon=True)
        for name, fn in (("aws", _probe_aws), ("gcp", _probe_gcp))
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 2 * timeout + 0.1  # connect + read, each bounded by timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    for name in ("aws", "gcp"):
        if found.get(name):
            return name
    return None


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


def _boinccmd_prefix(boinccmd: str, host: str | None, passwd: str | None) -> list[str]:
    argv = [boinccmd]
    if host:
        argv += ["--host", host]
    if passwd:
        argv += ["--passwd", passwd]
    return argv


def _require(value: str, what: str) -> str:
    if not isinstance(value, str) or not value.strip() or value != value.strip():
        raise ValueError(f"{what} must be a non-empty string without surrounding blanks: {value!r}")
    return value


def boinccmd_abort_argv(
    project_url: str,
    task_name: str,
    boinccmd: str = "boinccmd",
    *,
    host: str | None = None,
    passwd: str | None = None,
) -> list[str]:
    """``boinccmd [--host H] [--passwd P] --task <project_url> <task_name> abort``.

    ``--host``/``--passwd`` must precede the command (boinccmd parses them first).
    """
    return _boinccmd_prefix(boinccmd, host, passwd) + [
        "--task",
        _require(project_url, "project URL"),
        _require(task_name, "task name"),
        "abort",
    ]


def boinccmd_update_argv(
    project_url: str,
    boinccmd: str = "boinccmd",
    *,
    host: str | None = None,
    passwd: str | None = None,
) -> list[str]:
    """``boinccmd [--host H] [--passwd P] --project <project_url> update``: contact the
    project's scheduler now, reporting finished (and aborted) tasks."""
    return _boinccmd_prefix(boinccmd, host, passwd) + [
        "--project",
        _require(project_url, "project URL"),
        "update",
    ]


def _redacted(argv: Iterable[str]) -> str:
    out, hide = [], False
    for arg in argv:
        out.append("***" if hide else arg)
        hide = arg == "--passwd"
    return " ".join(out)


def _run_boinccmd(argv: list[str], cwd: str | None, timeout: float) -> str | None:
    """Run one boinccmd; None on success, else a one-line error."""
    if cwd is not None and not Path(cwd).is_dir():
        return f"BOINC data directory {cwd} does not exist"
    try:
        done = subprocess.run(
            argv,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except FileNotFoundError:
        return f"{argv[0]} not found"
    except subprocess.TimeoutExpired:
        return f"no answer within {timeout:g}s"
    except OSError as exc:
        return str(exc)
    if done.returncode != 0:
        detail = (done.stderr or done.stdout or "").strip().replace("\n", " | ")
        return f"exit status {done.returncode}: {detail[-400:]}"
    return None


def report_lost_to_boinc(
    project_url: str,
    task_name: str,
    boinccmd: str = "boinccmd",
    *,
    host: str | None = None,
    passwd: str | None = None,
    data_dir: str | os.PathLike[str] | None = None,
    report_now: bool = True,
    timeout: float = 15.0,
) -> bool:
    """Abort ``task_name`` in the local BOINC client so that the server re-issues it now.

    Runs ``boinccmd --task <project_url> <task_name> abort`` and then, if ``report_now``,
    ``boinccmd --project <project_url> update``: an aborted task is only reported at the
    client's next scheduler RPC, and ``update`` makes that happen at once, before the VM is
    gone. The order matters: the client processes GUI RPCs, then marks aborted tasks ready to
    report, then starts scheduler RPCs, so an ``update`` sent first could go out without the
    aborted task. When the server receives the aborted result it marks the workunit for the
    transitioner at once, which creates a new instance of the unit.

    Call it last, after the checkpoint is written: the BOINC client then asks the running
    app to quit (and ignores its exit status), so this process may be killed soon after the
    abort. Only the re-issue is lost; the server's copy of the unit's inputs is unchanged.

    Server-side accounting of an abort (exit status 203, ``EXIT_ABORTED_VIA_GUI``): servers
    since 2014 count it as "no reply", not as an error against ``max_error_results``; older
    servers count it as an error. It always counts against ``max_total_results``, and the
    scheduler lowers the host's daily job quota by one. So the work generator must pass
    ``max_total_results`` >= 2 (one more than retries wanted) and ``max_error_results`` >= 2.

    boinccmd reads the GUI RPC password from ``gui_rpc_auth.cfg`` in its working directory,
    so pass the BOINC data directory as ``data_dir`` (from ``init_data.xml``'s
    ``boinc_dir``, see :func:`boinc_task_from_slot`) rather than ``passwd`` (visible in
    ``ps``). Errors (boinccmd missing, refused, timed out, non-zero exit) are logged and
    reported by returning False, never raised. True means the abort was accepted; a failed
    ``update`` is only logged (the abort is reported with the client's next RPC).
    """
    try:
        abort = boinccmd_abort_argv(project_url, task_name, boinccmd, host=host, passwd=passwd)
        update = boinccmd_update_argv(project_url, boinccmd, host=host, passwd=passwd)
    except ValueError as exc:
        log.error("cannot report task lost to BOINC: %s", exc)
        return False
    cwd = os.fspath(data_dir) if data_dir is not None else None
    error = _run_boinccmd(abort, cwd, timeout)
    if error:
        log.error("BOINC abort failed (%s): %s", _redacted(abort), error)
        return False
    log.warning("aborted BOINC task %s so that %s re-issues it", task_name, project_url)
    if report_now:
        error = _run_boinccmd(update, cwd, timeout)
        if error:
            log.warning("BOINC project update failed (%s): %s", _redacted(update), error)
    return True


@dataclass(frozen=True)
class BoincTask:
    """The running BOINC task, as needed by :func:`report_lost_to_boinc`."""

    project_url: str
    task_name: str
    data_dir: str


def escape_project_url(url: str) -> str:
    """The BOINC client's directory name for a project URL (``projects/<name>``,
    ``account_<name>.xml``): scheme dropped, characters other than letters, digits, ``.``,
    ``-`` and ``_`` replaced by ``_``, one trailing ``_`` removed."""
    rest = url.split("://", 1)[1] if "://" in url else url
    out = "".join(c if (c.isascii() and c.isalnum()) or c in ".-_" else "_" for c in rest)
    return out[:-1] if out.endswith("_") else out


def _xml_field(text: str, tag: str) -> str | None:
    match = re.search(rf"<{tag}>\s*(.*?)\s*</{tag}>", text, re.S)
    return html.unescape(match.group(1)) if match else None


def boinc_task_from_slot(slot_dir: str | os.PathLike[str] = ".") -> BoincTask | None:
    """Read the task's identity from the slot's ``init_data.xml`` (None if not under BOINC).

    ``init_data.xml`` gives ``result_name`` (the task name), ``boinc_dir`` (the data
    directory) and ``project_dir`` (``<boinc_dir>/projects/<escaped URL>``); the master URL
    itself is read from the matching ``account_<escaped URL>.xml`` in the data directory,
    or else from ``client_state.xml``.
    """
    try:
        init = (Path(slot_dir) / "init_data.xml").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    task_name = _xml_field(init, "result_name")
    data_dir = _xml_field(init, "boinc_dir")
    project_dir = _xml_field(init, "project_dir")
    if not (task_name and data_dir and project_dir):
        return None
    escaped = Path(project_dir.rstrip("/\\")).name
    url = None
    account = Path(data_dir) / f"account_{escaped}.xml"
    with contextlib.suppress(OSError):
        url = _xml_field(account.read_text(encoding="utf-8", errors="replace"), "master_url")
    if not url:
        with contextlib.suppress(OSError):
            state = (Path(data_dir) / "client_state.xml").read_text(
                encoding="utf-8", errors="replace"
            )
            for candidate in re.findall(r"<master_url>\s*(.*?)\s*</master_url>", state, re.S):
                if escape_project_url(html.unescape(candidate)) == escaped:
                    url = html.unescape(candidate)
                    break
    if not url:
        return None
    return BoincTask(project_url=url, task_name=task_name, data_dir=data_dir)
