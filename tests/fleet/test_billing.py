"""Billing like the cloud: per second with a 60 s minimum, AWS's first-hour rule for spot
instances EC2 interrupts, lost compute up to the real end, what draining saved. The
ledger's pure part, against amounts worked out by hand."""

from __future__ import annotations

from decimal import Decimal

from boinc_dl.server.fleet.aws import BILLING as AWS
from boinc_dl.server.fleet.cost import Ledger
from boinc_dl.server.fleet.gcp import BILLING as GCP
from boinc_dl.server.fleet.prices import StepPriceBook
from boinc_dl.server.fleet.records import InstanceRecord
from boinc_dl.server.fleet.state import Commit

SPOT = Decimal("0.36")  # $/h: 0.1 m$ per second
OD = Decimal("1.08")
NS = 100_000  # nano-dollars per second at SPOT


def book() -> StepPriceBook:
    return StepPriceBook(on_demand={"x.large": OD}, spot_flat={"x.large": SPOT})


def life(launched_s: float = 0.0, market: str = "spot") -> InstanceRecord:
    t = round(launched_s * 1000)
    return InstanceRecord(uid="i-1", name="i-1", type="x.large", market=market, zone="z", launched_ms=t,
                          charged_from_ms=t, charged_ms=t, seen_ms=t)


def spent(c: Commit, job: str = "j", market: str = "spot") -> int:
    return c.ledger[(job, f"nusd|x.large|{market}")]


def test_rules_round_up_to_the_second_with_a_minute_minimum() -> None:
    assert AWS.billed_end_ms(0, 20_000) == 60_000
    assert AWS.billed_end_ms(0, 61_001) == 62_000
    assert AWS.billed_end_ms(5, 5) == 5  # never ran: not billed
    assert AWS.provisional("spot", 0, 3_599_999) and not AWS.provisional("spot", 0, 3_600_000)
    assert not AWS.provisional("on-demand", 0, 10) and not GCP.provisional("spot", 0, 10)
    assert AWS.waived("spot", 0, 3_000_000, by_cloud=True) and not AWS.waived("spot", 0, 3_000_000, by_cloud=False)


def test_a_short_life_is_billed_a_minute() -> None:
    ledger, c, rec = Ledger(book(), AWS), Commit(), life(market="on-demand")
    ledger.charge(rec, 10_000, {"j": 1}, c)
    ledger.settle(rec, 20_500, False, {"j": 1}, c, 30_000)
    assert spent(c, market="on-demand") == 60 * 300_000 and c.ledger[("j", "ms|x.large|on-demand")] == 60_000


def test_ec2_interrupting_in_the_first_hour_waives_the_bill() -> None:
    """Charged provisionally while the waiver may come; waived when EC2 reclaims it."""
    ledger, c, rec = Ledger(book(), AWS), Commit(), life()
    ledger.charge(rec, 600_000, {"j": 1}, c)
    assert spent(c) == 0 and rec.pending["j"][1] == 600 * NS  # provisional, not in the ledger
    rec.reclaim_ms, rec.handled_ms, rec.action = 1_000_000, 1_000_500, "drain"
    rec.lost_since = {"j": 400_000}
    ledger.settle(rec, 1_120_000, True, {"j": 1}, c, 1_130_000)
    assert spent(c) == 0 and rec.pending == {}
    assert c.ledger[("j", "waived_nusd")] == 1120 * NS and c.ledger[("j", "waived_n")] == 1
    # terminating on the warning would have been billed to then (1000.5 s -> 1001 s)
    assert c.ledger[("j", "drain_saved_nusd")] == 1001 * NS
    assert c.ledger[("j", "ms|x.large|spot")] == 1_120_000  # the hours were used all the same
    assert c.ledger[("j", "lost_ms")] == 720_000 and c.ledger[("j", "lost_nusd")] == 0  # nothing paid


def test_the_owners_termination_in_the_first_hour_is_billed() -> None:
    ledger, c, rec = Ledger(book(), AWS), Commit(), life()
    ledger.charge(rec, 600_000, {"j": 1}, c)
    rec.reclaim_ms, rec.handled_ms, rec.action, rec.terminated_ms = 700_000, 700_000, "replace", 700_000
    rec.lost_since = {"j": 650_000}
    ledger.settle(rec, 700_000, False, {"j": 1}, c, 710_000)
    assert spent(c) == 700 * NS and rec.pending == {}
    # lost compute: to the real end (the termination), not the end EC2 announced
    assert c.ledger[("j", "lost_ms")] == 50_000 and c.ledger[("j", "lost_nusd")] == 50 * NS
    assert ("j", "drain_saved_nusd") not in c.ledger


def test_past_the_first_hour_charges_are_final_and_draining_pays_the_notice() -> None:
    ledger, c, rec = Ledger(book(), AWS), Commit(), life()
    ledger.charge(rec, 3_000_000, {"j": 1}, c)
    ledger.charge(rec, 3_700_000, {"j": 1}, c)  # past the hour: the provisional part is final now
    assert spent(c) == 3700 * NS and rec.pending == {}
    rec.reclaim_ms, rec.handled_ms, rec.action = 3_800_000, 3_800_000, "drain"
    ledger.settle(rec, 3_920_000, True, {"j": 1}, c, 3_930_000)
    assert spent(c) == 3920 * NS
    assert c.ledger[("j", "drain_saved_nusd")] == -120 * NS  # the notice time terminate would not have paid


def test_charges_split_over_jobs_and_idle_time_is_unattributed() -> None:
    ledger, c, rec = Ledger(book(), AWS), Commit(), life(market="on-demand")
    ledger.charge(rec, 100_000, {"a": 1, "b": 3}, c)
    ledger.charge(rec, 200_000, {}, c)
    assert spent(c, "a", "on-demand") + spent(c, "b", "on-demand") == 100 * 300_000
    assert spent(c, "b", "on-demand") == 3 * spent(c, "a", "on-demand")
    assert spent(c, "_unattributed", "on-demand") == 100 * 300_000
    assert c.ledger[("a", "od_nusd")] + c.ledger[("b", "od_nusd")] == 100 * 300_000


def test_an_unknown_price_leaves_the_time_uncharged_until_known() -> None:
    ledger, c = Ledger(StepPriceBook(), AWS), Commit()
    rec = life(market="on-demand")
    rec.type = "no.such-type"
    assert ledger.charge(rec, 100_000, {"j": 1}, c) is False and rec.charged_ms == 0 and not c.ledger
    assert ledger.settle(rec, 100_000, False, {"j": 1}, c, 100_000) is False and rec.settled_ms is None
