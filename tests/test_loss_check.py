"""The held-out loss check in the merge path: the Redis protocol between an assimilator
and the work generator's checker, the checker's decision, and its failure paths.

The checker runs here with a numpy loss (the distance to a target model) instead of a
Keras forward pass: everything else (Redis, files, the framework, the checker loop in a
thread) is the real thing. tests/boinc/test_loss_check_boinc.py runs it with
TensorFlow inside the real work generator daemon.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import redis

from boinc_dl.server.assimilator import losscheck as lc
from boinc_dl.server.assimilator.framework import Delivery, assimilate
from boinc_dl.server.assimilator.policy import trusted_radius
from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.common.errors import StoreUnavailable
from boinc_dl.server.common.weights import WeightsFile, write_weights
from boinc_dl.server.work_generator.losscheck import JobChecker, LossChecker, held_out_batch
from tests.conftest import tiny_spec
from tests.hostile_corpus import ATTACKS
from tests.support.attacks import Attack, craft

TARGET = 1.0  # the "good" model: every weight 1 (the base, version 0, is all zeros)


def np_loss(flat: np.ndarray) -> float:
    return float(np.mean((flat.astype(np.float64) - TARGET) ** 2))


@pytest.fixture
def job(tiny_job, tmp_path: Path):
    store, _spec, fp = tiny_job
    spec = tiny_spec(validation={"loss_check_min_trusted": 4, "loss_check_wait_s": 1.0})
    job_dir = tmp_path / "jobdir"
    job_dir.mkdir()
    store.set_meta(job_dir=str(job_dir))
    return store, spec, fp, job_dir


#: The held-out loss of the tests' base (all zeros) under np_loss.
BASE_LOSS = 1.0


def seed_trusted(store: JobStore, values=(-0.30, -0.25, -0.2, -0.28, -0.22, -0.26),
                 base_loss: float | None = BASE_LOSS) -> None:
    """Trusted loss changes, measured (by default) from a base as good as the tests' own."""
    for v in values:
        store.push_trusted_value("0", lc.STAT, 1, v, lc.WINDOW, base_loss=base_loss)


def result(tmp_path: Path, store: JobStore, fp, unit: str, value: float, seq: int = 0) -> list[Path]:
    d = tmp_path / f"res-{unit}-{seq}-{value}"
    d.mkdir(exist_ok=True)
    w = d / "weights_out.h5"
    write_weights(w, WeightsFile(np.full(fp.n_params, value, np.float32), fp, job=store.job, model="0",
                                 unit=unit, base_version=0, examples_seen=10))
    return [w]


def deliver(store: JobStore, spec, unit: str, paths: list[Path], trusted: bool = False, seq: int = 0):
    return assimilate(store, Delivery(unit, f"{unit}_{seq}", unit=unit, files=paths, final=True, trusted=trusted),
                      spec=spec)


@contextmanager
def checker_running(store: JobStore, spec, job_dir: Path, checker: JobChecker | None = None) -> Iterator[LossChecker]:
    """The checker loop in a thread, serving ``store``'s job with ``checker`` (default: one
    whose loss is np_loss)."""
    stop = threading.Event()
    lcr = LossChecker(lambda: store.r, lambda: {store.job: job_dir}, stop, idle_s=0.05)
    lcr.checkers[store.job] = checker or JobChecker(store, spec, job_dir, loss_fn=np_loss)
    t = threading.Thread(target=lcr.run, daemon=True)
    t.start()
    try:
        yield lcr
    finally:
        stop.set()
        t.join(10)


# ---- the store's protocol ----------------------------------------------------------------

def test_request_is_queued_once_until_stale_and_bounded(job) -> None:
    store, *_ = job
    req = {"unit": "u0", "kind": "check", "file": "x.h5"}
    assert store.request_loss_check("r1", req, "100.0", stale_s=30, max_queue=3) == "queued"
    # a retry of the same result within the wait: no second request
    assert store.request_loss_check("r1", {**req, "file": "y.h5"}, "110.0", stale_s=30, max_queue=3) == "pending"
    assert store.loss_queue_length() == 1
    assert store.request_loss_check("r2", req, "101.0", stale_s=30, max_queue=3) == "queued"
    # still in the queue long after (a checker far behind): it keeps its place, not sent back
    assert store.request_loss_check("r1", {**req, "file": "y.h5"}, "500.0", stale_s=30, max_queue=3) == "pending"
    assert store.pop_loss_request(0.1)["file"] == "x.h5"  # oldest first, as first queued
    # taken by a checker that died (popped, never answered), older than the wait: replaced
    assert store.request_loss_check("r1", {**req, "file": "z.h5"}, "131.0", stale_s=30, max_queue=3) == "requeued x.h5"
    assert store.loss_queue_length() == 2 and store.loss_pending_count() == 2
    assert store.request_loss_check("r3", req, "1.0", stale_s=30, max_queue=3) == "queued"
    assert store.request_loss_check("r4", req, "1.0", stale_s=30, max_queue=3) == "full"
    assert store.loss_queue_length() == 3
    assert [store.pop_loss_request(0.1)["id"] for _ in range(3)] == ["r2", "r1", "r3"]
    assert store.pop_loss_request(0.05) is None


