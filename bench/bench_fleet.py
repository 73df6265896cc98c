"""The fleet controller: reclaim -> re-issue latency, decision time, cost, recovery.

AWS runs in moto's server (real HTTP, boto3), BOINC's tables in SQLite, the job in a
real Redis. For N simulated hosts (2 results in flight on each):

* **re-issue latency**: an ``EC2 Spot Instance Interruption Warning`` is put on
  EventBridge (delivered to the SQS queue); the controller's between-period loop
  (``interrupt_poll_s`` = 1 s) reads it, maps the instance to its BOINC host and files
  the host's units; the work generator's hand-over (``regeneration_requests``) is
  timed and added. Baseline, from the same lost units: BOINC's deadline path, the time
  left until each lost result's deadline (``delay_bound`` 1 h, sent at uniform times).
  The work generator's own pass interval (``poll_s``, 5 s by default) comes on top of
  both and is reported apart.
* **decision time** of one period at N instances (the pure decision plus the price of
  the current mix), median of 10 periods (4 at 1,000: each also reads the group from moto).
* **recovery**: 30% of the group reclaimed (two thirds terminated by EC2, the rest only
  warned): control periods until the group is back at its desired size.
* **cost**: the simulated day of ``tests/fleet/test_cost.py`` against its independent
  ledger: difference in cents.

    PYTHONPATH=$PWD python3 bench/bench_fleet.py [--hosts 100 1000] [--trials 30]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")

from bench._common import emit, machine  # noqa: E402
from boinc_dl.server.assimilator.connection import connect
from boinc_dl.server.assimilator.redis_server import EmbeddedRedis  # noqa: E402
from boinc_dl.server.backends.boinc.jobsystem import BoincJobSystem
from boinc_dl.server.backends.boinc.registry import BoincRegistry
from boinc_dl.server.fleet.aws import AwsProvider  # noqa: E402
from boinc_dl.server.fleet.boinchosts import BoincHosts  # noqa: E402
from boinc_dl.server.fleet.controller import FleetController  # noqa: E402

DELAY_BOUND_S = 3600.0


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def running(session, url: str, asg: str) -> int:
    g = session.client("autoscaling", endpoint_url=url).describe_auto_scaling_groups(
        AutoScalingGroupNames=[asg])["AutoScalingGroups"][0]
    ids = [m["InstanceId"] for m in g["Instances"]]
    ec2 = session.client("ec2", endpoint_url=url)
    n = 0
    for k in range(0, len(ids), 200):
        for rv in ec2.describe_instances(InstanceIds=ids[k:k + 200])["Reservations"]:
            n += sum(i["State"]["Name"] == "running" for i in rv["Instances"])
    return n


def one_size(n_hosts: int, trials: int, url: str, tmp: Path, r) -> dict:
    import boto3

    from tests.boinc.conftest import make_project
    from tests.fleet.conftest import BoincDB, make_fleet, put_interruptions
    from tests.fleet.test_aws import aws_config, boinc_job

    r.flushall()
    import requests

    requests.post(f"{url}/moto-api/reset", timeout=30)
    session = boto3.session.Session(region_name="us-east-1")
    project = make_project(tmp / f"project{n_hosts}")
    from boinc_dl.server.backends.boinc.install import InstallOptions, install

    install(project.root, InstallOptions(run_db_tools=False, gpu=False))
    store, units = boinc_job(r, project, f"bench{n_hosts}", 2 * n_hosts)
    for u in units:  # a deadline of an hour, like the job's spec
        rec = json.loads(r.hget(BoincRegistry(store).issued_key, u))
        r.hset(BoincRegistry(store).issued_key, u, json.dumps({**rec, "delay": DELAY_BOUND_S}))
    fleet = make_fleet(session, url, n_hosts, name=f"bench{n_hosts}")
    cfg = aws_config(url, fleet, str(project.root), max_hosts=4000, interrupt_poll_s=1.0,
                     fallback={"threshold": 1.0, "window_s": 60, "on_demand_percent": 50})
    db = BoincDB(tmp / f"boinc{n_hosts}.sqlite")
    ctl = FleetController(cfg, AwsProvider(cfg.aws, session), BoincHosts(db.conn, paramstyle="qmark"), r)
    instances = ctl.provider.observe().instances
    rng = random.Random(n_hosts)
    now = time.time()
    on_host, sent = {}, {}
    for k, inst in enumerate(instances):
        hid = db.add_host(inst.id)
        for u in units[2 * k:2 * k + 2]:
            sent[u] = now - rng.uniform(0, DELAY_BOUND_S)
            db.send(u, hid, sent[u])
        on_host[inst.id] = units[2 * k:2 * k + 2]
    ctl.step()

    # decision time at n_hosts (each period also reads the whole group from moto: slow)
    log(f"{n_hosts} hosts: fleet up, timing decisions")
    decision = []
    for _ in range(10 if n_hosts <= 100 else 4):
        decision.append(ctl.step().decision_ms)
    log(f"{n_hosts} hosts: re-issue latency, {trials} reclaims")

    # re-issue latency: one warning at a time, the fast path polling every second
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(cfg.interrupt_poll_s):
            ctl.fast_path()

    th = threading.Thread(target=loop, daemon=True)
    th.start()
    be = BoincJobSystem(project, r)
    victims = rng.sample([i.id for i in instances], trials)
    lat, handoff, baseline = [], [], []
    for v in victims:
        t0 = time.time()
        put_interruptions(session, url, [(v, "warning", t0)])
        while not all(r.sismember(BoincRegistry(store).reissue_key, u) for u in on_host[v]):
            time.sleep(0.01)
            if time.time() - t0 > 60:
                raise RuntimeError("re-issue did not happen within 60 s")
        filed = time.time() - t0
        h0 = time.perf_counter()
        got = be.regeneration_requests(store.job)
        handoff.append(time.perf_counter() - h0)
        assert sorted(u for u, _ in got) == sorted(on_host[v]), got
        lat.append(filed + handoff[-1])
        baseline += [sent[u] + DELAY_BOUND_S - t0 for u in on_host[v]]
    stop.set()
    th.join()
    res = {"hosts": n_hosts, "trials": trials,
           "reissue_median_s": statistics.median(lat), "reissue_p99_s": pct(lat, 0.99),
           "handoff_median_ms": 1000 * statistics.median(handoff),
           "deadline_median_s": statistics.median(baseline), "deadline_p99_s": pct(baseline, 0.99),
           "speedup_median": statistics.median(baseline) / statistics.median(lat),
           "decision_median_ms": statistics.median(decision), "decision_max_ms": max(decision)}
    emit("fleet_reissue", **res, load=os.getloadavg()[0], **machine())

    # a 30% reclaim storm: periods until the group is back at its desired size
    log(f"{n_hosts} hosts: 30% reclaim storm")
    ctl.step()
    alive = [i.id for i in ctl.provider.observe().instances if i.state == "running"]
    storm = rng.sample(alive, int(0.3 * len(alive)))
    session.client("ec2", endpoint_url=url).terminate_instances(InstanceIds=storm[:2 * len(storm) // 3])
    put_interruptions(session, url, [(v, "warning", time.time() + rng.uniform(0, 60)) for v in storm])
    periods = 0
    while True:
        ctl.step()
        periods += 1
        if running(session, url, fleet["asg"]) >= n_hosts or periods >= 10:
            break
    storm_res = {"hosts": n_hosts, "storm_reclaimed": len(storm), "storm_periods": periods,
                 "back_to_size": running(session, url, fleet["asg"]) >= n_hosts}
    emit("fleet_storm", **storm_res)
    return {**res, **storm_res}


def cost_day(r) -> dict:
    from types import SimpleNamespace

    from boinc_dl.server.fleet.config import parse_config
    from boinc_dl.server.fleet.cost import cost_report
    from boinc_dl.server.fleet.prices import StepPriceBook
    from tests.fleet import test_cost as tc

    r.flushall()
    with tempfile.TemporaryDirectory() as d:
        from tests.fleet.conftest import BoincDB

        db = BoincDB(Path(d) / "b.sqlite")
        import numpy as np

        from boinc_dl.server.assimilator.store import JobStore
        from boinc_dl.server.common.workunit import unit_name
        from tests.boinc.conftest import tiny_fp
        from tests.conftest import tiny_spec

        JobStore(r, "day").create(tiny_spec("day").model_dump_json(), "vcasgd", {"0": tiny_fp()}, {})
        JobStore(r, "day").init_weights("0", np.zeros(tiny_fp().n_params, np.float32))
        db.send(unit_name("day", 1, 0), db.add_host("x"), tc.DAY0)
        points, lives = tc.simulated_day(random.Random(2026))
        book = StepPriceBook()
        book.add_spot(points)
        clock = [tc.DAY0]
        cfg = parse_config({"provider": "aws", "project": "/p", "max_hosts": 100,
                            "aws": {"region": "us-east-1", "asg_name": "a", "queue_url": "q"}})
        ctl = FleetController(cfg, SimpleNamespace(name="sim"), BoincHosts(db.conn, paramstyle="qmark"), r,
                              book=book, clock=lambda: clock[0])
        ctl.started = tc.DAY0
        from boinc_dl.server.fleet.provider import FleetShape, Instance, Interruption, Observation

        gone_seen: set[str] = set()
        for T in range(int(tc.DAY0) + tc.PERIOD, int(tc.DAY0) + 86400 + 1, tc.PERIOD):
            clock[0] = float(T)
            insts, evs = [], []
            for lf in lives:
                if lf["launch"] > T or lf["id"] in gone_seen:
                    continue
                gone = lf["end"] is not None and lf["end"] <= T
                if gone:
                    gone_seen.add(lf["id"])
                insts.append(Instance(lf["id"], lf["type"], lf["market"], lf["zone"], "gone" if gone else "running",
                                      lf["launch"]))
                if lf["warning"] is not None and T - tc.PERIOD < lf["warning"] <= T:
                    evs.append(Interruption(lf["id"], "warning", lf["warning"], lf["warning"] + 120))
            for i in insts:
                if i.state != "gone" or i.id in ctl.known:
                    ctl.known[i.id] = i
            ctl.handle_interruptions(evs, float(T))
            ctl.account(Observation(float(T), insts, FleetShape(len(insts), 0), evs), float(T))
        truth = tc.independent_ledger(points, lives, tc.DAY0 + 86400)
        rep = cost_report(r, "day")
        total = sum(v for k, v in truth.items() if k != "_od")
        return {"instances": len(lives), "controller_usd": float(rep["total_usd"]),
                "ledger_usd": float(total.quantize(rep["total_usd"])),
                "diff_cents": int((rep["total_usd"] - total.quantize(rep["total_usd"])) * 100),
                "on_demand_usd": float(rep["on_demand_usd"]), "saving_pct": float(rep["saving_pct"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, nargs="+", default=[100, 1000])
    ap.add_argument("--trials", type=int, default=30)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    logging.getLogger("boinc-dl").setLevel(logging.ERROR)  # the simulated day has no BOINC hosts
    from moto.server import ThreadedMotoServer

    from tests.fleet.conftest import free_port

    port = free_port()
    srv = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    srv.start()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as d:
        redis = EmbeddedRedis(Path(d) / "redis")
        redis.start()
        try:
            r = connect(redis.url)
            print(f"{'hosts':>6} {'re-issue median/p99 s':>22} {'deadline median s':>18} {'x':>6} "
                  f"{'decision ms':>12} {'storm periods':>14}")
            for n in args.hosts:
                res = one_size(n, args.trials, url, Path(d), r)
                print(f"{n:>6} {res['reissue_median_s']:>10.2f} / {res['reissue_p99_s']:<9.2f} "
                      f"{res['deadline_median_s']:>18.0f} {res['speedup_median']:>6.0f} "
                      f"{res['decision_median_ms']:>12.2f} {res['storm_periods']:>14}")
            c = cost_day(r)
            print(f"simulated day: controller ${c['controller_usd']:.2f}, ledger ${c['ledger_usd']:.2f}, "
                  f"diff {c['diff_cents']} cents; on-demand ${c['on_demand_usd']:.2f}, saving {c['saving_pct']}%")
            emit("fleet_cost_day", **c)
        finally:
            redis.stop()
            srv.stop()


if __name__ == "__main__":
    main()
