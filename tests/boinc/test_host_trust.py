"""A result the assimilator refuses costs its host BOINC's trust, as an invalid one does.

The assimilator shim run as ``script_assimilator`` runs it, on the fake project whose
BOINC database is the machine's MariaDB: BOINC's validator has called every result here
valid, its hosts hold ``host_app_version`` rows with a run of consecutive valid results,
and the refusals that judge the host's work must set that run to 0 (what BOINC's
validator does for an invalid result), so that the scheduler replicates the host's next
jobs. (The held-out loss check's refusals go the same way: test_loss_check_boinc.py.)
"""

from __future__ import annotations

import random
import re
import time
from pathlib import Path

import numpy as np
import pytest

from tests.boinc import fake_server
from tests.boinc.conftest import make_result, run_script, tiny_fp, unit, use_mariadb

N = tiny_fp().n_params
AV = 3  # the app version BOINC's scheduler sent the results to run


def hav(project, host: int, av: int = AV) -> int | None:
    """``consecutive_valid`` of a host app version (None: no row)."""
    r = fake_server.rows(project, "SELECT consecutive_valid FROM host_app_version WHERE host_id = %s "
                                  "AND app_version_id = %s", (host, av))
    return int(r[0]["consecutive_valid"]) if r else None


@pytest.fixture
def boinc(env, mariadb_name):
    """The installed scripts and tiny job on the MariaDB-backed fake project, with three
    hosts that earned 12 consecutive valid results: 7 and 8 run app version 3, 9 runs an
    anonymous-platform CPU version (``app_version_id`` -1: BOINC's row is 1000001)."""
    project, store, spec, e = env
    use_mariadb(project, mariadb_name)
    fake_server._exec(project, "INSERT INTO app (id, create_time, name, user_friendly_name, target_nresults) "
                               "VALUES (1, 0, 'boincdl', 'boinc-dl', 2)")
    for host, av in ((7, AV), (8, AV), (9, 1_000_001)):
        fake_server._exec(project, "INSERT INTO host_app_version (host_id, app_version_id, consecutive_valid, "
                                   "max_jobs_per_day) VALUES (%s, %s, 12, 40)", (host, av))
    return project, store, spec, e


def returned(project, wu: str, host: int, av: int = AV) -> str:
    """Workunit ``wu`` in BOINC's database, its result sent unreplicated to ``host``,
    returned and validated (the validator's own checks passed); the result's name."""
    fake_server._exec(project, "INSERT INTO workunit (create_time, name, delay_bound) VALUES (0, %s, 600)", (wu,))
    wu_id = fake_server.rows(project, "SELECT id FROM workunit WHERE name = %s", (wu,))[0]["id"]
    fake_server._exec(project, "INSERT INTO result (create_time, workunitid, server_state, name) VALUES (0, %s, 2, %s)",
                      (wu_id, f"{wu}_0"))
    # a trusted host app version's job goes out unreplicated (the spot check drawn above 1/12)
    [name] = fake_server.send(project, [wu], hostid=host, app_version_id=av, rng=random.Random(0))
    fake_server.report(project, name)
    fake_server.validate(project, name)
    return name


def assimilate(project, e, paths: list[str]) -> None:
    p = run_script(project.root, f"../bin/bdl_assimilate 17 {' '.join(paths)}", e)
    assert p.returncode == 0, p.stderr