def test_checks_come_before_observations_and_observations_are_bounded(job) -> None:
    store, *_ = job
    assert store.post_loss_observation({"unit": "a"}, max_queue=2)
    assert store.post_loss_observation({"unit": "b"}, max_queue=2)
    assert not store.post_loss_observation({"unit": "c"}, max_queue=2)  # dropped: a sample, not a result
    store.request_loss_check("r1", {"unit": "u"}, "1.0", stale_s=30, max_queue=3)
    assert [store.pop_loss_request(0.1)["unit"] for _ in range(3)] == ["u", "a", "b"]


def test_first_verdict_wins_and_retires_the_request(job) -> None:
    store, *_ = job
    store.request_loss_check("r1", {"file": "f.h5"}, "5.0", stale_s=30, max_queue=10)
    t0 = time.monotonic()
    assert not store.wait_loss_notice("r1", 0.2) and time.monotonic() - t0 >= 0.2  # no verdict: no notice
    threading.Timer(0.2, lambda: store.set_loss_verdict("r1", {"ok": False, "reason": "first"}, 60)).start()
    t0 = time.monotonic()
    assert store.wait_loss_notice("r1", 10) and time.monotonic() - t0 < 5  # woken by the verdict
    first, retired = store.set_loss_verdict("r1", {"ok": False, "reason": "first"}, 60)
    again, retired2 = store.set_loss_verdict("r1", {"ok": True, "reason": "second"}, 60)
    assert first == again == {"ok": False, "reason": "first"} and retired is None and retired2 is None
    assert store.loss_verdict("r1") == first and store.loss_pending_count() == 0
    # answered: a later delivery never queues it again, and a replayed id is not judged
    assert store.request_loss_check("r1", {}, "999.0", stale_s=0, max_queue=10) == "verdict"
    assert store.pop_loss_request(0.1) == {"kind": "answered", "id": "r1"}
    assert 0 < store.r.ttl(store.k("losscheck", "v", "r1")) <= 60


def test_drop_only_the_live_request(job) -> None:
    store, *_ = job
    store.request_loss_check("r1", {}, "1.0", stale_s=0, max_queue=10)
    store.pop_loss_request(0.1)  # taken, never answered
    assert store.request_loss_check("r1", {}, "2.0", stale_s=0, max_queue=10) == "requeued"
    assert not store.drop_loss_request("r1", "1.0")  # an old stamp drops nothing
    assert store.drop_loss_request("r1", "2.0") and store.loss_pending_count() == 0


def test_decision() -> None:
    assert lc.decide(5.0, None)["ok"]  # no trusted bound yet
    assert lc.decide(-3.0, 0.01)["ok"]  # the held-out loss fell
    assert lc.decide(0.01, 0.02)["ok"]
    v = lc.decide(0.5, 0.02)
    assert not v["ok"] and "raises the loss by 0.5" in v["reason"] and "0.02" in v["reason"]
    assert not lc.decide(float("nan"), 0.02)["ok"] and not lc.decide(float("inf"), None)["ok"]
    assert lc.request_id("u", 1, "r_0") == lc.request_id("u", 1, "r_0") != lc.request_id("u", 2, "r_0")


# ---- through the framework ---------------------------------------------------------------

def test_without_trusted_results_untrusted_ones_pass_unchecked(job, tmp_path: Path) -> None:
    store, spec, fp, job_dir = job
    for i, v in enumerate((-5.0, 0.5, 40.0)):
        out = deliver(store, spec, f"u{i}", result(tmp_path, store, fp, f"u{i}", v))
        assert out.status == "merged"  # nothing trusted to compare with: no bound, no forward pass
        assert "loss_bound" not in store.assimilated()[f"u{i}"]  # the merge record as before
    # and nothing written for it: no request, no verdict
    assert store.loss_queue_length() == 0 and store.loss_pending_count() == 0
    assert not list(store.r.scan_iter(match=store.k("losscheck", "*")))
    assert not lc.spool_dir(job_dir).exists()


