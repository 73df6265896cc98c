"""``merge_rule: search``: the server's step search for each result.

The rule's arithmetic (the candidate steps, the search that stops at the first rise), the
protocol through the real framework, Redis and the checker loop in a thread (with a numpy
loss instead of Keras, as tests/test_loss_check.py does), its failure paths (no checker, a
forged verdict, an unreadable upload, a crash part-way through a merge), and the user's
path: the installed ``boinc-dl run`` SIGKILLed at a moment drawn at run time, then resumed.
"""

from __future__ import annotations

import csv
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from boinc_dl.server.assimilator import losscheck as lc
from boinc_dl.server.assimilator import rules, stepsearch
from boinc_dl.server.assimilator.framework import Delivery, assimilate
from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.common.weights import WeightsFile, write_weights
from boinc_dl.server.work_generator import losscheck as wlc
from boinc_dl.server.work_generator.losscheck import (
    JobChecker,
    sample_rows,
    search_batch,
    search_pool,
)
from boinc_dl.server.work_generator.prepare import JobFiles
from tests.conftest import REPO, tiny_spec
from tests.hostile_corpus import ATTACKS

# np_loss: the distance to the all-ones model; result: a result file holding one value
from tests.test_loss_check import checker_running as loss_checker_running
from tests.test_loss_check import np_loss, result


@pytest.fixture
def job(tiny_job, tmp_path: Path):
    """The tiny job with ``merge_rule: search``; units s0..s7 issued from version 0 with 4
    units in flight (``delta``'s weight at staleness s: min(1/(1+s), 2/4))."""
    store, _spec, fp = tiny_job
    spec = tiny_spec(vcasgd={"merge_rule": "search"}, validation={"loss_check_wait_s": 1.0})
    job_dir = tmp_path / "jobdir"
    job_dir.mkdir()
    store.set_meta(job_dir=str(job_dir))
    base = store.unit_info("u0")["files"]["weights_in.h5"]
    for i in range(8):
        store.register_unit(f"s{i}", {"epoch": 1, "shard": i % 4, "model": "0", "weights_version": 0,
                                      "in_flight": 4, "files": {"weights_in.h5": base}}, 1)
    return store, spec, fp, job_dir


def deliver(store: JobStore, spec, unit: str, paths: list[Path], seq: int = 0):
    return assimilate(store, Delivery(unit, f"{unit}_{seq}", unit=unit, files=paths, final=True, trusted=True),
                      spec=spec)


def checker_running(store: JobStore, spec, job_dir: Path, loss=np_loss):
    """The checker loop in a thread, with its own store (its own caches, as in the work
    generator's thread) and ``loss`` as the step search's loss."""
    own = JobChecker(JobStore(store.r, store.job), spec, job_dir, loss_fn=np_loss,
                     search_loss_fn=lambda flat, rows: loss(flat))
    return loss_checker_running(store, spec, job_dir, own)


# ---- the rule's arithmetic -----------------------------------------------------------------

