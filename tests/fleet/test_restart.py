"""The controller as a process, SIGKILLed in the middle of a storm and restarted: nothing
lost, nothing repeated, the fallback and its hold kept, the ledger equal to a bill
recomputed from the cloud's own launch and end times (AWS in moto's server; GCP's
stand-in, where a preempted VM comes back under its name with a new id and is
preempted again while the controller is down). One seeded case each; the bench runs 30.
"""

from __future__ import annotations

from tests.fleet.storm import aws_kill_storm, gcp_lives


def test_aws_storm_with_a_kill_and_restart(aws_session, moto_url, redis_server, fleet_mariadb, tmp_path,
                                           monkeypatch) -> None:
    out = aws_kill_storm(3, moto_url, aws_session, redis_server.url, fleet_mariadb, tmp_path / "storm", monkeypatch,
                         hosts=16, victims=6)
    assert out["exit"] == 0
    assert out["filed_are_lost"] and out["filed"] == out["lost_units"] == 12  # every lost unit, early, once
    assert out["handed_are_lost"] and out["handed_twice"] == 0
    assert out["latency_max_s"] < 60 < out["deadline_s"]  # none waited for its deadline
    assert out["instances_launched"] == out["expected_launched"]  # one replacement per reclaim
    assert out["reclaims_counted"] == out["job_reclaims"] == 6
    if out["fallback_active_before_kill"]:
        assert out["fallback_kept"] and out["on_demand_percent"] == 50
    # each period's charge is rounded to the nano-dollar (a few per instance and period),
    # and an ended life may be billed up to the second its cloud-reported end truncated
    # (well below the cent)
    slack = 1000 + out["resolution_allowance_nusd"]
    assert abs(out["ledger_minus_independent_nusd"]) < slack, out
    assert abs(out["waived_minus_independent_nusd"]) < slack, out
    assert slack < 10**7


def test_gcp_name_preempted_twice_across_a_restart(redis_server, fleet_mariadb, tmp_path) -> None:
    out = gcp_lives(5, redis_server.url, fleet_mariadb, tmp_path / "lives")
    assert out["exit"] == 0 and out["lives_of_the_name"] == 3  # preempted, recreated, preempted, recreated
    assert out["filed_are_lost"] and out["latency_first_s"] < 30 and out["latency_second_s"] < 30
    assert out["both_lives_charged"] and out["reclaims_counted"] == 2
    assert abs(out["ledger_minus_independent_nusd"]) < 1000, out
