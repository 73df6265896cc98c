"""The hosts' loss ledger: a CUSUM of each host's untrusted results' held-out loss
changes in trusted units (rules.LossLedger), kept in Redis with the verdicts
(losscheck.settle), and what it does to a patient host through the framework."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest

from boinc_dl.server.assimilator import losscheck as lc
from boinc_dl.server.assimilator.framework import Delivery, assimilate
from boinc_dl.server.assimilator.rules import LedgerReference, LossLedger
from tests import test_loss_check
from tests.conftest import tiny_spec
from tests.test_loss_check import BASE_LOSS, TARGET, checker_running, result, seed_trusted

job = test_loss_check.job  # the loss check's job fixture (a tiny job with a checker's directory)

TRUSTED = (-0.30, -0.25, -0.2, -0.28, -0.22, -0.26, -0.24, -0.27)  # the ledger's reference: 8
MED = float(np.median(TRUSTED))
SCALE = 1.0 / LossLedger(z_cap=math.inf).score(MED + 1.0, TRUSTED)  # its scale (its floor: half the |median|)


# ---- the rule ------------------------------------------------------------------------------

def test_score_is_in_trusted_units_and_needs_enough_of_them() -> None:
    led = LossLedger(rel_floor=0.0)
    assert led.score(0.0, []) is None  # no reference yet: no ledger
    assert led.score(MED, TRUSTED) == pytest.approx(0.0)
    mad = 1.4826 * float(np.median(np.abs(np.asarray(TRUSTED) - MED)))
    assert led.score(MED + 1.2 * mad, TRUSTED) == pytest.approx(1.2)
    assert led.score(float("nan"), TRUSTED) == math.inf
    # the scale's floor: a share of the median's size (trusted results that agree closely)
    assert LossLedger(rel_floor=0.25).score(-0.25 + 0.0625, [-0.25] * 8) == pytest.approx(1.0)
    assert LossLedger(z_cap=math.inf).score(MED + 1.0, TRUSTED) == pytest.approx(1.0 / max(mad, 0.5 * abs(MED)))
    # one result adds at most z_cap - slack to its host's balance (a non-finite one: everything)
    assert LossLedger().score(MED + 1.0, TRUSTED) == 1.5 and LossLedger().score(math.inf, TRUSTED) == math.inf


def test_a_comparable_reference_is_taken_at_the_results_base() -> None:
    """Trusted changes measured from older, worse bases improved more than a result from
    today's base can: their trend in the base loss, taken at the result's base, is what an
    honest result is expected to do (the plain median would charge it)."""
    led = LossLedger()
    bases = [round(2.0 - i / 7, 4) for i in range(8)]  # 2.0 down to the result's 1.0
    trend = [(1, -0.1 * b + 0.002 * (-1) ** i, b) for i, b in enumerate(bases)]  # a change of -0.1 x the base loss
    ref = led.reference(trend, 1, 1.0)
    assert ref.comparable and ref.bases == bases
    centre, _ = led.centre_scale(ref, base_loss=1.0)
    assert centre == pytest.approx(-0.1, abs=0.003)
    assert abs(led.score(-0.1, ref, base_loss=1.0)) < 0.1
    assert led.score(-0.1, ref.values) > 0.6  # against the median of older bases' changes (-0.15): charged
    # never beyond the trusted changes' range (a trend is not extrapolated)
    assert led.centre_scale(ref, base_loss=0.6)[0] == pytest.approx(max(ref.values))
    # no trend without every base, or from a stale reference
    assert led.centre_scale(ref._replace(bases=bases[:-1] + [None]), base_loss=1.0)[0] == pytest.approx(
        float(np.median(ref.values)))
    assert led.centre_scale(ref._replace(comparable=False), base_loss=1.0)[0] == 0.0


def test_the_reference_is_the_latest_comparable_trusted_changes() -> None:
    led = LossLedger(window=3)
    vals = [(1, -0.9, 0.5), (1, -0.8, 0.5), (2, -0.3, 0.5), (2, -0.2, 0.5), (3, -0.1, 0.5), (5, 9.0, 0.5)]
    def ref(*a):  # noqa: ANN202
        got = led.reference(*a)
        return got.values, got.comparable

    assert ref(vals, 3, 0.5) == ([-0.3, -0.2, -0.1], True)  # the newest 3 up to the result's epoch
    assert ref(vals, 2, 0.5) == ([-0.8, -0.3, -0.2], True)
    assert ref(vals, 1, 0.5) == ([], False)  # fewer than the window: the ledger waits
    # measured from bases at most twice as bad as the result's: comparable
    assert ref(vals, 3, 0.25) == ([-0.3, -0.2, -0.1], True)
    # from worse models (a converged model, no replication since): the latest, not comparable
    assert ref(vals, 3, 0.2) == ([-0.3, -0.2, -0.1], False)
    # the older, much worse ones do not make up the window of a comparable reference
    mixed = [(1, -0.9, 2.0), (1, -0.8, 2.0), (2, -0.3, 0.3), (2, -0.2, 0.3), (3, -0.1, 0.3)]
    assert ref(mixed, 3, 0.3) == ([-0.3, -0.2, -0.1], True)
    assert led.reference(mixed, 3, 0.3).bases == [0.3, 0.3, 0.3]
    assert ref(mixed[:4] + [(3, -0.1, None)], 3, 0.3) == ([-0.3, -0.2, -0.1], False)  # no base loss
    assert ref(vals, 3, None)[1] is False and ref(vals, 3, math.nan)[1] is False


def test_a_stale_reference_charges_only_a_rising_loss() -> None:
    """The project stopped replicating: the trusted changes are the first epoch's large
    improvements. An honest result of the converged model that no longer lowers the loss
    scored against them would score 1/rel_floor = 2 (counted 1.5, z_cap) each time, and its
    host be refused by its seventh result; not comparable, it is scored from a centre no
    lower than 0."""
    led = LossLedger()
    early = [(1, v, 2.3) for v in TRUSTED]
    ref, comparable, _ = led.reference(early, 9, 0.1)
    assert ref == list(TRUSTED) and not comparable
    assert led.score(0.0, ref) == pytest.approx(1.5)  # what a comparable reference would say (capped)
    b = 0.0
    for _ in range(100):
        b, ok = led.step(b, led.score(0.0, ref, comparable))
        assert ok
    assert b == 0.0
    # a rising loss is still charged, in the reference's units
    assert led.score(0.5 * SCALE, ref, comparable) == pytest.approx(0.5 * SCALE / SCALE)
    assert led.score(math.inf, ref, comparable) == math.inf


def test_balance_steps() -> None:
    led = LossLedger(slack=0.5, limit=6.0)
    assert led.step(0.0, -3.0) == (0.0, True)  # never below zero: good work earns no credit
    assert led.step(1.0, 0.5) == (1.0, True)  # at the slack: no change
    b, ok, n = 0.0, True, 0
    while ok:  # z = 1.5 each: +1 per result, refused when past 6
        b, ok = led.step(b, 1.5)
        n += 1
    assert n == 7 and b == 6.0
    assert led.step(6.0, 0.4) == pytest.approx((5.9, True))  # a result no worse than the slack passes
    assert led.step(6.0, 0.6) == (6.0, False)  # a refused host stays at the limit, not beyond
    assert led.step(0.0, math.inf) == (6.0, False) and led.step(0.0, 8.0) == (6.0, False)
    assert led.step(float("nan"), 0.0) == (0.0, True)  # a corrupt stored balance reads as none


def test_honest_scores_rarely_alarm_and_a_patient_host_is_held_to_the_slack() -> None:
    led = LossLedger()
    rng = np.random.default_rng(7)
    b, refused = 0.0, 0
    for z in rng.standard_normal(20_000):  # honest: scored like the trusted ones
        b, ok = led.step(b, float(z))
        refused += not ok
    assert refused / 20_000 < 0.005
    # a host scoring 2 on average (inside a per-result bound of 6): most of its results refused,
    # and what passes averages no more than the slack plus the limit spread over them
    b, passed = 0.0, []
    for z in rng.normal(2.0, 1.0, 2_000):
        b, ok = led.step(b, float(z))
        if ok:
            passed.append(float(z))
    assert len(passed) < 0.25 * 2_000
    assert sum(passed) <= led.slack * len(passed) + led.limit + 1e-9


# ---- in Redis, with the verdicts -----------------------------------------------------------------

def _verdict(x: float, base_loss: float | None = BASE_LOSS) -> dict:
    return {**lc.decide(x, None), "loss_increase": x, "base_loss": base_loss}


def test_settle_moves_a_hosts_balance_once_per_verdict(job) -> None:
    store, spec, *_ = job
    seed_trusted(store, TRUSTED)
    req = {"model": "0", "epoch": 1, "host": "17"}
    v, _ = lc.settle(store, spec, "r1", req, _verdict(MED + 1.4 * SCALE))
    assert v["ok"] and v["ledger_score"] == pytest.approx(1.4) and v["ledger_balance"] == pytest.approx(0.9)
    # a second verdict on the same result (a re-queued request, a second checker): first wins,
    # and the balance does not move again
    again, _ = lc.settle(store, spec, "r1", req, _verdict(MED + 5 * SCALE))
    assert again == v and store.ledger_balances() == {"17": pytest.approx(0.9)}
    # without a host (one the job system did not name), or with a name that is not one: no ledger
    v2, _ = lc.settle(store, spec, "r2", {"model": "0", "epoch": 1, "host": None}, _verdict(MED + 5 * SCALE))
    v3, _ = lc.settle(store, spec, "r3", {"model": "0", "epoch": 1, "host": "../x"}, _verdict(MED + 5 * SCALE))
    assert "ledger_score" not in v2 and "ledger_score" not in v3 and set(store.ledger_balances()) == {"17"}


def test_settle_refuses_within_the_bound_once_the_ledger_is_spent(job) -> None:
    store, spec, *_ = job
    seed_trusted(store, TRUSTED)
    verdicts = [lc.settle(store, spec, f"r{i}", {"model": "0", "epoch": 1, "host": "9"}, _verdict(MED + 3 * SCALE))[0]
                for i in range(8)]
    # each scores 3, counted as 1.5 (z_cap): 1, 2, ..., 6, then past 6
    assert [v["ok"] for v in verdicts] == [True] * 6 + [False, False]
    assert [v["ledger_score"] for v in verdicts[:6]] == [1.5] * 6
    verdicts = verdicts[4:]
    assert "the host's ledger" in verdicts[2]["reason"] and "limit 6" in verdicts[2]["reason"]
    assert store.ledger_balances() == {"9": pytest.approx(6.0)}


def test_concurrent_checkers_never_lose_a_step(job) -> None:
    """Two daemons' checkers judging one host's results at once: each step applies to the
    balance the other left (compare-and-set with the verdict)."""
    store, spec, *_ = job
    seed_trusted(store, TRUSTED)
    out: list[dict] = []
    start = threading.Barrier(8)

    def one(i: int) -> None:
        start.wait()
        out.append(lc.settle(store, spec, f"c{i}", {"model": "0", "epoch": 1, "host": "5"}, _verdict(MED + 1.0 * SCALE))[0])
    ts = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert len(out) == 8 and all(v["ok"] for v in out)
    assert sorted(v["ledger_balance"] for v in out) == pytest.approx([0.5 * k for k in range(1, 9)])
    assert store.ledger_balances() == {"5": pytest.approx(4.0)}


# ---- through the framework and the checker -----------------------------------------------------

def _value_for(loss_increase: float) -> float:
    """The uniform weight whose numpy loss is ``loss_increase`` above the base's (all zeros: 1)."""
    return TARGET - math.sqrt(1.0 + loss_increase)


