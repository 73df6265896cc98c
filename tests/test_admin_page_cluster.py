"""The BOINC admin page on a Redis Cluster, served for real.

A real 3-master cluster (``LocalRedisCluster``) and a real single Redis are filled with
the same jobs through ``JobStore`` (``fill_redis`` of test_admin_page.py); the page,
served by ``php -S`` with a cluster URL from each settings source (environment,
boinc-dl.yaml, boincdl.ini), must show on the cluster exactly what it shows on the
single Redis. A resharding under way (``ASK``, then ``MOVED``) is followed; a node
that answers with endless or hostile redirections, or a cluster that is down, gives
the page's error, never a PHP warning. Slot hashing and URL parsing are compared with
redis-py and ``server.common.cluster``.
"""

from __future__ import annotations

import json
import shutil
import socketserver
import subprocess
import threading
import urllib.parse
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest
import redis
from redis.crc import key_slot

from boinc_dl.server.assimilator.connection import cluster_nodes, connect
from boinc_dl.server.assimilator.redis_server import EmbeddedRedis, LocalRedisCluster
from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.common.weights import fingerprint_of
from boinc_dl.server.fleet.cost import summary_key
from tests.support.net import free_port
from tests.test_admin_page import (
    EVIL_JOB,
    EVIL_REASON,
    HTML,
    PASSWORD,
    PHP,
    PhpServer,
    fill_redis,
    parse,
)

pytestmark = pytest.mark.skipif(PHP is None, reason="php-cli is not installed (apt-get install php-cli; see .ci/deps.sh)")

LIB = HTML / "boincdl_lib.php"
PW = urllib.parse.quote(PASSWORD, safe="")
JOBS = ("digits-vcasgd", "cifar-mop", EVIL_JOB)
COST = {"instance_hours": "41.250", "total_usd": "9.87", "on_demand_usd": "21.70", "saving_usd": "11.83",
        "saving_pct": "54.5", "reclaims": "3", "lost_hours": "0.420", "lost_usd": "0.11"}
# Columns that hold wall-clock times, which differ between the two fills.
TIME_COLUMNS = {"bdl-jobs": 10, "bdl-rejections": 0, "bdl-epochs": 8}


def _fill(r: redis.Redis) -> dict[str, object]:
    facts = fill_redis(r)
    r.hset(summary_key("digits-vcasgd"), mapping=COST)
    return facts


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[tuple[LocalRedisCluster, dict[str, object]]]:
    """A 3-master cluster filled through JobStore, then given a password."""
    cl = LocalRedisCluster(tmp_path_factory.mktemp("cluster"), masters=3).start()
    try:
        facts = _fill(connect(cl.url, wait_s=10))
        for n in cl.nodes:
            n.client().config_set("requirepass", PASSWORD)
        yield cl, facts
    finally:
        cl.kill()


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Iterator[EmbeddedRedis]:
    """One Redis with the same jobs (the reference rendering)."""
    srv = EmbeddedRedis(tmp_path_factory.mktemp("single"), port=free_port()).start()
    try:
        _fill(srv.client())
        srv.client().config_set("requirepass", PASSWORD)
        yield srv
    finally:
        srv.stop()


def _nodes(cl: LocalRedisCluster) -> list[str]:
    return [f"127.0.0.1:{n.port}" for n in cl.nodes]


def _render(docroot: Path, env: dict[str, str], paths: list[str]) -> list[str]:
    php = PhpServer(docroot, {"BDL_REDIS_URL": "", "BDL_REDIS_PASSWORD_FILE": "", "BDL_ADMIN_CONFIG": "", **env})
    try:
        pages = []
        for p in paths:
            status, html = php.get(p)
            assert status == 200
            pages.append(html)
        return pages
    finally:
        php.stop()


def _clean(html: str) -> None:
    assert "unavailable" not in html, html[-800:]
    for php_noise in ("Warning", "Notice", "Fatal", "Deprecated"):
        assert php_noise not in html, html[-800:]


def _comparable(html: str) -> dict[str, object]:
    """Every table of the page (time columns and the meta's created_at left out) and the
    learning curve."""
    tables = parse(html).tables
    out: dict[str, object] = {"svg": html[html.find('<svg id="bdl-curve"'):html.find("</svg>")]}
    for tid, rows in tables.items():
        col = TIME_COLUMNS.get(tid)
        rows = [[c for i, c in enumerate(row) if i != col] for row in rows]
        if tid == "bdl-meta":
            rows = [row for row in rows if row[:1] != ["created_at"]]
        out[tid] = rows
    return out


