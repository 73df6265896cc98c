"""A stuck MOP workunit runs again, through the fake BOINC project and the work generator daemon.

``min_quorum 2`` and two hosts: one replica valid and waiting for its quorum, the other
judged invalid, and the replacement BOINC's transitioner creates can go to neither host
(``one_result_per_host_per_wu``). Seen on a real server, where the job then waited for a
third host with both clients idle. A MOP job has no regeneration, so the daemon cancels
such a workunit once its replacement has waited unsent for longer than ``delay_bound``;
BOINC hands it to the assimilator as failed (``--error``), and the MOP scheduler queues the
sub-epoch again as a new workunit, which the same hosts may take. The daemon is restarted
(its memory lost, as after a SIGKILL) at each point of that sequence: one cancellation,
one new workunit.
"""

from __future__ import annotations

import time

import pytest

from boinc_dl.server.assimilator.connection import connect
from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.backends.boinc.daemon import WorkGeneratorDaemon
from boinc_dl.server.backends.boinc.jobsystem import BoincJobSystem
from boinc_dl.server.backends.boinc.submit import submit_job
from boinc_dl.server.common.workunit import parse_unit_name
from tests.boinc import fake_server
from tests.boinc.conftest import REPO, calls, run_script, script_env
from tests.boinc.test_end_to_end import digits_mop_spec, install_with_wrapper

pytestmark = pytest.mark.slow


def _submitted(project, redis_server, tmp_path, name: str) -> tuple[JobStore, WorkGeneratorDaemon]:
    """boinc-dl installed with ``min_quorum 2`` and a one-epoch MOP job submitted: its
    store and a work generator daemon."""
    install_with_wrapper(project, redis_server.url, tmp_path, min_quorum=2)
    project.__dict__.pop("settings", None)
    spec = digits_mop_spec(name, epochs=1, limit=300, timeout_s=600)
    submit_job(spec, project.root, search_path=REPO / "examples")
    return JobStore(connect(redis_server.url), spec.name), WorkGeneratorDaemon(project, poll_s=0.1)


def _workunits(project) -> dict[str, dict]:
    return {w["name"]: w for w in fake_server.rows(project, "SELECT id, name, error_mask FROM workunit")}


@pytest.mark.parametrize("restart", ["before-cancel", "after-cancel", "after-error"])
def test_a_stuck_mop_workunit_runs_again_as_one_new_workunit(db_project, redis_server, tmp_path,
                                                            restart: str) -> None:
    project = db_project
    store, daemon = _submitted(project, redis_server, tmp_path, "stuck-mop")
    env = script_env()
    daemon.one_pass()
    first = _workunits(project)
    assert len(first) == 2  # one unit per model in flight
    wu = sorted(first)[0]
    # the two replicas go to two hosts; one valid (waiting for its quorum), one invalid
    (a,) = fake_server.send(project, [wu], hostid=1)
    (b,) = fake_server.send(project, [wu], hostid=2)
    for res in (a, b):
        fake_server.report(project, res)
    assert fake_server.judge(project, a, 0)[1] == 1 and fake_server.judge(project, b, 1) == (6, 2)
    for host in (1, 2):  # the replacement can go to neither host
        assert f"{wu}_2" not in fake_server.request_work(project, hostid=host, ncpus=1, n_wanted=4)
    daemon.one_pass()
    assert calls(project.root, "cancel_jobs") == []  # a replica waiting a while is normal
    delay_bound = int(fake_server.rows(project, "SELECT delay_bound FROM workunit WHERE name = %s",
                                       (wu,))[0]["delay_bound"])
    then = int(time.time()) - delay_bound - 5  # the replica and the results back waited that long
    fake_server._exec(project, "UPDATE result SET create_time = %s WHERE name = %s", (then, f"{wu}_2"))
    fake_server._exec(project, "UPDATE result SET received_time = %s WHERE name IN (%s, %s)", (then, a, b))

    if restart == "before-cancel":
        daemon = WorkGeneratorDaemon(project, poll_s=0.1)
    daemon.one_pass()
    assert [c["argv"][-1] for c in calls(project.root, "cancel_jobs")] == [wu]
    assert _workunits(project)[wu]["error_mask"] & 16
    if restart == "after-cancel":
        daemon = WorkGeneratorDaemon(project, poll_s=0.1)
        daemon.one_pass()
    # BOINC's assimilator hands the cancelled workunit over as failed
    p = run_script(project.root, f"../bin/bdl_assimilate --error 16 {wu} {first[wu]['id']} 0", env)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "cancelled as stuck" in store.failed()[wu]  # boinc-dl status says why, not just "cancelled"
    if restart == "after-error":
        daemon = WorkGeneratorDaemon(project, poll_s=0.1)
    for _ in range(3):
        daemon.one_pass()
    new = sorted(set(_workunits(project)) - set(first))
    assert len(new) == 1, new  # the sub-epoch runs again, once
    old, again = parse_unit_name(wu), parse_unit_name(new[0])
    assert (again["model"], again["epoch"], again["shard"]) == (old["model"], old["epoch"], old["shard"])
    assert again["attempt"] > old["attempt"]
    assert [c["argv"][-1] for c in calls(project.root, "cancel_jobs")] == [wu]  # cancelled once, whatever restarted
    assert store.counters()["boinc_stuck"] == 1  # and counted once
    # the new workunit is one the same hosts may take
    assert any(r.startswith(new[0]) for r in fake_server.request_work(project, hostid=1, ncpus=1, n_wanted=4))