def test_a_patient_host_inside_the_bound_is_refused_by_its_ledger(job, tmp_path: Path) -> None:
    """Each of the patient host's results lowers the held-out loss less than honest ones do
    (1.4 of the ledger's units above their median, still below zero: a non-rising loss
    always passes the per-result bound). Its seventh is refused (+0.9 a result); the honest
    host beside it merges every result. The host is the job system's, in the Delivery."""
    store, spec, fp, job_dir = job
    seed_trusted(store, TRUSTED)
    base = store.unit_info("u0")
    outs: dict[str, list[str]] = {"patient": [], "honest": []}
    with checker_running(store, spec, job_dir):
        for i in range(8):
            for who, host, x in (("patient", "41", MED + 1.4 * SCALE), ("honest", "42", MED)):
                unit = f"{who}{i}"
                store.register_unit(unit, {**base, "shard": i % 4}, 1)
                out = assimilate(store, Delivery(unit, f"{unit}_0", unit=unit, final=True, host=host,
                                                 files=result(tmp_path, store, fp, unit, _value_for(x))), spec=spec)
                outs[who].append(out.status)
                if out.status == "rejected":
                    assert "the host's ledger" in out.reason and out.host_fault
    assert outs["honest"] == ["merged"] * 8
    assert outs["patient"][:6] == ["merged"] * 6 and set(outs["patient"][6:]) == {"rejected"}
    rec = store.assimilated()["patient5"]
    assert rec["ledger_score"] == pytest.approx(1.4, rel=1e-3) and rec["ledger_balance"] == pytest.approx(5.4, rel=1e-3)
    assert store.ledger_balances() == {"41": pytest.approx(6.0), "42": 0.0}
    # the refusals went through the usual path: recorded, the unit given up (BOINC's final result)
    assert {r["unit"] for r in store.rejections(50)} == {f"patient{i}" for i in range(6, 8)}


