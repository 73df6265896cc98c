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

Search spaces (grammar and validation in :mod:`boinc_dl.server.common.space`) are dicts
``name -> values``. A list means a finite set of choices (grid
search takes the Cartesian product of the lists). Random search and PBT also accept
distributions: ``{"uniform": [a, b]}``, ``{"loguniform": [a, b]}`` (a > 0) and
``{"randint": [a, b]}`` (integers, both ends included). Malformed spaces raise
:class:`~boinc_dl.server.common.errors.SpecError` naming the offending key.

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
import math
import random
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from boinc_dl.server.common.errors import SpecError
from boinc_dl.server.common.space import canonical_json, parse_space

DEFAULT_METRIC = "val_acc"


# ---------------------------------------------------------------------------- configurations
def config_id(params: Mapping[str, Any], lineage: str = "") -> str:
    """A stable id: ``c`` + 12 hex digits of the SHA-1 of the canonical JSON of ``params``."""
    h = hashlib.sha1((canonical_json(dict(params)) + "|" + lineage).encode(), usedforsecurity=False).hexdigest()
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

    #: Whether the procedure decides at epoch boundaries (stops, adds or clones models):
    #: then every model waits for the others at each epoch's end. Grid and random search
    #: decide nothing there, so their models go on to the next epoch at once (pipelining).
    epoch_barrier: bool = True

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


def check_epochs(epochs: Any, what: str = "epochs") -> int:
    if not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 1:
        raise SpecError(f"{what} must be a positive integer, got {epochs!r}")
    return epochs


