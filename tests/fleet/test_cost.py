"""Cost accounting: a simulated day (spot price history, launches, reclaims, scale-ins)
charged period by period by the controller equals, to the cent, a ledger computed
independently here from the instances' true lifetimes."""

from __future__ import annotations

import random
from decimal import Decimal
from types import SimpleNamespace

import numpy as np
from typer.testing import CliRunner

from boinc_dl.server.assimilator.connection import connect
from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.common.workunit import unit_name
from boinc_dl.server.fleet.boinchosts import BoincHosts
from boinc_dl.server.fleet.config import parse_config
from boinc_dl.server.fleet.controller import FleetController
from boinc_dl.server.fleet.cost import cost_report
from boinc_dl.server.fleet.prices import ON_DEMAND_TABLE, StepPriceBook
from boinc_dl.server.fleet.provider import (
    FleetShape,
    Instance,
    Interruption,
    Observation,
    PricePoint,
)
from tests.boinc.conftest import tiny_fp

DAY0 = 1_795_000_000.0
PERIOD = 300
SPOT_TYPES = {"g4dn.xlarge": Decimal("0.526"), "g5.xlarge": Decimal("1.006")}
ZONES = ["us-east-1a", "us-east-1b"]


def simulated_day(rng: random.Random) -> tuple[list[PricePoint], list[dict]]:
    """Spot price histories (a change every 1-3 h, at millisecond times) and 60 instance
    lifetimes: 40% reclaimed (warning, then the end 120 s later), 30% scaled in at a
    period boundary, the rest running past the end of the day."""
    points = []
    for t, od in SPOT_TYPES.items():
        for z in ZONES:
            at = DAY0 - 3600
            while at < DAY0 + 86400:
                points.append(PricePoint(t, z, at, (od * Decimal(rng.uniform(0.25, 0.45))).quantize(Decimal("0.0001"))))
                at = round(at + rng.uniform(3600, 3 * 3600), 3)
    lives = []
    for k in range(60):
        spot = k % 5 != 0
        type_ = rng.choice(sorted(SPOT_TYPES)) if spot else "c6i.xlarge"
        launch = DAY0 + rng.randint(0, 80_000_000) / 1000
        kind = rng.choices(["reclaim", "scale-in", "stays"], [4, 3, 3])[0] if spot else rng.choice(["scale-in", "stays"])
        life = {"id": f"i-{k:017x}", "type": type_, "zone": rng.choice(ZONES), "market": "spot" if spot else "on-demand",
                "launch": launch, "end": None, "warning": None}
        if kind == "reclaim":
            life["warning"] = round(launch + rng.uniform(600, 30000), 3)
            life["end"] = life["warning"] + 120
        elif kind == "scale-in":
            first = (int((launch - DAY0) // PERIOD) + 3) * PERIOD + DAY0
            life["end"] = float(rng.randrange(int(first), int(DAY0 + 86400), PERIOD))
        lives.append(life)
    return points, lives


def independent_ledger(points: list[PricePoint], lives: list[dict], day_end: float) -> dict[str, Decimal]:
    """Dollars per (type|market) and the on-demand equivalent, integrated directly."""
    out: dict[str, Decimal] = {}
    od_total = Decimal(0)
    for life in lives:
        a_ms = round(life["launch"] * 1000)
        b_ms = round(min(life["end"] or day_end, day_end) * 1000)
        od_total += ON_DEMAND_TABLE[life["type"]] * (b_ms - a_ms) / 3_600_000
        if life["market"] == "on-demand":
            usd = ON_DEMAND_TABLE[life["type"]] * (b_ms - a_ms) / 3_600_000
        else:
            pts = sorted((round(p.time * 1000), p.usd_per_hour) for p in points
                         if p.type == life["type"] and p.zone == life["zone"])
            usd = Decimal(0)
            for i, (t_ms, price) in enumerate(pts):
                nxt = pts[i + 1][0] if i + 1 < len(pts) else 10**16
                lo, hi = max(t_ms, a_ms), min(nxt, b_ms)
                if hi > lo:
                    usd += price * (hi - lo) / 3_600_000
        key = f"{life['type']}|{life['market']}"
        out[key] = out.get(key, Decimal(0)) + usd
    out["_od"] = od_total
    return out


def test_simulated_day_to_the_cent(redis_server, boinc_db) -> None:
    from tests.conftest import tiny_spec

    rng = random.Random(2026)
    points, lives = simulated_day(rng)
    r = connect(redis_server.url)
    spec = tiny_spec("day")
    JobStore(r, "day").create(spec.model_dump_json(), "vcasgd", {"0": tiny_fp()}, {})
    JobStore(r, "day").init_weights("0", np.zeros(tiny_fp().n_params, np.float32))
    boinc_db.send(unit_name("day", 1, 0), boinc_db.add_host("elsewhere"), DAY0)  # the job has work in flight
    cfg = parse_config({"provider": "aws", "project": "/p", "max_hosts": 100,
                        "aws": {"region": "us-east-1", "asg_name": "a", "queue_url": "q"}})
    book = StepPriceBook()
    book.add_spot(points)
    clock = [DAY0]
    # The cloud is simulated here (a day cannot pass in moto): the controller's own
    # interruption handling and accounting see what a provider would report.
    ctl = FleetController(cfg, SimpleNamespace(name="sim"), BoincHosts(boinc_db.conn, paramstyle="qmark"), r,
                          book=book, clock=lambda: clock[0])
    ctl.started = DAY0
    reported_gone: set[str] = set()
    for T in range(int(DAY0) + PERIOD, int(DAY0) + 86400 + 1, PERIOD):
        clock[0] = float(T)
        insts, events = [], []
        for life in lives:
            if life["launch"] > T or life["id"] in reported_gone:
                continue
            gone = life["end"] is not None and life["end"] <= T
            if gone:
                reported_gone.add(life["id"])
            insts.append(Instance(life["id"], life["type"], life["market"], life["zone"],
                                  "gone" if gone else "running", life["launch"]))
            if life["warning"] is not None and T - PERIOD < life["warning"] <= T:
                events.append(Interruption(life["id"], "warning", life["warning"], life["warning"] + 120))
        obs = Observation(float(T), insts, FleetShape(len(insts), 0), events)
        for inst in obs.instances:
            if inst.state != "gone" or inst.id in ctl.known:
                ctl.known[inst.id] = inst
        ctl.handle_interruptions(obs.interruptions, float(T))
        ctl.account(obs, float(T))

    truth = independent_ledger(points, lives, DAY0 + 86400)
    rep = cost_report(r, "day")
    got = {f"{ln['type']}|{ln['market']}": ln["usd"] for ln in rep["lines"]}
    assert set(got) == {k for k in truth if k != "_od"}
    for k, v in got.items():
        assert v.quantize(Decimal("0.01")) == truth[k].quantize(Decimal("0.01")), k
    total = sum(v for k, v in truth.items() if k != "_od")
    assert rep["total_usd"] == total.quantize(Decimal("0.01"))
    assert rep["on_demand_usd"] == truth["_od"].quantize(Decimal("0.01"))
    assert rep["saving_usd"] == (truth["_od"] - total).quantize(Decimal("0.01"))
    assert Decimal(40) < rep["saving_pct"] < Decimal(75)
    assert rep["reclaims"] == 0  # no reclaimed instance held a result of the job (no BOINC host)

    out = CliRunner().invoke(__import__("boinc_dl.server.cli", fromlist=["app"]).app,
                             ["cost", "day", "--redis-url", redis_server.url])
    assert out.exit_code == 0, out.output
    assert f"{rep['total_usd']}" in out.output and "saved" in out.output
    bad = CliRunner().invoke(__import__("boinc_dl.server.cli", fromlist=["app"]).app,
                             ["cost", "nope", "--redis-url", redis_server.url])
    assert bad.exit_code != 0 and "no job named" in bad.output


def test_step_price_book_and_split() -> None:
    book = StepPriceBook({"x.large": Decimal("1.00")})
    book.add_spot([PricePoint("x.large", "z", 100.0, Decimal("0.30")), PricePoint("x.large", "z", 200.0, Decimal("0.60"))])
    from boinc_dl.server.fleet.prices import cost_between

    assert cost_between(book, "x.large", "z", "spot", 150.0, 250.0) == Decimal("0.30") * 50 / 3600 + Decimal("0.60") * 50 / 3600
    assert cost_between(book, "x.large", "z", "on-demand", 0, 3600) == Decimal("1.00")
    from boinc_dl.server.fleet.cost import _split

    assert _split(10, {"a": 1, "b": 2}) == {"a": 3, "b": 7} and sum(_split(7, {"a": 1, "b": 1, "c": 1}).values()) == 7