def _job_paths() -> list[str]:
    return ["/boincdl.php"] + ["/boincdl.php?job=" + urllib.parse.quote(j, safe="") for j in JOBS]


def _project(tmp_path: Path) -> Path:
    """A BOINC project folder with the page in html/ops/; returns the project root."""
    project = tmp_path / "project"
    shutil.copytree(HTML, project / "html" / "ops")
    return project


@pytest.fixture()
def ops_dir(tmp_path: Path) -> Path:
    d = tmp_path / "standalone" / "ops"
    shutil.copytree(HTML, d)
    return d


# ---- the page on a cluster --------------------------------------------------------------
def test_cluster_page_shows_what_a_single_redis_shows(cluster, single, ops_dir: Path) -> None:
    cl, facts = cluster
    url = f"redis+cluster://:{PW}@{','.join(_nodes(cl))}/"
    on_cluster = _render(ops_dir, {"BDL_REDIS_URL": url}, _job_paths())
    on_single = _render(ops_dir, {"BDL_REDIS_URL": f"redis://:{PW}@127.0.0.1:{single.port}/0"}, _job_paths())
    for c, s in zip(on_cluster, on_single, strict=True):
        _clean(c)
        _clean(s)
        assert _comparable(c) == _comparable(s)

    # and what it shows is the data: both jobs, epochs, unit states, versions, rejections
    t = parse(on_cluster[0])
    jobs = {row[0]: row for row in t.tables["bdl-jobs"][1:]}
    assert set(jobs) == set(JOBS)
    assert jobs["digits-vcasgd"][1:10] == ["vcasgd", "running", "3 / 5", "2", "10", "1", "2 / 0", "2", "0.86"]
    assert jobs["cifar-mop"][1:7] == ["mop", "running", "0 / 10", "2", "0", "0"]
    t = parse(on_cluster[1])
    assert t.tables["bdl-units"][1] == ["1", "1", "10", "1", "2", "0", "0", "0", "0", "2", "0"]
    epochs = {row[0]: row for row in t.tables["bdl-epochs"][1:]}
    assert list(epochs) == ["4", "3", "2", "1"]
    assert epochs["1"][1:8] == ["4", "4", "0", "0", "0.61", "1.2", "0.55 ± 0.06"]
    assert epochs["2"][1:5] == ["4", "3", "1", "0"]
    meta = dict(row for row in t.tables["bdl-meta"] if len(row) == 2)
    assert meta["weights of model 0"] == f"version {facts['version']}, stored as 1 Redis shard"
    rej = t.tables["bdl-rejections"][1:]
    assert [row[2] for row in rej] == ["res_e1s2_r0", "res_e2s3_r1"]
    assert rej[1][3] == EVIL_REASON and "<img src=x" not in on_cluster[1]
    assert t.tables["bdl-cost"][1] == list(COST.values())
    meta = dict(row for row in parse(on_cluster[2]).tables["bdl-meta"] if len(row) == 2)
    assert meta["mode"] == "mop" and meta["weights of model 1"] == "version 0, stored as 1 Redis shard"
    assert "<script>alert" not in on_cluster[3]


def test_cluster_url_from_every_settings_source(cluster, single, tmp_path: Path) -> None:
    """boinc-dl.yaml with the comma-separated form, boincdl.ini with one seed node and the
    password beside it, BDL_REDIS_PASSWORD_FILE with a URL that has none."""
    cl, _ = cluster
    nodes = _nodes(cl)
    project = _project(tmp_path)
    ops = project / "html" / "ops"
    path = "/boincdl.php?job=digits-vcasgd"
    [want] = _render(ops, {"BDL_REDIS_URL": f"redis://:{PW}@127.0.0.1:{single.port}/0"}, [path])
    pw_file = tmp_path / "redis_password"
    pw_file.write_text(PASSWORD + "\n")

    yaml_url = ",".join([f"redis://:{PW}@{nodes[0]}", *(f"redis://{n}" for n in nodes[1:])])
    (project / "boinc-dl.yaml").write_text(f"redis_url: '{yaml_url}'\n")
    [from_yaml] = _render(ops, {}, [path])
    (project / "boinc-dl.yaml").unlink()
    (project / "boincdl.ini").write_text(f'redis_url = "redis+cluster://{nodes[2]}"\nredis_password = "{PASSWORD}"\n')
    [from_ini] = _render(ops, {}, [path])
    [from_env] = _render(ops, {"BDL_REDIS_URL": ",".join(f"redis://{n}/0" for n in nodes),
                               "BDL_REDIS_PASSWORD_FILE": str(pw_file)}, [path])
    for html in (from_yaml, from_ini, from_env):
        _clean(html)
        assert _comparable(html) == _comparable(want)


