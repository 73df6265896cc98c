"""The local job system for real: worker processes, deadlines, re-issue, rejections.

Each test runs a tiny VC-ASGD job (digits, a few hundred examples) through
``run_job`` with real TensorFlow slot processes and real assimilator processes.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest

from boinc_dl.server.assimilator.connection import connect
from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.common.workunit import unit_name
from boinc_dl.server.run import run_job
from tests.support.harness import run_headless, small_spec

from .conftest import REPO

pytestmark = pytest.mark.slow


def _spec(name: str, **over):
    """The fault tests' small job, on 2 hosts x 1 slot."""
    return small_spec(name, **{"backend": {"local": {"workers": 2, "slots": 1, "assimilators": 2}}, **over})


def _merge_log(run_dir: Path) -> Counter:
    hist = json.loads((run_dir / "history.json").read_text())
    return Counter(u["unit"] for u in hist["units"] if "failed" not in u)


def test_tiny_job_runs_to_completion(tmp_path: Path) -> None:
    spec = _spec("ok")
    res = run_job(spec, tmp_path / "run", live=False, search_path=REPO / "examples")
    assert res.status == "done", res.reason
    assert [e["epoch"] for e in res.epochs] == [1, 2]
    merges = _merge_log(tmp_path / "run")
    assert len(merges) == 8 and set(merges.values()) == {1}  # every unit merged exactly once
    assert res.epochs[-1]["val_acc"] > 0.3  # 10 classes: chance is 0.1
    for name in ("final_model.keras", "history.json", "epochs.csv", "units.csv", "learning_curve.png"):
        assert (tmp_path / "run" / name).stat().st_size > 0
    assert res.backend["merged"] == 8 and res.backend["reissued"] == 0
    # The planner's check: predicted vs actual epoch time, in the summary file and table.
    plan = json.loads((tmp_path / "run" / "summary.json").read_text())["planner"]
    assert plan["actual_epoch_s"] > 0 and plan["predicted_epoch_s"] > 0
    assert plan["error"] == pytest.approx(plan["predicted_epoch_s"] / plan["actual_epoch_s"] - 1, abs=1e-3)
    # The pipeline's time plus the start-up before it is the run's elapsed time.
    assert plan["startup_s"] >= 0
    assert plan["actual_epoch_s"] * 2 + plan["startup_s"] == pytest.approx(res.elapsed_s, abs=0.01)
    assert res.planner == plan


def test_preempted_units_are_reissued_after_deadline(tmp_path: Path) -> None:
    """Slots SIGKILLed mid-unit: the units come back after t_o and are merged once."""
    spec = _spec("preempt", units={"timeout_s": 4, "max_error_results": 8, "max_total_results": 10},
                 training={"epochs": 2, "local_epochs": 6, "batch_size": 8})
    res = run_job(spec, tmp_path / "run", live=False, search_path=REPO / "examples",
                  backend_opts={"preempt_prob": 0.4})
    assert res.status == "done", res.reason
    b = res.backend
    assert b["preempted"] >= 1 and b["timed_out"] >= 1 and b["reissued"] >= 1, b
    merges = _merge_log(tmp_path / "run")
    assert len(merges) == 8 and set(merges.values()) == {1}


def test_every_result_rejected_fails_the_job_fast(tmp_path: Path) -> None:
    """A learning rate that blows the weights up to NaN: every result is rejected with
    its reason; after the first 3 units, all rejected the same way and none merged, the
    job ends failed with that reason (fail fast) instead of "done" with nothing learned."""
    spec = _spec("nan", training={"epochs": 3, "learning_rate": 1e30, "optimizer": "sgd"},
                 units={"max_error_results": 2, "max_total_results": 3})
    res = run_job(spec, tmp_path / "run", live=False, search_path=REPO / "examples")
    assert res.status == "failed", res.reason
    assert re.search(r"first [3-8] units all failed with the same error", res.reason) and "NaN/Inf" in res.reason
    assert res.backend["merged"] == 0 and 3 <= res.backend["rejected"] < 3 * 4 * 2, res.backend
    hist = json.loads((tmp_path / "run" / "history.json").read_text())
    assert hist["rejections"] and all("NaN/Inf" in r["reason"] for r in hist["rejections"])


def test_give_up_policy_fail_fails_the_job(tmp_path: Path, redis_server) -> None:
    """One unit whose every result kills its assimilator is given up while the others
    merge: with ``give_up_policy: fail`` the epoch's close fails the job."""
    spec = small_spec("givefail", training={"epochs": 2}, vcasgd={"give_up_policy": "fail"},
                      units={"max_error_results": 1, "max_total_results": 2})
    victim = unit_name(spec.name, 1, 0, "0")
    res = run_headless(spec, tmp_path / "run", redis_server.url, search_path=REPO / "examples",
                       on_start=lambda backend, gen: backend.poison_unit(victim),
                       backend_opts={"synthetic_unit_s": 0.2})
    assert res.status == "failed" and "epoch 1: 1 unit(s) failed for good" in res.reason, res.reason


def test_target_accuracy_stops_early(tmp_path: Path) -> None:
    spec = _spec("target", training={"epochs": 10, "target_accuracy": 0.3})
    res = run_job(spec, tmp_path / "run", live=False, search_path=REPO / "examples")
    assert res.status == "done" and "target accuracy" in res.reason
    assert len(res.epochs) < 10


def test_resume_continues_without_duplicates(tmp_path: Path, redis_server) -> None:
    """A run stopped mid-job (its job system gone) resumes from Redis: no unit twice."""
    spec = _spec("resume", training={"epochs": 3})
    run_dir = tmp_path / "run"
    # First run: stop after epoch 1 by setting a tiny epoch budget, then resume to 3 epochs.
    first = run_job(spec.model_copy(update={"training": spec.training.model_copy(update={"epochs": 1})}),
                    run_dir, live=False, redis_url=redis_server.url, search_path=REPO / "examples")
    assert first.status == "done"
    store = JobStore(connect(redis_server.url), "resume")
    store.set_meta(status="running", stopping=0)  # pretend it was interrupted after epoch 1
    again = run_job(spec, run_dir, resume=True, live=False, redis_url=redis_server.url,
                    search_path=REPO / "examples")
    assert again.status == "done" and len(again.epochs) == 3
    merges = _merge_log(run_dir)
    assert len(merges) == 12 and set(merges.values()) == {1}
