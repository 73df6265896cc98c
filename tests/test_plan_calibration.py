"""The planner calibrated the way a user does it: from a past run's units.csv.

A real ``boinc-dl run`` (the installed console script, a 1-slot run of real TensorFlow
units) writes units.csv with each unit's own durations; the calibration reads them and
must not mistake the time between merges (in a 1-slot run, the unit time) for the merge
cost. ``boinc-dl plan SPEC`` with no fleet file plans the local backend on this machine.
"""

from __future__ import annotations

import csv
import re
import shutil
import signal
import statistics
import subprocess
import time
from pathlib import Path

import pytest

from boinc_dl.server.planner.calibrate import CalibrationError, read_calibration
from boinc_dl.server.run.outputs import STEP_COLUMNS, UNIT_TIMINGS
from tests.support.cli import ENV, boinc_dl, boinc_dl_command, small_digits_spec
from tests.support.once import build_once

ROOT = Path(__file__).resolve().parents[1]

SPEC = small_digits_spec("plancal", n_subsets=4, workers=1, slots=1)

#: units.csv's columns before the timing columns were appended, in their order.
ORIGINAL = ["unit", "epoch", "shard", "version", "base_version", "staleness", "merge_rule", "clip_scale", "trusted",
            "val_acc", "val_loss", "train_loss", "train_acc", "examples_seen", "train_s", "wall_s", "host", "t"]


