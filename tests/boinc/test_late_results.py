"""A correct late result of a superseded or cancelled workunit is never judged invalid.

On a real 1.6.2 server a client killed after its upload came back after the deadline;
boinc-dl had regenerated the unit (cancelling the old workunit) and BOINC's file deleter
had removed the upload. ``bdl_validate`` looked at the files first, found them missing
and exited 1: BOINC recorded the result invalid (outcome 6, validate_state 2) against the
host, and nothing reached Redis. The fake project plays the same sequence.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from boinc_dl.server.backends.boinc.daemon import finalize_job
from boinc_dl.server.backends.boinc.registry import BoincRegistry
from tests.boinc import fake_server
from tests.boinc.conftest import make_result, run_script, script_env
from tests.boinc.test_backend import LIMITS
from tests.boinc.test_semantics import create_units, job, regenerate  # noqa: F401 - fixture

NO_CHECK, INVALID, VALIDATE_ERROR, SUCCESS = 3, 2, 6, 1


def validate(project, paths: list[str]):  # noqa: ANN001, ANN201
    return run_script(project.root, f"../bin/bdl_validate {' '.join(paths)}", script_env())


def test_late_result_of_a_regenerated_unit_after_the_file_deleter(job) -> None:  # noqa: F811
    project, store, spec, r = job
    be, (u,) = create_units(project, r, spec, 1)
    deadline = be.deadline_s(LIMITS)
    (r0,) = fake_server.send(project, [u], now=time.time() - deadline - 5)
    paths = make_result(project.root, r0, spec.name, u, np.ones(15), upload=project)  # uploaded, then killed
    assert fake_server.time_out(project) == [r0]
    assert be.regeneration_requests(spec.name) == [(u, 0)]
    new = regenerate(be, project, spec, u, 1)  # cancels the old workunit
    removed = fake_server.file_deleter(project, {})
    assert {str(p) for p in removed} >= set(paths)  # the upload is gone before the report
    fake_server.report(project, r0)  # the host restarts and reports its finished task
    v = validate(project, paths)
    assert v.returncode == 3, v.stderr  # "not checked", never invalid
    assert "not checked" in v.stderr and "superseded" in v.stderr
    # BOINC: the cancelled workunit's late success is left NO_CHECK: no penalty, no credit
    assert fake_server.judge(project, r0, v.returncode) == (SUCCESS, NO_CHECK)
    # counted where the admin looks (once, however often BOINC asks again)
    assert validate(project, paths).returncode == 3
    late = BoincRegistry(store).late_results()
    assert list(late) == [r0] and late[r0]["wu"] == u and new in late[r0]["reason"]
    assert store.rejections() == [] and store.unit_states_of([u]) == ["in_progress"]


def test_late_result_of_a_cancelled_job(job) -> None:  # noqa: F811
    project, store, spec, r = job
    be, (u,) = create_units(project, r, spec, 1)
    (res,) = fake_server.send(project, [u])
    store.set_meta(status="cancelled", finished_at=time.time())
    finalize_job(store, be)  # boinc-dl boinc cancel: the unit is cancelled, its workunit too
    paths = make_result(project.root, res, spec.name, u, np.ones(15), upload=project)
    fake_server.file_deleter(project, {})
    fake_server.report(project, res)
    v = validate(project, paths)
    assert v.returncode == 3, v.stderr
    assert fake_server.judge(project, res, v.returncode) == (SUCCESS, NO_CHECK)
    assert "cancelled" in BoincRegistry(store).late_results()[res]["reason"]


def test_current_workunit_with_missing_files_is_still_invalid(job) -> None:  # noqa: F811
    """Only late results are spared: a current workunit's result without its files
    (a host that never uploaded) is invalid, as before."""
    project, store, spec, r = job
    _, (u,) = create_units(project, r, spec, 1)
    (res,) = fake_server.send(project, [u])
    paths = make_result(project.root, res, spec.name, u, np.ones(15), upload=project)
    for p in paths:
        Path(p).unlink()
    fake_server.report(project, res)
    v = validate(project, paths)
    assert v.returncode == 1, v.stderr
    assert fake_server.judge(project, res, v.returncode) == (VALIDATE_ERROR, INVALID)
    assert BoincRegistry(store).late_results() == {}
