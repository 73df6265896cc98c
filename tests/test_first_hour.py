"""A new user's first hour (issue #26) and the run side of hostile hosts (issue #28), as a
user meets them: the installed ``boinc-dl`` run as a subprocess in a temporary directory
with the user's own model module and ``.npz``.

Runs use the minimal spec (name, mode, model, dataset, epochs) on 400 generated examples
and a small local backend given on the command line (1 host x 2 slots), so the spec's
own defaults are what is tested.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from .support.procs import busy_slot, children
from .support.userjob import MINIMAL, MODEL, user_files

# The installed command: beside this interpreter (a virtualenv), else on PATH.
BDL = str(Path(sys.executable).parent / "boinc-dl") if (Path(sys.executable).parent / "boinc-dl").exists() \
    else (shutil.which("boinc-dl") or "boinc-dl")
ENV = {**{k: v for k, v in os.environ.items() if not k.startswith("TF_")}, "COLUMNS": "120", "BDL_THREADS": "1"}
SMALL = ["--workers", "1", "--slots", "2", "--assimilators", "1"]


def bdl(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([BDL, *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)


def one_line_error(res: subprocess.CompletedProcess[str], needle: str, code: int = 2) -> str:
    assert res.returncode == code, (res.returncode, res.stdout, res.stderr)
    err = res.stderr.strip()
    assert "Traceback" not in res.stdout + res.stderr
    assert err.startswith("error:") and "\n" not in err, err
    assert needle in err, err
    return err


def merges(run_dir: Path) -> Counter[str]:
    hist = json.loads((run_dir / "history.json").read_text())
    return Counter(u["unit"] for u in hist["units"] if "failed" not in u)


# ---- a minimal spec: defaults chosen and said, progress lines, a readable summary ---------------

@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """One minimal-spec run to completion (its output is not a terminal)."""
    tmp = tmp_path_factory.mktemp("first-run")
    spec = user_files(tmp)
    res = bdl("run", str(spec), *SMALL, cwd=tmp)
    assert res.returncode == 0, (res.stdout, res.stderr)
    return tmp, res


def test_minimal_spec_says_what_it_chose_and_prints_a_line_per_epoch(finished) -> None:
    tmp, res = finished
    out = res.stdout
    # 320 training examples on 2 slots: one subset per slot, local epochs from the units in flight.
    assert "vcasgd.n_subsets = 2" in out and "training.local_epochs = 4" in out, out
    lines = out.splitlines()
    epoch_lines = [ln for ln in lines if ln.startswith("epoch ")]
    assert [ln.split(" - ")[0] for ln in epoch_lines] == ["epoch 1/2", "epoch 2/2"], out
    assert all(re.search(r"val_acc \d\.\d{4} - val_loss \d+\.\d{4}", ln) for ln in epoch_lines), out
    # The summary: one "epochs" row, files by name, no "creating units" once it is over.
    assert len(re.findall(r"│ epochs", out)) == 1 and "epochs closed" in out and "2 of 2" in out, out
    assert "creating" not in out
    assert "learning_curve.png" in out and "final_model.keras" in out
    summary = json.loads((tmp / "runs" / "mine" / "summary.json").read_text())
    assert summary["status"] == "done"
    assert summary["settings"]["n_subsets"] == 2 and summary["settings"]["local_epochs"] == 4
    assert sorted(summary["settings"]["derived"]) == ["training.local_epochs", "vcasgd.merge_rule", "vcasgd.n_subsets"]
    assert summary["settings"]["merge_rule"] == "delta" and "vcasgd.merge_rule = delta" in out  # 2 in flight
    # The planner's check simulates the backend that ran (the command line's 1 x 2 slots,
    # P = 1), not the spec's default 4 x 2 (it predicted 0.06 s for a 0.28 s epoch so).
    assert summary["planner"]["configuration"] == {"workers": 1, "slots": 2, "assimilators": 1}
    assert set(merges(tmp / "runs" / "mine").values()) == {1} and len(merges(tmp / "runs" / "mine")) == 2 * 2
    # One run trained the job: its totals are this run's, and the summary says no more.
    job = summary["job"]
    assert job["runs"] == 1 and job["merged"] == 4 and job["resubmitted"] == 0, job
    assert summary["elapsed_s"] - 1.0 <= job["active_s"] <= summary["elapsed_s"] + 1.0, summary
    assert " runs" not in out and "re-submitted" not in out, out
    # (How well the defaults learn is bench/bench_learning.py's to measure: against Keras.)


def test_too_few_examples_for_every_slot_keep_as_many_units_in_flight_as_subsets(tmp_path: Path) -> None:
    """250 examples on 4 x 2 slots: 3 subsets of at least 64, and 3 units in flight, so
    that each epoch's units start from weights that learned from the epoch before (with
    all 8 slots in flight, a 3-epoch job's 9 units all started from its initial weights)."""
    spec = user_files(tmp_path, MINIMAL.replace("epochs: 2", "epochs: 3"), n=250)
    res = bdl("run", str(spec), "--workers", "4", "--slots", "2", "--assimilators", "1", cwd=tmp_path)
    assert res.returncode == 0, (res.stdout, res.stderr)
    assert "vcasgd.n_subsets = 3" in res.stdout and "vcasgd.window = 3" in res.stdout, res.stdout
    assert "3 subsets per epoch on 8 slots" in res.stdout
    hist = json.loads((tmp_path / "runs" / "mine" / "history.json").read_text())
    units = [u for u in hist["units"] if "failed" not in u]
    assert len(units) == 9 and len({u["unit"] for u in units}) == 9
    later = [u["base_version"] for u in units if u["epoch"] > 1]
    assert later and min(later) >= 1, later  # no unit of epochs 2-3 trained from the initial weights


