"""What install sets up for a real admin, judged against BOINC's database and scheduler.

* a failed database step is repaired by the next install (idempotence is judged against
  the ``app``/``app_version`` tables, not against the files install wrote);
* ``min_quorum 2``: BOINC sends a unit's replicas to different users (or hosts), and the
  compare script records how many comparisons were across hosts;
* a per-host cap on tasks in progress, so that every host that asks gets work;
* the prerequisite checks (``boinc-dl boinc doctor``).
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from boinc_dl.server.backends.boinc import doctor
from boinc_dl.server.backends.boinc.install import InstallOptions, install
from boinc_dl.server.backends.boinc.project import BoincProjectError
from boinc_dl.server.backends.boinc.registry import BoincRegistry
from boinc_dl.server.common.spec import parse_spec
from tests.boinc import fake_server
from tests.boinc.conftest import (
    REPO,
    calls,
    make_result,
    run_script,
    script_env,
    seed_db_app,
    tiny_fp,
)
from tests.boinc.test_backend import LIMITS
from tests.boinc.test_install import wrapper  # noqa: F401 - fixture
from tests.boinc.test_semantics import create_units


def db_versions(project) -> set[tuple[int, str, str]]:
    return {(r["version_num"], r["platform"], r["plan_class"]) for r in fake_server.rows(
        project, "SELECT av.version_num, p.name AS platform, av.plan_class FROM app_version av "
                 "JOIN platform p ON p.id = av.platformid")}


# ---- a failed database step --------------------------------------------------------------

def test_failed_xadd_is_repaired_by_the_next_install(db_project, wrapper) -> None:  # noqa: F811
    root = db_project.root
    opts = InstallOptions(wrapper=wrapper, gpu=False, redis_url="redis://localhost:6379/0", checks=False)
    (root / "fake_xadd_fails").write_text("")  # PHP without its XML extension
    with pytest.raises(BoincProjectError, match="xadd.*simplexml_load_file"):
        install(root, opts)
    assert (root / "apps/boincdl/1.0/x86_64-pc-linux-gnu/version.xml").is_file()  # files written
    assert fake_server.rows(db_project, "SELECT * FROM app") == []
    (root / "fake_xadd_fails").unlink()  # php-xml installed
    rep = install(root, InstallOptions(gpu=False, checks=False))
    assert any(c.startswith("ran bin/xadd (BOINC's database lacked app boincdl") for c in rep.changes), rep.changes
    assert any(c.startswith("ran bin/update_versions") for c in rep.changes)
    assert [r["name"] for r in fake_server.rows(db_project, "SELECT name FROM app")] == ["example_app", "boincdl"]
    assert db_versions(db_project) == {(100, "x86_64-pc-linux-gnu", "")}
    n = len(calls(root))
    rep = install(root, InstallOptions(gpu=False, checks=False))
    assert rep.changes == [] and len(calls(root)) == n  # now truly up to date


def test_missing_app_version_row_is_registered(db_project, wrapper) -> None:  # noqa: F811
    root = db_project.root
    install(root, InstallOptions(wrapper=wrapper, checks=False))
    assert db_versions(db_project) == {(100, "x86_64-pc-linux-gnu", ""), (100, "x86_64-pc-linux-gnu", "bdl_nvidia")}
    fake_server._exec(db_project, "DELETE FROM app_version WHERE plan_class = 'bdl_nvidia'")  # e.g. a DB restore
    rep = install(root, InstallOptions(checks=False))
    assert rep.changes == ["ran bin/update_versions (BOINC's database lacked app version 1.00 "
                           "x86_64-pc-linux-gnu__bdl_nvidia)"]
    assert len(db_versions(db_project)) == 2


# ---- min_quorum 2: replicas on different hosts and users ----------------------------------

def config_values(root: Path) -> dict[str, str]:
    import xml.etree.ElementTree as ET

    return {c.tag: (c.text or "").strip() for c in ET.parse(root / "config.xml").getroot().find("config")}


def test_quorum_two_sends_replicas_to_different_users(project) -> None:
    root = project.root
    (root / "config.xml").write_text((root / "config.xml").read_text().replace(
        "<one_result_per_user_per_wu/>", "<one_result_per_user_per_wu>0</one_result_per_user_per_wu>"))
    rep = install(root, InstallOptions(run_db_tools=False, checks=False))  # min_quorum 1: the user rule left alone
    assert config_values(root)["one_result_per_user_per_wu"] == "0"
    assert config_values(root)["one_result_per_host_per_wu"] == "1"  # a spot check's replica: another host
    assert not any("one_result_per_user_per_wu" in n for n in rep.notes)
    rep = install(root, InstallOptions(run_db_tools=False, checks=False, min_quorum=2))
    assert "config.xml: changed <one_result_per_user_per_wu> to 1 (replicas of a workunit go to different users)" \
        in rep.changes
    assert any("different users" in n for n in rep.notes)
    assert install(root, InstallOptions(run_db_tools=False, checks=False, min_quorum=2)).changes == []
    # back to min_quorum 1 with the user rule on: install says what it means for spot checks
    rep = install(root, InstallOptions(run_db_tools=False, checks=False, min_quorum=1))
    assert any("<one_result_per_user_per_wu> is on" in n and "never sent" in n for n in rep.notes)
    install(root, InstallOptions(run_db_tools=False, checks=False, min_quorum=2))
    # a fleet attached with one account: different hosts instead
    rep = install(root, InstallOptions(run_db_tools=False, checks=False, min_quorum=2, quorum_across="hosts"))
    cfg = config_values(root)
    assert (cfg["one_result_per_user_per_wu"], cfg["one_result_per_host_per_wu"]) == ("0", "1")


@pytest.fixture
def quorum_job(db_project, tiny_boinc_job, redis_server):
    """The tiny job on the MariaDB project installed with min_quorum 2."""
    install(db_project.root, InstallOptions(run_db_tools=False, gpu=False, redis_url=redis_server.url, min_quorum=2,
                                            checks=False, command=[sys.executable, "-m", "boinc_dl.server.backends.boinc"]))
    seed_db_app(db_project.root)
    db_project.__dict__.pop("settings", None)  # read boinc-dl.yaml as install left it
    db_project.__dict__.pop("config", None)
    store, spec = tiny_boinc_job
    from boinc_dl.server.assimilator.connection import connect

    return db_project, store, spec, connect(redis_server.url)


def test_quorum_replicas_never_go_to_one_host(quorum_job) -> None:
    project, store, spec, r = quorum_job
    be, units = create_units(project, r, spec, 2)
    # one host asks again and again: it gets one replica of each unit, never two
    got = fake_server.request_work(project, hostid=1, ncpus=4, n_wanted=4)
    assert sorted(got) == sorted(f"{u}_0" for u in units)
    assert fake_server.request_work(project, hostid=1, ncpus=4, n_wanted=4) == []
    # a second volunteer's host gets the second replicas
    got2 = fake_server.request_work(project, hostid=2, ncpus=4, n_wanted=4)
    assert sorted(got2) == sorted(f"{u}_1" for u in units)


def test_a_quorum_no_host_left_can_complete_is_regenerated(quorum_job) -> None:
    """Two hosts, min_quorum 2, one replica judged invalid: the transitioner's replacement
    can go to neither host (one_result_per_host_per_wu), so the workunit would wait for a
    third host forever with its other replica back (seen on a real server: the job stalled
    with both clients idle). Once that replacement has waited unsent for longer than the
    workunit's delay_bound, boinc-dl regenerates the unit as a new workunit, which both
    hosts may take; not before."""
    project, store, spec, r = quorum_job
    be, (u,) = create_units(project, r, spec, 1)
    a = fake_server.request_work(project, hostid=1, ncpus=1, n_wanted=1)
    b = fake_server.request_work(project, hostid=2, ncpus=1, n_wanted=1)
    assert sorted(a + b) == [f"{u}_0", f"{u}_1"]
    for res in a + b:
        fake_server.report(project, res)
    assert fake_server.judge(project, a[0], 0)[1] == 1       # valid, waiting for its quorum
    assert fake_server.judge(project, b[0], 1) == (6, 2)     # invalid: a replacement is created
    unsent = fake_server.rows(project, "SELECT name FROM result WHERE server_state = 2")
    assert [x["name"] for x in unsent] == [f"{u}_2"]
    for host in (1, 2):  # neither host may take it
        assert fake_server.request_work(project, hostid=host, ncpus=1, n_wanted=1) == []
    assert be.regeneration_requests(spec.name) == []  # a replica waiting a while is normal
    _age_unsent(project)
    assert be.regeneration_requests(spec.name) == [(u, 0)]


def test_a_replica_a_busy_host_may_still_take_is_not_stuck(quorum_job) -> None:
    """Seen on a real server with two jobs on two hosts: a unit's second replica waited
    unsent while the other host ran another job's work, and boinc-dl took it for stuck
    (by the replica's age alone) and threw the first, returned result away. A host that
    contacted the scheduler within delay_bound and holds no result of the workunit may
    still take it: not stuck, until no such host is left."""
    project, store, spec, r = quorum_job
    _restore_spec(r, store, spec.model_copy(update={"vcasgd": spec.vcasgd.model_copy(update={"reissue": "same"})}))
    be, (u,) = create_units(project, r, spec, 1)
    assert fake_server.request_work(project, hostid=2, ncpus=1, n_wanted=0) == []  # busy: asks for nothing
    (a,) = fake_server.request_work(project, hostid=1, ncpus=1, n_wanted=1)
    fake_server.report(project, a)
    assert fake_server.judge(project, a, 0)[1] == 1  # valid, waiting for its quorum
    _age_unsent(project)
    assert be.regeneration_requests(spec.name) == []  # host 2 may take the replica
    assert be.cancel_stuck(spec.name) == 0
    delay_bound = int(fake_server.rows(project, "SELECT delay_bound FROM workunit")[0]["delay_bound"])
    fake_server._exec(project, "UPDATE host SET rpc_time = %s WHERE id = 2", (int(time.time()) - delay_bound - 5,))
    assert be.regeneration_requests(spec.name) == [(u, 0)]  # host 2 gone: only host 1, which has one


def _stuck(project, be, u: str) -> None:
    """``u``'s workunit stuck as on the real server: one replica valid and waiting for its
    quorum, the other invalid, the replacement sendable to neither host."""
    a = fake_server.request_work(project, hostid=1, ncpus=1, n_wanted=1)
    b = fake_server.request_work(project, hostid=2, ncpus=1, n_wanted=1)
    for res in a + b:
        fake_server.report(project, res)
    assert fake_server.judge(project, a[0], 0)[1] == 1 and fake_server.judge(project, b[0], 1) == (6, 2)
    for host in (1, 2):
        assert fake_server.request_work(project, hostid=host, ncpus=1, n_wanted=1) == []


def _age_unsent(project) -> None:
    """The replacement replica has waited unsent for longer than the workunit's delay_bound,
    and so has everything else: the results came back that long ago."""
    delay_bound = int(fake_server.rows(project, "SELECT delay_bound FROM workunit")[0]["delay_bound"])
    then = int(time.time()) - delay_bound - 5
    fake_server._exec(project, "UPDATE result SET create_time = %s WHERE server_state = 2", (then,))
    fake_server._exec(project, "UPDATE result SET received_time = %s WHERE server_state = 5", (then,))


def _restore_spec(r, store, spec) -> None:
    r.set(store.k("spec"), spec.model_dump_json())


def as_mop(r, store, spec) -> None:
    """The tiny job's stored spec made a MOP job of two configurations."""
    _restore_spec(r, store, parse_spec({"name": spec.name, "mode": "mop", "model": "models:mlp",
                                        "dataset": {"name": "digits"}, "mop": {"param_grid": {"lr": [0.01, 0.001]}}}))


def test_same_inputs_regenerate_only_a_stuck_workunit(quorum_job) -> None:
    """``reissue: same``: BOINC's own re-issue recovers a lost result, so a unit past its
    deadline is not regenerated; a stuck one, which BOINC's re-issue cannot finish, is."""
    project, store, spec, r = quorum_job
    _restore_spec(r, store, spec.model_copy(update={"vcasgd": spec.vcasgd.model_copy(update={"reissue": "same"})}))
    be, (u, v) = create_units(project, r, spec, 2)
    # v: both replicas sent, then their deadlines passed (BOINC times them out and re-issues)
    (v0,) = fake_server.send(project, [v], hostid=3)
    (v1,) = fake_server.send(project, [v], hostid=4)
    _stuck(project, be, u)
    fake_server._exec(project, "UPDATE result SET report_deadline = %s WHERE name IN (%s, %s)",
                      (int(time.time()) - 10, v0, v1))
    assert be.regeneration_requests(spec.name) == []
    _age_unsent(project)
    assert be.regeneration_requests(spec.name) == [(u, 0)]
    assert be.regeneration_requests(spec.name) == [(u, 0)]  # asked again before it is regenerated
    assert store.counters()["boinc_stuck"] == 1  # counted once
    assert be.cancel_stuck(spec.name) == 0  # VC-ASGD regenerates; only MOP cancels


def test_a_stuck_mop_workunit_is_cancelled_and_given_up_once(quorum_job) -> None:
    """A MOP job has no regeneration: its stuck workunit is cancelled, BOINC hands it to the
    assimilator as failed (``--error``), and the unit is given up, so the MOP scheduler
    queues the sub-epoch again as a new workunit. Not before delay_bound, and only once."""
    project, store, spec, r = quorum_job
    as_mop(r, store, spec)
    be, (u,) = create_units(project, r, spec, 1)
    _stuck(project, be, u)
    assert be.cancel_stuck(spec.name) == 0  # a replica waiting a while is normal
    assert be.regeneration_requests(spec.name) == []
    _age_unsent(project)
    assert be.cancel_stuck(spec.name) == 1
    (wu,) = fake_server.rows(project, "SELECT id, error_mask FROM workunit")
    assert wu["error_mask"] & 16
    assert not BoincRegistry(store).live()
    assert be.cancel_stuck(spec.name) == 0  # done with: not cancelled again
    # BOINC's assimilator then hands the cancelled workunit over as failed
    p = run_script(project.root, f"../bin/bdl_assimilate --error 16 {u} {wu['id']} 0", script_env())
    assert p.returncode == 0, p.stderr
    assert u in store.failed() and u not in store.assimilated()
    assert "cancelled as stuck" in store.failed()[u] and store.counters()["boinc_stuck"] == 1


def test_compare_counts_comparisons_across_hosts(quorum_job) -> None:
    project, store, spec, r = quorum_job
    _, (u, v) = create_units(project, r, spec, 2)
    (a0,) = fake_server.send(project, [u], hostid=1)
    (a1,) = fake_server.send(project, [u], hostid=2)
    # the same host for both replicas of v: only without config.xml's rule (forced here)
    fake_server._exec(project, "UPDATE result SET server_state = 4, hostid = 3, userid = 3 WHERE name LIKE %s",
                      (f"{v}\\_%",))
    w = np.full(15, 0.5)
    files = {name: make_result(project.root, name, spec.name, unit, w, upload=project)
             for name, unit in ((a0, u), (a1, u), (f"{v}_0", v), (f"{v}_1", v))}
    env = script_env()
    for x, y in ((a0, a1), (a1, a0), (f"{v}_0", f"{v}_1")):  # BOINC compares a pair both ways
        c = run_script(project.root, f"../bin/bdl_compare {' '.join(files[x])} {' '.join(files[y])}", env)
        assert c.returncode == 0, c.stderr
    counts = BoincRegistry(store).quorum_counts()
    assert counts == {"comparisons": 2, "matched": 2, "across_hosts": 1, "across_users": 1, "same_host": 1}


# ---- one host must not take the window --------------------------------------------------------

def test_per_host_cap_leaves_work_for_the_next_host(quorum_job) -> None:
    project, store, spec, r = quorum_job
    install(project.root, InstallOptions(run_db_tools=False, gpu=False, min_quorum=1, checks=False))
    project.__dict__.pop("settings", None)
    create_units(project, r, spec, 4)  # a window of 4 (e.g. 2 hosts x 2 slots)
    # host 1 (2 CPUs) asks for a day of work: at most 2 in progress
    assert len(fake_server.request_work(project, hostid=1, ncpus=2, n_wanted=20)) == 2
    assert fake_server.request_work(project, hostid=1, ncpus=2, n_wanted=20, in_progress=2) == []
    # host 2 still gets its share
    assert len(fake_server.request_work(project, hostid=2, ncpus=2, n_wanted=20)) == 2
    aux = (project.root / "config_aux.xml").read_text()
    assert "<app_name>boincdl</app_name>" in aux and "<per_proc/>" in aux
    assert install(project.root, InstallOptions(run_db_tools=False, gpu=False, checks=False)).changes == []
    rep = install(project.root, InstallOptions(run_db_tools=False, gpu=False, checks=False, jobs_per_slot=0))
    assert rep.changes == ["config_aux.xml: removed the per-host cap on boincdl tasks"]


def test_per_host_cap_keeps_other_apps_limits(project) -> None:
    aux = project.root / "config_aux.xml"
    aux.write_text("<config>\n  <!-- other app -->\n  <max_jobs_in_progress>\n    <app>\n"
                   "      <app_name>example_app</app_name>\n      <total_limit><jobs>3</jobs></total_limit>\n"
                   "    </app>\n  </max_jobs_in_progress>\n</config>\n")
    install(project.root, InstallOptions(run_db_tools=False, checks=False))
    text = aux.read_text()
    assert "<!-- other app -->" in text and "<app_name>example_app</app_name>" in text
    assert text.count("<app_name>boincdl</app_name>") == 1


# ---- a restart must not make a host late --------------------------------------------------------

def test_a_restart_never_makes_a_host_miss_its_deadline(quorum_job) -> None:
    """A host finishing its task just as ``boinc-dl boinc restart`` runs is sent away for
    ``maintenance_delay``; it must still report before its deadline."""
    project, store, spec, r = quorum_job
    install(project.root, InstallOptions(run_db_tools=False, gpu=False, min_quorum=1, checks=False))
    project.__dict__.pop("settings", None)
    be, (u,) = create_units(project, r, spec, 1)
    t0 = int(time.time()) - 1000
    (res,) = fake_server.send(project, [u], now=t0)
    report_s = 5 + 13  # the client's poll, then its upload and report round (docs/boinc.md)
    done = t0 + LIMITS.delay_bound_s - report_s  # a task that just makes its timeout_s
    (project.root / "stop_sched").write_text("<stop/>\n")  # bin/stop, at that moment
    # "project down, come back in maintenance_delay"; for the client an RPC failure, after
    # which it backs off 60-120 s on its own (measured: 71 s after a 30 s request_delay)
    assert fake_server.scheduler_reply_delay(project) == 30
    wait = fake_server.client_wait_after_reply(project)
    assert wait == 120
    (project.root / "stop_sched").unlink()  # bin/start
    reported = done + wait + report_s
    assert reported > t0 + LIMITS.delay_bound_s  # later than timeout_s alone would allow
    assert fake_server.time_out(project, now=reported) == []  # not late: no re-issue
    fake_server.report(project, res, now=reported)
    assert be.regeneration_requests(spec.name) == []
    deadline = fake_server.rows(project, "SELECT report_deadline FROM result WHERE name = %s", (res,))[0]
    assert deadline["report_deadline"] >= reported


def test_fake_stop_writes_stop_sched_and_start_removes_it(project) -> None:
    env = script_env()
    subprocess.run([str(project.root / "bin/stop")], cwd=project.root, env=env, check=True, timeout=60)
    assert (project.root / "stop_sched").exists()
    assert fake_server.scheduler_reply_delay(project) == 3600.0  # BOINC's default maintenance_delay
    subprocess.run([str(project.root / "bin/start")], cwd=project.root, env=env, check=True, timeout=60)
    assert not (project.root / "stop_sched").exists()


# ---- prerequisites --------------------------------------------------------------------------------

def test_doctor_names_each_gap_and_its_fix(project, tmp_path) -> None:
    root = project.root
    cfg = (root / "config.xml").read_text()
    (root / "config.xml").write_text(cfg.replace("<db_passwd>s3cret</db_passwd>", "<db_passwd> </db_passwd>")
                                     .replace(f"<host>{os.uname().nodename.split('.')[0]}</host>",
                                              "<host>localhost</host>"))
    project.__dict__.pop("config", None)
    (root / "html/project/project.inc").write_text('<?php\ndefine("PROJECT", "REPLACE WITH PROJECT NAME");\n')
    (root / "html/ops/.htaccess").write_text("AuthType Basic\nrequire valid-user\n")
    found = {f.name: f for f in doctor.diagnose(project)}
    assert not found["database password"].ok and "<db_passwd>" in found["database password"].fix
    assert not found["daemon host"].ok and "<host>" in found["daemon host"].fix
    assert not found["project name"].ok and "PROJECT" in found["project name"].fix
    assert not found["admin page"].ok and "htpasswd -c" in found["admin page"].fix
    assert found["admin page"].detail.startswith("http://boinc.example.org/test_ops/boincdl.php")
    assert not found["app version"].ok and "--wrapper" in found["app version"].fix
    # install prints the same gaps as notes
    rep = install(root, InstallOptions(run_db_tools=False))
    notes = "\n".join(rep.notes)
    for name in ("database password", "daemon host", "project name", "admin page"):
        assert name in notes


def test_doctor_python_for_bin_start(tmp_path, project) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python").write_text("#!/bin/sh\necho 'no such interpreter' >&2\nexit 1\n")
    (fake / "python").chmod(0o755)
    f = doctor.check_python_for_start(project, path=str(fake))
    assert not f.ok and "no such interpreter" in f.detail and "python-is-python3" in f.fix
    # bin/start imports the project's boinc_path_config and BOINC's configxml, no MySQLdb:
    # a python without a database driver runs it (seen on a real server)
    (fake / "python").unlink()
    (fake / "python").symlink_to(sys.executable)
    (project.bin_dir / "boinc_path_config.py").write_text(
        f"import sys, os\nsys.path.insert(0, os.path.join({str(project.root)!r}, 'py'))\n")
    boinc_py = project.root / "py" / "Boinc"
    boinc_py.mkdir(parents=True)
    (boinc_py / "__init__.py").write_text("")
    (boinc_py / "boinc_project_path.py").write_text("")
    (boinc_py / "configxml.py").write_text("import xml.dom.minidom\n")
    assert doctor.check_python_for_start(project, path=f"{fake}:/usr/bin:/bin").ok is (
        shutil.which("python", path="/usr/bin:/bin") is not None)
    f = doctor.check_python_for_start(project, path=str(fake))
    assert "your PATH" not in f.detail  # ours runs bin/start's imports (cron's PATH may have none)
    (boinc_py / "configxml.py").write_text("import MySQLdb_that_is_not_there\n")
    f = doctor.check_python_for_start(project, path=str(fake))
    assert not f.ok and "your PATH" in f.detail and "MySQLdb_that_is_not_there" in f.detail


def test_doctor_web_user_access(project) -> None:
    nobody = pwd.getpwnam("nobody")
    project.log_dir.chmod(0o750)
    f = doctor.check_web_access(project, "nobody")
    assert not f.ok and str(project.log_dir) in f.detail and "chgrp" in f.fix
    assert doctor.user_can(nobody, project.root, write=False) == bool(project.root.stat().st_mode & 0o005 == 0o005)


def test_cli_doctor_exit_code(project) -> None:
    p = subprocess.run([sys.executable, "-m", "boinc_dl.server.backends.boinc", "doctor", "--project", str(project.root)],
                       capture_output=True, text=True, env=script_env(), cwd=REPO, timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr  # no app version yet
    assert "FIX  app version" in p.stdout and "ok   database password" in p.stdout


def test_compare_without_database_counts_hosts_unknown(env_no_db) -> None:
    project, store, spec = env_no_db
    u = f"{spec.name}__m0_e0001_s0000"
    w = np.full(15, 0.5)
    a = make_result(project.root, f"{u}_0", spec.name, u, w, upload=project)
    b = make_result(project.root, f"{u}_1", spec.name, u, w, upload=project)
    c = run_script(project.root, f"../bin/bdl_compare {' '.join(a)} {' '.join(b)}", script_env())
    assert c.returncode == 0, c.stderr
    assert BoincRegistry(store).quorum_counts() == {"comparisons": 1, "matched": 1, "hosts_unknown": 1}


@pytest.fixture
def env_no_db(project, tiny_boinc_job, redis_server):
    install(project.root, InstallOptions(run_db_tools=False, gpu=False, redis_url=redis_server.url, checks=False,
                                         command=[sys.executable, "-m", "boinc_dl.server.backends.boinc"]))
    store, spec = tiny_boinc_job
    assert json.loads(store.spec_json())["name"] == spec.name and tiny_fp().n_params == 15
    return project, store, spec


def test_rewritten_settings_keep_their_group(project) -> None:
    """The web server reads boinc-dl.yaml (0640) through the project's group: a rewrite by
    install (here: --min-quorum 2) keeps the group the admin gave it."""
    import grp

    if os.geteuid() != 0:
        pytest.skip("changing a file's group to another one needs root here")
    group = grp.getgrnam("nogroup" if "nogroup" in {g.gr_name for g in grp.getgrall()} else "daemon")
    root = project.root
    install(root, InstallOptions(run_db_tools=False, checks=False, redis_url="redis://localhost:6379/0"))
    settings = root / "boinc-dl.yaml"
    os.chown(settings, -1, group.gr_gid)
    rep = install(root, InstallOptions(run_db_tools=False, checks=False, min_quorum=2))
    assert "updated boinc-dl.yaml" in rep.changes
    assert settings.stat().st_gid == group.gr_gid and settings.stat().st_mode & 0o777 == 0o640


def test_doctor_leaves_tools_run_elsewhere_to_their_host(project, monkeypatch) -> None:
    """The docker stack runs bin/xadd and bin/start in BOINC's container: PHP and Python
    are not checked where boinc-dl runs."""
    monkeypatch.setenv("BDL_BOINC_TOOL_RUNNER", "/opt/boinc-dl/shims/run_in_boinc")
    found = {f.name: f for f in doctor.diagnose(project)}
    for name in ("php for bin/xadd", "python for bin/start"):
        assert found[name].ok and "run_in_boinc" in found[name].detail
