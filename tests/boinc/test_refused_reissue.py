"""A refused result's unit runs again (``validation.reissue_refused``), through the fake BOINC project.

The work generator daemon creates workunits with the fake ``bin/create_work`` (its
database in MariaDB); results are handed to the assimilator shim as
``script_assimilator`` does. A result whose weights hold NaN is refused for what its
host computed, as the held-out loss check refuses one (tests/boinc/test_loss_check_boinc.py
walks that path with the checker); the unit is then not given up but issued again as
``<unit>_r<n>`` from the freshest weights, at most ``reissue_refused`` times, within
``units.max_total_results``. The daemon is killed (its in-memory queue lost) between
regenerating a unit and creating its workunit: the restart creates one workunit for it.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from boinc_dl.server.assimilator.connection import connect
from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.backends.boinc.daemon import WorkGeneratorDaemon
from boinc_dl.server.backends.boinc.project import dir_hier_path
from boinc_dl.server.backends.boinc.registry import BoincRegistry
from boinc_dl.server.backends.boinc.submit import submit_job
from boinc_dl.server.common.spec import parse_spec
from boinc_dl.server.common.weights import WeightsFile, write_weights
from boinc_dl.server.common.workunit import parse_unit_name, unit_name
from tests.boinc import fake_server
from tests.boinc.conftest import REPO, calls, fake_db, run_script, script_env
from tests.boinc.test_end_to_end import install_with_wrapper

pytestmark = pytest.mark.slow


class Job:
    """A small VC-ASGD job on the fake project, driven by an in-process daemon."""

    def __init__(self, project, redis_url: str, tmp_path, **over) -> None:
        install_with_wrapper(project, redis_url, tmp_path)
        validation = over.pop("validation", {})
        vcasgd = {"n_subsets": 2, "alpha": 0.5, "window": 2, **over.pop("vcasgd", {})}
        self.spec = parse_spec({
            "name": "refused", "model": "models:mlp", "model_args": {"input_dim": 64, "hidden": 8, "n_classes": 10},
            "dataset": {"name": "digits"},
            "training": {"epochs": 1, "batch_size": 64, "local_epochs": 1, "learning_rate": 0.01},
            "vcasgd": vcasgd,
            "units": {"timeout_s": 600, "max_error_results": 2, "max_total_results": 4, **over.pop("units", {})},
            "validation": {"loss_check": False, **validation},
            "seed": 3,
        })
        submit_job(self.spec, project.root, search_path=REPO / "examples")
        self.project = project
        self.store = JobStore(connect(redis_url), self.spec.name)
        self.env = script_env()
        fake_server._exec(project, "INSERT INTO host (create_time, rpc_time, p_ncpus, p_fpops) VALUES (0, %s, 1, 3e9)",
                          (int(time.time()),))
        self.daemon = WorkGeneratorDaemon(project, poll_s=0.1)
        self.daemon.one_pass()
        self.units = sorted(fake_db(project.root)["workunits"])

    def workunits(self) -> dict[str, dict]:
        return fake_db(self.project.root)["workunits"]

    def result(self, wu: str, flat: np.ndarray) -> int:
        """The shim's exit code for the first result of workunit ``wu`` holding ``flat``."""
        p = parse_unit_name(wu)
        unit = unit_name(p["job"], p["epoch"], p["shard"], p["model"])  # <unit>_r<n> carries <unit>
        paths = []
        for i in range(2):
            p = dir_hier_path(f"{wu}_0_r5_{i}", self.project.upload_dir, self.project.fanout)
            p.parent.mkdir(parents=True, exist_ok=True)
            paths.append(p)
        write_weights(paths[0], WeightsFile(flat.astype(np.float32), self.store.fingerprint("0"), job=self.spec.name,
                                            model="0", unit=unit, base_version=0, examples_seen=10))
        paths[1].write_text(json.dumps({"job": self.spec.name, "unit": unit, "val_acc": 0.5}))
        fake_server.send(self.project, [wu])
        wu_id = self.workunits()[wu]["id"]
        p = run_script(self.project.root, f"../bin/bdl_assimilate {wu_id} {' '.join(map(str, paths))}", self.env)
        assert p.returncode == 0, p.stderr[-2000:]
        return p.returncode

    def bad(self, wu: str) -> None:
        self.result(wu, np.full(self.store.fingerprint("0").n_params, np.nan))

    def good(self, wu: str) -> None:
        w = self.store.get_weights("0")[0]
        self.result(wu, np.asarray(w) + np.float32(0.01))


