"""The BOINC admin page (server/backends/boinc/html/boincdl.php), served for real.

PHP's built-in web server (Debian's php-cli) serves the page against a real Redis
started by the test and filled through JobStore; the HTML is fetched over HTTP and
checked, then headless Chromium renders it to a PNG screenshot. Skipped, with the
reason, where php or chromium is not installed (.ci/deps.sh installs both).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import struct
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
import redis

from boinc_dl.server.assimilator.redis_server import EmbeddedRedis
from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.common.weights import fingerprint_of
from boinc_dl.server.common.workunit import unit_name
from tests.support.net import free_port

ROOT = Path(__file__).resolve().parents[1]
HTML = ROOT / "server" / "backends" / "boinc" / "html"
PHP = shutil.which("php")
CHROMIUM = next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if p), None)
# Set BDL_SCREENSHOT_DIR to keep the screenshot (CI artifacts); else it goes to tmp_path.
SCREENSHOT_DIR = os.environ.get("BDL_SCREENSHOT_DIR")

pytestmark = pytest.mark.skipif(PHP is None, reason="php-cli is not installed (apt-get install php-cli; see .ci/deps.sh)")

EVIL_JOB = '<script>alert("job")</script>&x'
EVIL_REASON = "<img src=x onerror=alert(1)> weights of the wrong shape & NaN"
PASSWORD = "adm'n pw/with:odd#chars"


# ---- helpers -------------------------------------------------------------------------
class Tables(HTMLParser):
    """Rows (lists of cell texts) of every table with an id, plus all text."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self.text: list[str] = []
        self._stack: list[str | None] = []
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "table":
            tid = dict(attrs).get("id")
            self._stack.append(tid)
            if tid:
                self.tables[tid] = []
        elif tag == "tr" and self._stack and self._stack[-1]:
            self.tables[self._stack[-1]].append([])
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "table" and self._stack:
            self._stack.pop()
        elif tag in ("td", "th") and self._cell is not None:
            if self._stack and self._stack[-1]:
                self.tables[self._stack[-1]][-1].append("".join(self._cell).strip())
            self._cell = None

    def handle_data(self, data: str) -> None:
        self.text.append(data)
        if self._cell is not None:
            self._cell.append(data)


def parse(html: str) -> Tables:
    t = Tables()
    t.feed(html)
    return t


def fill_redis(r: redis.Redis) -> dict[str, object]:
    """A VC-ASGD job three epochs in, a MOP job just started, and a job with a hostile name."""
    fp = fingerprint_of(["dense/kernel", "dense/bias"], [np.zeros((8, 4)), np.zeros(4)])
    job = "digits-vcasgd"
    store = JobStore(r, job)
    spec = {"name": job, "mode": "vcasgd", "model": "examples.models:mlp", "dataset": {"name": "digits"}}
    store.create(json.dumps(spec), "vcasgd", {"0": fp}, {"epochs": 5, "n_subsets": 4})
    store.init_weights("0", np.zeros(fp.n_params, np.float32))
    curve = [(1, 0.61, 1.20, 0.55, 0.06), (2, 0.78, 0.71, 0.72, 0.04), (3, 0.86, 0.45, 0.81, 0.03)]
    for e, acc, loss, cmean, cstd in curve:
        units = [unit_name(job, e, s) for s in range(4)]
        for s, u in enumerate(units):
            store.register_unit(u, {"epoch": e, "shard": s, "model": "0"}, e)
            store.transition_unit(u, "created", "in_progress")  # handed to the job system
        for u in units[:3]:
            store.merge("0", u, lambda w: w + 1.0, {"epoch": e}, e)
        if e == 2:
            store.mark_failed(units[3], "too many errors", e)
        elif e == 3:
            pass  # last unit of epoch 3 still in flight
        else:
            store.merge("0", units[3], lambda w: w + 1.0, {"epoch": e}, e)
        if e < 3:
            store.finish_epoch(e, {"val_acc": acc, "val_loss": loss, "client_val_acc_mean": cmean,
                                   "client_val_acc_std": cstd})
    # epoch 3's summary exists too (the work generator evaluates as soon as enough is merged)
    store.finish_epoch(3, {"val_acc": 0.86, "val_loss": 0.45, "client_val_acc_mean": 0.81, "client_val_acc_std": 0.03})
    store.register_unit(unit_name(job, 4, 0), {"epoch": 4, "shard": 0, "model": "0"}, 4)
    store.record_rejection(unit_name(job, 2, 3), "res_e2s3_r1", EVIL_REASON)
    store.record_rejection(unit_name(job, 1, 2), "res_e1s2_r0", "update distance 93.1 from the server weights exceeds the bound 50")
    store.incr_counter("reissued", 2)

    mop = JobStore(r, "cifar-mop")
    mop.create(json.dumps({"name": "cifar-mop"}), "mop", {"0": fp, "1": fp}, {"epochs": 10})
    for m in ("0", "1"):
        mop.init_weights(m, np.zeros(fp.n_params, np.float32))
        mop.register_unit(unit_name("cifar-mop", 1, 0, model=m), {"epoch": 1, "shard": 0, "model": m}, 1)

    evil = JobStore(r, EVIL_JOB)
    evil.create("{}", "vcasgd", {"0": fp}, {"note": "<b>bold</b>"})
    evil.register_unit(unit_name(EVIL_JOB, 1, 0), {"epoch": 1, "shard": 0, "model": "0"}, 1)
    evil.record_rejection(unit_name(EVIL_JOB, 1, 0), '"><svg onload=alert(2)>', EVIL_REASON)
    return {"job": job, "version": store.version("0")}


