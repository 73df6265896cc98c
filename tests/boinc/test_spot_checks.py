"""The work generator's spot checks for the loss check (``server/backends/boinc/spotcheck.py``):
which units get a quorum of 2, recorded once per unit, through the BOINC job system and
the fake project's ``create_work`` with its database in MariaDB."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

from boinc_dl.server.assimilator import losscheck as lc
from boinc_dl.server.assimilator.connection import connect
from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.backends.base import RetryLimits
from boinc_dl.server.backends.boinc.install import InstallOptions, install
from boinc_dl.server.backends.boinc.jobsystem import BoincJobSystem
from boinc_dl.server.backends.boinc.project import BoincSettings
from boinc_dl.server.backends.boinc.spotcheck import spot_checks, wanted
from boinc_dl.server.run.status import job_status
from tests.boinc.fake_server import _exec, rows
from tests.boinc.test_backend import make_inputs
from tests.conftest import tiny_fingerprint, tiny_spec

LIMITS = RetryLimits(delay_bound_s=90.0, max_error_results=3, max_total_results=6)


@pytest.mark.parametrize(("trusted", "open_checks", "stale", "seen", "every", "why"), [
    (0, 0, 0, 0, 20, "bootstrap"),      # nothing trusted: replicate
    (10, 5, 0, 0, 20, "bootstrap"),     # 15 of 16 on the way
    (10, 6, 0, 0, 20, None),            # enough on the way: wait for them
    (16, 0, 19, 0, 20, None),           # 19 stale verdicts since the last: not yet
    (16, 0, 40, 20, 20, "stale"),       # 20 more
    (32, 0, 40, 20, 0, None),           # turned off
    (0, 0, 99, 0, 0, None),             # turned off, bootstrap too
])
def test_the_rule(trusted, open_checks, stale, seen, every, why) -> None:
    assert wanted(trusted, open_checks, stale, seen, min_trusted=16, every=every) == why


def _job(redis_url: str, project, name: str, **validation) -> tuple[JobStore, object]:
    spec = tiny_spec(name, units={"timeout_s": 90, "max_error_results": 3, "max_total_results": 6},
                     validation={"loss_check_min_trusted": 3, "loss_check_spot_every": 4, **validation})
    store = JobStore(connect(redis_url), spec.name)
    store.create(spec.model_dump_json(), "vcasgd", {"0": tiny_fingerprint()},
                 {"job_dir": str(project.job_dir(spec.name))})
    store.init_weights("0", np.zeros(tiny_fingerprint().n_params, np.float32))
    store.set_meta(backend="boinc", boinc_project=str(project.root))
    return store, spec


def _hosts(project, n: int) -> None:
    for _ in range(n):
        _exec(project, "INSERT INTO host (create_time, rpc_time, p_ncpus, p_fpops) VALUES (0, %s, 2, 3e9)",
              (int(time.time()),))


def _quorums(project, job: str) -> dict[str, int]:
    """min_quorum of the job's workunits (target_nresults always the same)."""
    got = rows(project, "SELECT name, min_quorum, target_nresults FROM workunit WHERE name LIKE %s", (f"{job}__%",))
    assert all(w["target_nresults"] == w["min_quorum"] for w in got), got
    return {w["name"]: int(w["min_quorum"]) for w in got}


def _submit(be: BoincJobSystem, project, spec, shards: range) -> list[str]:
    units = [f"{spec.name}__m0_e0001_s{i:04d}" for i in shards]
    for wu in make_inputs(project, spec.name, units):
        be.submit(wu, LIMITS)
    be.flush()
    return units


def _settle(store: JobStore, units: list[str], trusted: bool = True) -> None:
    """The units came back merged; trusted ones add their loss change to the reference."""
    for u in units:
        store.register_unit(u, {"epoch": 1, "shard": int(u[-4:]), "model": "0"}, 1)
        store.r.hset(store.k("unit_state"), u, "assimilated")
        if trusted:
            store.push_trusted_value("0", lc.STAT, 1, -0.01, lc.WINDOW, base_loss=2.0)