@pytest.fixture
def job(db_project, redis_server, tmp_path, request) -> Job:
    return Job(db_project, redis_server.url, tmp_path, **getattr(request, "param", {}))


def test_a_refused_unit_runs_again_from_fresh_weights_until_its_limit(job: Job) -> None:
    store, (a, b) = job.store, job.units
    reg = BoincRegistry(store)
    job.bad(a)
    assert a not in store.failed() and store.unit_states()[a] == "in_progress"
    # BOINC re-runs an assimilator killed after its work: the same refusal counts once
    job.bad(a)
    assert store.counters()["reissued_refused"] == 1 and reg.refused_counts() == {a: 1}
    job.good(b)
    assert store.version("0") == 1
    job.daemon.one_pass()
    wus = job.workunits()
    assert f"{a}_r1" in wus and not wus[a]["error_mask"]  # the finished workunit is not cancelled
    assert calls(job.project.root, "cancel_jobs") == []
    info = store.unit_info(a)
    assert info["attempt"] == 1 and info["weights_version"] == 1  # from the freshest weights
    assert reg.refused_pending() == {}  # answered
    job.daemon.one_pass()
    assert sorted(job.workunits()) == sorted([a, b, f"{a}_r1"])  # once
    job.bad(f"{a}_r1")
    job.daemon.one_pass()
    assert f"{a}_r2" in job.workunits() and store.unit_info(a)["attempt"] == 2
    job.bad(f"{a}_r2")  # the third refusal: reissue_refused (2) is spent
    assert "rejected at assimilation" in store.failed()[a]
    assert reg.refused_counts() == {a: 2} and store.counters()["reissued_refused"] == 2
    assert len(store.rejections(10)) == 3  # each refusal recorded once (the re-run too is one)
    for _ in range(10):
        if store.meta().get("status") != "running":
            break
        job.daemon.one_pass()
    assert store.meta()["status"] == "done" and store.epochs()[1]["units_ok"] == 1
    assert sorted(job.workunits()) == sorted([a, b, f"{a}_r1", f"{a}_r2"])


def test_an_honest_result_of_the_reissue_merges_once(job: Job) -> None:
    store, (a, b) = job.store, job.units
    job.bad(a)
    job.daemon.one_pass()
    job.good(f"{a}_r1")
    job.good(b)
    assert store.assimilated().keys() == {a, b} and store.assimilated()[a]["base_version"] == 0
    # the merge record names the result BOINC gave it: the re-run's, not the original's
    assert store.assimilated()[a]["result"].startswith(f"{a}_r1_")
    assert store.assimilated()[b]["result"].startswith(f"{b}_")
    # a late re-delivery of the refused original is a late call about a superseded workunit
    job.bad(a)
    assert store.version("0") == 2 and a not in store.failed() and len(store.rejections(10)) == 1
    for _ in range(10):
        if store.meta().get("status") != "running":
            break
        job.daemon.one_pass()
    assert store.meta()["status"] == "done" and store.epochs()[1]["units_ok"] == 2


@pytest.mark.parametrize("regenerated", [True, False], ids=["after-regenerating", "before-regenerating"])
def test_daemon_killed_before_the_new_workunit_exists(job: Job, regenerated: bool) -> None:
    """The daemon dies with the new workunit only queued in memory (its record already
    updated), or before it regenerated the unit at all: the restarted daemon creates
    exactly one new workunit for the unit."""
    store, (a, _b) = job.store, job.units
    job.bad(a)
    gen = job.daemon.gens[job.spec.name]
    if regenerated:
        gen.service_regenerations()  # queued, not created: the SIGKILL loses the queue
        assert job.daemon.backend.pending() == [f"{a}_r1"]
        # BOINC re-runs the assimilator on the refused result now: the request stays one
        job.bad(a)
        assert BoincRegistry(store).refused_counts() == {a: 1} and store.counters()["reissued_refused"] == 1
        assert BoincRegistry(store).refused_pending() == {}
    else:
        assert gen.regenerate(a, 1) is not None  # the record says attempt 1; nothing queued
    assert sorted(job.workunits()) == sorted(job.units)
    restarted = WorkGeneratorDaemon(job.project, poll_s=0.1)
    restarted.one_pass()
    restarted.one_pass()
    new = sorted(set(job.workunits()) - set(job.units))
    assert len(new) == 1 and new[0].startswith(f"{a}_r"), new
    assert store.unit_info(a)["attempt"] == int(new[0].rsplit("_r", 1)[1])
    assert BoincRegistry(store).refused_pending() == {}
    job.good(new[0])
    assert a in store.assimilated()


