"""Cost accounting: a simulated day (spot price history, launches, reclaims by EC2 some
in their first hour, scale-ins) charged period by period by the controller equals, to
the cent, a ledger computed independently from the instances' true lifetimes by AWS's
rules; ``boinc-dl cost`` prints it with what draining saved."""

from __future__ import annotations

import random
from decimal import Decimal

import numpy as np
from typer.testing import CliRunner

from boinc_dl.server.assimilator.connection import connect
from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.cli import app
from boinc_dl.server.common.workunit import unit_name
from boinc_dl.server.fleet.config import parse_config
from boinc_dl.server.fleet.controller import FleetController
from boinc_dl.server.fleet.cost import _split, cost_report
from boinc_dl.server.fleet.prices import StepPriceBook, cost_between
from boinc_dl.server.fleet.provider import PricePoint
from boinc_dl.server.fleet.state import FleetState
from tests.boinc.conftest import tiny_fp
from tests.fleet.conftest import boinc_hosts
from tests.fleet.simcloud import DAY0, PERIOD, SimCloud, independent_ledger, simulated_day


def run_day(r, project, seed: int = 2026) -> tuple[dict, dict]:  # noqa: ANN001
    """The controller's periods over the simulated day; (its report, the independent ledger)."""
    points, lives = simulated_day(random.Random(seed))
    cfg = parse_config({"provider": "aws", "project": str(project.root), "max_hosts": 100,
                        "aws": {"region": "us-east-1", "asg_name": "sim", "queue_url": "q"}})
    book = StepPriceBook()
    book.add_spot(points)
    clock = [DAY0]
    ctl = FleetController(cfg, SimCloud(lives, lambda: clock[0]), boinc_hosts(project), FleetState(r, "sim"),
                          book=book, clock=lambda: clock[0])
    ctl.hold()  # the fleet's first watch: DAY0
    for t in range(int(DAY0) + PERIOD, int(DAY0) + 86400 + 1, PERIOD):
        clock[0] = float(t)
        ctl.step()
    return cost_report(r, "day"), independent_ledger(points, lives, DAY0 + 86400)


def test_simulated_day_to_the_cent(redis_server, boinc_db, project) -> None:
    from tests.conftest import tiny_spec

    r = connect(redis_server.url)
    JobStore(r, "day").create(tiny_spec("day").model_dump_json(), "vcasgd", {"0": tiny_fp()}, {})
    JobStore(r, "day").init_weights("0", np.zeros(tiny_fp().n_params, np.float32))
    boinc_db.send(unit_name("day", 1, 0), boinc_db.add_host("elsewhere"), DAY0)  # the job has work in flight
    rep, truth = run_day(r, project)
    got = {f"{ln['type']}|{ln['market']}": ln["usd"] for ln in rep["lines"]}
    assert set(got) == {k for k in truth if not k.startswith("_")}
    for k, v in got.items():
        assert v.quantize(Decimal("0.01")) == truth[k].quantize(Decimal("0.01")), k
    total = sum(v for k, v in truth.items() if not k.startswith("_"))
    assert rep["total_usd"] == total.quantize(Decimal("0.01"))
    assert rep["on_demand_usd"] == truth["_od"].quantize(Decimal("0.01"))
    assert rep["waived_usd"] == truth["_waived"].quantize(Decimal("0.01")) and rep["waived_n"] > 0
    assert rep["saving_usd"] == (truth["_od"] - total).quantize(Decimal("0.01"))
    assert Decimal(40) < rep["saving_pct"] < Decimal(80)
    assert rep["reclaims"] == 0  # no reclaimed instance held a result of the job (no BOINC host)
    assert rep["drain_saved_usd"] != 0  # first-hour reclaims waived, later ones paid their notice
    assert rep["provisional_hours"] == 0  # every live instance is past its first hour at midnight

    out = CliRunner().invoke(app, ["cost", "day", "--redis-url", redis_server.url])
    assert out.exit_code == 0, out.output
    text = " ".join(out.output.split())
    assert f"{rep['total_usd']}" in text and "saved" in text and f"waived {rep['waived_n']} first-hour" in text
    bad = CliRunner().invoke(app, ["cost", "nope", "--redis-url", redis_server.url])
    assert bad.exit_code != 0 and "no job named" in bad.output


def test_step_price_book_and_split() -> None:
    book = StepPriceBook({"x.large": Decimal("1.00")})
    book.add_spot([PricePoint("x.large", "z", 100.0, Decimal("0.30")), PricePoint("x.large", "z", 200.0, Decimal("0.60"))])
    assert cost_between(book, "x.large", "z", "spot", 150.0, 250.0) == Decimal("0.30") * 50 / 3600 + Decimal("0.60") * 50 / 3600
    assert cost_between(book, "x.large", "z", "on-demand", 0, 3600) == Decimal("1.00")
    assert _split(10, {"a": 1, "b": 2}) == {"a": 3, "b": 7} and sum(_split(7, {"a": 1, "b": 1, "c": 1}).values()) == 7
    assert sum(_split(-7, {"a": 1, "b": 2}).values()) == -7  # a refund splits exactly too
