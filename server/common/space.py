"""The search-space grammar of MOP model selection (``mop.param_grid`` in a job spec).

Search spaces are dicts ``name -> values``. A list means a finite set of choices (grid
search takes the Cartesian product of the lists). Random search and PBT also accept
distributions: ``{"uniform": [a, b]}``, ``{"loguniform": [a, b]}`` (a > 0) and
``{"randint": [a, b]}`` (integers, both ends included). Malformed spaces raise
:class:`~boinc_dl.server.common.errors.SpecError` naming the offending key.

It lives in :mod:`boinc_dl.server.common` because the job spec validates a space when it is loaded;
the procedures that search it are in :mod:`boinc_dl.server.work_generator.mop`.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from boinc_dl.server.common.errors import SpecError

DISTRIBUTIONS = ("uniform", "loguniform", "randint")


def canonical_json(obj: Any) -> str:
    """``obj`` as canonical JSON (sorted keys, no spaces, no NaN): the basis of stable ids."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


@dataclass(frozen=True)
class Dimension:
    """One hyper-parameter: ``kind`` is ``choice`` (``values``) or a distribution (``low, high``)."""

    name: str
    kind: str
    values: tuple = ()
    low: float = 0.0
    high: float = 0.0

    def sample(self, rng: random.Random) -> Any:
        if self.kind == "choice":
            return self.values[rng.randrange(len(self.values))]
        if self.kind == "uniform":
            return rng.uniform(self.low, self.high)
        if self.kind == "loguniform":
            return math.exp(rng.uniform(math.log(self.low), math.log(self.high)))
        return rng.randint(int(self.low), int(self.high))  # randint

    def perturb(self, value: Any, rng: random.Random, factors: tuple[float, ...]) -> Any:
        """PBT's explore step: scale a number by a random factor (clipped to the range), or
        move a choice to a neighbouring value of its list."""
        if self.kind == "choice":
            try:
                k = self.values.index(value)
            except ValueError:
                return self.sample(rng)
            k = min(max(k + rng.choice((-1, 1)), 0), len(self.values) - 1)
            return self.values[k]
        v = float(value) * rng.choice(factors)
        v = min(max(v, self.low), self.high)
        return int(round(v)) if self.kind == "randint" else v


def _check_json(key: str, v: Any) -> None:
    try:
        canonical_json(v)
    except (TypeError, ValueError):
        raise SpecError(
            f"search space: '{key}' has a value that is not plain JSON: {v!r}"
        ) from None


def parse_space(space: Any, allow_distributions: bool = True) -> list[Dimension]:
    """Validate a search space and return its dimensions, in the given key order."""
    if not isinstance(space, Mapping):
        raise SpecError(
            f"search space must be a mapping of name -> values, got {type(space).__name__}"
        )
    if not space:
        raise SpecError("search space is empty: give at least one hyper-parameter")
    dims = []
    for key, v in space.items():
        if not isinstance(key, str) or not key:
            raise SpecError(
                f"search space: hyper-parameter names must be non-empty strings, got {key!r}"
            )
        if isinstance(v, list | tuple):
            if not v:
                raise SpecError(f"search space: '{key}' is an empty list; give at least one value")
            for x in v:
                _check_json(key, x)
            canon = [canonical_json(x) for x in v]
            if len(set(canon)) != len(canon):
                dups = sorted({c for c in canon if canon.count(c) > 1})
                raise SpecError(f"search space: '{key}' lists a value twice: {', '.join(dups)}")
            dims.append(Dimension(key, "choice", tuple(v)))
        elif isinstance(v, Mapping):
            if not allow_distributions:
                raise SpecError(
                    f"search space: '{key}' is a distribution; grid search needs a list of "
                    "values (use random search for distributions)"
                )
            if len(v) != 1 or next(iter(v)) not in DISTRIBUTIONS:
                raise SpecError(
                    f"search space: '{key}' must be one of {{uniform|loguniform|randint: [low, high]}}, "
                    f"got {dict(v)!r}"
                )
            kind, bounds = next(iter(v.items()))
            if (
                not isinstance(bounds, list | tuple)
                or len(bounds) != 2
                or not all(isinstance(b, int | float) and not isinstance(b, bool) for b in bounds)
                or not all(math.isfinite(b) for b in bounds)
            ):
                raise SpecError(
                    f"search space: '{key}': {kind} needs [low, high] as two finite numbers"
                )
            lo, hi = bounds
            if not lo < hi:
                raise SpecError(f"search space: '{key}': {kind} needs low < high, got [{lo}, {hi}]")
            if kind == "loguniform" and lo <= 0:
                raise SpecError(f"search space: '{key}': loguniform needs low > 0, got {lo}")
            if kind == "randint" and not (float(lo).is_integer() and float(hi).is_integer()):
                raise SpecError(f"search space: '{key}': randint needs integer bounds")
            dims.append(Dimension(key, kind, low=float(lo), high=float(hi)))
        else:
            raise SpecError(
                f"search space: '{key}' must be a list of values or a distribution "
                f"{{uniform|loguniform|randint: [low, high]}}, got {v!r}"
            )
    return dims


