"""Merge rules under staleness and poisoning: the project's merge functions replayed in a
simulated order, with real TensorFlow training of every client.

What is simulated is the *order*, nothing else: D units in flight, each unit's base is
the server weights at the moment it was issued (pipelined epochs, as the VC-ASGD work
generator issues them), completion times drawn from a seeded lognormal (sigma 0.5: hosts
of different speeds), and results merged one at a time, in completion order, with
``boinc_dl.server.assimilator.rules`` (and, for "today's" defence, the adaptive bound of
0.2's ``adaptive_bound``, tests/support/baselines.py). Each client trains exactly as a unit does
(``client_app/train.py``): a fresh Adam, ``local_epochs`` passes over its subset in
batches drawn by ``default_rng([unit_seed, local_epoch])``, the last batch partial. To
reach D = 1,000 the clients are trained many at once: every unit issued and not yet
trained is trained when the first of them is needed, as one batch of independent models
(a vectorised Adam over stacked weights, one TensorFlow graph); ``--check-trainer``
compares it with Keras on one unit.

Tables: staleness (rule x D x dataset, final and first-epoch validation accuracy, beside
D = 1 and the paper's rule, for subsets per epoch = D and for D = 4x subsets), poisoning
(10% colluding attackers, each attack, today's defence vs the trusted one), the patient
single attacker (accepted attacker results needed to drop 10 points), honest cost (share
of honest results refused or clipped, numpy merge latency at the paper's model size).

    python bench/bench_merge_rules.py --quick          # digits, 4 rules, D <= 128: 5 min (304 s measured, loaded 2-core VM)
    python bench/bench_merge_rules.py                  # digits + MNIST (subsampled), all tables

MNIST is subsampled (``--mnist-train``, default 12,000 training images; validation on the
10,000 test images) to keep the runtime sane on 2 cores; digits is used whole.
"""

from __future__ import annotations

import argparse
import heapq
import math
import os
import random
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import emit, machine  # noqa: E402
from boinc_dl.server.assimilator import rules as R  # noqa: E402
from boinc_dl.server.common.datasets import load_dataset, split_shards  # noqa: E402
from boinc_dl.server.common.spec import DatasetSpec, VCASGDSpec  # noqa: E402
from boinc_dl.server.common.spec_defaults import local_epochs_for  # noqa: E402
from boinc_dl.server.work_generator import losscheck as WLC  # noqa: E402
from boinc_dl.server.work_generator.vcasgd import unit_seed  # noqa: E402
from tests.support import baselines as norms  # noqa: E402  (0.2's bound, the baseline)
from tests.support.attacks import ATTACKS, Attack, craft  # noqa: E402  (the attacks, one home)

SEARCH_BATCH = VCASGDSpec.model_fields["search_batch"].default  # the product's vcasgd.search_batch
THREADS = int(os.environ.get("BDL_THREADS", "2") or 2)