class PhpServer:
    """``php -S`` serving ``docroot`` with the given environment."""

    def __init__(self, docroot: Path, env: dict[str, str]):
        self.port = free_port()
        self.proc = subprocess.Popen(
            [PHP, "-S", f"127.0.0.1:{self.port}", "-t", str(docroot)],
            cwd=docroot, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            start_new_session=True,
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"php -S did not start: {self.proc.stderr.read().decode()}") from None
                time.sleep(0.05)

    def url(self, path: str = "/boincdl.php") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def get(self, path: str = "/boincdl.php") -> tuple[int, str]:
        with urllib.request.urlopen(self.url(path), timeout=30) as resp:
            return resp.status, resp.read().decode()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture()
def redis_tcp(tmp_path: Path) -> Iterator[tuple[EmbeddedRedis, redis.Redis, dict]]:
    srv = EmbeddedRedis(tmp_path / "redis", port=free_port()).start()
    try:
        r = srv.client()
        facts = fill_redis(r)
        r.config_set("requirepass", PASSWORD)
        yield srv, redis.Redis(port=srv.port, password=PASSWORD), facts
    finally:
        srv.stop()


@pytest.fixture()
def ops_dir(tmp_path: Path) -> Path:
    """The page's folder as the BOINC install copies it (html/ops/ without BOINC)."""
    d = tmp_path / "standalone" / "ops"
    shutil.copytree(HTML, d)
    return d


@pytest.fixture()
def page(redis_tcp, ops_dir: Path, tmp_path: Path) -> Iterator[PhpServer]:
    srv, _r, _facts = redis_tcp
    pw = tmp_path / "redis_password"
    pw.write_text(PASSWORD + "\n")
    php = PhpServer(ops_dir, {"BDL_REDIS_URL": f"redis://127.0.0.1:{srv.port}/0", "BDL_REDIS_PASSWORD_FILE": str(pw)})
    yield php
    php.stop()


