"""Results BOINC's validator could not judge are judged again, not thrown away.

Seen on a real server (two 7.20.5 clients, ``min_quorum 2``, install's default
``one_result_per_user_per_wu``): a ``kill -9`` of boinc-dl's validator makes its shim
answer "transient" (3); BOINC's validator then finds no consensus, marks both returned
results INCONCLUSIVE and raises ``target_nresults``, and the extra replica can go to
neither host. Before, boinc-dl cancelled (MOP) or regenerated (VC-ASGD) such a unit once
that replica had waited ``delay_bound``: two good results thrown away, and the wait.
Now the work generator asks BOINC's validator to judge the set again (``need_validate``,
as ``html/ops/revalidate.php`` does), once per workunit: the results become valid and
canonical, the replica is not needed, the unit merges with its own hosts' work. Results
that really disagree stay undecided and the stuck path takes them, as before.
"""

from __future__ import annotations

import logging

import numpy as np

from boinc_dl.server.backends.boinc.boincdb import BoincDB, BoincDBError
from boinc_dl.server.backends.boinc.jobsystem import BoincJobSystem
from boinc_dl.server.backends.boinc.registry import BoincRegistry
from tests.boinc import fake_server
from tests.boinc.conftest import calls, make_result, run_script, script_env
from tests.boinc.test_install_admin import _age_unsent, _restore_spec, as_mop, quorum_job  # noqa: F401 - fixture
from tests.boinc.test_semantics import create_units


def _undecided(project, spec, u: str) -> dict[str, list[str]]:
    """``u``'s two replicas computed by hosts 1 and 2 and reported; the validator could not
    judge the first (its init script answered 3): the set is left INCONCLUSIVE with a third
    replica neither host may take. The results' uploaded files by result name."""
    a = fake_server.request_work(project, hostid=1, ncpus=1, n_wanted=1)
    b = fake_server.request_work(project, hostid=2, ncpus=1, n_wanted=1)
    files = {}
    for res in a + b:
        files[res] = make_result(project.root, res, spec.name, u, np.full(15, 0.25), upload=project)
        fake_server.report(project, res)
    assert fake_server.validate_set(project, u, {a[0]: 3}) is None
    states = fake_server.rows(project, "SELECT name, server_state, validate_state FROM result ORDER BY id")
    assert [(x["server_state"], x["validate_state"]) for x in states] == [(5, 4), (5, 4), (2, 0)]
    for host in (1, 2):  # the replica BOINC added can go to neither host
        assert fake_server.request_work(project, hostid=host, ncpus=1, n_wanted=1) == []
    return files


def _need_validate(project) -> list[int]:
    return [int(w["need_validate"]) for w in fake_server.rows(project, "SELECT need_validate FROM workunit")]


def test_an_undecided_set_is_judged_again_once_and_merges(quorum_job) -> None:  # noqa: F811
    project, store, spec, r = quorum_job
    _restore_spec(r, store, spec.model_copy(update={"vcasgd": spec.vcasgd.model_copy(update={"reissue": "same"})}))
    be, (u,) = create_units(project, r, spec, 1)
    files = _undecided(project, spec, u)
    assert be.revalidate_undecided(spec.name) == 1
    assert _need_validate(project) == [1]
    # once: neither this job system nor a restarted one (state in Redis) asks again
    assert be.revalidate_undecided(spec.name) == 0
    assert BoincJobSystem(project, r).revalidate_undecided(spec.name) == 0
    assert store.counters()["boinc_revalidated"] == 1
    # BOINC's validator judges the set again, through boinc-dl's installed validator
    env = script_env()
    exits = {res: run_script(project.root, f"../bin/bdl_validate {' '.join(paths)}", env).returncode
             for res, paths in files.items()}
    assert set(exits.values()) == {0}
    (canonical,) = fake_server.validator_pass(project, exits)
    states = fake_server.rows(project, "SELECT server_state, outcome, validate_state FROM result ORDER BY id")
    assert [(x["server_state"], x["outcome"], x["validate_state"]) for x in states] == [
        (5, 1, 1), (5, 1, 1), (5, 5, 0)]  # both valid; the replica not needed
    wu = fake_server.rows(project, "SELECT id FROM workunit")[0]
    a = run_script(project.root, f"../bin/bdl_assimilate {wu['id']} {' '.join(files[canonical])}", env)
    assert a.returncode == 0, a.stderr
    assert u in store.assimilated() and store.version("0") == 1
    # nothing is left to cancel or regenerate, however long the replica would have waited
    _age_unsent(project)
    assert be.regeneration_requests(spec.name) == [] and be.cancel_stuck(spec.name) == 0