def test_the_checker_refuses_a_loss_raising_update_and_passes_honest_ones(job, tmp_path: Path) -> None:
    store, spec, fp, job_dir = job
    seed_trusted(store)
    with checker_running(store, spec, job_dir):
        bad = deliver(store, spec, "u0", result(tmp_path, store, fp, "u0", -2.0))
        good = deliver(store, spec, "u1", result(tmp_path, store, fp, "u1", 0.6))
    assert bad.status == "rejected" and "raises the loss by 8" in bad.reason, bad.reason
    assert "u0" in store.failed() and "u0" not in store.assimilated()  # BOINC's final result: given up
    assert good.status == "merged"
    rec = store.assimilated()["u1"]
    assert rec["loss_increase"] == pytest.approx(np_loss(np.full(fp.n_params, 0.6)) - 1.0, rel=1e-5)
    assert rec["loss_bound"] is not None and 0 <= rec["loss_check_s"] <= rec["loss_wait_s"] < 10
    assert [r["reason"] for r in store.rejections()] == [bad.reason]
    assert not list(lc.spool_dir(job_dir).iterdir())  # every handed-over file is gone
    assert store.loss_pending_count() == 0 and store.loss_queue_length() == 0
    # a re-delivery of the refused result keeps its verdict, without a second check
    again = deliver(store, spec, "u0", result(tmp_path, store, fp, "u0", -2.0, seq=0))
    assert again.status == "rejected" and again.reason == bad.reason and store.loss_queue_length() == 0


def test_the_clip_scale_is_what_gets_checked(job, tmp_path: Path) -> None:
    """The check measures the update the merge would apply: clipped to the trusted radius."""
    store, spec, fp, job_dir = job
    seed_trusted(store)
    for _ in range(8):  # trusted update norms of about 0.4: radius 2 x 0.4
        store.push_trusted_value("0", "update_norm", 0, 0.4, 256)
    with checker_running(store, spec, job_dir):
        out = deliver(store, spec, "u2", result(tmp_path, store, fp, "u2", 5.0))  # far past the target
    assert out.status == "merged", out.reason
    rec = store.assimilated()["u2"]
    assert rec["clip_scale"] < 0.1
    wc = np.full(fp.n_params, 5.0, np.float32)
    assert rec["loss_increase"] == pytest.approx(np_loss(rec["clip_scale"] * wc) - 1.0, rel=1e-4)


def test_no_checker_means_retried_later_not_lost(job, tmp_path: Path) -> None:
    store, spec, fp, job_dir = job
    seed_trusted(store)
    paths = result(tmp_path, store, fp, "u3", 0.5)
    for _ in range(3):  # BOINC hands it over again; one request stays queued
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable, match="no held-out loss check verdict"):
            deliver(store, spec, "u3", paths)
        assert time.monotonic() - t0 >= spec.validation.loss_check_wait_s
    assert store.loss_queue_length() == 1 and store.loss_pending_count() == 1
    assert not store.assimilated() and not store.failed() and store.version("0") == 0
    with checker_running(store, spec, job_dir) as lcr:
        # the checker answers the queued request; the next delivery finds its verdict
        deadline = time.monotonic() + 10
        while store.loss_pending_count() and time.monotonic() < deadline:
            time.sleep(0.02)
        out = deliver(store, spec, "u3", paths)
    assert out.status == "merged" and lcr.handled.get("passed") == 1
    assert store.loss_queue_length() == 0 and not list(lc.spool_dir(job_dir).iterdir())


def test_a_result_that_waited_is_merged_with_the_staleness_it_has_then(job, tmp_path: Path,
                                                                        monkeypatch) -> None:
    """Another result merged while this one waited for its verdict: the wait made it one
    version staler, and the merge (its record, the rule's parameters a replay uses) says so."""
    store, spec, fp, job_dir = job
    seed_trusted(store)
    late, other = result(tmp_path, store, fp, "u7", 0.5), result(tmp_path, store, fp, "u6", 0.5)
    real_gate = lc.gate

    def gate(store_, spec_, **kw):
        if kw["unit"] == "u7":  # planned at version 0; u6 (trusted: no wait) lands meanwhile
            o = deliver(store, spec, "u6", other, trusted=True)
            assert o.status == "merged", o
        return real_gate(store_, spec_, **kw)

    monkeypatch.setattr(lc, "gate", gate)
    with checker_running(store, spec, job_dir):
        out = deliver(store, spec, "u7", late)
    assert out.status == "merged" and store.version("0") == 2
    rec = store.assimilated()["u7"]
    assert rec["base_version"] == 0 and rec["staleness"] == 1 and rec["rule_params"]["s"] == 1
    assert store.assimilated()["u6"]["staleness"] == 0


