"""Search spaces and AutoML procedures for MOP model selection.

Cerebro (PVLDB 2020, section 4.2) observes that most AutoML procedures fit one template:
create an initial set S of configurations, train all of S for an epoch, evaluate, then
terminate some configurations and/or add new ones, and repeat. Every procedure here is a
small class behind that one interface::

    proc = make_search("hyperband", {"lr": {"loguniform": [1e-4, 1e-1]}, "units": [32, 64]},
                       epochs=9, seed=0)
    S = proc.initial()                       # list[Config]
    # ... train every model of S for one epoch (MOP), validate ...
    d = proc.on_epoch_end(1, {"c1a2...": {"val_acc": 0.81}, ...})
    # d.stop: model ids leaving S (d.reasons[id] says why); d.add: [(Config, parent_id|None)]
    # -- a parent means "initialise the new model from that model's latest weights" (PBT);
    # d.done: the search is over.

A :class:`Config` is a dict of hyper-parameters with a stable id (a hash of the parameters,
plus the lineage for PBT clones), so ids are the same in every run with the same inputs.
Procedures are deterministic given their seed and the results fed to them: a restarted work
generator rebuilds one with the same arguments and :meth:`SearchProcedure.replay` s the
recorded per-epoch results to reach the same state.

Search spaces are dicts ``name -> values``. A list means a finite set of choices (grid
search takes the Cartesian product of the lists). Random search and PBT also accept
distributions: ``{"uniform": [a, b]}``, ``{"loguniform": [a, b]}`` (a > 0) and
``{"randint": [a, b]}`` (integers, both ends included). Malformed spaces raise
:class:`~server.common.errors.SpecError` naming the offending key.

Procedures: :class:`GridSearch`, :class:`RandomSearch`, :class:`SuccessiveHalving`,
:class:`Hyperband` (brackets trained together in one S -- more models to hop, which MOP
wants -- or one after another, the original order) and
:class:`PBT` (exploit/explore: the worst quantile is replaced by perturbed copies of the
best, cloned from their weights). ASHA is not included: it has no synchronous evaluation
point and does not fit the epoch-boundary template (Cerebro emulates it by setting |S| = p).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import random
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from server.common.errors import SpecError

DEFAULT_METRIC = "val_acc"
DISTRIBUTIONS = ("uniform", "loguniform", "randint")


# ---------------------------------------------------------------------------- configurations
def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


def config_id(params: Mapping[str, Any], lineage: str = "") -> str:
    """A stable id: ``c`` + 12 hex digits of the SHA-1 of the canonical JSON of ``params``."""
    h = hashlib.sha1((_canonical(dict(params)) + "|" + lineage).encode(), usedforsecurity=False).hexdigest()
    return "c" + h[:12]


@dataclass(frozen=True, eq=True)
class Config:
    """One training configuration: hyper-parameters ``params`` with a stable ``id``."""

    id: str
    params: dict[str, Any] = field(hash=False)

    @classmethod
    def make(cls, params: Mapping[str, Any], lineage: str = "") -> Config:
        return cls(config_id(params, lineage), dict(params))

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "params": dict(self.params)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Config:
        return cls(str(d["id"]), dict(d["params"]))


@dataclass
class Decision:
    """What to do at an epoch boundary.

    ``stop``: model ids leaving S before the next epoch (killed or finished), with
    ``reasons[id]``; ``add``: new configurations, each with the id of the model whose latest
    weights it starts from (``None``: fresh initialisation); ``done``: the search is over.
    """

    stop: list[str] = field(default_factory=list)
    add: list[tuple[Config, str | None]] = field(default_factory=list)
    done: bool = False
    reasons: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "stop": list(self.stop),
            "add": [[c.to_json(), parent] for c, parent in self.add],
            "done": self.done,
            "reasons": dict(self.reasons),
        }


# ---------------------------------------------------------------------------- search spaces
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
        _canonical(v)
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
            canon = [_canonical(x) for x in v]
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


def grid(param_grid: Mapping[str, Any]) -> list[Config]:
    """The Cartesian product of ``param_grid`` (dict of lists), in key and value order."""
    dims = parse_space(param_grid, allow_distributions=False)
    names = [d.name for d in dims]
    return [
        Config.make(dict(zip(names, vals, strict=True)))
        for vals in itertools.product(*(d.values for d in dims))
    ]


def sample_configs(
    space: Mapping[str, Any], n: int, rng: random.Random, what: str = "random search"
) -> list[Config]:
    """``n`` distinct random configurations of ``space``.

    A space of lists only is sampled without replacement (an error if ``n`` exceeds its
    size); with distributions, draws that repeat an earlier configuration are redrawn.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise SpecError(
            f"{what}: the number of configurations must be a positive integer, got {n!r}"
        )
    dims = parse_space(space)
    if all(d.kind == "choice" for d in dims):
        sizes = [len(d.values) for d in dims]
        total = math.prod(sizes)
        if n > total:
            raise SpecError(
                f"{what} needs {n} distinct configurations but the space has only {total}"
            )
        out = []
        for idx in rng.sample(range(total), n):  # decode a mixed-radix index, no enumeration
            params = {}
            for d, size in zip(reversed(dims), reversed(sizes), strict=True):
                idx, k = divmod(idx, size)
                params[d.name] = d.values[k]
            out.append(Config.make({d.name: params[d.name] for d in dims}))
        return out
    seen: dict[str, Config] = {}
    tries = 0
    while len(seen) < n:
        tries += 1
        if tries > 100 * n:
            raise SpecError(f"{what}: could not draw {n} distinct configurations from the space")
        c = Config.make({d.name: d.sample(rng) for d in dims})
        seen.setdefault(c.id, c)
    return list(seen.values())


