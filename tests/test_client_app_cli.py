"""``python -m boinc_dl.client_app`` as a real subprocess: SIGKILL and restart, SIGTERM, exit codes.

Each TensorFlow subprocess costs several seconds of start-up on this machine, so the
unit is sized to train for a few seconds and the tests wait on the slot's own files
(``checkpoint.json``, ``progress.json``) rather than on fixed sleeps.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import pytest

from boinc_dl.client_app import checkpoint
from boinc_dl.client_app.train import PROGRESS_JSON, ModelCache, run_unit
from boinc_dl.server.common.weights import Fingerprint
from tests.support.once import build_once
from tests.test_client_app import THREADS, copy_inputs, make_unit, weights_out

REPO = Path(__file__).resolve().parents[1]
# ~3000 batches of 8: a few seconds of training, long enough to be interrupted twice
UNIT = {"n": 2000, "n_val": 200, "batch_size": 8, "local_epochs": 12, "checkpoint_every_s": 0.3}
# The notice test needs training to outlast the watcher's 2 s poll after the first
# checkpoint, with room to spare (12 local epochs can train in under 2 s); the SIGKILL test
# needs several of progress.json's once-a-second reports to land between checkpoints.
LONG_UNIT = {**UNIT, "local_epochs": 60}


def start_cli(slot: Path, log: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "2",
                "BDL_PREEMPT_PROVIDER": "none", **(env or {})}
    with open(log, "ab") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "boinc_dl.client_app", "--slot", str(slot), "--threads", "1", *args],
            cwd=REPO, env=full_env, stdout=subprocess.DEVNULL, stderr=err,
        )


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def wait_for(cond: Callable[[], bool], proc: subprocess.Popen[bytes], log: Path, what: str,
             timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        if proc.poll() is not None:
            pytest.fail(f"client exited ({proc.returncode}) before {what}:\n{log.read_text()}")
        time.sleep(0.02)
    proc.kill()
    pytest.fail(f"timed out waiting for {what}:\n{log.read_text()}")


def positions(slot: Path) -> tuple[int, int]:
    """(batches in the last checkpoint, batches in the last progress report).

    The checkpoint's sidecar JSON: cheap to poll while the client runs, but written
    after the HDF5 rename, so a kill between the two leaves it one checkpoint behind.
    """
    ck = read_json(slot / checkpoint.CKPT_JSON) or {}
    pr = read_json(slot / PROGRESS_JSON) or {}
    return int(ck.get("done", -1)), int(pr.get("done", -1))


def checkpointed_done(slot: Path) -> int:
    """Batches in the checkpoint a resume will use: the HDF5 file's own position record."""
    with h5py.File(slot / checkpoint.CKPT_H5, "r") as f:
        pos = f.attrs["position"]
    return int(json.loads(pos.decode() if isinstance(pos, bytes) else pos)["done"])


def _unit_with_reference(tmp_path_factory: pytest.TempPathFactory, worker_id: str, name: str,
                         spec: dict) -> tuple[Path, Fingerprint, np.ndarray, dict]:
    """The unit's inputs, plus the weights and metrics of an uninterrupted in-process run:
    built once per session under ``name`` (tests copy the inputs before they run them)."""
    def build(where: Path) -> tuple[Path, Fingerprint, np.ndarray, dict]:
        src = where / "src"
        src.mkdir()
        fp = make_unit(src, **spec)
        ref = copy_inputs(src, where / "ref")
        res = run_unit(ref, cache=ModelCache(), threads=THREADS)
        return src, fp, weights_out(ref, fp), res.metrics

    return build_once(tmp_path_factory, worker_id, f"cli_{name}", build)


