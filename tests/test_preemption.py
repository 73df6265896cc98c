"""Preemption notices against a real local HTTP server standing in for AWS IMDSv2 and the
GCP metadata server, plus the local notice file and the boinccmd command lines."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import stat
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from boinc_dl.client_app import preemption as pre
from boinc_dl.client_app.boinc_io import atomic_write_bytes


class MetadataState:
    """What the fake metadata service answers; tests flip it while a watcher runs."""

    def __init__(self, aws: bool = True, gcp: bool = True) -> None:
        self.aws = aws
        self.gcp = gcp
        self.cond = threading.Condition()
        self.action: dict | None = None  # AWS instance-action (None: 404)
        self.rebalance: dict | None = None
        self.preempted = False  # GCP
        self.wait_supported = True  # GCP wait_for_change
        self.fail: str | None = None  # "500" | "garbage" | "drop": break every request
        self.tokens: dict[str, float] = {}  # token -> monotonic expiry
        self.token_puts = 0
        self.unauthorized = 0
        self.hanging_gets = 0
        self.closing = False

    def set(self, **changes: object) -> float:
        """Apply changes atomically, wake hanging GETs; return the epoch time of the change."""
        with self.cond:
            for key, value in changes.items():
                setattr(self, key, value)
            self.cond.notify_all()
            return time.time()

    def etag(self) -> str:
        return hashlib.sha1(str(self.preempted).encode()).hexdigest()[:16]


class Handler(BaseHTTPRequestHandler):
    state: MetadataState  # set on a per-server subclass

    def log_message(self, *args: object) -> None:  # keep test output quiet
        pass

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the watcher aborted this request (stop() or a notice elsewhere)

    def _broken(self) -> bool:
        mode = self.state.fail
        if mode == "500":
            self._send(500, b"internal error")
        elif mode == "garbage":
            self._send(200, b"\x00\xffnot what you expected <html>")
        elif mode == "drop":  # close the connection without answering
            self.connection.shutdown(socket.SHUT_RDWR)
        return mode is not None

    def do_PUT(self) -> None:
        st = self.state
        if not st.aws or self.path != "/latest/api/token":
            return self._send(404)
        if self._broken():
            return None
        ttl = self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")
        if not ttl or not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
            return self._send(400, b"bad ttl")
        with st.cond:
            st.token_puts += 1
            token = f"tok{st.token_puts}-{os.urandom(4).hex()}"
            st.tokens[token] = time.monotonic() + int(ttl)
        return self._send(200, token.encode())

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        if url.path.startswith("/latest/") and self.state.aws:
            return self._aws(url.path)
        if url.path == "/computeMetadata/v1/instance/preempted" and self.state.gcp:
            return self._gcp(parse_qs(url.query))
        return self._send(404, b"not found")

    def _aws(self, path: str) -> None:
        st = self.state
        token = self.headers.get("X-aws-ec2-metadata-token", "")
        with st.cond:
            if st.tokens.get(token, 0.0) < time.monotonic():
                st.unauthorized += 1
                return self._send(401)
        if self._broken():
            return None
        if path == "/latest/meta-data/spot/instance-action":
            item = st.action
        elif path == "/latest/meta-data/events/recommendations/rebalance":
            item = st.rebalance
        else:
            item = None
        if item is None:
            return self._send(404, b"<html>404 - Not Found</html>")
        return self._send(200, json.dumps(item).encode(), {"Content-Type": "text/plain"})

    def _gcp(self, query: dict[str, list[str]]) -> None:
        st = self.state
        if self.headers.get("Metadata-Flavor") != "Google":
            return self._send(403, b"Missing Metadata-Flavor:Google header.")
        if self._broken():
            return None
        if query.get("wait_for_change") == ["true"]:
            if not st.wait_supported:
                return self._send(400, b"wait_for_change not supported here")
            timeout = float(query.get("timeout_sec", ["60"])[0])
            last = query.get("last_etag", [None])[0]
            with st.cond:
                st.hanging_gets += 1
                start = st.etag()
                st.cond.wait_for(
                    lambda: st.closing or st.etag() != (last or start), timeout=timeout
                )
        with st.cond:
            body, etag = (b"TRUE" if st.preempted else b"FALSE"), st.etag()
        return self._send(200, body, {"Metadata-Flavor": "Google", "ETag": etag})


@pytest.fixture
def metadata():
    """Start fake metadata servers: ``metadata(aws=..., gcp=...) -> (base_url, state)``."""
    servers = []

    def start(aws: bool = True, gcp: bool = True) -> tuple[str, MetadataState]:
        state = MetadataState(aws=aws, gcp=gcp)
        handler = type("BoundHandler", (Handler,), {"state": state})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        servers.append((server, state))
        return f"http://127.0.0.1:{server.server_address[1]}", state

    yield start
    for server, state in servers:
        state.set(closing=True)
        server.shutdown()
        server.server_close()


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in (pre.ENV_METADATA_URL, pre.ENV_PROVIDER, pre.ENV_NOTICE_FILE):
        monkeypatch.delenv(name, raising=False)


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


class Recorder:
    def __init__(self) -> None:
        self.reasons: list[str] = []
        self.event = threading.Event()

    def __call__(self, reason: str) -> None:
        self.reasons.append(reason)
        self.event.set()


def test_aws_notice_latency_at_default_interval(metadata):
    base, st = metadata(gcp=False)
    rec = Recorder()
    w = pre.start_watcher(rec, provider="aws", base_url=base)  # default interval 2.0 s
    assert w is not None and w.provider == "aws-spot"
    try:
        time.sleep(0.7)  # some polls answer 404: nothing happens
        assert not w.noticed.is_set() and rec.reasons == []
        t0 = st.set(action={"action": "terminate", "time": "2030-01-02T03:04:05Z"})
        assert rec.event.wait(5.0)
        latency = w.notice_latency(t0)
        print(f"\nAWS notice latency at interval 2.0 s: {latency:.3f} s")
        assert latency is not None and 0 <= latency <= 2.0 + 0.5
        assert rec.reasons == ["aws-spot: terminate at 2030-01-02T03:04:05Z"]
        assert w.reason == rec.reasons[0] and w.noticed.is_set()
        assert w.deadline == pytest.approx(1893553445.0)
        assert st.unauthorized == 0 and w.errors == 0
    finally:
        w.stop()
    assert not w.running


@pytest.mark.parametrize("action", ["stop", "hibernate"])
def test_aws_stop_and_hibernate_are_notices(metadata, action):
    base, st = metadata(gcp=False)
    st.set(action={"action": action, "time": "2030-01-02T03:04:05Z"})
    rec = Recorder()
    w = pre.start_watcher(rec, provider="aws", base_url=base, interval=0.05)
    try:
        assert rec.event.wait(2.0)
        assert rec.reasons == [f"aws-spot: {action} at 2030-01-02T03:04:05Z"]
    finally:
        w.stop()


def test_aws_rebalance_reported_separately_and_once(metadata):
    base, st = metadata(gcp=False)
    rec, rebal = Recorder(), Recorder()
    w = pre.start_watcher(rec, provider="aws", base_url=base, interval=0.05, on_rebalance=rebal)
    try:
        st.set(rebalance={"noticeTime": "2030-01-02T03:00:00Z"})
        assert rebal.event.wait(2.0)
        time.sleep(0.3)  # more polls: still reported once, and not as a notice
        assert rebal.reasons == ["aws-rebalance: recommendation at 2030-01-02T03:00:00Z"]
        assert w.rebalance.is_set() and not w.noticed.is_set() and rec.reasons == []
        st.set(action={"action": "terminate", "time": "2030-01-02T03:02:00Z"})
        assert rec.event.wait(2.0)
    finally:
        w.stop()


def test_aws_token_renewed_before_ttl_ends(metadata):
    base, st = metadata(gcp=False)
    src = pre.AwsSpotSource(base, token_ttl=1)  # renewed 0.25 s before each expiry
    rec = Recorder()
    w = pre.Watcher([src], rec, interval=0.05).start()
    try:
        time.sleep(2.0)
        assert src.token_refreshes >= 3  # one token per ~0.75 s of a 1 s TTL
        assert st.unauthorized == 0 and w.errors == 0  # never used an expired token
        st.set(action={"action": "terminate", "time": "2030-01-02T03:04:05Z"})
        assert rec.event.wait(2.0)
    finally:
        w.stop()


def test_aws_token_refreshed_on_401(metadata):
    base, st = metadata(gcp=False)
    src = pre.AwsSpotSource(base)  # 6 h token: only a 401 makes it renew
    rec = Recorder()
    w = pre.Watcher([src], rec, interval=0.05).start()
    try:
        time.sleep(0.3)
        assert src.token_refreshes == 1
        with st.cond:
            st.tokens.clear()  # the service forgets every token (e.g. restarted)
        time.sleep(0.3)
        assert st.unauthorized >= 1 and src.token_refreshes == 2
        assert w.errors == 0  # the poll that got 401 renewed the token and retried at once
        t0 = st.set(action={"action": "terminate", "time": "2030-01-02T03:04:05Z"})
        assert rec.event.wait(2.0)
        print(
            f"\nAWS notice latency after token refresh (interval 0.05 s): {w.notice_latency(t0):.3f} s"
        )
    finally:
        w.stop()


@pytest.mark.parametrize("mode", ["500", "garbage", "drop"])
def test_aws_survives_broken_service(metadata, mode):
    base, st = metadata(gcp=False)
    rec = Recorder()
    w = pre.start_watcher(rec, provider="aws", base_url=base, interval=0.05)
    try:
        st.set(action={"action": "terminate", "time": "2030-01-02T03:04:05Z"}, fail=mode)
        time.sleep(0.8)
        assert w.errors >= 2 and w.running and rec.reasons == []  # no crash, no false notice
        t0 = st.set(fail=None)
        assert rec.event.wait(2.0)  # backoff is capped at 5 x interval
        assert w.notice_latency(t0) < 0.25 + 0.3
    finally:
        w.stop()


def test_aws_garbage_instance_action_is_not_a_notice(metadata):
    base, st = metadata(gcp=False)
    st.set(action=["not", "a", "dict"])
    rec = Recorder()
    w = pre.start_watcher(rec, provider="aws", base_url=base, interval=0.05)
    try:
        time.sleep(0.5)
        assert rec.reasons == [] and w.errors >= 2 and w.running
    finally:
        w.stop()


def test_connection_refused_never_crashes(metadata):
    rec = Recorder()
    w = pre.start_watcher(rec, provider="aws", base_url=closed_port_url(), interval=0.05)
    try:
        time.sleep(0.6)
        assert w.running and w.errors >= 2 and rec.reasons == []
    finally:
        w.stop()
    assert not w.running


def test_gcp_hanging_get_notice_is_immediate(metadata):
    base, st = metadata(aws=False)
    rec = Recorder()
    w = pre.start_watcher(rec, provider="gcp", base_url=base)  # default interval 2.0 s
    try:
        deadline = time.monotonic() + 2.0
        while st.hanging_gets == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert st.hanging_gets == 1  # primed with a plain read, then waiting
        time.sleep(0.3)
        t0 = st.set(preempted=True)
        assert rec.event.wait(3.0)
        latency = w.notice_latency(t0)
        print(f"\nGCP notice latency (hanging GET, interval 2.0 s): {latency * 1000:.1f} ms")
        assert latency < 0.5  # far below the polling interval
        assert rec.reasons == ["gcp-preempted: instance preempted"]
        assert w.deadline == pytest.approx(w.noticed_at + 30.0)
    finally:
        w.stop()


def test_gcp_hanging_get_rearms_after_timeout(metadata):
    base, st = metadata(aws=False)
    src = pre.GcpPreemptedSource(base, wait_timeout=1)
    rec = Recorder()
    w = pre.Watcher([src], rec, interval=2.0).start()
    try:
        time.sleep(1.5)  # a hanging GET times out with FALSE; the watcher re-arms at once
        assert src.hanging_gets >= 2 and w.errors == 0 and src.wait
        t0 = st.set(preempted=True)
        assert rec.event.wait(2.0)
        assert w.notice_latency(t0) < 0.5
    finally:
        w.stop()


def test_gcp_falls_back_to_polling(metadata):
    base, st = metadata(aws=False)
    st.set(wait_supported=False)
    src = pre.GcpPreemptedSource(base)
    rec = Recorder()
    w = pre.Watcher([src], rec, interval=0.1).start()
    try:
        time.sleep(0.8)
        assert not src.wait and w.running and w.errors == 2
        t0 = st.set(preempted=True)
        assert rec.event.wait(2.0)
        latency = w.notice_latency(t0)
        print(f"\nGCP notice latency (polling fallback, interval 0.1 s): {latency:.3f} s")
        assert latency < 0.1 + 0.3
    finally:
        w.stop()


@pytest.mark.parametrize("mode", ["500", "garbage", "drop"])
def test_gcp_survives_broken_service(metadata, mode):
    base, st = metadata(aws=False)
    st.set(fail=mode)
    rec = Recorder()
    w = pre.Watcher([pre.GcpPreemptedSource(base)], rec, interval=0.05).start()
    try:
        time.sleep(0.6)
        assert w.running and w.errors >= 2 and rec.reasons == []
        st.set(fail=None, preempted=True)
        assert rec.event.wait(2.0)
    finally:
        w.stop()


def test_stop_aborts_a_hanging_get_promptly(metadata):
    base, st = metadata(aws=False)
    w = pre.start_watcher(Recorder(), provider="gcp", base_url=base)
    deadline = time.monotonic() + 2.0
    while st.hanging_gets == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert st.hanging_gets == 1
    started = time.monotonic()
    w.stop()
    assert not w.running and time.monotonic() - started < 1.0


def test_detection(metadata):
    aws_url, _ = metadata(gcp=False)
    gcp_url, _ = metadata(aws=False)
    assert pre.detect_provider(aws_url) == "aws"
    assert pre.detect_provider(gcp_url) == "gcp"
    started = time.monotonic()
    assert pre.detect_provider(closed_port_url()) is None
    assert time.monotonic() - started < 1.0


def test_auto_detects_through_env(metadata, monkeypatch):
    base, st = metadata(aws=False)
    monkeypatch.setenv(pre.ENV_METADATA_URL, base)
    rec = Recorder()
    w = pre.start_watcher(rec, interval=0.05)
    assert w is not None and w.provider == "gcp-preempted"
    try:
        st.set(preempted=True)
        assert rec.event.wait(2.0)
    finally:
        w.stop()


def test_none_off_cloud_is_quick():
    started = time.monotonic()
    assert pre.start_watcher(Recorder(), base_url=closed_port_url()) is None
    assert time.monotonic() - started < 1.0
    # Something listening that never answers: bounded by the 0.3 s probe timeout.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        started = time.monotonic()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        assert pre.start_watcher(Recorder(), base_url=url) is None
        elapsed = time.monotonic() - started
        print(f"\ndetection against a silent endpoint took {elapsed * 1000:.0f} ms")
        assert 0.25 < elapsed < 1.0
    assert pre.start_watcher(Recorder(), provider="none") is None


def test_default_detection_is_quick():
    """Real link-local probe of this machine: never slow; None unless on AWS/GCP."""
    started = time.monotonic()
    w = pre.start_watcher(Recorder())
    elapsed = time.monotonic() - started
    print(f"\ndefault cloud detection took {elapsed * 1000:.1f} ms")
    assert elapsed < 1.0
    if w is not None:
        w.stop()
        pytest.skip(f"this machine is on a cloud ({w.provider})")


def test_notice_file(tmp_path, monkeypatch):
    path = tmp_path / "preempt-notice"
    monkeypatch.setenv(pre.ENV_NOTICE_FILE, str(path))
    rec = Recorder()
    w = pre.start_watcher(rec, provider="none", interval=0.05)
    assert w is not None and w.provider == "notice-file"
    try:
        time.sleep(0.2)
        assert rec.reasons == []
        t0 = time.time()
        # Written whole, as the local backend does: the watcher fires on the file existing,
        # so a plain write_text could be seen empty (CI saw it).
        atomic_write_bytes(path, b"simulated preemption of worker 3\n")
        assert rec.event.wait(2.0)
        print(f"\nnotice-file latency (interval 0.05 s): {w.notice_latency(t0):.3f} s")
        assert rec.reasons == [f"notice-file: {path}: simulated preemption of worker 3"]
    finally:
        w.stop()


def test_notice_file_reads_a_bounded_first_line(tmp_path, monkeypatch):
    """A huge notice file (one 64 MiB line) costs one bounded read; its reason keeps 200 chars."""
    path = tmp_path / "notice"
    with path.open("wb") as f:
        f.write(b"x" * (64 << 20))
    opened: list[int] = []
    real_open = type(path).open

    def counting_open(self, *args, **kwargs):
        fh = real_open(self, *args, **kwargs)
        real_read = fh.read

        def read(n=-1):
            opened.append(n)
            return real_read(n)

        fh.read = read
        return fh

    monkeypatch.setattr(type(path), "open", counting_open)
    [signal] = pre.NoticeFileSource(path).poll()
    assert signal.reason == f"notice-file: {path}: " + "x" * 200
    assert opened and all(0 < n <= 4096 for n in opened)


def test_notice_file_alongside_cloud_fires_once(metadata, tmp_path):
    base, st = metadata(aws=False)
    path = tmp_path / "notice"
    rec = Recorder()
    w = pre.start_watcher(rec, base_url=base, notice_file=path, interval=0.05)
    assert w is not None and w.provider == "gcp-preempted+notice-file"
    try:
        path.touch()
        assert rec.event.wait(2.0)
        st.set(preempted=True)
        time.sleep(0.3)
        assert rec.reasons == [f"notice-file: {path}"]
    finally:
        w.stop()
    assert not w.running  # the hanging GET was aborted by the notice


def test_callback_errors_are_contained(tmp_path):
    path = tmp_path / "notice"
    path.touch()

    def boom(reason: str) -> None:
        raise RuntimeError("checkpoint failed")

    w = pre.start_watcher(boom, provider="none", notice_file=path, interval=0.05)
    try:
        assert w.wait(2.0) and w.reason == f"notice-file: {path}"
    finally:
        w.stop()


def test_bad_arguments():
    with pytest.raises(ValueError):
        pre.start_watcher(Recorder(), provider="azure")
    with pytest.raises(ValueError):
        pre.AwsSpotSource("http://127.0.0.1:1", token_ttl=0)
    with pytest.raises(ValueError):
        pre.Watcher([pre.NoticeFileSource("x")], Recorder(), interval=0)
    with pytest.raises(ValueError):
        pre.GcpPreemptedSource("ftp://example.org")


# --- BOINC ---------------------------------------------------------------------------

URL = "https://boinc.example.org/boincdl/"
TASK = "job1_e3_s17_v42_0"


def test_boinccmd_abort_argv():
    assert pre.boinccmd_abort_argv(URL, TASK) == ["boinccmd", "--task", URL, TASK, "abort"]
    assert pre.boinccmd_abort_argv(
        URL, TASK, "/usr/bin/boinccmd", host="localhost:31416", passwd="s3cret"
    ) == [
        "/usr/bin/boinccmd",
        "--host",
        "localhost:31416",
        "--passwd",
        "s3cret",
        "--task",
        URL,
        TASK,
        "abort",
    ]
    assert pre.boinccmd_update_argv(URL) == ["boinccmd", "--project", URL, "update"]
    for bad in ("", " ", f" {TASK}"):
        with pytest.raises(ValueError):
            pre.boinccmd_abort_argv(URL, bad)
    with pytest.raises(ValueError):
        pre.boinccmd_abort_argv("", TASK)


def fake_boinccmd(tmp_path: Path, exit_code: int = 0, stderr: str = "", sleep: float = 0) -> Path:
    """An executable standing in for boinccmd: logs its argv and cwd, then exits."""
    script = tmp_path / "boinccmd"
    log = tmp_path / "calls.jsonl"
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys, time\n"
        f"with open({str(log)!r}, 'a') as f:\n"
        "    f.write(json.dumps({'argv': sys.argv[1:], 'cwd': os.getcwd()}) + '\\n')\n"
        f"time.sleep({sleep})\n"
        f"sys.stderr.write({stderr!r})\n"
        f"sys.exit({exit_code})\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def calls(tmp_path: Path) -> list[dict]:
    log = tmp_path / "calls.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_report_lost_aborts_then_updates(tmp_path):
    data_dir = tmp_path / "boinc-data"
    data_dir.mkdir()
    exe = fake_boinccmd(tmp_path)
    assert pre.report_lost_to_boinc(URL, TASK, str(exe), data_dir=data_dir)
    assert calls(tmp_path) == [
        {"argv": ["--task", URL, TASK, "abort"], "cwd": str(data_dir)},
        {"argv": ["--project", URL, "update"], "cwd": str(data_dir)},
    ]


def test_report_lost_errors_are_reported_not_raised(tmp_path, caplog):
    exe = fake_boinccmd(tmp_path, exit_code=255, stderr="GUI RPC error: no such result\n")
    assert not pre.report_lost_to_boinc(URL, TASK, str(exe), passwd="s3cret")
    assert [c["argv"][-1] for c in calls(tmp_path)] == ["abort"]  # no update after a failure
    assert "no such result" in caplog.text and "s3cret" not in caplog.text
    assert not pre.report_lost_to_boinc(URL, TASK, str(tmp_path / "missing-boinccmd"))
    assert not pre.report_lost_to_boinc(URL, "", str(exe))
    assert not pre.report_lost_to_boinc(URL, TASK, str(exe), data_dir=tmp_path / "nope")


def test_report_lost_times_out(tmp_path):
    exe = fake_boinccmd(tmp_path, sleep=10)
    started = time.monotonic()
    assert not pre.report_lost_to_boinc(URL, TASK, str(exe), timeout=0.5)
    assert time.monotonic() - started < 3.0


def test_report_lost_update_failure_still_true(tmp_path):
    exe = tmp_path / "boinccmd"
    exe.write_text(f"#!{sys.executable}\nimport sys\nsys.exit(0 if '--task' in sys.argv else 1)\n")
    exe.chmod(0o755)
    assert pre.report_lost_to_boinc(URL, TASK, str(exe))


def test_escape_project_url():
    assert (
        pre.escape_project_url("https://boinc.example.org/boincdl/") == "boinc.example.org_boincdl"
    )
    assert pre.escape_project_url("http://h:8080/a b/") == "h_8080_a_b"


def test_boinc_task_from_slot(tmp_path):
    data_dir = tmp_path / "var-lib-boinc"
    slot = data_dir / "slots" / "3"
    slot.mkdir(parents=True)
    escaped = pre.escape_project_url(URL)
    (slot / "init_data.xml").write_text(
        "<app_init_data>\n<major_version>8</major_version>\n"
        f"<project_dir>{data_dir}/projects/{escaped}</project_dir>\n"
        f"<boinc_dir>{data_dir}</boinc_dir>\n<authenticator>x</authenticator>\n"
        f"<wu_name>job1_e3_s17_v42</wu_name>\n<result_name>{TASK}</result_name>\n"
        "</app_init_data>\n"
    )
    assert pre.boinc_task_from_slot(slot) is None  # no account file, no client state
    (data_dir / "client_state.xml").write_text(
        "<client_state><project><master_url>https://other.org/</master_url></project>"
        f"<project><master_url>{URL}</master_url></project></client_state>"
    )
    assert pre.boinc_task_from_slot(slot) == pre.BoincTask(URL, TASK, str(data_dir))
    (data_dir / f"account_{escaped}.xml").write_text(
        f"<account>\n    <master_url>{URL}</master_url>\n</account>\n"
    )
    task = pre.boinc_task_from_slot(slot)
    assert task == pre.BoincTask(URL, TASK, str(data_dir))
    assert pre.boinccmd_abort_argv(task.project_url, task.task_name)[-3:] == [URL, TASK, "abort"]
    assert pre.boinc_task_from_slot(tmp_path) is None  # not a BOINC slot