def _stale(store: JobStore, n: int) -> None:
    """``n`` verdicts judged against trusted changes from worse models."""
    for _ in range(n):
        store.set_loss_verdict(f"rid{np.random.randint(1 << 40)}", {"ok": True}, 60, stale_model="0")


@pytest.fixture
def spot(db_project, redis_server):
    install(db_project.root, InstallOptions(gpu=False, checks=False))
    _hosts(db_project, 2)
    return db_project, redis_server.url


def test_bootstrap_then_one_per_stale_stretch(spot) -> None:
    project, url = spot
    store, spec = _job(url, project, "spotjob")
    be = BoincJobSystem(project, store.r, batch_size=50)
    first = _submit(be, project, spec, range(5))
    q = _quorums(project, spec.name)
    # the first 3 (loss_check_min_trusted) replicated on two hosts, the rest as the project says
    assert [q[u] for u in first] == [2, 2, 2, 1, 1]
    assert {u: c["why"] for u, c in spot_checks(store).items()} == dict.fromkeys(first[:3], "bootstrap")
    # the replicas end without a trusted measurement (they disagreed, or the checker's
    # daemon died measuring one): bootstrap goes on
    _settle(store, first[:3], trusted=False)
    got = _submit(be, project, spec, range(5, 7))
    assert [_quorums(project, spec.name)[u] for u in got] == [2, 2]
    _settle(store, [f"{spec.name}__m0_e0001_s{i:04d}" for i in (5, 6, 99)])  # 3 trusted now
    got = _submit(be, project, spec, range(7, 8))
    assert _quorums(project, spec.name)[got[0]] == 1
    # stale verdicts: one spot check per 4 of them, whatever the order of submissions
    _stale(store, 3)
    got = _submit(be, project, spec, range(8, 9))
    assert _quorums(project, spec.name)[got[0]] == 1
    _stale(store, 1)
    got = _submit(be, project, spec, range(9, 12))
    assert [_quorums(project, spec.name)[u] for u in got] == [2, 1, 1]
    assert spot_checks(store)[got[0]]["why"] == "stale" and spot_checks(store)[got[0]]["stale"] == 4
    _stale(store, 9)  # 9 more: one spot check (the count restarts from the one used)
    got = _submit(be, project, spec, range(12, 15))
    assert [_quorums(project, spec.name)[u] for u in got] == [2, 1, 1]
    # `boinc install` made sure the replicas go to different hosts
    cfg = (project.root / "config.xml").read_text()
    assert "<one_result_per_host_per_wu>1</one_result_per_host_per_wu>" in cfg
    # what the admin reads (the command as run)
    cmd = [sys.executable, "-m", "boinc_dl.server.cli", "status", spec.name, "--redis-url", url]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=project.root).stdout
    assert "spot checks" in out and "7 unit(s) replicated for the loss check: 5 until enough trusted results, 2 " \
        "after results judged against worse models" in " ".join(out.replace("│", " ").split())
    assert job_status(store)["spot_checks"] == {"bootstrap": 5, "stale": 2}
    assert "not active yet" not in out  # 3 trusted measured of the 3 it needs


def test_status_says_when_the_check_is_not_active_yet(spot) -> None:
    project, url = spot
    store, spec = _job(url, project, "spotidle")
    _settle(store, [f"{spec.name}__m0_e0001_s0099"])
    cmd = [sys.executable, "-m", "boinc_dl.server.cli", "status", spec.name, "--redis-url", url]
    out = " ".join(subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                                  cwd=project.root).stdout.replace("│", " ").split())
    assert "loss check not active yet: 1 of 3 trusted (replicated) results measured" in out
    assert job_status(store)["loss_check"] == {"trusted": 1, "needed": 3}


