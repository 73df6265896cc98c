"""One set of hostile and lifecycle cases through every assimilation transport.

Results reach the parameter server three ways, all through
:mod:`boinc_dl.server.assimilator.framework`:

* ``local`` — what each assimilator process of the local backend runs
  (:func:`~boinc_dl.server.backends.local.assimilators.assimilate_message`);
* ``boinc`` — BOINC's ``script_assimilator`` script, called with BOINC's arguments
  (the output files in the project's upload hierarchy, named as BOINC names them);
* ``spool`` — the docker stack: BOINC's POSIX-sh shim copies the result into the spool,
  then ``boinc-dl boinc spool``'s consumer takes it.

Each case runs on each transport; where a job system's semantics differ (the local
backend re-issues a unit whose result it rejected; BOINC's assimilator is final) the
expected outcome says so.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from boinc_dl.server.assimilator.connection import connect
from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.backends.boinc import scripts
from boinc_dl.server.backends.boinc.registry import BoincRegistry
from boinc_dl.server.backends.boinc.spool import SpoolConsumer
from boinc_dl.server.backends.local.assimilators import assimilate_message
from boinc_dl.server.common.errors import StoreUnavailable
from tests.boinc.conftest import make_project, make_result, tiny_fp
from tests.conftest import tiny_spec

ROOT = Path(__file__).resolve().parents[1]
SHIM = ROOT / "docker" / "shims" / "bdl_assimilate_spool.sh"
N = tiny_fp().n_params
TRANSPORTS = ["local", "boinc", "spool"]


@dataclass
class Rig:
    """A job with four units, and one transport's way to deliver a result or a give-up."""

    kind: str
    store: JobStore
    units: list[str]
    deliver: Callable[..., str]
    give_up: Callable[[str, int], str]


def _unit(job: str, i: int) -> str:
    return f"{job}__m0_e0001_s{i:04d}"


@pytest.fixture(params=TRANSPORTS)
def rig(request, redis_server, tmp_path: Path) -> Rig:
    kind = request.param
    project = make_project(tmp_path / "project")
    spec = tiny_spec(units={"timeout_s": 90, "max_error_results": 3, "max_total_results": 6})
    store = JobStore(connect(redis_server.url), spec.name)
    store.create(spec.model_dump_json(), "vcasgd", {"0": tiny_fp()}, {"job_dir": str(project.job_dir(spec.name))})
    store.init_weights("0", np.zeros(N, np.float32))
    units = [_unit(spec.name, i) for i in range(4)]
    for i, u in enumerate(units):
        store.register_unit(u, {"epoch": 1, "shard": i, "model": "0"}, 1)
    os.environ["BDL_REDIS_URL"] = redis_server.url
    request.addfinalizer(lambda: os.environ.pop("BDL_REDIS_URL", None))
    spool = tmp_path / "spool"
    spool.mkdir()
    seq = iter(range(10**6))

    def deliver(wu: str, flat: np.ndarray, embedded: str | None = None, job: str | None = None) -> str:
        """A result of workunit ``wu`` (BOINC's name); ``embedded``: the unit the host wrote."""
        result = f"{wu}_{next(seq)}"
        paths = make_result(tmp_path / "up", result, job or spec.name, embedded or wu, flat, upload=project)
        if kind == "local":
            st = store if job is None else JobStore(store.r, job)
            return assimilate_message(st, None if job else spec, "result", result, wu, paths).status
        if kind == "boinc":
            rc = scripts.assimilate(project, ["17", *paths])
            if rc == scripts.EXIT_TRANSIENT:
                return "transient"  # BOINC keeps the workunit and calls again later
            assert rc == scripts.EXIT_OK
        else:
            shim = subprocess.run(["sh", str(SHIM), "17", *paths], env={**os.environ, "BDL_SPOOL": str(spool)},
                                  capture_output=True, text=True, timeout=60)
            assert shim.returncode == 0, shim.stderr
            (res,) = SpoolConsumer(spool, project, store.r, retry_s=store.retry_s).run_once()
            return res.status or res.action
        return _last_status(store, wu)

    def give_up(wu: str, mask: int) -> str:
        if kind == "local":
            return assimilate_message(store, spec, "error", "", wu, f"mask {mask}").status
        if kind == "boinc":
            assert scripts.assimilate(project, ["--error", str(mask), wu, "1", "0"]) == scripts.EXIT_OK
            return _last_status(store, wu)
        subprocess.run(["sh", str(SHIM), "--error", str(mask), wu, "1", "0"],
                       env={**os.environ, "BDL_SPOOL": str(spool)}, check=True, timeout=60)
        (res,) = SpoolConsumer(spool, project, store.r, retry_s=store.retry_s).run_once()
        return res.status or res.action

    return Rig(kind, store, units, deliver, give_up)