# ---- the page ----------------------------------------------------------------------
def test_page_shows_jobs_epochs_units_and_rejections(page: PhpServer, redis_tcp) -> None:
    status, html = page.get()
    assert status == 200
    assert "<b>Fatal" not in html and "Warning</b>" not in html and "Notice</b>" not in html
    t = parse(html)
    jobs = {row[0]: row for row in t.tables["bdl-jobs"][1:]}
    assert set(jobs) == {"digits-vcasgd", "cifar-mop", EVIL_JOB}
    # job  mode  status  epochs  in flight  done  failed  re-issued / regenerated  rejected  val acc  created
    assert jobs["digits-vcasgd"][1:10] == ["vcasgd", "running", "3 / 5", "2", "10", "1", "2 / 0", "2", "0.86"]
    assert jobs["cifar-mop"][1:7] == ["mop", "running", "0 / 10", "2", "0", "0"]

    # The newest job is shown in detail by default; ask for the VC-ASGD one.
    status, html = page.get("/boincdl.php?job=digits-vcasgd")
    t = parse(html)
    # queued  in flight  done  failed  re-issued  rejected  cancelled
    assert t.tables["bdl-units"][1] == ["1", "1", "10", "1", "2", "0", "0", "0", "0", "2", "0"]
    epochs = {row[0]: row for row in t.tables["bdl-epochs"][1:]}
    assert list(epochs) == ["4", "3", "2", "1"]  # newest first
    # epoch  created  assimilated  failed  in flight  val acc  val loss  clients
    assert epochs["1"][1:8] == ["4", "4", "0", "0", "0.61", "1.2", "0.55 ± 0.06"]
    assert epochs["2"][1:5] == ["4", "3", "1", "0"]
    assert epochs["3"][1:5] == ["4", "3", "0", "1"]
    assert epochs["4"][1:7] == ["1", "0", "0", "1", "–", "–"]
    meta = dict(row for row in t.tables["bdl-meta"] if len(row) == 2)
    assert meta["weights of model 0"] == f"version {redis_tcp[2]['version']}, stored as 1 Redis shard"
    assert redis_tcp[2]["version"] == 10
    assert meta["n_subsets"] == "4"
    rej = t.tables["bdl-rejections"][1:]
    assert [row[2] for row in rej] == ["res_e1s2_r0", "res_e2s3_r1"]  # newest first
    assert rej[0][3].startswith("update distance 93.1")
    assert rej[1][3] == EVIL_REASON  # shown as text...
    assert "<img src=x" not in html  # ...never as markup
    assert "&lt;img src=x onerror=alert(1)&gt;" in html
    # the learning curve: inline SVG, 3 points per series, no external resources
    svg = html[html.index("<svg id=\"bdl-curve\""): html.index("</svg>") + 6]
    acc_line = svg.split('class="val_acc" points="')[1].split('"')[0].split()
    loss_line = svg.split('class="val_loss" points="')[1].split('"')[0].split()
    assert len(acc_line) == len(loss_line) == 3
    ys = [float(p.split(",")[1]) for p in acc_line]
    assert ys[0] > ys[1] > ys[2]  # accuracy rises: y decreases on screen
    assert 'class="band"' in svg
    for external in ("<script", "src=\"http", "href=\"http", "cdn", "@import"):
        assert external not in html.lower()


def test_page_names_data_subsets_and_weight_shards_apart(page: PhpServer, redis_tcp) -> None:
    _srv, r, _facts = redis_tcp
    JobStore(r, "digits-vcasgd").set_meta(n_shards=8)
    JobStore(r, "cifar-mop").set_meta(n_shards=4)
    t = parse(page.get("/boincdl.php?job=digits-vcasgd")[1])
    meta = dict(row for row in t.tables["bdl-meta"] if len(row) == 2)
    assert meta["data subsets (n_shards)"] == "8" and meta["weights of model 0"].endswith("1 Redis shard")
    t = parse(page.get("/boincdl.php?job=cifar-mop")[1])
    assert dict(row for row in t.tables["bdl-meta"] if len(row) == 2)["data partitions (n_shards)"] == "4"


def test_page_shows_late_results_and_replication(page: PhpServer, redis_tcp) -> None:
    from boinc_dl.server.backends.boinc.registry import BoincRegistry

    _srv, r, _facts = redis_tcp
    reg = BoincRegistry(JobStore(r, "digits-vcasgd"))
    reg.record_late_result("digits-vcasgd__m0_e0001_s0000", "digits-vcasgd__m0_e0001_s0000_0", "superseded")
    for i, (same_host, same_user) in enumerate([(False, False)] * 6 + [(False, True), (True, True), (None, None)]):
        reg.record_comparison(f"u{i}", (f"u{i}_0", f"u{i}_1"), True, same_host, same_user)
    reg.record_comparison("u0", ("u0_1", "u0_0"), True, False, False)  # the same pair again: counted once
    t = parse(page.get("/boincdl.php?job=digits-vcasgd")[1])
    head, row = t.tables["bdl-units"]
    assert dict(zip(head, row, strict=True))["late results not checked"] == "1"
    # refused results whose unit runs again (the registry's count), beside the rejections
    JobStore(r, "digits-vcasgd").r.hincrby(JobStore(r, "digits-vcasgd").k("counters"), "reissued_refused", 2)
    html = page.get("/boincdl.php?job=digits-vcasgd")[1]
    head, row = parse(html).tables["bdl-units"]
    assert dict(zip(head, row, strict=True))["rejected results"] == "2 (2 run again)"
    assert "reissued_refused" not in html  # not repeated among the other counters
    # workunits cancelled, and how many of them the work generator found stuck
    store = JobStore(r, "digits-vcasgd")
    store.r.hincrby(store.k("counters"), "boinc_cancelled", 3)
    BoincRegistry(store).mark_stuck("digits-vcasgd__m0_e0001_s0001")
    html = page.get("/boincdl.php?job=digits-vcasgd")[1]
    head, row = parse(html).tables["bdl-units"]
    assert dict(zip(head, row, strict=True))["workunits cancelled"] == "3 (1 stuck)"
    assert "boinc_stuck" not in html
    head, row = t.tables["bdl-quorum"]
    q = dict(zip(head, row, strict=True))
    assert q["replica comparisons"] == "9" and q["across hosts"] == "7 (77.8%)"
    assert q["across users"] == "6 (66.7%)" and q["same host"] == "1 (11.1%)" and q["hosts unknown"] == "1 (11.1%)"