# ---- the task: data, model, training settings ------------------------------------------------
@dataclass
class Task:
    name: str
    x: np.ndarray
    y: np.ndarray
    xv: np.ndarray
    yv: np.ndarray
    xc: np.ndarray  # the server's held-out check batch (descent check)
    yc: np.ndarray
    hidden: int
    lr: float
    batch: int
    local_epochs: int
    epochs: int
    seed: int = 7
    classes: int = 10

    @property
    def d(self) -> int:
        return int(self.x.shape[1])

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        return [(self.d, self.hidden), (self.hidden,), (self.hidden, self.classes), (self.classes,)]

    @property
    def n(self) -> int:
        return int(sum(np.prod(s) for s in self.shapes))

    def unflatten(self, flat: np.ndarray) -> list[np.ndarray]:
        out, i = [], 0
        for s in self.shapes:
            k = int(np.prod(s))
            out.append(flat[..., i:i + k].reshape(flat.shape[:-1] + s))
            i += k
        return out

    def init(self) -> np.ndarray:
        """Keras' defaults for Dense: Glorot-uniform kernels, zero biases."""
        rng = np.random.default_rng(self.seed)
        parts = []
        for s in self.shapes:
            if len(s) == 2:
                lim = math.sqrt(6.0 / (s[0] + s[1]))
                parts.append(rng.uniform(-lim, lim, s).astype(np.float32).ravel())
            else:
                parts.append(np.zeros(s, np.float32))
        return np.concatenate(parts)

    def _forward(self, flat: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        w1, b1, w2, b2 = self.unflatten(flat)
        h = np.maximum(x @ w1 + b1, 0.0)
        return h, h @ w2 + b2

    def check_loss(self, flat: np.ndarray) -> float:
        """Mean cross-entropy on the server's held-out check batch (zeroth-order check)."""
        if not np.isfinite(flat).all():
            return math.inf
        _, z = self._forward(flat, self.xc)
        z = z - z.max(axis=1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
        return float(-logp[np.arange(len(self.yc)), self.yc].mean())

    def accuracy(self, flat: np.ndarray) -> float:
        if not np.isfinite(flat).all():
            return 0.0
        out = []
        for i in range(0, len(self.xv), 4096):
            _, z = self._forward(flat, self.xv[i:i + 4096])
            out.append(np.argmax(z, axis=1) == self.yv[i:i + 4096])
        return float(np.concatenate(out).mean())

    def grad(self, flat: np.ndarray) -> np.ndarray:
        """Gradient of the mean cross-entropy on the check batch (numpy backprop): what the
        work generator would write beside each weights file for the descent check."""
        w1, b1, w2, b2 = self.unflatten(flat)
        x, y = self.xc, self.yc
        h_pre = x @ w1 + b1
        h = np.maximum(h_pre, 0.0)
        z = h @ w2 + b2
        z = z - z.max(axis=1, keepdims=True)
        p = np.exp(z)
        p /= p.sum(axis=1, keepdims=True)
        p[np.arange(len(y)), y] -= 1.0
        dz = p / len(y)
        dh = (dz @ w2.T) * (h_pre > 0)
        return np.concatenate([(x.T @ dh).ravel(), dh.sum(0), (h.T @ dz).ravel(), dz.sum(0)]).astype(np.float32)


def load_task(name: str, epochs: int, mnist_train: int) -> Task:
    if name == "digits":
        data = load_dataset(DatasetSpec(name="digits", val_fraction=0.2), 7)
        x, y = data.x_train, data.y_train
        rng = np.random.default_rng(11)
        ci = rng.choice(len(x), 256, replace=False)
        return Task("digits", x, y, data.x_val, data.y_val, x[ci], y[ci], hidden=64, lr=0.002, batch=16,
                    local_epochs=2, epochs=epochs)
    data = load_dataset(DatasetSpec(name="mnist"), 7)
    rng = np.random.default_rng(7)
    ti = np.sort(rng.choice(len(data.x_train), mnist_train, replace=False))
    x, y = data.x_train[ti], data.y_train[ti]
    ci = rng.choice(len(x), 512, replace=False)
    return Task("mnist", x, y, data.x_val, data.y_val, x[ci], y[ci], hidden=128, lr=0.001, batch=64,
                local_epochs=1, epochs=epochs)


# ---- many clients at once: a vectorised Adam over stacked MLPs ----------------------------------------
class VecTrainer:
    """Trains K independent copies of the task's MLP at once, each on its own batches, each
    with its own fresh Adam (Keras' update: bias-corrected step, epsilon 1e-7)."""

    def __init__(self, task: Task):
        from boinc_dl.server.common.keras_model import configure_tf

        self.tf = tf = configure_tf(threads=THREADS, deterministic=False)
        self.task = task
        self.x_tf = tf.constant(task.x)
        lr, b1, b2, eps = task.lr, 0.9, 0.999, 1e-7
        d, h, c = task.d, task.hidden, task.classes

        @tf.function(reduce_retracing=True)
        def run(flat, idx, lab, mask, active):
            k = tf.shape(flat)[0]
            o1, o2, o3 = d * h, d * h + h, d * h + h + h * c
            params = [tf.reshape(flat[:, :o1], (k, d, h)), flat[:, o1:o2],
                      tf.reshape(flat[:, o2:o3], (k, h, c)), flat[:, o3:]]
            ms = [tf.zeros_like(p) for p in params]
            vs = [tf.zeros_like(p) for p in params]
            t0 = tf.zeros((k,), tf.float32)
            steps = tf.shape(idx)[0]

            def body(i, t, ps, ms_, vs_):
                xb = tf.gather(self.x_tf, idx[i])  # [K, B, d]
                yb, mb, ab = lab[i], mask[i], active[i]
                with tf.GradientTape() as tape:
                    tape.watch(ps)
                    hid = tf.nn.relu(tf.linalg.matmul(xb, ps[0]) + ps[1][:, None, :])
                    z = tf.linalg.matmul(hid, ps[2]) + ps[3][:, None, :]
                    ce = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=yb, logits=z)
                    per = tf.reduce_sum(ce * mb, 1) / tf.maximum(tf.reduce_sum(mb, 1), 1.0)
                    loss = tf.reduce_sum(per)
                gs = tape.gradient(loss, ps)
                t_new = t + ab
                a_k = lr * tf.sqrt(1.0 - tf.pow(b2, t_new)) / tf.maximum(1.0 - tf.pow(b1, t_new), 1e-12)
                new_p, new_m, new_v = [], [], []
                for p, g, m, v in zip(ps, gs, ms_, vs_, strict=True):
                    shape = tf.concat([[k], tf.ones([tf.rank(p) - 1], tf.int32)], 0)
                    act = tf.reshape(ab, shape)
                    m2 = m + act * (g - m) * (1 - b1)
                    v2 = v + act * (g * g - v) * (1 - b2)
                    step = tf.reshape(a_k, shape) * m2 / (tf.sqrt(v2) + eps)
                    new_p.append(p - act * step)
                    new_m.append(m2)
                    new_v.append(v2)
                return i + 1, t_new, new_p, new_m, new_v

            _, _, ps, _, _ = tf.while_loop(lambda i, *a: i < steps, body, (0, t0, params, ms, vs))
            return tf.concat([tf.reshape(ps[0], (k, -1)), ps[1], tf.reshape(ps[2], (k, -1)), ps[3]], 1)

        self._run = run
        self.units_trained = 0
        self.calls = 0
        self.seconds = 0.0

    def schedule(self, subset: np.ndarray, seed: int) -> list[np.ndarray]:
        """The unit's batches, as the client draws them."""
        bs, n = self.task.batch, len(subset)
        out = []
        for le in range(self.task.local_epochs):
            order = np.random.default_rng([seed, le]).permutation(n)
            out += [subset[order[b * bs:(b + 1) * bs]] for b in range(math.ceil(n / bs))]
        return out

    #: Units trained in one vectorised call at most (memory: K x steps x batch indices).
    CHUNK = 256

    def train(self, bases: list[np.ndarray], subsets: list[np.ndarray], seeds: list[int],
              flip: list[bool] | None = None) -> np.ndarray:
        """Train K units (bases [K][n]) on their subsets, :data:`CHUNK` at a time; returns
        the results [K, n]."""
        c = self.CHUNK
        if len(bases) <= c:
            return self._train_chunk(bases, subsets, seeds, flip)
        return np.concatenate([self._train_chunk(bases[i:i + c], subsets[i:i + c], seeds[i:i + c],
                                                 None if flip is None else flip[i:i + c])
                               for i in range(0, len(bases), c)])

    def _train_chunk(self, bases: list[np.ndarray], subsets: list[np.ndarray], seeds: list[int],
                     flip: list[bool] | None) -> np.ndarray:
        t0 = time.perf_counter()
        k = len(bases)
        scheds = [self.schedule(s, sd) for s, sd in zip(subsets, seeds, strict=True)]
        steps = max(len(s) for s in scheds)
        b = max(len(bt) for s in scheds for bt in s)
        idx = np.zeros((steps, k, b), np.int32)
        mask = np.zeros((steps, k, b), np.float32)
        active = np.zeros((steps, k), np.float32)
        for j, s in enumerate(scheds):
            for i, bt in enumerate(s):
                idx[i, j, :len(bt)] = bt
                mask[i, j, :len(bt)] = 1.0
                active[i, j] = 1.0
        lab = self.task.y[idx].astype(np.int32)
        if flip is not None and any(flip):
            f = np.asarray(flip)[None, :, None]
            lab = np.where(f, (lab + 1) % self.task.classes, lab).astype(np.int32)
        out = self._run(np.stack(bases).astype(np.float32), idx, lab, mask, active).numpy()
        self.units_trained += k
        self.calls += 1
        self.seconds += time.perf_counter() - t0
        return out


def check_trainer(task: Task, trainer: VecTrainer) -> float:
    """Max |difference| between the vectorised trainer and Keras (the client's model and
    optimizer, the client's batch order) on one unit of 64 examples, from the same base."""
    import keras

    from boinc_dl.server.common.keras_model import get_flat, set_flat

    sys.path.insert(0, str(ROOT / "examples"))
    from models import mlp  # type: ignore[import-not-found]

    model = mlp(task.d, task.hidden, task.classes)
    base = task.init()
    set_flat(model, base)
    opt = keras.optimizers.Adam(learning_rate=task.lr)
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    subset = np.arange(64)
    for bt in trainer.schedule(subset, 123):
        model.train_on_batch(task.x[bt], task.y[bt])
    ref = get_flat(model)
    ours = trainer.train([base], [subset], [123])[0]
    return float(np.abs(ref - ours).max())


# ---- defences ----------------------------------------------------------------------------------------
@dataclass
class Defence:
    """``today``: the adaptive bound on ||wc - ws|| of norms.py, fed by every accepted
    result (k = 10, warm-up 10: the spec's defaults). ``trusted``: the update ``wc - wb``
    clipped to a TrustedRadius fed only by replicated results, plus the descent check."""

    kind: str = "none"  # none | today | trusted | clip (trusted radius, no descent check) | trusted0 | trusted01
    replicate_p: float = 0.2     # share of honest results replicated (their statistics are trusted)
    radius_factor: float = 2.0
    cos_k: float = 4.0           # descent check: median + k scaled MADs of trusted cosines (+ 0.05)
    warm_epochs: int = 1         # epochs whose honest results are all replicated (every host is new)
    # The work generator's spot checks (server/backends/boinc/spotcheck.py), when > 0: no warm
    # epochs; a unit is replicated while trusted + open spot checks < loss_check_min_trusted,
    # and once this many results were judged against no comparable trusted changes since the last.
    spot_every: int = 0
    observe_cos: bool = False    # record trusted cosines even when not checking (to warm a start)
    today_k: float = 10.0
    today_warmup: int = 10
    # BOINC's adaptive replication for the attacker's host (single-attacker mode): its units
    # are replicated by ``rules.HostReputation`` (all below 10 consecutive valid results,
    # then a spot check with probability 1/count); a replicated attack disagrees with the
    # honest replica and resets the count, and so does a refusal by a check.
    reputation: bool = False
    # The host's ledger (rules.LossLedger) on top of the zeroth-order check: each host's
    # untrusted results' loss changes, in trusted scaled MADs, summed as a CUSUM.
    ledger: bool = False

    @property
    def clips(self) -> bool:
        return self.kind in ("trusted", "clip", "trusted0", "trusted01")

    @property
    def descent(self) -> bool:
        """The first-order check (cosine with the held-out gradient at the base)."""
        return self.kind in ("trusted", "trusted01")

    @property
    def zeroth(self) -> bool:
        """Zeno++'s zeroth-order check: the held-out loss of wb + d against wb's."""
        return self.kind in ("trusted0", "trusted01")


#: Share of honest results replicated in the poisoning section (``--replicate-p``).
REPLICATE_P = 0.2
#: The work generator's spot checks (``--spot-every``; 0: off, the warm epoch instead).
SPOT_EVERY = 0
BOUND_RATIO = R.BOUND_BASE_RATIO  # the per-result bound's comparable ratio (``--bound-base-ratio``)
SPOT_RULE = "stale"  # as the work generator does; or "fresh" (``--spot-rule``)


def defence_of(name: str) -> Defence:
    """A defence by its bench name: the kind, then ``+rep`` (BOINC's adaptive replication
    of the attacker's host) and ``+ledger`` (the hosts' loss ledgers), e.g. ``trusted0+rep+ledger``."""
    kind, *extras = name.split("+")
    return Defence(kind, reputation="rep" in extras, ledger="ledger" in extras, replicate_p=REPLICATE_P,
                   spot_every=SPOT_EVERY if kind in ("trusted0", "trusted01") else 0)


# ---- the simulated order -------------------------------------------------------------------------------
@dataclass
class RunResult:
    accs: list[float]
    merges: int = 0
    honest: int = 0
    honest_rejected: int = 0
    honest_clipped: int = 0
    attacker: int = 0
    attacker_accepted: int = 0
    attacker_to_drop: int | None = None  # single-attacker mode: accepted attacker results at -10 points
    attacker_caught: int = 0    # reputation: attacks sent on units BOINC replicated (the replica disagreed)
    attacker_honest: int = 0    # reputation: units the attacker computed honestly to regain trust
    attacker_ledger: int = 0    # attacker results refused by the host's ledger (within the per-result bound)
    honest_ledger: int = 0      # honest results refused by their host's ledger
    ledger_unscored: int = 0    # untrusted results the ledger had no comparable trusted reference for
    loss_unbounded: int = 0     # untrusted results the loss check had no comparable trusted changes for
    spot_checks: int = 0        # units the work generator replicated (spot_every > 0)
    reissued: int = 0           # refused results whose unit was issued again (reissue > 0)
    stale: int = 0              # untrusted results judged against no comparable trusted changes (either check)
    mean_staleness: float = 0.0
    honest_cos: list[float] = field(default_factory=list)
    attack_cos: list[float] = field(default_factory=list)
    final_weights: np.ndarray | None = None
    trusted: R.TrustedRadius | None = None
    cos_threshold: R.TrustedStatistic | None = None
    loss_threshold: R.TrustedStatistic | None = None
    trusted_loss: list[tuple[int, float, float | None]] = field(default_factory=list)  # (epoch, change, base loss)
    today_window: list[float] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def final(self) -> float:
        return self.accs[-1] if self.accs else float("nan")

    @property
    def first(self) -> float:
        return self.accs[0] if self.accs else float("nan")


def simulate(task: Task, trainer: VecTrainer, rule: R.MergeRule, d_inflight: int, n_subsets: int,
             epochs: int | None = None, seed: int = 0, attack: Attack | None = None,
             defence: Defence | None = None, init: np.ndarray | None = None, sigma: float = 0.5,
             stop_drop: float | None = None, max_attacker: int | None = None,
             radius: R.TrustedRadius | None = None, today_window: list[float] | None = None,
             flip_target: np.ndarray | None = None, cos_threshold: R.TrustedStatistic | None = None,
             loss_threshold: R.TrustedStatistic | None = None,
             trusted_loss: list[tuple[int, float, float | None]] | None = None,
             attack_lost: bool = False, reissue: int = 0) -> RunResult:
    """Replay one job: ``epochs`` x ``n_subsets`` units, ``d_inflight`` in flight.

    ``attack_lost``: the attackers' results are lost (never merged, whatever they hold):
    the floor of any defence that refuses them. ``reissue``: a refused result's unit is
    issued again (to a host drawn afresh), at most this many times, before its subset is
    given up for the epoch."""
    t_start = time.perf_counter()
    epochs = epochs or task.epochs
    rule = rule.capped(d_inflight)  # as the generator records the window for each unit
    defence = defence or Defence()
    rng = np.random.default_rng([seed, d_inflight, n_subsets, 17])  # completion times only
    rep_rng = np.random.default_rng([seed, 5])  # which honest results were replicated
    subsets = split_shards(len(task.x), n_subsets, task.seed)
    schedule = [(e, int(sh)) for e in range(1, epochs + 1)
                for sh in np.random.default_rng([task.seed, e]).permutation(n_subsets)]
    ws = (init if init is not None else task.init()).astype(np.float32).copy()
    state = rule.new_state(ws.size)
    scratch = np.empty_like(ws)
    version = 0
    bases: dict[int, list[Any]] = {}  # version -> [weights, refs, check-batch gradient or None]
    issued: dict[int, int] = {}  # version -> units issued from it (the step search's cohorts)
    if isinstance(rule, SearchRule):
        rule.cohorts = issued
    info: dict[int, tuple[int, int, int, bool]] = {}  # uid -> (epoch, shard, base version, attacker)
    pending: dict[int, None] = {}  # issued, not yet trained (ordered)
    results: dict[int, np.ndarray] = {}
    heap: list[tuple[float, int]] = []
    done = {e: 0 for e in range(1, epochs + 1)}
    closed = 0
    res = RunResult(accs=[])
    trusted = radius if radius is not None else R.TrustedRadius(factor=defence.radius_factor)
    window = list(today_window or [])  # today's bound: accepted distances, newest last
    honest_recent: deque[np.ndarray] = deque(maxlen=32)
    honest_norms: deque[float] = deque(maxlen=64)
    descent = R.DescentCheck()
    cos_th = cos_threshold if cos_threshold is not None else R.cosine_threshold(k=defence.cos_k)
    loss_th = loss_threshold if loss_threshold is not None else R.loss_increase_threshold()
    base_loss: dict[int, float] = {}
    start_acc = task.accuracy(ws) if stop_drop is not None else 0.0
    staleness_sum = 0
    now = 0.0
    nxt = 0
    # The attacker's host under BOINC's adaptive replication. It starts trusted (it built
    # its count on honest work before the attack: the worst case) and knows its count (a
    # volunteer sees its results' validation on the project's pages): it attacks only while
    # trusted, and computes honestly to regain trust after a reset.
    reputation = R.HostReputation()
    atk_host = "attacker"
    reputation.counts[atk_host] = reputation.threshold
    rep_draw = random.Random(seed * 7919 + 3)
    ledger = LEDGER
    balances: dict[str, float] = {}  # host -> its ledger balance
    # the trusted loss changes with their bases' losses, as the job's Redis keeps them
    ledger_ref: deque[tuple[int, float, float | None]] = deque(trusted_loss or [], maxlen=loss_th.window)

    def loss_bound(e: int, bv: int) -> tuple[float | None, bool]:
        """The per-result loss bound for a result of epoch ``e`` from base version ``bv``
        (the checker's rule: rules.loss_increase_bound), and whether comparable changes made it."""
        bound, comparable = R.loss_increase_bound(ledger_ref, e, base_loss[bv], k=loss_th.k,
                                                  min_samples=loss_th.min_samples, ratio=BOUND_RATIO)
        res.loss_unbounded += not comparable
        return bound, comparable

    spot: set[int] = set()  # units the work generator made spot checks, not yet back
    spot_seen = 0           # the count the last spot check used
    judged = 0              # untrusted results judged
    judged_at_trusted = 0   # ... when the latest trusted change arrived
    warm_epochs = 0 if defence.spot_every else defence.warm_epochs
    reissued: dict[tuple[int, int], int] = {}  # (epoch, subset) -> times issued again

    def spot_check() -> bool:
        """The work generator's decision for the next honest unit (spotcheck.wanted)."""
        nonlocal spot_seen
        if not defence.spot_every:
            return False
        if len(ledger_ref) + len(spot) < loss_th.min_samples:
            return True
        if SPOT_RULE == "stale":
            count, since = res.stale, spot_seen
        else:  # fresh: results judged since the later of the last trusted change and spot check
            count, since = judged, max(spot_seen, judged_at_trusted)
        if count - since >= defence.spot_every:
            spot_seen = count
            return True
        return False

    def host_of(uid: int, atk: bool) -> str:
        # The single attacker is one host; 10% colluders are 4 hosts; honest units come from 36.
        if not atk:
            return f"h{uid % 36}"
        return atk_host if attack.pattern is not None else f"a{uid % 4}"  # type: ignore[union-attr]
    roles: dict[int, str] = {}  # uid -> honest | attack | caught (replicated attack) | rebuild

    def is_attacker(uid: int) -> bool:
        if attack is None:
            return False
        if attack.pattern is not None:
            return attack.pattern(uid)
        return bool(np.random.default_rng([seed, uid, 99]).random() < attack.frac)

    def issue() -> None:
        nonlocal nxt
        if nxt >= len(schedule):
            return
        uid = nxt
        nxt += 1
        e, sh = schedule[uid]
        if version not in bases:
            bases[version] = [ws.copy(), 0, None]
        bases[version][1] += 1
        issued[version] = issued.get(version, 0) + 1
        atk = is_attacker(uid)
        role = "attack" if atk else "honest"
        if atk and defence.reputation:
            if not reputation.trusted(atk_host):
                role, atk = "rebuild", False  # honest work, replicated: regains trust
            elif reputation.needs_replication(atk_host, rep_draw):
                role, atk = "caught", False  # the workunit's canonical result is the honest replica's
        roles[uid] = role
        info[uid] = (e, sh, version, atk)
        # the attackers never draw a spot check (the worst case: they would be caught)
        if not atk and role == "honest" and spot_check():
            spot.add(uid)
            res.spot_checks += 1
        if not atk or attack.trains:  # type: ignore[union-attr]
            pending[uid] = None
        heapq.heappush(heap, (now + float(rng.lognormal(0.0, sigma)), uid))

    def train_pending() -> None:
        todo = list(pending)
        pending.clear()
        if not todo:
            return
        out = trainer.train([bases[info[u][2]][0] for u in todo], [subsets[info[u][1]] for u in todo],
                            [unit_seed(task.seed, info[u][0], info[u][1]) for u in todo],
                            [info[u][3] for u in todo])
        for u, w in zip(todo, out, strict=True):
            results[u] = w

    def grad_at(bv: int) -> np.ndarray:
        entry = bases[bv]
        if entry[2] is None:
            entry[2] = task.grad(entry[0])
        return entry[2]

    def bound_now() -> float | None:
        return norms.adaptive_bound(window[-norms.WINDOW:], defence.today_k, defence.today_warmup)

    def crafted(uid: int, wb: np.ndarray, e: int) -> np.ndarray:
        """The attacker's result, sized at 0.99x the bound in force."""
        today = defence.kind in ("today", "none")
        if today:  # the bound's centre: ||wc - ws|| today, ||wc - wb|| with the trusted radius
            ref, bound = ws, bound_now()
        else:
            ref, bound = wb, trusted.radius(e)
        return craft(attack, ref, bound, honest_updates=honest_recent, honest_norms=honest_norms,  # type: ignore[arg-type]
                     trained=results.pop(uid) if attack.trains else None,  # type: ignore[union-attr]
                     target=flip_target, offset=(wb - ws) if today else None)

    def close_epochs() -> None:
        nonlocal closed
        while closed < epochs and done[closed + 1] >= n_subsets:
            closed += 1
            res.accs.append(task.accuracy(ws))

    for _ in range(min(d_inflight, len(schedule))):
        issue()
    while heap:
        now, uid = heapq.heappop(heap)
        e, sh, bv, atk = info[uid]
        if uid in pending:
            train_pending()
        del info[uid]
        role = roles.pop(uid)
        wb = bases[bv][0]
        if atk:
            wc = crafted(uid, wb, e)
        else:
            wc = results.pop(uid)
        s = version - bv
        dnorm = R.update_norm(wc, wb)
        accept, scale = math.isfinite(dnorm) and not (atk and attack_lost), 1.0
        dist = float(np.linalg.norm(wc - ws)) if accept else None
        if defence.kind == "today" and dist is not None:
            b = bound_now()
            if b is not None and dist > b:
                accept = False
        if defence.clips and accept:
            scale = R.clip_scale(dnorm, trusted.radius(e))
        # Replication is decided when the unit is sent, before any check: a replicated
        # honest result whose replica agrees is confirmed (trusted): its statistics feed
        # the trusted bounds whatever they are, and it skips the descent check. The
        # attackers' results are never replicated here (the worst case: trusted hosts).
        replicated = role in ("caught", "rebuild") or uid in spot or (
            not atk and (e <= warm_epochs or rep_rng.random() < defence.replicate_p))
        spot.discard(uid)
        stale_here = False
        cos = None
        if (defence.descent or defence.observe_cos) and math.isfinite(dnorm):
            cos = R.descent_cosine_parts(grad_at(bv), wc, wb)
            (res.attack_cos if atk else res.honest_cos).append(cos)
            if accept and defence.descent and not replicated and not descent.passes(cos, cos_th.value(e)):
                accept = False
        dloss = None
        if (defence.zeroth or defence.observe_cos) and math.isfinite(dnorm):
            if bv not in base_loss:
                base_loss[bv] = task.check_loss(wb)
            dloss = task.check_loss(wb + (wc - wb) * np.float32(scale)) - base_loss[bv]
            if accept and defence.zeroth and not replicated:
                bound, comparable = loss_bound(e, bv)
                stale_here = bound is not None and not comparable
                if not R.loss_check_passes(dloss, bound):
                    accept = False
            if defence.ledger and not replicated and dloss is not None:
                reference = ledger.reference(ledger_ref, e, base_loss[bv])
                comparable = reference.comparable
                z = ledger.score(dloss, reference, base_loss=base_loss[bv])
                res.ledger_unscored += not comparable
                stale_here = stale_here or (z is not None and not comparable)
                if z is not None:
                    h = host_of(uid, atk)
                    balances[h], ok = ledger.step(balances.get(h, 0.0), z)
                    if accept and not ok:
                        accept = False
                        if atk:
                            res.attacker_ledger += 1
                        else:
                            res.honest_ledger += 1
        res.stale += stale_here
        judged += not replicated and dloss is not None
        if replicated and dloss is not None:
            judged_at_trusted = judged
        if replicated:
            trusted.observe(dnorm, R.trusted_observation(True, True), e)
            if cos is not None:
                cos_th.observe(cos, R.trusted_observation(True, True), e)
            if dloss is not None:
                loss_th.observe(dloss, R.trusted_observation(True, True), e)
                ledger_ref.append((e, dloss, base_loss[bv]))
        if atk:
            res.attacker += 1
            if defence.reputation and not accept:
                reputation.record(atk_host, valid=False, replicated=False)  # refused for the host's work
        elif role == "caught":
            res.attacker += 1
            res.attacker_caught += 1
            reputation.record(atk_host, valid=False, replicated=True)
        elif role == "rebuild":
            res.attacker_honest += 1
            reputation.record(atk_host, valid=True, replicated=True)
        if not atk:
            honest_recent.append(wc - wb)
            honest_norms.append(dnorm)
        if role == "honest":
            res.honest += 1
            if not accept:
                res.honest_rejected += 1
            elif scale < 1.0:
                res.honest_clipped += 1
        if accept:
            rule.apply(ws, wc, wb, s, state, scale, scratch)
            version += 1
            res.merges += 1
            staleness_sum += s
            if dist is not None:
                window.append(dist)
            if atk:
                res.attacker_accepted += 1
        if not accept and stop_drop is None and reissued.get((e, sh), 0) < reissue:
            reissued[(e, sh)] = reissued.get((e, sh), 0) + 1
            res.reissued += 1
            schedule.insert(nxt, (e, sh))  # the next unit issued: the epoch waits for it
        else:
            done[e] += 1
        bases[bv][1] -= 1
        if bases[bv][1] == 0 and bv != version:
            del bases[bv]
        if stop_drop is not None and role != "honest":
            acc = task.accuracy(ws)
            if acc <= start_acc - stop_drop:
                res.attacker_to_drop = res.attacker_accepted
                res.accs.append(acc)
                break
            if max_attacker is not None and res.attacker + res.attacker_honest >= max_attacker:
                res.accs.append(acc)
                break
        else:
            close_epochs()
        issue()
    if stop_drop is not None and not res.accs:
        res.accs.append(task.accuracy(ws))
    res.mean_staleness = staleness_sum / max(1, res.merges)
    res.final_weights = ws
    res.trusted = trusted
    res.cos_threshold = cos_th
    res.loss_threshold = loss_th
    res.trusted_loss = list(ledger_ref)
    res.today_window = window[-norms.WINDOW:]
    res.seconds = time.perf_counter() - t_start
    return res


# ---- the rules compared ------------------------------------------------------------------------------
LEDGER = R.LossLedger()  # the job's default ledger (the bench's experiments replace it)
POISON_RULE = "delta-cap"  # the rule of the poisoning section's defended columns (--poison-rule)
REC = "delta-cap"  # the recommended default (see docs/merge-rules.md)


def candidate_rules(a: float = 0.5) -> dict[str, R.MergeRule]:
    """The rules of the staleness table; ``a`` is the paper's alpha (0.5, as in the issue)."""
    P = R.Staleness
    return {
        "paper": R.MergeRule("paper", a),
        "delta": R.MergeRule("delta", a, server_lr=1 - a),  # the naive delta merge
        "fedasync-poly": R.MergeRule("fedasync", a, P("poly", p=0.5)),
        "fedasync-hinge": R.MergeRule("fedasync", a, P("hinge", a=10.0, b=4.0)),
        "fedbuff": R.MergeRule("fedbuff", a, P("poly", p=0.5), server_lr=1.0, buffer_k=8),
        "momentum": R.MergeRule("momentum", a, P("poly", p=1.0), server_lr=0.1, momentum=0.9),
        "delta-poly.75": R.MergeRule("delta", a, P("poly", p=0.75), server_lr=1.0),
        "delta-poly1": R.MergeRule("delta", a, P("poly", p=1.0), server_lr=1.0),
        # the job's default: delta-poly1 with each weight at most 1/D (D in flight)
        REC: R.MergeRule("delta", a, P("poly", p=1.0), server_lr=1.0, cap_in_flight=True),
    }


def all_rules() -> dict[str, Any]:
    """The staleness table's rules: :func:`candidate_rules` and ``search`` (bound to each task)."""
    return {**candidate_rules(), "search": SearchRule(), "search-fixed": SearchRule(fixed_sample=True),
            "oracle": OracleRule()}


class SearchRule:
    """``merge_rule: search`` in the simulated order: the product's candidates
    (``rules.search_steps`` of the capped ``delta`` weight, bounded by the units issued
    from the result's base version), its search (``rules.search_step``) and its merge
    (``rules.stepped``), the loss that of ``batch`` training examples at the server
    weights when the result is merged, drawn for each result (the checker's
    ``sample_rows``) from a fixed pool of ``SEARCH_POOL`` samples' worth (uniform here,
    where the product takes an equal share of each subset; it evaluates at the weights
    when the checker takes the request: the same weights here, where merges land one at
    a time). ``fixed_sample``: one sample for every result (the search before fresh
    samples, for comparison). ``multipliers``: the candidate steps' multiples of ``delta``'s
    weight (the product's ``rules.SEARCH_MULTIPLIERS``; ``--search-multipliers``).
    ``buffer_k`` > 1 (``--search-buffer``, not a product rule): the search on the sum of
    ``buffer_k`` results at a time, a step of ``c`` moving the server by ``c`` times their
    sum, ``c`` among 0 and their mean ``delta`` weight times the multipliers, at most their
    mean bound (a buffer left part-filled at the job's end is not merged)."""

    def __init__(self, task: Task | None = None, batch: int = SEARCH_BATCH, base: R.MergeRule | None = None,
                 stats: dict[str, int] | None = None, fixed_sample: bool = False,
                 multipliers: tuple[float, ...] = R.SEARCH_MULTIPLIERS, buffer_k: int = 1):
        self.task, self.batch, self.fixed_sample = task, batch, fixed_sample
        self.multipliers, self.buffer_k = tuple(multipliers), max(1, int(buffer_k))
        self.buffer: list[tuple[np.ndarray, float, float]] = []  # (update, delta's weight, bound)
        self.base = base or candidate_rules()[REC]
        self.stats = stats if stats is not None else {"results": 0, "zero": 0, "evals": 0}
        self.xs = self.ys = None
        self.merged: int = 0  # this replay's merges so far: the server version
        self.in_flight: int = 1  # the window (capped sets it)
        self.cohorts: dict[int, int] | None = None  # version -> units issued from it (simulate sets it)
        self.pool_x = self.pool_y = None
        if task is not None:
            size = batch if fixed_sample else WLC.SEARCH_POOL * batch
            idx = np.sort(np.random.default_rng([task.seed, 0x57E9]).permutation(len(task.x))[:size])
            self.pool_x, self.pool_y = task.x[idx], task.y[idx]
            self.xs, self.ys = self.pool_x, self.pool_y

    def bound(self, task: Task) -> SearchRule:
        return SearchRule(task, self.batch, self.base, fixed_sample=self.fixed_sample, multipliers=self.multipliers,
                          buffer_k=self.buffer_k)

    def capped(self, in_flight: int) -> SearchRule:
        out = SearchRule(None, self.batch, self.base.capped(in_flight), self.stats, self.fixed_sample,
                         self.multipliers, self.buffer_k)
        out.task, out.xs, out.ys, out.pool_x, out.pool_y = self.task, self.xs, self.ys, self.pool_x, self.pool_y
        # one job's replay: its merges so far (the server version) and, set by simulate(),
        # the units issued from each version (the product's JobStore.issued_from)
        out.merged, out.cohorts, out.in_flight = 0, None, max(1, int(in_flight))
        return out

    def new_state(self, n: int) -> None:
        return None

    def describe(self) -> str:
        sample = "one fixed sample" if self.fixed_sample else f"a sample per result of a pool of {WLC.SEARCH_POOL}"
        buffered = f", on the sum of {self.buffer_k} results at a time" if self.buffer_k > 1 else ""
        return f"search(0 or {self.base.describe()} x {', '.join(f'{m:g}' for m in self.multipliers)}, " \
               f"at most w x max(1, in flight / cohort); {self.batch} training examples, {sample}{buffered})"

    def loss(self, flat: np.ndarray) -> float:
        assert self.task is not None and self.xs is not None, "bind the rule to a task first"
        if not np.isfinite(flat).all():
            return math.inf
        _, z = self.task._forward(flat, self.xs)
        z = z - z.max(axis=1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
        return float(-logp[np.arange(len(self.ys)), self.ys].mean())

    def apply(self, ws: np.ndarray, wc: np.ndarray, wb: np.ndarray | None, s: float, state: Any = None,
              scale: float = 1.0, scratch: np.ndarray | None = None) -> np.ndarray:
        assert wb is not None
        d = (wc - wb) * np.float32(scale)

        def at(c: float) -> float:
            self.stats["evals"] += 1
            return self.loss(ws + np.float32(c) * d)
        cohort = (self.cohorts or {}).get(self.merged - int(s), 1)  # units issued from the base version
        assert self.task is not None and self.pool_x is not None and self.pool_y is not None
        # this result's own sample of the pool, as the checker draws it from the request's id
        rows = WLC.sample_rows(len(self.pool_y), self.batch, self.task.seed, f"step-{self.merged}")
        self.xs, self.ys = (self.pool_x, self.pool_y) if rows is None else (self.pool_x[rows], self.pool_y[rows])
        self.merged += 1
        if self.buffer_k > 1:
            return self._apply_buffered(ws, d, s, cohort)
        step, _ = R.search_step(R.search_steps(self.base.weight(s), cohort, self.in_flight, self.multipliers), at)
        self.stats["results"] += 1
        self.stats["zero"] += step == 0.0
        rule, factor = R.stepped(step)
        return rule.apply(ws, wc, wb, s, None, scale * factor, scratch)

    def _apply_buffered(self, ws: np.ndarray, d: np.ndarray, s: float, cohort: int) -> np.ndarray:
        """``buffer_k`` > 1: hold ``d`` until the buffer is full, then search one step on the sum."""
        w = self.base.weight(s)
        self.buffer.append((d, w, min(1.0, w * max(1.0, self.in_flight / max(1, cohort)))))
        if len(self.buffer) < self.buffer_k:
            return ws
        total = np.sum([b[0] for b in self.buffer], axis=0, dtype=np.float32)
        w_mean = float(np.mean([b[1] for b in self.buffer]))
        top = float(np.mean([b[2] for b in self.buffer]))
        self.buffer = []
        steps = [0.0] + sorted({min(top, w_mean * m) for m in self.multipliers})

        def at(c: float) -> float:
            self.stats["evals"] += 1
            return self.loss(ws + np.float32(c) * total)
        step, _ = R.search_step(steps, at)
        self.stats["results"] += 1
        self.stats["zero"] += step == 0.0
        ws += np.float32(step) * total
        return ws


class OracleRule(SearchRule):
    """Not a rule a server can run: a ceiling for every rule that chooses each result's
    step as it arrives. Each result's step is the one of ``ORACLE_STEPS`` (0, then 1/1024
    to 1 by factors of 2, with no bound by staleness, window or cohort) after which the loss
    on the *validation* set, the one the run is scored on, is lowest, all of them evaluated.
    A greedy rule that looks at anything the server may use (a training sample, a held-out
    batch) can only do worse, up to the noise of one run."""

    STEPS: tuple[float, ...] = (0.0,) + tuple(2.0 ** -j for j in range(10, -1, -1))

    def bound(self, task: Task) -> OracleRule:
        out = OracleRule(task, self.batch, self.base)
        out.xs, out.ys = task.xv, task.yv
        return out

    def capped(self, in_flight: int) -> OracleRule:
        out = OracleRule(None, self.batch, self.base.capped(in_flight), self.stats)
        out.task, out.xs, out.ys = self.task, self.xs, self.ys
        out.merged, out.cohorts, out.in_flight = 0, None, max(1, int(in_flight))
        return out

    def describe(self) -> str:
        return ("oracle(each result's step among 0 and 2^-10..1 by the validation loss: "
                "a ceiling for greedy rules, not a rule)")

    def apply(self, ws: np.ndarray, wc: np.ndarray, wb: np.ndarray | None, s: float, state: Any = None,
              scale: float = 1.0, scratch: np.ndarray | None = None) -> np.ndarray:
        assert wb is not None and self.task is not None
        d = (wc - wb) * np.float32(scale)
        losses = [self.loss(ws + np.float32(c) * d) for c in self.STEPS]
        self.stats["evals"] += len(losses)
        step = self.STEPS[int(np.argmin(losses))]
        self.merged += 1
        self.stats["results"] += 1
        self.stats["zero"] += step == 0.0
        rule, factor = R.stepped(step)
        return rule.apply(ws, wc, wb, s, None, scale * factor, scratch)


def fmt(x: float) -> str:
    return f"{x:.3f}" if math.isfinite(x) else "  nan"


def cell(r: RunResult) -> str:
    return f"{fmt(r.final)} ({fmt(r.first)})"


@dataclass
class Bench:
    quick: bool
    epochs: int
    rules: dict[str, Any]  # R.MergeRule, or a SearchRule
    d_list: list[int]
    #: "task": the task's own local epochs; "derived": the project's default for D units in
    #: flight (boinc_dl.server.common.spec_defaults.local_epochs_for), D = 1 alike; a
    #: number: that many for every D
    local_epochs: str = "task"
    rows: list[dict[str, Any]] = field(default_factory=list)

    def log(self, **row: Any) -> None:
        self.rows.append(row)


def task_at(b: Bench, task: Task, d: int) -> Task:
    """``task`` with the unit length ``b.local_epochs`` gives it at ``d`` units in flight."""
    if b.local_epochs == "derived":  # the unit length a job with D in flight gets by default
        return replace(task, local_epochs=local_epochs_for(d)[0])
    if b.local_epochs != "task":
        return replace(task, local_epochs=int(b.local_epochs))
    return task


def staleness_section(b: Bench, task: Task, tr: VecTrainer) -> dict[str, Any]:
    """Rule x D, for subsets = D, D = 4x subsets, and the issue's 32 subsets."""
    regimes = {"subsets = D": [(d, d) for d in b.d_list],
               "D = 4x subsets": [(d, max(1, d // 4)) for d in b.d_list],
               "issue: 32 subsets": [(d, 32) for d in (8, 32, 128)]}
    if b.quick:
        regimes.pop("issue: 32 subsets")
    names = list(b.rules)
    defended = Defence("trusted")
    out: dict[str, Any] = {}
    for regime, pairs in regimes.items():
        print(f"\n{task.name}, {regime}: final accuracy (first epoch), {b.epochs} epochs; "
              f"D=1 is the same subsets with one unit in flight")
        head = f"{'D':>5s} {'subs':>5s} | {'D=1 paper':>13s} {'D=1 ' + REC:>17s} | " + \
            " ".join(f"{n:>13s}" for n in names) + f" | {REC + '+def':>17s} refused clipped"
        print(head)
        for d, ns in pairs:
            tr.task = task_at(b, task, d)
            base = {n: simulate(tr.task, tr, b.rules[n], 1, ns, b.epochs) for n in ("paper", REC)}
            res, zero = {}, {}
            for n, r in b.rules.items():
                before = dict(r.stats) if isinstance(r, SearchRule) else None
                res[n] = simulate(tr.task, tr, r, d, ns, b.epochs)
                if before is not None:  # the search: the share of results it gave step 0
                    zero[n] = (r.stats["zero"] - before["zero"]) / max(1, r.stats["results"] - before["results"])
            dfd = simulate(tr.task, tr, b.rules[REC], d, ns, b.epochs, defence=defended)
            tr.task = task
            refused = dfd.honest_rejected / max(1, dfd.honest)
            clipped = dfd.honest_clipped / max(1, dfd.honest)
            print(f"{d:5d} {ns:5d} | {cell(base['paper']):>13s} {cell(base[REC]):>17s} | " +
                  " ".join(f"{cell(res[n]):>13s}" for n in names) +
                  f" | {cell(dfd):>17s} {refused:6.1%} {clipped:6.1%}" +
                  "".join(f" | {n}: step 0 for {z:.0%}" for n, z in zero.items()), flush=True)
            key = f"{task.name}|{regime}|D={d}|subsets={ns}|local_epochs={task.local_epochs if b.local_epochs == 'task' else b.local_epochs}"
            out[key] = {"d1_paper": [base["paper"].final, base["paper"].first],
                        "d1_rec": [base[REC].final, base[REC].first],
                        **{n: [r.final, r.first] for n, r in res.items()},
                        "rec_defended": [dfd.final, dfd.first], "honest_refused": refused,
                        "honest_clipped": clipped, "mean_staleness": res[REC].mean_staleness,
                        **{f"{n}_zero_step_share": z for n, z in zero.items()},
                        "honest_cos_p99": float(np.quantile(dfd.honest_cos, 0.99)) if dfd.honest_cos else None}
    return out


def fedavg(task: Task, tr: VecTrainer, n_subsets: int, epochs: int, server_lr: float = 1.0) -> RunResult:
    """Synchronous FedAvg on the same subsets, unit length and client seeds: each epoch one
    round, every subset trained from the same server weights (no staleness at all), then
    ``W_s <- W_s + server_lr * mean(W_c - W_s)``. Not a rule a BOINC project can run
    (a round waits for its slowest host); the reference for what D parallel units per
    generation can reach, staleness aside."""
    t0 = time.perf_counter()
    subsets = split_shards(len(task.x), n_subsets, task.seed)
    ws = task.init().astype(np.float32).copy()
    res = RunResult(accs=[])
    for e in range(1, epochs + 1):
        out = tr.train([ws] * n_subsets, list(subsets), [unit_seed(task.seed, e, sh) for sh in range(n_subsets)])
        ws = (ws + server_lr * (out.astype(np.float64).mean(0) - ws)).astype(np.float32)
        res.accs.append(task.accuracy(ws))
        res.merges += n_subsets
    res.seconds = time.perf_counter() - t0
    return res


def sync_section(b: Bench, task: Task, tr: VecTrainer, server_lrs: list[float]) -> dict[str, Any]:
    """With subsets = D: one unit in flight, each rule at D in flight, and synchronous
    FedAvg (no staleness) at each server learning rate, in one run."""
    names = list(b.rules)
    print(f"\n{task.name}, subsets = D: final accuracy (first epoch), {b.epochs} epochs; D=1 is the same "
          f"subsets with one unit in flight ({REC}); sync is synchronous FedAvg, one round per epoch")
    print(f"{'D':>5s} | {'D=1':>13s} | " + " ".join(f"{n:>13s}" for n in names) + " | " +
          " ".join(f"{'sync lr ' + format(lr, 'g'):>13s}" for lr in server_lrs))
    out: dict[str, Any] = {}
    for d in b.d_list:
        tr.task = task_at(b, task, d)
        one = simulate(tr.task, tr, b.rules[REC] if REC in b.rules else candidate_rules()[REC], 1, d, b.epochs)
        res = {n: simulate(tr.task, tr, r, d, d, b.epochs) for n, r in b.rules.items()}
        syn = {lr: fedavg(tr.task, tr, d, b.epochs, lr) for lr in server_lrs}
        print(f"{d:5d} | {cell(one):>13s} | " + " ".join(f"{cell(res[n]):>13s}" for n in names) + " | " +
              " ".join(f"{cell(syn[lr]):>13s}" for lr in server_lrs), flush=True)
        key = f"{task.name}|subsets = D|D={d}|local_epochs={tr.task.local_epochs}"
        out[key] = {"d1": [one.final, one.first], **{n: [r.final, r.first] for n, r in res.items()},
                    **{f"sync_lr{lr:g}": [r.final, r.first, r.accs] for lr, r in syn.items()}}
        tr.task = task
    return out


def trained_start(task: Task, tr: VecTrainer, epochs: int, n_subsets: int = 32) -> RunResult:
    """A trained model to attack, with today's window and warm trusted statistics, from
    units of the attack run's size (the radius is a statistic of one job's units)."""
    return simulate(task, tr, candidate_rules()[REC], 1, n_subsets, epochs,
                    defence=Defence("none", replicate_p=1.0, observe_cos=True))


def poison_section(b: Bench, task: Task, tr: VecTrainer, d: int = 32, only: str = "", seed: int = 0,
                   reissue: int = 0) -> dict[str, Any]:
    """10% of units from colluding attackers, D = subsets = d (``only``: a comma list of
    the columns' defences to run, e.g. ``trusted0+ledger``; ``seed``: completion times,
    replication and which units the attackers run; ``reissue``: a refused result's unit is
    issued again up to this many times). The row ``lost`` loses the attackers' results
    whatever they hold: what refusing every one of them costs."""
    rules: dict[str, Any] = {**candidate_rules(), **b.rules}  # b.rules: search bound to the task
    rec = POISON_RULE
    configs = [("paper", "today"), (rec, "today"), (rec, "clip"), (rec, "trusted"), (rec, "trusted0"),
               (rec, "trusted0+ledger")]
    if only:
        configs = [c for c in configs if c[1] in only.split(",")]
    flip_target = trained_flip_target(task, tr)
    print(f"\n{task.name}: 10% colluding attackers, D = {d} in flight, {d} subsets, {b.epochs} epochs, "
          f"{REPLICATE_P:g} of honest results replicated"
          + (f" (trusted0: no warm epoch, spot checks: bootstrap, then 1 per {SPOT_EVERY} stale; Ns)" if SPOT_EVERY else "")
          + (f", refused units issued again up to {reissue}x" if reissue else "")
          + (f", seed {seed}" if seed else "")
          + ": final accuracy (first epoch) [attacker results "
          "accepted / sent] change from clean, honest refused")
    print(f"{'attack':10s} " + " ".join(f"{r + ' + ' + dk:>34s}" for r, dk in configs))
    print("(today: paper-era adaptive bound on ||wc - ws||; clip: trusted radius only; trusted: + first-order "
          "descent check; trusted0: + zeroth-order (held-out loss) check)")
    out: dict[str, Any] = {}
    clean = {}
    for attack in ("none", "lost") + ATTACKS:
        cells = []
        for rname, dk in configs:
            atk = None if attack == "none" else Attack("zeros" if attack == "lost" else attack, frac=0.1)
            r = simulate(task, tr, rules[rname], d, d, b.epochs, seed=seed, attack=atk, defence=defence_of(dk),
                         flip_target=flip_target, attack_lost=attack == "lost", reissue=reissue)
            if attack == "none":
                clean[(rname, dk)] = r.final
            drop = clean[(rname, dk)] - r.final
            out[f"{task.name}|D={d}|{attack}|{rname}|{dk}" + (f"|seed={seed}" if seed else "")] = {
                "final": r.final, "first": r.first, "drop_points": drop * 100,
                "attacker_accepted": r.attacker_accepted, "attacker": r.attacker,
                "honest_refused": r.honest_rejected / max(1, r.honest), "honest": r.honest,
                "honest_refused_n": r.honest_rejected, "honest_refused_by_ledger": r.honest_ledger,
                "ledger_unscored": r.ledger_unscored, "loss_unbounded": r.loss_unbounded,
                "spot_checks": r.spot_checks, "stale": r.stale, "units": r.honest + r.attacker,
                "reissued": r.reissued}
            cells.append(f"{cell(r)} [{r.attacker_accepted}/{r.attacker}] {drop * 100:+5.1f} {r.honest_rejected}h"
                         + (f" {r.loss_unbounded}b" if "trusted0" in dk else "")
                         + (f" {r.honest_ledger}L {r.ledger_unscored}u" if "+ledger" in dk else "")
                         + (f" {r.spot_checks}s" if r.spot_checks else "")
                         + (f" {r.reissued}r" if r.reissued else ""))
        print(f"{attack:10s} " + " ".join(f"{c:>34s}" for c in cells), flush=True)
    return out


def summarise_poison(cells: dict[str, Any]) -> None:
    """Each (dataset, D, attack, rule, defence) cell's points below the clean run over the
    seeds it ran with: mean and range (printed only for more than one seed)."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for key, c in cells.items():
        groups.setdefault(key.split("|seed=")[0], []).append(c)
    if all(len(v) < 2 for v in groups.values()):
        return
    print(f"\npoisoning over {max(len(v) for v in groups.values())} seeds: points below the clean run, mean "
          "[min, max]; attacker results accepted (mean); honest refused (total)")
    for key, cs in groups.items():
        drops = [c["drop_points"] for c in cs]
        print(f"  {key:52s} {np.mean(drops):+5.2f} [{min(drops):+5.1f}, {max(drops):+5.1f}]  "
              f"{np.mean([c['attacker_accepted'] for c in cs]):5.1f} accepted  "
              f"{sum(c['honest_refused_n'] for c in cs)} honest refused  "
              f"final {np.mean([c['final'] for c in cs]):.3f}")


def trained_flip_target(task: Task, tr: VecTrainer) -> np.ndarray:
    """The many-small-nudges target: a model trained on shifted labels (y+1 mod 10)."""
    all_idx = np.arange(len(task.x))
    return tr.train([task.init()], [all_idx], [4242], [True])[0]


def single_section(b: Bench, task: Task, tr: VecTrainer, cap: int, only: str = "", seed: int = 1) -> dict[str, Any]:
    """One patient attacker against a trained model: accepted attacker results needed to
    drop validation accuracy by 10 points (the issue measured 18-22 today)."""
    start = trained_start(task, tr, b.epochs)
    flip_target = trained_flip_target(task, tr)
    acc0 = task.accuracy(start.final_weights)
    print(f"\n{task.name}: one patient attacker from a trained model at {acc0:.4f}, D = 8 in flight, "
          f"32 subsets; attacker results accepted until -10 points (cap {cap} sent)")
    rec = POISON_RULE
    configs = [("paper", "today", "1:1"), ("paper", "today", "attacker only"),
               (rec, "trusted", "1:1"), (rec, "trusted0", "1:1"), (rec, "trusted0", "attacker only"),
               (rec, "trusted0+rep", "attacker only"), (rec, "trusted0+ledger", "1:1"),
               (rec, "trusted0+ledger", "attacker only"), (rec, "trusted0+rep+ledger", "attacker only")]
    if only:  # e.g. "trusted0+rep" or "trusted0/attacker only": defence names, optionally /pattern
        keep = [k.strip() for k in only.split(",") if k.strip()]
        configs = [c for c in configs if any(k in (c[1], f"{c[1]}/{c[2]}") for k in keep)]
    rules: dict[str, Any] = {**candidate_rules(), **b.rules}  # b.rules: search bound to the task
    out: dict[str, Any] = {}
    print(f"{'attack':10s} " + " ".join(f"{r + '+' + dk + ' ' + pat:>30s}" for r, dk, pat in configs))
    for attack in ATTACKS:
        cells = []
        for rname, dk, pat in configs:
            pattern = (lambda u: u % 2 == 0) if pat == "1:1" else (lambda u: True)
            # The attack run's epochs count from 1 again: the start's trusted values become
            # "epoch 0" (all before it), nothing frozen yet.
            radius = R.TrustedRadius.from_dict({"values": [(0, v) for _, v in start.trusted.values]},  # type: ignore[union-attr]
                                               factor=2.0)
            ct = start.cos_threshold
            fields = ("kind", "k", "offset", "fallback", "min_samples", "window", "freeze")
            cth = R.TrustedStatistic.from_dict({"values": [(0, v) for _, v in ct.values]},  # type: ignore[union-attr]
                                               **{f: getattr(ct, f) for f in fields})
            lt = start.loss_threshold
            lth = R.TrustedStatistic.from_dict({"values": [(0, v) for _, v in lt.values]},  # type: ignore[union-attr]
                                               **{f: getattr(lt, f) for f in fields})
            r = simulate(task, tr, rules[rname], 8, 32, epochs=10_000, seed=seed,
                         attack=Attack(attack, pattern=pattern),
                         defence=defence_of(dk),
                         init=start.final_weights, stop_drop=0.10, max_attacker=cap, radius=radius,
                         today_window=start.today_window, flip_target=flip_target, cos_threshold=cth,
                         loss_threshold=lth, trusted_loss=[(0, v, bl) for _, v, bl in start.trusted_loss])
            hit = r.attacker_to_drop
            txt = (f"{hit} of {r.attacker}" if hit is not None
                   else f">{r.attacker_accepted} acc. of {r.attacker} ({r.final - acc0:+.3f})")
            if "+rep" in dk:
                txt += f" {r.attacker_caught}c/{r.attacker_honest}h"
            if "+ledger" in dk:
                txt += f" {r.attacker_ledger}L"
            cells.append(txt)
            out[f"{task.name}|{attack}|{rname}|{dk}|{pat}" + (f"|seed={seed}" if seed != 1 else "")] = {
                "accepted_to_drop_10": hit, "attacker_sent": r.attacker, "attacker_accepted": r.attacker_accepted,
                "attacker_caught_by_replica": r.attacker_caught, "attacker_honest_units": r.attacker_honest,
                "attacker_refused_by_ledger": r.attacker_ledger, "honest_refused_by_ledger": r.honest_ledger,
                "honest": r.honest, "honest_refused": r.honest_rejected,
                "acc_change": r.final - acc0}
        print(f"{attack:10s} " + " ".join(f"{c:>30s}" for c in cells), flush=True)
    return out


def latency_section(n: int = 4_972_746, shards: int = 16, repeats: int = 9) -> dict[str, Any]:
    """numpy cost per merge at the paper's model size: the paper's combine vs the
    recommended rule with clipping and the descent check, plus reading the base file.
    The minimum of ``repeats`` runs: on a shared, loaded machine the minimum is the cost,
    the rest is waiting for a core."""
    import tempfile

    from boinc_dl.server.assimilator.core import merge_into
    from boinc_dl.server.common.weights import (
        WeightsFile,
        fingerprint_of,
        read_weights,
        write_weights,
    )

    rng = np.random.default_rng(0)
    ws0 = rng.normal(size=n).astype(np.float32)
    wc = ws0 + rng.normal(scale=0.01, size=n).astype(np.float32)
    wb = ws0 + rng.normal(scale=0.01, size=n).astype(np.float32)
    g = rng.normal(size=n).astype(np.float32)
    bounds = list(R.iter_bounds(n, shards))
    rule = candidate_rules()[REC]
    fp = fingerprint_of(["flat"], [np.zeros(n, np.float32)])
    tmp = Path(tempfile.mkdtemp(prefix="bdl-mr-"))
    write_weights(tmp / "base.h5", WeightsFile(wb, fp))

    def med(fn: Callable[[], Any]) -> float:
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return float(np.min(ts)) * 1e3

    def paper() -> None:
        ws = ws0.copy()
        for sl in bounds:
            merge_into(ws[sl], wc[sl], 0.5)

    def today_check() -> None:
        float(np.linalg.norm(wc - ws0))

    scratch = np.empty(n // shards + 1, np.float32)

    def rec() -> None:
        ws = ws0.copy()
        sc = R.clip_scale(R.update_norm(wc, wb), 1.0)
        for sl in bounds:
            rule.apply(ws[sl], wc[sl], wb[sl], 31, None, sc, scratch[: sl.stop - sl.start])

    copy_ms = med(lambda: ws0.copy())
    out = {"params": n, "shards": shards,
           "paper_combine_ms": med(paper) - copy_ms,
           "today_distance_check_ms": med(today_check),
           "rec_combine_with_clip_ms": med(rec) - copy_ms,
           "update_norm_ms": med(lambda: R.update_norm(wc, wb)),
           "descent_dot_ms": med(lambda: R.descent_cosine_parts(g, wc, wb)),
           "read_base_file_ms": med(lambda: read_weights(tmp / "base.h5", expected=fp))}
    for f in tmp.iterdir():
        f.unlink()
    tmp.rmdir()
    return out


def local_epochs_arg(text: str) -> str:
    """``--local-epochs``: task, derived, or a number of local epochs >= 1."""
    if text in ("task", "derived") or (text.isdigit() and int(text) >= 1):
        return text
    raise argparse.ArgumentTypeError(f"task, derived or a number >= 1, not {text!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="digits only, fewer rules: a few minutes")
    ap.add_argument("--datasets", default=None, help="comma list of digits,mnist (default: both; quick: digits)")
    ap.add_argument("--rules", default=None, help="comma list of rule names (default: all candidates)")
    ap.add_argument("--D", default=None, help="units in flight (default 8,32,128,1000; quick: 8,32,128; the poison "
                    "section: 32)")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--local-epochs", default="task", type=local_epochs_arg,
                    help="task: the task's own (digits 2, MNIST 1, the issue's setting); derived: what a job "
                         "with D units in flight gets by default (4 to 16); a number: that many at every D")
    ap.add_argument("--search-buffer", type=int, default=1,
                    help="the step search on the sum of this many results at a time (a variant measured against "
                         "the product's one result at a time; 1: the product's)")
    ap.add_argument("--search-multipliers", default=None,
                    help="the step search's candidate steps as multiples of delta's weight, comma list "
                         "(default: the product's, " + ",".join(f"{m:g}" for m in R.SEARCH_MULTIPLIERS) + ")")
    ap.add_argument("--search-batch", type=int, default=SEARCH_BATCH,
                    help="training examples the step search judges each result on (the product's "
                         "vcasgd.search_batch; its pool is 16 times as many)")
    ap.add_argument("--mnist-train", type=int, default=12000, help="MNIST training images used")
    ap.add_argument("--task-seed", type=int, default=Task.seed,
                    help="the task's seed: its subsets, batch orders and the search's samples")
    ap.add_argument("--sections", default="staleness,poison,single,cost",
                    help="comma list of staleness, sync (synchronous FedAvg beside the rules, subsets = D), "
                         "poison, single, cost")
    ap.add_argument("--sync-lrs", default="1,2", help="sync section: comma list of FedAvg's server learning rates")
    ap.add_argument("--single-cap", type=int, default=None,
                    help="attacker results sent at most, single attacker (default 300; quick: 100)")
    ap.add_argument("--single-only", default="",
                    help="single attacker: only these defences (comma list of e.g. trusted0+rep or "
                         "'trusted0/attacker only')")
    ap.add_argument("--single-seeds", default="1", help="single attacker: comma list of seeds (completion "
                    "order, replication draws)")
    ap.add_argument("--replicate-p", type=float, default=0.2,
                    help="share of honest results replicated (trusted) after the first epoch (a mature BOINC "
                         "project's spot checks: 0.05)")
    ap.add_argument("--ledger-base-ratio", type=float, default=R.LossLedger.base_ratio,
                    help="the ledger's reference: trusted changes from bases of held-out loss at most this many "
                         "times the result's base loss (inf: the latest ones, whatever their base)")
    ap.add_argument("--poison-only", default="", help="poisoning section: only the columns with these defences "
                    "(comma list, e.g. trusted0+ledger)")
    ap.add_argument("--poison-seeds", default="0", help="poisoning section: comma list of seeds (completion "
                    "times, replication, the attackers' units); more than one prints each cell's mean and range")
    ap.add_argument("--poison-rule", default="delta-cap", choices=("delta-cap", "search"),
                    help="poisoning and single-attacker sections: the merge rule of the defended columns "
                         "(delta-cap: the default below 32 units in flight; search: from 32)")
    ap.add_argument("--reissue-refused", type=int, default=2, help="poisoning section: issue a refused "
                    "result's unit again, at most this many times, as the BOINC job system does "
                    "(validation.reissue_refused, 2); 0: its subset is given up for the epoch")
    ap.add_argument("--spot-every", type=int, default=0,
                    help="the work generator's spot checks with the loss check (validation.loss_check_spot_every; "
                         "replaces the warm epoch): 0 off")
    ap.add_argument("--ledger-window", type=int, default=R.LossLedger.window,
                    help="trusted changes the ledger scores against (the latest comparable ones)")
    ap.add_argument("--ledger-slack", type=float, default=R.LossLedger.slack, help="the ledger's slack "
                    "(validation.loss_ledger_slack)")
    ap.add_argument("--ledger-limit", type=float, default=R.LossLedger.limit, help="the ledger's limit "
                    "(validation.loss_ledger_limit)")
    ap.add_argument("--ledger-z-cap", type=float, default=R.LossLedger.z_cap,
                    help="the most one result's score adds to its host's balance, plus the slack (inf: no cap)")
    ap.add_argument("--bound-base-ratio", type=float, default=R.BOUND_BASE_RATIO,
                    help="the per-result bound's comparable ratio (rules.BOUND_BASE_RATIO; the ledger's is "
                         "--ledger-base-ratio)")
    ap.add_argument("--spot-rule", choices=("stale", "fresh"), default="stale",
                    help="spot checks: after N results judged since the last trusted one (fresh) or N judged "
                         "against stale trusted changes (stale: the work generator's rule)")
    ap.add_argument("--check-trainer", action="store_true", help="also compare with Keras on one unit")
    args = ap.parse_args()
    global REPLICATE_P, LEDGER, SPOT_EVERY, SPOT_RULE, BOUND_RATIO, POISON_RULE
    BOUND_RATIO = args.bound_base_ratio
    POISON_RULE = args.poison_rule
    REPLICATE_P = args.replicate_p
    SPOT_EVERY = args.spot_every
    SPOT_RULE = args.spot_rule
    LEDGER = R.LossLedger(base_ratio=args.ledger_base_ratio, window=args.ledger_window, z_cap=args.ledger_z_cap,
                          slack=args.ledger_slack, limit=args.ledger_limit)
    t0 = time.perf_counter()
    allr = all_rules()
    if args.rules:
        names = [n for n in args.rules.split(",") if n]
    elif args.quick:
        names = ["paper", "fedasync-poly", "fedbuff", REC]
    else:  # the oracle is a ceiling to measure against, named with --rules
        names = [n for n in allr if n != "oracle"]
    for must in ("paper", REC) + (("search",) if args.poison_rule == "search" else ()):
        if must not in names:
            names.insert(0, must)
    datasets = (args.datasets or ("digits" if args.quick else "digits,mnist")).split(",")
    sections = set(args.sections.split(","))
    d_list = args.D or ("8,32,128" if args.quick else "8,32,128,1000")
    cap = args.single_cap or (100 if args.quick else 300)
    if args.search_batch < 1:
        ap.error("--search-batch must be >= 1")
    if args.search_multipliers or args.search_buffer > 1 or args.search_batch != SEARCH_BATCH:
        mult = tuple(float(m) for m in args.search_multipliers.split(",")) if args.search_multipliers \
            else R.SEARCH_MULTIPLIERS
        allr = {n: (SearchRule(batch=args.search_batch, fixed_sample=r.fixed_sample, multipliers=mult,
                               buffer_k=args.search_buffer)
                    if isinstance(r, SearchRule) and not isinstance(r, OracleRule) else r) for n, r in allr.items()}
    b = Bench(args.quick, args.epochs, {n: allr[n] for n in names}, [int(x) for x in d_list.split(",")],
              local_epochs=args.local_epochs)
    print(f"merge rules bench, {time.strftime('%Y-%m-%d %H:%M')}, load {os.getloadavg()[0]:.1f}, "
          f"{machine()}, TF threads {THREADS}")
    print("rules: " + "; ".join(f"{n} = {r.describe()}" for n, r in b.rules.items()))
    result: dict[str, Any] = {"quick": args.quick, "epochs": args.epochs,
                              "rules": {n: r.describe() for n, r in b.rules.items()},
                              "recommended": REC}
    for ds in datasets:
        task = replace(load_task(ds, args.epochs, args.mnist_train), seed=args.task_seed)
        tr = VecTrainer(task)
        b.rules = {n: (r.bound(task) if isinstance(r, SearchRule) else r) for n, r in b.rules.items()}
        print(f"\n== {ds}: {len(task.x)} training / {len(task.xv)} validation examples, MLP {task.d}-{task.hidden}-"
              f"{task.classes} ({task.n} parameters), Adam lr {task.lr}, batch {task.batch}, "
              f"{task.local_epochs} local epoch(s)")
        if args.check_trainer:
            diff = check_trainer(task, tr)
            print(f"vectorised trainer vs Keras on one unit: max |difference| {diff:.2e}")
            result[f"{ds}_trainer_vs_keras_max_abs"] = diff
        if "staleness" in sections:
            result[f"{ds}_staleness"] = staleness_section(b, task, tr)
        if "sync" in sections:
            result[f"{ds}_sync"] = sync_section(b, task, tr, [float(x) for x in args.sync_lrs.split(",")])
        if "poison" in sections:
            result[f"{ds}_poison"] = {}
            for d in ([int(x) for x in args.D.split(",")] if args.D else [32]):
                for seed in (int(x) for x in args.poison_seeds.split(",")):
                    result[f"{ds}_poison"].update(poison_section(b, task, tr, d, args.poison_only, seed,
                                                                 args.reissue_refused))
            summarise_poison(result[f"{ds}_poison"])
        if "single" in sections:
            result[f"{ds}_single"] = {}
            for seed in (int(x) for x in args.single_seeds.split(",")):
                print(f"\n(seed {seed})")
                result[f"{ds}_single"].update(single_section(b, task, tr, cap, args.single_only, seed))
        print(f"[{ds}: {tr.units_trained} units trained in {tr.calls} batches, {tr.seconds:.0f} s of training]")
    if "cost" in sections:
        lat = latency_section()
        print("\nnumpy per merge at 4,972,746 parameters in 16 shards (ms, min of 9): "
              + ", ".join(f"{k} {v:.1f}" for k, v in lat.items() if k.endswith("_ms")))
        result["latency"] = lat
    result["wall_s"] = time.perf_counter() - t0
    emit("merge_rules", **result)


if __name__ == "__main__":
    main()
