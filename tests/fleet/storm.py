"""Kill-and-restart storms: ``boinc-dl fleet watch`` as a process, SIGKILLed at a random
moment of a reclaim storm and started again, against moto's server (AWS) or the Compute
stand-in (GCP); then the outcome checked against the clouds' own records. Used by
``tests/fleet/test_restart.py`` (one seeded case each) and ``bench/bench_fleet.py`` (30).

AWS (:func:`aws_kill_storm`): a group of ``hosts`` spot instances up for 10 minutes to 2
hours, each the BOINC host of two results; ``victims`` of them are warned at random
moments of a few seconds and reclaimed by EC2 ``notice_s`` later (the warnings' times
are set so that EC2's two minutes end then), some warnings delivered twice; the
controller is killed after a random number of warnings and restarted ``down_s`` later.

GCP (:func:`gcp_lives`): a managed instance group; a VM is preempted, recreated under its
name (new id), given work, the controller killed, the new life preempted while it is
down, the controller restarted.
"""

from __future__ import annotations

import math
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import yaml

from boinc_dl.server.assimilator.connection import connect
from boinc_dl.server.fleet.cost import cost_report
from boinc_dl.server.fleet.prices import ON_DEMAND_TABLE
from boinc_dl.server.fleet.state import FleetState

_SCRIPT = shutil.which("boinc-dl", path=str(Path(sys.executable).parent))
#: the installed command, as a user or systemd runs it (the module where not installed)
EXE = [_SCRIPT] if _SCRIPT else [sys.executable, "-m", "boinc_dl.server.cli"]
SPOT = {"g4dn.xlarge": Decimal("0.1578"), "g5.xlarge": Decimal("0.3018"), "c6i.xlarge": Decimal("0.0621")}
DEADLINE_S = 3600.0


def wait_for(cond: Callable[[], bool], timeout: float, what: str, log: Path | None = None) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            tail = log.read_text()[-3000:] if log and log.exists() else ""
            raise AssertionError(f"timed out waiting for {what}\n{tail}")
        time.sleep(0.05)


class Controller:
    """``boinc-dl fleet watch`` as a process (its log appended to ``log``)."""

    def __init__(self, config: Path, env: dict[str, str], log: Path):
        self.config, self.env, self.log = config, env, log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([*EXE, "fleet", "watch", "--config", str(self.config)], env=self.env,
                                         stdout=out, stderr=subprocess.STDOUT)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(30)


def _env(redis_url: str) -> dict[str, str]:
    return {**os.environ, "BDL_REDIS_URL": redis_url, "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1", "PYTHONUNBUFFERED": "1"}


def billed_usd(launch: float, end: float | None, cut: float, start: float, price: Decimal, waivable: bool,
               by_cloud: bool) -> tuple[Decimal, Decimal]:
    """(billed, waived) dollars of one life at a flat price, written out from AWS's and
    GCP's rules: per second (a second begun counts), 60 s at least; a spot instance the
    cloud reclaims in its first hour is free where ``waivable`` (AWS). Charged from
    ``start`` (the fleet's first watch, if it came after the launch); a life still running
    is charged up to ``cut``."""
    a = round(launch * 1000)
    s = max(a, round(start * 1000))
    if end is None:
        return price * (round(cut * 1000) - s) / 3_600_000, Decimal(0)
    e = round(end * 1000)
    b = a + max(60_000, math.ceil((e - a) / 1000) * 1000) if e > a else a
    usd = price * max(0, b - s) / 3_600_000
    if waivable and by_cloud and e - a < 3_600_000:
        return Decimal(0), usd
    return usd, Decimal(0)