def test_cluster_problems_give_the_page_error(cluster, single, ops_dir: Path) -> None:
    cl, _ = cluster
    down = f"127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    for url, expect in (
        (f"redis+cluster://{down}/", "no node of the Redis Cluster answered"),
        (",".join(f"redis://{n}" for n in down.split(",")), "cannot connect to Redis at tcp://127.0.0.1:"),
        (f"redis+cluster://:wrong@{_nodes(cl)[0]}/", "WRONGPASS"),
        # a node that is no cluster member
        (f"redis://:{PW}@127.0.0.1:{single.port},redis://127.0.0.1:{free_port()}", "cluster support disabled"),
        ("redis+cluster:///", "no Redis Cluster nodes"),
        ("redis+cluster://:s3cret@127.0.0.1:99999/", "bad Redis Cluster node #1"),
        ("redis+cluster://:s3cret@127.0.0.1:1,bad host:2/", "bad Redis Cluster node #2"),
        ("redis+cluster://:s3cret@127.0.0.1:1,127.0.0.1:x/", "bad Redis Cluster node #2"),
        ("redis://127.0.0.1:1,http://127.0.0.1:2", "bad Redis Cluster node #2"),
    ):
        [html] = _render(ops_dir, {"BDL_REDIS_URL": url}, ["/boincdl.php"])
        assert "boinc-dl state unavailable" in html and expect in html, (url, html[-800:])
        assert "s3cret" not in html  # the URL's password is never echoed
        for php_noise in ("Warning", "Notice", "Fatal", "Deprecated"):
            assert php_noise not in html, html[-800:]


# ---- a resharding under way: ASK, then MOVED ----------------------------------------------
DRIVER = r"""<?php
require $argv[1];
$r = new BdlRedisCluster($argv[2]);
echo "ready\n";
while (($job = fgets(STDIN)) !== false) {
    try {
        $j = bdl_load_job($r, rtrim($job, "\n"));
        $out = array('mode' => $j['meta']['mode'], 'versions' => (object)$j['versions'], 'states' => $j['states'],
                     'epochs' => $j['epochs'], 'counters' => $j['counters'], 'rejections' => count($j['rejections']));
    } catch (BdlRedisError $e) {
        $out = array('error' => $e->getMessage());
    }
    echo json_encode($out), "\n";
}
"""


def _node_id(c: redis.Redis) -> str:
    return c.execute_command("CLUSTER", "MYID").decode()


