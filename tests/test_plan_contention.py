"""The contention term: a unit's CPU seconds grow with the units running beside it.

Synthetic ``units.csv`` files with a known g: a 1-slot run (units one after another) and
a 4-slot run (four units at once, each needing 1 + 3 g times the CPU seconds of the same
unit alone) pooled must give back g; a 1-slot run alone must give g = 0 and say so; rows
that are hostile or too few must not move it. The installed CLI is run on such files.
"""

from __future__ import annotations

import csv
import math
import re
import shutil
from pathlib import Path

import pytest

from boinc_dl.server.planner.calibrate import read_calibration, read_calibrations
from boinc_dl.server.planner.contention import Contention, fit_contention, mean_concurrency
from boinc_dl.server.planner.local import LocalCandidate, Machine, predict
from tests.support.cli import boinc_dl, small_digits_spec

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = ["unit", "examples_seen", "train_s", "wall_s", "host", "t", "load_s", "eval_s", "checkpoint_s",
           "train_cpu_s", "cpu_s", "validate_s", "validate_cpu_s", "merge_s", "merge_cpu_s", "commit_s",
           "first_step_cpu_s"]
FIRST, PER_EX, OVER, EX = 0.06, 50e-6, 0.07, 1440  # alone: 0.06 + 0.072 + 0.07 = 0.202 s of CPU a unit


def write_run(run: Path, slots: int, g: float, units_per_slot: int = 4, cores: int = 2, t0: float = 1.8e9,
              first_traces: bool = False) -> None:
    """A run of ``slots`` slots, each running ``units_per_slot`` units back to back, all
    slots at once: each unit needs ``f(slots)`` times its CPU alone, and its wall time is
    that CPU shared over ``cores`` cores. ``first_traces``: each slot's first unit has a
    5x first step (it traces the model), as real runs do."""
    f = 1 + g * (slots - 1)
    rows = []
    for s in range(slots):
        t = t0
        for i in range(units_per_slot):
            first = FIRST * (5 if first_traces and i == 0 else 1)
            train_cpu = (first + PER_EX * EX) * f
            cpu = train_cpu + OVER * f
            wall = cpu * max(1.0, slots / cores) * 1.02
            t += wall
            rows.append({"unit": f"u{s}-{i}", "examples_seen": EX, "train_s": train_cpu * 1.01, "wall_s": wall,
                         "host": "vm", "t": t + 0.005, "load_s": 0.02, "eval_s": 0.02, "checkpoint_s": 0.0,
                         "train_cpu_s": train_cpu, "cpu_s": cpu, "validate_s": 0.003, "validate_cpu_s": 0.003,
                         "merge_s": 0.002, "merge_cpu_s": 0.002, "commit_s": 0.0003, "first_step_cpu_s": first * f})
            t += 0.005 + 0.001  # validate + merge, then the slot's next unit
    run.mkdir(parents=True)
    with (run / "units.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(sorted(rows, key=lambda r: r["t"]))
    (run / "epochs.csv").write_text("epoch,eval_s\n1,0.5\n2,0.1\n")


def test_mean_concurrency_counts_the_units_running_beside_each():
    # [0,2] alone then beside [1,3]; [1,3] beside [0,2] then alone; [5,6] alone
    k = mean_concurrency([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0), None, (4.0, 4.0)])
    assert k[0] == pytest.approx(1.5) and k[1] == pytest.approx(1.5) and k[2] == pytest.approx(1.0)
    assert k[3] is None and k[4] is None
    four = mean_concurrency([(0.0, 1.0)] * 4 + [(0.5, 1.0)])
    assert four[0] == pytest.approx(4.5) and four[4] == pytest.approx(5.0)


@pytest.mark.parametrize("g", [0.05, 0.1, 0.3])
def test_a_one_slot_and_a_four_slot_run_pooled_give_back_g(tmp_path, g):
    write_run(tmp_path / "one", 1, g)
    write_run(tmp_path / "four", 4, g, first_traces=True)
    cal = read_calibrations([tmp_path / "one", tmp_path / "four"])
    assert cal.contention.g == pytest.approx(g, rel=0.05)
    assert cal.contention.units == 12  # the four slots' first units (tracing the model) left out
    assert cal.contention.max_running == pytest.approx(4, abs=0.2)
    # The per-unit costs are the 1-slot run's, not medians inflated by the crowded units.
    assert cal.compute_per_example_s == pytest.approx(PER_EX)
    assert cal.first_step_s == pytest.approx(FIRST) and cal.overhead_s == pytest.approx(OVER)
    assert cal.units == 20
    assert re.search(rf"contention g = {g:.3f} per extra running unit", cal.describe())


def test_a_one_slot_calibration_alone_has_no_contention_and_says_so(tmp_path):
    write_run(tmp_path / "one", 1, 0.2, units_per_slot=8)
    cal = read_calibration(tmp_path / "one")
    assert cal.contention.g == 0 and cal.contention.units == 0
    assert "a 1-slot calibration only: contention not modelled (g = 0)" in cal.describe()
    assert cal.contention.factor(6) == 1.0


def test_a_crowded_run_alone_keeps_g_at_zero_and_says_why(tmp_path):
    """Without units that ran alone there is nothing to compare with: g = 0, said so."""
    write_run(tmp_path / "four", 4, 0.2)
    cal = read_calibration(tmp_path / "four")
    assert cal.contention.g == 0 and "no units that ran alone" in cal.describe()


