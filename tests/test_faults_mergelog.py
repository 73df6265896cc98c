"""Durable merges under SIGKILL: of the assimilator, of Redis, and of both, at every step
of a merge; and Redis killed twice under four merging processes.

Exactly once across recovery: every acknowledged merge is there after the restart,
none is applied twice, and the weights are the very bytes that sequential merges of the
same result files give (a replay runs the same float ops in the same order).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from boinc_dl.server.assimilator.connection import connect
from boinc_dl.server.assimilator.core import merge_into
from boinc_dl.server.assimilator.redis_server import EmbeddedRedis
from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.common.weights import WeightsFile, write_weights
from tests.support.audit import audit_job
from tests.support.chaos import kill_redis_checking, merge_while_killing
from tests.support.procs import mp_context, process
from tests.test_merge_log import ALPHA, FP, SHARD_BYTES, N, merge_file, new_job, result_file

STEPS = ["retained", "intent", "shard:1", "shard:2", "shard:3", "shard:4", "finalized"]


def _expected(seeds: list[int]) -> bytes:
    """The weights after merging the results of ``seeds`` in order, shard by shard."""
    w = np.linspace(-1, 1, N, dtype=np.float32)
    for s in seeds:
        wc = np.random.default_rng(s).standard_normal(N).astype(np.float32)
        for k in range(4):
            sl = slice(N * k // 4, N * (k + 1) // 4)
            merge_into(w[sl], wc[sl], ALPHA)
    return w.tobytes()


def _victim_merge(url: str, path: str, unit: str, step: str, victim: str, redis_pid: int, marker: str) -> None:
    """An assimilator merging ``unit`` that, at ``step``, SIGKILLs Redis, itself, or both."""
    def hit(name: str) -> None:
        if name != step:
            return
        Path(marker).write_text(name)
        if victim in ("redis", "both"):
            os.kill(redis_pid, signal.SIGKILL)
        if victim in ("assimilator", "both"):
            os.kill(os.getpid(), signal.SIGKILL)

    store = JobStore(connect(url, wait_s=60), "lj", retry_s=60,
                     on_shard_applied=lambda n: hit(f"shard:{n}"), on_merge_step=hit)
    Path(marker + ".status").write_text(merge_file(store, Path(path), unit))


@pytest.mark.parametrize("victim", ["assimilator", "redis", "both"])
@pytest.mark.parametrize("step", STEPS)
def test_sigkill_at_every_step_of_a_merge(tmp_path: Path, monkeypatch, step: str, victim: str) -> None:
    monkeypatch.setenv("BDL_SHARD_BYTES", SHARD_BYTES)
    monkeypatch.setenv("BDL_SNAPSHOT_EVERY", "100000")
    srv = EmbeddedRedis(tmp_path / "redis").start()
    try:
        store = new_job(srv.url, tmp_path / "job", units=4)
        for i in range(3):
            assert merge_file(store, result_file(tmp_path / "r", "lj", f"u{i}", i), f"u{i}") == "merged"
        path = result_file(tmp_path / "r", "lj", "u3", 3)
        marker = str(tmp_path / "hit")
        child = process(_victim_merge, srv.url, str(path), "u3", step, victim, srv.pid, marker)
        child.start()
        deadline = time.monotonic() + 60
        while not Path(marker).exists() and child.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert Path(marker).exists(), "the merge never reached the step"
        if victim in ("redis", "both"):
            while srv.alive() and time.monotonic() < deadline:
                time.sleep(0.01)
            srv.restart()
        child.join(60)
        if victim == "redis":
            # The assimilator rode through the restart (rebuilding the lost shards first).
            assert child.exitcode == 0 and Path(marker + ".status").read_text() == "merged"
        else:
            assert child.exitcode == -signal.SIGKILL
            # The job system never got the acknowledgement: it delivers the result again.
            again = merge_file(JobStore(connect(srv.url, wait_s=10), "lj"), path, "u3")
            assert again == ("duplicate" if step == "finalized" else "merged")
        fresh = JobStore(connect(srv.url), "lj")
        assert fresh.snapshot("0").flat.tobytes() == _expected([0, 1, 2, 3])
        assert fresh.snapshot("0").shard_versions == [4] * 4 and fresh.version("0") == 4
        audit = audit_job(fresh, n_subsets=1000)
        assert audit.ok and audit.merges == 4, audit.problems
        # The log is whole: one more crash of Redis loses nothing either.
        srv.kill()
        srv.restart()
        assert JobStore(connect(srv.url), "lj").snapshot("0").flat.tobytes() == _expected([0, 1, 2, 3])
    finally:
        srv.kill()


def _ack_merger(url: str, units: list[str], files: str, acks: mp.Queue) -> None:
    store = JobStore(connect(url, wait_s=60), "lj", retry_s=60)
    for u in units:
        if merge_file(store, Path(files) / f"{u}.h5", u) == "merged":
            acks.put(u)  # acknowledged: it must survive any Redis crash from now on


def test_no_acknowledged_logged_merge_lost_when_redis_is_killed_twice(tmp_path: Path, monkeypatch) -> None:
    """4 processes merge 120 results while Redis is SIGKILLed twice: every acknowledged
    merge is there after each restart, none twice, and every shard holds exactly 120
    merges (all results are the constant 1, so the order of merges does not matter)."""
    monkeypatch.setenv("BDL_SHARD_BYTES", SHARD_BYTES)
    monkeypatch.setenv("BDL_SNAPSHOT_EVERY", "50")  # snapshots (and truncation) in between
    srv = EmbeddedRedis(tmp_path / "redis").start()
    try:
        n = 120
        store = new_job(srv.url, tmp_path / "job", units=n)
        files = tmp_path / "r"
        files.mkdir()
        for i in range(n):
            write_weights(files / f"u{i}.h5", WeightsFile(np.ones(N, np.float32), FP, job="lj", model="0", unit=f"u{i}"))
        ctx = mp_context()
        acks: mp.Queue = ctx.Queue()
        procs = [process(_ack_merger, srv.url, [f"u{i}" for i in range(k, n, 4)], str(files), acks)
                 for k in range(4)]
        acked = merge_while_killing(procs, acks, kill_redis_checking(srv, "lj", 0.2), every=35,
                                    deadline_s=180, join_s=60)
        store = JobStore(connect(srv.url), "lj")
        assert acked == set(store.assimilated()) and len(acked) == n
        w = np.linspace(-1, 1, N, dtype=np.float32)
        for _ in range(n):
            merge_into(w, np.ones(N, np.float32), ALPHA)
        snap = store.snapshot("0")
        assert snap.shard_versions == [n] * 4
        assert snap.flat.tobytes() == w.tobytes()
        assert audit_job(store, n_subsets=1000).ok
    finally:
        srv.kill()
