"""The controller's Redis state against a real Redis: one actor per fleet (a lease with a
fencing token), commits that apply once, re-issue filings that are idempotent, reclaims
counted once per instance, and a clear error when Redis stays away."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from boinc_dl.server.assimilator.connection import connect
from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.backends.boinc.registry import BoincRegistry
from boinc_dl.server.common.errors import BoincDLError, StoreUnavailable
from boinc_dl.server.fleet.records import FallbackState, InstanceRecord
from boinc_dl.server.fleet.state import Commit, FleetState, LeaseLost


def rec(uid: str, charged: int = 1000) -> InstanceRecord:
    return InstanceRecord(uid=uid, name=uid, type="g5.xlarge", market="spot", zone="z", launched_ms=0,
                          charged_from_ms=0, charged_ms=charged, seen_ms=charged)


def test_one_controller_acts_and_a_stale_one_is_fenced(redis_server) -> None:
    r = connect(redis_server.url)
    a, b = FleetState(r, "gpu", owner="a"), FleetState(r, "gpu", owner="b")
    assert a.hold(0.4)[0]
    held, holder, left = b.hold(0.4)
    assert not held and holder == "a" and 0 < left <= 0.4
    assert a.hold(0.4)[0]  # renewal keeps the token
    token_a = a.token
    time.sleep(0.5)  # a stalls past its lease: b takes over with a higher fence
    assert b.hold(5)[0] and int(b.token) > int(token_a)
    with pytest.raises(LeaseLost):
        a.commit(Commit(records={"i-1": rec("i-1")}), 0)
    assert b.commit(Commit(records={"i-1": rec("i-1")}), 0)
    assert set(b.records()) == {"i-1"}
    assert not a.hold(5)[0]  # a cannot take it back while b holds it
    b.release()
    assert a.hold(5)[0] and a.holder()[0] == "a"  # a clean stop frees the fleet at once
    with pytest.raises(LeaseLost):
        b.publish_status({"running": 3})
    other = FleetState(r, "cpu", owner="b")  # another fleet: its own lease
    assert other.hold(5)[0]
    with pytest.raises(BoincDLError, match="fleet name"):
        FleetState(r, "a{b}")


def test_commit_applies_once_and_keeps_the_books(redis_server) -> None:
    r = connect(redis_server.url)
    st = FleetState(r, "gpu", owner="a")
    st.hold(10)
    c = Commit(records={"i-1": rec("i-1", 5000)}, ledger=Counter({("job1", "nusd|g5.xlarge|spot"): 12_345_678_901}),
               reclaims={"i-1": (100.0, 30)}, fallback=FallbackState(True, 100.0, 100.0, "storm"))
    assert st.commit(c, 0)
    # the same instance reclaimed again (a duplicate warning) is not counted again
    assert st.commit(Commit(reclaims={"i-1": (150.0, 40)}, ledger=Counter({("job1", "nusd|g5.xlarge|spot"): 1})), 0)
    assert st.reclaims_since(0) == [("i-1", 100.0, 30)]
    assert st.job_ledger("job1") == {"nusd|g5.xlarge|spot": 12_345_678_902}
    assert st.records()["i-1"].charged_ms == 5000 and st.fallback().reason == "storm"
    assert st.commit(Commit(records={"i-1": None}), 200.0)  # forgotten, and old reclaims pruned
    assert st.records() == {} and st.reclaims_since(0) == []
    assert st.commit(Commit(), 0)  # nothing to do: no call


def test_a_resent_commit_is_a_no_op(redis_server, monkeypatch) -> None:
    """A reply lost after Redis applied the commit: the retry finds its token."""
    r = connect(redis_server.url)
    st = FleetState(r, "gpu", owner="a")
    st.hold(10)
    sc = st._script("commit", __import__("boinc_dl.server.fleet.state", fromlist=["_COMMIT"])._COMMIT)
    calls = []

    def flaky(keys, args):  # noqa: ANN001, ANN202
        out = sc(keys=keys, args=args)
        calls.append(out)
        if len(calls) == 1:
            import redis

            raise redis.ConnectionError("reply lost")
        return out

    monkeypatch.setitem(st._scripts, "commit", flaky)
    assert st.commit(Commit(ledger=Counter({("j", "lost_ms"): 7})), 0) is False  # applied by the first try
    assert calls == [1, 0] and st.job_ledger("j") == {"lost_ms": 7}


def test_filing_reissue_is_idempotent(redis_server) -> None:
    r = connect(redis_server.url)
    st = FleetState(r, "gpu")
    assert st.file_reissue({"jobA": ["jobA_e1_s0", "jobA_e1_s1"]}, 100.0) == ["jobA_e1_s0", "jobA_e1_s1"]
    assert st.file_reissue({"jobA": ["jobA_e1_s1", "jobA_e1_s2"]}, 101.0) == ["jobA_e1_s2"]
    key = BoincRegistry(JobStore(r, "jobA")).reissue_key
    assert {x.decode() for x in r.smembers(key)} == {"jobA_e1_s0", "jobA_e1_s1", "jobA_e1_s2"}
    assert 0 < r.ttl(key) <= 7 * 86400 and set(st.requested()) == {"jobA_e1_s0", "jobA_e1_s1", "jobA_e1_s2"}


def test_redis_gone_is_a_clear_error_after_the_retry_window(redis_server) -> None:
    r = connect(redis_server.url)
    st = FleetState(r, "gpu", retry_s=0.5)
    assert st.hold(10)[0]
    redis_server.kill()
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable, match="fleet gpu"):
        st.records()
    assert time.monotonic() - t0 < 5


def test_a_record_written_before_reclaims_counted_keeps_its_count() -> None:
    """A reclaimed life stored by an earlier release had its jobs counted already: read
    back, they are not counted again; a life known only as gone has none counted."""
    import json

    base = InstanceRecord(uid="i-1", name="h", type="t", market="spot", zone="z", launched_ms=1, charged_from_ms=1,
                          charged_ms=1, seen_ms=1, lost_since={"jobA": 5, "jobB": 7})
    old = json.loads(base.dumps())
    del old["reclaims_counted"]
    assert InstanceRecord.loads(json.dumps({**old, "reclaim_ms": 9})).reclaims_counted == ["jobA", "jobB"]
    assert InstanceRecord.loads(json.dumps({**old, "vanished": True})).reclaims_counted == []
    again = InstanceRecord.loads(base.dumps())
    assert again == base