def test_the_ledger_can_be_switched_off(tiny_job, tmp_path: Path) -> None:
    store, _spec, fp = tiny_job
    spec = tiny_spec(validation={"loss_check_min_trusted": 4, "loss_check_wait_s": 1.0, "loss_ledger": False})
    job_dir = tmp_path / "jobdir"
    job_dir.mkdir()
    store.set_meta(job_dir=str(job_dir))
    seed_trusted(store, TRUSTED)
    base = store.unit_info("u0")
    with checker_running(store, spec, job_dir):
        for i in range(5):
            unit = f"p{i}"
            store.register_unit(unit, {**base, "shard": i % 4}, 1)
            out = assimilate(store, Delivery(unit, f"{unit}_0", unit=unit, final=True, host="41",
                                             files=result(tmp_path, store, fp, unit, _value_for(MED + 1.9 * SCALE))),
                             spec=spec)
            assert out.status == "merged"
    assert store.ledger_balances() == {}


def test_status_shows_the_hosts_nearest_their_limit(job, redis_server, tmp_path: Path) -> None:
    """``boinc-dl status`` (the command as an admin runs it) lists the ledgers, fullest first."""
    store, spec, *_ = job
    seed_trusted(store, TRUSTED)
    for i, (host, z) in enumerate((("31", 2.0), ("31", 2.0), ("32", 1.0), ("33", -2.0))):
        lc.settle(store, spec, f"s{i}", {"model": "0", "epoch": 1, "host": host}, _verdict(MED + z * SCALE))
    store.record_rejection("tiny__m0_e0001_s0009", "r9", "held-out loss check, the host's ledger", "31")
    cmd = [sys.executable, "-m", "boinc_dl.server.cli", "status", store.job, "--redis-url", redis_server.url]
    res = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    st = json.loads(res.stdout)
    assert st["ledgers"] == {"0": {"31": 2.0, "32": 0.5, "33": 0.0}} and st["ledger_limit"] == 6.0
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path).stdout
    rejected = next(line for line in out.splitlines() if "s0009" in line)  # the refusal names BOINC's host
    assert " 31 " in rejected.replace("│", " ")
    assert "loss ledgers" in out and "refused past 6" in out and "2.00" in out
    assert out.index("2.00") < out.index("0.50") and "33" not in out.split("loss ledgers")[1]