def test_results_that_disagree_again_go_to_the_stuck_path(quorum_job) -> None:  # noqa: F811
    project, store, spec, r = quorum_job
    _restore_spec(r, store, spec.model_copy(update={"vcasgd": spec.vcasgd.model_copy(update={"reissue": "same"})}))
    be, (u,) = create_units(project, r, spec, 1)
    _undecided(project, spec, u)
    assert be.revalidate_undecided(spec.name) == 1
    assert fake_server.validator_pass(project, agree=False) == []
    # still undecided, and no further replica: the validator raised the target once
    assert fake_server.rows(project, "SELECT COUNT(*) AS n FROM result")[0]["n"] == 3
    assert be.revalidate_undecided(spec.name) == 0  # not asked twice
    assert be.regeneration_requests(spec.name) == []  # the replica has not waited delay_bound yet
    _age_unsent(project)
    _age_ask(r, store, u)
    assert be.regeneration_requests(spec.name) == [(u, 0)]


def _age_ask(r, store, wu: str) -> None:
    """The validator was asked to judge ``wu`` again longer than delay_bound ago."""
    r.hset(BoincRegistry(store).revalidated_key, wu, 1)


def test_a_set_first_seen_undecided_after_a_long_wait_is_judged_again_not_thrown_away(quorum_job) -> None:  # noqa: F811
    """A work generator down for longer than delay_bound finds the set undecided and its
    replica old: it asks for the judgement, and neither the stuck path of this pass nor
    of the next ones throws the results away until that judgement has had delay_bound."""
    project, store, spec, r = quorum_job
    _restore_spec(r, store, spec.model_copy(update={"vcasgd": spec.vcasgd.model_copy(update={"reissue": "same"})}))
    be, (u,) = create_units(project, r, spec, 1)
    _undecided(project, spec, u)
    _age_unsent(project)
    assert be.regeneration_requests(spec.name) == []  # not before the set was judged again
    assert be.revalidate_undecided(spec.name) == 1
    assert be.regeneration_requests(spec.name) == [] and be.cancel_stuck(spec.name) == 0
    _age_ask(r, store, u)  # judged again and still undecided, delay_bound ago
    assert be.regeneration_requests(spec.name) == [(u, 0)]


def test_a_mop_workunit_is_judged_again_instead_of_cancelled(quorum_job) -> None:  # noqa: F811
    project, store, spec, r = quorum_job
    as_mop(r, store, spec)
    be, (u,) = create_units(project, r, spec, 1)
    _undecided(project, spec, u)
    assert be.revalidate_undecided(spec.name) == 1
    assert fake_server.validator_pass(project) != []
    _age_unsent(project)
    assert be.cancel_stuck(spec.name) == 0 and calls(project.root, "cancel_jobs") == []


def test_without_write_access_the_stuck_path_still_ends_it(quorum_job, monkeypatch, caplog) -> None:  # noqa: F811
    project, store, spec, r = quorum_job
    _restore_spec(r, store, spec.model_copy(update={"vcasgd": spec.vcasgd.model_copy(update={"reissue": "same"})}))
    be, (u,) = create_units(project, r, spec, 1)
    _undecided(project, spec, u)

    def denied(self, wu_id: int) -> bool:
        raise BoincDBError("update of BOINC's workunit failed: (1142, \"UPDATE command denied to user 'bdl'\")")

    monkeypatch.setattr(BoincDB, "ask_revalidation", denied)
    with caplog.at_level(logging.ERROR):
        assert be.revalidate_undecided(spec.name) == 0
        assert be.revalidate_undecided(spec.name) == 0
    said = [m for m in caplog.messages if "UPDATE command denied" in m]
    assert len(said) == 1 and "wait for the stuck path" in said[0]  # once, not every pass
    assert _need_validate(project) == [0] and BoincRegistry(store).revalidated(f"{u}") is not None
    assert "boinc_revalidated" not in store.counters()
    _age_unsent(project)
    assert be.regeneration_requests(spec.name) == [(u, 0)]
