"""Server-side faults: assimilators, Redis and the work generator killed for real.

* an assimilator SIGKILLed right after a merge commits and before it acknowledges:
  the job system restarts it and re-sends the result; the merge is not repeated;
* assimilators SIGKILLed at random moments, and a result that kills every
  assimilator it is handed (quarantined after ``poison_after`` deaths);
* Redis SIGKILLed and restarted on its AOF under ``run_job`` (the ``boinc-dl run``
  path): the generator loop, the assimilators and the counter sync carry on;
* the work generator crashed between registering a unit and submitting it, and a
  whole ``boinc-dl run`` process group SIGKILLed mid-epoch and resumed: no unit is
  duplicated or skipped.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from boinc_dl.server.assimilator.connection import connect
from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.backends.local import LocalJobSystem
from boinc_dl.server.common.workunit import unit_name
from boinc_dl.server.run import run_job
from boinc_dl.server.run.status import job_status
from boinc_dl.server.work_generator.prepare import prepare_job
from boinc_dl.server.work_generator.vcasgd import VCASGDWorkGenerator
from tests.support.audit import audit_job
from tests.support.chaos import ChaosMonkey, ChaosPlan
from tests.support.harness import run_headless, small_spec

from .conftest import REPO

pytestmark = pytest.mark.slow
EXAMPLES = REPO / "examples"


def _store(redis_server, job: str) -> JobStore:
    return JobStore(connect(redis_server.url), job)


def test_assimilator_killed_between_merge_and_ack_is_not_merged_twice(tmp_path: Path, redis_server) -> None:
    spec = small_spec("ackcrash", training={"epochs": 2})

    def arm(backend: LocalJobSystem, gen: VCASGDWorkGenerator) -> None:
        backend.arm_assimilator_crash(0, after_merges=1)
        backend.arm_assimilator_crash(1, after_merges=2)

    res = run_headless(spec, tmp_path / "run", redis_server.url, search_path=EXAMPLES, on_start=arm,
                       backend_opts={"synthetic_unit_s": 0.2})
    assert res.status == "done", res.reason
    b = res.backend
    assert b["assimilator_restarts"] == 2 and b["redelivered"] >= 2, b
    # The two results whose acknowledgement died with the process came back as duplicates.
    assert b["duplicates"] >= 2 and b["merged"] + 2 <= 8
    audit = audit_job(_store(redis_server, spec.name), n_subsets=4, epochs=2)
    assert audit.ok, audit.problems
    assert audit.merges == 8 == audit.version


def test_assimilators_sigkilled_at_random_moments(tmp_path: Path, redis_server) -> None:
    spec = small_spec("assimkill", training={"epochs": 4})
    holder: dict = {}

    def chaos(backend: LocalJobSystem, gen: VCASGDWorkGenerator) -> None:
        plan = ChaosPlan(kill_assimilators_at=[0.1, 0.3, 0.5, 0.7])
        holder["monkey"] = m = ChaosMonkey(redis_server, spec.name, 16, plan, assimilators=2, backend=backend)
        m.start()

    res = run_headless(spec, tmp_path / "run", redis_server.url, search_path=EXAMPLES, on_start=chaos,
                       backend_opts={"synthetic_unit_s": 0.15})
    holder["monkey"].stop()
    assert res.status == "done", res.reason
    assert holder["monkey"].log.count("assimilator_killed") == 4
    assert res.backend["assimilator_restarts"] == 4
    audit = audit_job(_store(redis_server, spec.name), n_subsets=4, epochs=4)
    assert audit.ok, audit.problems
    assert audit.merges == 16


def test_poison_result_is_quarantined_and_recorded(tmp_path: Path, redis_server) -> None:
    """Every result of one unit SIGKILLs the assimilator handed it: after 3 deaths it is
    rejected (quarantined), re-issued, quarantined again, then the unit is given up.
    The other units are merged once; the reason is visible in the job's status."""
    spec = small_spec("poison", training={"epochs": 1}, units={"max_error_results": 2, "max_total_results": 4})
    victim = unit_name(spec.name, 1, 0, "0")

    def poison(backend: LocalJobSystem, gen: VCASGDWorkGenerator) -> None:
        backend.poison_unit(victim)

    res = run_headless(spec, tmp_path / "run", redis_server.url, search_path=EXAMPLES, on_start=poison,
                       backend_opts={"synthetic_unit_s": 0.2})
    assert res.status == "done", res.reason
    b = res.backend
    assert b["quarantined"] == 2 and b["assimilator_restarts"] == 6 and b["given_up"] == 1, b
    store = _store(redis_server, spec.name)
    assert list(store.failed()) == [victim]
    audit = audit_job(store, n_subsets=4, epochs=1)
    assert audit.ok, audit.problems
    assert audit.merges == 3
    st = job_status(store)
    assert any("killed the assimilator 3 times" in r["reason"] and r["unit"] == victim for r in st["rejections"])
    assert victim in st["failed"]