# ---- trusted changes from worse models (a project that stopped replicating) -----------------

def test_the_bound_follows_comparable_changes_and_otherwise_only_their_spread() -> None:
    from boinc_dl.server.assimilator.rules import loss_increase_bound, median_spread

    med, spread = median_spread(TRUSTED)
    near = [(1, v, 1.5) for v in TRUSTED]  # bases at most 1.5 times as bad as the result's (1.0)
    far = [(1, v, 2.5) for v in TRUSTED]
    assert loss_increase_bound(near, 1, 1.0, k=6, min_samples=8) == (pytest.approx(med + 6 * spread), True)
    assert loss_increase_bound(far, 1, 1.0, k=6, min_samples=8) == (pytest.approx(6 * spread), False)
    assert loss_increase_bound(far[:7], 1, 1.0, k=6, min_samples=8) == (None, False)  # too few at all
    assert loss_increase_bound(far, 0, 1.0, k=6, min_samples=8) == (None, False)  # none up to the epoch
    # a rising median is kept: a centre is only raised to 0, never lowered
    up = [(1, v + 1.0, 2.5) for v in TRUSTED]
    assert loss_increase_bound(up, 1, 1.0, k=6, min_samples=8)[0] == pytest.approx(med + 1.0 + 6 * spread)


def test_the_bound_compares_more_strictly_than_the_ledger() -> None:
    """Changes from bases 1.8x as bad as the result's: the ledger may score with them (its
    centre follows their trend in base loss), the bound's plain median may not (their
    larger improvements would put a negative centre under an honest result)."""
    from boinc_dl.server.assimilator.rules import (
        BASE_RATIO,
        BOUND_BASE_RATIO,
        LossLedger,
        loss_increase_bound,
    )

    assert BOUND_BASE_RATIO < 1.8 <= BASE_RATIO
    mid = [(1, v, 1.8) for v in TRUSTED]
    assert loss_increase_bound(mid, 1, 1.0, k=6, min_samples=8)[1] is False
    assert loss_increase_bound(mid, 1, 1.0, k=6, min_samples=8, ratio=BASE_RATIO)[1] is True
    assert LossLedger(window=8).reference(mid, 1, 1.0).comparable is True