@pytest.mark.parametrize(("job", "why"), [
    ({"validation": {"reissue_refused": 0}}, "reissue_refused 0"),
    ({"vcasgd": {"reissue": "same"}}, "BOINC re-issues the same inputs: nothing to regenerate"),
    ({"units": {"max_total_results": 1, "max_error_results": 1}}, "no workunit left within max_total_results"),
], indirect=["job"])
def test_a_refused_unit_is_given_up_where_it_cannot_run_again(job: Job, why: str) -> None:
    store, (a, _b) = job.store, job.units
    job.bad(a)
    assert "rejected at assimilation" in store.failed()[a], why
    job.daemon.one_pass()
    assert sorted(job.workunits()) == sorted(job.units)
    assert "reissued_refused" not in store.counters()


def test_a_rejection_that_does_not_judge_the_host_gives_the_unit_up(job: Job) -> None:
    """Files the file deleter removed say nothing of the host: no second run."""
    store, (a, _b) = job.store, job.units
    wu_id = job.workunits()[a]["id"]
    ghost = dir_hier_path(f"{a}_0_r5_0", job.project.upload_dir, job.project.fanout)
    ghost.parent.mkdir(parents=True, exist_ok=True)
    p = run_script(job.project.root, f"../bin/bdl_assimilate {wu_id} {ghost}", job.env)
    assert p.returncode == 0, p.stderr
    assert "missing" in store.failed()[a]
    job.daemon.one_pass()
    assert sorted(job.workunits()) == sorted(job.units)


def _forget_creation(reg: BoincRegistry, unit: str, wu: str, record: dict | None) -> None:
    """The state a daemon SIGKILLed between ``create_work`` and recording the workunit
    leaves: BOINC has ``wu``, Redis still names ``record`` (None: nothing) as the unit's."""
    if record is None:
        reg.store.r.hdel(reg.issued_key, unit)
    else:
        reg.set_issued(unit, record)
    reg.store.r.srem(reg.created_key, wu)
    reg.store.r.hdel(reg.live_key, wu)


def test_a_result_of_a_new_workunit_not_yet_recorded_merges(job: Job) -> None:
    """A fast host returns ``<unit>_r1``'s result before the killed daemon's restart records
    the workunit: it is the unit's current workunit, not a superseded one, and merges."""
    store, (a, b) = job.store, job.units
    reg = BoincRegistry(store)
    job.bad(a)
    old = reg.issued([a])[0]
    job.daemon.one_pass()  # rebuilds the unit and creates <unit>_r1
    assert f"{a}_r1" in job.workunits()
    _forget_creation(reg, a, f"{a}_r1", old)
    assert reg.superseded_by(f"{a}_r1") is None and reg.superseded_by(a) is None
    job.good(f"{a}_r1")
    assert a in store.assimilated() and "superseded_calls" not in store.counters()
    restarted = WorkGeneratorDaemon(job.project, poll_s=0.1)  # records <unit>_r1 ("already exists")
    job.good(b)
    for _ in range(10):
        if store.meta().get("status") != "running":
            break
        restarted.one_pass()
    assert store.meta()["status"] == "done" and sorted(job.workunits()) == sorted([a, b, f"{a}_r1"])


def test_a_refusal_of_a_first_workunit_not_yet_recorded_runs_it_again(job: Job) -> None:
    """The same window for a unit's first workunit: its refused result does not give the unit
    up; the request waits until the restarted daemon has recorded the workunit, then the unit
    runs again."""
    store, (a, _b) = job.store, job.units
    reg = BoincRegistry(store)
    _forget_creation(reg, a, a, None)
    job.bad(a)
    assert a not in store.failed() and reg.refused_pending() == {a: a}
    job.daemon.one_pass()  # the old daemon's pass: nothing recorded, nothing issued, still waiting
    assert reg.refused_pending() == {a: a} and f"{a}_r1" not in job.workunits()
    restarted = WorkGeneratorDaemon(job.project, poll_s=0.1)
    restarted.one_pass()
    restarted.one_pass()
    assert f"{a}_r1" in job.workunits() and reg.refused_pending() == {}
    job.good(f"{a}_r1")
    assert a in store.assimilated()
