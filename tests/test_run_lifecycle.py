"""``boinc-dl run`` as a real process: its private Redis SIGKILLed mid-run, the run
stopped by SIGTERM or SIGHUP, a job in which every unit fails, a crashed run's status.

Each test starts the real command line (TensorFlow, Redis, slot and assimilator
processes) and looks at the processes it left behind through psutil.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest

from .conftest import REPO

pytestmark = pytest.mark.slow
EXE = [sys.executable, "-m", "boinc_dl.server.cli"]
ENV = {**os.environ, "COLUMNS": "120", "PYTHONPATH": str(REPO)}
ENV.pop("TF_CPP_MIN_LOG_LEVEL", None)  # the command must keep TensorFlow quiet by itself

SPEC = """name: life
model: models:mlp
model_args: {input_dim: 64, hidden: 32, n_classes: 10}
dataset: {name: digits}
training: {epochs: EPOCHS, batch_size: 32, learning_rate: LR, local_epochs: 1}
vcasgd: {n_subsets: 4, alpha: 0.5}
units: {timeout_s: 60}
backend: {kind: local, local: {workers: 2, slots: 2, assimilators: 2}}
seed: 3
"""


def _spec(tmp: Path, epochs: int = 3, lr: str = "0.005") -> Path:
    shutil.copy(REPO / "examples" / "models.py", tmp / "models.py")
    p = tmp / "job.yaml"
    p.write_text(SPEC.replace("EPOCHS", str(epochs)).replace("LR", lr))
    return p


def _start(tmp: Path, spec: Path, run_dir: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([*EXE, "run", str(spec), "--run-dir", str(run_dir), "-q"], cwd=tmp, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(pred, timeout: float, proc: subprocess.Popen[str], what: str) -> None:  # noqa: ANN001
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"run ended before {what}: rc {proc.returncode}\n{out}\n{err}")
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"timed out waiting for {what}")


def _family(pid: int) -> list[psutil.Process]:
    """The run's process and all its descendants (Redis, fork server, slots, assimilators)."""
    p = psutil.Process(pid)
    return [p, *p.children(recursive=True)]


def _redis_of(run_dir: Path) -> psutil.Process | None:
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "redis-server" in cmd and str(run_dir) in cmd:
            return p
    return None


def _survivors(procs: list[psutil.Process], timeout: float = 30.0) -> list[str]:
    """Processes of ``procs`` still alive after ``timeout`` (the fork server, holding
    TensorFlow, takes a few seconds to tear down on a loaded machine)."""
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return [f"{p.pid} {' '.join(p.cmdline())[:120]}" for p in alive
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def _assimilated(run_dir: Path) -> Counter[str]:
    hist = json.loads((run_dir / "history.json").read_text())
    return Counter(u["unit"] for u in hist["units"] if "failed" not in u)


def _tf_noise(text: str) -> list[str]:
    return [line for line in text.splitlines()
            if any(k in line for k in ("absl::", "oneDNN", "cuda", "cpu_feature_guard", "I0000", "W0000", "E0000"))]


def test_redis_sigkilled_mid_run_is_restarted_and_the_run_merges_each_unit_once(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _start(tmp_path, _spec(tmp_path, epochs=3), run_dir)
    _wait_for(lambda: "epoch 1 closed" in (run_dir / "boinc-dl.log").read_text(errors="replace")
              if (run_dir / "boinc-dl.log").exists() else False, 300, proc, "epoch 1 to close")
    redis = _redis_of(run_dir)
    assert redis is not None
    redis.send_signal(signal.SIGKILL)  # a real crash of the run's Redis, mid-run
    killed_at = time.time()
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, (out, err)
    assert "Traceback" not in err and _tf_noise(out + err) == [], err
    log = (run_dir / "boinc-dl.log").read_text(errors="replace")
    assert "restarting it on its AOF" in log and "redis-server restarted" in log
    merges = _assimilated(run_dir)
    assert len(merges) == 3 * 4 and set(merges.values()) == {1}, merges  # every unit, exactly once
    hist = json.loads((run_dir / "history.json").read_text())
    after = [u["t"] for u in hist["units"] if u.get("t") and u["t"] > killed_at]
    assert after and min(after) - killed_at < 10.0  # the next merge came within seconds
    assert _redis_of(run_dir) is None  # the restarted Redis stopped with the run


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_stop_the_run_cleanly(tmp_path: Path, sig: signal.Signals) -> None:
    run_dir = tmp_path / "run"
    proc = _start(tmp_path, _spec(tmp_path, epochs=20), run_dir)
    # Wait until every kind of child is up: Redis, fork server, slots and assimilators.
    _wait_for(lambda: (run_dir / "boinc-dl.log").exists()
              and "merged" in (run_dir / "boinc-dl.log").read_text(errors="replace")
              or len(_family(proc.pid)) >= 8, 300, proc, "the run to start its processes")
    family = _family(proc.pid)
    assert _redis_of(run_dir) in family
    t0 = time.time()
    proc.send_signal(sig)  # to the run alone, as kill(1) or systemd would
    out, err = proc.communicate(timeout=60)
    stop_s = time.time() - t0
    assert proc.returncode == 128 + sig, (proc.returncode, out, err)
    assert "--resume" in out and "Traceback" not in err
    assert stop_s < 30, stop_s
    assert _survivors(family) == []
    st = subprocess.run([*EXE, "status", "--run-dir", str(run_dir), "--json"], cwd=tmp_path, env=ENV,
                        capture_output=True, text=True, timeout=120)
    state = json.loads(st.stdout)
    assert state["status"] == "interrupted" and signal.Signals(sig).name in state["reason"]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSEGV], ids=["sigkill", "sigsegv"])
