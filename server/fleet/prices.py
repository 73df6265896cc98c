"""Prices in force: a small :class:`PriceBook` interface and its step-function book.

Spot prices change at points in time (AWS's ``describe_spot_price_history``; GCP's
published SPOT prices); on-demand prices are list prices from ``fleet.yaml`` or the
project's one dated price table, the planner's ``server/planner/data/prices.yaml``.

This :class:`PriceBook` is the controller's billing interface: a price per zone and
point in time, in Decimal, with the times it changes, so a period's bill integrates a
step function exactly. The planner's ``PriceBook`` (``hourly(type, market)`` and the
prices' source) answers a different question, a typical hourly price for a plan;
``server.planner.prices.ExternalPriceBook`` adapts this one to it. Money is
:class:`~decimal.Decimal` throughout, so a day's bill adds up to the cent.
"""

from __future__ import annotations

import bisect
from decimal import Decimal
from typing import Protocol

from boinc_dl.server.fleet.provider import Market, PricePoint
from boinc_dl.server.planner.prices import DEFAULT_TABLE, TablePriceBook


def _shipped_on_demand() -> tuple[str, dict[str, Decimal]]:
    """The on-demand column of the project's one price table (the planner's, read through
    its :class:`~boinc_dl.server.planner.prices.TablePriceBook`), as exact Decimals."""
    book = TablePriceBook.load(DEFAULT_TABLE)
    # repr() of the float read from YAML is the shortest decimal that reads back as the
    # same float: the digits written in the table, so a bill adds up to the cent.
    return book.date, {name: Decimal(repr(info.on_demand)) for name, info in book.types.items()}


#: On-demand list prices, $/h, Linux, AWS us-east-1 and GCP us-central1, as of the
#: table's date (``server/planner/data/prices.yaml``). ``on_demand_prices`` in
#: fleet.yaml overrides them.
ON_DEMAND_TABLE_DATE, ON_DEMAND_TABLE = _shipped_on_demand()

SECONDS_PER_HOUR = Decimal(3600)


class PriceBook(Protocol):
    """Prices in force by instance type, zone and market."""

    def price(self, type_: str, zone: str, market: Market, t: float) -> Decimal:
        """$/h of one instance at time ``t``."""
        ...

    def breakpoints(self, type_: str, zone: str, market: Market, t0: float, t1: float) -> list[float]:
        """Times in (t0, t1) where the price changes."""
        ...


class UnknownPrice(LookupError):
    """No price is known for an instance type (add it to on_demand_prices)."""


class StepPriceBook:
    """On-demand list prices plus spot price histories (each price holds until the next)."""

    def __init__(self, on_demand: dict[str, Decimal] | None = None, spot_flat: dict[str, Decimal] | None = None):
        self.on_demand = {**ON_DEMAND_TABLE, **(on_demand or {})}
        self.spot_flat = dict(spot_flat or {})
        self._spot: dict[tuple[str, str], tuple[list[float], list[Decimal]]] = {}

    def add_spot(self, points: list[PricePoint]) -> None:
        """Merge spot price points (any order, duplicates ignored)."""
        by_key: dict[tuple[str, str], dict[float, Decimal]] = {}
        for (k, (ts, ps)) in self._spot.items():
            by_key[k] = dict(zip(ts, ps, strict=True))
        for p in points:
            by_key.setdefault((p.type, p.zone), {})[p.time] = p.usd_per_hour
        self._spot = {k: (sorted(v), [v[t] for t in sorted(v)]) for k, v in by_key.items()}

    def price(self, type_: str, zone: str, market: Market, t: float) -> Decimal:
        if market == "on-demand":
            if type_ not in self.on_demand:
                raise UnknownPrice(f"no on-demand price for {type_} (set on_demand_prices in fleet.yaml)")
            return self.on_demand[type_]
        hist = self._spot.get((type_, zone))
        if hist:
            i = bisect.bisect_right(hist[0], t) - 1
            return hist[1][max(i, 0)]  # before the first point: the oldest price known
        if type_ in self.spot_flat:
            return self.spot_flat[type_]
        raise UnknownPrice(f"no spot price for {type_} in {zone}")

    def breakpoints(self, type_: str, zone: str, market: Market, t0: float, t1: float) -> list[float]:
        if market == "on-demand" or (type_, zone) not in self._spot:
            return []
        ts = self._spot[(type_, zone)][0]
        return ts[bisect.bisect_right(ts, t0):bisect.bisect_left(ts, t1)]


def cost_between(book: PriceBook, type_: str, zone: str, market: Market, t0: float, t1: float) -> Decimal:
    """Dollars one instance costs from ``t0`` to ``t1`` at the prices in force."""
    if t1 <= t0:
        return Decimal(0)
    edges = [t0, *book.breakpoints(type_, zone, market, t0, t1), t1]
    total = Decimal(0)
    for a, b in zip(edges, edges[1:], strict=False):
        total += book.price(type_, zone, market, a) * (_d(b) - _d(a)) / SECONDS_PER_HOUR
    return total


def _d(t: float) -> Decimal:
    """A timestamp as a Decimal to the millisecond (what clouds report)."""
    return Decimal(repr(round(t, 3)))
