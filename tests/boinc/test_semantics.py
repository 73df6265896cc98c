"""Real BOINC semantics, played by the fake project on a real MariaDB.

Each test is one behaviour of a real BOINC server that boinc-dl got wrong once:
deadlines run from when a result is *sent*, BOINC sends out of creation order and
times results out, the file deleter removes files of finished (cancelled ones too)
workunits, late calls come about superseded workunits, and ``bin/stop`` returns before
the daemons have exited.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from boinc_dl.server.assimilator.connection import connect
from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.backends.boinc.daemon import finalize_job
from boinc_dl.server.backends.boinc.install import InstallOptions, install
from boinc_dl.server.backends.boinc.jobsystem import BoincJobSystem, _Pending
from boinc_dl.server.backends.boinc.registry import BoincRegistry
from tests.boinc import fake_server
from tests.boinc.conftest import calls, make_result, run_script, script_env, seed_db_app
from tests.boinc.test_backend import LIMITS, make_inputs, units_of


@pytest.fixture
def job(db_project, tiny_boinc_job, redis_server):
    """A VC-ASGD job (re-issue ``fresh``, timeout 90 s) on the MariaDB-backed project."""
    install(db_project.root, InstallOptions(run_db_tools=False, gpu=False, redis_url=redis_server.url,
                                            command=[sys.executable, "-m", "boinc_dl.server.backends.boinc"]))
    seed_db_app(db_project.root)
    store, spec = tiny_boinc_job
    return db_project, store, spec, connect(redis_server.url)


def live_key(store: JobStore) -> str:
    """The ledger of workunits BOINC may still run."""
    return BoincRegistry(store).live_key


def create_units(project, r, spec, n: int) -> tuple[BoincJobSystem, list[str]]:
    be = BoincJobSystem(project, r)
    wus = make_inputs(project, spec.name, units_of(spec, n))
    for wu in wus:
        be.submit(wu, LIMITS)
    be.flush()
    store = JobStore(r, spec.name)
    for wu in wus:
        store.transition_unit(wu.unit, "created", "in_progress")
    return be, [wu.unit for wu in wus]


def age_ledger(r, store: JobStore, seconds: float) -> None:
    """Pretend every workunit was created ``seconds`` ago (a long wait in BOINC's queue)."""
    for unit, raw in r.hgetall(BoincRegistry(store).issued_key).items():
        rec = json.loads(raw)
        r.hset(BoincRegistry(store).issued_key, unit, json.dumps({**rec, "t": rec["t"] - seconds}))


# ---- finding 1: re-issue from send time --------------------------------------------------

def test_queued_workunit_is_never_overdue(job) -> None:
    project, store, spec, r = job
    be, (u,) = create_units(project, r, spec, 1)
    age_ledger(r, store, 10 * LIMITS.delay_bound_s)  # created long ago, never sent
    assert be.regeneration_requests(spec.name) == []
    fake_server.send(project, [u], now=time.time() - 30)  # sent 30 s ago: well within its deadline
    assert be.regeneration_requests(spec.name) == []
    fake_server.send(project, [u])  # (nothing left to send)
    r_id = fake_server.rows(project, "SELECT id FROM result")[0]["id"]
    fake_server._exec(project, "UPDATE result SET sent_time = %s, report_deadline = %s WHERE id = %s",
                      (int(time.time()) - 91, int(time.time()) - 1, r_id))
    assert be.regeneration_requests(spec.name) == [(u, 0)]


def test_out_of_order_sending(job) -> None:
    project, store, spec, r = job
    be, units = create_units(project, r, spec, 3)
    # BOINC sends the last-created unit first; it is lost; the other two wait in the queue
    fake_server.send(project, [units[2]], now=time.time() - be.deadline_s(LIMITS) - 5)
    assert be.regeneration_requests(spec.name) == [(units[2], 0)]


def test_result_back_is_never_regenerated(job) -> None:
    project, store, spec, r = job
    be, (a, b) = create_units(project, r, spec, 2)
    long_ago = time.time() - 3 * LIMITS.delay_bound_s
    ra, rb = fake_server.send(project, [a, b], now=long_ago)
    age_ledger(r, store, 3 * LIMITS.delay_bound_s)
    fake_server.report(project, ra, now=long_ago + 10)  # back, waiting for the validator
    fake_server.report(project, rb, now=long_ago + 20)
    fake_server.validate(project, rb)  # valid, waiting for the assimilator
    assert be.regeneration_requests(spec.name) == []


def test_timed_out_by_boinc_is_regenerated(job) -> None:
    project, store, spec, r = job
    be, (u,) = create_units(project, r, spec, 1)
    fake_server.send(project, [u], now=time.time() - be.deadline_s(LIMITS) - 2)
    assert fake_server.time_out(project) == [f"{u}_0"]  # NO_REPLY, a new unsent instance
    assert be.regeneration_requests(spec.name) == [(u, 0)]


def test_failed_or_cancelled_workunit_is_not_regenerated(job) -> None:
    project, store, spec, r = job
    be, (u,) = create_units(project, r, spec, 1)
    fake_server.send(project, [u], now=time.time() - 200)
    fake_server._exec(project, "UPDATE workunit SET error_mask = 2 WHERE name = %s", (u,))
    assert be.regeneration_requests(spec.name) == []  # the --error call decides


# ---- findings 2 and 3: superseded workunits, strays, exact accounting --------------------

def regenerate(be: BoincJobSystem, project, spec, unit: str, attempt: int, cancel_old: bool = True) -> str:
    name = f"{unit}_r{attempt}"
    (wu,) = make_inputs(project, spec.name, [name], version=attempt)
    wu.unit = unit
    if cancel_old:
        be.resubmit_regenerated(unit, wu, name)
    else:  # a regeneration whose cancel of the old workunit did not get through
        be._queue(_Pending(wu, LIMITS, name))
    be.flush()
    return name


def assimilate(project, argv: str):  # noqa: ANN201
    return run_script(project.root, f"../bin/bdl_assimilate {argv}", script_env())


def test_late_calls_of_superseded_workunit_change_nothing(job) -> None:
    project, store, spec, r = job
    be, (u,) = create_units(project, r, spec, 1)
    (r0,) = fake_server.send(project, [u], now=time.time() - be.deadline_s(LIMITS) - 5)
    assert be.regeneration_requests(spec.name) == [(u, 0)]
    new = regenerate(be, project, spec, u, 1)
    assert fake_server.live_workunits(project) == [new]  # the old one was cancelled
    # the file deleter removes the cancelled workunit's files; then its host reports late
    fake_server.file_deleter(project, {})
    paths = make_result(project.root, r0, spec.name, u, np.ones(15), upload=project)
    for p in paths:
        Path(p).unlink()  # uploaded, then removed by the file deleter
    a = assimilate(project, f"1 {' '.join(paths)}")
    assert a.returncode == 0, a.stderr
    assert "superseded" in a.stderr
    assert store.unit_states_of([u]) == ["in_progress"] and store.failed() == {}
    # a late success of the superseded workunit is not merged either
    paths = make_result(project.root, r0, spec.name, u, np.ones(15), upload=project)
    a = assimilate(project, f"1 {' '.join(paths)}")
    assert a.returncode == 0 and "superseded" in a.stderr
    assert store.version("0") == 0 and store.unit_states_of([u]) == ["in_progress"]
    # nor is its error call (cancelled: mask 16)
    a = assimilate(project, f"--error 16 {u} 1 0")
    assert a.returncode == 0 and store.failed() == {}
    # the current workunit's result merges; the epoch counts it once, nothing failed
    paths = make_result(project.root, f"{new}_0", spec.name, u, np.ones(15), upload=project)
    a = assimilate(project, f"2 {' '.join(paths)}")
    assert a.returncode == 0, a.stderr
    assert store.unit_states_of([u]) == ["assimilated"] and store.version("0") == 1
    counts = store.epoch_counts(1)
    assert counts.get("assimilated") == 1 and not counts.get("failed")
    assert store.counters().get("superseded_calls") == 3


def test_given_up_unit_is_never_merged(job) -> None:
    project, store, spec, r = job
    _, (u,) = create_units(project, r, spec, 1)
    a = assimilate(project, f"--error 2 {u} 1 0")  # too many errors: given up
    assert a.returncode == 0
    assert store.unit_states_of([u]) == ["failed"]
    paths = make_result(project.root, f"{u}_3", spec.name, u, np.ones(15), upload=project)
    a = assimilate(project, f"1 {' '.join(paths)}")  # a late success of the same workunit
    assert a.returncode == 0, a.stderr
    assert not store.is_assimilated(u) and store.version("0") == 0
    assert store.unit_states_of([u]) == ["failed"]


def test_late_success_of_a_cancelled_unit_is_not_merged(job) -> None:
    """BOINC validates and assimilates a cancelled workunit's late success (its result
    was in progress when cancel_jobs ran): the job has ended, nothing changes."""
    project, store, spec, r = job
    be, (u,) = create_units(project, r, spec, 1)
    (res,) = fake_server.send(project, [u])
    store.set_meta(status="cancelled", finished_at=time.time())
    finalize_job(store, be)
    assert store.unit_states_of([u]) == ["cancelled"]
    paths = make_result(project.root, res, spec.name, u, np.ones(15), upload=project)
    a = assimilate(project, f"1 {' '.join(paths)}")
    assert a.returncode == 0, a.stderr
    assert store.unit_states_of([u]) == ["cancelled"] and store.version("0") == 0
    assert not store.is_assimilated(u)


def test_files_deleted_after_merge_do_not_fail_the_unit(job) -> None:
    project, store, spec, r = job
    _, (u,) = create_units(project, r, spec, 1)
    paths = make_result(project.root, f"{u}_0", spec.name, u, np.ones(15), upload=project)
    assert assimilate(project, f"1 {' '.join(paths)}").returncode == 0
    for p in paths:
        Path(p).unlink()
    # BOINC hands the same workunit over again (a crash after the merge), files gone
    assert assimilate(project, f"1 {' '.join(paths)}").returncode == 0
    assert store.unit_states_of([u]) == ["assimilated"] and store.failed() == {}


def test_stray_workunits_are_cancelled(job) -> None:
    project, store, spec, r = job
    be, (u, v) = create_units(project, r, spec, 2)
    u1 = regenerate(be, project, spec, u, 1, cancel_old=False)
    v1 = regenerate(be, project, spec, v, 1, cancel_old=False)
    assert fake_server.live_workunits(project) == [u, v, u1, v1]
    # a pass cancels the superseded workunits at once
    assert be.cancel_stray(spec.name) == 2
    assert fake_server.live_workunits(project) == [u1, v1]
    # v is merged through v1 (BOINC: assimilated); a regenerated u2 races with u1's merge
    fake_server.assimilated(project, v1)
    store.transition_unit(v, "in_progress", "assimilated")
    r.hdel(BoincRegistry(store).live_key, v1)
    u2 = regenerate(be, project, spec, u, 2, cancel_old=False)
    store.transition_unit(u, "in_progress", "assimilated")
    assert be.cancel_stray(spec.name) >= 1
    assert fake_server.live_workunits(project) == []
    assert r.hlen(BoincRegistry(store).live_key) == 0
    assert u2 not in fake_server.live_workunits(project)


def test_job_end_cancels_every_workunit(job) -> None:
    project, store, spec, r = job
    be, (u, v) = create_units(project, r, spec, 2)
    u1 = regenerate(be, project, spec, u, 1, cancel_old=False)
    # u merged through u1 (the old workunit u stayed live); the job ends
    store.transition_unit(u, "in_progress", "assimilated")
    fake_server.assimilated(project, u1)
    store.set_meta(status="done", finished_at=time.time())
    finalize_job(store, be)
    # no host can be sent a workunit whose inputs were removed with the job
    assert fake_server.live_workunits(project) == []
    assert r.hlen(BoincRegistry(store).live_key) == 0


# ---- finding 4: bin/stop returns before the daemons exit ----------------------------------

def daemon_pid(project) -> int | None:
    p = project.pid_dir / "bdl_work_generator.pid"
    try:
        pid = int(p.read_text().split()[0])
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError, IndexError):
        return None