def test_a_second_run_offers_resume_new_overwrite(finished) -> None:
    tmp, _ = finished
    first = tmp / "runs" / "mine"
    before = (first / "summary.json").read_text()

    again = bdl("run", "job.yaml", *SMALL, cwd=tmp)
    err = one_line_error(again, "already exists")
    assert "--resume" in err and "--new" in err and "--overwrite" in err

    both = bdl("run", "job.yaml", "--resume", "--new", cwd=tmp)
    one_line_error(both, "do not go together")

    # The run that finished the job killed before it wrote its summary: a --resume writes
    # the outputs with the job's story from its store (it said "elapsed 0.0 s", its own).
    story = json.loads(before)
    (first / "summary.json").unlink()
    done = bdl("run", "job.yaml", "--resume", *SMALL, cwd=tmp)
    assert done.returncode == 0 and "already done" in done.stdout, (done.stdout, done.stderr)
    told = json.loads((first / "summary.json").read_text())
    assert told["job"] == story["job"] and abs(told["elapsed_s"] - story["elapsed_s"]) < 1.0, (told, story)
    assert re.search(rf"elapsed\s+│ {told['elapsed_s']:.1f} s", done.stdout), done.stdout
    before = (first / "summary.json").read_text()

    new = bdl("run", "job.yaml", "--new", "--epochs", "1", *SMALL, cwd=tmp)
    assert new.returncode == 0, (new.stdout, new.stderr)
    second = tmp / "runs" / "mine-2"
    assert "mine-2" in new.stdout and json.loads((second / "summary.json").read_text())["status"] == "done"
    assert (first / "summary.json").read_text() == before  # the earlier run untouched

    st = bdl("status", cwd=tmp)  # both runs, each with its own name and folder
    assert st.returncode == 0, st.stderr
    assert "job mine (vcasgd)" in st.stdout and "job mine-2 (vcasgd)" in st.stdout, st.stdout
    assert re.search(r"run directory\s+│ runs/mine\s", st.stdout) and "runs/mine-2" in st.stdout, st.stdout
    # --json: one document, an array of both jobs (it printed two objects one after the other)
    st = bdl("status", "--json", cwd=tmp)
    assert st.returncode == 0 and [j["job"] for j in json.loads(st.stdout)] == ["mine", "mine-2"], st.stdout

    (first / "notes.txt").write_text("the user's own file")
    over = bdl("run", "job.yaml", "--overwrite", "--epochs", "1", *SMALL, cwd=tmp)
    assert over.returncode == 0, (over.stdout, over.stderr)
    assert (first / "notes.txt").read_text() == "the user's own file"  # only the run's own files go
    assert json.loads((first / "summary.json").read_text())["status"] == "done"
    assert len(merges(first)) == 2  # a fresh job of 1 epoch, not the old one continued