def test_candidate_steps_are_zero_then_multiples_of_deltas_weight_never_above_one() -> None:
    assert rules.search_steps(1 / 16) == [0.0, 1 / 16, 0.25, 1.0]
    assert rules.search_steps(0.5) == [0.0, 0.5, 1.0]
    assert rules.search_steps(1.0) == [0.0, 1.0]
    assert rules.search_steps(0.001, zero=False) == pytest.approx([0.001, 0.004, 0.016, 0.064])
    for bad in (0.0, -0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            rules.search_steps(bad)
    with pytest.raises(ValueError):
        rules.stepped(1.5)
    rule, factor = rules.stepped(0.25)
    assert rule.weight(7) == 1.0 and rule.server_lr == 0.25 and factor == 1.0  # no staleness weight of its own
    assert rules.stepped(0.0)[1] == 0.0  # step 0: a scale of 0


def test_a_cohort_as_large_as_the_window_gets_deltas_weight_or_nothing() -> None:
    """Units issued together from one version into a window of k (the job's first round:
    all k) start and, on hosts alike, end together: each of their steps at most
    w * max(1, k / cohort), so that the first of them cannot take its whole update and
    leave the rest of the cohort no use; in steady state (a cohort of one or two) the
    search is free."""
    assert rules.search_steps(1 / 16, cohort=32, in_flight=32) == [0.0, 1 / 16]  # the first round
    assert rules.search_steps(1 / 16, cohort=4, in_flight=32) == [0.0, 1 / 16, 0.25, 0.5]
    assert rules.search_steps(1 / 32, cohort=1, in_flight=32) == [0.0, 1 / 32, 0.125, 0.5, 1.0]
    assert rules.search_steps(0.5, cohort=1000, in_flight=4) == [0.0, 0.5]  # never below delta's own weight
    assert rules.search_steps(1 / 16) == [0.0, 1 / 16, 0.25, 1.0]  # no window given: no bound but 1


def test_the_search_stops_at_the_first_rise_and_a_non_finite_loss_never_wins() -> None:
    seen: list[float] = []

    def loss(c: float) -> float:
        seen.append(c)
        return (c - 0.3) ** 2

    step, losses = rules.search_step([0.0, 0.1, 0.4, 1.0, 2.0], loss)
    assert step == 0.4 and losses[:4] == pytest.approx([0.09, 0.04, 0.01, 0.49]) and losses[4] is None
    assert seen == [0.0, 0.1, 0.4, 1.0]  # 2.0 never evaluated
    # unordered candidates are tried smallest first; ties go to the smaller step
    assert rules.search_step([1.0, 0.0, 0.5], lambda c: 1.0)[0] == 0.0
    # NaN and inf never win; all non-finite: the smallest step
    assert rules.search_step([0.0, 0.5, 1.0], lambda c: {0.0: float("nan"), 0.5: 2.0, 1.0: 1.0}[c])[0] == 1.0
    assert rules.search_step([0.0, 0.5], lambda c: float("inf"))[0] == 0.0


# ---- through the framework, the store and the checker ---------------------------------------

def test_each_result_merges_with_the_step_that_lowers_the_loss_most(job, tmp_path: Path) -> None:
    store, spec, fp, job_dir = job
    with checker_running(store, spec, job_dir):
        # s = 0, weight min(1, 2/4) = 0.5: candidates 0, 0.5, 1; the full update (to 0.5 from
        # zeros) lowers the loss most: applied whole, as one unit in flight would
        out = deliver(store, spec, "s0", result(tmp_path, store, fp, "s0", 0.5))
        assert out.status == "merged", out.reason
        ws, v = store.get_weights()
        assert v == 1 and np.array_equal(ws, np.full(fp.n_params, 0.5, np.float32))
        rec = store.assimilated()["s0"]
        assert rec["step"] == 1.0 and rec["merge_rule"].startswith("search(step 1 = 2x delta(")
        assert rec["step_losses"] == [1.0, 0.5625, 0.25]  # at 0, 0.25, 0.5: (w - 1)^2
        # s = 1, weight 0.5: an update of 3 from the base lands on 2.0 at step 0.5, worse
        # than staying at 0.5: step 0 (merged and counted, the weights unchanged)
        out = deliver(store, spec, "s1", result(tmp_path, store, fp, "s1", 3.0))
        assert out.status == "merged"
        rec = store.assimilated()["s1"]
        # loss at 0: (0.5-1)^2 = 0.25; at 0.5: (2.0-1)^2 = 1: the search stops there
        assert rec["step"] == 0.0 and rec["step_losses"] == [0.25, 1.0, None]
        ws, v = store.get_weights()
        assert v == 2 and np.array_equal(ws, np.full(fp.n_params, 0.5, np.float32))  # counted, unchanged
        # s = 2, weight 1/3: an update of 1.5 from the base: 0.5 + 1.5/3 = 1.0 is best
        assert deliver(store, spec, "s2", result(tmp_path, store, fp, "s2", 1.5)).status == "merged"
        assert store.assimilated()["s2"]["step"] == pytest.approx(1 / 3)
        assert np.allclose(store.get_weights()[0], 1.0)
    # every request was answered and every spool copy removed
    assert store.loss_pending_count() == 0 and not list(lc.spool_dir(job_dir).iterdir())


def register_cohort(store: JobStore, again: bool = False) -> str:
    """Units c0..c7 of epoch 2 registered as the work generator registers them, all issued
    from version 0 into a window of 4 (with ``again``, each registered twice: the second
    counts nothing); returns their base weights file."""
    base = store.unit_info("s0")["files"]["weights_in.h5"]
    for i in range(8):
        info = {"epoch": 2, "shard": i % 4, "model": "0", "weights_version": 0, "in_flight": 4,
                "files": {"weights_in.h5": base}}
        assert store.register_unit(f"c{i}", info, 2, issued_from=("0", 0))
        if again:
            assert not store.register_unit(f"c{i}", info, 2, issued_from=("0", 0))
    return base


def test_the_work_generators_cohort_of_a_base_bounds_its_results_steps(job, tmp_path: Path) -> None:
    """The count of units issued from a version is kept with their registration (one
    script: a restart re-registering a unit counts nothing twice) and read at the merge."""
    store, spec, fp, job_dir = job
    register_cohort(store, again=True)
    assert store.issued_from("0", 0) == 8 and store.issued_from("0", 1) == 0
    with checker_running(store, spec, job_dir):
        # delta's weight 0.5 (4 in flight, s = 0); a cohort of 8 from version 0, twice the window:
        # 0 or 0.5, where a cohort of one would have taken the whole update (1.0)
        assert deliver(store, spec, "c0", result(tmp_path, store, fp, "c0", 1.0)).status == "merged"
    rec = store.assimilated()["c0"]
    assert rec["step"] == 0.5 and rec["step_losses"] == [1.0, 0.25]


def test_a_host_cannot_claim_a_lone_base_to_escape_its_cohorts_bound(job, tmp_path: Path) -> None:
    """The cohort is read for the base the server recorded for the unit, never the one the
    result file names: a host of a large cohort that claims a version from which one unit
    was issued (whose steps would go up to its whole update) still gets 0 or delta's weight."""
    store, spec, fp, job_dir = job
    base = register_cohort(store)
    lone = {"epoch": 2, "shard": 0, "model": "0", "weights_version": 1, "in_flight": 4,
            "files": {"weights_in.h5": base}}
    assert store.register_unit("lone", lone, 2, issued_from=("0", 1))
    assert store.issued_from("0", 1) == 1
    w = tmp_path / "claims-v1" / "weights_out.h5"
    w.parent.mkdir()
    write_weights(w, WeightsFile(np.full(fp.n_params, 1.0, np.float32), fp, job=store.job, model="0",
                                 unit="c0", base_version=1, examples_seen=10))  # the lie: base 1
    with checker_running(store, spec, job_dir):
        assert deliver(store, spec, "c0", [w]).status == "merged"
    rec = store.assimilated()["c0"]
    assert rec["base_version"] == 0 and rec["step"] == 0.5 and rec["step_losses"] == [1.0, 0.25]


def test_a_merge_replays_bit_for_bit_from_its_record(job, tmp_path: Path) -> None:
    store, spec, fp, job_dir = job
    with checker_running(store, spec, job_dir):
        paths = result(tmp_path, store, fp, "s0", 0.7)
        assert deliver(store, spec, "s0", paths).status == "merged"
    rec = store.assimilated()["s0"]
    assert rec["rule_params"]["rule"]["server_lr"] == rec["step"] and rec["step"] > 0
    wc = np.full(fp.n_params, 0.7, np.float32)
    replay = rules.apply(rec["rule"], np.zeros(fp.n_params, np.float32), wc, rec["rule_params"],
                         slice(0, fp.n_params))
    assert replay.tobytes() == store.get_weights()[0].tobytes()
    # a step of 0 replays as no change at all
    with checker_running(store, spec, job_dir):
        assert deliver(store, spec, "s1", result(tmp_path, store, fp, "s1", -5.0)).status == "merged"
    rec = store.assimilated()["s1"]
    assert rec["step"] == 0.0 and rec["rule_params"]["scale"] == 0.0
    again = rules.apply(rec["rule"], replay.copy(), np.full(fp.n_params, -5.0, np.float32), rec["rule_params"],
                        slice(0, fp.n_params))
    assert again.tobytes() == replay.tobytes() == store.get_weights()[0].tobytes()


def test_a_merge_cut_short_is_finished_with_its_first_step(job, tmp_path: Path, monkeypatch) -> None:
    """BOINC runs the assimilator at least once: a re-run after a crash part-way through a
    merge applies the shards left with the step the first run was given, though the
    weights moved on meanwhile and a fresh search would choose another."""
    _, spec, fp, job_dir = job
    monkeypatch.setenv("BDL_SHARD_BYTES", "16")  # 4 values a shard: the 15-value model in 4 shards
    monkeypatch.setenv("BDL_COMMITS_PER_MERGE", "4")  # committed shard by shard
    store = JobStore(job[0].r, "cut")
    store.create(spec.model_dump_json(), "vcasgd", {"0": fp}, {"job_dir": str(job_dir)})
    store.init_weights("0", np.zeros(fp.n_params, np.float32))
    assert store.layout("0").shards == 4
    base = job[0].unit_info("s0")["files"]["weights_in.h5"]
    for u in ("a", "b", "c"):
        store.register_unit(u, {"epoch": 1, "shard": 0, "model": "0", "weights_version": 0, "in_flight": 4,
                                "files": {"weights_in.h5": base}}, 1)

    class Killed(BaseException):
        """A SIGKILL stand-in: nothing in the merge path catches it."""

    def dies_after_one_shard(n: int) -> None:
        raise Killed

    with checker_running(store, spec, job_dir):
        paths = result(tmp_path, store, fp, "a", 0.5)
        store.on_shard_applied = dies_after_one_shard
        with pytest.raises(Killed):
            deliver(store, spec, "a", paths)
        store.on_shard_applied = None
        first = store.loss_verdict(stepsearch.step_id("a", None, "a_0"))
        assert first["step"] == 1.0
        cut = store.snapshot("0")
        assert sorted(cut.shard_versions) == [0, 0, 0, 1]  # one shard applied, three left
        # another result lands meanwhile on every shard (at a's step 1 it would overshoot)
        assert deliver(store, spec, "b", result(tmp_path, store, fp, "b", 0.5)).status == "merged"
        after_b = store.get_weights("0")[0].copy()
        assert deliver(store, spec, "a", paths).status == "merged"
    assert store.loss_verdict(stepsearch.step_id("a", None, "a_0")) == first
    assert store.assimilated()["a"]["step"] == 1.0
    done = store.get_weights("0")[0]
    applied = np.asarray(cut.shard_versions) == 1
    lay = store.layout("0")
    for i in range(lay.shards):  # the three shards left got a's whole update (step 1), the first not again
        sl = lay.bounds(i)
        want = after_b[sl] if applied[i] else after_b[sl] + np.float32(0.5)
        assert np.array_equal(done[sl], want), i


def test_without_a_checker_the_result_merges_with_deltas_weight_after_its_wait(job, tmp_path: Path) -> None:
    """A checker starting, stopped or behind never holds merges back: after
    ``search_wait_s`` the result merges as under ``delta``, and that is its verdict for good
    (the checker's answer to the request, if it comes later, changes nothing)."""
    store, spec, fp, job_dir = job
    spec = spec.model_copy(update={"vcasgd": spec.vcasgd.model_copy(update={"search_wait_s": 0.3})})
    paths = result(tmp_path, store, fp, "s0", 0.5)
    t0 = time.monotonic()
    assert deliver(store, spec, "s0", paths).status == "merged"
    assert 0.3 <= time.monotonic() - t0 < 5
    rec = store.assimilated()["s0"]
    assert rec["step"] == 0.5 and np.allclose(store.get_weights()[0], 0.25)  # delta's weight at s = 0
    rid = stepsearch.step_id("s0", None, "s0_0")
    assert store.loss_verdict(rid)["fallback"] is True
    assert store.loss_pending_count() == 0 and not list(lc.spool_dir(job_dir).iterdir())  # retired, copy gone
    with checker_running(store, spec, job_dir):  # a checker starting late finds nothing to answer
        assert deliver(store, spec, "s1", result(tmp_path, store, fp, "s1", 1.0)).status == "merged"
    assert store.loss_verdict(rid)["fallback"] is True and store.assimilated()["s1"].get("step") is not None


def test_a_checker_too_far_behind_is_not_waited_for(job, tmp_path: Path) -> None:
    """When the queue ahead of a result would take the checker longer than the wait at its
    recent pace, the result merges at once with delta's weight: a slow checker (a large
    model, a busy server) costs the search, not the parameter server's throughput."""
    store, spec, fp, _ = job
    store.note_step_seconds(6.0)
    assert store.checker_load() == (0, 6.0)
    store.request_loss_check("other", {"kind": "step", "file": "x.h5"}, "1.0", stale_s=60, max_queue=8)
    t0 = time.monotonic()
    assert deliver(store, spec, "s0", result(tmp_path, store, fp, "s0", 0.5)).status == "merged"
    assert time.monotonic() - t0 < 3  # not the 10 s wait
    verdict = store.loss_verdict(stepsearch.step_id("s0", None, "s0_0"))
    assert verdict["fallback"] and "behind (1 request(s) queued, 6 s each)" in verdict["reason"]
    assert store.assimilated()["s0"]["step"] == 0.5
    store.note_step_seconds(1.0)  # a running mean: 0.8 * 6 + 0.2 * 1
    assert store.checker_load()[1] == pytest.approx(5.0)


@pytest.mark.parametrize("forged", [
    {"ok": True, "step": 8.0, "steps": [0.0, 8.0]},       # a step larger than any candidate
    {"ok": True, "step": 0.25, "steps": [0.0, 0.5, 1.0]},  # a step that is not among them
    {"ok": True, "step": float("nan"), "steps": [float("nan")]},
    {"ok": True, "step": True, "steps": [True]},
    {"ok": True, "steps": list(range(100)), "step": 1},
    {"ok": True},
])
def test_a_verdict_not_written_by_the_checker_gives_only_deltas_own_weight(job, tmp_path: Path,
                                                                          forged) -> None:
    store, spec, fp, _ = job
    rid = stepsearch.step_id("s0", None, "s0_0")
    store.r.set(store.k("losscheck", "v", rid), json.dumps(forged))
    assert deliver(store, spec, "s0", result(tmp_path, store, fp, "s0", 1.0)).status == "merged"
    assert store.assimilated()["s0"]["step"] == 0.5  # delta's weight at s = 0, 4 in flight
    assert np.allclose(store.get_weights()[0], 0.5)


@pytest.mark.parametrize("attack", [a for a in ATTACKS if a.name in (
    "external-storage-v2", "external-link-v2", "virtual-dataset-v2", "truncated-v2", "huge-tensor-v2",
    "vlen-length-lie-4gb")], ids=lambda a: a.name)
def test_the_checker_refuses_an_unreadable_upload_within_bounds(job, tmp_path: Path, attack) -> None:
    """The checker reads the upload again (its own copy in the spool): a hostile file there
    (a request forged, or its copy replaced) is refused by the bounded reader."""
    store, spec, fp, job_dir = job
    spool = lc.spool_dir(job_dir)
    spool.mkdir(parents=True, exist_ok=True)
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    attack.build(spool / "evil.h5", fp, store.job, "s0", secrets)
    base = store.unit_info("s0")["files"]["weights_in.h5"]
    store.request_loss_check("step-x", {"kind": "step", "file": "evil.h5", "unit": "s0", "model": "0",
                                        "base": base, "scale": 1.0, "steps": [0.0, 0.5, 1.0]},
                             "1.0", stale_s=60, max_queue=8)
    ch = JobChecker(store, spec, job_dir, loss_fn=np_loss, search_loss_fn=lambda flat, rows: np_loss(flat))
    assert ch.handle(store.pop_loss_request(1.0)) == "unreadable"
    verdict = store.loss_verdict("step-x")
    assert verdict["ok"] is False and "cannot be read" in verdict["reason"] and attack.reason in verdict["reason"]
    assert not (spool / "evil.h5").exists()


def test_the_search_batch_is_a_fixed_share_of_every_subset(tmp_path: Path) -> None:
    files = JobFiles(tmp_path, "j")
    files.dir.mkdir(parents=True)
    for k in range(3):
        n = (50, 5, 200)[k]
        np.savez(files.shard(k), x=np.full((n, 2), k, np.float32), y=np.full(n, k, np.int64))
    x, y = search_batch(files, 3, 60, seed=1)
    assert len(x) == 60 and Counter(y.tolist())[1] == 5  # the small subset whole, the rest shared
    x2, y2 = search_batch(files, 3, 60, seed=1)
    assert np.array_equal(x, x2) and np.array_equal(y, y2)
    assert len(search_batch(files, 3, 10_000, seed=1)[0]) == 255  # all of it when smaller


# ---- the user's path: boinc-dl run, SIGKILLed, resumed ------------------------------------

def _cli() -> list[str]:
    exe = shutil.which("boinc-dl")
    return [exe] if exe else [sys.executable, "-m", "boinc_dl.server.cli"]


def test_boinc_dl_run_with_the_search_survives_a_sigkill(tmp_path: Path) -> None:
    shutil.copy(REPO / "examples" / "models.py", tmp_path / "models.py")
    spec = tmp_path / "search.yaml"
    spec.write_text("""
name: searched
mode: vcasgd
model: models:mlp
model_args: {input_dim: 64, hidden: 32, n_classes: 10}
dataset: {name: digits}
training: {epochs: 4, batch_size: 32, learning_rate: 0.003, local_epochs: 2}
vcasgd: {n_subsets: 8, merge_rule: search, search_batch: 256}
backend: {kind: local, local: {workers: 3, slots: 2, assimilators: 2}}
""")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    run_dir = tmp_path / "runs" / "searched"
    proc = subprocess.Popen([*_cli(), "run", str(spec), "-q"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    # SIGKILL at a moment drawn now, once the checker has chosen a first step (before it,
    # nothing but the start would be tested)
    at = random.SystemRandom().uniform(0.0, 2.0)
    log = run_dir / "boinc-dl.log"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if log.exists() and "(step): step" in log.read_text():
            break
        time.sleep(0.05)
    time.sleep(at)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    assert not (run_dir / "history.json").exists()  # killed mid-run: the outputs come at the end
    res = subprocess.run([*_cli(), "run", str(spec), "--resume", "-q"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, (res.stdout[-2000:], res.stderr[-2000:])
    assert "Traceback" not in res.stderr
    hist = json.loads((run_dir / "history.json").read_text())
    merged = Counter(u["unit"] for u in hist["units"] if "failed" not in u)
    assert len(merged) == 4 * 8 and set(merged.values()) == {1}, merged  # every unit once
    assert [e["epoch"] for e in hist["epochs"]] == [1, 2, 3, 4]
    with (run_dir / "units.csv").open() as f:
        rows = list(csv.DictReader(f))
    steps = [float(r["step"]) for r in rows if r.get("step")]
    assert len(steps) == 32 and all(0.0 <= s <= 1.0 for s in steps)
    assert all(r["merge_rule"].startswith("search(step ") for r in rows)
    # the search chose something other than delta's own weight for some results
    assert any(not r["merge_rule"].startswith(f"search(step {float(r['step']):.4g} = 1x") for r in rows)
    assert hist["epochs"][-1]["val_acc"] > 0.75


def test_each_step_request_is_judged_on_a_sample_of_its_own_from_a_bounded_pool(tmp_path: Path,
                                                                                 monkeypatch) -> None:
    """One fixed sample judged every result of a job, and hundreds of choices made on the
    same examples fit the server to them: each request draws its own sample of the pool,
    from the job's seed and its id (the same request asked again gets the same one)."""
    files = JobFiles(tmp_path, "j")
    files.dir.mkdir(parents=True)
    for k in range(4):
        np.savez(files.shard(k), x=np.full((500, 3), k, np.float32), y=np.arange(500, dtype=np.int64) + 1000 * k)
    pool_x, pool_y = search_pool(files, 4, 64, seed=1)
    assert len(pool_y) == wlc.SEARCH_POOL * 64 == 1024
    assert Counter((pool_y // 1000).tolist()) == {0: 256, 1: 256, 2: 256, 3: 256}  # an equal share of each subset
    assert len(set(pool_y.tolist())) == 1024  # no example twice
    a, a2, b = (sample_rows(1024, 64, 1, rid) for rid in ("step-u1-0-r", "step-u1-0-r", "step-u2-0-r"))
    assert a is not None and b is not None and a2 is not None
    assert len(a) == 64 and len(set(a.tolist())) == 64 and 0 <= a.min() and a.max() < 1024
    assert np.array_equal(a, a2) and not np.array_equal(a, b)
    # over many requests the samples cover the pool: no example judges every result
    seen = np.zeros(1024, bool)
    for i in range(200):
        seen[sample_rows(1024, 64, 1, f"step-u{i}")] = True
    assert seen.mean() > 0.99
    assert sample_rows(64, 64, 1, "x") is None and sample_rows(10, 64, 1, "x") is None  # the pool is the sample
    # a pool is bounded in bytes: a job of large examples keeps fewer (never fewer than a sample)
    monkeypatch.setattr(wlc, "SEARCH_POOL_BYTES", 200 * 3 * 4)
    assert len(search_pool(files, 4, 64, seed=1)[1]) == 200
    monkeypatch.setattr(wlc, "SEARCH_POOL_BYTES", 10)
    assert len(search_pool(files, 4, 64, seed=1)[1]) == 64


def test_the_pool_reads_subset_shapes_from_their_headers(tmp_path: Path) -> None:
    """The pool's sizes come from the subsets' .npz headers (no subset read for its shape):
    the same shapes and dtypes as loading the arrays."""
    from boinc_dl.server.common.datasets import npz_array_shape, save_npz

    for i, (x, y) in enumerate([(np.zeros((7, 3, 2), np.float32), np.zeros(7, np.int64)),
                                (np.zeros((1, 784), np.uint8), np.zeros(1, np.int32)),
                                (np.zeros((0, 5), np.float64), np.zeros(0, np.int64))]):
        path = tmp_path / f"s{i}.npz"
        save_npz(path, x, y)
        with np.load(path) as z:
            for name in ("x", "y"):
                assert npz_array_shape(path, name) == (z[name].shape, z[name].dtype)


def test_the_checker_judges_each_step_request_on_its_own_rows(job, tmp_path: Path) -> None:
    """Through the checker: the loss function is called with the rows sample_rows gives the
    request's id, for every candidate step of that request."""
    store, spec, fp, job_dir = job
    spool = lc.spool_dir(job_dir)
    spool.mkdir(parents=True, exist_ok=True)
    calls: list[tuple[str, bytes | None]] = []
    current = {"rid": ""}

    def loss(flat: np.ndarray, rows: np.ndarray | None) -> float:
        calls.append((current["rid"], None if rows is None else rows.tobytes()))
        return np_loss(flat)

    ch = JobChecker(store, spec, job_dir, loss_fn=np_loss, search_loss_fn=loss)
    ch.pool_size = 4096  # a pool larger than a sample (the tiny job's real pool is built by Keras)
    base = store.unit_info("s0")["files"]["weights_in.h5"]
    for i, rid in enumerate(("step-a", "step-b")):
        write_weights(spool / f"r{i}.h5", WeightsFile(np.full(fp.n_params, 0.5, np.float32), fp, job=store.job,
                                                      model="0", unit=f"s{i}", base_version=0, examples_seen=10))
        store.request_loss_check(rid, {"kind": "step", "file": f"r{i}.h5", "unit": f"s{i}", "model": "0",
                                       "base": base, "scale": 1.0, "steps": [0.0, 0.25, 1.0]},
                                 "1.0", stale_s=60, max_queue=8)
        current["rid"] = rid
        assert ch.handle(store.pop_loss_request(1.0)).startswith("step")
    by_request: dict[str, set[bytes | None]] = {}
    for rid, rows in calls:
        by_request.setdefault(rid, set()).add(rows)
    want = {rid: sample_rows(4096, spec.vcasgd.search_batch, spec.seed, rid).tobytes() for rid in by_request}
    assert {rid: rows for rid, rows in by_request.items()} == {rid: {want[rid]} for rid in want}
    assert want["step-a"] != want["step-b"]

