"""The planner: closed forms by hand, the simulation against them, the searches, the
price table, the CLI end to end, and the local backend's per-host synthetic unit times."""

from __future__ import annotations

import csv
import itertools
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from boinc_dl.server.planner.calibrate import read_calibration
from boinc_dl.server.planner.model import (
    Config,
    HostType,
    ServerCosts,
    Workload,
    closed_form,
    waves,
)
from boinc_dl.server.planner.prices import DEFAULT_TABLE, PriceError, TablePriceBook
from boinc_dl.server.planner.search import (
    Goal,
    Planner,
    Space,
    exact,
    genetic,
    greedy,
    pareto,
    regret,
)
from boinc_dl.server.planner.sim import simulate, simulate_once

ROOT = Path(__file__).resolve().parents[1]
FAST = HostType("fast", unit_s=1.0, cores=4, bandwidth_mbps=1e9)


# ---- closed forms ---------------------------------------------------------------------------

def test_unit_time_by_hand():
    # 2 s compute, 8 slots on 4 cores (x2), 100 B/s... : params 1000 -> 4000 B each way,
    # data 16000 B / 4 units = 4000 B; 12000 B * 8 bit / 1 Mbit/s = 0.096 s; staging 0.1 s.
    h = HostType("h", unit_s=2.0, cores=4, bandwidth_mbps=1.0)
    w = Workload(units_per_epoch=4, epochs=1, params=1000, data_bytes=16000)
    c = ServerCosts(merge_s=0.1, stage_s=0.1)
    assert h.unit_time(8, w, c) == pytest.approx(2.0 * 2 + 0.1 + 0.096)
    assert h.unit_time(2, w, c) == pytest.approx(2.0 + 0.1 + 0.096)
    # Bigger units (half as many per epoch) take twice the compute.
    w2 = Workload(units_per_epoch=2, epochs=1, params=1000, data_bytes=16000, base_units_per_epoch=4)
    assert h.unit_time(2, w2, c) == pytest.approx(4.0 + 0.1 + 8 * (8000 + 8000) / 1e6)


def test_closed_form_by_hand():
    # Client-bound: 2 hosts x 2 slots of 1 s units -> R_c = 4/s; P=2 at speed-up 2 of
    # 0.1 s merges -> R_s = 20/s. 40 units: 40/4 + fill (1 + 0.1) - 1/4 = 10.85 s.
    cfg = Config(((FAST, 2),), slots=2, assimilators=2)
    w = Workload(units_per_epoch=20, epochs=2, params=10)
    c = ServerCosts(merge_s=0.1, merge_speedup={1: 1.0, 2: 2.0})
    p = closed_form(cfg, w, c)
    assert p.bound == "clients"
    assert p.client_rate == pytest.approx(4.0)
    assert p.server_rate == pytest.approx(20.0)
    assert p.job_s == pytest.approx(10.85)
    assert p.epoch_s == pytest.approx(10.85 / 2)
    # Server-bound: merges of 1 s at P=1 -> 40 s + fill (1 + 1) - 1.
    p = closed_form(Config(((FAST, 2),), 2, 1), w, ServerCosts(merge_s=1.0))
    assert p.bound == "servers"
    assert p.job_s == pytest.approx(41.0)


def test_closed_form_preemption_term_is_the_papers():
    # n*t_e + n*p*t_o: n_s = 40 units on S = 4 slots, p = 0.1, t_o = 5: + 40*0.1*5/4 = 5 s.
    lossy = HostType("fast", unit_s=1.0, cores=4, bandwidth_mbps=1e9, preempt_p=0.1)
    w = Workload(units_per_epoch=20, epochs=2, params=10)
    c = ServerCosts(merge_s=0.01, merge_speedup={1: 1.0})
    base = closed_form(Config(((FAST, 2),), 2, 1, timeout_s=5.0), w, c).job_s
    assert closed_form(Config(((lossy, 2),), 2, 1, timeout_s=5.0), w, c).job_s == pytest.approx(base + 5.0)