def wait_for(cond, timeout: float = 30.0):  # noqa: ANN001, ANN201
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = cond()
        if v:
            return v
        time.sleep(0.1)
    return cond()


def test_stop_then_start_brings_the_work_generator_back(db_project, redis_server) -> None:
    project = db_project
    install(project.root, InstallOptions(run_db_tools=False, gpu=False, redis_url=redis_server.url,
                                         command=[sys.executable, "-m", "boinc_dl.server.backends.boinc"]))
    env = script_env()
    subprocess.run(["bin/start"], cwd=project.root, env=env, check=True, timeout=30)
    first = wait_for(lambda: daemon_pid(project))
    assert first, (project.log_dir / "bdl_work_generator.log").read_text()
    # loaded and idle in its sleep between passes, as in production
    wait_for(lambda: "started" in (project.log_dir / "bdl_work_generator.log").read_text())
    time.sleep(1.5)
    subprocess.run(["bin/stop"], cwd=project.root, env=env, check=True, timeout=30)
    subprocess.run(["bin/start"], cwd=project.root, env=env, check=True, timeout=30)
    try:
        second = wait_for(lambda: (daemon_pid(project) or 0) not in (0, first) and daemon_pid(project), 10)
        log_text = (project.log_dir / "bdl_work_generator.log").read_text()
        assert second and second != first, f"the work generator did not come back:\n{log_text[-2000:]}"
    finally:
        subprocess.run(["bin/stop"], cwd=project.root, env=env, timeout=30)
        for pid in {first, daemon_pid(project)} - {None}:
            assert wait_for(lambda pid=pid: not _alive(pid), 10), f"daemon {pid} did not exit"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # a zombie of ours is gone for this purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