def test_a_restart_makes_the_same_decision(spot) -> None:
    """The decision is recorded before the workunit exists: a work generator killed in
    between decides the same for that unit, and counts one stale stretch once."""
    project, url = spot
    store, spec = _job(url, project, "spotrestart", loss_check_min_trusted=1)
    _settle(store, ["spotrestart__m0_e0001_s0099"])
    _stale(store, 4)
    be = BoincJobSystem(project, store.r, batch_size=50)
    unit = f"{spec.name}__m0_e0001_s0000"
    be.submit(make_inputs(project, spec.name, [unit])[0], LIMITS)  # decided, never created
    assert be.pending() == [unit] and spot_checks(store)[unit]["why"] == "stale"
    del be
    _stale(store, 3)  # 7 in all: 3 since the one used
    be2 = BoincJobSystem(project, store.r, batch_size=50)
    got = _submit(be2, project, spec, range(0, 2))
    q = _quorums(project, spec.name)
    assert [q[u] for u in got] == [2, 1]
    assert list(spot_checks(store)) == [unit]
    # a unit decided *not* to be one keeps that decision too (it may exist in BOINC already,
    # created before the kill and never marked), and leaves the stretch to the next unit
    later = f"{spec.name}__m0_e0001_s0002"
    be3 = BoincJobSystem(project, store.r, batch_size=50)
    be3.submit(make_inputs(project, spec.name, [later])[0], LIMITS)  # 3 stale since: decided no
    del be3
    _stale(store, 1)  # a fresh decision would now make it one
    be4 = BoincJobSystem(project, store.r, batch_size=50)
    got = _submit(be4, project, spec, range(2, 4))
    q = _quorums(project, spec.name)
    assert [q[u] for u in got] == [1, 2] and later not in spot_checks(store)


def test_no_spot_check_where_it_cannot_or_need_not_run(spot) -> None:
    project, url = spot
    # a regenerated workunit keeps the project's quorum (a replica no host took must not
    # hold its unit past a second deadline)
    store, spec = _job(url, project, "spotregen")
    be = BoincJobSystem(project, store.r, batch_size=50)
    unit = f"{spec.name}__m0_e0001_s0000"
    be.resubmit_regenerated(unit, make_inputs(project, spec.name, [unit])[0], f"{unit}_r1")
    be.flush()
    assert _quorums(project, spec.name) == {f"{unit}_r1": 1} and spot_checks(store) == {}
    # turned off; MOP-like settings (no loss check); a unit that may run only one result
    for name, kw, limits in (("spotoff", {"loss_check_spot_every": 0}, LIMITS),
                             ("spotnocheck", {"loss_check": False}, LIMITS),
                             ("spotone", {}, RetryLimits(90.0, 1, 1))):
        store, spec = _job(url, project, name, **kw)
        be = BoincJobSystem(project, store.r, batch_size=50)
        unit = f"{spec.name}__m0_e0001_s0000"
        be.submit(make_inputs(project, spec.name, [unit])[0], limits)
        be.flush()
        assert _quorums(project, spec.name) == {unit: 1} and spot_checks(store) == {}, name
    # a project that replicates everything already
    store, spec = _job(url, project, "spotq2")
    be = BoincJobSystem(project, store.r, settings=BoincSettings(min_quorum=3), batch_size=50)
    _submit(be, project, spec, range(1))
    assert set(_quorums(project, spec.name).values()) == {3} and spot_checks(store) == {}


def test_a_lone_host_gets_no_spot_check(db_project, redis_server) -> None:
    install(db_project.root, InstallOptions(gpu=False, checks=False))
    _hosts(db_project, 1)
    store, spec = _job(redis_server.url, db_project, "spotlone")
    be = BoincJobSystem(db_project, store.r, batch_size=50)
    got = _submit(be, db_project, spec, range(2))
    assert [_quorums(db_project, spec.name)[u] for u in got] == [1, 1] and spot_checks(store) == {}