# ---- one run per directory; SIGKILL, then --resume loses and repeats nothing --------------------

class _Lines:
    """A process's stdout, read as it comes."""

    def __init__(self, proc: subprocess.Popen[str]):
        self.lines: list[str] = []
        self.t = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self.t.start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.lines.append(line)

    def wait_for(self, prefix: str, proc: subprocess.Popen[str], timeout: float = 300) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if any(ln.startswith(prefix) for ln in self.lines):
                return
            if proc.poll() is not None:
                break
            time.sleep(0.1)
        proc.kill()
        pytest.fail(f"no line {prefix!r}: {''.join(self.lines)}")


def test_a_slot_process_killed_or_crashed_mid_unit_is_not_left_to_its_deadline(tmp_path: Path) -> None:
    """A slot's process SIGKILLed mid-unit (a user, the out-of-memory killer) restarts in
    its slot from its checkpoint, as BOINC's client restarts an app killed so; one that
    crashes (SIGSEGV) is a client error, issued again at once. Neither waits for the
    unit's deadline (units.timeout_s, 300 s by default; a killed slot held its unit that
    long), and every unit is merged once."""
    import random

    rng = random.Random(os.getpid())
    # units of a few seconds (1,600 examples, 20 passes), so that kills land inside them
    spec = user_files(tmp_path, MINIMAL.replace("epochs: 2", "epochs: 14, local_epochs: 20"), n=4000)
    t0 = time.time()
    proc = subprocess.Popen([BDL, "run", str(spec), *SMALL], cwd=tmp_path, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    log = tmp_path / "runs" / "mine" / "boinc-dl.log"
    try:
        for sig, said in ((signal.SIGKILL, "restarting it there from its checkpoint"),
                          (signal.SIGSEGV, "a client error, issued again")):
            landed, give_up = False, time.time() + 180
            while not landed and time.time() < give_up:  # until one lands mid-unit, at a random moment of it
                time.sleep(rng.uniform(0, 1.5))
                victim = busy_slot(proc.pid)
                assert proc.poll() is None, proc.stdout.read()
                if victim is None:
                    continue
                os.kill(victim, sig)
                end = time.time() + 15
                while not landed and time.time() < end:
                    landed = said in (log.read_text() if log.exists() else "")
                    time.sleep(0.2)
            assert landed, f"no {sig.name} landed mid-unit: {log.read_text()[-3000:]}"
        # The fork server itself: it reports its children dead (exit 255) while they run on,
        # orphaned; they are killed, and their units restart in place.
        while busy_slot(proc.pid) is None and proc.poll() is None:
            time.sleep(0.1)
        server = next(k for k in children(proc.pid) if b"forkserver" in Path(f"/proc/{k}/cmdline").read_bytes())
        orphans = children(server)
        os.kill(server, signal.SIGKILL)
        out, _ = proc.communicate(timeout=600)
        assert orphans and not [k for k in orphans if Path(f"/proc/{k}/cmdline").exists()
                                and Path(f"/proc/{k}/cmdline").read_bytes()], orphans
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    took = time.time() - t0
    assert proc.returncode == 0, out
    run_dir = tmp_path / "runs" / "mine"
    m = merges(run_dir)
    assert len(m) == 14 * 2 and set(m.values()) == {1}, m
    backend = json.loads((run_dir / "summary.json").read_text())["backend"]
    assert backend["app_restarts"] >= 1 and backend["client_errors"] >= 1 and backend["reissued"] >= 1, backend
    assert backend["timed_out"] == 0 and took < 300, (took, backend)


def test_one_run_per_directory_and_resume_after_sigkill(tmp_path: Path) -> None:
    spec = user_files(tmp_path, MINIMAL.replace("epochs: 2", "epochs: 3"))
    args = [BDL, "run", str(spec), *SMALL]
    # Two runs of one spec started together: exactly one proceeds.
    a_started = time.time()
    a = subprocess.Popen(args, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    b_started = time.time()
    b = subprocess.Popen(args, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first_done = None
    deadline = time.time() + 120
    while first_done is None and time.time() < deadline:
        first_done = next((p for p in (a, b) if p.poll() is not None), None)
        time.sleep(0.05)
    assert first_done is not None, "neither run gave way"
    running = b if first_done is a else a
    out, err = first_done.communicate()
    assert first_done.returncode == 2, (out, err)
    assert err.strip().startswith("error:") and "\n" not in err.strip() and "in use by another boinc-dl run" in err

    lines = _Lines(running)
    lines.wait_for("epoch 1/3", running)
    # Frozen mid-run (so that it cannot finish meanwhile), it still owns its directory:
    # neither a plain run nor --resume touches it.
    running.send_signal(signal.SIGSTOP)
    started = min(a_started, b_started)
    frozen_at = time.time()
    for extra in ([], ["--resume"]):
        res = bdl("run", str(spec), *SMALL, *extra, cwd=tmp_path, timeout=120)
        one_line_error(res, "in use by another boinc-dl run")

    running.send_signal(signal.SIGKILL)  # no clean-up at all
    running.wait(timeout=60)
    res = bdl("run", str(spec), "--resume", *SMALL, cwd=tmp_path)
    assert res.returncode == 0, (res.stdout, res.stderr)
    run_dir = tmp_path / "runs" / "mine"
    m = merges(run_dir)
    assert len(m) == 3 * 2 and set(m.values()) == {1}, m  # every unit merged, none twice
    hist = json.loads((run_dir / "history.json").read_text())
    assert [e["epoch"] for e in hist["epochs"]] == [1, 2, 3]

    # The summary tells the job's story, not the resuming process's: two runs, every unit
    # merged (some by the first), the units re-submitted on resuming, and the job's run
    # time: the killed run's up to its last heartbeat plus this one's, the frozen minutes
    # and the pause between them not counted.
    summary = json.loads((run_dir / "summary.json").read_text())
    job = summary["job"]
    said = re.search(r"resumed: (\d+) unit\(s\) in flight re-submitted", res.stdout)
    assert job["runs"] == 2 and job["merged"] == 6 and job["resubmitted"] == (int(said[1]) if said else 0), job
    assert summary["backend"]["merged"] < 6, summary  # the first run merged epoch 1's
    # the first run's clock at its epoch-1 line, as the line itself says
    first_line = next(ln for ln in lines.lines if ln.startswith("epoch 1/3"))
    at_epoch_1 = float(re.search(r" - ([\d.]+) s", first_line)[1])
    first_run = job["active_s"] - summary["elapsed_s"]
    assert at_epoch_1 - 1.0 <= first_run <= frozen_at - started + 1.0, (first_run, at_epoch_1, job, summary)
    out = " ".join(res.stdout.split())
    assert f"{job['active_s']:.1f} s in 2 runs ({summary['elapsed_s']:.1f} s this run)" in out, res.stdout
    assert f"6 merged ({summary['backend']['merged']} by this run)" in out, res.stdout
    st = json.loads(bdl("status", str(run_dir), "--json", cwd=tmp_path).stdout)
    assert st["run_time_s"] == pytest.approx(job["active_s"], abs=0.01) and st["counters"]["runs"] == 2, st
    text = " ".join(bdl("status", str(run_dir), cwd=tmp_path).stdout.split())
    assert f"2 runs, {job['active_s']:.1f} s of run time" in text, text


def test_cancel_stops_a_running_job_and_leaves_a_finished_one_alone(tmp_path: Path, finished) -> None:
    """``boinc-dl cancel`` from another terminal: the run ends as cancelled with the weights
    it had (final_model.keras) and no unit left "in progress"; a finished job keeps its
    status (a cancel once turned a done job into a cancelled one)."""
    spec = user_files(tmp_path, MINIMAL.replace("epochs: 2", "epochs: 40"))
    proc = subprocess.Popen([BDL, "run", str(spec), *SMALL], cwd=tmp_path, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = _Lines(proc)
    lines.wait_for("epoch 1/40", proc)
    res = bdl("cancel", "mine", cwd=tmp_path)
    assert res.returncode == 0 and res.stdout.strip() == "job mine cancelled", (res.stdout, res.stderr)
    assert proc.wait(timeout=120) == 1
    time.sleep(0.2)  # the reader thread drains the last lines
    out = "".join(lines.lines)
    assert "job mine cancelled: cancelled by the user" in out, out
    run_dir = tmp_path / "runs" / "mine"
    st = json.loads(bdl("status", str(run_dir), "--json", cwd=tmp_path).stdout)
    assert st["status"] == "cancelled" and st["closed_epochs"] < 40, st
    assert set(st["units"]) <= {"assimilated", "cancelled"}, st["units"]  # nothing left in progress
    assert (run_dir / "final_model.keras").stat().st_size > 0 and "final_model.keras" in out
    again = bdl("cancel", "mine", cwd=tmp_path)
    assert again.returncode == 0 and again.stdout.strip() == "job mine already cancelled: nothing to cancel"
    # the finished run of the fixture: done it stays
    done_dir, _res = finished
    before = json.loads(bdl("status", str(done_dir / "runs" / "mine"), "--json", cwd=done_dir).stdout)
    res = bdl("cancel", "mine", "--run-dir", str(done_dir / "runs" / "mine"), cwd=done_dir)
    assert res.returncode == 0 and res.stdout.strip() == "job mine already done: nothing to cancel", res.stdout
    st = json.loads(bdl("status", str(done_dir / "runs" / "mine"), "--json", cwd=done_dir).stdout)
    assert before["status"] == st["status"] == "done" and st["reason"] == before["reason"], st


# ---- validate: clear refusals, quiet with keras imported at the top -----------------------------

@pytest.mark.parametrize(("extra", "field"), [
    ("units: {timeout_s: 1.0e-9}\n", "units.timeout_s"),
    ("training: {epochs: 2, batch_size: 1000000000}\n", "training.batch_size"),
])
def test_validate_refuses_settings_that_cannot_train(tmp_path: Path, extra: str, field: str) -> None:
    text = MINIMAL.replace("training: {epochs: 2}\n", "") + extra
    if "training" not in extra:
        text += "training: {epochs: 2}\n"
    user_files(tmp_path, text)
    for cmd in ("validate", "run"):
        one_line_error(bdl(cmd, "job.yaml", cwd=tmp_path), field)


def test_a_misnamed_field_is_named_with_the_one_meant(tmp_path: Path) -> None:
    user_files(tmp_path, MINIMAL.replace("dataset: {train: data.npz}", "dataset: {path: data.npz}"))
    for cmd in ("validate", "run"):
        err = one_line_error(bdl(cmd, "job.yaml", cwd=tmp_path), "dataset.path")
        assert err.endswith("dataset.path: unknown field (did you mean train?)"), err


def test_validate_refuses_too_few_training_examples(tmp_path: Path) -> None:
    user_files(tmp_path, MINIMAL.replace("dataset: {train: data.npz}", "dataset: {train: data.npz, limit: 3}"))
    err = one_line_error(bdl("validate", "job.yaml", cwd=tmp_path), "dataset.limit")
    assert "2 training example(s)" in err


def test_model_builder_calling_sys_exit(tmp_path: Path) -> None:
    user_files(tmp_path, model=MODEL.replace("    return keras.Sequential", "    import sys\n    sys.exit(3)\n"
                                                                             "    return keras.Sequential"))
    for cmd in ("validate", "run"):
        one_line_error(bdl(cmd, "job.yaml", *(SMALL if cmd == "run" else []), cwd=tmp_path), "sys.exit(3)")


def test_validate_is_quiet_and_shows_the_derived_defaults(tmp_path: Path) -> None:
    user_files(tmp_path)  # the model module imports keras at its top
    res = bdl("validate", "job.yaml", cwd=tmp_path)
    assert res.returncode == 0, (res.stdout, res.stderr)
    assert res.stderr == "", res.stderr  # no TensorFlow start-up lines
    assert "spec OK" in res.stdout and "derived vcasgd.n_subsets" in res.stdout
    assert "derived training.local_epochs" in res.stdout


def test_validate_says_what_the_result_checks_will_do(tmp_path: Path) -> None:
    """The ``validation`` settings in words, with the user's values: the local backend's
    results are all trusted, so its loss check is BOINC's only; on BOINC the check, the host
    ledgers and the spot checks, with the trusted results the check needs before it acts."""
    def rows(spec: str) -> dict[str, str]:
        user_files(tmp_path, spec)
        res = bdl("validate", "job.yaml", cwd=tmp_path)
        assert res.returncode == 0, (res.stdout, res.stderr)
        out = {}
        for line in res.stdout.splitlines():  # the table's two columns: label | text, wrapped
            cells = [c.strip() for c in line.strip().strip("│").split("│")]
            if len(cells) == 2 and cells[0]:
                key = cells[0]
                out[key] = cells[1]
            elif len(cells) == 2 and out:
                out[key] += " " + cells[1]
        return out

    local = rows(MINIMAL)
    assert local["result checks"] == ("no update-norm cap; updates clipped to 2x the median norm of trusted ones "
                                      "(frozen per epoch) once 8 exist")
    assert local["loss check"].startswith("BOINC only")
    assert local["refused results"] == "the unit runs again on another slot, within units.max_error_results (4)"
    assert "spot checks" not in local
    boinc = rows(MINIMAL + "backend: {kind: boinc}\nvalidation: {max_update_norm: 50, clip_factor: null, "
                           "loss_check_min_trusted: 100, loss_check_spot_every: 7, loss_ledger_limit: 4}\n")
    assert boinc["result checks"] == "update norm at most 50; no clipping"
    assert "median + 6 MADs" in boinc["loss check"] and "active once 32 trusted" in boinc["loss check"]
    assert "from bases at most 1.5x as bad as its own" in boinc["loss check"]
    n_val = int(local["train / val examples"].split("/")[1])
    assert n_val < 256 and f"raises the loss of {n_val} held-out examples" in boinc["loss check"]  # all it has
    assert boinc["host ledgers"].startswith("a host is refused once its balance passes 4 ")
    assert "until 32 trusted results are measured, then after every 7 results" in boinc["spot checks"]
    assert boinc["refused results"].startswith("the unit runs again from the freshest weights, at most 2 time(s)")
    off = rows(MINIMAL + "backend: {kind: boinc}\nvalidation: {loss_check: false}\nvcasgd: {reissue: same}\n")
    assert off["loss check"] == "off (validation.loss_check)" and "spot checks" not in off
    assert off["refused results"] == "the unit is given up (vcasgd.reissue same)"


def test_on_off_flags_take_no_value(tmp_path: Path) -> None:
    res = bdl("run", "--help", cwd=tmp_path)
    assert res.returncode == 0 and "<bool>" not in res.stdout
    assert all(f in res.stdout for f in ("--resume", "--new", "--overwrite", "--quiet"))
    user_files(tmp_path)
    bad = bdl("run", "job.yaml", "--resume", "true", cwd=tmp_path)
    assert bad.returncode == 2 and "unexpected extra argument" in bad.stdout + bad.stderr


# ---- MOP: configurations by their parameters, quiet logs ----------------------------------------

MOP_SPEC = """name: sel
mode: mop
model: mymodel:build
dataset: {train: data.npz}
training: {epochs: 2}
mop:
  partitions: 2
  param_grid: {hidden: [8, 16], learning_rate: [0.01, 0.003], batch_size: [16, 32]}
"""


def test_mop_names_configurations_by_their_parameters(tmp_path: Path) -> None:
    user_files(tmp_path, MOP_SPEC)
    res = bdl("run", "job.yaml", *SMALL, cwd=tmp_path)
    assert res.returncode == 0, (res.stdout, res.stderr)
    epoch_lines = [ln for ln in res.stdout.splitlines() if ln.startswith("epoch ")]
    assert [ln.split(" - ")[0] for ln in epoch_lines] == ["epoch 1/2", "epoch 2/2"], res.stdout
    assert re.search(r"best val_acc \d\.\d{4}: hidden=(8|16) learning_rate=0\.0(1|03) batch_size=(16|32)",
                     epoch_lines[-1]), epoch_lines
    assert "search finished" not in res.stdout and "hidden=16" in res.stdout
    run_dir = tmp_path / "runs" / "sel"
    import csv

    with (run_dir / "leaderboard.csv").open() as f:
        configs = {r["config"] for r in csv.DictReader(f)}
    assert configs == {f"hidden={h} learning_rate={lr} batch_size={b}"
                       for h in (8, 16) for lr in ("0.01", "0.003") for b in (16, 32)}
    # Each slot traces the steps of each of the 8 models it trains: TensorFlow's retracing
    # warnings (one per few models) are noise there and stay out of the log.
    log = (run_dir / "local-backend.log").read_text()
    assert "retracing" not in log


def test_mop_run_sigkilled_mid_run_resumes_and_trains_each_sub_epoch_once(tmp_path: Path) -> None:
    """A model-selection run SIGKILLed at a moment not chosen in advance (after its first
    epoch closed, plus a random wait) resumes with --resume: every configuration visits
    every partition once per epoch, none twice. (Its resume once refused: "its model file
    is missing", a file only VC-ASGD jobs have.)"""
    import random

    user_files(tmp_path, MOP_SPEC.replace("batch_size: [16, 32]", "batch_size: [32]"))
    proc = subprocess.Popen([BDL, "run", "job.yaml", *SMALL], cwd=tmp_path, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines = _Lines(proc)
    lines.wait_for("epoch 1/2", proc)
    time.sleep(random.SystemRandom().uniform(0, 3))
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    res = bdl("run", "job.yaml", "--resume", *SMALL, cwd=tmp_path)
    assert res.returncode == 0, (res.stdout, res.stderr)
    hist = json.loads((tmp_path / "runs" / "sel" / "history.json").read_text())
    visits = Counter((m, p, e) for m, p, _w, _att, e in hist["schedule"])
    assert len(visits) == 4 * 2 * 2 and set(visits.values()) == {1}, visits  # 4 configs x 2 partitions x 2 epochs
    # units.csv: one row per sub-epoch trained, across the kill, with its configuration and
    # its durations (what a VC-ASGD run records, and what a calibration reads).
    import csv

    with (tmp_path / "runs" / "sel" / "units.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert Counter((r["model"], r["shard"], r["epoch"]) for r in rows) == Counter(
        {(m, str(p), str(e)): 1 for m, p, e in visits}), rows
    assert all(float(r["wall_s"]) > 0 and float(r["cpu_s"]) > 0 for r in rows)
    # The leaderboard ranks by the accuracy of the weights each configuration keeps, and
    # best_model.keras holds the first row's: evaluated on the job's validation split it
    # scores what the row says (it once ranked by the best epoch, whose weights are gone).
    with (tmp_path / "runs" / "sel" / "leaderboard.csv").open() as f:
        board = list(csv.DictReader(f))
    finals = [float(r["final_val_acc"]) for r in board]
    assert finals == sorted(finals, reverse=True), board
    import keras
    import numpy as np

    val = np.load(tmp_path / "runs" / "sel" / "files" / "sel__val.npz")
    best = keras.models.load_model(tmp_path / "runs" / "sel" / "best_model.keras")
    acc = float(np.mean(best.predict(val["x"], verbose=0).argmax(axis=1) == val["y"]))
    assert acc == pytest.approx(finals[0], abs=1e-6), (acc, board[0])
    assert f"{board[0]['config']}: val accuracy {finals[0]:.4f}" in " ".join(res.stdout.split()), res.stdout
    # The summary counts the job's two runs: every sub-epoch merged, the units the resume
    # re-submitted as it said, and both runs' time.
    # (The kill may land after the first run finished the job: the resume then only
    # writes the outputs again, and the job had one run.)
    written = json.loads((tmp_path / "runs" / "sel" / "summary.json").read_text())
    job, runs = written["job"], 1 if "already done" in res.stdout else 2
    said = re.search(r"resumed: (\d+) unit\(s\) in flight re-submitted", res.stdout)
    assert job["runs"] == runs and job["merged"] == 16 and job["resubmitted"] == (int(said[1]) if said else 0), job
    assert job["active_s"] > written["elapsed_s"] if runs == 2 else job["active_s"] >= written["elapsed_s"] - 1e-3
    # A --resume of the finished job writes its outputs again and keeps the finishing run's
    # story: its elapsed time and backend counters, not this process's (a MOP resume once
    # rewrote them as 0.0 s and an empty backend).
    summary = tmp_path / "runs" / "sel" / "summary.json"
    before = summary.read_text()
    again = bdl("run", "job.yaml", "--resume", *SMALL, cwd=tmp_path)
    assert again.returncode == 0 and "already done" in again.stdout, (again.stdout, again.stderr)
    assert summary.read_text() == before


# ---- pieces too small to need a run ------------------------------------------------------------

def test_learning_curve_has_whole_epoch_ticks() -> None:
    from boinc_dl.server.run.outputs import learning_curve_figure

    fig = learning_curve_figure({"VC-ASGD": [{"epoch": e, "val_acc": 0.5 + e / 100} for e in range(1, 11)]}, "t")
    ticks = [t for t in fig.axes[0].get_xticks() if 1 <= t <= 10]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks


def test_mop_legend_names_whole_configurations_inside_the_figure() -> None:
    from boinc_dl.server.run.mop import curves_figure, format_params

    params = [{"hidden": h, "depth": d, "learning_rate": lr} for h in (32, 64) for d in (1, 2) for lr in (0.003, 5e-4)]
    rows = [{"config": format_params(p), "curve": [0.5, 0.6 + i / 100]} for i, p in enumerate(params)]
    fig = curves_figure(rows, "t")
    legend = fig.axes[0].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == [r["config"] for r in rows]
    assert "hidden=64 depth=2 learning_rate=0.0005" in [t.get_text() for t in legend.get_texts()]
    fig.canvas.draw()
    box, canvas = legend.get_window_extent(), fig.bbox
    assert box.x0 >= canvas.x0 and box.x1 <= canvas.x1 + 0.5 and box.y0 >= canvas.y0, (box, canvas)


def test_live_view_epoch_row_reads_well_at_the_end() -> None:
    from boinc_dl.server.run.vcasgd import _epoch_line

    assert _epoch_line(20, 20, 20, "done") == "20 / 20 closed"
    assert _epoch_line(3, 20, 4, "running") == "3 / 20 closed · training epoch 4"
    assert _epoch_line(3, 20, 5, "running") == "3 / 20 closed · units of epochs 4-5 in flight"
