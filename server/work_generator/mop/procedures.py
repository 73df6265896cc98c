"""The AutoML procedures of MOP model selection, behind :class:`~.search.SearchProcedure`.

:class:`GridSearch`, :class:`RandomSearch`, :class:`SuccessiveHalving`, :class:`Hyperband`
and :class:`PBT` (see :mod:`.search` for the template they share), and :func:`make_search`,
which builds one from a job spec's ``mop`` section.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from boinc_dl.server.common.errors import SpecError
from boinc_dl.server.common.space import parse_space
from boinc_dl.server.work_generator.mop.search import (
    DEFAULT_METRIC,
    Config,
    Decision,
    SearchProcedure,
    check_epochs,
    grid,
    sample_configs,
)


class GridSearch(SearchProcedure):
    """Every combination of ``param_grid`` trained for ``epochs`` epochs (one-shot template)."""

    epoch_barrier = False

    def __init__(self, param_grid: Mapping[str, Any], epochs: int, **kw: Any) -> None:
        super().__init__(**kw)
        self.epochs = check_epochs(epochs)
        self._configs = grid(param_grid)

    def _initial(self) -> list[Config]:
        return list(self._configs)

    def _decide(self, epoch: int, d: Decision) -> None:
        d.done = epoch >= self.epochs or not self.live


class RandomSearch(SearchProcedure):
    """``budget`` random configurations of ``space``, trained for ``epochs`` epochs."""

    epoch_barrier = False

    def __init__(
        self, space: Mapping[str, Any], budget: int, epochs: int, seed: int = 0, **kw: Any
    ) -> None:
        super().__init__(**kw)
        self.epochs = check_epochs(epochs)
        self._configs = sample_configs(space, budget, random.Random(seed))

    def _initial(self) -> list[Config]:
        return list(self._configs)

    def _decide(self, epoch: int, d: Decision) -> None:
        d.done = epoch >= self.epochs or not self.live


@dataclass
class _Bracket:
    rungs: list[int]  # ages (epochs trained) at which to halve; the last one ends the bracket
    configs: list[Config]
    members: list[str] = field(default_factory=list)
    alive: list[str] = field(default_factory=list)
    started: bool = False
    finished: bool = False


def _rungs(min_epochs: int, max_epochs: int, eta: int) -> list[int]:
    out, r = [], min_epochs
    while r < max_epochs:
        out.append(r)
        r *= eta
    return sorted(set(out)) + [max_epochs]


class SuccessiveHalving(SearchProcedure):
    """Synchronous successive halving (Jamieson & Talwalkar; Li et al.).

    ``n_configs`` random configurations start together; at ages ``min_epochs * eta^k`` (the
    rungs) only the best ``max(1, alive // eta)`` survive; survivors train to ``max_epochs``.
    A subclass (:class:`Hyperband`) runs several such brackets.
    """

    def __init__(
        self,
        space: Mapping[str, Any],
        n_configs: int,
        max_epochs: int,
        min_epochs: int = 1,
        eta: int = 3,
        seed: int = 0,
        **kw: Any,
    ) -> None:
        super().__init__(**kw)
        self.max_epochs = check_epochs(max_epochs, "max_epochs")
        min_epochs = check_epochs(min_epochs, "min_epochs")
        if min_epochs > self.max_epochs:
            raise SpecError(
                f"min_epochs ({min_epochs}) must not exceed max_epochs ({self.max_epochs})"
            )
        if not isinstance(eta, int) or eta < 2:
            raise SpecError(f"eta must be an integer >= 2, got {eta!r}")
        self.eta = eta
        self.sequential = False
        rng = random.Random(seed)
        self._brackets = [
            _Bracket(
                _rungs(min_epochs, self.max_epochs, eta),
                sample_configs(space, n_configs, rng, what="successive halving"),
            )
        ]

    def _initial(self) -> list[Config]:
        out = []
        for b in self._brackets if not self.sequential else self._brackets[:1]:
            out.extend(self._start(b))
        return out

    def _start(self, b: _Bracket) -> list[Config]:
        b.started = True
        b.members = [c.id for c in b.configs]
        b.alive = list(b.members)
        return list(b.configs)

    def _on_removed(self, model: str) -> None:
        for b in self._brackets:
            if model in b.alive:
                b.alive.remove(model)

    def _decide(self, epoch: int, d: Decision) -> None:
        for b in self._brackets:
            if not b.started or b.finished:
                continue
            if not b.alive:
                b.finished = True
                continue
            age = max(self.age[m] for m in b.alive)
            if age >= b.rungs[-1]:
                for m in list(b.alive):
                    self._remove(m, d, f"trained for max_epochs={b.rungs[-1]}")
                b.finished = True
            elif age in b.rungs:
                ranked = self._ranked(b.alive)
                keep = max(1, len(ranked) // self.eta)
                for m in ranked[keep:]:
                    self._remove(m, d, f"killed at rung {age} epochs (not in top {keep})")
        if self.sequential:
            nxt = next((b for b in self._brackets if not b.started), None)
            if nxt is not None and all(b.finished for b in self._brackets if b.started):
                for c in self._start(nxt):
                    self._add(d, c, None)
        d.done = all(b.finished for b in self._brackets)


class Hyperband(SuccessiveHalving):
    """Hyperband (Li et al., JMLR 2018) over epochs: brackets of successive halving.

    With ``s_max = floor(log_eta(max_epochs))``, bracket ``s`` (``s_max`` .. 0) starts
    ``ceil((s_max + 1) / (s + 1) * eta^s)`` random configurations with ``max_epochs * eta^-s``
    epochs each and halves at every rung up to ``max_epochs``. ``brackets="concurrent"``
    (default) trains all brackets' configurations in one S from the first epoch -- more
    models to hop, which is what MOP wants; ``"sequential"`` starts a bracket when the
    previous one ends (the original algorithm's order).
    """

    def __init__(
        self,
        space: Mapping[str, Any],
        max_epochs: int,
        eta: int = 3,
        seed: int = 0,
        brackets: str = "concurrent",
        **kw: Any,
    ) -> None:
        SearchProcedure.__init__(self, **kw)
        self.max_epochs = check_epochs(max_epochs, "max_epochs")
        if not isinstance(eta, int) or eta < 2:
            raise SpecError(f"eta must be an integer >= 2, got {eta!r}")
        if brackets not in ("concurrent", "sequential"):
            raise SpecError(f"brackets must be 'concurrent' or 'sequential', got {brackets!r}")
        self.eta = eta
        self.sequential = brackets == "sequential"
        s_max = 0
        while eta ** (s_max + 1) <= self.max_epochs:
            s_max += 1
        sizes = [math.ceil((s_max + 1) / (s + 1) * eta**s) for s in range(s_max, -1, -1)]
        cs = sample_configs(space, sum(sizes), random.Random(seed), what="hyperband")
        self._brackets = []
        for k, s in enumerate(range(s_max, -1, -1)):
            rungs = sorted({max(1, round(self.max_epochs * eta ** (i - s))) for i in range(s + 1)})
            first = sum(sizes[:k])
            self._brackets.append(_Bracket(rungs, cs[first : first + sizes[k]]))


class PBT(SearchProcedure):
    """Population-based training (Jaderberg et al., 2017), exploit/explore at epoch ends.

    Every ``ready_every`` epochs the models are ranked; the bottom ``quantile`` stop and each
    is replaced by a copy of a random top-``quantile`` model -- same weights (the Decision's
    parent) and perturbed hyper-parameters: numbers scaled by a factor from ``factors``
    (clipped to the space's range), choices moved to a neighbouring value; with probability
    ``resample_prob`` a hyper-parameter is drawn afresh instead. The population size stays
    constant; the search ends after ``epochs`` epochs.
    """

    def __init__(
        self,
        space: Mapping[str, Any],
        population: int,
        epochs: int,
        ready_every: int = 1,
        quantile: float = 0.25,
        factors: tuple[float, ...] = (0.8, 1.2),
        resample_prob: float = 0.25,
        seed: int = 0,
        **kw: Any,
    ) -> None:
        super().__init__(**kw)
        self.epochs = check_epochs(epochs)
        self.ready_every = check_epochs(ready_every, "ready_every")
        if not 0 < quantile <= 0.5:
            raise SpecError(f"quantile must be in (0, 0.5], got {quantile!r}")
        if not 0 <= resample_prob <= 1:
            raise SpecError(f"resample_prob must be in [0, 1], got {resample_prob!r}")
        if not factors or any(not isinstance(f, int | float) or f <= 0 for f in factors):
            raise SpecError(f"factors must be positive numbers, got {factors!r}")
        self.quantile = quantile
        self.factors = tuple(float(f) for f in factors)
        self.resample_prob = resample_prob
        self._dims = parse_space(space)
        self._rng = random.Random(seed)
        self._configs = sample_configs(space, population, self._rng, what="PBT")

    def _initial(self) -> list[Config]:
        return list(self._configs)

    def explore(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """Perturb (or, with ``resample_prob``, resample) every hyper-parameter."""
        out = {}
        for dim in self._dims:
            if self._rng.random() < self.resample_prob:
                out[dim.name] = dim.sample(self._rng)
            else:
                out[dim.name] = dim.perturb(params[dim.name], self._rng, self.factors)
        return out

    def _decide(self, epoch: int, d: Decision) -> None:
        if epoch >= self.epochs or not self.live:
            d.done = True
            return
        if epoch % self.ready_every:
            return
        ranked = self._ranked(self.live)
        n = math.floor(len(ranked) * self.quantile)
        if n < 1 or len(ranked) < 2:
            return
        top, bottom = ranked[:n], ranked[-n:]
        for k, loser in enumerate(bottom):
            donor = top[self._rng.randrange(len(top))]
            params = self.explore(self.configs[donor].params)
            c = Config.make(params, lineage=f"pbt:{donor}:{epoch}:{k}")
            self._remove(loser, d, f"exploited: replaced by a copy of {donor}")
            self._add(d, c, donor)


def make_search(
    kind: str,
    space: Mapping[str, Any],
    *,
    epochs: int,
    budget: int | None = None,
    seed: int = 0,
    metric: str = DEFAULT_METRIC,
    mode: str = "max",
    **options: Any,
) -> SearchProcedure:
    """Build the procedure a job spec names (``mop.search``): grid, random, sha, hyperband, pbt.

    ``epochs`` is the job's epoch budget (``max_epochs`` of Hyperband/SHA); ``budget`` the
    number of configurations for random search, successive halving (``n_configs``) and PBT
    (``population``); ``options`` go to the procedure (e.g. ``eta``, ``quantile``).
    """
    kw: dict[str, Any] = {"metric": metric, "mode": mode}
    try:
        if kind == "grid":
            return GridSearch(space, epochs, **kw, **options)
        if kind == "random":
            if budget is None:
                raise SpecError("random search needs a budget (number of configurations)")
            return RandomSearch(space, budget, epochs, seed=seed, **kw, **options)
        if kind in ("sha", "successive_halving"):
            n = budget if budget is not None else options.pop("n_configs", None)
            if n is None:
                raise SpecError("successive halving needs a budget (number of configurations)")
            return SuccessiveHalving(space, n, epochs, seed=seed, **kw, **options)
        if kind == "hyperband":
            return Hyperband(space, epochs, seed=seed, **kw, **options)
        if kind == "pbt":
            pop = budget if budget is not None else options.pop("population", None)
            if pop is None:
                raise SpecError("PBT needs a budget (population size)")
            return PBT(space, pop, epochs, seed=seed, **kw, **options)
    except TypeError as e:  # an unknown option name
        raise SpecError(f"search '{kind}': bad option: {e}") from None
    raise SpecError(
        f"unknown search procedure {kind!r}; choose grid, random, sha, hyperband or pbt"
    )