# ---- simulation -----------------------------------------------------------------------------

def test_simulation_matches_wave_arithmetic():
    # P >= S, round-robin servers: exact waves of dispatch + unit + merge.
    c = ServerCosts(merge_s=0.2, merge_speedup={8: 8.0}, stage_s=0.05, dispatch_s=0.03)
    w = Workload(units_per_epoch=12, epochs=2, params=10)
    cfg = Config(((FAST, 2),), slots=2, assimilators=8)
    assert simulate_once(cfg, w, c, assign="round_robin").job_s == pytest.approx(waves(cfg, w, c))


def test_simulation_meets_closed_form_where_no_queue_forms():
    # Many units, client-bound by far, no preemption: the simulation's time is the
    # closed form's within the pipeline's fill (a few %).
    c = ServerCosts(merge_s=0.001, merge_speedup={1: 1.0})
    w = Workload(units_per_epoch=400, epochs=1, params=10)
    cfg = Config(((FAST, 4),), slots=2, assimilators=1, window=8)
    cf, sim = closed_form(cfg, w, c).job_s, simulate(cfg, w, c, reps=1).job_s
    assert sim == pytest.approx(cf, rel=0.03)


def test_simulation_preemption_costs_about_the_papers_term():
    lossy = HostType("fast", unit_s=1.0, cores=4, bandwidth_mbps=1e9, preempt_p=0.2)
    c = ServerCosts(merge_s=0.001, merge_speedup={1: 1.0})
    w = Workload(units_per_epoch=200, epochs=1, params=10)
    base = simulate(Config(((FAST, 2),), 2, 1, timeout_s=4.0), w, c, reps=3).job_s
    lost = simulate(Config(((lossy, 2),), 2, 1, timeout_s=4.0), w, c, reps=10).job_s
    # n*p*t_o = 200 * 0.2 * 4 / 4 slots = 40 s (the simulation also wastes the killed work
    # and overlaps some waits: within 25%).
    assert lost - base == pytest.approx(40.0, rel=0.25)


# ---- resource sharing -------------------------------------------------------------------------

def _shared(**kw: float) -> ServerCosts:
    base = {"merge_s": 1e-9, "stage_s": 1.0, "cpu_cores": 2, "colocated": True}
    return ServerCosts(**{**base, **kw})


def test_processor_sharing_by_hand():
    # 4 slots of one host, no compute, staging 1 s of CPU each on 2 shared cores: all
    # four stage together at half speed and finish at 2 s; without sharing, at 1 s.
    h = HostType("h", unit_s=0.0, cores=4, bandwidth_mbps=1e12)
    w = Workload(units_per_epoch=4, epochs=1, params=1)
    cfg = Config(((h, 1),), slots=4, assimilators=1)
    assert simulate_once(cfg, w, _shared()).job_s == pytest.approx(2.0, rel=1e-6)
    assert simulate_once(cfg, w, _shared(cpu_cores=None)).job_s == pytest.approx(1.0, rel=1e-6)
    # Slots on their own machines (not colocated): staging is theirs, not the server's.
    assert simulate_once(cfg, w, _shared(colocated=False)).job_s == pytest.approx(1.0, rel=1e-6)


def test_merges_share_the_cores_with_staging():
    # One assimilator, 1 s merges, 1 core: two units staging (0.5 s CPU each) and the
    # first merge overlap. Unit 0 and 1 stage together 0..1 s (rate 0.5), both merges
    # then queue on the single server: 1 + 1 + 1 = 3 s; with 2 cores staging ends at
    # 0.5 s, merges at 1.5 and 2.5 s.
    h = HostType("h", unit_s=0.0, cores=4, bandwidth_mbps=1e12)
    w = Workload(units_per_epoch=2, epochs=1, params=1)
    cfg = Config(((h, 1),), slots=2, assimilators=1)
    assert simulate_once(cfg, w, _shared(merge_s=1.0, stage_s=0.5, cpu_cores=1)).job_s == pytest.approx(3.0)
    assert simulate_once(cfg, w, _shared(merge_s=1.0, stage_s=0.5, cpu_cores=2)).job_s == pytest.approx(2.5)
    # P = 2 at 1 core: two 1.5 s shared merges at half speed after 1 s of staging: 4 s.
    two = Config(((h, 1),), slots=2, assimilators=2)
    c = _shared(merge_s=1.0, merge_shared_s=1.5, stage_s=0.5, cpu_cores=1)
    assert simulate_once(two, w, c, assign="round_robin").job_s == pytest.approx(4.0)
    assert c.speedup(2) == pytest.approx(1.0 / 1.5)