def test_sigkilled_run_leaves_no_redis_and_shows_as_crashed(tmp_path: Path, sig: signal.Signals) -> None:
    """No clean-up at all (SIGKILL; or a crash in a native library, SIGSEGV): only the
    kernel's parent-death signal is left. A crash prints every thread's Python stack."""
    run_dir = tmp_path / "run"
    proc = _start(tmp_path, _spec(tmp_path, epochs=20), run_dir)
    _wait_for(lambda: len(_family(proc.pid)) >= 8, 300, proc, "the run to start its processes")
    time.sleep(2.0)  # a heartbeat or two
    family = _family(proc.pid)
    proc.send_signal(sig)
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == -sig
    if sig == signal.SIGSEGV:
        assert "Fatal Python error: Segmentation fault" in err and "most recent call first" in err, err[-3000:]
        stacks = err.split("Fatal Python error")[1]
        # every thread, and where in the run's own code they were
        assert stacks.count("Thread 0x") + stacks.count("Current thread 0x") >= 2, stacks[:3000]
        assert "/server/" in stacks or "boinc_dl" in stacks, stacks[:3000]
    assert _survivors(family) == []
    st = subprocess.run([*EXE, "status", "--run-dir", str(run_dir)], cwd=tmp_path, env=ENV,
                        capture_output=True, text=True, timeout=120)
    assert st.returncode == 0, st.stderr
    assert "crashed" in st.stdout and "creating epoch" not in st.stdout


def _job_recorded(run_dir: Path) -> bool:
    """Whether the run's private Redis holds the job's record yet (read from its AOF,
    so as not to race the run for its Redis)."""
    aof = run_dir / "redis"
    return any(b"created_at" in f.read_bytes() for f in aof.rglob("*.aof*") if f.is_file()) if aof.exists() else False


def test_run_sigkilled_before_its_first_heartbeat_shows_as_crashed(tmp_path: Path) -> None:
    """Killed in start-up, right after the job's record was written and before the run's
    first heartbeat (its slots are still starting): ``status`` must say crashed, not
    running for ever (the record and its owner are written in one commit)."""
    run_dir = tmp_path / "run"
    proc = _start(tmp_path, _spec(tmp_path, epochs=20), run_dir)
    _wait_for(lambda: _job_recorded(run_dir), 300, proc, "the job's record")
    family = _family(proc.pid)
    proc.kill()
    proc.communicate(timeout=30)
    assert _survivors(family) == []
    st = subprocess.run([*EXE, "status", "--run-dir", str(run_dir), "--json"], cwd=tmp_path, env=ENV,
                        capture_output=True, text=True, timeout=120)
    assert st.returncode == 0, st.stderr
    state = json.loads(st.stdout)
    assert state["status"] == "crashed", state
    assert "--resume" in state["reason"]