def test_a_converged_model_with_stale_trusted_changes_refuses_only_a_rising_loss(job, tmp_path: Path,
                                                                                  redis_server) -> None:
    """No result replicated since the first epoch, whose bases' loss was 5x the current
    one: honest results that no longer lower the loss (+0.01, noise) merge, where a bound
    and a reference centred on those first improvements would refuse them all (checked
    here on the same store with comparable trusted changes); a host that raises the loss
    inside the bound is still refused by its ledger. Each such verdict is counted once, and
    ``boinc-dl status`` says to replicate more."""
    store, spec, fp, job_dir = job
    seed_trusted(store, TRUSTED, base_loss=5 * BASE_LOSS)
    base = store.unit_info("u0")
    bound, comparable = lc.bound_for(store, spec, "0", 1, BASE_LOSS)
    assert not comparable and 0.01 < bound
    rising = 0.9 * bound  # inside the per-result bound, far above honest noise
    outs: dict[str, list[str]] = {"honest": [], "raiser": []}
    with checker_running(store, spec, job_dir):
        for i in range(10):
            for who, host, x in (("honest", "42", 0.01), ("raiser", "43", rising)):
                unit = f"{who}{i}"
                store.register_unit(unit, {**base, "shard": i % 4}, 1)
                out = assimilate(store, Delivery(unit, f"{unit}_0", unit=unit, final=True, host=host,
                                                 files=result(tmp_path, store, fp, unit, _value_for(x))), spec=spec)
                outs[who].append(out.status)
    assert outs["honest"] == ["merged"] * 10
    # +0.76 a result (z = 0.9 bound / (half the stale median's size) = 1.26): refused from its 8th
    assert outs["raiser"] == ["merged"] * 7 + ["rejected"] * 3
    assert "taken no lower than 0" in store.rejections(1)[0]["reason"]
    assert store.loss_checks_stale() == {"0": 20}
    rec = store.assimilated()["honest9"]
    assert rec["ledger_comparable"] is False and rec["bound_comparable"] is False
    # one more verdict counts once; judged again (a re-queued request), the verdict and the count stay
    req = {"model": "0", "epoch": 1, "host": "42"}
    first, _ = lc.settle(store, spec, "dup", req, _verdict(0.01))
    again, _ = lc.settle(store, spec, "dup", req, _verdict(0.01))
    assert again == first and store.loss_checks_stale() == {"0": 21}
    # the same honest result against comparable trusted changes: refused by the bound
    seed_trusted(store, TRUSTED * 6, base_loss=BASE_LOSS)
    bound2, comparable2 = lc.bound_for(store, spec, "0", 1, BASE_LOSS)
    assert comparable2 and not lc.decide(0.01, bound2)["ok"]
    from boinc_dl.server.run.status import job_status

    assert job_status(store)["loss_checks_stale"] == {"0": 21}  # what --json prints
    cmd = [sys.executable, "-m", "boinc_dl.server.cli", "status", store.job, "--redis-url", redis_server.url]
    wide = {**os.environ, "COLUMNS": "400"}  # one line per row
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=wide).stdout
    assert "21 result(s) judged against trusted results from worse models" in " ".join(out.split())


# ---- hostile numbers -------------------------------------------------------------------------------

def test_no_number_a_result_or_a_reference_holds_makes_a_score_that_pays_down_a_balance() -> None:
    """Loss changes near the float range (a diverged model's, a crafted result's), bases
    of every size: a score is None (no reference), +inf, or a finite number at most
    z_cap; never NaN. And a NaN score, wherever it came from, never reads as a paid-down
    balance (``max(0, nan)`` is 0)."""
    led = LossLedger()
    rng = np.random.default_rng(2026)
    special = [0.0, 1e308, -1e308, 5e-324, 1e300, 1e-300, 3e38, -3e38]

    def draw(positive: bool = False) -> float:
        if rng.random() < 0.3:
            v = float(rng.choice(special))
            return abs(v) if positive else v
        v = float(rng.normal(0.0, 10.0 ** int(rng.integers(-6, 6))))
        return abs(v) + 1e-9 if positive else v

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and numpy's warnings stay inside the ledger
        for _ in range(3000):
            ref = LedgerReference([draw() for _ in range(8)], bool(rng.random() < 0.8),
                                  [draw(positive=True) for _ in range(8)])
            z = led.score(draw(), ref, base_loss=draw(positive=True))
            assert z is not None and not math.isnan(z) and (z == math.inf or z <= led.z_cap), (z, ref)
            b, _ = led.step(float(rng.uniform(0, 6)), z)
            assert 0.0 <= b <= led.limit
    assert led.step(5.0, math.nan) == (led.limit, False)
    assert led.step(5.0, -math.inf) == (0.0, True)