def test_page_shows_the_loss_check_ledgers_and_stale_verdicts(page: PhpServer, redis_tcp) -> None:
    """What ``boinc-dl status`` shows of the held-out loss check, on the admin page: the
    hosts' ledgers nearest their limit (hostile host ids as text) and the results judged
    against trusted results from worse models, written as the checker writes them."""
    from boinc_dl.server.assimilator import losscheck as lc

    _srv, r, _facts = redis_tcp
    status, html = page.get("/boincdl.php?job=digits-vcasgd")
    assert status == 200 and "Held-out loss check" not in html  # nothing yet, no section
    store = JobStore(r, "digits-vcasgd")
    spec = json.loads(store.spec_json())
    r.set(store.k("spec"), json.dumps({**spec, "validation": {"loss_ledger_limit": 6.0}}))  # as submit stores it
    for i, (host, balance) in enumerate((("31", 5.5), ("32", 0.75), ("<b>h</b>", 2.0), ("33", 0.0))):
        got = store.set_loss_verdict_with_ledger(f"r{i}", {**lc.decide(0.0, None)}, 60, "0", host, None, balance,
                                                 stale_model="0" if i < 3 else None)
        assert got is not None
    status, html = page.get("/boincdl.php?job=digits-vcasgd")
    assert status == 200 and "<b>Fatal" not in html and "Warning</b>" not in html and "Notice</b>" not in html
    t = parse(html)
    head, *rows = t.tables["bdl-ledgers"]
    assert head == ["host", "model", "ledger balance (refused past 6)"]
    assert rows == [["31", "0", "5.50"], ["<b>h</b>", "0", "2.00"], ["32", "0", "0.75"]]  # fullest first, none at 0
    assert "&lt;b&gt;h&lt;/b&gt;" in html and "<b>h</b>" not in html
    assert "3 results judged against trusted results from worse models" in " ".join(html.split())
    # the work generator's spot checks, as spotcheck.py records them (a hostile-looking entry counts as "?")
    r.hset(store.k("boinc", "spot_checks"), mapping={"u1": json.dumps({"why": "bootstrap"}),
                                                     "u2": json.dumps({"why": "bootstrap"}),
                                                     "u3": json.dumps({"why": "stale", "stale": 20}), "u4": "{"})
    status, html = page.get("/boincdl.php?job=digits-vcasgd")
    assert status == 200 and "Warning</b>" not in html and "Notice</b>" not in html
    assert ("4 units replicated on a second host for the check (spot checks): 2 until it had enough trusted "
            "results, 1 after results judged against worse models") in " ".join(html.split())


