"""Merge rules and merge defences for VC-ASGD: pure numpy, per shard, float32, in place.

Every rule is an elementwise update of one shard of the server weights, so it composes
with the sharded strict merge (``JobStore.merge`` calls ``combine(ws, slice)`` once per
shard and commits each shard with its "unit applied" mark). The inputs of one merge are

``ws``  the server shard (a writable float32 copy; updated in place and returned),
``wc``  the same parameters of the client's result,
``wb``  the same parameters of the unit's *base*: the server weights the unit started
        from (the weights file of version ``weights_version`` the generator wrote, the
        unit's ``weights_in``; read on the server, never taken from the result),
``s``   the staleness: server version at merge time minus the unit's base version,
        both from the server's own records (``unit_info(unit)["weights_version"]``, not
        the result file's ``base_version``, which the host writes),
``scale`` the clipping factor of the whole update, computed once per result from the
        whole model (:func:`clip_scale`) before any shard is touched,

and, for the rules that keep server state, that shard's :class:`ShardState`. The delta
a unit contributes is ``d = scale * (wc - wb)``: the client's own progress, which does
not grow with the number of units in flight (``wc - ws`` does: it also holds every
merge since the unit's base).

Rules (``1 - alpha`` is the paper's weight of the client copy, ``S(s)`` a staleness
weight, :class:`Staleness`):

``paper``     ``ws <- alpha*ws + (1-alpha)*wc``                  (eq. 1 of the VC-ASGD paper)
``fedasync``  ``ws <- ws + (1-alpha)*S(s)*(wc - ws)``            (Xie et al. 2019: mixing
              weight shrinking with staleness; polynomial or hinge ``S``)
``delta``     ``ws <- ws + lr*S(s)*d``                            (asynchronous SGD on deltas;
              ``lr = 1 - alpha``, ``S = 1`` is the naive delta merge)
``fedbuff``   ``buf += S(s)*d; n += 1``; when ``n == K``: ``ws <- ws + lr*buf/K``, ``buf = 0``
              (Nguyen et al. 2022: buffered aggregation with a server learning rate)
``momentum``  ``m <- mu*m + S(s)*d; ws <- ws + lr*m``            (server momentum; with
              ``buffer_k > 1`` the momentum step is taken at each flush of the buffer)

``max_weight`` caps ``S(s)`` (every rule but ``paper``): the job's default ``delta`` caps it
at ``CAP_SHARE/k`` with ``k`` units in flight (:meth:`MergeRule.capped`). In steady state a
result is about ``k - 1`` merges old and ``S = 1/k`` anyway; the cap matters when many
units start from one base (the first epoch; the second too when the first round ends
together): there ``S(0) + S(1) + ... + S(k-1)`` would add up to ``H(k)`` (2.7 at 8 in
flight) times one unit's step, and the shipped example's early epochs swung between 0.19
and 0.96 (docs/merge-rules.md). Capped at ``2/k``, such a round adds 1.6 steps at 8 in
flight.

Per-shard server state that must live in Redis beside each weights shard (same hash
tag, so it is in the shard's slot and in the same ``WATCH``/``MULTI``/``EXEC``):

============  =========================  ===================================================
rule          keys beside ``B:w``        update, committed with the shard and its mark
============  =========================  ===================================================
paper         none                       ``B:w``
fedasync      none                       ``B:w``
delta         none                       ``B:w``
fedbuff       ``B:buf`` (float32, shard  ``B:buf`` and field ``bn`` of ``B:m`` every merge;
              size), field ``bn``        ``B:w`` only when ``bn`` reaches K (``B:buf`` zeroed,
              (deltas in the buffer)     ``bn`` = 0, field ``steps`` += 1)
momentum      ``B:mom`` (float32, shard  ``B:mom`` and ``B:w`` every merge (every flush with
              size)                      ``buffer_k > 1``, which also keeps ``B:buf``/``bn``)
============  =========================  ===================================================

``B = bdl:J:s:{J/M/i}`` (:mod:`boinc_dl.server.assimilator.shards`). A shard's state is read
under the same ``WATCH`` as its bytes and written in the same ``MULTI`` as its bytes, its
new tag and its ``u:<unit>`` mark, so a re-run of the assimilator skips it with the rest
(exactly once) and a conflicting writer retries the state update too. Everything else a
merge needs is per result, not per shard: the staleness ``s`` and the clip ``scale``
are computed once before the first shard and written in the merge record, so a re-run
after a crash applies the shards left with the same numbers.

Defences (also pure): :func:`update_norm` and :func:`clip_scale` (clipping of the update
``wc - wb`` to a radius), :class:`TrustedStatistic` / :class:`TrustedRadius` (bounds
computed only from results that an independent host confirmed, frozen per epoch),
:func:`descent_cosine` / :class:`DescentCheck` / :func:`cosine_threshold` (Zeno++'s
first-order test against a gradient of a held-out server batch, written beside each
weights file by the work generator) and
:class:`HostReputation` (BOINC's adaptive replication: consecutive valid results per
host id). See ``docs/merge-rules.md``.
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, NamedTuple

import numpy as np

from boinc_dl.server.common.weights import read_weights

RuleName = Literal["paper", "fedasync", "delta", "fedbuff", "momentum"]
RULES: tuple[str, ...] = ("paper", "fedasync", "delta", "fedbuff", "momentum")
MIX_RULES = frozenset({"paper", "fedasync"})  # pull towards wc; no base needed without clipping

_F32 = np.float32
# Values per pass of the chunked reductions: 256 KB of float32, in cache. Each chunk's dot
# product runs in float32 (BLAS sdot), the sum over chunks in Python floats (float64):
# relative error ~1e-6, and 10x faster than converting to float64 (measured).
_CHUNK = 1 << 16


# ---- staleness ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Staleness:
    """A staleness weight ``S(s)`` in (0, 1], ``S(0) = 1`` (FedAsync's functions).

    ``const``: 1. ``poly``: ``(1 + s) ** -p``. ``hinge``: 1 up to ``s <= b``, then
    ``1 / (a * (s - b) + 1)``.
    """

    kind: Literal["const", "poly", "hinge"] = "const"
    p: float = 0.5
    a: float = 10.0
    b: float = 4.0

    def __post_init__(self) -> None:
        if self.kind not in ("const", "poly", "hinge"):
            raise ValueError(f"staleness kind {self.kind!r}: one of const, poly, hinge")
        if self.p < 0 or self.a < 0 or self.b < 0:
            raise ValueError("staleness parameters p, a, b must be >= 0")

    def weight(self, s: float) -> float:
        s = max(0.0, float(s))
        if self.kind == "poly":
            return (1.0 + s) ** -self.p
        if self.kind == "hinge":
            return 1.0 if s <= self.b else 1.0 / (self.a * (s - self.b) + 1.0)
        return 1.0


# ---- per-shard server state ---------------------------------------------------------------
@dataclass
class ShardState:
    """The server state one rule keeps beside one weights shard (see the module's table).

    ``buf``: FedBuff's sum of weighted deltas since the last flush (Redis ``B:buf``);
    ``count``: deltas in it (field ``bn`` of ``B:m``); ``mom``: the server momentum
    (``B:mom``); ``steps``: buffer flushes applied (field ``steps``; informational).
    """

    buf: np.ndarray | None = None
    count: int = 0
    mom: np.ndarray | None = None
    steps: int = 0

    def copy(self) -> ShardState:
        return ShardState(None if self.buf is None else self.buf.copy(), self.count,
                          None if self.mom is None else self.mom.copy(), self.steps)


# ---- rules ---------------------------------------------------------------------------------
#: A result of a rule that caps by the units in flight weighs at most ``CAP_SHARE / k``
#: with ``k`` in flight. 1 makes a round from one base apply the mean of its deltas (FedAvg's
#: step): steady, but on digits it cost the first epoch 5-25 points at 32 and 128 in flight
#: (tiny subsets, whose deltas the uncapped rule adds up to H(k) times); 2 kept the shipped
#: example's epochs from swinging and lost at most 1.4 points against the uncapped rule
#: in the simulated bench (docs/merge-rules.md, "The cap").
CAP_SHARE = 2.0


@dataclass(frozen=True)
class MergeRule:
    """One merge rule and its parameters (``spec.vcasgd`` would carry these).

    ``alpha``: the paper's ``a`` (weight of the server copy) for ``paper``/``fedasync``;
    ``server_lr``: the learning rate of the delta rules (``delta``/``fedbuff``/
    ``momentum``); ``buffer_k``: FedBuff's K; ``momentum``: the server momentum ``mu``.
    """

    name: str = "paper"
    alpha: float = 0.5
    staleness: Staleness = field(default_factory=Staleness)
    server_lr: float = 0.5
    buffer_k: int = 1
    momentum: float = 0.0
    #: the most ``S(s)`` may be (``capped(k)``: ``CAP_SHARE / k`` with ``k`` units in flight)
    max_weight: float = 1.0
    #: whether :meth:`capped` applies (the job's ``delta`` rule; the bench's ``-cap`` rules)
    cap_in_flight: bool = False

    def __post_init__(self) -> None:
        if self.name not in RULES:
            raise ValueError(f"merge rule {self.name!r}: one of {', '.join(RULES)}")
        if not 0.0 <= self.alpha < 1.0:
            raise ValueError("alpha must be in [0, 1)")
        if not (self.server_lr > 0 and math.isfinite(self.server_lr)):
            raise ValueError("server_lr must be a finite number > 0")
        if self.buffer_k < 1:
            raise ValueError("buffer_k must be >= 1")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError("momentum must be in [0, 1)")
        if not (0.0 < self.max_weight <= 1.0):
            raise ValueError("max_weight must be in (0, 1]")
        if self.name == "fedbuff" and self.momentum:
            raise ValueError("fedbuff with momentum is the rule 'momentum' with buffer_k > 1")

    # The state fields this rule keeps per shard: drives what the store reads and writes.
    @property
    def needs_buffer(self) -> bool:
        return self.name in ("fedbuff", "momentum") and self.buffer_k > 1

    @property
    def needs_momentum(self) -> bool:
        return self.name == "momentum" and self.momentum > 0.0

    @property
    def needs_base(self) -> bool:
        """Whether ``wb`` is read for an unclipped merge (clipping always needs it)."""
        return self.name not in MIX_RULES

    @property
    def stateful(self) -> bool:
        return self.needs_buffer or self.needs_momentum

    def weight(self, s: float) -> float:
        """The staleness weight this rule gives a result of staleness ``s``."""
        return min(self.max_weight, self.staleness.weight(s)) if self.name != "paper" else 1.0

    def capped(self, in_flight: int) -> MergeRule:
        """This rule for a result issued with ``in_flight`` units in flight: its weight at
        most ``CAP_SHARE / in_flight`` when the rule caps by the units in flight, else
        unchanged."""
        cap = CAP_SHARE / max(1, int(in_flight))
        if not self.cap_in_flight or cap >= 1.0:
            return self
        return replace(self, max_weight=cap)

    def new_state(self, n: int) -> ShardState:
        """The initial state of a shard of ``n`` values (zeros; empty for stateless rules)."""
        return ShardState(np.zeros(n, _F32) if self.needs_buffer else None, 0,
                          np.zeros(n, _F32) if self.needs_momentum else None, 0)

    def describe(self) -> str:
        st = self.staleness
        sw = {"const": "", "poly": f", poly p={st.p:g}", "hinge": f", hinge a={st.a:g} b={st.b:g}"}[st.kind]
        cap = f", cap {self.max_weight:.3g}" if self.max_weight < 1.0 else ""
        if self.name in MIX_RULES:
            return f"{self.name}(a={self.alpha:g}{sw}{cap})"
        extra = (f", K={self.buffer_k}" if self.buffer_k > 1 else "") + \
                (f", mu={self.momentum:g}" if self.momentum else "") + cap
        return f"{self.name}(lr={self.server_lr:g}{sw}{extra})"

    def apply(self, ws: np.ndarray, wc: np.ndarray, wb: np.ndarray | None, s: float,
              state: ShardState | None = None, scale: float = 1.0,
              scratch: np.ndarray | None = None) -> np.ndarray:
        """Merge one shard in place: ``ws`` updated and returned (``state`` updated too).

        ``wb`` may be None only for ``paper``/``fedasync`` with ``scale == 1``.
        ``scratch``: an optional float32 buffer of ``ws.size`` (else one is allocated):
        the only temporary, shard-sized.
        """
        _check_shard(ws, wc, wb)
        if self.stateful and state is None:
            raise ValueError(f"rule {self.name} keeps per-shard state: pass the shard's ShardState")
        scale = float(scale)
        if not (0.0 <= scale <= 1.0):
            raise ValueError(f"clip scale {scale} must be in [0, 1]")
        w = self.weight(s)
        if self.name in MIX_RULES:
            beta = (1.0 - self.alpha) * w
            if scale == 1.0:
                target = wc
            else:
                if wb is None:
                    raise ValueError("a clipped merge needs the base weights wb")
                target = _delta(wc, wb, scale, scratch)
                target += wb  # wb + scale*(wc - wb)
            return _mix(ws, target, 1.0 - beta)
        if wb is None:
            raise ValueError(f"rule {self.name} needs the base weights wb")
        d = _delta(wc, wb, scale * w, scratch)  # S(s) * scale * (wc - wb)
        if not self.needs_buffer:
            if self.needs_momentum:
                assert state is not None and state.mom is not None
                _momentum_step(ws, state.mom, d, self.momentum, self.server_lr)
                return ws
            d *= _F32(self.server_lr)
            ws += d
            return ws
        assert state is not None and state.buf is not None
        state.buf += d
        state.count += 1
        if state.count >= self.buffer_k:
            g = state.buf
            g *= _F32(1.0 / self.buffer_k)
            if self.needs_momentum:
                assert state.mom is not None
                _momentum_step(ws, state.mom, g, self.momentum, self.server_lr)
            else:
                g *= _F32(self.server_lr)
                ws += g
            g[:] = 0.0
            state.count = 0
            state.steps += 1
        return ws


# ---- the step search (``merge_rule: search``) ----------------------------------------------------
#: The candidate steps of a result are its ``delta`` weight times these (each at most 1: a
#: result never moves the server further than its own update). Chosen in the simulated
#: bench (docs/merge-rules.md, "The step search"): 1, 4, 16, 64 did as well as seven
#: multipliers from 1 to 64 (digits, 128 in flight: 0.947 both) at four forward passes.
SEARCH_MULTIPLIERS: tuple[float, ...] = (1.0, 4.0, 16.0, 64.0)
#: Step 0 is a candidate too: a result that raises the loss at its smallest step is merged
#: with step 0 (counted, the weights unchanged). Without it, a burst of results from one old
#: base (the first round of a job, whose units start together and end together) was each
#: applied at its smallest step although each raised the loss (docs/merge-rules.md).
SEARCH_ZERO = True
#: The most candidates a step request may carry (a bound on the checker's work per result).
MAX_SEARCH_STEPS = 8


def search_steps(weight: float, cohort: int = 1, in_flight: int | None = None,
                 multipliers: Sequence[float] = SEARCH_MULTIPLIERS, zero: bool = SEARCH_ZERO) -> list[float]:
    """The candidate steps of a result whose ``delta`` rule weight is ``weight``: 0 (with
    ``zero``), then ``weight`` times each multiplier, distinct, ascending, each at most 1
    and at most ``weight * max(1, in_flight / cohort)``: ``cohort`` the units the work
    generator issued from the result's base version, ``in_flight`` the window they were
    issued into (None: no bound but 1).

    A cohort as large as the window (the job's first round, a window refilled at once
    after a stall) starts together and, on hosts alike, ends together; a greedy choice
    gave its first two or three results whole steps, after which the rest, computed from
    the same old base, were of no use to the moved server (a real first round of 32
    units replayed: 0.49-0.67 on the validation set, against 0.68-0.71 for delta's capped
    mean; docs/merge-rules.md). Such a cohort gets delta's weight or 0. In steady state a
    version has a unit or two, ``weight`` is about ``1/in_flight``, and a result may take
    up to its whole update."""
    w = float(weight)
    if not (math.isfinite(w) and w > 0.0):
        raise ValueError(f"a result's weight must be a finite number > 0, not {weight!r}")
    top = 1.0 if in_flight is None else min(1.0, w * max(1.0, max(1, int(in_flight)) / max(1, int(cohort))))
    return ([0.0] if zero else []) + sorted({min(top, w * float(m)) for m in multipliers})


def search_step(steps: Sequence[float], loss_at: Callable[[float], float]) -> tuple[float, list[float | None]]:
    """The step of ``steps`` after which ``loss_at(step)`` is lowest, and the losses seen
    (None: not evaluated). The steps are tried smallest first and the search stops at the
    first one that does no better than the best so far (the loss along one update is taken
    to fall, then rise: most results stop after two forward passes). A non-finite loss
    never wins; with no finite one, the smallest step.

    ``loss_at``: the loss of the server's current weights after the step, on the server's
    own sample of the training data (:mod:`boinc_dl.server.work_generator.losscheck`)."""
    if not steps:
        raise ValueError("no candidate step")
    order = sorted(range(len(steps)), key=lambda i: steps[i])
    losses: list[float | None] = [None] * len(steps)
    best, best_loss = order[0], math.inf
    for i in order:
        loss = float(loss_at(float(steps[i])))
        losses[i] = loss
        if not (math.isfinite(loss) and loss < best_loss):
            if math.isfinite(best_loss):
                break
            continue
        best, best_loss = i, loss
    return float(steps[best]), losses


def stepped(step: float) -> tuple[MergeRule, float]:
    """The merge a searched step makes, as (rule, factor of the clip scale):
    ``ws <- ws + step * scale * (wc - wb)``, the ``delta`` rule with the step as its rate and
    no staleness weight of its own (the step already is the result's weight); a step of 0
    (rates are > 0) as the rate 1 on a scale of 0: the result is merged and moves nothing."""
    s = float(step)
    if not (math.isfinite(s) and 0.0 <= s <= 1.0):
        raise ValueError(f"a searched step must be in [0, 1], not {step!r}")
    return MergeRule("delta", staleness=Staleness("const"), server_lr=s or 1.0), (1.0 if s else 0.0)


def _check_shard(ws: np.ndarray, wc: np.ndarray, wb: np.ndarray | None) -> None:
    if ws.dtype != _F32 or wc.dtype != _F32 or (wb is not None and wb.dtype != _F32):
        raise TypeError("merge rules work on float32 buffers")
    if ws.shape != wc.shape or (wb is not None and wb.shape != ws.shape):
        raise ValueError(f"shard shapes differ: ws {ws.shape}, wc {wc.shape}, wb {None if wb is None else wb.shape}")
    if not ws.flags.writeable:
        raise ValueError("ws must be writable: the merge is computed in place")


def _delta(wc: np.ndarray, wb: np.ndarray, c: float, scratch: np.ndarray | None) -> np.ndarray:
    """``c * (wc - wb)`` into ``scratch`` (or a new shard-sized buffer)."""
    out = scratch if scratch is not None else np.empty_like(wc)
    if out.shape != wc.shape or out.dtype != _F32:
        raise ValueError("scratch must be a float32 buffer of the shard's size")
    np.subtract(wc, wb, out=out)
    if c != 1.0:
        out *= _F32(c)
    return out


def _mix(ws: np.ndarray, target: np.ndarray, keep: float) -> np.ndarray:
    """``keep*ws + (1-keep)*target`` in place, as ``merge_into`` computes it (so ``paper``
    gives the same bits as the assimilator's merge): ``keep*(ws - target) + target``."""
    if keep == 0.0:
        ws[:] = target
        return ws
    ws -= target
    ws *= _F32(keep)
    ws += target
    return ws


def _momentum_step(ws: np.ndarray, mom: np.ndarray, g: np.ndarray, mu: float, lr: float) -> None:
    """``mom <- mu*mom + g; ws <- ws + lr*mom`` in place (``g`` is left scaled: scratch)."""
    mom *= _F32(mu)
    mom += g
    np.multiply(mom, _F32(lr), out=g)
    ws += g


def apply_model(rule: MergeRule, ws: np.ndarray, wc: np.ndarray, wb: np.ndarray | None, s: float,
                bounds: Sequence[slice], states: Sequence[ShardState] | None = None,
                scale: float = 1.0) -> np.ndarray:
    """Apply ``rule`` to a whole flat model shard by shard (``bounds``: the layout's
    slices), as the sharded merge does; returns ``ws`` (updated in place)."""
    for i, sl in enumerate(bounds):
        part = ws[sl]
        st = states[i] if states is not None else None
        out = rule.apply(part, wc[sl], None if wb is None else wb[sl], s, st, scale)
        if out is not part:
            part[:] = out
    return ws


def preset(name: str, alpha: float = 0.5) -> MergeRule:
    """The rules compared in ``bench/bench_merge_rules.py`` under their bench names."""
    presets: dict[str, MergeRule] = {
        "paper": MergeRule("paper", alpha),
        "delta": MergeRule("delta", alpha, server_lr=1.0 - alpha),
        "fedasync-poly": MergeRule("fedasync", alpha, Staleness("poly", p=0.5)),
        "fedasync-hinge": MergeRule("fedasync", alpha, Staleness("hinge", a=10.0, b=4.0)),
        "delta-poly1": MergeRule("delta", alpha, Staleness("poly", p=1.0), server_lr=1.0 - alpha),
    }
    if name not in presets:
        raise KeyError(f"no preset rule {name!r}: {', '.join(presets)}")
    return presets[name]


# ---- clipping -------------------------------------------------------------------------------
def update_norm(wc: np.ndarray, wb: np.ndarray) -> float:
    """``||wc - wb||_2``, in cache-sized chunks (no model-sized temporary); inf if not finite."""
    if wc.shape != wb.shape:
        raise ValueError(f"shapes differ: {wc.shape} vs {wb.shape}")
    total = 0.0
    buf = np.empty(min(_CHUNK, wc.size), _F32)
    with np.errstate(over="ignore", invalid="ignore"):
        for i in range(0, wc.size, _CHUNK):
            d = buf[: min(_CHUNK, wc.size - i)]
            np.subtract(wc[i:i + _CHUNK], wb[i:i + _CHUNK], out=d)
            part = float(np.dot(d, d))
            if not math.isfinite(part):  # float32 overflow in the chunk: redo it in float64
                d64 = wc[i:i + _CHUNK].astype(np.float64) - wb[i:i + _CHUNK]
                part = float(np.dot(d64, d64))
            total += part
    return math.sqrt(total) if math.isfinite(total) else math.inf


def clip_scale(norm: float, radius: float | None) -> float:
    """The factor in [0, 1] that brings an update of L2 ``norm`` within ``radius``
    (1 with no radius; 0 for a non-finite norm: such a result is refused upstream)."""
    if not math.isfinite(norm):
        return 0.0
    if radius is None or norm <= radius:
        return 1.0
    return max(0.0, float(radius) / norm)


def centred_clip(delta: np.ndarray, ref: np.ndarray, radius: float) -> np.ndarray:
    """Centred clipping (Karimireddy et al. 2021), one step: ``ref + clip(delta - ref)``,
    in place in ``delta``. With ``ref`` = 0 it is plain clipping of the update."""
    diff = delta - ref
    n = float(np.linalg.norm(diff.astype(np.float64)))
    delta[:] = ref + diff * _F32(clip_scale(n, radius))
    return delta


# ---- statistics that an attacker cannot feed ---------------------------------------------------
def median_spread(values: Sequence[float]) -> tuple[float, float]:
    """The median of ``values`` and their robust spread, 1.4826 x the median absolute
    deviation (the standard deviation, for normal values)."""
    a = np.asarray(values, np.float64)
    med = float(np.median(a))
    return med, 1.4826 * float(np.median(np.abs(a - med)))


@dataclass
class TrustedStatistic:
    """A bound computed from trusted observations only, frozen per epoch.

    *Trusted* means that an independent host confirmed the result: the result passed
    replication (its replica from another host, of another user, agreed: BOINC's quorum)
    — not "its host has a good reputation" (a patient attacker earns that) and not "it
    was accepted" (the attacker's own accepted results would feed the statistic, as the
    adaptive bound of ``tests/support/baselines.py (0.2's bound)`` does). :meth:`observe` ignores every
    other result.

    *Frozen per epoch*: :meth:`value` for epoch ``e`` is computed once, from the trusted
    observations of epochs before ``e`` (the last ``window`` of them), and never changes
    during ``e``. Until ``min_samples`` of them exist, it is computed from those of epoch
    ``e`` itself as soon as there are ``min_samples`` (then frozen), and is ``fallback``
    before that. ``freeze=False`` follows the latest ``window`` trusted values instead
    (still only trusted ones: freezing is not what keeps an attacker out, trust is; it
    only makes the bound of an epoch reproducible).

    The bound: ``kind="quantile"``: ``factor * quantile(values, q) + offset``;
    ``kind="mad"``: ``median + k * 1.4826 * MAD + offset`` (a robust upper tail).

    Redis state per model and statistic (``to_dict``/``from_dict``): the trusted values
    with their epochs (a list, LPUSH + LTRIM to ``window``, written by whoever saw the
    quorum: the validator) and the frozen value per epoch (a hash field set with
    HSETNX: the first assimilator of an epoch freezes it, every other one reads it).
    """

    kind: Literal["quantile", "mad"] = "quantile"
    factor: float = 1.0
    quantile: float = 0.5
    k: float = 3.0
    offset: float = 0.0
    min_samples: int = 8
    window: int = 256
    fallback: float | None = None
    freeze: bool = True
    values: list[tuple[int, float]] = field(default_factory=list)  # (epoch, value), oldest first
    frozen: dict[int, float] = field(default_factory=dict)

    def observe(self, value: float, trusted: bool, epoch: int) -> bool:
        """Record a result's statistic; True if it counted (trusted and finite)."""
        if not trusted or not math.isfinite(value):
            return False
        self.values.append((int(epoch), float(value)))
        if len(self.values) > self.window:
            del self.values[: len(self.values) - self.window]
        return True

    def _estimate(self, values: list[float]) -> float:
        if self.kind == "mad":
            med, spread = median_spread(values)
            return med + self.k * spread + self.offset
        return self.factor * float(np.quantile(np.asarray(values, np.float64), self.quantile)) + self.offset

    def value(self, epoch: int) -> float | None:
        """The bound in force in ``epoch`` (frozen at its first computation; with
        ``freeze=False``, from the latest trusted values, current epoch included)."""
        if not self.freeze:
            vals = [v for e, v in self.values if e <= epoch]
            return self._estimate(vals) if len(vals) >= self.min_samples else self.fallback
        if epoch in self.frozen:
            return self.frozen[epoch]
        before = [v for e, v in self.values if e < epoch]
        if len(before) < self.min_samples:
            before += [v for e, v in self.values if e == epoch]
            if len(before) < self.min_samples:
                return self.fallback
        r = self._estimate(before)
        self.frozen[epoch] = r
        return r

    def to_dict(self) -> dict[str, Any]:
        return {"values": self.values, "frozen": {str(k): v for k, v in self.frozen.items()}}

    @classmethod
    def from_dict(cls, d: dict[str, Any], **params: Any) -> TrustedStatistic:
        tr = cls(**params)
        tr.values = [(int(e), float(n)) for e, n in d.get("values", [])]
        tr.frozen = {int(k): float(v) for k, v in d.get("frozen", {}).items()}
        return tr


@dataclass
class TrustedRadius(TrustedStatistic):
    """The clip radius of the update ``wc - wb``: ``factor`` (2) times the median of the
    trusted update norms (see :class:`TrustedStatistic`)."""

    factor: float = 2.0
    quantile: float = 0.5

    def observe(self, value: float, trusted: bool, epoch: int) -> bool:
        return value >= 0 and super().observe(value, trusted, epoch)

    def radius(self, epoch: int) -> float | None:
        return self.value(epoch)


def cosine_threshold(k: float = 4.0, offset: float = 0.1, fallback: float | None = 0.3,
                     min_samples: int = 16, window: int = 32) -> TrustedStatistic:
    """The descent check's bound on the cosine of an update with the held-out gradient:
    the upper tail (median + ``k`` scaled MADs + ``offset``) of the cosines of trusted
    (replicated) results. The honest distribution moves with the subset size and the
    phase of training (tiny subsets and a converged model give honest updates that do
    not descend a held-out batch), so a fixed threshold either refuses honest results or
    lets attacks through; a trusted one follows it. It follows the latest ``window``
    trusted cosines (not frozen per epoch): the honest cosines rise as the model
    converges, and a bound frozen from the previous epoch refused 1.3-2.2% of honest
    results in the bench's sequential runs (0.9% live; see docs/merge-rules.md)."""
    return TrustedStatistic(kind="mad", k=k, offset=offset, fallback=fallback, min_samples=min_samples,
                            window=window, freeze=False)


# ---- descent check (Zeno++, first order) -----------------------------------------------------------
def _cosine(dot: float, gg: float, dd: float) -> float:
    if not (math.isfinite(dot) and math.isfinite(dd)):
        return math.inf
    if dd == 0.0:
        return 0.0  # no update: nothing to refuse on direction
    if gg == 0.0 or not math.isfinite(gg):
        return math.inf
    return dot / math.sqrt(gg * dd)


def descent_cosine(grad: np.ndarray, delta: np.ndarray) -> float:
    """``<g, d> / (|g| |d|)``: the cosine between the gradient ``g`` of the server's
    held-out loss at the unit's base and the update ``d = wc - wb``. Negative: the update
    descends the held-out loss (to first order). +inf when not finite."""
    if grad.shape != delta.shape:
        raise ValueError(f"shapes differ: {grad.shape} vs {delta.shape}")
    dot = gg = dd = 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        for i in range(0, grad.size, _CHUNK):
            g, d = grad[i:i + _CHUNK], delta[i:i + _CHUNK]
            dot += float(np.dot(g, d))
            gg += float(np.dot(g, g))
            dd += float(np.dot(d, d))
    return _cosine(dot, gg, dd)


def descent_cosine_parts(grad: np.ndarray, wc: np.ndarray, wb: np.ndarray) -> float:
    """:func:`descent_cosine` of ``wc - wb`` without a model-sized temporary."""
    if not (grad.shape == wc.shape == wb.shape):
        raise ValueError("grad, wc and wb must have one shape")
    dot = gg = dd = 0.0
    buf = np.empty(min(_CHUNK, wc.size), _F32)
    with np.errstate(over="ignore", invalid="ignore"):
        for i in range(0, grad.size, _CHUNK):
            d = buf[: min(_CHUNK, wc.size - i)]
            np.subtract(wc[i:i + _CHUNK], wb[i:i + _CHUNK], out=d)
            g = grad[i:i + _CHUNK]
            dot += float(np.dot(g, d))
            gg += float(np.dot(g, g))
            dd += float(np.dot(d, d))
    return _cosine(dot, gg, dd)


def zeno_score(loss_before: float, loss_after: float, delta_sq_norm: float, rho: float) -> float:
    """Zeno++'s zeroth-order score of an update: ``L(wb) - L(wb + d) - rho*|d|^2`` on the
    server's held-out batch (accept when >= ``-eps``). Needs a forward pass of the model
    on the result (TensorFlow); :class:`DescentCheck` uses the first-order test instead."""
    return float(loss_before) - float(loss_after) - float(rho) * float(delta_sq_norm)


#: Trusted loss changes are comparable with a result's when measured from a base whose
#: held-out loss was at most this many times the result's base loss. A change measured on a
#: much worse model (the first epoch's large improvements) says nothing of what an honest
#: result from a converged model does: where a project replicates little or nothing, the
#: trusted changes are from such models, and a bound or reference centred on their
#: improvements refuses honest results (an update that no longer lowers the loss, or raises
#: it by noise). Without enough comparable ones, the loss check and the ledger fall back
#: to the latest trusted changes with their centre taken no lower than 0 (see
#: :func:`loss_increase_bound`, :class:`LossLedger`). A model made worse (by an attack) only
#: admits more of them: stricter, never a way out.
BASE_RATIO = 2.0

#: The per-result bound's :data:`BASE_RATIO`, tighter than the ledger's. The bound is
#: centred on the comparable changes' plain median, so a reference from somewhat worse
#: models (their improvements larger than a result from today's base can make) puts a
#: negative centre under it and refuses honest results that raise the loss by noise. The
#: ledger follows the changes' trend in their bases' loss, which corrects for that within
#: its range. Measured where it mattered most: with nothing replicated but the work
#: generator's spot checks, all 16 bootstrap changes came from the first base and stayed
#: "comparable" (within 2x) until epoch 8 of 10, and the bound refused 2.6% of honest
#: results (bench/README.md, "The per-result bound's own ratio").
BOUND_BASE_RATIO = 1.5


def comparable_base(entry_base_loss: float | None, base_loss: float | None, ratio: float = BASE_RATIO) -> bool:
    """Whether a trusted loss change measured from a base of held-out loss
    ``entry_base_loss`` may judge a result whose base has loss ``base_loss`` (see
    :data:`BASE_RATIO`; a missing or non-finite loss on either side: never)."""
    if entry_base_loss is None or base_loss is None:
        return False
    if not (math.isfinite(entry_base_loss) and math.isfinite(base_loss)):
        return False
    return float(entry_base_loss) <= ratio * max(float(base_loss), 0.0) + 1e-12


def comparable_values(trusted: Sequence[tuple[int, float, float | None]], epoch: int, base_loss: float | None,
                      ratio: float = BASE_RATIO) -> list[tuple[int, float]]:
    """Of ``trusted`` ((epoch, loss change, its base's held-out loss), oldest first), the
    (epoch, change) pairs up to ``epoch`` that may judge a result from a base of loss
    ``base_loss`` (:func:`comparable_base`)."""
    return [(e, v) for e, v, bl in trusted if e <= epoch and comparable_base(bl, base_loss, ratio)]


def loss_increase_threshold(k: float = 6.0, offset: float = 0.0, fallback: float | None = None,
                            min_samples: int = 16, window: int = 32) -> TrustedStatistic:
    """Zeno++'s zeroth-order check, made scale-free by trusted statistics: the bound on
    ``L(wb + d) - L(wb)`` on the held-out batch is the upper tail of that change over
    confirmed results (median + ``k`` scaled MADs of the latest ``window``)."""
    return TrustedStatistic(kind="mad", k=k, offset=offset, fallback=fallback, min_samples=min_samples,
                            window=window, freeze=False)


def loss_increase_bound(trusted: Sequence[tuple[int, float, float | None]], epoch: int, base_loss: float | None,
                        k: float = 6.0, min_samples: int = 16,
                        ratio: float = BOUND_BASE_RATIO) -> tuple[float | None, bool]:
    """The bound on the held-out loss increase of a result of ``epoch`` whose base has loss
    ``base_loss``, from ``trusted`` ((epoch, change, its base's loss), oldest first), and
    whether it was made of comparable changes.

    With ``min_samples`` comparable changes (:func:`comparable_values`): their median +
    ``k`` scaled MADs (Zeno++'s test made scale-free). Otherwise, from every trusted change
    up to ``epoch``, with the median taken no lower than 0: those changes come from worse
    models, whose improvements an honest result of this one cannot match, so only their
    spread is used (a rise beyond ``k`` of their spreads is refused). Fewer than
    ``min_samples`` trusted changes at all: None (no bound)."""
    fresh = [v for _, v in comparable_values(trusted, epoch, base_loss, ratio)]
    if len(fresh) >= min_samples:
        med, spread = median_spread(fresh)
        return med + k * spread, True
    older = [v for e, v, _ in trusted if e <= epoch]
    if len(older) >= min_samples:
        med, spread = median_spread(older)
        return max(med, 0.0) + k * spread, False
    return None, False


def loss_check_passes(loss_increase: float, bound: float | None) -> bool:
    """Whether an update passes the zeroth-order check: a held-out loss that does not
    rise always passes; a rise passes when within ``bound`` (None: no bound yet)."""
    if not math.isfinite(loss_increase):
        return False
    return bound is None or loss_increase <= max(0.0, bound)


class LedgerReference(NamedTuple):
    """What :meth:`LossLedger.reference` picked: the trusted loss changes, whether they
    are comparable with the result's base, and their bases' held-out losses."""

    values: list[float]
    comparable: bool
    bases: list[float | None]


@dataclass(frozen=True)
class LossLedger:
    """A host's running account of its untrusted results' held-out loss changes: the
    per-result check bounds each result, the ledger bounds their sum.

    Each result's loss change ``x`` is scored against the latest ``window`` trusted loss
    changes measured from a base about as good as the result's (never the host's own, nor
    its peers'),
    ``z = (x - median) / max(1.4826 * MAD, rel_floor * |median|)``, and the host's balance
    is a one-sided CUSUM (Page's test)::

        S <- max(0, S + z - slack);   refuse the result when S > limit   (S is then kept at limit)

    Honest results score around 0 (they are drawn like the trusted ones), so the balance
    drifts down by ``slack`` per result and stays near 0: with normal scores the test
    raises a false alarm about once in a thousand results. A patient host whose every
    result sits inside the per-result bound but above the honest median (a little is
    enough, many small nudges) gains ``z - slack`` per result and is refused within
    ``limit / (z - slack)`` results; once refused, its balance stays at the limit, so only
    results no worse than ``slack`` above the honest median pass until its honest-looking
    work has paid the balance down. The damage a host can do through its untrusted results is
    thereby held to ``slack`` units per result above what an honest result does,
    plus ``limit`` once: a budget no number of results wears down (docs/merge-rules.md,
    "The host's ledger")."""

    slack: float = 0.5
    limit: float = 6.0
    #: The reference: the latest ``window`` trusted loss changes (honest changes drift
    #: towards 0 as the model converges: an older reference scores honest results high).
    window: int = 8
    #: The scale's floor, as a share of the reference median's size: honest results that
    #: happen to agree closely must not turn a small drift into a large score.
    rel_floor: float = 0.5
    #: Which trusted changes may score a result (:func:`comparable_base`).
    base_ratio: float = BASE_RATIO
    #: The most one result adds to its host's balance (``z_cap - slack``): an honest
    #: result's loss change has a long upper tail once the model has converged (a unit
    #: trained on a small subset overfits it; 16-24% of honest results scored 2 or more
    #: late in 30-epoch digits runs), and those results alone took honest hosts past the
    #: limit; a patient host above the honest trend is charged on every result.
    z_cap: float = 1.5

    def reference(self, trusted: Sequence[tuple[int, float, float | None]], epoch: int,
                  base_loss: float | None) -> LedgerReference:
        """The trusted loss changes a result of ``epoch`` from a base of held-out loss
        ``base_loss`` is scored against, whether they are comparable, and their bases'
        losses: of ``trusted`` ((epoch, change, its base's loss), oldest first), the latest
        ``window`` up to ``epoch`` measured from a base about as good as the result's
        (:func:`comparable_base`); too few of them: the latest ``window`` up to ``epoch``
        (not comparable: :meth:`score` then charges only a loss that rises); fewer than
        ``window`` at all: none (the ledger waits)."""
        fresh = [(v, bl) for e, v, bl in trusted
                 if e <= epoch and comparable_base(bl, base_loss, self.base_ratio)][-self.window:]
        if len(fresh) >= self.window:
            return LedgerReference([v for v, _ in fresh], True, [bl for _, bl in fresh])
        older = [(v, bl) for e, v, bl in trusted if e <= epoch][-self.window:]
        if len(older) < self.window:
            return LedgerReference([], False, [])
        return LedgerReference([v for v, _ in older], False, [bl for _, bl in older])

    def centre_scale(self, reference: Sequence[float] | LedgerReference, comparable: bool = True,
                     base_loss: float | None = None) -> tuple[float, float]:
        """What an honest result's loss change is expected to be, and its spread (1.4826
        MAD, at least ``rel_floor`` of the reference median's size).

        For a comparable :class:`LedgerReference` and the result's ``base_loss``: the
        changes' linear trend in their bases' loss, taken at ``base_loss`` (kept within
        the changes' range), with the spread of the changes around the trend. The
        trusted changes were all measured from bases older than the result's (about as
        good, up to ``base_ratio`` times worse): their plain median lags the model, and
        scored honest results 0.3-1 spreads high on average, all through a 30-epoch run
        (the bench's honest runs, docs/merge-rules.md). Otherwise the median; for a
        reference not ``comparable`` (from worse models: their improvements say nothing of
        what this one allows) no lower than 0, so a result is charged only for raising the
        loss."""
        bases: Sequence[float | None] = ()
        if isinstance(reference, LedgerReference):
            comparable, bases, reference = reference.comparable, reference.bases, reference.values
        # numpy's floating-point warnings stay here: values near the float range (a diverged
        # model's loss) give an infinite or undefined trend, and the median is used instead
        with np.errstate(all="ignore"):
            med, spread = median_spread(reference)
            floor = max(self.rel_floor * abs(med), 1e-9)
            if not comparable:
                return max(med, 0.0), max(spread, floor)
            if base_loss is not None and math.isfinite(base_loss) and len(bases) == len(reference) \
                    and all(b is not None and math.isfinite(b) for b in bases):
                b = np.asarray(bases, np.float64)
                y = np.asarray(reference, np.float64)
                db = b - b.mean()
                var = float(db @ db)
                if var > 0:  # least squares: y = icpt + slope * b
                    slope = float(db @ (y - y.mean())) / var
                    icpt = float(y.mean()) - slope * float(b.mean())
                    centre = float(np.clip(icpt + slope * float(base_loss), y.min(), y.max()))
                    _, rs = median_spread(y - (icpt + slope * b))
                    if math.isfinite(centre) and math.isfinite(rs):
                        return centre, max(rs, floor)
            return med, max(spread, floor)

    def score(self, loss_increase: float, reference: Sequence[float] | LedgerReference, comparable: bool = True,
              base_loss: float | None = None) -> float | None:
        """``loss_increase`` above what an honest result's is expected to be, in units of
        its spread (:meth:`centre_scale`), at most ``z_cap``; None: an empty reference;
        +inf for a non-finite change (always refused)."""
        values = reference.values if isinstance(reference, LedgerReference) else reference
        if not len(values):
            return None
        if not math.isfinite(loss_increase):
            return math.inf
        centre, scale = self.centre_scale(reference, comparable, base_loss)
        z = (float(loss_increase) - centre) / scale
        # a score that is not a number (a reference of values near the float range) is no
        # evidence for the host: it counts as the worst
        return math.inf if math.isnan(z) else min(z, self.z_cap)

    def step(self, balance: float, z: float) -> tuple[float, bool]:
        """(the host's balance after a result scored ``z``, whether the result passes)."""
        b = balance if math.isfinite(balance) and balance > 0 else 0.0
        new = b + z - self.slack
        if math.isnan(new) or new > self.limit:  # (max(0, nan) would read as a paid-down balance)
            return self.limit, False
        return max(0.0, new), True


@dataclass(frozen=True)
class DescentCheck:
    """Accept an update when its :func:`descent_cosine` is at most ``max_cosine`` (a
    fixed bound; :func:`cosine_threshold` gives a trusted per-epoch one to pass to
    :meth:`passes` instead).
    """

    max_cosine: float = 0.05

    def passes(self, cosine: float, max_cosine: float | None = None) -> bool:
        """Whether an update passes: a descent direction (cosine <= 0) always does; an
        ascent one when its cosine is within the bound."""
        bound = self.max_cosine if max_cosine is None else max_cosine
        return math.isfinite(cosine) and cosine <= max(0.0, bound)


# ---- host reputation (BOINC's adaptive replication) ------------------------------------------------
@dataclass
class HostReputation:
    """Which results to replicate, from each host id's run of valid results.

    BOINC's rule (``sched/sched_send.cpp`` ``set_trust``, ``sched/validator.cpp``
    ``is_valid`` and ``is_invalid``): a host app version with ``consecutive_valid < threshold`` (BOINC's
    ``CONS_VALID_UNREPLICATED``, 10) gets replicated jobs; at or above it, a job is sent
    unreplicated with probability ``1 - 1/consecutive_valid`` (spot checks never stop).
    ``consecutive_valid`` grows only with results that *were replicated* and validated
    (an unreplicated result proves nothing); an invalid result (replica disagreed, a
    failed descent check) or a timed-out one resets it to 0, and so does a result the
    assimilator refuses for the host's work (the held-out loss check, the hard update
    cap): on BOINC, :mod:`boinc_dl.server.backends.boinc.hosttrust` writes that reset
    into BOINC's ``host_app_version`` row, since BOINC's validator had called the result
    valid.

    Redis state: one hash per job, host id -> consecutive valid count (HINCRBY on a
    confirmed result, HSET 0 on an invalid one). The host id is BOINC's (the scheduler's
    ``hostid`` of the result), never a string from the result file.
    """

    threshold: int = 10
    counts: dict[str, int] = field(default_factory=dict)

    def consecutive_valid(self, host: str) -> int:
        return self.counts.get(str(host), 0)

    def trusted(self, host: str) -> bool:
        """At or past the threshold: eligible for unreplicated jobs."""
        return self.consecutive_valid(host) >= self.threshold

    def needs_replication(self, host: str, rng: random.Random | None = None) -> bool:
        """Whether a unit sent to ``host`` is replicated (drawn like BOINC's ``set_trust``)."""
        n = self.consecutive_valid(host)
        if n < self.threshold:
            return True
        return (rng or random).random() <= 1.0 / n

    def record(self, host: str, valid: bool, replicated: bool) -> int:
        """Update ``host``'s count after one of its results was judged; returns it."""
        h = str(host)
        if not valid:
            self.counts[h] = 0
        elif replicated:
            self.counts[h] = self.counts.get(h, 0) + 1
        return self.counts.get(h, 0)

    def record_timeout(self, host: str) -> None:
        self.counts[str(host)] = 0


def trusted_observation(replicated: bool, replicas_agree: bool) -> bool:
    """Whether a result's statistics may feed :class:`TrustedRadius`: only one confirmed
    by a replica from another host. A trusted host's unreplicated result does not count."""
    return bool(replicated and replicas_agree)


def iter_bounds(n: int, shards: int) -> Iterable[slice]:
    """The slices of ``ShardLayout(n, shards)`` (for tests and the bench, no Redis)."""
    for i in range(shards):
        yield slice(n * i // shards, n * (i + 1) // shards)


# ---- replayable rules (the merge log) ----------------------------------------------------------
# A durable merge (docs/parameter-server.md, "Durability") logs what it did, not the bytes
# it wrote: after a Redis crash the weights are rebuilt by replaying the merges from a
# snapshot. A replay rebuilds the same bytes only if the merge of a shard is a pure
# function of (the shard's float32 values, the same slice of the result's weights, the
# rule's parameters, the shard's slice), computed with the same float ops in the same
# order. So the function a merge applies is registered here under a name, the merge
# record names it (``record["rule"]``) with its parameters (``record["rule_params"]``, a
# JSON object), and the live merge and the replay call the same function. A rule may
# read nothing else but files the parameters name that the server keeps (the unit's base
# weights): no clock, no random draw, no other key.

#: ``rule(ws, wc, params, sl)``: the new value of shard ``sl`` of the model, in place in
#: ``ws`` (a writable float32 copy of the shard), from ``wc`` (the same slice of the result).
ReplayableRule = Callable[[np.ndarray, np.ndarray, Mapping[str, Any], slice], np.ndarray]

_REGISTRY: dict[str, ReplayableRule] = {}


def register(name: str) -> Callable[[ReplayableRule], ReplayableRule]:
    """Decorator: make ``fn`` the replayable rule ``name`` (one definition per name)."""
    def deco(fn: ReplayableRule) -> ReplayableRule:
        if _REGISTRY.get(name, fn) is not fn:
            raise ValueError(f"merge rule {name!r} is already registered")
        _REGISTRY[name] = fn
        return fn
    return deco


def get(name: str) -> ReplayableRule | None:
    """The replayable rule registered as ``name`` (None when there is none)."""
    return _REGISTRY.get(name)


def apply(name: str, ws: np.ndarray, wc: np.ndarray, params: Mapping[str, Any], sl: slice) -> np.ndarray:
    """Run replayable rule ``name`` on shard ``sl`` (``KeyError`` for an unknown rule)."""
    rule = _REGISTRY.get(name)
    if rule is None:
        raise KeyError(f"no merge rule named {name!r} is registered")
    return rule(ws, wc, params, sl)


@register("alpha")
def alpha_rule(ws: np.ndarray, wc: np.ndarray, params: Mapping[str, Any], sl: slice) -> np.ndarray:
    """The papers' merge ``W_s <- a*W_s + (1-a)*W_c`` (logs written before the merge
    policy named its rule with ``merge``)."""
    return _mix(ws, wc, float(params["alpha"]))


#: The rule every merge of the merge policy logs: a :class:`MergeRule` with its staleness,
#: clip scale and the unit's base weights file.
PLANNED = "merge"
#: Base weights files a process merged or replayed from lately, by (path, mtime, size): a
#: file rewritten under the same name (a version Redis lost, written again) is read anew.
_BASES: dict[tuple[str, int, int], np.ndarray] = {}
_BASES_KEPT = 4


def _stamp(path: str) -> tuple[str, int, int]:
    st = os.stat(path)
    return path, st.st_mtime_ns, st.st_size


def remember_base(path: str, flat: np.ndarray) -> None:
    """Keep ``flat`` as the content of base weights file ``path`` (a live merge just read it)."""
    key = _stamp(path)
    _BASES.pop(key, None)
    _BASES[key] = flat
    while len(_BASES) > _BASES_KEPT:
        _BASES.pop(next(iter(_BASES)))


def _base_for_replay(path: str) -> np.ndarray:
    """A base weights file by path (the server's own file; cached)."""
    flat = _BASES.get(_stamp(path))
    if flat is None:
        flat = read_weights(path).flat
        remember_base(path, flat)
    return flat


@register(PLANNED)
def _replayable_merge(ws: np.ndarray, wc: np.ndarray, params: Any, sl: slice) -> np.ndarray:
    """One shard of a merge planned by :func:`boinc_dl.server.assimilator.policy.plan_merge`
    (live, or replayed from the log)."""
    r = params["rule"]
    st = r["staleness"]
    # max_weight: absent from records written before the cap existed (then 1: no cap)
    rule = MergeRule(r["name"], float(r["alpha"]), Staleness(st["kind"], float(st["p"]), float(st["a"]),
                                                                          float(st["b"])), float(r["server_lr"]),
                     max_weight=float(r.get("max_weight", 1.0)))
    base = _base_for_replay(params["base"])[sl] if params.get("base") else None
    return rule.apply(ws, wc, base, float(params["s"]), None, float(params["scale"]))