def test_epoch_closes_and_first_units_are_cpu_work_in_the_simulation():
    # 1 slot, 2 units/epoch x 3 epochs of 1 s CPU, 0.1 s merges, 1 core: 6 x 1.1 = 6.6 s.
    # The generator closes epochs 1 and 2 inside the job (0.5 s each, the first +0.25 s
    # loading the model; epoch 3 closes after the last merge) with no unit in flight,
    # and the slot's first unit traces the model (+0.3 s): 6.6 + 1.25 + 0.3.
    h = HostType("h", unit_s=0.0, cores=4, bandwidth_mbps=1e12)
    w = Workload(units_per_epoch=2, epochs=3, params=1)
    one = Config(((h, 1),), slots=1, assimilators=1)
    c = _shared(merge_s=0.1, stage_s=1.0, cpu_cores=1)
    assert simulate_once(one, w, c).job_s == pytest.approx(6.6)
    closes = replace(c, epoch_close_s=0.5, first_close_extra_s=0.25, first_unit_extra_s=0.3)
    assert simulate_once(one, w, closes).job_s == pytest.approx(6.6 + 1.25 + 0.3)
    # Without sharing (a fleet), the same as delays.
    plain = replace(closes, cpu_cores=None, colocated=False, stage_s=0.0)
    assert simulate_once(Config(((replace(h, unit_s=1.0), 1),), 1, 1), w, plain).job_s == \
        pytest.approx(6 * 1.1 + 1.25 + 0.3)
    # 2 slots on 1 core: the core never idles (the other slot's unit runs during a close),
    # so the job is all its CPU seconds: 6.6 + 1.25 + 2 first units x 0.3.
    two = Config(((h, 1),), slots=2, assimilators=1)
    assert simulate_once(two, w, closes).job_s == pytest.approx(6.6 + 1.25 + 0.6)


def test_one_generator_creates_units_one_at_a_time():
    # 4 slots, units of no time, creation 1 s of CPU each by the one generator: 4 s,
    # however many cores; and the closed form's generator bound says the same.
    h = HostType("h", unit_s=0.0, cores=4, bandwidth_mbps=1e12)
    w = Workload(units_per_epoch=4, epochs=1, params=1)
    cfg = Config(((h, 1),), slots=4, assimilators=4)
    for cores in (1, 8):
        c = _shared(stage_s=0.0, cpu_cores=cores, create_s=1.0)
        assert simulate_once(cfg, w, c).job_s == pytest.approx(4.0, rel=1e-6)
    many = Workload(units_per_epoch=400, epochs=1, params=1)
    c = _shared(stage_s=0.0, cpu_cores=8, create_s=0.1)
    assert closed_form(cfg, many, c).job_s == pytest.approx(40.0, rel=0.05)
    assert simulate(cfg, many, c, reps=1).job_s == pytest.approx(40.0, rel=0.01)