def _last_status(store: JobStore, wu: str) -> str:
    """What BOINC's script did, read back from the job's state (the script exits 0 for
    every handled outcome)."""
    state = store.unit_states_of([wu])[0]
    return {"assimilated": "merged", "failed": "failed"}.get(state or "", "recorded")


def test_a_result_merges_once_and_a_redelivery_is_a_duplicate(rig: Rig) -> None:
    u = rig.units[0]
    assert rig.deliver(u, np.ones(N)) == "merged"
    assert rig.store.version("0") == 1
    rig.deliver(u, np.full(N, 5.0))  # BOINC's at-least-once call, or a late replica
    assert rig.store.version("0") == 1
    np.testing.assert_allclose(rig.store.get_weights("0")[0], 0.5)  # alpha 0.5 of the first result only
    assert rig.store.epoch_counts(1)["assimilated"] == 1


def test_a_nan_result_is_rejected_and_given_up_where_it_was_final(rig: Rig) -> None:
    u = rig.units[1]
    rig.deliver(u, np.full(N, np.nan))
    assert rig.store.version("0") == 0
    assert "NaN" in rig.store.rejections(1)[0]["reason"]
    if rig.kind == "local":  # the local backend re-issues the unit itself
        assert rig.store.unit_states_of([u]) == ["created"]
    else:  # BOINC's assimilator is the workunit's last step: the epoch must be able to close
        assert rig.store.unit_states_of([u]) == ["failed"] and "NaN" in rig.store.failed()[u]


def test_a_result_claiming_another_unit_is_never_merged_into_either(rig: Rig) -> None:
    u0, u1 = rig.units[0], rig.units[1]
    rig.deliver(u0, np.ones(N), embedded=u1)
    assert rig.store.version("0") == 0
    rej = rig.store.rejections(1)[0]
    assert rej["unit"] == u0 and "embeds unit" in rej["reason"]
    assert not rig.store.is_assimilated(u1)


def test_a_late_result_of_a_superseded_workunit_changes_nothing(rig: Rig) -> None:
    if rig.kind == "local":
        pytest.skip("the local backend supersedes no workunit: its regenerated unit keeps the unit's name")
    u = rig.units[2]
    reg = BoincRegistry(rig.store)
    reg.mark_created([(f"{u}_r1", u, 90.0, 1)])  # boinc-dl regenerated the unit as <unit>_r1
    rig.deliver(u, np.ones(N))  # the original comes back late
    assert rig.store.version("0") == 0 and not rig.store.is_assimilated(u)
    assert rig.store.counters().get("superseded_calls") == 1
    assert rig.store.unit_states_of([u]) == ["created"]  # the regenerated workunit still runs


def test_a_late_result_of_a_cancelled_unit_changes_nothing(rig: Rig) -> None:
    u = rig.units[3]
    assert rig.store.transition_unit(u, "created", "cancelled")
    rig.deliver(u, np.ones(N))
    assert rig.store.version("0") == 0 and rig.store.rejections() == []
    assert rig.store.unit_states_of([u]) == ["cancelled"]


def test_a_give_up_is_recorded_once_and_never_undoes_a_merge(rig: Rig) -> None:
    u0, u1 = rig.units[0], rig.units[1]
    rig.give_up(u0, 8)
    rig.give_up(u0, 8)
    assert rig.store.unit_states_of([u0]) == ["failed"]
    assert rig.store.epoch_counts(1)["failed"] == 1
    rig.deliver(u0, np.ones(N))  # a late success of a unit given up: not merged
    assert rig.store.version("0") == 0
    rig.deliver(u1, np.ones(N))
    rig.give_up(u1, 8)  # an error call after the merge
    assert rig.store.unit_states_of([u1]) == ["assimilated"] and rig.store.epoch_counts(1).get("failed") == 1


def test_a_result_of_an_unknown_job_touches_no_job(rig: Rig) -> None:
    status = rig.deliver(_unit("ghost", 0), np.ones(N), job="ghost")
    assert status in ("ignored", "dead", "recorded")
    assert rig.store.version("0") == 0 and rig.store.rejections() == []
    assert not JobStore(rig.store.r, "ghost").exists()


def test_redis_down_is_transient_and_loses_nothing(rig: Rig, redis_server) -> None:
    u = rig.units[0]
    redis_server.stop()
    try:
        rig.store.retry_s = 0.5  # how long one call waits out the outage (30 s by default)
        if rig.kind == "local":  # the assimilator process keeps the result and retries
            with pytest.raises(StoreUnavailable):
                rig.deliver(u, np.ones(N))
        else:  # BOINC's script exits 3, the spool keeps its entry
            assert rig.deliver(u, np.ones(N)) == {"boinc": "transient", "spool": "retry"}[rig.kind]
    finally:
        redis_server.start()
    rig.store.retry_s = 30.0
    assert rig.store.version("0") == 0
