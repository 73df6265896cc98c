"""``boinc-dl submit``: one submit per BOINC job at a time (an flock on the job's
``submit.lock``, freed by the kernel however its holder ends), run as a user runs it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

from ..test_first_hour import BDL  # the installed command

MODEL = '''import keras


def build():
    return keras.Sequential([keras.Input(shape=(20,)), keras.layers.Dense(8, activation="relu"),
                             keras.layers.Dense(3, activation="softmax")])
'''


def test_one_submit_per_job(tmp_path: Path, project, redis_server) -> None:
    (project.root / "templates" / "boincdl_in").write_text("<input_template/>\n")  # as 'boinc install' leaves it
    (project.root / "boinc-dl.yaml").write_text(json.dumps({"redis_url": redis_server.url}))
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "data.npz", x=rng.normal(size=(200, 20)).astype(np.float32), y=rng.integers(0, 3, 200))
    (tmp_path / "mymodel.py").write_text(MODEL)
    (tmp_path / "job.yaml").write_text("name: mine\nmodel: mymodel:build\ndataset: {train: data.npz}\n"
                                       "training: {epochs: 1}\n")
    env = {**os.environ, "COLUMNS": "120"}
    env.pop("BDL_REDIS_URL", None)
    submit = [BDL, "submit", "job.yaml", "--project", str(project.root)]

    lock = project.job_dir("mine") / "submit.lock"
    code = ("import time\nfrom boinc_dl.server.common.filelock import FileLock\n"
            f"FileLock({str(lock)!r}, 'boinc-dl submit of mine').acquire()\nprint('held', flush=True)\n"
            "time.sleep(120)\n")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    try:
        busy = subprocess.run(submit, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert busy.returncode == 2, (busy.stdout, busy.stderr)
        err = busy.stderr.strip()
        assert err.startswith("error:") and "\n" not in err and "in use by another boinc-dl submit of mine" in err
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()

    ok = subprocess.run(submit, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, (ok.stdout, ok.stderr)
    again = subprocess.run(submit, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and "already submitted" in again.stderr and "--resume" in again.stderr