def test_redis_commits_one_merge_at_a_time():
    # 4 units arrive together at 4 assimilators on 8 cores: merges of 0.1 s CPU run in
    # parallel, but Redis commits 1 s each one at a time: 0.1 + 4 x 1 s. Without the
    # commit term the four merges would end together at 0.1 s.
    h = HostType("h", unit_s=0.0, cores=4, bandwidth_mbps=1e12)
    w = Workload(units_per_epoch=4, epochs=1, params=1)
    cfg = Config(((h, 1),), slots=4, assimilators=4)
    c = _shared(merge_s=0.1, merge_shared_s=0.1, stage_s=0.0, cpu_cores=8, commit_s=1.0)
    assert simulate_once(cfg, w, c, assign="round_robin").job_s == pytest.approx(4.1, rel=1e-6)
    assert simulate_once(cfg, w, replace(c, commit_s=0.0), assign="round_robin").job_s == pytest.approx(0.1)
    # The closed form's server rate is capped by the one Redis: 1 commit per second.
    many = Workload(units_per_epoch=200, epochs=1, params=1)
    assert closed_form(cfg, many, c).server_rate == pytest.approx(1.0, rel=0.05)
    assert simulate(cfg, many, c, reps=1).job_s == pytest.approx(200.0, rel=0.02)


def test_sharing_with_ample_cores_is_the_plain_model():
    c_plain = ServerCosts(merge_s=0.2, merge_speedup={3: 3.0}, stage_s=0.05, dispatch_s=0.03)
    c_ps = replace(c_plain, merge_speedup={}, cpu_cores=64, colocated=True)
    w = Workload(units_per_epoch=24, epochs=2, params=10)
    cfg = Config(((FAST, 3),), slots=2, assimilators=3)
    assert simulate(cfg, w, c_ps, reps=4).job_s == pytest.approx(simulate(cfg, w, c_plain, reps=4).job_s)


def test_sharing_closed_form_tracks_the_simulation_and_saturates():
    # Client-bound with CPU to spare: the closed form is the simulation's within 5%.
    w = Workload(units_per_epoch=400, epochs=1, params=10)
    cfg = Config(((FAST, 4),), slots=2, assimilators=2)
    c = _shared(merge_s=0.02, stage_s=0.05)
    assert closed_form(cfg, w, c).job_s == pytest.approx(simulate(cfg, w, c, reps=2).job_s, rel=0.05)
    # CPU-bound: 400 units x (0.2 + 0.3) s of CPU on 2 cores cannot beat 100 s, and
    # both forms say so. The closed form's open-queue stretch overshoots near saturation
    # (a closed system of 32 units in flight cannot queue without bound): within 20%.
    heavy = _shared(merge_s=0.3, merge_shared_s=0.3, stage_s=0.2)
    many = Config(((FAST, 8),), slots=4, assimilators=4)
    assert closed_form(many, w, heavy).job_s >= 100.0
    assert simulate(many, w, heavy, reps=2).job_s >= 100.0
    assert closed_form(many, w, heavy).job_s == pytest.approx(simulate(many, w, heavy, reps=2).job_s, rel=0.2)


def test_fig3_effect_comes_out_of_the_model():
    """The VC-ASGD paper's Fig. 3: P=1, C=3: T=4 beats T=2, T=8 is slower than T=4;
    P=3 at T=8 is faster than P=1 at T=8."""
    c = ServerCosts(merge_s=0.25, merge_speedup={1: 1.0, 3: 2.0}, stage_s=0.1, dispatch_s=0.03)
    w = Workload(units_per_epoch=24, epochs=2, params=4_972_746)
    h = HostType("fast", unit_s=1.5, cores=4, bandwidth_mbps=1e9)

    def t(p: int, slots: int) -> float:
        return simulate(Config(((h, 3),), slots, p), w, c, reps=10).job_s

    t2, t4, t8, p3t8 = t(1, 2), t(1, 4), t(1, 8), t(3, 8)
    assert t4 < t2
    assert t8 > t4
    assert p3t8 < t8


# ---- prices ---------------------------------------------------------------------------------

def test_shipped_price_table_schema():
    book = TablePriceBook.load(DEFAULT_TABLE)
    assert book.date and book.source_text
    for name in ("g4dn.xlarge", "g5.xlarge", "p3.2xlarge", "c6i.xlarge", "c6i.2xlarge", "m6i.xlarge",
                 "n1-standard-4-t4", "g2-standard-4", "n2-standard-4", "e2-standard-4"):
        info = book.types[name]
        assert 0 < info.spot <= info.on_demand
        assert book.hourly(name, "spot") == info.spot
    assert {i.provider for i in book.types.values()} == {"aws", "gcp"}
    assert "as of" in book.source()