def test_a_lost_request_is_queued_again_once_stale(job, tmp_path: Path) -> None:
    """The checker died holding the request (popped, unanswered): the next delivery after
    the wait queues it again; a replay of the id once answered is not judged again."""
    store, spec, fp, job_dir = job
    seed_trusted(store)
    paths = result(tmp_path, store, fp, "u4", 0.5)
    with pytest.raises(StoreUnavailable):
        deliver(store, spec, "u4", paths)
    lost = store.pop_loss_request(0.1)  # popped by a checker that is then SIGKILLed
    assert lost is not None and store.loss_queue_length() == 0 and store.loss_pending_count() == 1
    with checker_running(store, spec, job_dir) as lcr:
        out = deliver(store, spec, "u4", paths)  # its request is older than the wait
        assert out.status == "merged"
        store.r.lpush(store.k("losscheck", "queue"), lost["id"])  # the id replayed
        deadline = time.monotonic() + 10
        while store.loss_queue_length() and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)
    assert lcr.handled.get("answered") == 1 and lcr.handled.get("passed") == 1
    assert store.loss_pending_count() == 0
    # the lost request's copy went with its replacement; a stray file goes with the sweep
    assert not list(lc.spool_dir(job_dir).iterdir())
    (lc.spool_dir(job_dir) / "stray.h5").write_bytes(b"x")
    c = JobChecker(store, spec, job_dir, loss_fn=np_loss)
    assert c.sweep() == 0 and c.sweep(now=time.time() + 2 * 86400) == 1


def test_trusted_results_feed_the_statistic_only_through_a_live_checker(job, tmp_path: Path,
                                                                         monkeypatch) -> None:
    store, spec, fp, job_dir = job
    out = deliver(store, spec, "u5", result(tmp_path, store, fp, "u5", 0.5), trusted=True)
    assert out.status == "merged" and store.loss_queue_length() == 0  # no checker: nothing queued
    assert not lc.checker_alive(store)
    monkeypatch.setattr(lc, "ALIVE_CACHE_S", 0.0)  # the cached answer would hold for 5 s
    with checker_running(store, spec, job_dir):
        deadline = time.monotonic() + 5
        while not lc.checker_alive(store) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert deliver(store, spec, "u6", result(tmp_path, store, fp, "u6", 0.5), trusted=True).status == "merged"
        # untrusted results never feed it (no bound yet: they pass unmeasured)
        assert deliver(store, spec, "u7", result(tmp_path, store, fp, "u7", 0.4)).status == "merged"
        _measured_once(store, fp, job_dir)


def _measured_once(store: JobStore, fp, job_dir: Path) -> None:
    """The checker measured the one trusted result (weights all 0.5), and its copy is gone."""
    deadline = time.monotonic() + 10
    while (not store.trusted_values("0", lc.STAT, 32) or list(lc.spool_dir(job_dir).iterdir())) \
            and time.monotonic() < deadline:  # the value is pushed, then the copy removed
        time.sleep(0.02)
    vals = store.trusted_values("0", lc.STAT, 32)
    assert len(vals) == 1 and vals[0][1] == pytest.approx(np_loss(np.full(fp.n_params, 0.5)) - 1.0, rel=1e-5)
    assert not list(lc.spool_dir(job_dir).iterdir())


def test_on_boinc_a_trusted_result_waits_for_a_restarting_checker(job, tmp_path: Path) -> None:
    """The work generator (the checker) is down when a replicated result merges: on a
    BOINC job its measurement waits in the queue and is taken once the daemon is back (the
    check and the spot checks need it); nothing is lost."""
    store, spec, fp, job_dir = job
    store.set_meta(backend="boinc")
    lc._backend.clear()
    assert not lc.checker_alive(store)
    out = deliver(store, spec, "u5", result(tmp_path, store, fp, "u5", 0.5), trusted=True)
    assert out.status == "merged" and store.r.llen(store.k("losscheck", "observe")) == 1
    assert len(list(lc.spool_dir(job_dir).iterdir())) == 1  # its copy waits with it
    with checker_running(store, spec, job_dir):
        _measured_once(store, fp, job_dir)


