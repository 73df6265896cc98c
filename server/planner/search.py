"""Cost and choice: candidates, their price, exact search, greedy and genetic baselines.

Cost follows HeterPS (Liu et al., "HeterPS: Distributed Deep Learning With Reinforcement
Learning Based Scheduling in Heterogeneous Environments", eqs. 2-8, 13-14): the job's
time multiplied by the sum of the hourly prices of the resources it holds (every client
host and the server). A candidate is (counts per instance type, market, T, P, units
per epoch). The exact search scores every candidate with the closed form and re-scores
the best ``refine`` of them (and of each baseline's answer) with the simulation; the
greedy and genetic searches are the papers' baselines, run over the same space and
scored the same way, with their regret against the exact answer.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from boinc_dl.server.planner.model import (
    Config,
    HostType,
    Prediction,
    ServerCosts,
    Workload,
    closed_form,
)
from boinc_dl.server.planner.prices import Market, PriceBook
from boinc_dl.server.planner.sim import simulate


@dataclass(frozen=True)
class Space:
    """The search space: per-type count ranges and the choices of market, T, P, unit size."""

    types: tuple[HostType, ...]
    max_counts: tuple[int, ...]
    markets: tuple[Market, ...] = ("spot", "on-demand")
    slots: tuple[int, ...] = (1, 2, 4, 8)
    assimilators: tuple[int, ...] = (1, 2, 4)
    units_per_epoch: tuple[int, ...] = (16,)
    server_type: str | None = None  # priced on-demand for the job's duration
    timeout_s: float = 300.0
    notice_s: float | None = None

    def size(self) -> int:
        n = 1
        for m in self.max_counts:
            n *= m + 1
        return (n - 1) * len(self.markets) * len(self.slots) * len(self.assimilators) * len(self.units_per_epoch)


@dataclass(frozen=True)
class Candidate:
    """A point of the space (``counts`` aligned with ``Space.types``)."""

    counts: tuple[int, ...]
    market: Market
    slots: int
    assimilators: int
    units_per_epoch: int


@dataclass
class Scored:
    """A candidate with its predicted times and dollars."""

    cand: Candidate
    pred: Prediction
    dollars: float
    on_demand_dollars: float
    hourly: float

    @property
    def hours(self) -> float:
        return self.pred.job_s / 3600

    @property
    def saving(self) -> float:
        """Fraction saved against the same fleet on on-demand."""
        return 1 - self.dollars / self.on_demand_dollars if self.on_demand_dollars else 0.0


@dataclass
class Goal:
    """Cheapest meeting ``deadline_s``, or fastest within ``budget``."""

    deadline_s: float | None = None
    budget: float | None = None

    def __post_init__(self) -> None:
        if (self.deadline_s is None) == (self.budget is None):
            raise ValueError("give exactly one of a deadline or a budget")

    def feasible(self, s: Scored) -> bool:
        if self.deadline_s is not None:
            return s.pred.job_s <= self.deadline_s
        return s.dollars <= float(self.budget or 0)

    def objective(self, s: Scored) -> float:
        """Lower is better: dollars (deadline) or seconds (budget)."""
        return s.dollars if self.deadline_s is not None else s.pred.job_s

    def penalised(self, s: Scored) -> float:
        """The objective, or a large penalty growing with the violation (for the baselines)."""
        if self.feasible(s):
            return self.objective(s)
        if self.deadline_s is not None:
            return 1e9 * (1 + s.pred.job_s / self.deadline_s)
        return 1e9 * (1 + s.dollars / float(self.budget or 1))

    def why(self) -> str:
        if self.deadline_s is not None:
            return f"cheapest predicted to finish within the deadline ({self.deadline_s / 3600:.2f} h)"
        return f"fastest predicted to stay within the budget (${self.budget:.2f})"


@dataclass
class Planner:
    """Scores candidates of a space for one workload with one price book."""

    space: Space
    workload: Workload
    costs: ServerCosts
    prices: PriceBook
    simulate_top: bool = True
    _cache: dict[tuple[Candidate, str], Scored] = field(default_factory=dict)

    def config(self, c: Candidate) -> Config:
        hosts = tuple((replace(t, preempt_p=t.preempt_p if c.market == "spot" else 0.0), n)
                      for t, n in zip(self.space.types, c.counts, strict=True) if n)
        return Config(hosts, c.slots, c.assimilators, timeout_s=self.space.timeout_s, notice_s=self.space.notice_s)

    def hourly(self, c: Candidate, market: Market | None = None) -> float:
        m = market or c.market
        total = sum(n * self.prices.hourly(t.name, m) for t, n in zip(self.space.types, c.counts, strict=True))
        if self.space.server_type:
            total += self.prices.hourly(self.space.server_type, "on-demand")
        return total

    def score(self, c: Candidate, method: str = "closed-form") -> Scored:
        key = (c, method)
        if key not in self._cache:
            cfg = self.config(c)
            w = replace(self.workload, units_per_epoch=c.units_per_epoch)
            pred = closed_form(cfg, w, self.costs) if method == "closed-form" else simulate(cfg, w, self.costs)
            # On-demand: no reclaims, so it is also faster; the saving compares what the
            # same fleet would cost there for its own (predicted) time.
            od = pred if c.market == "on-demand" else self.score(replace(c, market="on-demand"), method).pred
            hourly = self.hourly(c)
            self._cache[key] = Scored(c, pred, hourly * pred.job_s / 3600,
                                      self.hourly(c, "on-demand") * od.job_s / 3600, hourly)
        return self._cache[key]

    def candidates(self) -> list[Candidate]:
        s = self.space
        out = []
        for counts in itertools.product(*[range(m + 1) for m in s.max_counts]):
            if not any(counts):
                continue
            for market, t, p, n in itertools.product(s.markets, s.slots, s.assimilators, s.units_per_epoch):
                out.append(Candidate(tuple(counts), market, t, p, n))
        return out


@dataclass
class SearchResult:
    """The best candidate a search found and how many it scored."""

    best: Scored | None
    evaluated: int
    method: str


def exact(planner: Planner, goal: Goal, refine: int = 20) -> tuple[SearchResult, list[Scored]]:
    """Score every candidate (closed form), re-score the ``refine`` best feasible-or-near
    ones with the simulation, and pick by the goal. Returns the result and all scores."""
    scored = [planner.score(c) for c in planner.candidates()]
    best = _refine(planner, goal, scored, refine)
    return SearchResult(best, len(scored), "exact"), scored


def _refine(planner: Planner, goal: Goal, scored: list[Scored], refine: int) -> Scored | None:
    if not planner.simulate_top:
        ok = [s for s in scored if goal.feasible(s)]
        return min(ok, key=goal.objective) if ok else None
    # The closed form is optimistic where queues form: simulate the best few by the
    # closed form, widening the feasibility margin so near-misses get their chance.
    relaxed = Goal(goal.deadline_s * 1.5 if goal.deadline_s else None, goal.budget * 1.5 if goal.budget else None)
    pool = sorted((s for s in scored if relaxed.feasible(s)), key=goal.objective)[:refine]
    sims = [planner.score(s.cand, "simulation") for s in pool]
    ok = [s for s in sims if goal.feasible(s)]
    return min(ok, key=goal.objective) if ok else None


def greedy(planner: Planner, goal: Goal) -> SearchResult:
    """HeterPS-style greedy: start from one host of the type with the best throughput per
    dollar, then take the single change (one host more or less of a type, T, P, unit
    size, market) that most lowers the penalised objective, until none does."""
    s = planner.space
    seen: set[Candidate] = set()

    def val(c: Candidate) -> float:
        seen.add(c)
        return goal.penalised(planner.score(c))

    def per_dollar(i: int) -> float:
        t = s.types[i]
        return 1.0 / (t.unit_s * planner.prices.hourly(t.name, s.markets[0]))

    start = max(range(len(s.types)), key=per_dollar)
    counts = tuple(1 if i == start else 0 for i in range(len(s.types)))
    cur = Candidate(counts, s.markets[0], s.slots[0], s.assimilators[0], s.units_per_epoch[0])
    cur_v = val(cur)
    while True:
        moves = list(_neighbours(s, cur))
        if not moves:
            break
        vals = [(val(m), m) for m in moves]
        v, m = min(vals, key=lambda x: x[0])
        if v >= cur_v:
            break
        cur, cur_v = m, v
    best = _refine(planner, goal, [planner.score(cur)], 1)
    return SearchResult(best, len(seen), "greedy")


def _neighbours(s: Space, c: Candidate) -> list[Candidate]:
    out = []
    for i in range(len(s.types)):
        for d in (-1, 1):
            n = c.counts[i] + d
            if 0 <= n <= s.max_counts[i]:
                counts = c.counts[:i] + (n,) + c.counts[i + 1:]
                if any(counts):
                    out.append(replace(c, counts=counts))
    for name, choices in (("slots", s.slots), ("assimilators", s.assimilators),
                          ("units_per_epoch", s.units_per_epoch), ("market", s.markets)):
        cur = getattr(c, name)
        k = choices.index(cur)
        for j in (k - 1, k + 1):
            if 0 <= j < len(choices):
                out.append(replace(c, **{name: choices[j]}))
    return out


def genetic(planner: Planner, goal: Goal, population: int = 24, generations: int = 30, seed: int = 0,
            mutation: float = 0.2) -> SearchResult:
    """A plain genetic algorithm (HeterPS's second baseline): tournament selection,
    uniform crossover, per-gene mutation, elitism of two."""
    s = planner.space
    rng = random.Random(seed)
    genes: list[Sequence] = [range(m + 1) for m in s.max_counts]
    genes += [s.markets, s.slots, s.assimilators, s.units_per_epoch]

    def decode(g: tuple) -> Candidate:
        k = len(s.types)
        counts = tuple(g[:k])
        if not any(counts):
            counts = tuple(1 if i == 0 else 0 for i in range(k))
        return Candidate(counts, g[k], g[k + 1], g[k + 2], g[k + 3])

    seen: set[Candidate] = set()

    def fit(g: tuple) -> float:
        seen.add(decode(g))
        return goal.penalised(planner.score(decode(g)))

    pop = [tuple(rng.choice(list(ch)) for ch in genes) for _ in range(population)]
    for _ in range(generations):
        ranked = sorted(pop, key=fit)
        nxt = ranked[:2]
        while len(nxt) < population:
            a = min(rng.sample(ranked, 3), key=fit)
            b = min(rng.sample(ranked, 3), key=fit)
            child = tuple(x if rng.random() < 0.5 else y for x, y in zip(a, b, strict=True))
            child = tuple(rng.choice(list(ch)) if rng.random() < mutation else x
                          for x, ch in zip(child, genes, strict=True))
            nxt.append(child)
        pop = nxt
    top = sorted({decode(g) for g in pop}, key=lambda c: goal.penalised(planner.score(c)))[:3]
    best = _refine(planner, goal, [planner.score(c) for c in top], 3)
    return SearchResult(best, len(seen), "genetic")


def regret(found: Scored | None, best: Scored | None, goal: Goal) -> float | None:
    """found's objective over the exact answer's, minus one (None: nothing feasible)."""
    if found is None or best is None:
        return None
    return goal.objective(found) / goal.objective(best) - 1


def pareto(points: list[Scored]) -> list[Scored]:
    """The time-versus-dollars Pareto front, fastest first."""
    front: list[Scored] = []
    for s in sorted(points, key=lambda s: (s.pred.job_s, s.dollars)):
        if not front or s.dollars < front[-1].dollars:
            front.append(s)
    return front


def describe(planner: Planner, c: Candidate) -> str:
    """``3 x g4dn.xlarge + 1 x c6i.xlarge spot, T=4, P=2, 16 units/epoch``."""
    parts = [f"{n} x {t.name}" for t, n in zip(planner.space.types, c.counts, strict=True) if n]
    return f"{' + '.join(parts)} {c.market}, T={c.slots}, P={c.assimilators}, {c.units_per_epoch} units/epoch"