class _Killed(BaseException):
    """The daemon's process ends here (as under SIGKILL): nothing after it runs."""


@pytest.mark.parametrize("then", ["error-first", "daemon-first"])
def test_a_cancel_the_daemon_did_not_record_is_counted_once(db_project, redis_server, tmp_path,
                                                            monkeypatch, then: str) -> None:
    """The work generator is killed after ``bin/cancel_jobs`` took a stuck workunit and
    before it recorded that: the workunit stays in the live records. BOINC's ``--error``
    call for it (cancelled bit), or the restarted daemon's sweep of the live records once
    the job has ended, counts it, once, whichever comes first."""
    from boinc_dl.server.backends.boinc.registry import BoincRegistry

    project = db_project
    store, daemon = _submitted(project, redis_server, tmp_path, "cancel-count")
    env = script_env()
    daemon.one_pass()
    first = _workunits(project)
    wu = sorted(first)[0]
    (a,) = fake_server.send(project, [wu], hostid=1)
    (b,) = fake_server.send(project, [wu], hostid=2)
    for res in (a, b):
        fake_server.report(project, res)
    fake_server.judge(project, a, 0)
    fake_server.judge(project, b, 1)
    delay_bound = int(fake_server.rows(project, "SELECT delay_bound FROM workunit WHERE name = %s",
                                       (wu,))[0]["delay_bound"])
    then_t = int(time.time()) - delay_bound - 5
    fake_server._exec(project, "UPDATE result SET create_time = %s WHERE name = %s", (then_t, f"{wu}_2"))
    fake_server._exec(project, "UPDATE result SET received_time = %s WHERE name IN (%s, %s)", (then_t, a, b))

    def killed(self, name):
        raise _Killed

    with monkeypatch.context() as m:
        m.setattr(BoincRegistry, "cancelled", killed)
        with pytest.raises(_Killed):
            daemon.one_pass()
    assert _workunits(project)[wu]["error_mask"] & 16  # BOINC has the cancel
    assert wu in BoincRegistry(store).live()  # the daemon did not record it
    assert store.counters().get("boinc_cancelled", 0) == 0

    daemon = WorkGeneratorDaemon(project, poll_s=0.1)  # restarted: its memory lost

    def error_call() -> None:
        p = run_script(project.root, f"../bin/bdl_assimilate --error 16 {wu} {first[wu]['id']} 0", env)
        assert p.returncode == 0, p.stderr[-2000:]

    if then == "error-first":
        error_call()
        daemon.one_pass()
        BoincJobSystem(project, store.r).cancel_all(store.job)
    else:
        BoincJobSystem(project, store.r).cancel_all(store.job)  # the sweep of a job that ended
        error_call()
        error_call()  # BOINC re-runs an assimilator it saw die
    cancelled = [c["argv"][-1] for c in calls(project.root, "cancel_jobs")]
    assert cancelled.count(wu) == 1  # the restarted daemon did not cancel it again
    # each cancelled workunit counted once: the stuck one, and those the sweep cancelled
    assert store.counters()["boinc_cancelled"] == len(set(cancelled))
    assert store.counters()["boinc_stuck"] == 1
    assert BoincRegistry(store).live() == {}


def test_an_undecided_mop_workunit_is_judged_again_across_a_daemon_restart(db_project, redis_server,
                                                                           tmp_path) -> None:
    """The validator could not judge one of the two replicas (its shim answered 3): the
    set is INCONCLUSIVE and the replica BOINC adds can go to neither host. The daemon asks
    BOINC's validator to judge it again (once, whatever restarts), and nothing is cancelled."""
    project = db_project
    store, daemon = _submitted(project, redis_server, tmp_path, "undecided-mop")
    daemon.one_pass()
    wu = sorted(_workunits(project))[0]
    (a,) = fake_server.send(project, [wu], hostid=1)
    (b,) = fake_server.send(project, [wu], hostid=2)
    for res in (a, b):
        fake_server.report(project, res)
    assert fake_server.validate_set(project, wu, {a: 3}) is None
    daemon.one_pass()
    need = fake_server.rows(project, "SELECT need_validate FROM workunit WHERE name = %s", (wu,))[0]
    assert need["need_validate"] == 1
    fake_server._exec(project, "UPDATE workunit SET need_validate = 0")  # as if the validator ran, again undecided
    daemon = WorkGeneratorDaemon(project, poll_s=0.1)  # restarted: its memory lost
    daemon.one_pass()
    assert fake_server.rows(project, "SELECT need_validate FROM workunit WHERE name = %s", (wu,))[0][
        "need_validate"] == 0  # asked once
    fake_server._exec(project, "UPDATE workunit SET need_validate = 1 WHERE name = %s", (wu,))
    assert fake_server.validator_pass(project) == [a]
    fake_server._exec(project, "UPDATE result SET create_time = 0 WHERE name = %s", (f"{wu}_2",))
    daemon.one_pass()
    assert calls(project.root, "cancel_jobs") == [] and store.counters()["boinc_revalidated"] == 1