@pytest.mark.parametrize("raw, msg", [
    ({"source": "x", "types": {"a": {}}}, "date"),
    ({"date": "d", "source": "x", "types": {}}, "non-empty"),
    ({"date": "d", "source": "x", "types": {"a": {"provider": "aws", "vcpus": 4, "memory_gib": 1,
                                                  "on_demand": 1.0, "spot": 2.0}}}, "spot <= on_demand"),
    ({"date": "d", "source": "x", "types": {"a": {"provider": "azure", "vcpus": 4, "memory_gib": 1,
                                                  "on_demand": 1.0, "spot": 0.5}}}, "provider"),
    ({"date": "d", "source": "x", "types": {"a": {"provider": "aws", "on_demand": 1.0}}}, "types.a"),
])
def test_bad_price_tables_are_rejected(raw, msg):
    with pytest.raises(ValueError, match=msg):
        TablePriceBook.from_dict(raw)


def test_spot_history_replaces_the_table():
    book = TablePriceBook.load()
    pts = [SimpleNamespace(type="g4dn.xlarge", zone="us-east-1a", time=t, usd_per_hour=v)
           for t, v in ((1000.0, 0.30), (2000.0, 0.20), (-10 * 86400.0, 9.0))]
    b2 = book.with_spot_history(pts, now=2000.0)
    assert b2.hourly("g4dn.xlarge", "spot") == pytest.approx(0.25)  # the old point is out of the window
    assert b2.hourly("g4dn.xlarge", "on-demand") == book.hourly("g4dn.xlarge", "on-demand")
    assert b2.hourly("c6i.xlarge", "spot") == book.hourly("c6i.xlarge", "spot")
    assert "observed" in b2.source()


# ---- search ---------------------------------------------------------------------------------

def _planner() -> Planner:
    types = (HostType("g4dn.xlarge", 2.0, 4, 1e9, 0.05), HostType("c6i.xlarge", 6.0, 4, 1e9, 0.03))
    space = Space(types, (3, 3), ("spot", "on-demand"), (1, 2, 4), (1, 2), (8,), "c6i.xlarge", 30.0)
    w = Workload(8, 10, 100_000)
    return Planner(space, w, ServerCosts(0.2, {1: 1.0, 2: 1.7}, 0.05, 0.02), TablePriceBook.load(),
                   simulate_top=False)


def test_exact_is_the_brute_force_optimum_and_baselines_have_regret():
    pl = _planner()
    goal = Goal(deadline_s=120.0)
    res, scored = exact(pl, goal)
    assert res.evaluated == pl.space.size() == len(scored)
    feasible = [s for s in scored if goal.feasible(s)]
    assert res.best is not None and res.best.dollars == min(s.dollars for s in feasible)
    for r in (greedy(pl, goal), genetic(pl, goal, seed=1)):
        rg = regret(r.best, res.best, goal)
        assert rg is not None and rg >= 0
        assert r.evaluated <= len(scored) + 1
    # Budget: fastest within it.
    bgoal = Goal(budget=0.05)
    bres, _ = exact(pl, bgoal)
    assert bres.best.pred.job_s == min(s.pred.job_s for s in scored if s.dollars <= 0.05)


def test_spot_saves_against_on_demand_and_pareto_is_a_front():
    pl = _planner()
    _, scored = exact(pl, Goal(deadline_s=1e6))
    spot = [s for s in scored if s.cand.market == "spot"]
    assert all(s.saving > 0 for s in spot)
    front = pareto(scored)
    for a, b in itertools.pairwise(front):
        assert a.pred.job_s <= b.pred.job_s and a.dollars > b.dollars
    for s in scored:  # nothing dominates the front strictly
        assert not any(s.pred.job_s < f.pred.job_s and s.dollars < f.dollars for f in front)


def test_goal_needs_exactly_one_limit():
    with pytest.raises(ValueError):
        Goal()
    with pytest.raises(ValueError):
        Goal(deadline_s=1.0, budget=1.0)