def test_too_few_crowded_units_keep_g_at_zero(tmp_path):
    write_run(tmp_path / "one", 1, 0.2, units_per_slot=8)
    write_run(tmp_path / "two", 2, 0.2, units_per_slot=1)  # two crowded units: < MIN_CROWDED
    cal = read_calibrations([tmp_path / "one", tmp_path / "two"])
    assert cal.contention.g == 0 and "only 2 units ran beside others" in cal.describe()


def test_runs_are_not_counted_as_running_beside_each_other(tmp_path):
    """Two 1-slot runs at the same moment (or with the same clock values) are two runs:
    concurrency is counted within a run, so g stays 0."""
    write_run(tmp_path / "a", 1, 0.0, units_per_slot=6)
    write_run(tmp_path / "b", 1, 0.0, units_per_slot=6)  # the same times as a's
    cal = read_calibrations([tmp_path / "a", tmp_path / "b"])
    assert cal.contention.units == 0 and cal.contention.max_running == pytest.approx(1.0)


def test_hostile_rows_do_not_move_the_fit(tmp_path):
    write_run(tmp_path / "one", 1, 0.1)
    write_run(tmp_path / "four", 4, 0.1)
    good = read_calibrations([tmp_path / "one", tmp_path / "four"]).contention.g
    with (tmp_path / "four" / "units.csv").open("a") as fh:  # junk a units.csv may hold
        fh.write("x1,1440,0.1,0.2,vm,nan,,,,0.1,0.2,,,,,,\n")
        fh.write("x2,1440,0.1,0.2,vm,-5,,,,0.1,1e300,,,,,,\n")
        fh.write("x3,1440,0.1,0.2,vm,inf,,,,abc,0.2,,,,,,\n")
        fh.write("x4,1440,0.3,0.2,vm,1800000000.1,,,,0.1,0.2,,,,,,\n")  # train longer than wall
        fh.write("x5,0,0.1,0.2,vm,1800000000.2,,,,0.1,0.2,,,,,,\n")
    assert read_calibrations([tmp_path / "one", tmp_path / "four"]).contention.g == pytest.approx(good, rel=0.05)


def test_the_fit_clamps_and_ignores_nonsense():
    assert fit_contention([(4.0, 1.3)] * 5).g == pytest.approx(0.1)
    assert fit_contention([(4.0, 0.5)] * 5).g == 0  # faster when crowded: no negative contention
    assert fit_contention([(2.0, 50.0)] * 5).g == 2.0  # clamped
    assert fit_contention([(math.nan, 1.3), (4.0, math.inf), (4.0, -1.0), (0.0, 1.0)] * 5).units == 0
    assert fit_contention([]) == Contention(0.0, 0, 1.0, fit_contention([]).note)


def test_contention_slows_plans_of_many_slots_and_not_of_one(tmp_path):
    write_run(tmp_path / "one", 1, 0.1)
    write_run(tmp_path / "four", 4, 0.1)
    flat = read_calibration(tmp_path / "one")
    crowd = read_calibrations([tmp_path / "one", tmp_path / "four"])
    machine = Machine(2, None)

    def epoch(cal, c: int, t: int) -> float:
        return predict(cal, LocalCandidate(c, t, 1, 12), machine, epochs=2, params=10_000, n_train=1440,
                       local_epochs=1).pred.epoch_s

    assert epoch(crowd, 1, 1) == pytest.approx(epoch(flat, 1, 1), rel=1e-6)
    # 6 slots on 2 cores: the clients' CPU bounds it, stretched by up to 1 + 5 g = 1.5
    # (less where fewer run: the first and last units of an epoch, its close)
    assert 1.2 < epoch(crowd, 3, 2) / epoch(flat, 3, 2) < 1.55


SPEC = small_digits_spec("plancrowd", n_subsets=12, workers=2, slots=2)


def test_installed_cli_plans_with_contention_from_two_runs(tmp_path):
    """``boinc-dl plan SPEC --calibrate RUN1 --calibrate RUN2``, a 1-slot and a 4-slot
    run: the calibration line gives g and the 1-slot run's unit costs (not medians over
    the crowded units, as pooling did before), and the plan is made. (How much slower the
    plans of many slots become is checked in-process above: each plan samples the other
    work on this machine, so two plans here are not comparable.)"""
    shutil.copy(ROOT / "examples" / "models.py", tmp_path / "models.py")
    (tmp_path / "spec.yaml").write_text(SPEC)
    write_run(tmp_path / "one", 1, 0.1)
    write_run(tmp_path / "four", 4, 0.1, first_traces=True)
    both = boinc_dl("plan", "spec.yaml", "--calibrate", "one", "--calibrate", "four", cwd=tmp_path, timeout=300)
    assert both.returncode == 0, both.stdout + both.stderr
    text = " ".join(both.stdout.split())
    assert ("contention g = 0.100 per extra running unit (from 12 units that ran beside up to 4.0 at once: "
            "x1.10 at 2, x1.30 at 4, x1.50 at 6)") in text, text
    assert "0.060 s first step + 50.0 us/example" in text and "+ 0.070 s overhead" in text, text
    assert re.search(r"the spec's own \(2 workers x 2 slots, P=1, 12 units/epoch\): epoch \d+\.\d{3} s", text), text
    alone = boinc_dl("plan", "spec.yaml", "--calibrate", "one", cwd=tmp_path, timeout=300)
    assert alone.returncode == 0, alone.stdout + alone.stderr
    alone_text = " ".join(alone.stdout.split())
    assert "a 1-slot calibration only: contention not modelled (g = 0)" in alone_text
    assert "contention not calibrated (g = 0): plans of many slots may be optimistic" in alone_text
    assert "contention not calibrated" not in text