def test_refused_results_cost_their_hosts_trust(boinc) -> None:
    project, store, spec, e = boinc
    bad, good, anon = unit(spec, 0), unit(spec, 1), unit(spec, 2)
    names = {u: returned(project, u, host, av) for u, host, av in ((bad, 7, AV), (good, 8, AV), (anon, 9, -1))}
    before = fake_server.rows(project, "SELECT * FROM host_app_version WHERE host_id = 7")[0]
    uploads = {u: make_result(project.upload_dir, names[u], spec.name, u,
                              np.ones(N) if u == good else np.full(N, np.nan), upload=project)
               for u in (bad, good, anon)}
    for u in (bad, good, anon):
        assimilate(project, e, uploads[u])
    assert "NaN" in store.failed()[bad] and "NaN" in store.failed()[anon] and store.is_assimilated(good)
    # the refused results' hosts lost their run; the honest host kept its own
    assert hav(project, 7) == 0 and hav(project, 9, 1_000_001) == 0 and hav(project, 8) == 12
    after = fake_server.rows(project, "SELECT * FROM host_app_version WHERE host_id = 7")[0]
    assert {k: v for k, v in after.items() if k != "consecutive_valid"} == \
           {k: v for k, v in before.items() if k != "consecutive_valid"}  # nothing else of the row
    rec = store.host_demotion(names[bad])
    assert rec["done"] and rec["demoted"] and rec["host"] == 7 and rec["app_version"] == AV
    assert rec["consecutive_valid_before"] == 12 and "NaN" in rec["reason"]
    assert store.host_demotion(names[anon])["app_version"] == 1_000_001
    assert store.host_demotion(names[good]) is None and store.counters()["hosts_demoted"] == 2
    # BOINC hands the refused result over again (a crash before its DB update): same state
    fake_server._exec(project, "UPDATE host_app_version SET consecutive_valid = 3 WHERE host_id = 7")
    assimilate(project, e, uploads[bad])
    assert hav(project, 7) == 3 and store.counters()["hosts_demoted"] == 2  # handled once
    # BOINC's scheduler now replicates host 7's next job and still trusts host 8 (spot check
    # drawn above 1/12)
    fake_server._exec(project, "UPDATE host_app_version SET consecutive_valid = 0 WHERE host_id = 7")
    for u, host in ((unit(spec, 3), 7), (unit(spec, 4), 8)):
        fake_server._exec(project, "INSERT INTO workunit (create_time, name, delay_bound) VALUES (0, %s, 600)", (u,))
        wu_id = fake_server.rows(project, "SELECT id FROM workunit WHERE name = %s", (u,))[0]["id"]
        fake_server._exec(project, "INSERT INTO result (create_time, workunitid, server_state, name) "
                                   "VALUES (0, %s, 2, %s)", (wu_id, f"{u}_0"))
        assert fake_server.send(project, [u], hostid=host, app_version_id=AV, rng=random.Random(0))
    targets = {r["name"]: (r["target_nresults"], r["min_quorum"], r["n"]) for r in fake_server.rows(
        project, "SELECT w.name, w.target_nresults, w.min_quorum, COUNT(r.id) AS n FROM workunit w "
                 "JOIN result r ON r.workunitid = w.id WHERE w.name IN (%s, %s) GROUP BY w.id",
        (unit(spec, 3), unit(spec, 4)))}
    assert targets == {unit(spec, 3): (2, 2, 2), unit(spec, 4): (1, 1, 1)}


def test_refusals_that_are_not_the_hosts_fault_cost_nothing(boinc) -> None:
    project, store, spec, e = boinc
    gone, dup = unit(spec, 0), unit(spec, 1)
    r_gone, r_dup = returned(project, gone, 7), returned(project, dup, 8)
    # BOINC's file deleter removed the uploads: the unit is given up, the host not blamed
    paths = make_result(project.upload_dir, r_gone, spec.name, gone, np.ones(N), upload=project)
    Path(paths[0]).unlink()
    assimilate(project, e, paths)
    assert "missing" in store.failed()[gone]
    # a result of a unit already settled: a late duplicate, whatever its content
    assimilate(project, e, make_result(project.upload_dir, r_dup, spec.name, dup, np.ones(N), upload=project))
    late = make_result(project.upload_dir, f"{dup}_1", spec.name, dup, np.full(N, np.nan), upload=project)
    assimilate(project, e, late)
    # a result of a workunit the job never issued
    stray = f"{spec.name}__m0_e0001_s0099"
    r_stray = returned(project, stray, 9, -1)
    assimilate(project, e, make_result(project.upload_dir, r_stray, spec.name, stray, np.ones(N), upload=project))
    assert any(r["unit"] == stray for r in store.rejections(10))
    assert hav(project, 7) == hav(project, 8) == hav(project, 9, 1_000_001) == 12
    assert store.host_demotions() == {} and "hosts_demoted" not in store.counters()


