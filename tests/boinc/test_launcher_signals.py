"""The app version's launcher under BOINC's wrapper, with real processes and signals.

BOINC's wrapper (played by ``fake_wrapper.py``) suspends and resumes its direct child
with SIGSTOP/SIGCONT and, on a client quit, sends SIGTERM, waits, SIGTERMs the
descendants it listed and exits. Seen on a real client: a shell left between the
wrapper and Python was the only process stopped, Python trained on while "suspended",
and after ``boinccmd --quit`` the stopped shells stayed behind with defunct Python
children. Each test runs the shipped launcher on a real unit (TensorFlow included).
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

import pytest

from boinc_dl.server.backends.boinc import artifacts
from tests.boinc.fake_wrapper import alive, descendants
from tests.test_client_app import copy_inputs, make_unit

REPO = Path(__file__).resolve().parents[2]
WRAPPER = Path(__file__).resolve().parent / "fake_wrapper.py"
# ~3000 batches of 8: several seconds of training, checkpoints every 0.3 s
UNIT = {"n": 2000, "n_val": 200, "batch_size": 8, "local_epochs": 12, "checkpoint_every_s": 0.3}
# The spot-notice tests need training to outlast the watcher's 2 s poll after the first
# checkpoint, with room to spare on a loaded machine (12 local epochs can take 2 s).
LONG_UNIT = {**UNIT, "local_epochs": 60}


@pytest.fixture(scope="module")
def unit_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("launcher_unit")
    make_unit(src, **UNIT)
    return src


@pytest.fixture(scope="module")
def long_unit_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("launcher_long_unit")
    make_unit(src, **LONG_UNIT)
    return src


@pytest.fixture
def launcher(tmp_path: Path) -> Path:
    path = tmp_path / "bdl_launcher_1.0.sh"
    path.write_text(artifacts.launcher())
    path.chmod(0o755)
    return path


def env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "BDL_PYTHON": sys.executable, "TF_CPP_MIN_LOG_LEVEL": "2",
            "BDL_PREEMPT_PROVIDER": "none", **extra}


def state(pid: int) -> str:
    """The process state letter (R, S, T, Z...), or '' once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [a.decode() for a in f.read().split(b"\0") if a]


def done_batches(slot: Path) -> int:
    try:
        return int(json.loads((slot / "progress.json").read_text()).get("done", -1))
    except (OSError, ValueError):
        return -1


def checkpointed(slot: Path) -> int:
    try:
        return int(json.loads((slot / "checkpoint.json").read_text()).get("done", -1))
    except (OSError, ValueError):
        return -1


def wait_until(cond: Callable[[], bool], what: str, log: Path, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}:\n{log.read_text()[-3000:]}")


def start_wrapper(launcher: Path, slot: Path, log: Path, grace: float = 3.0,
                  **extra: str) -> tuple[subprocess.Popen[str], int]:
    """The fake wrapper running the launcher in ``slot``; (wrapper, task pid)."""
    err = open(log, "a")  # noqa: SIM115 - closed with the test's tmp_path
    w = subprocess.Popen([sys.executable, str(WRAPPER), "--grace", str(grace), str(launcher), "--threads", "1"],
                         cwd=slot, env=env(**extra), stdout=subprocess.PIPE, stderr=err, text=True)
    assert w.stdout is not None
    line = w.stdout.readline()
    assert line.startswith("child "), line
    return w, int(line.split()[1])


def test_launcher_is_python_itself(unit_src: Path, launcher: Path, tmp_path: Path) -> None:
    """The wrapper's child is the training process: no shell in between."""
    slot = copy_inputs(unit_src, tmp_path / "slot")
    log = tmp_path / "stderr.txt"
    w, pid = start_wrapper(launcher, slot, log)
    try:
        wait_until(lambda: checkpointed(slot) > 0, "a first checkpoint", log)
        argv = cmdline(pid)
        assert "boinc_dl.client_app" in argv and argv[0] == sys.executable, argv
        assert descendants(w.pid) == [pid], "a process between the wrapper and Python"
    finally:
        w.send_signal(signal.SIGTERM)
        w.wait(30)
    assert state(pid) in ("", "Z")


def test_suspend_stops_training_and_resume_finishes(unit_src: Path, launcher: Path, tmp_path: Path) -> None:
    slot = copy_inputs(unit_src, tmp_path / "slot")
    log = tmp_path / "stderr.txt"
    w, pid = start_wrapper(launcher, slot, log)
    wait_until(lambda: checkpointed(slot) > 0, "a first checkpoint", log)
    w.send_signal(signal.SIGUSR1)  # suspend
    wait_until(lambda: state(pid) == "T", "the task stopped", log, timeout=10)
    time.sleep(1.2)  # progress.json is rewritten at most once a second
    before = done_batches(slot)
    time.sleep(2.0)
    assert done_batches(slot) == before, "the task trained on while suspended"
    assert state(pid) == "T"
    w.send_signal(signal.SIGUSR2)  # resume
    assert w.wait(120) == 0, log.read_text()[-3000:]
    m = json.loads((slot / "metrics.json").read_text())
    assert m["batches"] > before and (slot / "weights_out.h5").is_file()
    assert state(pid) in ("", "Z")


