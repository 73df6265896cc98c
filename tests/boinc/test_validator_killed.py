"""The validator's scripts killed mid-run give no verdict: BOINC asks again, the result stays good.

On a real server (BOINC master, script_validator, two 7.20 clients), a ``kill -9`` of
``bdl_validate``'s Python reached ``script_validator`` as status 137 through
``system()``'s shell: "init script ... returned: 137", the good result marked invalid
(outcome 6, validate_state 2) against its host, and a replacement replica the scheduler
could not send to either host under ``one_result_per_host_per_wu``: the job waited with
both clients idle. The installed shims now answer 3 (``VAL_RESULT_TRANSIENT_ERROR``) for a
run that ended without a verdict, and the fake project judges the status as
``script_validator`` does (``fake_server.judge``).

The kill is real: the shim is run through a shell as ``system()`` runs it, and the test
SIGKILLs boinc-dl's validator process from outside while it runs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from boinc_dl.server.backends.boinc.install import InstallOptions, install
from tests.boinc import fake_server
from tests.boinc.conftest import HOST, make_result, run_script, script_env
from tests.boinc.test_semantics import create_units, job  # noqa: F401 - fixture

INIT, VALID, INVALID, SUCCESS, VALIDATE_ERROR = 0, 1, 2, 1, 6

# boinc-dl's own command, held before it starts while a "hold" file exists, so that the
# test can kill it from outside at a moment it chooses (its pid is written first)
HOLDING = """\
import os, runpy, sys, time
here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "pid"), "w") as f:
    f.write(str(os.getpid()))
while os.path.exists(os.path.join(here, "hold")):
    time.sleep(0.05)
sys.argv = ["boinc_dl.server.backends.boinc", *sys.argv[1:]]
runpy.run_module("boinc_dl.server.backends.boinc", run_name="__main__", alter_sys=True)
"""


def _install_holding(project, tmp_path: Path, redis_url: str) -> Path:
    """Reinstall the project's shims with the holding command; returns its directory."""
    d = tmp_path / "holding"
    d.mkdir()
    (d / "bdl_holding.py").write_text(HOLDING)
    install(project.root, InstallOptions(run_db_tools=False, gpu=False, redis_url=redis_url,
                                         command=[sys.executable, str(d / "bdl_holding.py")]))
    return d


def _killed_while_running(project, d: Path, script: str) -> subprocess.CompletedProcess[str]:
    """Run ``../bin/<script>`` as BOINC's daemon does; SIGKILL boinc-dl's process once it runs."""
    (d / "hold").touch()
    (d / "pid").unlink(missing_ok=True)
    p = subprocess.Popen(script, shell=True, cwd=project.root / f"tmp_{HOST}", env=script_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not (d / "pid").exists() or not (d / "pid").read_text():
        assert time.monotonic() < deadline and p.poll() is None, "the validator never started"
        time.sleep(0.02)
    os.kill(int((d / "pid").read_text()), signal.SIGKILL)
    out, err = p.communicate(timeout=30)
    (d / "hold").unlink()
    return subprocess.CompletedProcess(script, p.returncode, out, err)


def test_init_script_killed_is_asked_again_and_the_result_stays_valid(job, redis_server, tmp_path) -> None:  # noqa: F811
    project, store, spec, r = job
    d = _install_holding(project, tmp_path, redis_server.url)
    _, (u,) = create_units(project, r, spec, 1)
    (res,) = fake_server.send(project, [u])
    paths = make_result(project.root, res, spec.name, u, np.ones(15), upload=project)
    fake_server.report(project, res)
    killed = _killed_while_running(project, d, f"../bin/bdl_validate {' '.join(paths)}")
    assert killed.returncode == 3, (killed.returncode, killed.stderr)
    assert "without a verdict (status 137)" in killed.stderr
    # script_validator: a transient error leaves the result as it was, no mark on the host
    assert fake_server.judge(project, res, killed.returncode) == (SUCCESS, INIT)
    assert fake_server.rows(project, "SELECT COUNT(*) AS n FROM result WHERE workunitid = "
                                     "(SELECT workunitid FROM result WHERE name = %s)", (res,))[0]["n"] == 1
    # BOINC validates it again later: now it runs to its verdict, valid, and merges once
    again = run_script(project.root, f"../bin/bdl_validate {' '.join(paths)}", script_env())
    assert again.returncode == 0, again.stderr
    assert fake_server.judge(project, res, again.returncode) == (SUCCESS, VALID)
    a = run_script(project.root, f"../bin/bdl_assimilate 1 {' '.join(paths)}", script_env())
    assert a.returncode == 0, a.stderr
    assert store.unit_states_of([u]) == ["assimilated"] and store.version("0") == 1


def test_compare_script_killed_is_no_mismatch(job, redis_server, tmp_path) -> None:  # noqa: F811
    project, store, spec, r = job
    d = _install_holding(project, tmp_path, redis_server.url)
    _, (u,) = create_units(project, r, spec, 1)
    a = make_result(project.root, f"{u}_0", spec.name, u, np.ones(15), upload=project)
    b = make_result(project.root, f"{u}_1", spec.name, u, np.ones(15), upload=project)
    killed = _killed_while_running(project, d, f"../bin/bdl_compare {' '.join(a)} {' '.join(b)}")
    # 137 would read "the results differ" (sched/script_validator.cpp: compare_results)
    assert killed.returncode == 3, (killed.returncode, killed.stderr)
    agreed = run_script(project.root, f"../bin/bdl_compare {' '.join(a)} {' '.join(b)}", script_env())
    assert agreed.returncode == 0, agreed.stderr


@pytest.mark.parametrize("status", [0, 1, 3])
def test_the_verdicts_pass_through_the_shim(tmp_path, status: int) -> None:
    """The shim changes only a missing verdict: boinc-dl's own 0, 1 and 3 reach BOINC as they are."""
    from boinc_dl.server.backends.boinc import artifacts

    shim = tmp_path / "bdl_validate"
    shim.write_text(artifacts.shim([sys.executable, "-c", f"raise SystemExit({status})"], tmp_path,
                                   "validate-init"))
    shim.chmod(0o755)
    assert subprocess.run(f"{shim} a b", shell=True, capture_output=True).returncode == status
    gone = tmp_path / "bdl_gone"
    gone.write_text(artifacts.shim([str(tmp_path / "no-such-python")], tmp_path, "validate-init"))
    gone.chmod(0o755)
    p = subprocess.run(str(gone), shell=True, capture_output=True, text=True)
    assert p.returncode == 3 and "status 127" in p.stderr

