"""The fleet controller bills from the project's one price table (the planner's)."""

from __future__ import annotations

import re
from decimal import Decimal

from boinc_dl.server.fleet.prices import ON_DEMAND_TABLE, ON_DEMAND_TABLE_DATE, StepPriceBook
from boinc_dl.server.planner.prices import DEFAULT_TABLE, TablePriceBook


def test_on_demand_table_is_the_planners_digit_for_digit():
    book = TablePriceBook.load(DEFAULT_TABLE)
    assert ON_DEMAND_TABLE_DATE == book.date
    assert set(ON_DEMAND_TABLE) == set(book.types)
    # The digits as written in prices.yaml, not a float's approximation of them.
    written = dict(re.findall(r"^\s+([\w.-]+):\s+\{.*on_demand:\s*([0-9.]+)", DEFAULT_TABLE.read_text(), re.M))
    assert written and {k: Decimal(v) for k, v in written.items()} == ON_DEMAND_TABLE
    assert ON_DEMAND_TABLE["g6.xlarge"] == Decimal("0.8048")


def test_fleet_file_prices_override_the_table():
    step = StepPriceBook(on_demand={"g4dn.xlarge": Decimal("0.5")})
    assert step.price("g4dn.xlarge", "z", "on-demand", 0.0) == Decimal("0.5")
    assert step.price("c6i.xlarge", "z", "on-demand", 0.0) == ON_DEMAND_TABLE["c6i.xlarge"]