# ---------------------------------------------------------------------------- procedures
class SearchProcedure(ABC):
    """An AutoML procedure acting at epoch boundaries (Cerebro's template, section 4.2).

    Subclasses implement :meth:`_initial` and :meth:`_decide`; the base class checks the
    epoch sequence, tracks live models, their ages (epochs trained) and learning curves, and
    treats a live model missing from ``results`` (it failed) as stopped.

    Args:
        metric: the key of the validation metrics to rank by (default ``val_acc``).
        mode: ``"max"`` or ``"min"`` (higher or lower is better). NaN/missing ranks last.
    """

    def __init__(self, metric: str = DEFAULT_METRIC, mode: str = "max") -> None:
        if mode not in ("max", "min"):
            raise SpecError(f"search mode must be 'max' or 'min', got {mode!r}")
        self.metric = metric
        self.mode = mode
        self.epoch = 0
        self.configs: dict[str, Config] = {}  # every config ever proposed
        self.live: list[str] = []  # models currently in S
        self.age: dict[str, int] = {}  # epochs trained (clones inherit their parent's)
        self.curves: dict[str, list[float]] = {}  # per-model score per trained epoch
        self.parent: dict[str, str | None] = {}
        self._started = False
        self._done = False

    # -- public interface
    def initial(self) -> list[Config]:
        """The initial S. Call once, before any :meth:`on_epoch_end`."""
        if self._started:
            raise RuntimeError("initial() was already called")
        self._started = True
        cs = self._initial()
        if not cs:
            raise SpecError("the search produced no configurations")
        for c in cs:
            self._admit(c, None)
        return list(cs)

    def on_epoch_end(self, epoch: int, results: Mapping[str, Mapping[str, Any]]) -> Decision:
        """Feed the validation metrics of every live model after ``epoch`` (1, 2, ...)."""
        if not self._started:
            raise RuntimeError("call initial() first")
        if self._done:
            raise RuntimeError("the search is already done")
        if epoch != self.epoch + 1:
            raise ValueError(f"expected results of epoch {self.epoch + 1}, got epoch {epoch}")
        unknown = sorted(set(results) - set(self.live))
        if unknown:
            raise ValueError(f"results for models not in S: {unknown}")
        self.epoch = epoch
        d = Decision()
        for m in list(self.live):
            if m not in results:
                self._remove(m, d, "failed: no result this epoch")
                continue
            self.age[m] += 1
            self.curves[m].append(self._score(results[m]))
        self._decide(epoch, d)
        if d.done:
            for m in list(self.live):
                self._remove(m, d, "search finished")
        self._done = d.done
        return d

    def replay(
        self, history: Iterable[tuple[int, Mapping[str, Mapping[str, Any]]]]
    ) -> list[Decision]:
        """Rebuild state after a restart: :meth:`initial` then every recorded epoch's results."""
        self.initial()
        return [self.on_epoch_end(e, r) for e, r in history]

    @property
    def done(self) -> bool:
        return self._done

    def score(self, model: str) -> float:
        """The model's latest score (higher is better, whatever the mode)."""
        c = self.curves.get(model)
        return c[-1] if c else -math.inf

    # -- helpers for subclasses
    def _score(self, metrics: Mapping[str, Any]) -> float:
        v = metrics.get(self.metric) if isinstance(metrics, Mapping) else None
        if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
            return -math.inf
        return float(v) if self.mode == "max" else -float(v)

    def _admit(self, c: Config, parent: str | None) -> None:
        if c.id in self.configs:
            raise RuntimeError(f"configuration id {c.id} proposed twice")
        self.configs[c.id] = c
        self.live.append(c.id)
        self.parent[c.id] = parent
        self.age[c.id] = self.age[parent] if parent is not None else 0
        self.curves[c.id] = list(self.curves[parent]) if parent is not None else []

    def _add(self, d: Decision, c: Config, parent: str | None) -> None:
        self._admit(c, parent)
        d.add.append((c, parent))

    def _remove(self, m: str, d: Decision, reason: str) -> None:
        self.live.remove(m)
        d.stop.append(m)
        d.reasons[m] = reason
        self._on_removed(m)

    def _ranked(self, models: Iterable[str]) -> list[str]:
        """Best first; ties broken by id so the ranking is deterministic."""
        return sorted(models, key=lambda m: (-self.score(m), m))

    def _on_removed(self, model: str) -> None:  # noqa: B027 - optional hook
        """Hook: a model left S (killed, finished or failed)."""

    @abstractmethod
    def _initial(self) -> list[Config]: ...

    @abstractmethod
    def _decide(self, epoch: int, d: Decision) -> None:
        """Fill ``d`` (stop/add/done) after the scores of ``epoch`` were recorded."""