def aws_kill_storm(seed: int, url: str, session: Any, redis_url: str, boinc_db_name: str, workdir: Path,
                   monkeypatch: Any, hosts: int = 30, victims: int = 12, notice_s: float = 4.0, down_s: float = 2.0,
                   lease_s: float = 3.0) -> dict[str, Any]:
    """One AWS storm with a SIGKILL and restart (module docstring); the measured outcome."""
    import requests

    from boinc_dl.server.backends.boinc.install import InstallOptions, install
    from boinc_dl.server.backends.boinc.jobsystem import BoincJobSystem
    from tests.boinc.conftest import make_project
    from tests.fleet.conftest import (
        REGION,
        FleetBoincDB,
        backdate_launch,
        ec2_lives,
        ec2_reclaim,
        inject_spot_prices,
        make_fleet,
        put_interruptions,
    )
    from tests.fleet.test_aws import boinc_job

    rng = random.Random(seed)
    requests.post(f"{url}/moto-api/reset", timeout=30)
    r = connect(redis_url)
    r.flushall()
    workdir.mkdir(parents=True, exist_ok=True)
    project = make_project(workdir / "project")
    install(project.root, InstallOptions(run_db_tools=False, gpu=False))
    db = FleetBoincDB(boinc_db_name)
    db.point(project)
    now = time.time()
    inject_spot_prices(monkeypatch, [(t, f"{REGION}a", now - 86400, p) for t, p in SPOT.items()])
    name = f"storm{seed}"
    fleet = make_fleet(session, url, hosts, name=name)
    store, units = boinc_job(r, project, "storm", 2 * hosts)
    asg = session.client("autoscaling", endpoint_url=url)
    first = [m["InstanceId"] for m in asg.describe_auto_scaling_groups(
        AutoScalingGroupNames=[name])["AutoScalingGroups"][0]["Instances"]]
    launched = {i: now - rng.uniform(600, 7200) for i in first}
    backdate_launch(first, launched)
    on_host: dict[str, list[str]] = {}
    for k, iid in enumerate(first):
        hid = db.add_host(iid)
        for u in units[2 * k:2 * k + 2]:
            db.send(u, hid, rng.uniform(max(launched[iid], now - 3000), now))  # none past its deadline
        on_host[iid] = units[2 * k:2 * k + 2]
    cfg = {"provider": "aws", "project": str(project.root), "name": name, "min_hosts": 0, "max_hosts": 4 * hosts,
           "slots_per_host": 2, "period_s": 1.0, "interrupt_poll_s": 0.2, "lease_s": lease_s,
           "aws": {"region": REGION, "asg_name": name, "queue_url": fleet["queue"], "endpoint_url": url},
           "fallback": {"window_s": 600, "threshold": 0.1, "hold_s": 900, "on_demand_percent": 50}}
    config = workdir / "fleet.yaml"
    config.write_text(yaml.safe_dump(cfg))
    log = workdir / "controller.log"
    ctl = Controller(config, _env(redis_url), log)
    st = FleetState(r, name)
    ctl.start()
    wait_for(lambda: bool(st.status().get("time")), 60, "the first period", log)

    doomed = rng.sample(first, victims)
    times = sorted(rng.uniform(0.5, 6.0) for _ in doomed)
    kill_after = rng.randint(1, victims - 1)
    t0 = time.time()
    plan = [(t0 + dt, "warn", v) for dt, v in zip(times, doomed, strict=True)]
    plan += [(t0 + dt + notice_s, "reclaim", v) for dt, v in zip(times, doomed, strict=True)]
    plan += [(t0 + dt + 0.3, "dup", v) for dt, v in zip(times, doomed, strict=True) if rng.random() < 0.3]
    plan.sort()
    warned_at: dict[str, float] = {}
    killed_at = restarted_at = 0.0
    fb_before = None
    for at, what, v in plan:
        time.sleep(max(0.0, at - time.time()))
        if what in ("warn", "dup"):
            # EC2's warning comes two minutes before its end: here the end is notice_s away
            put_interruptions(session, url, [(v, "warning", time.time() + notice_s - 120)])
            warned_at.setdefault(v, time.time())
            if what == "warn" and len(warned_at) == kill_after and not killed_at:
                time.sleep(rng.uniform(0, 0.5))
                fb_before = st.fallback()
                ctl.kill()
                killed_at = time.time()
        else:
            ec2_reclaim(session, url, [v])
        if killed_at and not restarted_at and time.time() >= killed_at + down_s:
            ctl.start()
            restarted_at = time.time()
    if not restarted_at:
        time.sleep(max(0.0, killed_at + down_s - time.time()))
        ctl.start()
        restarted_at = time.time()
    lost = sorted(u for v in doomed for u in on_host[v])

    def settled() -> bool:
        recs = st.records()
        return all(v in recs and recs[v].settled_ms for v in doomed) and set(st.requested()) >= set(lost)
    wait_for(settled, 90, "every reclaimed instance settled", log)
    # a warning the killed controller had received and not acknowledged comes back once the
    # queue's visibility timeout (aws.VISIBILITY_S) has passed: until then its instance,
    # reclaimed meanwhile, is known only as gone, and its reclaim is not counted yet
    wait_for(lambda: len(st.reclaims_since(0)) >= len(doomed), 60, "every reclaim counted", log)
    t_status = float(st.status()["time"])
    wait_for(lambda: float(st.status()["time"]) > t_status, 30, "one more period", log)
    fb_after = st.fallback()
    rc = ctl.stop()

    requested = st.requested()
    latency = {u: requested[u] - warned_at[v] for v in doomed for u in on_host[v] if u in requested}
    be = BoincJobSystem(project, r)
    handed = [u for u, _ in be.regeneration_requests(store.job)]
    handed_again = [u for u, _ in be.regeneration_requests(store.job)]
    lives = ec2_lives(session, url)
    status = st.status()
    cut = float(status["time"])
    created = st.created() or 0.0
    total, waived, allowance = Decimal(0), Decimal(0), Decimal(0)
    for lf in lives.values():
        price = SPOT[lf["type"]] if lf["market"] == "spot" else ON_DEMAND_TABLE[lf["type"]]
        b, w = billed_usd(lf["launch"], lf["end"], cut, created, price, True, lf["by_ec2"])
        total, waived = total + b, waived + w
        if lf["end"] is not None:
            allowance += price / 3600
    rep = cost_report(r, store.job)
    g = asg.describe_auto_scaling_groups(AutoScalingGroupNames=[name])["AutoScalingGroups"][0]
    return {
        "seed": seed, "hosts": hosts, "victims": victims, "killed_after_warnings": kill_after,
        "down_s": round(restarted_at - killed_at, 2), "exit": rc,
        "lost_units": len(lost), "filed": len(requested), "filed_are_lost": sorted(requested) == lost,
        "handed": len(handed), "handed_twice": len(handed_again) + len(handed) - len(set(handed)),
        "handed_are_lost": sorted(handed) == lost,
        "latency_max_s": max(latency.values()) if latency else None,
        "latency_median_s": sorted(latency.values())[len(latency) // 2] if latency else None,
        "deadline_s": DEADLINE_S,
        "instances_launched": len(lives), "expected_launched": hosts + victims,
        "reclaims_counted": len(st.reclaims_since(0)), "job_reclaims": rep["reclaims"],
        "fallback_kept": bool(fb_before and fb_before.active and fb_after.active and fb_after.since == fb_before.since),
        "fallback_active_before_kill": bool(fb_before and fb_before.active),
        "on_demand_percent": int(g["MixedInstancesPolicy"]["InstancesDistribution"]
                                 ["OnDemandPercentageAboveBaseCapacity"]),
        # what the cloud bills = the ledger's final charges + the provisional ones (spot
        # instances still in their first hour); compared in nano-dollars
        "billed_usd": str(Decimal(rep["total_nusd"] + rep["provisional_nusd"]) / 10**9),
        "ledger_minus_independent_nusd": rep["total_nusd"] + rep["provisional_nusd"] - _nanos(total),
        "waived_minus_independent_nusd": rep["waived_nusd"] - _nanos(waived),
        # EC2 reports an end to the whole second: a life seen running within the second its
        # reported end truncates is billed to when it was seen (cost.Ledger.settle), so each
        # ended life may differ from the recomputation by up to one second of its price
        "resolution_allowance_nusd": _nanos(allowance),
        "drain_saved_usd": str(rep["drain_saved_usd"]),
    }


def gcp_lives(seed: int, redis_url: str, boinc_db_name: str, workdir: Path, hosts: int = 4,
              down_s: float = 2.0, lease_s: float = 3.0) -> dict[str, Any]:
    """A VM preempted, recreated under its name (new id), preempted again while the
    controller is down (module docstring); the measured outcome."""
    from tests.boinc.conftest import make_project
    from tests.fleet.conftest import FleetBoincDB
    from tests.fleet.gcp_standin import GcpStandin, World
    from tests.fleet.test_aws import boinc_job

    rng = random.Random(seed)
    r = connect(redis_url)
    r.flushall()
    workdir.mkdir(parents=True, exist_ok=True)
    project = make_project(workdir / "project")
    db = FleetBoincDB(boinc_db_name)
    db.point(project)
    price = Decimal("0.2827")
    w = World("bdl-test", "us-central1-a")
    w.add_mig("bdl-spot", "g2-standard-4", hosts)
    store, units = boinc_job(r, project, "lives", 2 * hosts + 2)
    names = sorted(w.instances)
    time.sleep(1.0)
    for k, n in enumerate(names):
        db.send(units[k], db.add_host(n), time.time())
    stop = threading.Event()

    def reconcile() -> None:  # the group's own loop: creations finish, preempted VMs come back
        while not stop.wait(0.3):
            with w.lock:
                w.tick()

    with GcpStandin(w) as s:
        threading.Thread(target=reconcile, daemon=True).start()
        cfg = {"provider": "gcp", "project": str(project.root), "name": f"lives{seed}", "min_hosts": hosts,
               "max_hosts": hosts, "period_s": 1.0, "interrupt_poll_s": 0.2, "lease_s": lease_s,
               "gcp": {"project": "bdl-test", "zone": "us-central1-a", "mig": "bdl-spot",
                       "machine_type": "g2-standard-4", "endpoint_url": s.url, "credentials": "anonymous",
                       "spot_prices": {"g2-standard-4": str(price)}},
               "fallback": {"threshold": 1.0}}
        config = workdir / "fleet.yaml"
        config.write_text(yaml.safe_dump(cfg))
        log = workdir / "controller.log"
        ctl = Controller(config, _env(redis_url), log)
        st = FleetState(r, f"lives{seed}")
        ctl.start()
        wait_for(lambda: bool(st.status().get("time")), 60, "the first period", log)
        victim = rng.choice(names)
        first_id = w.instances[victim]["id"]
        with w.lock:
            w.preempt(victim)
        first_at = time.time()
        wait_for(lambda: w.instances[victim]["id"] != first_id and w.instances[victim]["status"] == "RUNNING",
                 30, "the VM recreated", log)
        second_id = w.instances[victim]["id"]
        wait_for(lambda: second_id in st.records(), 30, "the new life seen", log)
        time.sleep(1.0)
        new_unit = units[hosts]
        db.send(new_unit, db.add_host(victim), time.time())  # the new life's BOINC client
        time.sleep(rng.uniform(0.2, 1.5))
        ctl.kill()
        with w.lock:
            w.preempt(victim)  # while nobody watches
        second_at = time.time()
        time.sleep(down_s)
        ctl.start()
        lost = [units[names.index(victim)], new_unit]

        def done() -> bool:
            recs = st.records()
            return (all(i in recs and recs[i].settled_ms for i in (first_id, second_id))
                    and set(st.requested()) >= set(lost))
        wait_for(done, 60, "both lives settled", log)
        t_status = float(st.status()["time"])
        wait_for(lambda: float(st.status()["time"]) > t_status, 30, "one more period", log)
        rc = ctl.stop()
        stop.set()
    requested = st.requested()
    cut = float(st.status()["time"])
    created = st.created() or 0.0
    total = Decimal(0)
    for lf in w.lives.values():
        if lf["created"] > cut:
            continue
        b, _ = billed_usd(lf["created"], lf["ended"] if lf["ended"] is not None and lf["ended"] <= cut else None,
                          cut, created, price, False, False)
        total += b
    rep = cost_report(r, store.job)
    recs = st.records()
    return {
        "seed": seed, "exit": rc, "lost_units": len(lost), "filed_are_lost": sorted(requested) == sorted(lost),
        "latency_first_s": requested.get(lost[0], math.inf) - first_at,
        "latency_second_s": requested.get(lost[1], math.inf) - second_at,
        "lives_of_the_name": sum(1 for lf in w.lives.values() if lf["name"] == victim),
        "both_lives_charged": all(recs[i].charged_ms > recs[i].charged_from_ms for i in (first_id, second_id)),
        "reclaims_counted": len(st.reclaims_since(0)),
        "billed_usd": str(Decimal(rep["total_nusd"] + rep["provisional_nusd"]) / 10**9),
        "ledger_minus_independent_nusd": rep["total_nusd"] + rep["provisional_nusd"] - _nanos(total),
    }


def _nanos(usd: Decimal) -> int:
    return int((usd * 10**9).to_integral_value())
