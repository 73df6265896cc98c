"""The work generator daemon behaves like BOINC's daemons: it exits on the project's
stop_daemons file and on SIGHUP/SIGTERM, and logs; submit/cancel against a project."""

from __future__ import annotations

import select
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from boinc_dl.server.backends.boinc.daemon import WorkGeneratorDaemon, finalize_job, job_is_ours
from boinc_dl.server.backends.boinc.install import InstallOptions, install
from boinc_dl.server.backends.boinc.registry import BoincRegistry
from boinc_dl.server.backends.boinc.submit import cancel_job
from boinc_dl.server.common.errors import BoincDLError
from tests.boinc.conftest import REPO, calls, fake_db, script_env


def install_with(project, redis_url: str):
    """The project set up for boinc-dl with its daemons run by this Python, on ``redis_url``."""
    install(project.root, InstallOptions(redis_url=redis_url, gpu=False,
                                         command=[sys.executable, "-m", "boinc_dl.server.backends.boinc"]))
    return project


@pytest.fixture
def installed(project, redis_server):
    return install_with(project, redis_server.url)


def start_daemon(project) -> subprocess.Popen[str]:
    """The daemon as bin/start runs it, returned once it has said it started (its signal
    handlers are installed before that line; a fixed wait lost the race on a loaded
    machine, and a SIGHUP during start-up ends a process by the default action)."""
    p = subprocess.Popen([str(project.root / "bin" / "bdl_work_generator")], cwd=project.tmp_dir,
                         env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: list[str] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ready, _, _ = select.select([p.stdout], [], [], 1.0)
        line = p.stdout.readline() if ready else ""
        seen.append(line)
        if "work generator for" in line and "started" in line:
            return p
        assert p.poll() is None or line, "".join(seen) + p.stdout.read()
    p.kill()
    pytest.fail("the daemon never said it started: " + "".join(seen))


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM])
def test_exits_on_signal(installed, sig) -> None:
    p = start_daemon(installed)
    assert p.poll() is None
    p.send_signal(sig)
    out, _ = p.communicate(timeout=30)
    assert p.returncode == 0, out
    assert f"got {sig.name}: exiting now" in out


def test_exits_on_stop_daemons_file(installed) -> None:
    p = start_daemon(installed)
    (installed.root / "stop_daemons").write_text("<stop/>\n")  # what bin/stop writes
    out, _ = p.communicate(timeout=30)
    assert p.returncode == 0, out
    assert "stop_daemons" in out