# ---- history --------------------------------------------------------------------------------

def test_calibration_from_units_csv_takes_recorded_durations_not_gaps(tmp_path):
    p = tmp_path / "units.csv"
    cols = ["unit", "train_s", "wall_s", "t", "examples_seen", "train_cpu_s", "cpu_s", "validate_s",
            "validate_cpu_s", "merge_s", "merge_cpu_s", "commit_s", "failed"]
    with p.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        # Merges 1 s apart (a 1-slot run: the gap is the unit time), each 10 ms of work.
        for i, t in enumerate((10.0, 11.0, 12.0, 13.0)):
            w.writerow({"unit": f"u{i}", "train_s": 0.8, "wall_s": 1.0, "t": t, "examples_seen": 400,
                        "train_cpu_s": 0.6, "cpu_s": 0.75, "validate_s": 0.004, "validate_cpu_s": 0.003,
                        "merge_s": 0.009, "merge_cpu_s": 0.005, "commit_s": 0.002})
        w.writerow({"unit": "bad", "failed": "too many errors"})
        w.writerow({"unit": "nan", "train_s": "nan", "wall_s": "x", "t": ""})
    c = read_calibration(p)
    assert c.units == 4 and c.cpu_clock
    assert c.compute_per_example_s == pytest.approx(0.6 / 400)  # CPU seconds: not stretched by sharing
    assert c.overhead_s == pytest.approx(0.15)
    assert c.merge_s == pytest.approx(0.008)  # validate + merge CPU, never the 1 s gap
    assert c.commit_s == pytest.approx(0.002)
    assert read_calibration(tmp_path).units == 4  # a run directory works too


# ---- CLI ------------------------------------------------------------------------------------