def test_database_down_the_refusal_stands_and_the_demotion_waits(boinc) -> None:
    project, store, spec, e = boinc
    first, second = unit(spec, 0), unit(spec, 1)
    r1, r2 = returned(project, first, 7), returned(project, second, 9, -1)
    good_config = project.config_xml.read_text()
    # BOINC's database unreachable (a closed port) while the first refusal is handled
    project.config_xml.write_text(re.sub(r"<db_port>\d+</db_port>", "<db_port>1</db_port>", good_config))
    t0 = time.monotonic()
    assimilate(project, e, make_result(project.upload_dir, r1, spec.name, first, np.full(N, np.nan), upload=project))
    assert time.monotonic() - t0 < 30  # bounded by the connect timeout
    assert "NaN" in store.failed()[first]  # refused, recorded, the unit given up
    rec = store.host_demotion(r1)
    assert not rec["done"] and "BOINC's database" in rec["error"] and "NaN" in rec["reason"]
    assert store.pending_host_demotions() == [r1] and store.counters()["host_demotions_failed"] == 1
    project.config_xml.write_text(good_config)
    assert hav(project, 7) == 12
    # the database is back: the next refusal demotes its host and retries the pending one
    assimilate(project, e, make_result(project.upload_dir, r2, spec.name, second, np.full(N, np.nan),
                                       upload=project))
    assert hav(project, 9, 1_000_001) == 0 and hav(project, 7) == 0
    assert store.pending_host_demotions() == [] and store.counters()["hosts_demoted"] == 2
    assert store.host_demotion(r1)["done"] and "NaN" in store.host_demotion(r1)["reason"]


def test_update_over_the_hard_cap_costs_its_host_trust(boinc) -> None:
    """``validation.max_update_norm`` judges the host's update: its refusal demotes."""
    from tests.conftest import tiny_spec

    project, store, spec, e = boinc
    capped = tiny_spec(units={"timeout_s": 90, "max_error_results": 3, "max_total_results": 6},
                       validation={"max_update_norm": 1.0})
    store.r.set(store.k("spec"), capped.model_dump_json())
    far, near = unit(spec, 0), unit(spec, 1)
    r_far, r_near = returned(project, far, 7), returned(project, near, 8)
    assimilate(project, e, make_result(project.upload_dir, r_far, spec.name, far, np.ones(N), upload=project))
    assimilate(project, e, make_result(project.upload_dir, r_near, spec.name, near, np.full(N, 0.1),
                                       upload=project))
    assert "max_update_norm" in store.failed()[far] and store.is_assimilated(near)
    assert hav(project, 7) == 0 and hav(project, 8) == 12
    assert "max_update_norm" in store.host_demotion(r_far)["reason"]


def test_a_stale_judgement_caps_the_hosts_run_so_boinc_spot_checks_it_more(boinc) -> None:
    """``cap_host_trust`` (called for a merged result the loss check judged against trusted
    results from worse models): a host above the cap keeps the cap, one below keeps
    its own count, a second call changes nothing, BOINC's database down changes nothing
    and raises nothing (BOINC's scheduler then spot-checks the capped host at 1/cap:
    ``set_trust``, which the fake scheduler applies, test_loss_check_boinc.py)."""
    from boinc_dl.server.backends.boinc.hosttrust import cap_host_trust

    project, store, spec, e = boinc
    fake_server._exec(project, "UPDATE host_app_version SET consecutive_valid = 60 WHERE host_id = 7")
    r7, r8 = returned(project, unit(spec, 0), 7), returned(project, unit(spec, 1), 8)
    got = cap_host_trust(project, r7, cap=20)
    assert got is not None and (got.hostid, got.before) == (7, 60) and hav(project, 7) == 20
    assert cap_host_trust(project, r7, cap=20).before == 20 and hav(project, 7) == 20  # idempotent
    assert cap_host_trust(project, r8, cap=20).before == 12 and hav(project, 8) == 12  # below the cap
    assert cap_host_trust(project, "no_such_result", cap=20) is None
    good_config = project.config_xml.read_text()
    fake_server._exec(project, "UPDATE host_app_version SET consecutive_valid = 60 WHERE host_id = 8")
    project.config_xml.write_text(re.sub(r"<db_port>\d+</db_port>", "<db_port>1</db_port>", good_config))
    assert cap_host_trust(type(project)(project.root), r8, cap=20) is None  # a fresh read of config.xml
    project.config_xml.write_text(good_config)
    assert hav(project, 8) == 60
