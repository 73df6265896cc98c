"""Prices the planner charges: a small :class:`PriceBook` interface over a dated table.

The shipped table (``data/prices.yaml``) gives approximate list on-demand prices and
typical spot prices; it states its date and source, and :class:`TablePriceBook` carries
them so every plan can print where its dollars came from. When the fleet controller has
a spot price history (objects with ``type``, ``zone``, ``time`` and ``usd_per_hour``,
the fleet controller's ``PricePoint``), :meth:`TablePriceBook.with_spot_history` replaces
the table's spot price of each type seen by its recent mean. Any object with the fleet
controller's ``price(type_, zone, market, t)`` method can also stand in (see
:class:`ExternalPriceBook`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import yaml

Market = Literal["spot", "on-demand"]
MARKETS: tuple[Market, ...] = ("spot", "on-demand")
DEFAULT_TABLE = Path(__file__).parent / "data" / "prices.yaml"


class PriceError(LookupError):
    """No price is known for an instance type and market."""


class PriceBook(Protocol):
    """$/h of one instance of a type in a market."""

    def hourly(self, type_: str, market: Market) -> float:
        """USD per hour of one instance of ``type_`` in ``market``."""
        ...

    def source(self) -> str:
        """Where the prices come from (and as of when), for the plan's footer."""
        ...


@dataclass(frozen=True)
class TypeInfo:
    """One row of the price table."""

    name: str
    provider: str
    vcpus: int
    memory_gib: float
    gpu: str | None
    on_demand: float
    spot: float


class TablePriceBook:
    """The shipped (or a user's) dated price table, optionally with observed spot prices."""

    def __init__(self, types: dict[str, TypeInfo], date: str, source_text: str,
                 spot_observed: dict[str, float] | None = None, on_demand_given: dict[str, float] | None = None):
        self.types = types
        self.date = date
        self.source_text = source_text
        self.spot_observed = dict(spot_observed or {})
        self.on_demand_given = dict(on_demand_given or {})  # a fleet file's on_demand_prices

    @classmethod
    def load(cls, path: Path | str = DEFAULT_TABLE) -> TablePriceBook:
        """Read and check a price table (schema: ``date``, ``source``, ``types``)."""
        raw = yaml.safe_load(Path(path).read_text())
        return cls.from_dict(raw, str(path))

    @classmethod
    def from_dict(cls, raw: Any, where: str = "price table") -> TablePriceBook:
        if not isinstance(raw, dict):
            raise ValueError(f"{where}: a mapping with date, source and types expected")
        for key in ("date", "source", "types"):
            if key not in raw:
                raise ValueError(f"{where}: missing field {key!r}")
        if not isinstance(raw["types"], dict) or not raw["types"]:
            raise ValueError(f"{where}: types must be a non-empty mapping")
        types: dict[str, TypeInfo] = {}
        for name, row in raw["types"].items():
            if not isinstance(row, dict):
                raise ValueError(f"{where}: types.{name} must be a mapping")
            try:
                od, spot = float(row["on_demand"]), float(row["spot"])
                info = TypeInfo(str(name), str(row["provider"]), int(row["vcpus"]), float(row["memory_gib"]),
                                row.get("gpu"), od, spot)
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{where}: types.{name}: {type(e).__name__}: {e}") from None
            if info.provider not in ("aws", "gcp"):
                raise ValueError(f"{where}: types.{name}.provider must be aws or gcp")
            if not 0 < spot <= od:
                raise ValueError(f"{where}: types.{name}: need 0 < spot <= on_demand")
            types[str(name)] = info
        return cls(types, str(raw["date"]), str(raw["source"]))

    def hourly(self, type_: str, market: Market) -> float:
        info = self.types.get(type_)
        if market == "spot" and type_ in self.spot_observed:
            return self.spot_observed[type_]
        if market == "on-demand" and type_ in self.on_demand_given:
            return self.on_demand_given[type_]
        if info is None:
            raise PriceError(f"no price for instance type {type_!r} (add it to the price table)")
        return info.spot if market == "spot" else info.on_demand

    def source(self) -> str:
        extra = f"; spot from observed history for {', '.join(sorted(self.spot_observed))}" \
            if self.spot_observed else ""
        if self.on_demand_given:
            extra += f"; on-demand from the fleet file for {', '.join(sorted(self.on_demand_given))}"
        return f"{self.source_text}, as of {self.date} (approximate list prices){extra}"

    def with_prices(self, on_demand: dict[str, float], spot: dict[str, float]) -> TablePriceBook:
        """A copy with a fleet file's prices: its on-demand list prices, and its spot
        prices taken as observed (GCP publishes SPOT prices: no history to average)."""
        for name, v in [*on_demand.items(), *spot.items()]:
            if not (isinstance(v, (int, float)) and 0 < float(v) < 1e4):
                raise PriceError(f"price of {name!r}: a positive $/h expected, got {v!r}")
        return TablePriceBook(self.types, self.date, self.source_text,
                              {**self.spot_observed, **{k: float(v) for k, v in spot.items()}},
                              {**self.on_demand_given, **{k: float(v) for k, v in on_demand.items()}})

    def with_spot_history(self, points: Iterable[Any], window_s: float = 7 * 86400,
                          now: float | None = None) -> TablePriceBook:
        """A copy whose spot prices are the mean of the history's points in the last
        ``window_s`` (all zones) for every type the history covers."""
        now = time.time() if now is None else now
        seen: dict[str, list[float]] = {}
        for p in points:
            if now - float(p.time) <= window_s:
                seen.setdefault(str(p.type), []).append(float(p.usd_per_hour))
        observed = {t: statistics.fmean(v) for t, v in seen.items() if v}
        return TablePriceBook(self.types, self.date, self.source_text, {**self.spot_observed, **observed},
                              self.on_demand_given)


class ExternalPriceBook:
    """Adapts a book with the fleet controller's interface (``price(type_, zone, market, t)``
    returning a Decimal) to the planner's, at one zone and time; the table fills the gaps."""

    def __init__(self, book: Any, zone: str, fallback: TablePriceBook, at: float | None = None):
        self.book, self.zone, self.fallback = book, zone, fallback
        self.at = time.time() if at is None else at

    def hourly(self, type_: str, market: Market) -> float:
        try:
            return float(self.book.price(type_, self.zone, market, self.at))
        except LookupError:
            return self.fallback.hourly(type_, market)

    def source(self) -> str:
        return f"fleet controller prices in {self.zone}; else {self.fallback.source()}"
