"""The fleet controller killed and restarted mid-storm; a name's two lives on GCP; a day's bill.

AWS in moto's server (real HTTP, boto3), GCP in the Compute stand-in (the real
google-cloud-compute client), BOINC's tables in MariaDB (127.0.0.1:3306, root), the job
and the controller's state in a real Redis; the controller is ``boinc-dl fleet watch``,
a process (``tests/fleet/storm.py`` drives both clouds):

* **kill-restart storms** (``--storms N``, seeds 1..N): 30 spot hosts, up 10 min-2 h, two
  results each; 12 warned at random moments over 6 s and reclaimed by EC2 4 s after
  (some warnings delivered twice); the controller SIGKILLed after a random number of
  warnings and restarted ``--down`` s later (10 s: a systemd restart); its lease is the
  default 15 s. Measured per storm: units filed early vs units lost, units the work
  generator is handed twice, the re-issue latency (warning -> filed) against the
  deadline path (baseline: the time left to each lost result's deadline, an hour after
  it was sent), instances EC2 launched vs hosts + reclaims (no double launch), the
  fallback and its start kept across the restart, reclaims counted, and the bill
  (ledger + provisional) minus an independent bill from EC2's own launch and end times
  (per second, 60 s minimum, first-hour waiver) in nano-dollars;
* **GCP lives** (``--gcp N``): a VM preempted, recreated under its name with a new id,
  given work, preempted again while the controller is down; both losses re-issued, both
  lives charged, bill minus the stand-in's own record;
* **a simulated day** (60 lives, spot price changes, reclaims some in the first hour,
  scale-ins) charged period by period vs the independent ledger.

    PYTHONPATH=$PWD python3 bench/bench_fleet.py [--storms 30] [--gcp 5] [--down 10]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")

from bench._common import emit, machine  # noqa: E402
from boinc_dl.server.assimilator.redis_server import EmbeddedRedis  # noqa: E402


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def mariadb_database() -> str:
    import pymysql

    from tests.fleet.conftest import MARIADB

    conn = pymysql.connect(**MARIADB, connect_timeout=3, autocommit=True)
    name = f"bdl_bench_fleet_{os.getpid()}"
    with conn.cursor() as c:
        c.execute(f"CREATE DATABASE IF NOT EXISTS `{name}`")
    conn.close()
    return name


def drop_database(name: str) -> None:
    import pymysql

    from tests.fleet.conftest import MARIADB

    conn = pymysql.connect(**MARIADB, connect_timeout=3, autocommit=True)
    with conn.cursor() as c:
        c.execute(f"DROP DATABASE IF EXISTS `{name}`")
    conn.close()


def storms(n: int, down_s: float, redis_url: str, db: str, tmp: Path) -> list[dict]:
    import boto3
    import pytest
    from moto.server import ThreadedMotoServer

    from tests.fleet.conftest import free_port, launch_spot_as_the_policy_says
    from tests.fleet.storm import aws_kill_storm

    port = free_port()
    srv = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    srv.start()
    url = f"http://127.0.0.1:{port}"
    session = boto3.session.Session(region_name="us-east-1")
    out = []
    try:
        with pytest.MonkeyPatch.context() as mp:
            launch_spot_as_the_policy_says(mp)
            for seed in range(1, n + 1):
                t0 = time.monotonic()
                res = aws_kill_storm(seed, url, session, redis_url, db, tmp / f"storm{seed}", mp, hosts=30,
                                     victims=12, down_s=down_s, lease_s=15.0)
                res["wall_s"] = round(time.monotonic() - t0, 1)
                emit("fleet_kill_storm", **res)
                log(f"storm {seed}: killed after {res['killed_after_warnings']} warnings, "
                    f"{res['filed']}/{res['lost_units']} filed, max latency {res['latency_max_s']:.1f}s, "
                    f"launched {res['instances_launched']}/{res['expected_launched']}, "
                    f"fallback kept {res['fallback_kept']}, bill diff {res['ledger_minus_independent_nusd']} n$")
                out.append(res)
    finally:
        srv.stop()
    return out


def gcp(n: int, down_s: float, redis_url: str, db: str, tmp: Path) -> list[dict]:
    from tests.fleet.storm import gcp_lives

    out = []
    for seed in range(1, n + 1):
        res = gcp_lives(seed, redis_url, db, tmp / f"lives{seed}", down_s=down_s, lease_s=15.0)
        emit("fleet_gcp_lives", **res)
        out.append(res)
    return out


def day(redis_url: str, db: str, tmp: Path) -> dict:
    import numpy as np

    from boinc_dl.server.assimilator.connection import connect
    from boinc_dl.server.assimilator.store import JobStore
    from boinc_dl.server.common.workunit import unit_name
    from tests.boinc.conftest import make_project, tiny_fp
    from tests.conftest import tiny_spec
    from tests.fleet import simcloud
    from tests.fleet.conftest import FleetBoincDB
    from tests.fleet.test_cost import run_day

    r = connect(redis_url)
    r.flushall()
    project = make_project(tmp / "day")
    boinc = FleetBoincDB(db)
    boinc.point(project)
    JobStore(r, "day").create(tiny_spec("day").model_dump_json(), "vcasgd", {"0": tiny_fp()}, {})
    JobStore(r, "day").init_weights("0", np.zeros(tiny_fp().n_params, np.float32))
    boinc.send(unit_name("day", 1, 0), boinc.add_host("x"), simcloud.DAY0)
    rep, truth = run_day(r, project)
    total = sum(v for k, v in truth.items() if not k.startswith("_"))
    return {"instances": 60, "controller_usd": float(rep["total_usd"]), "ledger_usd": float(total.quantize(rep["total_usd"])),
            "diff_cents": int((rep["total_usd"] - total.quantize(rep["total_usd"])) * 100),
            "waived_usd": float(rep["waived_usd"]), "independent_waived_usd": float(truth["_waived"].quantize(rep["waived_usd"])),
            "drain_saved_usd": float(rep["drain_saved_usd"]),
            "on_demand_usd": float(rep["on_demand_usd"]), "saving_pct": float(rep["saving_pct"])}


def summary(rs: list[dict]) -> dict:
    lat = [r["latency_max_s"] for r in rs if r["latency_max_s"] is not None]
    return {
        "storms": len(rs),
        "all_lost_filed_early": sum(r["filed_are_lost"] and r["filed"] == r["lost_units"] for r in rs),
        "units_lost": sum(r["lost_units"] for r in rs), "units_filed": sum(r["filed"] for r in rs),
        "handed_twice": sum(r["handed_twice"] for r in rs),
        "latency_max_s": max(lat), "latency_median_of_max_s": statistics.median(lat),
        "deadline_s": rs[0]["deadline_s"],
        "double_launches": sum(r["instances_launched"] - r["expected_launched"] for r in rs),
        "fallback_active_at_kill": sum(r["fallback_active_before_kill"] for r in rs),
        "fallback_kept": sum(r["fallback_kept"] for r in rs),
        "reclaims_counted_right": sum(r["reclaims_counted"] == r["victims"] == r["job_reclaims"] for r in rs),
        "bill_diff_nusd_max": max(abs(r["ledger_minus_independent_nusd"]) for r in rs),
        "waived_diff_nusd_max": max(abs(r["waived_minus_independent_nusd"]) for r in rs),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--storms", type=int, default=30)
    ap.add_argument("--gcp", type=int, default=5)
    ap.add_argument("--down", type=float, default=10.0, help="seconds between the SIGKILL and the restart")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    logging.getLogger("boinc-dl").setLevel(logging.ERROR)
    db = mariadb_database()
    with tempfile.TemporaryDirectory() as d:
        redis = EmbeddedRedis(Path(d) / "redis")
        redis.start()
        try:
            if args.storms:
                rs = storms(args.storms, args.down, redis.url, db, Path(d))
                s = summary(rs)
                emit("fleet_kill_storms", **s, load=os.getloadavg()[0], **machine())
                print(f"{s['storms']} storms, SIGKILL + restart {args.down:.0f} s later: {s['units_filed']} units filed "
                      f"early of {s['units_lost']} lost ({s['all_lost_filed_early']}/{s['storms']} storms exact), "
                      f"{s['handed_twice']} handed twice; re-issue latency max {s['latency_max_s']:.1f} s "
                      f"(median of storm maxima {s['latency_median_of_max_s']:.1f} s) vs the deadline path's "
                      f"{s['deadline_s']:.0f} s; {s['double_launches']} double launches; fallback kept "
                      f"{s['fallback_kept']}/{s['fallback_active_at_kill']}; reclaims counted right "
                      f"{s['reclaims_counted_right']}/{s['storms']}; bill vs EC2's record: max "
                      f"{s['bill_diff_nusd_max']} n$ apart (waived: {s['waived_diff_nusd_max']} n$)")
            if args.gcp:
                gs = gcp(args.gcp, min(args.down, 3.0), redis.url, db, Path(d))
                print(f"GCP, {len(gs)} runs: both losses filed {sum(g['filed_are_lost'] for g in gs)}/{len(gs)}, "
                      f"latency max {max(max(g['latency_first_s'], g['latency_second_s']) for g in gs):.1f} s, "
                      f"both lives charged {sum(g['both_lives_charged'] for g in gs)}/{len(gs)}, bill vs the "
                      f"stand-in's record: max {max(abs(g['ledger_minus_independent_nusd']) for g in gs)} n$ apart")
            c = day(redis.url, db, Path(d))
            emit("fleet_cost_day", **c)
            print(f"simulated day: controller ${c['controller_usd']:.2f}, ledger ${c['ledger_usd']:.2f}, "
                  f"diff {c['diff_cents']} cents; waived ${c['waived_usd']:.2f} (independent "
                  f"${c['independent_waived_usd']:.2f}); drain saved ${c['drain_saved_usd']:.2f}; "
                  f"on-demand ${c['on_demand_usd']:.2f}, saving {c['saving_pct']}%")
        finally:
            redis.stop()
            drop_database(db)


if __name__ == "__main__":
    main()
