"""A full disk under the run directory, for real: ``boinc-dl run`` on a small tmpfs.

The installed command runs a VC-ASGD job (real TensorFlow, Redis, slots and
assimilators) in a run directory on a tmpfs mounted for the test; once epoch 1 has
closed, the test fills the file system to its last byte. Everything that writes there
(a slot's checkpoint or upload, a weights version, Redis's append-only file) then
fails with ENOSPC, which is the server's fault, not a unit's:

* the run stops with exit status 75 (EX_TEMPFAIL) and one line on stderr naming the
  path, the space free there and the space needed, and saying ``--resume``;
* no unit was given up or charged an error;
* once space is freed, ``--resume`` finishes the job and every (epoch, subset) is
  merged exactly once (tests/support/audit.py).

Skipped where a tmpfs cannot be mounted (mounting needs root or CAP_SYS_ADMIN).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from boinc_dl.server.assimilator.connection import connect
from boinc_dl.server.assimilator.redis_server import EmbeddedRedis
from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.common.diskfaults import EXIT_SERVER_FAULT
from tests.support.audit import audit_job

from .conftest import REPO

pytestmark = pytest.mark.slow
EPOCHS, SUBSETS = 5, 4
SPEC = f"""name: fulldisk
model: models:mlp
model_args: {{input_dim: 64, hidden: 32, n_classes: 10}}
dataset: {{name: digits}}
training: {{epochs: {EPOCHS}, batch_size: 32, learning_rate: 0.005, local_epochs: 1}}
vcasgd: {{n_subsets: {SUBSETS}, alpha: 0.5}}
units: {{timeout_s: 120, max_error_results: 2, max_total_results: 4}}
backend: {{kind: local, local: {{workers: 2, slots: 2, assimilators: 2}}}}
seed: 5
"""
ENV = {**os.environ, "COLUMNS": "200", "PYTHONPATH": str(REPO), "BDL_THREADS": "1"}


def _boinc_dl() -> list[str]:
    """The installed console script (the virtualenv's), as a user runs it."""
    exe = Path(sys.executable).parent / "boinc-dl"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "boinc_dl.server.cli"]


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 64 MB tmpfs of its own: what fills it fills nothing else."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or r.returncode}): needs root")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(path: Path) -> None:
    with path.open("wb", buffering=0) as f:
        try:
            while True:
                f.write(bytes(1 << 16))
        except OSError:
            pass
        try:  # the last few blocks
            while True:
                f.write(bytes(512))
        except OSError:
            pass


def _log(run_dir: Path) -> str:
    p = run_dir / "boinc-dl.log"
    return p.read_text(errors="replace") if p.exists() else ""


def _store_of(run_dir: Path):  # noqa: ANN202
    srv = EmbeddedRedis(run_dir / "redis").start()
    return srv, JobStore(connect(srv.url), "fulldisk")


def test_full_disk_pauses_the_run_and_resume_finishes_every_subset_once(tmp_path: Path, small_disk: Path) -> None:
    shutil.copy(REPO / "examples" / "models.py", tmp_path / "models.py")
    spec = tmp_path / "job.yaml"
    spec.write_text(SPEC)
    run_dir = small_disk / "run"
    cmd = [*_boinc_dl(), "run", str(spec), "--run-dir", str(run_dir), "-q"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    end = time.time() + 300
    while "epoch 1 closed" not in _log(run_dir):
        assert proc.poll() is None, proc.communicate()
        assert time.time() < end, "epoch 1 did not close"
        time.sleep(0.2)
    filler = small_disk / "filler"
    _fill(filler)
    t_full = time.time()
    out, err = proc.communicate(timeout=240)
    paused_after = time.time() - t_full

    # One clear line, the documented exit status, no traceback.
    assert proc.returncode == EXIT_SERVER_FAULT, (proc.returncode, out, err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    line = lines[0]
    assert line.startswith("error: server-side I/O fault (no unit was charged)"), line
    assert "No space left on device" in line or "append-only file" in line, line
    assert str(small_disk) in line and "free there" in line and "needed" in line and "--resume" in line, line
    assert "Traceback" not in out + err
    assert paused_after < 90, paused_after  # at most Redis's retry window (30 s) after the fault
    print(f"paused {paused_after:.1f} s after the disk filled: {line}")

    filler.unlink()  # the admin frees space
    srv, store = _store_of(run_dir)
    try:
        meta, counters = store.meta(), store.counters()
        # "paused" is recorded when Redis can still write (its append-only file may be
        # what failed first); never a finished or failed job.
        assert meta["status"] in ("paused", "running"), meta
        assert not store.failed() and counters.get("given_up", 0) == 0, counters
        assert counters.get("client_errors", 0) == 0 and counters.get("rejected", 0) == 0, counters
    finally:
        srv.stop()

    res = subprocess.run([*_boinc_dl(), "run", str(spec), "--run-dir", str(run_dir), "-q", "--resume"],
                         cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, (res.stdout, res.stderr)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "done", summary
    srv, store = _store_of(run_dir)
    try:
        a = audit_job(store, n_subsets=SUBSETS, epochs=EPOCHS)
        assert not a.problems, a.problems
        assert a.assimilated == EPOCHS * SUBSETS and a.failed == 0, a
        assert store.counters().get("given_up", 0) == 0
    finally:
        srv.stop()


def test_an_assimilators_aof_fault_names_redis_directory_not_its_working_directory(
        tiny_job, redis_server: EmbeddedRedis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk under Redis reaches the assimilator as a MISCONF reply, which names no
    file: the fault must point at Redis's directory (where the space is missing), whichever
    process meets it first. Before, the assimilator named its own working directory, and
    the run's one-line error said how much was free on the wrong file system."""
    import redis

    from boinc_dl.server.assimilator import framework
    from boinc_dl.server.common.diskfaults import ServerResourceError

    store, spec, _ = tiny_job
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)

    def refused(*_a: object, **_k: object) -> None:
        raise redis.ResponseError("MISCONF Errors writing to the AOF file: No space left on device")

    monkeypatch.setattr(framework, "_merge", refused)
    with pytest.raises(ServerResourceError) as caught:
        framework.assimilate(store, framework.Delivery("u0", unit="u0", files=[], trusted=True), spec=spec)
    assert caught.value.path == str(redis_server.data_dir)
    assert "append-only file" in caught.value.what and f"at {redis_server.data_dir};" in str(caught.value)