def test_quit_while_running_checkpoints_and_leaves_nothing(unit_src: Path, launcher: Path, tmp_path: Path) -> None:
    """Quit: SIGTERM -> checkpoint, exit 75, and no resume loop left running."""
    slot = copy_inputs(unit_src, tmp_path / "slot")
    log = tmp_path / "stderr.txt"
    # a resume delay of 0 would let an old-style resume loop start training again
    w, pid = start_wrapper(launcher, slot, log, BDL_RESUME_DELAY_S="0")
    wait_until(lambda: checkpointed(slot) > 0, "a first checkpoint", log)
    tree = descendants(w.pid)
    t = time.monotonic()
    w.send_signal(signal.SIGTERM)
    assert w.wait(30) == 0
    wait_until(lambda: not any(alive(p) for p in tree), "the task's processes gone", log, timeout=10)
    gone_s = time.monotonic() - t
    assert "signal SIGTERM: checkpointing and stopping" in log.read_text()
    assert checkpointed(slot) == done_batches(slot) > 0
    assert not (slot / "weights_out.h5").exists()
    assert gone_s < 3.0, f"{gone_s:.1f} s: the task ignored SIGTERM until the wrapper's grace ran out"


def test_quit_while_suspended_leaves_no_stopped_process(unit_src: Path, launcher: Path, tmp_path: Path) -> None:
    """The case seen on a real client: suspend, then ``boinccmd --quit``. The stopped task
    never sees SIGTERM; once the wrapper exits nothing of the task may stay behind."""
    slot = copy_inputs(unit_src, tmp_path / "slot")
    log = tmp_path / "stderr.txt"
    w, pid = start_wrapper(launcher, slot, log, grace=1.0)
    wait_until(lambda: checkpointed(slot) > 0, "a first checkpoint", log)
    tree = descendants(w.pid)
    w.send_signal(signal.SIGUSR1)
    wait_until(lambda: state(pid) == "T", "the task stopped", log, timeout=10)
    w.send_signal(signal.SIGTERM)
    assert w.wait(30) == 0
    wait_until(lambda: not any(alive(p) for p in tree), "the task's processes gone", log, timeout=10)
    assert checkpointed(slot) > 0  # the periodic checkpoint: a restart resumes from it


def test_wrapper_killed_takes_the_task_with_it(unit_src: Path, launcher: Path, tmp_path: Path) -> None:
    """The client SIGKILLs a wrapper that did not quit in time: no orphan trains on."""
    slot = copy_inputs(unit_src, tmp_path / "slot")
    log = tmp_path / "stderr.txt"
    w, pid = start_wrapper(launcher, slot, log)
    wait_until(lambda: checkpointed(slot) > 0, "a first checkpoint", log)
    tree = descendants(w.pid)
    w.send_signal(signal.SIGKILL)
    w.wait(10)
    wait_until(lambda: not any(alive(p) for p in tree), "the orphaned task gone", log, timeout=2)
    time.sleep(3.0)  # longer than the rest of the unit's training
    assert not (slot / "weights_out.h5").exists(), "an orphan trained on after its wrapper died"


def test_spot_notice_on_a_surviving_vm_resumes_in_the_same_process(long_unit_src: Path, launcher: Path,
                                                                   tmp_path: Path) -> None:
    """Exit 75 after a spot notice must not become a compute error while the VM lives on:
    the task waits, then re-execs itself (same pid for the wrapper) and finishes."""
    slot = copy_inputs(long_unit_src, tmp_path / "slot")
    log = tmp_path / "stderr.txt"
    notice = tmp_path / "notice"
    w, pid = start_wrapper(launcher, slot, log, BDL_PREEMPT_NOTICE_FILE=str(notice), BDL_RESUME_DELAY_S="3")
    wait_until(lambda: checkpointed(slot) > 0, "a first checkpoint", log)
    notice.write_text("spot reclaim (test)\n")
    wait_until(lambda: "resuming in 3 s" in log.read_text(), "the resume wait", log, timeout=30)
    notice.unlink()  # a false alarm: the VM stays
    assert w.wait(120) == 0, log.read_text()[-3000:]
    m = json.loads((slot / "metrics.json").read_text())
    assert m["resumed"] is True and m["redone_batches"] == 0
    assert descendants(w.pid) == []


def test_spot_notice_then_sigterm_during_the_wait_exits_75_at_once(long_unit_src: Path, launcher: Path,
                                                                   tmp_path: Path) -> None:
    slot = copy_inputs(long_unit_src, tmp_path / "slot")
    log = tmp_path / "stderr.txt"
    notice = tmp_path / "notice"
    w, pid = start_wrapper(launcher, slot, log, grace=30.0, BDL_PREEMPT_NOTICE_FILE=str(notice),
                           BDL_RESUME_DELAY_S="600")
    wait_until(lambda: checkpointed(slot) > 0, "a first checkpoint", log)
    notice.write_text("spot reclaim (test)\n")
    wait_until(lambda: "resuming in 600 s" in log.read_text(), "the resume wait", log, timeout=30)
    t = time.monotonic()
    w.send_signal(signal.SIGTERM)
    assert w.wait(30) == 0
    wait_until(lambda: not alive(pid), "the waiting task gone", log, timeout=10)
    assert time.monotonic() - t < 3.0


def test_resumes_are_bounded(long_unit_src: Path, launcher: Path, tmp_path: Path) -> None:
    """With the resumes used up, exit 75 reaches the wrapper (which reports the error)."""
    slot = copy_inputs(long_unit_src, tmp_path / "slot")
    log = tmp_path / "stderr.txt"
    notice = tmp_path / "notice"
    w, _ = start_wrapper(launcher, slot, log, BDL_PREEMPT_NOTICE_FILE=str(notice), BDL_MAX_RESUMES="0")
    wait_until(lambda: checkpointed(slot) > 0, "a first checkpoint", log)
    notice.write_text("spot reclaim (test)\n")
    assert w.wait(30) == 75
    assert "resuming" not in log.read_text()
