"""The held-out loss check on the user's path: a BOINC project (the fake one, its
database in MariaDB), the work generator daemon run as BOINC runs it (``bin/``'s shim, a
subprocess with its checker thread and TensorFlow), results handed to the assimilator
shim as ``script_assimilator`` does, one process per result.

Results are made in the test from each workunit's real base weights: honest ones move
towards a model trained on the job's data, attacks towards a model trained on shifted
labels (label flip) or against the honest direction (inner-product manipulation), each
no longer than an honest update (inside any clip radius). Trusted results are those
BOINC's database shows agreed with a replica from another host.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from boinc_dl.server.assimilator import losscheck as lc
from boinc_dl.server.assimilator.connection import connect
from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.backends.boinc.install import InstallOptions, install
from boinc_dl.server.backends.boinc.project import dir_hier_path
from boinc_dl.server.backends.boinc.spotcheck import spot_checks
from boinc_dl.server.backends.boinc.submit import submit_job
from boinc_dl.server.common.spec import parse_spec
from boinc_dl.server.common.weights import WeightsFile, read_weights, write_weights
from boinc_dl.server.common.workunit import WEIGHTS_IN, parse_unit_name, unit_name
from boinc_dl.server.work_generator.prepare import JobFiles
from tests.boinc.conftest import REPO, run_script, script_env
from tests.boinc.fake_server import _exec, rows, send

pytestmark = pytest.mark.slow

N_TRUSTED = 8  # the loss ledger's reference (the per-result bound needs 4)
#: The trained targets per job data and start weights (one training per test process).
_TARGETS: dict[str, tuple[np.ndarray, np.ndarray]] = {}


def _spec(name: str, vcasgd: dict | None = None, **validation):
    return parse_spec({
        "name": name, "model": "models:mlp", "model_args": {"input_dim": 64, "hidden": 16, "n_classes": 10},
        "dataset": {"name": "digits"},
        "training": {"epochs": 4, "batch_size": 32, "local_epochs": 1, "learning_rate": 0.01},
        "vcasgd": {"n_subsets": 8, "window": 8, **(vcasgd or {})},
        "units": {"timeout_s": 600, "max_error_results": 3, "max_total_results": 6},
        "validation": {"loss_check_min_trusted": 4, "loss_check_wait_s": 6, "clip_min_trusted": 4, **validation},
        "seed": 5,
    })


class Play:
    """The test's side of BOINC: the daemon, the hosts, and the results they return."""

    def __init__(self, project, redis_url: str, name: str, tmp_path: Path, validation: dict | None = None,
                 vcasgd: dict | None = None):
        install(project.root, InstallOptions(redis_url=redis_url, gpu=False,
                                             command=[os.sys.executable, "-m", "boinc_dl.server.backends.boinc"]))
        self.project = project
        self.spec = _spec(name, vcasgd, **(validation or {}))
        submit_job(self.spec, project.root, search_path=REPO / "examples")
        self.store = JobStore(connect(redis_url), name)
        self.files = JobFiles(project.job_dir(name), name)
        self.env = script_env()
        self.log = tmp_path / "work_generator.log"
        self.daemon: subprocess.Popen | None = None
        self.fp = self.store.fingerprint("0")
        self.seen: set[str] = set()
        for _ in range(2):  # two hosts asking for work: the window is the spec's 8
            _exec(project, "INSERT INTO host (create_time, rpc_time, p_ncpus, p_fpops) VALUES (0, %s, 4, 3e9)",
                  (int(time.time()) + 3600,))
        self._train_targets()

    def _train_targets(self) -> None:
        """A model trained on the job's data (honest direction) and one on shifted labels
        (trained once per process for the same data and start)."""
        from boinc_dl.server.common.keras_model import configure_tf, get_flat, set_flat

        x = np.concatenate([np.load(p)["x"] for p in sorted(self.files.dir.glob("*__shard*.npz"))])
        y = np.concatenate([np.load(p)["y"] for p in sorted(self.files.dir.glob("*__shard*.npz"))])
        w0 = self.store.get_weights("0")[0]
        key = hashlib.sha256(x.tobytes() + y.tobytes() + np.asarray(w0).tobytes()).hexdigest()
        if key in _TARGETS:
            self.good, self.flipped = _TARGETS[key]
            return
        tf = configure_tf(threads=1)
        out = []
        for labels in (y, (y + 1) % 10):
            m = tf.keras.models.load_model(self.files.model, compile=False)
            set_flat(m, w0)
            m.compile(optimizer=tf.keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy")
            m.fit(x, labels, epochs=30, batch_size=64, verbose=0)
            out.append(get_flat(m).astype(np.float32))
        self.good, self.flipped = _TARGETS[key] = out[0], out[1]

    # ---- the daemon -------------------------------------------------------------------------
    def start(self) -> None:
        with self.log.open("a") as f:
            self.daemon = subprocess.Popen([str(self.project.root / "bin" / "bdl_work_generator")],
                                           cwd=self.project.tmp_dir, env=self.env, stdout=f, stderr=subprocess.STDOUT)

    def kill(self) -> None:
        assert self.daemon is not None
        self.daemon.send_signal(signal.SIGKILL)
        self.daemon.wait(30)

    def stop(self) -> None:
        if self.daemon is not None and self.daemon.poll() is None:
            self.daemon.send_signal(signal.SIGTERM)
            try:
                self.daemon.wait(30)
            except subprocess.TimeoutExpired:  # never leave a daemon writing to the next test's tables
                self.daemon.kill()
                self.daemon.wait(30)
                raise

    def wait_checker(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not self.store.loss_checker_alive():
            assert self.daemon is not None and self.daemon.poll() is None, self.log.read_text()[-3000:]
            assert time.monotonic() < deadline, self.log.read_text()[-3000:]
            time.sleep(0.2)

    def new_workunits(self, n: int, timeout: float = 120) -> list[dict]:
        """The next ``n`` workunits the daemon created (in creation order)."""
        deadline = time.monotonic() + timeout
        while True:
            got = [w for w in rows(self.project, "SELECT id, name FROM workunit ORDER BY id")
                   if w["name"] not in self.seen and w["name"].startswith(f"{self.spec.name}__")]
            if len(got) >= n:
                self.seen.update(w["name"] for w in got[:n])
                return got[:n]
            assert time.monotonic() < deadline, (got, self.log.read_text()[-3000:])
            time.sleep(0.2)

    def workunits_named(self, names: list[str], timeout: float = 120) -> list[dict]:
        """BOINC's rows of these workunits, once the daemon has created every one."""
        deadline = time.monotonic() + timeout
        while True:
            got = {w["name"]: w for w in rows(self.project, "SELECT id, name, min_quorum FROM workunit "
                                                            "WHERE name LIKE %s", (f"{self.spec.name}__%",))}
            if all(n in got for n in names):
                return [got[n] for n in names]
            assert time.monotonic() < deadline, (sorted(got), self.log.read_text()[-3000:])
            assert self.daemon is not None and self.daemon.poll() is None, self.log.read_text()[-3000:]
            time.sleep(0.2)

    # ---- hosts ------------------------------------------------------------------------------
    @staticmethod
    def unit_of(wu: str) -> str:
        """The unit a workunit carries (a regenerated ``<unit>_r<n>`` carries ``<unit>``)."""
        p = parse_unit_name(wu)
        return unit_name(p["job"], p["epoch"], p["shard"], p["model"])

    def base(self, wu: str) -> np.ndarray:
        """The weights ``wu`` was issued with (a regenerated unit's record names its newest)."""
        return read_weights(self.store.unit_info(self.unit_of(wu))["files"][WEIGHTS_IN], self.fp).flat

    def weights_for(self, wu: str, role: str, i: int, share: float = 0.05) -> np.ndarray:
        wb = self.base(wu)
        # honest hosts: a twentieth of the way to the trained model, a little apart (small
        # steps: the model's held-out loss stays within a factor 2 of the trusted results'
        # bases during a test, so they stay comparable, rules.BASE_RATIO)
        honest = (share + 0.004 * (i % 4)) * (self.good - wb)
        if role == "honest":
            return wb + honest
        size = float(np.linalg.norm(honest))
        if role == "labelflip":
            d = self.flipped - wb
        elif role == "ipm":  # inner-product manipulation: against the honest direction
            d = -(self.good - wb)
        else:
            raise ValueError(role)
        return wb + d * np.float32(size / float(np.linalg.norm(d)))

    def upload(self, wu: dict, flat: np.ndarray, trusted: bool) -> list[str]:
        """The result files of ``wu``'s first result in the upload hierarchy; with
        ``trusted``, BOINC's database shows it valid beside a valid replica of another host."""
        result = f"{wu['name']}_0"
        paths = []
        for i in range(2):
            p = dir_hier_path(f"{result}_r99_{i}", self.project.upload_dir, self.project.fanout)
            p.parent.mkdir(parents=True, exist_ok=True)
            paths.append(p)
        write_weights(paths[0], WeightsFile(flat.astype(np.float32), self.fp, job=self.spec.name, model="0",
                                            unit=self.unit_of(wu["name"]), base_version=0, examples_seen=100))
        paths[1].write_text(f'{{"job": "{self.spec.name}", "unit": "{self.unit_of(wu["name"])}", "val_acc": 0.5}}')
        if trusted:
            _exec(self.project, "UPDATE result SET validate_state = 1, hostid = 1, userid = 1, server_state = 5 "
                                "WHERE name = %s", (result,))
            replica = f"{wu['name']}_1"  # a spot check's second result exists already
            if not _exec(self.project, "UPDATE result SET validate_state = 1, hostid = 2, userid = 2, "
                                       "server_state = 5 WHERE name = %s", (replica,)):
                _exec(self.project, "INSERT INTO result (create_time, workunitid, server_state, validate_state, "
                                    "hostid, userid, name) VALUES (%s, %s, 5, 1, 2, 2, %s)",
                      (int(time.time()), wu["id"], replica))
        return [str(p) for p in paths]

    def assimilate(self, wu: dict, paths: list[str]) -> subprocess.Popen[str]:
        """BOINC's script_assimilator calling the shim (system() from tmp_<host>)."""
        return subprocess.Popen(f"../bin/bdl_assimilate {wu['id']} {' '.join(paths)}", shell=True,
                                cwd=self.project.tmp_dir, env=self.env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    def assimilate_until_handled(self, wu: dict, paths: list[str], tries: int = 20) -> int:
        """Call the shim until it exits 0 (BOINC re-runs a transient exit, 3); the tries."""
        for n in range(1, tries + 1):
            p = run_script(self.project.root, f"../bin/bdl_assimilate {wu['id']} {' '.join(paths)}", self.env)
            if p.returncode == 0:
                return n
            assert p.returncode == 3, p.stderr
        pytest.fail(f"{wu['name']} never assimilated: {p.stderr[-2000:]}")


@pytest.fixture
def play(db_project, redis_server, tmp_path, request):
    # a job name of its own: nothing another test left in BOINC's tables can pass for its units
    pl = Play(db_project, redis_server.url, f"digits-losscheck-{os.urandom(3).hex()}", tmp_path,
              getattr(request, "param", None))
    yield pl
    pl.stop()


def feed_trusted(play: Play, share: float = 0.05) -> None:
    """The replicated results that teach the checker what an honest loss change is."""
    for i, wu in enumerate(play.new_workunits(N_TRUSTED)):
        paths = play.upload(wu, play.weights_for(wu["name"], "honest", i, share), trusted=True)
        assert play.assimilate_until_handled(wu, paths) == 1  # trusted: never held back
    deadline = time.monotonic() + 60
    while len(play.store.trusted_values("0", lc.STAT, 64)) < N_TRUSTED:
        assert time.monotonic() < deadline, play.log.read_text()[-3000:]
        time.sleep(0.2)


def spot_checks_as_in_boinc(play: Play, timeout: float = 60) -> dict[str, dict]:
    """The work generator's spot checks, once it has stopped: each workunit of quorum 2 in
    BOINC's table is a recorded one, and each recorded one is either that or not created yet; the first
    ``loss_check_min_trusted`` units were bootstrap ones (a few more may follow while the
    checker is a moment behind the merges it measures, at most a window's worth), and no
    stale count was used twice."""
    # SIGTERM ends the daemon at once, as BOINC's daemons end (daemon.install_signals): a
    # create_work it started may still be committing its batch (one transaction), so the
    # workunits are read in one query, a snapshot in which each one has its final quorum
    play.stop()
    checks = spot_checks(play.store)
    wus = rows(play.project, "SELECT name, min_quorum, target_nresults FROM workunit WHERE name LIKE %s",
               (f"{play.spec.name}__%",))
    q2 = {w["name"] for w in wus if int(w["min_quorum"]) == 2 and int(w["target_nresults"]) == 2}
    created = {w["name"] for w in wus}
    # a spot check decided just before the stop may not be created yet (a restart creates it
    # with quorum 2); none exists with another quorum
    stray = (set(checks) - q2) & created  # recorded, created, and not with quorum 2
    assert q2 <= set(checks) and not stray, (
        q2 - set(checks), [w for w in wus if w["name"] in stray], {u: checks[u] for u in stray})
    first = [w["name"] for w in rows(play.project, "SELECT name FROM workunit WHERE name LIKE %s ORDER BY id",
                                     (f"{play.spec.name}__%",))][:play.spec.validation.loss_check_min_trusted]
    boot = {u for u, c in checks.items() if c["why"] == "bootstrap"}
    assert set(first) <= boot and len(boot) <= len(first) + play.spec.vcasgd.window, (first, boot)
    used = [c["stale"] for c in checks.values() if c["why"] == "stale"]
    assert len(set(used)) == len(used), checks
    return checks


def test_untrusted_results_that_raise_the_held_out_loss_are_refused(play: Play) -> None:
    store = play.store
    play.start()
    play.wait_checker()
    feed_trusted(play)
    assert store.assimilated().keys() == play.seen and not store.rejections()
    roles = ["honest", "labelflip", "ipm"] * 2
    wus = play.new_workunits(len(roles))
    # BOINC trusts both hosts (12 consecutive valid results each): their jobs go out unreplicated
    honest_host, attacker = 11, 12
    for host in (honest_host, attacker):
        _exec(play.project, "INSERT INTO host_app_version (host_id, app_version_id, consecutive_valid) "
                            "VALUES (%s, 5, 12)", (host,))
    for i, (wu, role) in enumerate(zip(wus, roles, strict=True)):
        host = honest_host if role == "honest" else attacker
        assert send(play.project, [wu["name"]], hostid=host, app_version_id=5, rng=random.Random(0))
        paths = play.upload(wu, play.weights_for(wu["name"], role, i), trusted=False)
        play.assimilate_until_handled(wu, paths)
    merged, failed = store.assimilated(), store.failed()
    for wu, role in zip(wus, roles, strict=True):
        if role == "honest":
            assert wu["name"] in merged, (role, failed.get(wu["name"]))
            assert merged[wu["name"]]["loss_increase"] <= max(0.0, merged[wu["name"]]["loss_bound"])
            # judged against trusted changes from bases about as good as its own
            assert merged[wu["name"]]["bound_comparable"] is True
        else:
            # refused, and not given up: another host computes the unit again
            assert wu["name"] not in merged and wu["name"] not in failed, (role, merged.get(wu["name"]))
    reasons = [r["reason"] for r in store.rejections(50)]
    assert len(reasons) == 4 and all("held-out loss check" in r for r in reasons)
    refused = [wu["name"] for wu, role in zip(wus, roles, strict=True) if role != "honest"]
    again = play.workunits_named([f"{u}_r1" for u in refused])
    assert store.counters()["reissued_refused"] == 4 and all(w["min_quorum"] == 1 for w in again)
    assert all(store.unit_info(u)["attempt"] == 1 for u in refused)
    # each names BOINC's host (as the ledgers do), and so does each merge record
    assert {r.get("host_id") for r in store.rejections(50)} == {str(attacker)}
    assert {merged[wu["name"]]["host_id"] for wu, role in zip(wus, roles, strict=True) if role == "honest"} == {
        str(honest_host)}
    assert store.loss_checks_stale() == {}
    # each refusal cost the attacker BOINC's trust (its next jobs are replicated); the
    # honest host keeps its run
    trust = {r["host_id"]: r["consecutive_valid"]
             for r in rows(play.project, "SELECT host_id, consecutive_valid FROM host_app_version")}
    assert trust == {honest_host: 12, attacker: 0}
    assert store.counters()["hosts_demoted"] == 4 and "host_demotions_failed" not in store.counters()
    # the hosts' ledgers are kept under BOINC's host ids (nothing in a result file names a host)
    ledgers = store.ledger_balances()
    led = lc.ledger_of(play.spec)  # each refused attack scored past the cap: z_cap - slack a result
    assert set(ledgers) == {str(honest_host), str(attacker)}
    assert ledgers[str(attacker)] == pytest.approx(min(led.limit, 4 * (led.z_cap - led.slack)))
    # only the trusted results fed the statistic: untrusted ones, honest or not, never do
    assert len(store.trusted_values("0", lc.STAT, 64)) == N_TRUSTED
    assert store.loss_pending_count() == 0 and not list(lc.spool_dir(play.files.job_dir).iterdir())


@pytest.mark.parametrize("play", [{"loss_check_spot_every": 1}], indirect=True)
def test_without_comparable_trusted_results_hosts_are_spot_checked_more(play: Play) -> None:
    """The only replicated results took the model most of the way (their bases' held-out
    loss is more than twice the next units', except the first's): later results are judged against the latest
    trusted changes from a centre no lower than 0. Honest ones merge, each such verdict is
    counted, and the host of each gets BOINC's ``consecutive_valid`` lowered to the cap, so
    BOINC's scheduler spot-checks it more and comparable trusted results come again; a host
    below the cap keeps its count. The work generator replicates its next unit itself
    (a spot check, here after every such verdict)."""
    from boinc_dl.server.backends.boinc.hosttrust import STALE_TRUST_CAP

    store = play.store
    play.start()
    play.wait_checker()
    feed_trusted(play, share=0.9)
    veteran, newer = 51, 52
    for host, cv in ((veteran, 60), (newer, 12)):
        _exec(play.project, "INSERT INTO host_app_version (host_id, app_version_id, consecutive_valid) "
                            "VALUES (%s, 5, %s)", (host, cv))
    # the next units were sent as the replicated results merged: the first from bases a
    # little better than theirs (comparable), the last from the model they made (not)
    wus = play.new_workunits(N_TRUSTED)
    for i, wu in enumerate(wus):
        host = newer if i < N_TRUSTED // 2 else veteran
        assert send(play.project, [wu["name"]], hostid=host, app_version_id=5, rng=random.Random(0))
        paths = play.upload(wu, play.weights_for(wu["name"], "honest", i), trusted=False)
        play.assimilate_until_handled(wu, paths)
    merged = store.assimilated()
    stale = [wu["name"] for wu in wus if merged[wu["name"]]["bound_comparable"] is False]
    ledger_stale = [wu["name"] for wu in wus if merged[wu["name"]]["ledger_comparable"] is False]
    assert wus[-1]["name"] in ledger_stale and wus[0]["name"] not in ledger_stale, ledger_stale
    # the bound's ratio is the tighter one (rules.BOUND_BASE_RATIO, rules.BASE_RATIO): with
    # loss_check_min_trusted (16) no smaller than the ledger's window (8), what the ledger
    # cannot compare, the bound cannot either
    assert set(ledger_stale) <= set(stale), (ledger_stale, stale)
    assert store.loss_checks_stale() == {"0": len(stale)}
    trust = {r["host_id"]: r["consecutive_valid"]
             for r in rows(play.project, "SELECT host_id, consecutive_valid FROM host_app_version")}
    assert trust == {veteran: STALE_TRUST_CAP, newer: 12}
    assert not store.rejections(), store.rejections()
    deadline = time.monotonic() + 60
    while not any(c["why"] == "stale" for c in spot_checks(store).values()):
        assert time.monotonic() < deadline, (spot_checks(store), play.log.read_text()[-3000:])
        time.sleep(0.2)
    checks = spot_checks_as_in_boinc(play)
    assert all(1 <= c["stale"] <= len(stale) for c in checks.values() if c["why"] == "stale")


def test_a_patient_host_inside_the_bound_is_refused_by_its_ledger(play: Play) -> None:
    """A trusted host whose every result is only a little worse than honest work: each one
    changes the held-out loss 1.4 of the ledger's units above what trusted results make an
    honest one expected to (it still lowers it: inside the per-result bound). Its ledger
    refuses the seventh (+0.9 a result), and BOINC's trust goes with it."""
    from boinc_dl.server.work_generator.losscheck import keras_loss

    store = play.store
    play.start()
    play.wait_checker()
    feed_trusted(play)
    ledger = lc.ledger_of(play.spec)
    loss = keras_loss(play.files.model, play.files.val, play.spec)  # the checker's own measure
    patient = 13
    _exec(play.project, "INSERT INTO host_app_version (host_id, app_version_id, consecutive_valid) "
                        "VALUES (%s, 5, 12)", (patient,))
    outcomes = []
    for i, wu in enumerate(play.new_workunits(8)):
        wb = play.base(wu["name"])
        honest, flip = play.weights_for(wu["name"], "honest", i) - wb, play.weights_for(wu["name"], "labelflip", i) - wb
        base_loss = loss(wb)
        # 1.4 of the ledger's units above what it expects of an honest result from this base
        ref = ledger.reference(store.trusted_entries("0", lc.STAT, lc.WINDOW),
                               parse_unit_name(wu["name"])["epoch"], base_loss)
        assert ref.comparable
        centre, scale = ledger.centre_scale(ref, base_loss=base_loss)
        target = centre + 1.4 * scale
        assert target < 0
        lo, hi = 0.0, 1.0  # the share of the label-flip direction: its loss change is target
        for _ in range(30):
            t = (lo + hi) / 2
            if loss(wb + (1 - t) * honest + t * flip) - base_loss < target:
                lo = t
            else:
                hi = t
        assert send(play.project, [wu["name"]], hostid=patient, app_version_id=5, rng=random.Random(0))
        paths = play.upload(wu, wb + (1 - lo) * honest + lo * flip, trusted=False)
        play.assimilate_until_handled(wu, paths)
        why = [r["reason"] for r in store.rejections(50) if r["unit"] == wu["name"]]
        outcomes.append("merged" if wu["name"] in store.assimilated() else (why or ["?"])[0])
    assert outcomes[:6] == ["merged"] * 6, outcomes
    assert all("the host's ledger" in o for o in outcomes[6:]), outcomes
    for rec in store.assimilated().values():
        if "ledger_score" in rec:  # each merged one was inside the per-result bound, scored about 1.4
            assert rec["loss_increase"] <= max(0.0, rec["loss_bound"]) and 1.2 < rec["ledger_score"] < 1.6, rec
    assert store.ledger_balances() == {str(patient): 6.0}
    trust = {r["host_id"]: r["consecutive_valid"]
             for r in rows(play.project, "SELECT host_id, consecutive_valid FROM host_app_version")}
    assert trust[patient] == 0  # BOINC replicates its next jobs


@pytest.mark.parametrize("play", [{"loss_check_spot_every": 1}], indirect=True)
def test_daemon_sigkilled_while_results_wait_for_verdicts(play: Play) -> None:
    """Every result ends merged or refused exactly once, whenever the checker dies; the
    work generator's spot checks agree with BOINC's table through the kill."""
    store = play.store
    play.start()
    play.wait_checker()
    feed_trusted(play)
    roles = ["honest", "labelflip", "honest", "ipm", "honest", "labelflip", "honest", "ipm"]
    wus = play.new_workunits(len(roles))
    for wu, role in zip(wus, roles, strict=True):  # BOINC sent them to two hosts: their ledgers
        assert send(play.project, [wu["name"]], hostid=21 if role == "honest" else 22, app_version_id=5,
                    rng=random.Random(0))
    uploads = [play.upload(wu, play.weights_for(wu["name"], role, i), trusted=False)
               for i, (wu, role) in enumerate(zip(wus, roles, strict=True))]
    procs = [play.assimilate(wu, paths) for wu, paths in zip(wus, uploads, strict=True)]
    deadline = time.monotonic() + 60
    while not store.loss_pending_count():  # the first request is queued
        assert time.monotonic() < deadline
        time.sleep(0.005)
    time.sleep(random.uniform(0.0, 0.1))  # some answered, some waiting or being checked
    play.kill()
    codes = [p.wait(120) for p in procs]
    assert set(codes) <= {0, 3}, [p.stdout.read() for p in procs]
    print("exit codes after the kill:", codes)
    assert 3 in codes  # some waited in vain: BOINC hands them over again
    play.start()  # restarted (BOINC's cron runs bin/start): its checker resumes
    play.wait_checker()
    for wu, paths, code in zip(wus, uploads, codes, strict=True):
        if code == 3:  # BOINC hands a transient failure over again
            play.assimilate_until_handled(wu, paths)
    merged, failed = store.assimilated(), store.failed()
    names = [wu["name"] for wu in wus]
    refused = [r["unit"] for r in store.rejections(50)]
    for name, role in zip(names, roles, strict=True):
        # exactly one outcome each: merged, or refused (recorded once) and issued again
        assert (name in merged) != (name in refused) and name not in failed, name
        assert (name in merged) == (role == "honest"), (name, role, failed.get(name))
    assert sorted(refused) == sorted(set(refused))
    merges = [m["unit"] for m in store.metrics("merge")]
    assert sorted(u for u in merges if u in names) == sorted(n for n in names if n in merged)  # none twice
    assert store.version("0") == len(merges) == len(merged)
    # each refused unit runs again exactly once, as <unit>_r1, whatever the kill interrupted
    play.workunits_named([f"{u}_r1" for u in refused])
    assert store.counters()["reissued_refused"] == len(refused)
    assert store.loss_pending_count() == 0 and store.loss_queue_length() == 0
    # each host's ledger moved once per verdict, whatever the kill interrupted: replaying the
    # verdicts in the order they were set gives each step and the balance stored
    verdicts = [json.loads(store.r.get(k)) for k in store.r.scan_iter(match=store.k("losscheck", "v", "*"))]
    assert len(verdicts) == len(wus)
    ledger = lc.ledger_of(play.spec)
    for host, want in store.ledger_balances().items():
        b = 0.0
        mine = sorted((v for v in verdicts if v.get("ledger_host") == host), key=lambda v: v["t"])
        assert len(mine) == 4, (host, verdicts)
        for v in mine:
            b, _ = ledger.step(b, v["ledger_score"] if v["ledger_score"] is not None else float("inf"))
            assert v["ledger_balance"] == pytest.approx(b, abs=1e-3)
        assert want == pytest.approx(b, abs=1e-3)
    # the verdicts judged against trusted results from worse models were counted once each
    stale = sum(False in (v.get("bound_comparable"), v.get("ledger_comparable")) for v in verdicts)
    assert sum(store.loss_checks_stale().values()) == stale
    again = [w["name"] for w in rows(play.project, "SELECT name FROM workunit WHERE name LIKE %s",
                                     (f"{play.spec.name}__%",)) if parse_unit_name(w["name"])["attempt"]]
    assert sorted(again) == sorted(f"{u}_r1" for u in refused), again
    spot_checks_as_in_boinc(play)