def test_on_boinc_waiting_measurements_are_bounded_while_the_checker_is_down(job, tmp_path: Path,
                                                                             monkeypatch) -> None:
    """Results that merge as trusted while the work generator stays down (hosts in
    collusion can get their replicas to agree) wait at most MAX_QUEUE deep: past it they
    are dropped with their spool copies, so neither Redis nor the job's disk grows with them."""
    store, spec, fp, job_dir = job
    store.set_meta(backend="boinc")
    lc._backend.clear()
    monkeypatch.setattr(lc, "MAX_QUEUE", 2)
    for i in range(5):
        assert deliver(store, spec, f"u{i}", result(tmp_path, store, fp, f"u{i}", 0.5), trusted=True).status == "merged"
    assert store.r.llen(store.k("losscheck", "observe")) == 2
    assert len(list(lc.spool_dir(job_dir).iterdir())) == 2


def test_whether_a_checker_is_alive_is_asked_once_per_interval(job) -> None:
    """The local backend's assimilators (every result trusted, no checker) do not pay a
    round trip per merge for it."""
    store, *_ = job
    assert not lc.checker_alive(store)
    store.mark_loss_checker_alive(30)
    assert store.loss_checker_alive() and not lc.checker_alive(store)  # cached
    lc._alive.clear()
    assert lc.checker_alive(store)
    other = JobStore(redis.Redis(unix_socket_path="/nonexistent"), store.job)
    assert lc._where(other) != lc._where(store)  # another Redis: another answer


@pytest.mark.parametrize("attack", [a for a in ATTACKS if a.name in (
    "huge-tensor", "external-link", "virtual-dataset", "truncated", "huge-fingerprint", "dtype-float64")],
    ids=lambda a: a.name)
def test_a_hostile_file_in_a_request_is_refused_within_bounds(job, tmp_path: Path, attack) -> None:
    """A request naming a hostile file (its assimilator's copy replaced, or a forged
    request): the checker reads it with the bounded reader and refuses it, and never
    opens a path from Redis outside the job's spool."""
    store, spec, fp, job_dir = job
    seed_trusted(store)
    spool = lc.spool_dir(job_dir)
    spool.mkdir()
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    attack.build(spool / "evil.h5", fp, store.job, "u0", secrets)
    store.request_loss_check("rid", {"kind": "check", "file": "evil.h5", "unit": "u0", "model": "0",
                                     "epoch": 1, "base": store.unit_info("u0")["files"]["weights_in.h5"],
                                     "scale": 1.0}, "1.0", stale_s=30, max_queue=10)
    c = JobChecker(store, spec, job_dir, loss_fn=np_loss)
    assert c.handle(store.pop_loss_request(0.1)) == "refused"
    v = store.loss_verdict("rid")
    assert not v["ok"] and "cannot be read" in v["reason"] and attack.reason in v["reason"], v["reason"]
    assert not (spool / "evil.h5").exists()


def test_a_request_cannot_name_a_path_outside_the_spool(job, tmp_path: Path) -> None:
    store, spec, fp, job_dir = job
    outside = tmp_path / "outside.h5"
    write_weights(outside, WeightsFile(np.zeros(fp.n_params, np.float32), fp, job=store.job, model="0"))
    c = JobChecker(store, spec, job_dir, loss_fn=np_loss)
    for name in (str(outside), "../outside.h5", "..", 7):
        store.request_loss_check("rid", {"kind": "check", "file": name}, "1.0", stale_s=0, max_queue=10)
        assert c.handle(store.pop_loss_request(0.1)) == "no file"
    assert outside.exists() and store.loss_verdict("rid") is None


def test_held_out_batch_is_a_fixed_seeded_sample(tmp_path: Path) -> None:
    x, y = np.arange(1000, dtype=np.float32).reshape(500, 2), np.arange(500) % 10
    np.savez(tmp_path / "val.npz", x=x, y=y)
    a, b = held_out_batch(tmp_path / "val.npz", 64, 3), held_out_batch(tmp_path / "val.npz", 64, 3)
    assert a[0].shape == (64, 2) and np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert not np.array_equal(a[0], held_out_batch(tmp_path / "val.npz", 64, 4)[0])
    assert len(held_out_batch(tmp_path / "val.npz", 10_000, 3)[0]) == 500


