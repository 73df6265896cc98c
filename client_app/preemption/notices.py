"""Cloud and local notice sources: AWS spot instance-action, GCP preempted, a notice file,
and the probe that tells which cloud this VM is on."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
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


#: Bytes of a notice file read for its reason (the reason keeps 200 characters of one line).
_NOTICE_READ_LIMIT = 4096


class NoticeFileSource(NoticeSource):
    """Fires when ``path`` exists (the local backend's simulated preemption notice).

    The first line of the file, if any, is appended to the reason. It fires as soon as the
    file exists, even empty: a writer should create it whole (write elsewhere, then rename)
    for its text to be in the reason. Only the first :data:`_NOTICE_READ_LIMIT` bytes are read.
    """

    name = "notice-file"

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def poll(self) -> list[Signal]:
        if not self.path.exists():
            return []
        detail = ""
        with contextlib.suppress(OSError), self.path.open("rb") as f:
            text = f.read(_NOTICE_READ_LIMIT).decode("utf-8", errors="replace")
            detail = text.strip().splitlines()[0][:200] if text.strip() else ""
        reason = f"notice-file: {self.path}" + (f": {detail}" if detail else "")
        return [Signal("notice", reason)]



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


