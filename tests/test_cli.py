"""The ``boinc-dl`` command line, run as a real subprocess: bad input gives one clear
line and a non-zero exit; a real run writes its outputs; Ctrl-C then --resume loses
nothing and merges nothing twice."""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from .conftest import REPO

EXE = [sys.executable, "-m", "boinc_dl.server.cli"]
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "COLUMNS": "120"}


def _cli(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*EXE, *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)


def _spec(tmp: Path, text: str) -> Path:
    shutil.copy(REPO / "examples" / "models.py", tmp / "models.py")
    p = tmp / "job.yaml"
    p.write_text(text)
    return p


def _one_line_error(res: subprocess.CompletedProcess[str], code: int, needle: str) -> None:
    assert res.returncode == code, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr + res.stdout
    assert needle in res.stderr, res.stderr
    assert res.stderr.strip().startswith("error:")


def test_malformed_spec(tmp_path: Path) -> None:
    p = _spec(tmp_path, "name: j\nmodel: models:mlp\ndataset: {name: digits}\ntraining: {epochs: zero}\n")
    _one_line_error(_cli("run", str(p), cwd=tmp_path), 2, "training.epochs")


def _redis_left_under(root: Path) -> list[str]:
    """Command lines of redis-server processes whose socket lies under ``root``."""
    left = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "redis-server" in cmd and str(root) in cmd:
            left.append(cmd)
    return left


def test_missing_dataset_file(tmp_path: Path) -> None:
    p = _spec(tmp_path, "name: j\nmodel: models:mlp\ndataset: {train: nowhere.npz}\n")
    _one_line_error(_cli("run", str(p), "-q", cwd=tmp_path), 2, "dataset file not found")
    assert _redis_left_under(tmp_path) == []  # the private Redis stops with the failed run


@pytest.mark.parametrize("mop", [False, True])
def test_model_builder_cannot_be_imported(tmp_path: Path, mop: bool) -> None:
    extra = "mode: mop\nmop: {partitions: 2, param_grid: {learning_rate: [0.01]}}\n" if mop else ""
    p = _spec(tmp_path, "name: j\nmodel: no_such_module:build\ndataset: {name: digits}\n" + extra)
    _one_line_error(_cli("run", str(p), "-q", cwd=tmp_path), 2, "cannot import model module")
    assert _redis_left_under(tmp_path) == []


def test_redis_unreachable(tmp_path: Path) -> None:
    p = _spec(tmp_path, "name: j\nmodel: models:mlp\ndataset: {name: digits}\n")
    res = _cli("run", str(p), "-q", "--redis-url", "redis://127.0.0.1:1/0", cwd=tmp_path)
    _one_line_error(res, 3, "unreachable")


def test_status_of_unknown_job(tmp_path: Path, redis_server) -> None:
    res = _cli("status", "nope", "--redis-url", redis_server.url, cwd=tmp_path)
    _one_line_error(res, 2, "no job named 'nope'")


@pytest.mark.slow
def test_run_interrupt_resume_status(tmp_path: Path) -> None:
    # The example as shipped: its units train one local epoch per unit in flight, so its
    # early epochs climb steadily and four of them say whether training went on after
    # the resume.
    p = _spec(tmp_path, (REPO / "examples" / "digits-vcasgd.yaml").read_text())
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([*EXE, "run", str(p), "--epochs", "4", "--run-dir", str(run_dir), "-q"],
                            cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    log = run_dir / "boinc-dl.log"
    deadline = time.time() + 300
    while time.time() < deadline:
        if log.exists() and "epoch 1 closed" in log.read_text():
            break
        time.sleep(0.2)
    else:
        proc.kill()
        pytest.fail("epoch 1 never closed")
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches the whole foreground group
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (out, err)
    assert "--resume" in out and "Traceback" not in err

    st = _cli("status", "digits-vcasgd", "--run-dir", str(run_dir), "--json", cwd=tmp_path)
    assert st.returncode == 0, st.stderr
    state = json.loads(st.stdout)
    assert state["status"] == "interrupted" and state["closed_epochs"] >= 1

    res = _cli("run", str(p), "--epochs", "4", "--run-dir", str(run_dir), "--resume", "-q", cwd=tmp_path)
    assert res.returncode == 0, (res.stdout, res.stderr)
    assert "done" in res.stdout
    hist = json.loads((run_dir / "history.json").read_text())
    merges = Counter(u["unit"] for u in hist["units"] if "failed" not in u)
    assert len(merges) == 4 * 8 and set(merges.values()) == {1}  # 4 epochs x 8 subsets, once each
    assert [e["epoch"] for e in hist["epochs"]] == [1, 2, 3, 4]
    # Training went on from where it stopped: the units of the last epoch, trained from the
    # resumed server weights, score well above those of the first (medians of each epoch's
    # units on the validation set: 0.84 in epoch 1, 0.95-0.96 in epoch 4 over six runs).
    by_epoch: dict[int, list[float]] = {}
    for u in hist["units"]:
        if "failed" not in u:
            by_epoch.setdefault(int(u["epoch"]), []).append(float(u["val_acc"]))
    first, last = statistics.median(by_epoch[1]), statistics.median(by_epoch[4])
    assert last > first + 0.05, (first, last)
    # ... and so does the server model, steadily: the default rule caps each result at 2/8
    # of its update (8 in flight), so the rounds of units sent from one base no longer throw
    # it back (uncapped, epochs read 0.68, 0.20, 0.66, 0.20 in one run of this test).
    assert {u["merge_rule"] for u in hist["units"] if "failed" not in u} == {"delta(lr=1, poly p=1, cap 0.25)"}
    acc = [e["val_acc"] for e in hist["epochs"]]
    assert acc[-1] > acc[0] and min(acc) > 0.7, acc
    for name in ("final_model.keras", "learning_curve.png", "epochs.csv", "units.csv"):
        assert (run_dir / name).exists()
    st = _cli("status", "--run-dir", str(run_dir), cwd=tmp_path)
    assert st.returncode == 0 and "done" in st.stdout
    # The run directory as the argument, as a user types it after a run (absolute, and
    # relative to where they stand), reads the same state; a job name still means runs/<job>.
    for where in (str(run_dir), "run"):
        st = _cli("status", where, "--json", cwd=tmp_path)
        assert st.returncode == 0, st.stderr
        assert json.loads(st.stdout)["status"] == "done" and json.loads(st.stdout)["run_dir"] == where
    st = _cli("status", "digits-vcasgd", cwd=tmp_path)
    assert st.returncode != 0 and "runs/digits-vcasgd" in st.stderr