@pytest.fixture(scope="module")
def past_run(tmp_path_factory, worker_id: str) -> tuple[Path, Path]:
    """(work dir with the spec, run dir) of one real 1-slot run by the installed CLI, run
    once per session: the tests only read it (``plan`` calibrates in a temporary
    directory of its own) or copy it."""
    def build(work: Path) -> tuple[Path, Path]:
        shutil.copy(ROOT / "examples" / "models.py", work / "models.py")
        (work / "spec.yaml").write_text(SPEC)
        out = boinc_dl("run", "spec.yaml", "--run-dir", "run", "-q", cwd=work, timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr
        return work, work / "run"

    return build_once(tmp_path_factory, worker_id, "plancal", build)


def test_units_csv_keeps_its_columns_and_appends_the_timings(past_run):
    _, run = past_run
    with (run / "units.csv").open(newline="") as f:
        header = next(csv.reader(f))
    assert header == ORIGINAL + list(UNIT_TIMINGS) + list(STEP_COLUMNS)


def test_one_slot_run_calibrates_a_merge_far_below_the_unit_time(past_run):
    """The gap between merges of a 1-slot run is the unit time; the merge's own recorded
    duration is milliseconds. The old calibration took the gap (0.9 s against 0.01 s)."""
    _, run = past_run
    cal = read_calibration(run / "units.csv")
    with (run / "units.csv").open(newline="") as f:
        ts = sorted(float(r["t"]) for r in csv.DictReader(f) if not r.get("failed"))
    gap = statistics.median(b - a for a, b in zip(ts, ts[1:], strict=False))
    assert cal.units == 8 and cal.cpu_clock
    assert cal.merge_s is not None and cal.commit_s is not None
    assert cal.merge_s < 0.1 * cal.wall_s, cal.describe()
    assert cal.merge_s < 0.1 * gap, (cal.merge_s, gap)  # what a gap-based calibration would have taken
    assert 0 < cal.unit_compute_s(cal.examples_per_unit) <= cal.train_s * 1.05
    assert cal.eval_s > 0  # epochs.csv beside it: the generator's evaluation at an epoch's close
    assert read_calibration(run).units == cal.units  # the run directory works the same
    # Every unit records its first step's CPU: part of its training CPU, per unit.
    assert 0 < cal.first_step_s < cal.unit_compute_s(cal.examples_per_unit), cal.describe()


def test_first_step_is_a_per_unit_cost_and_the_rest_per_example(tmp_path):
    """A unit's first step (~80 ms here, against ~1.5 ms a step) does not scale with its
    examples: units a third the size take a third of the rest, and all of the first step."""
    rows = ["unit,train_s,wall_s,train_cpu_s,cpu_s,examples_seen,first_step_cpu_s"]
    rows += [f"u{i},0.25,0.33,0.23,0.31,1500,0.08" for i in range(3)]
    p = tmp_path / "units.csv"
    p.write_text("\n".join(rows) + "\n")
    cal = read_calibration(p)
    assert cal.first_step_s == pytest.approx(0.08)
    assert cal.compute_per_example_s == pytest.approx(0.15 / 1500)
    assert cal.unit_compute_s(1500) == pytest.approx(0.23)  # the calibration's own units
    assert cal.unit_compute_s(500) == pytest.approx(0.08 + 0.05)
    assert cal.overhead_s == pytest.approx(0.31 - 0.23)
    # An older units.csv without the column: all of the training per example, as before.
    p.write_text("\n".join(r.rsplit(",", 1)[0] for r in rows) + "\n")
    old = read_calibration(p)
    assert old.first_step_s == 0 and old.unit_compute_s(500) == pytest.approx(0.23 / 3)


def test_plan_with_no_fleet_plans_the_local_backend(past_run):
    work, _ = past_run
    out = boinc_dl("plan", "spec.yaml", "--calibrate", "run", cwd=work, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert "local backend on this machine" in text and "cores" in text
    assert "calibration: 8 merged units" in text and "merge" in text
    assert re.search(r"recommended \(\*\): .* epoch \d+\.\d{3} s", text.replace("\n", " ")), text
    assert re.search(r"bound by (clients|servers)", text.replace("\n", " "))
    assert "expected error" in text


def test_plan_with_no_fleet_and_no_past_run_calibrates_here(past_run, tmp_path):
    work, _ = past_run
    # A plan SIGKILLed while its calibration runs: its directory is left behind, and the
    # next plan removes it.
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**ENV, "TMPDIR": str(tmp)}
    killed = subprocess.Popen([*boinc_dl_command(), "plan", "spec.yaml"], cwd=work, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not list(tmp.glob("bdl-plan-cal.*/run-1")):
        assert killed.poll() is None and time.monotonic() < deadline, "no calibration run started"
        time.sleep(0.05)
    killed.kill()
    assert killed.wait(30) == -signal.SIGKILL
    orphans = list(tmp.glob("bdl-plan-cal.*"))
    assert orphans
    out = boinc_dl("plan", "spec.yaml", cwd=work, timeout=300, env=env)
    assert not any(d.exists() for d in orphans) and not list(tmp.glob("bdl-plan-cal.*"))
    assert out.returncode == 0, out.stdout + out.stderr
    text = " ".join(out.stdout.split())
    assert re.search(r"calibrating: two epochs of the spec's real units on this host \(1 slot, then (\d+) slots\)",
                     text), text
    # Two runs pooled: 1 slot (8 units), then 2 x cores slots (two units per slot and epoch),
    # which calibrates the contention term.
    m = re.search(r"calibration: (\d+) merged units of the calibration runs here \(1 slot, (\d+) slots\)", text)
    assert m and int(m.group(1)) == 8 + 4 * int(m.group(2)), text
    assert "contention g = " in text, text
    assert "recommended (*)" in out.stdout


def test_several_runs_pool_their_units_and_their_epoch_closes(tmp_path):
    """``--calibrate RUN1 --calibrate RUN2``: the medians over every run's units (a run
    that read high moves the calibration less), each run's first epoch close its own."""
    from boinc_dl.server.planner.calibrate import read_calibrations

    header = "unit,train_s,wall_s,train_cpu_s,cpu_s,examples_seen,first_step_cpu_s"
    for k, (per_ex, evals) in enumerate([(100e-6, (0.30, 0.10, 0.12)), (130e-6, (0.50, 0.14, 0.16)),
                                         (110e-6, (0.40, 0.11, 0.11))]):
        run = tmp_path / f"run{k}"
        run.mkdir()
        train = 0.05 + per_ex * 1000
        (run / "units.csv").write_text("\n".join(
            [header] + [f"u{i},{train},{train + 0.1},{train},{train + 0.08},1000,0.05" for i in range(4)]) + "\n")
        (run / "epochs.csv").write_text("epoch,eval_s\n" + "".join(f"{e + 1},{v}\n" for e, v in enumerate(evals)))
    runs = [tmp_path / f"run{k}" for k in range(3)]
    cal = read_calibrations(runs)
    assert cal.units == 12 and cal.compute_per_example_s == pytest.approx(110e-6)
    assert cal.first_step_s == pytest.approx(0.05) and cal.overhead_s == pytest.approx(0.08)
    # each run's closes: (0.11, +0.19), (0.15, +0.35), (0.11, +0.29): their medians
    assert cal.eval_s == pytest.approx(0.11) and cal.first_eval_extra_s == pytest.approx(0.29)
    assert "3 runs" in cal.source
    assert read_calibrations(runs[:1]) == read_calibration(runs[0])
    with pytest.raises(CalibrationError, match="without units.csv"):
        read_calibrations([runs[0], tmp_path])


def test_plan_pools_several_past_runs(past_run, tmp_path):
    work, run = past_run
    shutil.copytree(run, tmp_path / "again")
    out = boinc_dl("plan", "spec.yaml", "--calibrate", "run", "--calibrate", str(tmp_path / "again"),
                   cwd=work, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "calibration: 16 merged units of 2 runs" in " ".join(out.stdout.split())


@pytest.mark.parametrize("content, msg", [
    (b"", "not a run's units.csv"),
    (b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe garbage", "not text"),
    (b"a,b,c\n1,2,3\n", "not a run's units.csv"),
    (b"unit,train_s,wall_s,failed\nu1,,,lost\n", "no merged unit"),
    (b"unit,train_s,wall_s\nu1,0.5,0.7\n", "examples_seen"),
    (b'unit,train_s,wall_s\n"u1,0.5\n', "not a run's units.csv|no merged unit|not a CSV"),
])
def test_bad_units_csv_is_refused_with_a_clear_message(tmp_path, content, msg):
    p = tmp_path / "units.csv"
    p.write_bytes(content)
    with pytest.raises(CalibrationError, match=msg):
        read_calibration(p)


def test_missing_units_csv_is_refused(tmp_path):
    with pytest.raises(CalibrationError, match="without units.csv"):
        read_calibration(tmp_path)
    with pytest.raises(CalibrationError, match="no such file"):
        read_calibration(tmp_path / "nope.csv")


def test_plan_refuses_a_garbled_units_csv(past_run, tmp_path):
    work, _ = past_run
    bad = tmp_path / "units.csv"
    bad.write_text("this is not, a units file\n1,2\n")
    out = boinc_dl("plan", str(work / "spec.yaml"), "--calibrate", str(bad), cwd=work, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "not a run's units.csv" in out.stderr and "Traceback" not in out.stderr