def _check_epochs(epochs: Any, what: str = "epochs") -> int:
    if not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 1:
        raise SpecError(f"{what} must be a positive integer, got {epochs!r}")
    return epochs


class GridSearch(SearchProcedure):
    """Every combination of ``param_grid`` trained for ``epochs`` epochs (one-shot template)."""

    def __init__(self, param_grid: Mapping[str, Any], epochs: int, **kw: Any) -> None:
        super().__init__(**kw)
        self.epochs = _check_epochs(epochs)
        self._configs = grid(param_grid)

    def _initial(self) -> list[Config]:
        return list(self._configs)

    def _decide(self, epoch: int, d: Decision) -> None:
        d.done = epoch >= self.epochs or not self.live


class RandomSearch(SearchProcedure):
    """``budget`` random configurations of ``space``, trained for ``epochs`` epochs."""

    def __init__(
        self, space: Mapping[str, Any], budget: int, epochs: int, seed: int = 0, **kw: Any
    ) -> None:
        super().__init__(**kw)
        self.epochs = _check_epochs(epochs)
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
        self.max_epochs = _check_epochs(max_epochs, "max_epochs")
        min_epochs = _check_epochs(min_epochs, "min_epochs")
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
        self.max_epochs = _check_epochs(max_epochs, "max_epochs")
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
        self.epochs = _check_epochs(epochs)
        self.ready_every = _check_epochs(ready_every, "ready_every")
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