def test_page_says_the_loss_check_is_not_active_yet(page: PhpServer, redis_tcp) -> None:
    """A BOINC VC-ASGD job whose check has measured fewer trusted results than it needs says
    so, with the count ``boinc-dl status`` shows (losscheck.trusted_needed); a job on the
    local backend, or with the check off, says nothing; a measured check says nothing."""
    from boinc_dl.server.assimilator import losscheck as lc
    from boinc_dl.server.common.spec import spec_from_json

    _srv, r, _facts = redis_tcp
    store = JobStore(r, "digits-vcasgd")
    spec = json.loads(store.spec_json())

    def inactive(validation: dict, backend: str = "boinc") -> str | None:
        r.set(store.k("spec"), json.dumps({**spec, "validation": validation}))
        store.set_meta(backend=backend)
        status, html = page.get("/boincdl.php?job=digits-vcasgd")
        assert status == 200 and "Warning</b>" not in html and "Notice</b>" not in html
        m = re.search(r'<p id="bdl-loss-inactive"[^>]*>([^<]*)</p>', html)
        return " ".join(m.group(1).split()) if m else None

    assert inactive({"loss_check_min_trusted": 4}) == ("Not active yet: 0 of 4 trusted (replicated) results "
                                                        "measured; until then it refuses nothing.")
    for i in range(3):
        store.push_trusted_value("0", lc.STAT, 1, 0.01 * i, lc.WINDOW, base_loss=1.0)
    assert inactive({"loss_check_min_trusted": 4}).startswith("Not active yet: 3 of 4 ")
    # the needed count is the check's own: min(loss_check_min_trusted, its window)
    full = {**spec, "validation": {"loss_check_min_trusted": 1000}}
    assert lc.trusted_needed(spec_from_json(json.dumps(full))) == 32
    assert inactive({"loss_check_min_trusted": 1000}).startswith("Not active yet: 3 of 32 ")
    assert inactive({}).startswith("Not active yet: 3 of 16 ")  # the spec's default
    assert inactive({"loss_check_min_trusted": 4}, backend="local") is None
    assert inactive({"loss_check_min_trusted": 4, "loss_check": False}) is None
    store.push_trusted_value("0", lc.STAT, 1, 0.0, lc.WINDOW, base_loss=1.0)
    assert inactive({"loss_check_min_trusted": 4}) is None
    assert "Held-out loss check" not in page.get("/boincdl.php?job=digits-vcasgd")[1]  # nothing else to say


def test_page_shows_mop_models_with_hyper_parameters(page: PhpServer, redis_tcp) -> None:
    from boinc_dl.server.work_generator.mop.state import MopState

    _srv, r, _facts = redis_tcp
    state = MopState(JobStore(r, "cifar-mop"))
    state.put_config("0", {"params": {"lr": 0.1, "units": 32}, "status": "running"})
    state.put_config("1", {"params": {"lr": 0.01, "units": 64}, "status": "stopped", "reason": "successive halving"})
    # model 2 peaked at epoch 1 (0.8) but its weights now score 0.62: ranked by those
    state.put_config("2", {"params": {"lr": 1.0, "units": 8}, "status": "running"})
    for e, (a0, a1, a2) in enumerate([(0.5, 0.6, 0.8), (0.7, 0.65, 0.62)], start=1):
        state.put_model_result(e, "0", {"val_acc": a0, "val_loss": 1.0})
        state.put_model_result(e, "2", {"val_acc": a2, "val_loss": 1.0})
        if e == 1:
            state.put_model_result(e, "1", {"val_acc": a1, "val_loss": 1.0})
    state.put_results(1, {"0": {"val_acc": 0.5}, "1": {"val_acc": 0.6}})
    status, html = page.get("/boincdl.php?job=cifar-mop")
    assert status == 200 and "<b>Fatal" not in html and "Warning</b>" not in html
    t = parse(html)
    models = t.tables["bdl-models"][1:]
    # rank  hyper-parameters  model  status  epochs done  last  best  weights version  note
    assert models[0][:7] == ["1", "lr=0.1, units=32", "0", "running", "2", "0.7", "0.7"]
    assert models[1][:7] == ["2", "lr=1, units=8", "2", "running", "2", "0.62", "0.8"]
    assert models[2][:7] == ["3", "lr=0.01, units=64", "1", "stopped", "1", "0.6", "0.6"]
    assert models[2][8] == "successive halving"
    meta = dict(row for row in t.tables["bdl-meta"] if len(row) == 2)
    assert meta["weights of model lr=0.1, units=32"].startswith("version 0")
    svg = html[html.index('<svg id="bdl-model-curves"'):]
    svg = svg[: svg.index("</svg>")]
    assert svg.count('<g class="model">') == 3 and svg.count("<polyline") == 2  # models 0 and 2: 2 epochs
    assert svg.count("<circle") == 5


def test_page_shows_the_cloud_cost(page: PhpServer, redis_tcp) -> None:
    _srv, r, _facts = redis_tcp
    status, html = page.get("/boincdl.php?job=digits-vcasgd")
    assert status == 200 and "bdl-cost" not in html  # no fleet, no section
    r.hset("bdl:digits-vcasgd:cost_summary", mapping={
        "instance_hours": "41.250", "total_usd": "9.87", "on_demand_usd": "21.70", "saving_usd": "11.83",
        "saving_pct": "54.5", "reclaims": "3", "lost_hours": "0.420", "lost_usd": "0.11", "job": "<b>x</b>"})
    status, html = page.get("/boincdl.php?job=digits-vcasgd")
    t = parse(html)
    assert t.tables["bdl-cost"][1] == ["41.250", "9.87", "21.70", "11.83", "54.5", "3", "0.420", "0.11"]