def test_a_job_in_which_every_unit_fails_ends_failed_fast(tmp_path: Path) -> None:
    """A learning rate that makes every unit diverge: the job fails after the first few
    units with their error on the console and exit 1, instead of "done"."""
    run_dir = tmp_path / "run"
    spec = _spec(tmp_path, epochs=3, lr="1.0e+30")
    t0 = time.time()
    res = subprocess.run([*EXE, "run", str(spec), "--run-dir", str(run_dir), "-q"], cwd=tmp_path, env=ENV,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 1, (res.stdout, res.stderr)
    err_lines = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(err_lines) == 1 and "failed" in err_lines[0] and "units all failed" in err_lines[0], res.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert summary["backend"]["merged"] == 0
    backend = summary["backend"]
    # fast: it did not try every unit of every epoch (3 x 4 distinct units). Re-issues of
    # the failed ones go on being sent until the verdict lands, more of them on a loaded
    # machine, so they are bounded apart: far below trying every unit to its error limit.
    assert backend["sent"] - backend["reissued"] < 3 * 4, backend
    assert backend["sent"] <= 3 * 4 * 2, backend
    assert time.time() - t0 < 300
    st = subprocess.run([*EXE, "status", "--run-dir", str(run_dir)], cwd=tmp_path, env=ENV,
                        capture_output=True, text=True, timeout=120)
    assert "failed" in st.stdout and "creating epoch" not in st.stdout


def test_a_job_that_fails_to_prepare_leaves_no_process_behind(tmp_path: Path) -> None:
    """The user's data file is not an .npz: the run exits 2 with the file's error within
    a second, and the local backend's fork server, which the run starts before preparing
    the job (to import TensorFlow beside the run's own import) and which is then still
    importing it, is gone when the run is."""
    spec = _spec(tmp_path)
    spec.write_text(spec.read_text().replace("dataset: {name: digits}", "dataset: {train: data.npz}"))
    (tmp_path / "data.npz").write_text("these are not arrays\n")
    tag = f"bdl-lifecycle-{os.getpid()}-{time.time_ns()}"
    res = subprocess.run([*EXE, "run", str(spec), "--run-dir", str(tmp_path / "run"), "-q"], cwd=tmp_path,
                         env={**ENV, "BDL_TEST_TAG": tag}, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert "data.npz: unreadable dataset file" in res.stderr and "Traceback" not in res.stderr, res.stderr
    tagged = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("BDL_TEST_TAG") == tag:
                tagged.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    # multiprocessing's resource tracker ends when it reads the end of its pipe: a moment
    assert not _survivors(tagged, timeout=2.0)


def test_a_run_whose_every_slot_dies_at_start_fails_with_the_logs_path(tmp_path: Path) -> None:
    """A script fed to ``python3 -`` that calls ``run_job``: multiprocessing's fork server
    cannot import a ``__main__`` read from stdin, so every slot dies before it is ready.
    No unit runs, so none fails: the run once retried them every 30 s for ever. It now
    fails once every slot has died at start 3 times in a row, naming the log that has the
    slots' error, and leaves no process behind."""
    spec = _spec(tmp_path, epochs=1, lr="0.01")
    script = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from boinc_dl.server.common.spec import load_spec\n"
        "from boinc_dl.server.run import run_job\n"
        f"res = run_job(load_spec(Path({str(spec)!r})), Path({str(tmp_path / 'run')!r}), live=False,\n"
        f"              search_path=Path({str(REPO / 'examples')!r}), backend_opts={{'workers': 1, 'slots': 2}})\n"
        "print(json.dumps({'status': res.status, 'reason': res.reason}))\n")
    t0 = time.time()
    p = subprocess.Popen([sys.executable, "-"], cwd=tmp_path, env=ENV, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(script, timeout=300)
    assert p.returncode == 0, err[-3000:]
    res = json.loads(out.strip().splitlines()[-1])
    assert res["status"] == "failed", res
    assert "every slot died at start" in res["reason"] and "local-backend.log" in res["reason"], res
    assert time.time() - t0 < 120
    # The slots' own error is where the reason says.
    assert "No such file or directory" in (tmp_path / "run" / "local-backend.log").read_text()
    # (the fork server exits when it reads its parent's end of the pipe closed: a moment)
    left = [q for q in psutil.process_iter(["cmdline"]) if str(tmp_path) in " ".join(q.info["cmdline"] or [])]
    _, alive = psutil.wait_procs(left, timeout=10)
    assert not alive, [q.cmdline() for q in alive]