def test_redis_killed_twice_under_run_job(tmp_path: Path, redis_server) -> None:
    """``boinc-dl run``'s own loop (run_job) with Redis SIGKILLed and restarted twice and
    both assimilators killed: the job finishes, every subset merged exactly once."""
    spec = small_spec("redischaos", training={"epochs": 3})
    plan = ChaosPlan(kill_assimilators_at=[0.2, 0.45], restart_redis_at=[0.3, 0.6], redis_down_s=1.0)
    monkey = ChaosMonkey(redis_server, spec.name, 12, plan, assimilators=2)
    monkey.start()
    try:
        res = run_job(spec, tmp_path / "run", live=False, redis_url=redis_server.url, search_path=EXAMPLES)
    finally:
        monkey.stop()
    assert res.status == "done", res.reason
    assert monkey.log.count("redis_restarted") == 2 and monkey.log.count("assimilator_killed") == 2, monkey.log
    audit = audit_job(_store(redis_server, spec.name), n_subsets=4, epochs=3)
    assert audit.ok, audit.problems
    assert audit.merges == 12


class _Crash(Exception):
    pass


def test_generator_crashed_between_register_and_submit(tmp_path: Path, redis_server) -> None:
    """The generator dies after registering a unit but before handing it to the job
    system; a new generator on the same job system recovers it: no gap, no double."""
    spec = small_spec("gencrash", training={"epochs": 2})
    run_dir = tmp_path / "run"
    store = _store(redis_server, spec.name)
    prepare_job(spec, store, run_dir, search_path=EXAMPLES)
    backend = LocalJobSystem(run_dir, redis_server.url, spec.name, workers=2, slots=2, assimilators=2,
                             synthetic_unit_s=0.2)
    backend.start()
    try:
        gen1 = VCASGDWorkGenerator(store, spec, run_dir, backend, window=2)
        real_submit, calls = gen1._submit, []

        def crashing(wu):  # noqa: ANN001, ANN202
            calls.append(wu.unit)
            if len(calls) == 4:  # mid-epoch 1... or early epoch 2, after a few merges
                raise _Crash(wu.unit)
            real_submit(wu)

        gen1._submit = crashing  # type: ignore[method-assign]
        with pytest.raises(_Crash):
            while gen1.step():
                time.sleep(0.02)
        orphan = calls[-1]
        assert store.unit_states()[orphan] == "created"  # registered, never submitted
        gen2 = VCASGDWorkGenerator(store, spec, run_dir, backend, window=2)
        assert gen2.recover() == 1
        t0 = time.time()
        while gen2.step():
            assert time.time() - t0 < 120
            time.sleep(0.02)
    finally:
        backend.stop()
    units = store.units()
    assert len(units) == 8 and len({(i["epoch"], i["shard"]) for i in units.values()}) == 8
    audit = audit_job(store, n_subsets=4, epochs=2)
    assert audit.ok, audit.problems
    assert orphan in store.assimilated()


def test_generator_step_outlasts_an_outage_longer_than_the_store_window(tmp_path: Path, redis_server) -> None:
    """The generator's store gives up after 0.3 s; Redis stays down 2.5 s mid-job. The
    step backs off and carries on (no exception reaches the loop), then re-submits
    whatever it registered but could not submit: every subset merged once."""
    spec = small_spec("outage", training={"epochs": 3})
    run_dir = tmp_path / "run"
    store = JobStore(connect(redis_server.url), spec.name, retry_s=0.3)
    prepare_job(spec, store, run_dir, search_path=EXAMPLES)
    backend = LocalJobSystem(run_dir, redis_server.url, spec.name, workers=2, slots=2, assimilators=2,
                             synthetic_unit_s=0.2)
    backend.start()
    outages = []

    def bounce() -> None:
        redis_server.kill()
        time.sleep(2.5)
        redis_server.restart()

    bouncer = threading.Thread(target=bounce)
    try:
        gen = VCASGDWorkGenerator(store, spec, run_dir, backend)
        t0 = time.time()
        while True:
            more = gen.step()  # during the outage: backs off and returns True
            if gen._outage_since is not None and not outages:
                outages.append(time.time())
            if not more:
                break
            if not bouncer.is_alive() and bouncer.ident is None and len(store.assimilated()) >= 4:
                bouncer.start()
            assert time.time() - t0 < 120
            time.sleep(0.02)
        bouncer.join()
    finally:
        backend.stop()
    bounced = bouncer.ident is not None
    assert bounced and outages, "the step never saw the outage"
    audit = audit_job(store, n_subsets=4, epochs=3)
    assert audit.ok, audit.problems
    assert audit.merges == 12


def test_run_process_group_sigkilled_mid_epoch_then_resumed(tmp_path: Path, redis_server) -> None:
    """``boinc-dl run`` (generator, job system, slots, assimilators) SIGKILLed as a whole
    mid-epoch; ``--resume`` finishes the job: every subset of every epoch merged once."""
    spec = small_spec("sigkill", training={"epochs": 3, "local_epochs": 3})
    shutil.copy(EXAMPLES / "models.py", tmp_path / "models.py")
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "boinc_dl.server.cli", "run", str(spec_file), "--run-dir", str(run_dir),
           "--redis-url", redis_server.url, "-q"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    store = _store(redis_server, spec.name)
    try:
        deadline = time.time() + 180
        while time.time() < deadline and proc.poll() is None:
            if store.exists() and 5 <= len(store.assimilated()) <= 8:
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        merged_before = len(store.assimilated())
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert 0 < merged_before < 12
    res = run_job(spec, run_dir, resume=True, live=False, redis_url=redis_server.url, search_path=EXAMPLES)
    assert res.status == "done", res.reason
    audit = audit_job(store, n_subsets=4, epochs=3)
    assert audit.ok, audit.problems
    assert audit.merges == 12 and len(store.units()) == 12
