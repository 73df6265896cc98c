"""BOINC's intake and file deleter against the merge log: the script BOINC's
``script_assimilator`` runs copies an upload into a working dir it deletes, BOINC's file
deleter then removes the upload; a merge's retained input survives both."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from boinc_dl.server.assimilator.connection import connect
from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.backends.boinc.install import InstallOptions, install
from tests.boinc.conftest import make_result, run_script, script_env


def test_boincs_intake_and_file_deleter_leave_the_retained_input_intake_and_file_deleter_leave_the_retained_input(project, tiny_boinc_job, redis_server) -> None:
    """BOINC's script copies the upload into a working dir it deletes, then BOINC's file
    deleter removes the upload: the merge's retained input survives both, and a Redis
    restarted after that gets the same weights back."""
    install(project.root, InstallOptions(redis_url=redis_server.url, run_db_tools=False, gpu=False,
                                         command=[sys.executable, "-m", "boinc_dl.server.backends.boinc"]))
    store, spec = tiny_boinc_job
    n = store.layout("0").n
    for i in range(3):
        u = f"{spec.name}__m0_e0001_s{i:04d}"
        paths = make_result(project.upload_dir, f"{u}_0", spec.name, u,
                            np.random.default_rng(i).standard_normal(n), upload=project)
        p = run_script(project.root, f"../bin/bdl_assimilate {17 + i} {' '.join(paths)}", script_env())
        assert p.returncode == 0, p.stderr
        for q in paths:  # the file deleter
            Path(q).unlink()
    u = f"{spec.name}__m0_e0001_s0001"
    entry = json.loads(store.r.hget(store.mlog_key("0"), u))
    assert (project.job_dir(spec.name) / "durable" / "inputs" / "0" / f"{u}.{entry['f']}.h5").is_file()
    assert not list((project.boincdl_dir / "spool").glob("*.*/*"))  # the intake's working copies are gone
    before = store.snapshot("0").flat.tobytes()
    redis_server.kill()
    redis_server.restart()
    assert JobStore(connect(redis_server.url), spec.name).snapshot("0").flat.tobytes() == before