def test_refuses_to_start_without_redis_url(project) -> None:
    install(project.root, InstallOptions(gpu=False, run_db_tools=False,
                                         command=[sys.executable, "-m", "boinc_dl.server.backends.boinc"]))
    p = subprocess.run([sys.executable, "-m", "boinc_dl.server.backends.boinc", "work-generator", "--project", str(project.root),
                        "--once"], cwd=REPO, env=script_env(), capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "no Redis URL" in p.stderr


def test_finished_job_is_swept_and_cancel(installed, tiny_boinc_job) -> None:
    store, spec = tiny_boinc_job
    assert job_is_ours(store.meta(), installed)
    # two units "created in BOINC" (fake database + ledger), then the job is cancelled
    units = sorted(store.unit_states())[:2]
    from tests.boinc.conftest import seed_db_app  # noqa: F401 - the app exists after install

    db = fake_db(installed.root)
    for i, u in enumerate(units):
        db["workunits"][u] = {"id": i + 1, "name": u, "error_mask": 0}
    import json

    (installed.root / "fake_boinc_db.json").write_text(json.dumps(db))
    store.r.sadd(BoincRegistry(store).created_key, *units)
    for u in units:
        store.transition_unit(u, "created", "in_progress")
    was, n = cancel_job(installed.root, spec.name)
    assert was is None and n == 4  # 2 in BOINC + 2 never created
    assert sorted(c["argv"][1] for c in calls(installed.root, "cancel_jobs")) == units
    assert all(fake_db(installed.root)["workunits"][u]["error_mask"] & 16 for u in units)
    meta = store.meta()
    assert meta["status"] == "cancelled" and meta["boinc_finalized"] == "1"
    assert set(store.unit_states().values()) == {"cancelled"}
    # the daemon sweeps a finished job again (late units), without error
    d = WorkGeneratorDaemon(installed, poll_s=0.1)
    assert d.one_pass() == 0
    from boinc_dl.server.backends.boinc.jobsystem import BoincJobSystem

    assert finalize_job(store, BoincJobSystem(installed, store.r)) == 0
    # cancelling it again changes nothing: it says how it had ended
    assert cancel_job(installed.root, spec.name) == ("cancelled", 0)
    assert store.meta()["finished_at"] == meta["finished_at"]


def test_cancel_unknown_job(installed) -> None:
    with pytest.raises(BoincDLError, match="no job named"):
        cancel_job(installed.root, "nope")


def test_other_projects_jobs_are_left_alone(installed, tiny_boinc_job) -> None:
    store, spec = tiny_boinc_job
    store.set_meta(boinc_project="/elsewhere")
    d = WorkGeneratorDaemon(installed, poll_s=0.1)
    assert d.one_pass() == 0
    assert calls(installed.root, "create_work") == []
    assert np.isfinite(1.0)


# ---- waking on a merge -------------------------------------------------------------------

def test_wakes_on_a_merge_not_at_the_end_of_the_pass_interval(installed, tiny_boinc_job) -> None:
    """A merge frees a window slot: the next pass runs within a fraction of a second, not
    after poll_s. (On a real server a host that reports finds "no tasks" otherwise, and
    waits for its next_rpc_delay; the example job took a minute and a half per 3 units.)"""
    import threading

    store, spec = tiny_boinc_job
    d = WorkGeneratorDaemon(installed, poll_s=30.0)
    d.connect()
    d.gens[spec.name] = object()  # the job is being driven (its generator is not needed here)
    threading.Timer(0.5, lambda: store.r.hset(store.k("assimilated"), "some_unit", "{}")).start()
    t0 = time.monotonic()
    assert d.wait_for_work(30.0) is True
    assert 0.4 < time.monotonic() - t0 < 2.0
    threading.Timer(0.3, lambda: store.r.hset(store.k("failed"), "other_unit", "gave up")).start()
    assert d.wait_for_work(30.0) is True  # a give-up moves the window too
    t0 = time.monotonic()
    assert d.wait_for_work(0.6) is False  # nothing happened: the whole interval
    assert time.monotonic() - t0 >= 0.6
    d.stop.set()
    t0 = time.monotonic()
    assert d.wait_for_work(30.0) is False and time.monotonic() - t0 < 1.0


def test_waits_without_jobs_or_redis(installed) -> None:
    d = WorkGeneratorDaemon(installed, poll_s=30.0)
    t0 = time.monotonic()
    assert d.wait_for_work(0.3) is False  # no job driven: a plain sleep
    assert time.monotonic() - t0 >= 0.3


def test_logs_once_what_in_its_redis_could_lose_merges(project, tmp_path, caplog) -> None:
    """An admin's own Redis with ``everysec``: the daemon says so in its log (once, not
    at every reconnect) and works on."""
    import logging

    from boinc_dl.server.assimilator.redis_server import EmbeddedRedis

    with EmbeddedRedis(tmp_path / "everysec", appendfsync="everysec") as srv:
        d = WorkGeneratorDaemon(install_with(project, srv.url), poll_s=0.1)
        with caplog.at_level(logging.INFO, logger="boinc_dl.server.backends.boinc.daemon"):
            d.connect()
            d.r = None
            d.connect()
            assert d.one_pass() == 0
    warned = [r for r in caplog.records if "everysec" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    assert "boinc-dl redis sync-aof" in warned[0].getMessage()