# ---- latency: report at once, assimilate promptly ------------------------------------------

def test_install_sets_prompt_reporting_and_daemon_intervals(job) -> None:
    import xml.etree.ElementTree as ET

    project, store, spec, r = job
    cmds = [d.findtext("cmd") for d in ET.parse(project.config_xml).getroot().findall("daemons/daemon")]
    assert "transitioner -d 3 --sleep_interval 1" in cmds
    assert "feeder -d 3 --sleep_interval 1" in cmds  # a new unit is sendable within a second
    ours = [c for c in cmds if "boincdl" in c]
    assert ours and all(c.endswith("--sleep_interval 1") for c in ours)
    be, (u,) = create_units(project, r, spec, 1)
    (cw,) = calls(project.root, "create_work")
    template = cw["argv"][cw["argv"].index("--result_template") + 1]
    result = ET.parse(project.root / template).getroot().find("result")
    assert result is not None and result.find("report_immediately") is not None


# ---- task size from measured unit times --------------------------------------------------

def test_fpops_estimate_follows_measured_task_times(job) -> None:
    project, store, spec, r = job
    be, units = create_units(project, r, spec, 4)
    assert be.task_fpops(spec.name) == (be.settings.rsc_fpops_est, be.settings.rsc_fpops_bound)  # no host yet
    # calibration: half the deadline (90 s) on the median active host (3 GFLOPS)
    for speed in (1e9, 3e9, 8e9):
        fake_server._exec(project, "INSERT INTO host (create_time, rpc_time, p_fpops) VALUES (0, %s, %s)",
                          (int(time.time()), speed))
    est, bound = BoincJobSystem(project, r).task_fpops(spec.name)
    assert est == pytest.approx(3e9 * 90 * 0.5) and bound >= est * 20
    for u, elapsed in zip(units, (4.0, 5.0, 6.0, 60.0), strict=True):
        (res,) = fake_server.send(project, [u], flops=2e9)
        fake_server.report(project, res, elapsed_s=elapsed)
    be2 = BoincJobSystem(project, r)
    est, bound = be2.task_fpops(spec.name)
    # the slow end of the measured tasks (here the 60 s one) with a 20% margin, so BOINC's
    # deadline check never lets a host queue more tasks than really fit in the deadline
    assert est == pytest.approx(60.0 * 2e9 * 1.2)
    assert bound >= 60.0 * 2e9 * 4  # never aborts a task as slow as the slowest seen
    args = be2.create_work_args(spec.name, LIMITS, "templates/x", 1e9)
    assert args[args.index("--rsc_fpops_est") + 1] == "1.44e+11"


