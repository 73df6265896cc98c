"""Exact MOP scheduling as a MILP (Cerebro, PVLDB 2020, section 5.1, eq. 2), solved by HiGHS.

Given unit times ``T[i, j]`` (config ``i`` on partition/worker ``j``, one partition per
worker, no replicas), find start times ``X[i, j]`` minimising the makespan ``C`` of one epoch
under model isolation and worker exclusivity. This is the open-shop problem (NP-hard): it is
only practical for small instances, which is what the benchmark uses it for -- measuring how
far the randomized scheduler is from the optimum.

The formulation, with ``V`` a big-M (the sum of all unit times, the paper's default)::

    min C
    (a) X[i,j]  >= X[i,j'] + T[i,j'] - V * Y[i,j,j']        for all i, j < j'
    (b) X[i,j'] >= X[i,j]  + T[i,j]  - V * (1 - Y[i,j,j'])  for all i, j < j'
    (c) X[i,j]  >= X[i',j] + T[i',j] - V * Z[i,i',j]        for all i < i', j
    (d) X[i',j] >= X[i,j]  + T[i,j]  - V * (1 - Z[i,i',j])  for all i < i', j
    (e) X >= 0
    (f) C >= X[i,j] + T[i,j]

The paper's text (as extracted) writes (a) with ``X[i',j']`` and ``T[i',j']``, i.e. with the
*other* model's unit: that constrains pairs of different models on different workers, which
is wrong -- model isolation is about two units of the *same* model ``i`` on two partitions
``j, j'``, as (b) and Table 3 (``Y in {0,1}^{|S| x p x p}``) show. We use ``i`` in (a).
Y[i,j,j'] = 1 iff unit (i,j) precedes (i,j'), Z[i,i',j] = 1 iff (i,j) precedes (i',j); only
``j < j'`` and ``i < i'`` are needed (the other orientation is the complement). We also add
the valid cuts ``C >= sum_j T[i,j]`` and ``C >= sum_i T[i,j]``, which do not change the
optimum but give the LP relaxation a useful bound.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import numpy as np


@dataclass
class MilpResult:
    """Outcome of :func:`solve_milp`.

    ``makespan`` is the best schedule found (``inf`` if none), ``bound`` the solver's proven
    lower bound; ``optimal`` is True when HiGHS proved optimality (within its default gap).
    """

    makespan: float
    bound: float
    optimal: bool
    status: str
    start: np.ndarray | None
    seconds: float


def schedule_makespan(T: np.ndarray, start: np.ndarray, tol: float = 1e-6) -> float:
    """Check a start-time matrix against the invariants and return its makespan."""
    T = np.asarray(T, dtype=float)
    S, p = T.shape
    end = start + T
    scale = tol * max(1.0, float(end.max()))
    if np.any(start < -scale):
        raise ValueError("negative start time")
    for i in range(S):
        o = np.argsort(start[i])
        if np.any(start[i, o[1:]] < end[i, o[:-1]] - scale):
            raise ValueError(f"model {i} runs two units at once")
    for j in range(p):
        o = np.argsort(start[:, j])
        if np.any(start[o[1:], j] < end[o[:-1], j] - scale):
            raise ValueError(f"worker {j} runs two units at once")
    return float(end.max())


def solve_milp(
    T: np.ndarray,
    time_limit: float = 60.0,
    threads: int = 1,
    warm_start: np.ndarray | None = None,
) -> MilpResult:
    """Solve eq. 2 for unit times ``T`` (|S| x p) with HiGHS; ``warm_start`` = start times.

    A warm start (e.g. the randomized scheduler's schedule, as suggested in chapter 4 of
    "Cerebro - An Efficient, End-to-End Platform for Scalable Deep Learning", MS thesis,
    UC San Diego 2023) gives HiGHS an incumbent from the outset.
    """
    import highspy  # optional dependency (the ``mop`` extra)

    T = np.asarray(T, dtype=float)
    S, p = T.shape
    V = float(T.sum())
    h = highspy.Highs()
    h.silent()
    h.setOptionValue("time_limit", float(time_limit))
    h.setOptionValue("threads", int(threads))
    h.setOptionValue("random_seed", 0)
    C = h.addVariable(lb=0.0, ub=V, name="C")
    X = [[h.addVariable(lb=0.0, ub=V, name=f"X_{i}_{j}") for j in range(p)] for i in range(S)]
    Y: dict[tuple[int, int, int], object] = {}
    Z: dict[tuple[int, int, int], object] = {}
    for i in range(S):
        for j, k in itertools.combinations(range(p), 2):
            y = Y[i, j, k] = h.addBinary(name=f"Y_{i}_{j}_{k}")
            h.addConstr(X[i][j] - X[i][k] + V * y >= float(T[i, k]))  # (a)
            h.addConstr(X[i][k] - X[i][j] - V * y >= float(T[i, j]) - V)  # (b)
    for j in range(p):
        for i, k in itertools.combinations(range(S), 2):
            z = Z[i, k, j] = h.addBinary(name=f"Z_{i}_{k}_{j}")
            h.addConstr(X[i][j] - X[k][j] + V * z >= float(T[k, j]))  # (c)
            h.addConstr(X[k][j] - X[i][j] - V * z >= float(T[i, j]) - V)  # (d)
    for i in range(S):
        for j in range(p):
            h.addConstr(C - X[i][j] >= float(T[i, j]))  # (f)
    for i in range(S):
        h.addConstr(C >= float(T[i].sum()))
    for j in range(p):
        h.addConstr(C >= float(T[:, j].sum()))
    if warm_start is not None:
        x0 = np.asarray(warm_start, dtype=float)
        sol = np.zeros(h.getNumCol())
        sol[C.index] = float((x0 + T).max())
        for i in range(S):
            for j in range(p):
                sol[X[i][j].index] = x0[i, j]
        for (i, j, k), y in Y.items():
            sol[y.index] = 1.0 if x0[i, j] < x0[i, k] else 0.0
        for (i, k, j), z in Z.items():
            sol[z.index] = 1.0 if x0[i, j] < x0[k, j] else 0.0
        hs = highspy.HighsSolution()
        hs.col_value = [float(v) for v in sol]
        hs.value_valid = True
        h.setSolution(hs)
    t0 = time.perf_counter()
    h.minimize(C)
    secs = time.perf_counter() - t0
    status = h.getModelStatus()
    info = h.getInfo()
    name = h.modelStatusToString(status)
    has_sol = info.primal_solution_status == 2  # kSolutionStatusFeasible
    start = None
    makespan = float("inf")
    if has_sol:
        vals = np.asarray(h.getSolution().col_value)
        start = np.array([[vals[X[i][j].index] for j in range(p)] for i in range(S)])
        makespan = schedule_makespan(T, start)
    return MilpResult(
        makespan=makespan,
        bound=float(info.mip_dual_bound),
        optimal=status == highspy.HighsModelStatus.kOptimal,
        status=name,
        start=start,
        seconds=secs,
    )


def exhaustive_makespan(T: np.ndarray) -> float:
    """Optimal makespan by enumerating every model order and worker order (tiny instances).

    Every schedule induces an order of each model's units and of each worker's units, and
    starting every unit as early as those orders allow never lengthens it; so the optimum is
    the minimum, over all acyclic order combinations, of the longest path through them.
    Cost: (p!)^|S| * (|S|!)^p combinations -- keep |S| * p <= 9.
    """
    T = np.asarray(T, dtype=float)
    S, p = T.shape
    if S * p > 9:
        raise ValueError("exhaustive search is only for |S| * p <= 9")
    model_orders = list(itertools.product(itertools.permutations(range(p)), repeat=S))
    worker_orders = list(itertools.product(itertools.permutations(range(S)), repeat=p))
    best = float("inf")
    n = S * p
    for mo in model_orders:
        mpred = [[-1] * p for _ in range(S)]
        for i, order in enumerate(mo):
            for a, b in zip(order, order[1:], strict=False):
                mpred[i][b] = a
        for wo in worker_orders:
            wpred = [[-1] * p for _ in range(S)]
            for j, order in enumerate(wo):
                for a, b in zip(order, order[1:], strict=False):
                    wpred[b][j] = a
            # Longest path by repeated relaxation; a cycle shows up as no fixpoint in n rounds.
            end = [[0.0] * p for _ in range(S)]
            for _ in range(n + 1):
                changed = False
                for i in range(S):
                    for j in range(p):
                        s = 0.0
                        if mpred[i][j] >= 0:
                            s = end[i][mpred[i][j]]
                        if wpred[i][j] >= 0:
                            s = max(s, end[wpred[i][j]][j])
                        e = s + T[i, j]
                        if e > end[i][j]:
                            end[i][j] = e
                            changed = True
                if not changed:
                    break
            else:
                continue  # cyclic orders: infeasible
            best = min(best, max(max(r) for r in end))
    return best