@pytest.mark.parametrize("attack", ATTACKS, ids=lambda a: a.name)
def test_every_hostile_upload_is_refused_before_the_check_sees_it(job, tmp_path: Path, attack) -> None:
    """The whole hostile corpus, delivered untrusted with the check on and a trusted bound
    in force: each file is refused by validation, for the host's fault, before anything is
    handed to the checker (no spool file, no request) and before any shard changes."""
    store, spec, fp, job_dir = job
    seed_trusted(store)
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    d = tmp_path / "up"
    d.mkdir()
    attack.build(d / "weights_out.h5", fp, store.job, "u2", secrets)
    out = deliver(store, spec, "u2", [d / "weights_out.h5"])
    assert out.status == "rejected", (attack.name, out)
    assert store.version("0") == 0 and "u2" not in store.assimilated()
    assert store.loss_queue_length() == 0 and store.loss_pending_count() == 0
    spool = lc.spool_dir(job_dir)
    assert not spool.exists() or not list(spool.iterdir())


def test_a_patient_attacker_cannot_move_the_bound(job, tmp_path: Path) -> None:
    """Many untrusted results, each raising the held-out loss just inside the bound in
    force: the ones that pass are merged, but the bound is fed by trusted results only,
    so it is the same after 24 of them as before (it does not ratchet up)."""
    store, spec, fp, job_dir = job
    seed_trusted(store)
    before = lc.bound_of(store, spec, "0", 1)
    trusted_before = store.trusted_values("0", lc.STAT, 64)
    assert before is not None
    with checker_running(store, spec, job_dir):
        outs = []
        for i in range(24):
            unit = f"p{i}"
            store.register_unit(unit, {**store.unit_info("u0"), "shard": i % 4}, 1)
            # a uniform value v moves the numpy loss from 1 to (v - 1)^2: just under the bound
            v = 1.0 - float(np.sqrt(1.0 + 0.95 * max(before, 0.0)))
            outs.append(deliver(store, spec, unit, result(tmp_path, store, fp, unit, v)))
    assert lc.bound_of(store, spec, "0", 1) == before
    assert store.trusted_values("0", lc.STAT, 64) == trusted_before
    assert {o.status for o in outs} <= {"merged", "rejected"} and any(o.status == "merged" for o in outs)


def test_a_colluders_inner_product_manipulation_is_refused_and_honest_work_merges(job, tmp_path: Path) -> None:
    """The benches' attack code on the shipped path: an inner-product manipulation result
    (minus the mean of the honest updates the colluders saw, at 0.99x the clip radius in
    force) is refused by the checker; an honest result of the same round merges."""
    store, spec, fp, job_dir = job
    seed_trusted(store)
    for _ in range(8):  # trusted update norms of 0.4: a clip radius of 0.8
        store.push_trusted_value("0", "update_norm", 0, 0.4, 256)
    rng = np.random.default_rng(3)
    base = np.zeros(fp.n_params, np.float32)  # the units' base (version 0)
    honest = [(0.1 + 0.02 * rng.standard_normal(fp.n_params)).astype(np.float32) for _ in range(6)]  # towards TARGET
    radius = trusted_radius(store, spec, "0", 1)
    assert radius == pytest.approx(0.8)
    bad = craft(Attack("ipm"), base, radius, honest_updates=[h - base for h in honest],
                honest_norms=[float(np.linalg.norm(h - base)) for h in honest])
    assert float(np.linalg.norm(bad - base)) == pytest.approx(0.99 * radius, rel=1e-5)  # just inside the clip
    assert np_loss(bad) > np_loss(base)

    def write(unit: str, flat: np.ndarray) -> list[Path]:
        d = tmp_path / f"res-{unit}"
        d.mkdir()
        write_weights(d / "weights_out.h5", WeightsFile(flat, fp, job=store.job, model="0", unit=unit,
                                                        base_version=0, examples_seen=10))
        return [d / "weights_out.h5"]

    with checker_running(store, spec, job_dir):
        refused = deliver(store, spec, "u0", write("u0", bad))
        merged = deliver(store, spec, "u1", write("u1", honest[0]))
    assert refused.status == "rejected" and "raises the loss" in refused.reason, refused.reason
    assert merged.status == "merged" and "u0" not in store.assimilated()
    assert store.assimilated()["u1"]["clip_scale"] == 1.0  # honest work is not clipped