def test_page_escapes_hostile_job_names(page: PhpServer) -> None:
    status, html = page.get()
    assert '<script>alert("job")' not in html
    assert "&lt;script&gt;alert(&quot;job&quot;)&lt;/script&gt;&amp;x" in html
    status, html = page.get("/boincdl.php?job=" + urllib.parse.quote(EVIL_JOB, safe=""))
    assert status == 200
    t = parse(html)
    assert t.tables["bdl-rejections"][1][2] == '"><svg onload=alert(2)>'
    assert "<svg onload" not in html and "<b>bold</b>" not in html
    assert "&lt;b&gt;bold&lt;/b&gt;" in html
    # the link to the job carries the name URL-encoded, inside an escaped attribute
    assert "?job=%3Cscript%3Ealert%28%22job%22%29%3C%2Fscript%3E%26x" in html
    status, html = page.get("/boincdl.php?job=" + urllib.parse.quote("<i>nope</i>"))
    assert "No job named <code>&lt;i&gt;nope&lt;/i&gt;</code>" in html
    status, html = page.get("/boincdl.php?job[]=x")  # an array parameter is ignored
    assert status == 200 and "bdl-jobs" in html


def test_page_reports_redis_problems(redis_tcp, ops_dir: Path, tmp_path: Path) -> None:
    srv, _r, _ = redis_tcp
    for env, expect in (
        ({"BDL_REDIS_URL": f"redis://127.0.0.1:{srv.port}/0", "BDL_REDIS_PASSWORD": "wrong"}, "WRONGPASS"),
        ({"BDL_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}, "cannot connect to Redis"),
        ({"BDL_REDIS_URL": "http://example.invalid/"}, "unsupported Redis URL"),
        ({"BDL_REDIS_URL": f"redis://127.0.0.1:{srv.port}/0", "BDL_REDIS_PASSWORD_FILE": str(tmp_path / "none")},
         "not readable"),
    ):
        php = PhpServer(ops_dir, env)
        try:
            status, html = php.get()
        finally:
            php.stop()
        assert status == 200
        assert "boinc-dl state unavailable" in html and expect in html, html[-600:]
        assert "Fatal error" not in html


def test_page_over_unix_socket_with_ini_file(redis_tcp, tmp_path: Path) -> None:
    """Redis on its Unix socket; location and password from boincdl.ini in the project dir."""
    srv, _r, _ = redis_tcp
    project = tmp_path / "project"
    ops = project / "html" / "ops"
    shutil.copytree(HTML, ops)
    (project / "boincdl.ini").write_text(f'redis_url = "unix://{srv.socket}?db=0"\nredis_password = "{PASSWORD}"\n')
    php = PhpServer(ops, {"BDL_REDIS_URL": "", "BDL_REDIS_PASSWORD_FILE": "", "BDL_ADMIN_CONFIG": ""})
    try:
        status, html = php.get("/boincdl.php?job=cifar-mop")
    finally:
        php.stop()
    t = parse(html)
    assert {row[0] for row in t.tables["bdl-jobs"][1:]} == {"digits-vcasgd", "cifar-mop", EVIL_JOB}
    meta = dict(row for row in t.tables["bdl-meta"] if len(row) == 2)
    assert meta["mode"] == "mop" and meta["weights of model 1"] == "version 0, stored as 1 Redis shard"
    assert "No model has finished an epoch yet" in html


def test_page_uses_boinc_admin_head_and_tail(redis_tcp, tmp_path: Path) -> None:
    """Inside a project's html/ops/ the page includes ../inc/util_ops.inc and uses its head/tail."""
    srv, _r, _ = redis_tcp
    html_dir = tmp_path / "boincproj" / "html"
    (html_dir / "inc").mkdir(parents=True)
    # A stand-in for BOINC's util_ops.inc with the two functions the page calls.
    (html_dir / "inc" / "util_ops.inc").write_text(
        "<?php\nfunction admin_page_head($title) { echo \"<html><body><h2>OPS-HEAD: $title</h2>\"; }\n"
        "function admin_page_tail() { echo \"<p>OPS-TAIL</p></body></html>\"; }\n"
    )
    shutil.copytree(HTML, html_dir / "ops")
    php = PhpServer(html_dir / "ops", {"BDL_REDIS_URL": f"redis://:{urllib.parse.quote(PASSWORD, safe='')}@127.0.0.1:{srv.port}/0"})
    try:
        status, html = php.get()
    finally:
        php.stop()
    assert html.startswith("<html><body><h2>OPS-HEAD: boinc-dl training</h2>")
    assert html.rstrip().endswith("<p>OPS-TAIL</p></body></html>")
    assert "<!DOCTYPE html>" not in html  # no standalone head inside BOINC
    assert "digits-vcasgd" in html


def test_screenshot_in_headless_chromium(page: PhpServer, tmp_path: Path) -> None:
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (apt-get install chromium; see .ci/deps.sh)")
    out_dir = Path(SCREENSHOT_DIR) if SCREENSHOT_DIR else tmp_path
    out_dir.mkdir(parents=True, exist_ok=True)
    shot = out_dir / "admin_page.png"
    if shot.exists():
        shot.unlink()
    cmd = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'chrome-profile'}",
        f"--screenshot={shot}", "--window-size=1200,900", page.url("/boincdl.php?job=digits-vcasgd"),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1200, 900)
    assert len(data) > 20_000  # a rendered page with tables and a chart, not a blank canvas