def test_resharding_ask_then_moved_followed(cluster, tmp_path: Path) -> None:
    """The page's client keeps the slot map it read at connect; the job's slot then
    migrates to another master: first half-way (keys answered with ASK), then for good
    (MOVED). Every read still finds the job, each node over one connection."""
    cl, _ = cluster
    job = "reshard-me"
    r = redis.RedisCluster(host="127.0.0.1", port=cl.nodes[0].port, password=PASSWORD)
    store = JobStore(r, job)
    fp = fingerprint_of(["w"], [np.zeros(8, np.float32)])
    store.create("{}", "vcasgd", {"0": fp}, {"epochs": 2})
    store.init_weights("0", np.zeros(8, np.float32))
    for s in range(3):
        store.register_unit(f"u{s}", {"epoch": 1, "shard": s, "model": "0"}, 1)
    for s in range(2):
        store.merge("0", f"u{s}", lambda w: w + 1.0, {"epoch": 1}, 1)
    store.finish_epoch(1, {"val_acc": 0.5, "val_loss": 1.0})
    store.register_unit("u9", {"epoch": 2, "shard": 0, "model": "0"}, 2)
    store.record_rejection("u2", "res_u2", "bad")

    slot = key_slot(store.k("meta").encode())
    clients = {n.port: redis.Redis(port=n.port, password=PASSWORD) for n in cl.nodes}
    [src_port] = [p for p, c in clients.items() if c.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot)]
    dst_port = next(p for p in clients if p != src_port)
    src, dst = clients[src_port], clients[dst_port]

    driver = tmp_path / "driver.php"
    driver.write_text(DRIVER)
    url = f"redis+cluster://:{PW}@" + ",".join(_nodes(cl))
    proc = subprocess.Popen([PHP, str(driver), str(LIB), url], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n", proc.stderr.read()

        def load() -> dict[str, object]:
            proc.stdin.write(job + "\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
            return json.loads(line)

        before = load()
        assert "error" not in before, before
        assert before["mode"] == "vcasgd" and before["versions"] == {"0": 2} and before["rejections"] == 1
        assert sorted(before["epochs"]) == ["1", "2"] and before["states"]["assimilated"] == 2

        # half-way: the meta hash alone is on the new master (the old one answers ASK)
        dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", _node_id(src))
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", _node_id(dst))
        src.execute_command("MIGRATE", "127.0.0.1", dst_port, "", 0, 5000, "AUTH", PASSWORD, "KEYS", store.k("meta"))
        asking = dst.info("commandstats").get("cmdstat_asking", {}).get("calls", 0)
        assert load() == before
        assert dst.info("commandstats")["cmdstat_asking"]["calls"] > asking

        # for good: every key moved, every master told (the old one answers MOVED)
        keys = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
        src.execute_command("MIGRATE", "127.0.0.1", dst_port, "", 0, 5000, "AUTH", PASSWORD, "KEYS", *keys)
        for c in clients.values():
            c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", _node_id(dst))
        assert src.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 0
        assert load() == before
        assert load() == before  # the MOVED learnt is kept
        # one connection per node, whatever the redirections
        php = psutil.Process(proc.pid)
        conns = getattr(php, "net_connections", php.connections)(kind="tcp")
        per_node = Counter(c.raddr.port for c in conns if c.raddr and c.status == psutil.CONN_ESTABLISHED)
        assert per_node[src_port] == per_node[dst_port] == 1 and set(per_node.values()) == {1}, per_node
    finally:
        proc.stdin.close()
        proc.wait(10)
    assert proc.returncode == 0, proc.stderr.read()
    assert "Warning" not in proc.stderr.read()


# ---- a hostile or broken node ---------------------------------------------------------------
class FakeNode(socketserver.ThreadingTCPServer):
    """A RESP2 server on loopback: CLUSTER SLOTS from ``slots``, any other command
    answered by ``answer`` (raw RESP)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, slots: Callable[[int], bytes], answer: Callable[[int], bytes]):
        self.slots, self.answer = slots, answer
        self.commands: list[list[bytes]] = []
        super().__init__(("127.0.0.1", 0), _FakeHandler)
        self.port = self.server_address[1]
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.shutdown()
        self.server_close()


class _FakeHandler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        srv: FakeNode = self.server  # type: ignore[assignment]
        while True:
            head = self.rfile.readline()
            if not head.startswith(b"*"):
                return
            args = []
            for _ in range(int(head[1:])):
                n = int(self.rfile.readline()[1:])
                args.append(self.rfile.read(n + 2)[:-2])
            srv.commands.append(args)
            if [a.upper() for a in args[:2]] == [b"CLUSTER", b"SLOTS"]:
                self.wfile.write(srv.slots(srv.port))
            else:
                self.wfile.write(srv.answer(srv.port))


def _slots_reply(host: bytes, port: int) -> bytes:
    return b"*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n$%d\r\n%s\r\n:%d\r\n" % (len(host), host, port)


@pytest.mark.parametrize(("slots", "answer", "expect"), [
    # a node that redirects to itself forever: a bounded number of hops
    (lambda p: _slots_reply(b"127.0.0.1", p), lambda p: b"-MOVED 12 127.0.0.1:%d\r\n" % p,
     "still redirected after 5 redirections"),
    (lambda p: _slots_reply(b"127.0.0.1", p), lambda p: b"-ASK 12 :%d\r\n" % p,
     "still redirected after 5 redirections"),
    # redirections to something other than host:port
    (lambda p: _slots_reply(b"127.0.0.1", p), lambda p: b"-MOVED 12 evil.example/x:80\r\n",
     "redirected to an invalid address: evil.example/x:80"),
    (lambda p: _slots_reply(b"127.0.0.1", p), lambda p: b"-ASK 12 unix:///tmp/redis.sock:0\r\n",
     "redirected to an invalid address"),
    (lambda p: _slots_reply(b"127.0.0.1", p), lambda p: b"-MOVED 99999 127.0.0.1:%d\r\n" % p,
     "redirected to an invalid address"),
    # a valid address that the cluster does not list: never contacted
    (lambda p: _slots_reply(b"127.0.0.1", p), lambda p: b"-MOVED 12 127.0.0.2:6379\r\n",
     "redirected to 127.0.0.2:6379, a node the cluster does not list"),
    # a slot map naming something other than a host
    (lambda p: _slots_reply(b"http://evil/", p), lambda p: b"+OK\r\n", "lists a node with an invalid address"),
    (lambda p: b"*1\r\n*3\r\n:5\r\n:3\r\n*2\r\n$9\r\n127.0.0.1\r\n:1\r\n", lambda p: b"+OK\r\n",
     "malformed CLUSTER SLOTS reply"),
    (lambda p: b"*0\r\n", lambda p: b"+OK\r\n", "serves no slots"),
    # a reply of the wrong shape
    (lambda p: _slots_reply(b"127.0.0.1", p), lambda p: b"*1\r\n$3\r\njob\r\n", "malformed HGETALL reply"),
])
def test_hostile_cluster_replies_give_the_page_error(slots, answer, expect, ops_dir: Path) -> None:
    node = FakeNode(slots, answer)
    try:
        [html] = _render(ops_dir, {"BDL_REDIS_URL": f"redis+cluster://127.0.0.1:{node.port}"}, ["/boincdl.php"])
    finally:
        node.close()
    assert "boinc-dl state unavailable" in html and expect in html, html[-800:]
    for php_noise in ("Warning", "Notice", "Fatal", "Deprecated", "Uncaught"):
        assert php_noise not in html, html[-800:]
    assert len(node.commands) <= 1 + 2 * 6  # CLUSTER SLOTS, then at most 5 redirections (ASKING + command)


# ---- the same slots and URLs as the daemons ----------------------------------------------------
def _php(code: str, data: object) -> object:
    res = subprocess.run([PHP, "-r", f"require {json.dumps(str(LIB))}; $in = json_decode(stream_get_contents(STDIN), true); {code}"],
                         input=json.dumps(data), capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and not res.stderr, res.stderr
    return json.loads(res.stdout)


def test_key_slots_match_redis() -> None:
    rng = np.random.default_rng(7)
    keys = [b"123456789", b"", b"bdl:jobs", b"bdl:{digits-vcasgd}:meta", b"bdl:{a}:epoch:3", b"{}", b"a{}b",
            b"{a}{b}", b"a{b", b"}{x}", b"{{x}}", b"x{}{y}", "bdl:{jöb ü}:v:0".encode(), b"bdl:d:s:{d/0/3}:w",
            EVIL_JOB.encode(), *(rng.integers(0, 256, int(rng.integers(1, 40)), dtype=np.uint8).tobytes()
                                  for _ in range(300))]
    got = _php("echo json_encode(array_map(function ($h) { return bdl_key_slot(hex2bin($h)); }, $in));",
               [k.hex() for k in keys])
    assert got == [key_slot(k) for k in keys]
    assert key_slot(b"123456789") == 12739  # CRC16/XMODEM's check value 0x31C3, mod 16384


def test_cluster_urls_read_as_the_daemons_read_them() -> None:
    urls = [
        "redis+cluster://h1:7000,h2:7001/",
        "redis+cluster://:p%40ss%3Aw@10.0.0.1:7000,10.0.0.2/",
        "redis+cluster://user:pw@h1:7000",
        "redis+cluster://pw@h1:7000",
        "redis+cluster://[::1]:7000,h_2.example.org:7001",
        "redis://a:1,redis://:secret@b:2/0, redis://c",
        "redis://:x@a:1,redis://:y@b:2",
    ]
    got = _php("$o = array(); foreach ($in as $u) { $n = bdl_cluster_nodes($u); $o[] = array($n['nodes'], $n['password']); }"
               " echo json_encode($o);", urls)
    want = [[[list(n) for n in nodes], pw] for nodes, pw in map(cluster_nodes, urls)]
    assert got == want
    is_cluster = _php("echo json_encode(array_map('bdl_is_cluster_url', $in));",
                      [*urls, "redis://h:1/0", "unix:///tmp/s?db=0", "rediss://a:1,b:2"])
    assert is_cluster == [True] * len(urls) + [False, False, False]