@pytest.fixture(scope="module")
def unit(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> tuple[Path, Fingerprint, np.ndarray, dict]:
    """The unit's inputs, plus the weights and metrics of an uninterrupted in-process run."""
    return _unit_with_reference(tmp_path_factory, worker_id, "unit", UNIT)


@pytest.fixture(scope="module")
def long_unit(tmp_path_factory: pytest.TempPathFactory,
              worker_id: str) -> tuple[Path, Fingerprint, np.ndarray, dict]:
    """As ``unit``, training five times longer (see LONG_UNIT)."""
    return _unit_with_reference(tmp_path_factory, worker_id, "long_unit", LONG_UNIT)


def test_sigkill_mid_unit_then_restart_resumes_bitwise(long_unit: tuple[Path, Fingerprint, np.ndarray, dict],
                                                       tmp_path: Path) -> None:
    # The long unit: progress is reported once a second and checkpoints come every 0.3 s,
    # so "progress past the last checkpoint" is a short window each second; the short
    # unit trains in under 2 s and a loaded machine can miss its only window.
    src, fp, reference, ref_metrics = long_unit
    slot = copy_inputs(src, tmp_path / "slot")
    log = tmp_path / "stderr.txt"
    p = start_cli(slot, log)
    # kill when progress has moved past the last checkpoint: that work is lost for real
    wait_for(lambda: 0 < positions(slot)[0] < positions(slot)[1], p, log, "progress past a checkpoint")
    p.send_signal(signal.SIGKILL)
    assert p.wait(30) == -signal.SIGKILL
    progress_done = positions(slot)[1]
    ck_done = checkpointed_done(slot)
    assert 0 < ck_done and progress_done < ref_metrics["batches"]
    assert not (slot / "weights_out.h5").exists()

    t = time.monotonic()
    p = start_cli(slot, log)
    assert p.wait(120) == 0, log.read_text()
    restart_s = time.monotonic() - t
    m = json.loads((slot / "metrics.json").read_text())
    assert m["resumed"] is True and m["resumed_at_batch"] == ck_done and m["restarts"] == 1
    # progress.json is written at most once a second, so it may lag a checkpoint taken
    # just before the kill: redone_batches is a lower bound, never negative
    assert m["redone_batches"] == max(0, progress_done - ck_done)
    assert m["examples_seen"] == ref_metrics["examples_seen"]
    assert np.array_equal(weights_out(slot, fp), reference), "resumed run differs from the uninterrupted one"
    assert m["train_loss"] == ref_metrics["train_loss"] and m["val_acc"] == ref_metrics["val_acc"]
    print(f"\nSIGKILL at batch {progress_done}/{m['batches']}, last checkpoint at {ck_done}: "
          f"redone {m['redone_batches']} batches; restart to done {restart_s:.1f} s "
          f"(load {m['load_s']:.1f} s, train {m['train_s']:.2f} s of {m['train_s_total']:.2f} s total, "
          f"{m['checkpoints']} checkpoints in {m['checkpoint_s']:.2f} s)")


def test_sigterm_checkpoints_and_exits_75(unit: tuple[Path, Fingerprint, np.ndarray, dict], tmp_path: Path) -> None:
    src, fp, reference, _ = unit
    slot = copy_inputs(src, tmp_path / "slot")
    log = tmp_path / "stderr.txt"
    p = start_cli(slot, log)
    wait_for(lambda: positions(slot)[0] > 0, p, log, "a first checkpoint")
    t = time.monotonic()
    p.send_signal(signal.SIGTERM)
    assert p.wait(30) == 75, log.read_text()
    stop_s = time.monotonic() - t
    err = log.read_text()
    assert "signal SIGTERM: checkpointing and stopping" in err and "Traceback" not in err
    ck_done, progress_done = positions(slot)
    assert ck_done == progress_done > 0  # the stop checkpointed the last batch trained
    assert not (slot / "weights_out.h5").exists()

    # a restart (here in-process, TensorFlow is loaded already) resumes with nothing redone
    m = run_unit(slot, cache=ModelCache(), threads=THREADS).metrics
    assert m["resumed"] is True and m["resumed_at_batch"] == ck_done and m["redone_batches"] == 0
    assert np.array_equal(weights_out(slot, fp), reference)
    print(f"\nSIGTERM -> exit 75 in {stop_s:.2f} s, checkpoint at batch {ck_done}")


@pytest.mark.slow
def test_preemption_notice_checkpoints_and_exits_75(long_unit: tuple[Path, Fingerprint, np.ndarray, dict],
                                                    tmp_path: Path) -> None:
    """The real watcher (its notice-file source, as the local backend uses it) stops the unit."""
    src, fp, reference, _ = long_unit
    slot = copy_inputs(src, tmp_path / "slot")
    log = tmp_path / "stderr.txt"
    notice = tmp_path / "preempt-notice"
    p = start_cli(slot, log, env={"BDL_PREEMPT_NOTICE_FILE": str(notice)})
    wait_for(lambda: positions(slot)[0] > 0, p, log, "a first checkpoint")
    t = time.monotonic()
    notice.write_text("spot reclaim (test)\n")
    assert p.wait(30) == 75, log.read_text()
    notice_s = time.monotonic() - t
    assert "preemption notice" in log.read_text()
    ck_done, progress_done = positions(slot)
    assert ck_done == progress_done > 0
    m = run_unit(slot, cache=ModelCache(), threads=THREADS).metrics
    assert m["resumed"] is True and m["redone_batches"] == 0
    assert np.array_equal(weights_out(slot, fp), reference)
    print(f"\nnotice -> exit 75 in {notice_s:.2f} s")


# ---- exit codes without TensorFlow: inputs are checked before it is imported ----------------


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "BDL_PREEMPT_PROVIDER": "none"}
    return subprocess.run([sys.executable, "-m", "boinc_dl.client_app", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)


def test_bad_wu_json_exits_1_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "wu.json").write_text("{broken")
    r = run_cli("--slot", str(tmp_path), "--quiet")
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("client_app: error: wu.json: not a valid workunit"), r.stderr


def test_missing_input_exits_1(unit: tuple[Path, Fingerprint, np.ndarray, dict], tmp_path: Path) -> None:
    slot = copy_inputs(unit[0], tmp_path / "slot")
    (slot / "val.npz").unlink()
    r = run_cli("--slot", str(slot), "--quiet")
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == ["client_app: error: missing input file val.npz"], r.stderr


@pytest.mark.parametrize("args", [["--threads", "0"], ["--bogus"], ["--slot", "/nonexistent/slot/dir"]])
def test_usage_errors_exit_2(args: list[str]) -> None:
    r = run_cli(*args)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