# ---- the page reads what install writes ------------------------------------------------

def test_page_reads_the_settings_install_writes(redis_tcp, tmp_path: Path) -> None:
    """``boinc-dl boinc install`` writes boinc-dl.yaml and the page; the page finds Redis
    there, like the daemons do, with no environment and no other file."""
    from boinc_dl.server.backends.boinc.install import InstallOptions, install
    from tests.boinc.conftest import make_project

    srv, r, _ = redis_tcp
    project = make_project(tmp_path / "project")
    url = f"redis://:{urllib.parse.quote(PASSWORD, safe='')}@127.0.0.1:{srv.port}/0"
    install(project.root, InstallOptions(redis_url=url, run_db_tools=False, gpu=False))
    ops = project.root / "html" / "ops"
    assert (ops / "boincdl.php").is_file()
    store = JobStore(r, "digits-vcasgd")
    store.set_meta(finished_at=1_700_000_000.5)
    for name, n in (("reissued", 2), ("regenerated", 3), ("boinc_cancelled", 4), ("superseded_calls", 5)):
        r.hset(store.k("counters"), name, n)
    php = PhpServer(ops, {"BDL_REDIS_URL": "", "BDL_REDIS_PASSWORD_FILE": "", "BDL_ADMIN_CONFIG": ""})
    try:
        status, html = php.get("/boincdl.php?job=digits-vcasgd")
    finally:
        php.stop()
    assert status == 200 and "unavailable" not in html, html[-800:]
    t = parse(html)
    assert "digits-vcasgd" in {row[0] for row in t.tables["bdl-jobs"][1:]}
    head, row = t.tables["bdl-units"]
    units = dict(zip(head, row, strict=True))
    assert units["re-issued (same inputs)"] == "2" and units["regenerated (fresh weights)"] == "3"
    assert units["workunits cancelled"] == "4" and units["late calls of superseded workunits"] == "5"
    assert units["late results not checked"] == "0"
    meta = dict(row for row in t.tables["bdl-meta"] if len(row) == 2)
    assert meta["finished_at"] == "2023-11-14 22:13:20 UTC"  # not raw epoch seconds


def test_page_without_settings_says_so(tmp_path: Path) -> None:
    """No Redis URL anywhere: an explicit error, never a silent default Redis."""
    project = tmp_path / "project"
    ops = project / "html" / "ops"
    shutil.copytree(HTML, ops)
    php = PhpServer(ops, {"BDL_REDIS_URL": "", "BDL_REDIS_PASSWORD_FILE": "", "BDL_ADMIN_CONFIG": ""})
    try:
        status, html = php.get()
        (project / "boinc-dl.yaml").write_text("redis_url: null\n")
        _, html2 = php.get()
    finally:
        php.stop()
    for h in (html, html2):
        assert "boinc-dl state unavailable" in h and "no Redis URL" in h, h[-600:]
        assert "no jobs in Redis" not in h
    assert "run boinc-dl boinc install" in html