def test_fpops_estimate_keeps_queued_tasks_within_the_deadline(job) -> None:
    """BOINC's deadline check (sched_check.cpp) admits queued tasks while the sum of their
    *predicted* runtimes fits in delay_bound. With the estimate taken from the measured
    tasks, a 1-CPU host never queues more real work than fits in the deadline."""
    project, store, spec, r = job
    be, units = create_units(project, r, spec, 4)
    timeout = spec.units.timeout_s
    # real runs of 20-38 s (start-up included), measured on the hosts' speed: a median
    # estimate (25 s) would let a 1-CPU host hold three tasks against the 90 s deadline,
    # and the third, queued behind two slow runs, would pass it
    elapsed = [20.0, 22.0, 25.0, 38.0]
    for u, e in zip(units, elapsed, strict=True):
        (res,) = fake_server.send(project, [u], flops=1e9)
        fake_server.report(project, res, elapsed_s=e)
    est, _ = BoincJobSystem(project, r).task_fpops(spec.name)
    predicted = est / 1e9
    admitted = int(timeout // predicted)  # tasks the deadline check lets one CPU hold
    assert admitted >= 1
    assert admitted * max(elapsed) <= timeout  # even the slowest run seen meets its deadline


def test_restart_command_waits_and_checks(db_project, redis_server) -> None:
    """``boinc-dl boinc restart``: stop, wait for the old daemon, start, check its lock."""
    from boinc_dl.server.backends.boinc.restart import lock_held, our_daemons

    project = db_project
    install(project.root, InstallOptions(run_db_tools=False, gpu=False, redis_url=redis_server.url,
                                         command=[sys.executable, "-m", "boinc_dl.server.backends.boinc"]))
    # BOINC's own script_validator/script_assimilator binaries are not here: leave only ours
    text = project.config_xml.read_text().replace("<cmd>script_", "<disabled>1</disabled><cmd>script_")
    project.config_xml.write_text(text)
    env = script_env()
    subprocess.run(["bin/start"], cwd=project.root, env=env, check=True, timeout=30)
    first = wait_for(lambda: daemon_pid(project))
    ((cmd, lock),) = our_daemons(project)
    assert cmd == "bdl_work_generator" and wait_for(lambda: lock_held(lock))
    try:
        p = subprocess.run([sys.executable, "-m", "boinc_dl.server.backends.boinc", "restart", "--project", str(project.root)],
                           env=env, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stdout + p.stderr
        assert "running: bdl_work_generator" in p.stdout
        assert not _alive(first) and daemon_pid(project) not in (None, first)
    finally:
        subprocess.run(["bin/stop"], cwd=project.root, env=env, timeout=30)
        assert wait_for(lambda: not lock_held(lock), 10)


# ---- the read-only database module ---------------------------------------------------------

@pytest.mark.parametrize("host, tls", [("localhost", False), ("127.0.0.1:3307", False),
                                       ("db.example.org", True), ("10.0.0.5:3306", True)])
def test_boincdb_skips_tls_only_on_this_machine(project, host: str, tls: bool) -> None:
    """No TLS context per connection on loopback (PyMySQL would build one each time, with
    the system's CA store); a database across the network keeps PyMySQL's TLS default."""
    from boinc_dl.server.backends.boinc.boincdb import credentials

    text = re.sub(r"<db_host>.*?</db_host>", f"<db_host>{host}</db_host>", project.config_xml.read_text())
    if "<db_host>" not in text:
        text = text.replace("<db_name>", f"<db_host>{host}</db_host>\n    <db_name>", 1)
    project.config_xml.write_text(text)
    project.__dict__.pop("config", None)
    assert ("ssl_disabled" not in credentials(project)) is tls
    project.config_xml.write_text(text.replace("</db_name>", "</db_name>\n    <db_socket>/run/mysqld.sock</db_socket>", 1))
    project.__dict__.pop("config", None)
    assert credentials(project)["ssl_disabled"] is True  # a Unix socket: never TLS


def test_boincdb_is_read_only_and_bounded(db_project) -> None:
    from boinc_dl.server.backends.boinc.boincdb import BoincDB, BoincDBError, credentials

    project = db_project
    now = int(time.time())
    for rpc, ncpus in ((now - 10, 4), (now - 200_000, 8)):
        fake_server._exec(project, "INSERT INTO host (create_time, rpc_time, p_ncpus, p_fpops) VALUES (0, %s, %s, 3e9)",
                          (rpc, ncpus))
    args = credentials(project)
    assert (args["host"], args["port"], args["user"]) == ("127.0.0.1", 3306, "root")
    with BoincDB.connect(project, timeout_s=3) as db:
        assert [h.p_ncpus for h in db.active_hosts()] == [4]
        assert db.query("SELECT id FROM host ORDER BY id", limit=1) == [{"id": 1}]
        assert db.workunits(["nope"]) == {}
        with pytest.raises(BoincDBError, match="SELECT"):
            db.query("DELETE FROM host")
        import pymysql

        with pytest.raises(pymysql.MySQLError, match="READ ONLY"), db.conn.cursor() as c:
            c.execute("UPDATE host SET p_ncpus = 1")  # even past query(): the session is read-only
    text = project.config_xml.read_text().replace("<db_port>3306</db_port>", "<db_port>1</db_port>")
    project.config_xml.write_text(text)
    project.__dict__.pop("config", None)
    with pytest.raises(BoincDBError, match="cannot read BOINC's database"):
        BoincDB.connect(project, timeout_s=2)


def test_stuck_only_with_a_result_back_and_a_replica_unsent_past_the_deadline() -> None:
    from boinc_dl.server.backends.boinc.boincdb import ResultRow, WorkunitState

    now = 10_000.0

    def wu(*results: ResultRow, canonical: int = 0) -> WorkunitState:
        return WorkunitState(1, "w", 0, 0, canonical, 100, list(results))

    back = ResultRow(1, "w_0", 5, 1, 0, 1000, 1100, 1050, 1, create_time=900)
    old_unsent = ResultRow(2, "w_1", 2, 0, 0, 0, 0, 0, 0, create_time=int(now) - 101)
    new_unsent = ResultRow(3, "w_2", 2, 0, 0, 0, 0, 0, 0, create_time=int(now) - 99)
    running = ResultRow(4, "w_3", 4, 0, 0, int(now) - 10, int(now) + 90, 0, 2, create_time=int(now) - 500)
    assert wu(back, old_unsent).stuck(now) and wu(back, old_unsent).overdue(now)
    assert not wu(back, old_unsent, new_unsent).stuck(now)  # the last replica has not waited long
    assert not wu(old_unsent).stuck(now)  # nothing came back: still queued, never overdue
    assert not wu(old_unsent).overdue(now)
    assert not wu(back, old_unsent, running).stuck(now)  # a replica is being computed
    assert not wu(back, old_unsent, canonical=1).stuck(now)  # validated


def test_not_stuck_while_a_host_seen_lately_may_take_the_replica() -> None:
    """Seen on a real server: two jobs on two hosts, a replica created with its workunit
    waited unsent while both hosts ran other work, and by its creation time alone it
    looked stuck 47 s after its sibling came back; the returned result was thrown away."""
    from boinc_dl.server.backends.boinc.boincdb import ResultRow, Takers, WorkunitState

    now = 10_000.0
    back = ResultRow(1, "w_0", 5, 1, 0, 1000, 1100, 1050, 1, create_time=900, userid=11)
    unsent = ResultRow(2, "w_1", 2, 0, 0, 0, 0, 0, 0, create_time=900)
    wu = WorkunitState(1, "w", 0, 0, 0, 100, [back, unsent])
    assert wu.stuck(now)  # by the waits alone (hosts unknown)
    other_user = Takers(((1, 11, int(now) - 5), (2, 22, int(now) - 5)), "users")
    same_user = Takers(((1, 11, int(now) - 5), (2, 11, int(now) - 5)), "users")
    assert not wu.stuck(now, other_user) and not wu.overdue(now, other_user)
    assert wu.stuck(now, same_user) and wu.overdue(now, same_user)  # the account rule: no host may
    assert not wu.stuck(now, Takers(same_user.hosts, "hosts"))  # the host rule: host 2 may
    assert not wu.stuck(now, Takers(((1, 11, int(now) - 5),), None))  # no rule: host 1 may again
    assert wu.stuck(now, Takers(((1, 11, int(now) - 5),), "hosts"))
    gone = Takers(((2, 22, int(now) - 101),), "users")  # last seen before delay_bound
    assert wu.stuck(now, gone)
    # the wait counts from the last result back too, not only from the replica's creation
    late = ResultRow(1, "w_0", 5, 1, 0, 1000, 1100, int(now) - 50, 1, create_time=900, userid=11)
    assert not WorkunitState(1, "w", 0, 0, 0, 100, [late, unsent]).stuck(now)