def test_cli_plan_end_to_end(tmp_path):
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(
        "types:\n"
        "  g4dn.xlarge: {unit_s: 6.0, cores: 4, max_count: 3, preempt_p: 0.05}\n"
        "  n2-standard-4: {unit_s: 20.0, cores: 4, max_count: 3, preempt_p: 0.03}\n"
        "slots: [1, 2, 4]\nassimilators: [1, 2]\nserver: {type: c6i.xlarge}\nparams: 4970\n"
        "costs: {merge_s: 0.05, speedup: {2: 1.5}}\n")
    png = tmp_path / "plan.png"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    out = subprocess.run([sys.executable, "-m", "boinc_dl.server.cli", "plan", str(ROOT / "examples" / "digits-vcasgd.yaml"),
                          "--fleet", str(fleet), "--deadline", "10m", "--plot", str(png)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr + out.stdout
    assert "recommended (*)" in out.stdout
    assert "cheapest predicted to finish within the deadline" in out.stdout
    assert "greedy:" in out.stdout and "genetic:" in out.stdout and "regret" in out.stdout
    assert "as of 2026-11-01" in out.stdout
    assert png.exists() and png.read_bytes()[:4] == b"\x89PNG"
    bad = subprocess.run([sys.executable, "-m", "boinc_dl.server.cli", "plan", str(ROOT / "examples" / "digits-vcasgd.yaml"),
                          "--fleet", str(fleet)], capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode != 0


# ---- local backend knob ---------------------------------------------------------------------

def test_local_backend_runs_per_host_synthetic_unit_times(redis_server, tmp_path):
    from tests.support.harness import run_headless, small_spec

    spec = small_spec("perhost", training={"epochs": 1}, vcasgd={"n_subsets": 6},
                      backend={"local": {"workers": 2, "slots": 1, "assimilators": 1}})
    box: dict = {}
    res = run_headless(spec, tmp_path / "run", redis_server.url, search_path=ROOT / "examples",
                       backend_opts={"synthetic_unit_s": [0.2, 0.9]},
                       on_start=lambda b, g: box.setdefault("b", b), timeout_s=120)
    assert res.status == "done"
    times = sorted(box["b"].unit_times)
    assert times[0] < 0.6 and times[-1] >= 0.9  # both hosts ran units at their own speed
    from boinc_dl.server.backends.local import LocalJobSystem

    with pytest.raises(ValueError, match="one time per host"):
        LocalJobSystem(tmp_path / "x", redis_server.url, "j", workers=2, synthetic_unit_s=[0.1])


def test_fleet_controllers_price_book_plugs_in():
    """The fleet controller's book (spot history by zone) stands in through ExternalPriceBook,
    and its PricePoints feed the table's spot column."""
    from decimal import Decimal

    from boinc_dl.server.fleet.prices import StepPriceBook
    from boinc_dl.server.fleet.provider import PricePoint
    from boinc_dl.server.planner.prices import ExternalPriceBook

    pts = [PricePoint("g4dn.xlarge", "us-east-1a", 100.0, Decimal("0.19")),
           PricePoint("g4dn.xlarge", "us-east-1a", 200.0, Decimal("0.23"))]
    fleet_book = StepPriceBook()
    fleet_book.add_spot(pts)
    table = TablePriceBook.load()
    ext = ExternalPriceBook(fleet_book, "us-east-1a", table, at=150.0)
    assert ext.hourly("g4dn.xlarge", "spot") == pytest.approx(0.19)
    assert ext.hourly("n2-standard-4", "spot") == table.hourly("n2-standard-4", "spot")  # unknown there
    assert table.with_spot_history(pts, now=200.0).hourly("g4dn.xlarge", "spot") == pytest.approx(0.21)


# ---- one fleet file for the planner and the controller ---------------------------------------

def test_planner_reads_the_controllers_fleet_file():
    from boinc_dl.server.fleet.config import load_planner_fleet

    # The AWS example carries a planner section: its types and choices, and the
    # controller's on-demand prices on top of the shipped table.
    ff = load_planner_fleet(ROOT / "examples" / "fleet-aws.yaml")
    assert set(ff.types) == {"g4dn.xlarge", "g5.xlarge"}
    assert ff.types["g4dn.xlarge"]["unit_s"] == 4.0 and ff.slots == (1, 2, 4)
    assert ff.on_demand_prices == {"g4dn.xlarge": 0.526, "g5.xlarge": 1.006}
    # The GCP example has no planner section: the controller's own fields are the fleet
    # (its machine type, up to max_hosts, T = slots_per_host, its published SPOT price).
    ff = load_planner_fleet(ROOT / "examples" / "fleet-gcp.yaml")
    assert ff.types == {"g2-standard-4": {"max_count": 32}}
    assert ff.slots == (1,)
    assert ff.spot_prices == {"g2-standard-4": 0.2827}
    book = TablePriceBook.load().with_prices(ff.on_demand_prices, ff.spot_prices)
    assert book.hourly("g2-standard-4", "spot") == 0.2827
    assert book.hourly("g2-standard-4", "on-demand") == 0.70683  # the table's, not overridden
    with pytest.raises(ValueError, match="give unit_s, or calibrate"):
        ff.host_types(None)  # no unit time anywhere: calibrate first
    assert ff.host_types(10.0)[0][0].unit_s == 10.0


def test_a_bad_planner_section_fails_the_controller_too(tmp_path):
    from boinc_dl.server.fleet.config import FleetConfigError, load_config, load_planner_fleet
    from boinc_dl.server.planner.fleetfile import FleetFileError, load_fleet

    good = (ROOT / "examples" / "fleet-aws.yaml").read_text()
    bad = tmp_path / "fleet.yaml"
    bad.write_text(good.replace("preempt_p: 0.05}   #", "preempt_p: 1.5}   #"))
    for load in (load_config, load_planner_fleet):
        with pytest.raises(FleetConfigError, match=r"planner.*types\.g4dn\.xlarge\.preempt_p"):
            load(bad)
    # The planner-only loader refuses a controller file rather than misreading it.
    with pytest.raises(FleetFileError, match="fleet controller file"):
        load_fleet(ROOT / "examples" / "fleet-aws.yaml")
    # Oversized and non-mapping files are refused before parsing.
    big = tmp_path / "big.yaml"
    big.write_text("types: {}\n" + "#" * (1 << 20))
    with pytest.raises(FleetFileError, match="larger than 1 MiB"):
        load_planner_fleet(big)
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    with pytest.raises(FleetFileError, match="mapping expected"):
        load_planner_fleet(lst)
    with pytest.raises(PriceError, match="positive"):
        TablePriceBook.load().with_prices({"x": -1.0}, {})
    for costs in ("{merge_s: fast}", "{merge_shared_s: -1}", "{nonsense: 1}", "{speedup: {2: 0}}"):
        bad.write_text(good.replace("  server: {type: c6i.xlarge}", f"  server: {{type: c6i.xlarge}}\n  costs: {costs}"))
        with pytest.raises(FleetConfigError, match="costs"):
            load_planner_fleet(bad)


def test_cli_plan_with_the_example_controller_file():
    """A fresh user's command line: the shipped spec and the shipped fleet file."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    out = subprocess.run([sys.executable, "-m", "boinc_dl.server.cli", "plan", str(ROOT / "examples" / "digits-vcasgd.yaml"),
                          "--fleet", str(ROOT / "examples" / "fleet-aws.yaml"), "--deadline", "8h"],
                         capture_output=True, text=True, env=env, timeout=180)
    assert out.returncode == 0, out.stderr + out.stdout
    assert "recommended (*)" in out.stdout
    assert "on-demand from the fleet file for g4dn.xlarge, g5.xlarge" in out.stdout


def test_run_check_compares_the_pipeline_not_the_start_up():
    """``boinc-dl run``'s check: the actual epoch time runs from the first unit's start
    to the last merge; the start-up before it is reported apart, not blamed on the model."""
    from boinc_dl.server.common.spec import parse_spec
    from boinc_dl.server.planner.runcheck import predict_epoch

    spec = parse_spec({"name": "c", "mode": "vcasgd", "model": "models:mlp", "dataset": {"name": "digits"},
                       "training": {"epochs": 2}, "vcasgd": {"n_subsets": 4},
                       "backend": {"kind": "local", "local": {"workers": 2, "slots": 1, "assimilators": 1}}})
    # 8 units of 1 s on 2 slots, merged at 101, 101, 102, 102, ... 104 (t = 100 + ...).
    units = [{"t": 101.0 + i // 2, "wall_s": 1.0} for i in range(8)]
    out = predict_epoch(spec, units, params=1000, elapsed_s=30.0, epochs_done=2)
    assert out["actual_epoch_s"] == pytest.approx(2.0)  # (104 - 100) / 2 epochs
    assert out["startup_s"] == pytest.approx(26.0)
    assert out["predicted_epoch_s"] == pytest.approx(2.0, rel=0.15)  # 2 waves of 1 s + merges
    assert out["configuration"] == {"workers": 2, "slots": 1, "assimilators": 1}
    # The run's --workers/--slots/--assimilators are the configuration that ran: one slot
    # runs the 8 units one after the other (it simulated the spec's 2 slots: half the time).
    one = predict_epoch(spec, units, params=1000, elapsed_s=30.0, epochs_done=2, backend_opts={"workers": 1})
    assert one["configuration"] == {"workers": 1, "slots": 1, "assimilators": 1}
    assert one["predicted_epoch_s"] == pytest.approx(4.0, rel=0.15)
    # Without timestamps the run's elapsed time is all there is.
    bare = predict_epoch(spec, [{"wall_s": 1.0}], params=1000, elapsed_s=30.0, epochs_done=2)
    assert bare["actual_epoch_s"] == pytest.approx(15.0) and bare["startup_s"] == 0
    assert predict_epoch(spec, [], params=1000, elapsed_s=30.0, epochs_done=2) is None
    # A run resumed after the job finished (0.02 s of its own) or part-way: the units are
    # older than the process, and its time says nothing of an epoch's (it read +63069%).
    assert predict_epoch(spec, units, params=1000, elapsed_s=0.02, epochs_done=2) is None
