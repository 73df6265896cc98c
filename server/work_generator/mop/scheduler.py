"""The MOP scheduler: randomized, replica-aware and fault-tolerant (Cerebro, PVLDB 2020).

Model hopper parallelism (MOP) trains a set S of models on ``p`` data partitions. A
*training unit* ``(model, partition)`` trains one model for one sub-epoch on one partition.
Per epoch the scheduler keeps the four invariants of Cerebro (PVLDB 2020, section 3.1):

* **completeness** -- every model trains on every partition exactly once per epoch;
* **model isolation** -- never two units of one model in flight (a model "hops");
* **worker/partition exclusivity** -- one unit per worker slot at a time, and a unit only
  goes to a worker that holds its partition (the availability map);
* **non-preemption** -- a unit is never split; a unit lost with its worker restarts from the
  model's last weights.

Policies (all keep the invariants; lost units go back from Q' (in flight) to Q (to do), as
in section 5.6):

* ``"random"`` -- Algorithm 1 verbatim: an idle worker gets a unit drawn uniformly at random
  among the units ``(i, j)`` still to do this epoch whose model ``i`` is idle and whose
  partition ``j`` the worker holds (line 10, with the replica-aware change of section 5.5).
* ``"random-matching"`` (default) -- still a random choice among eligible units, but only
  among the most *critical* ones: a unit ``(i, j)`` ranks by ``max(left_i, pressure_j)``
  where ``left_i`` is the number of units model ``i`` still has to do this epoch and
  ``pressure_j`` the units left on partition ``j`` per worker holding it; and when several
  workers are idle at once, a maximum matching of idle workers to idle models so that as
  many units as possible start. In our simulation of section 5.4 plain ``"random"`` is
  9-13% above the lower bound with |S|=16 homogeneous configs (the last rounds cannot be
  packed) and 8-30% above it with replicas (fast workers drain their own partitions while
  slow replicas fall behind); this variant stays within 0-3% on average without replicas
  and 3-10% with them (``bench/bench_mop_scheduler.py``).
* ``"fifo"`` -- a naive baseline: the first eligible unit in a fixed (model, partition)
  order.

Two ways to drive it
--------------------

*Push* (a scheduler that knows its workers, as in Cerebro or the simulator)::

    s = MOPScheduler(models, n_partitions=4,
                     availability=round_robin_availability(["w0", "w1"], 4), seed=7)
    s.start_epoch()
    for a in s.assign(["w0", "w1"]):         # Assignment(model, partition, worker, ...)
        run(a)
    s.complete(a.model, a.partition, attempt=a.attempt)   # or s.fail(...) if it was lost
    ...                                        # until s.epoch_done(), then start_epoch()

A *worker* is one execution slot: a host with T slots is registered as T workers holding the
same partitions.

*Pull* (BOINC, where hosts ask for work and the work generator never sees hosts)::

    for a in s.issue(max_units=8):            # a.worker is None
        create_workunit(a)                     # partition a.partition as a <sticky/> file

:meth:`runnable` answers "which units may exist now": for every model with no unit in flight,
its partitions still to do this epoch. :meth:`issue` picks at most one of them per model
(randomly), and at most ``partition_capacity[j]`` units of partition ``j`` at once (by default
the number of workers that hold ``j``, unlimited when the availability is unknown). Because
the partition is a sticky file, BOINC's locality scheduling sends a unit to a host that
already caches its partition; the model-isolation invariant is kept by issuing the next unit
of a model only after :meth:`complete` (or :meth:`fail`, on a timeout or error) of the last.

Results arrive at least once and late originals of re-issued units still arrive: every
:class:`Assignment` carries an ``attempt`` number, and :meth:`complete` / :meth:`fail` return
``False`` (and change nothing) for a result that does not match the unit in flight -- a
duplicate, or a stale attempt whose model has moved on. The caller must then discard it.

State and restarts
------------------

:meth:`to_state` returns a JSON-serialisable dict (Q, Q', attempts, visit orders, completion
log and the random generator's state); :meth:`from_state` rebuilds an identical scheduler, so
a work generator restarted mid-epoch continues with the same future choices and without
duplicating or skipping units. Units in flight at the time of the snapshot stay in flight:
their results are accepted after the restart.

Reproducibility: :meth:`visit_order` gives each model's partition order per epoch (the order
of completed units, which by model isolation is the order of training).

API at a glance
---------------

* ``MOPScheduler(models, n_partitions, availability | None, seed=0, policy="random-matching",
  partition_capacity=None)``
* epochs: ``start_epoch(models=None) -> int``, ``epoch_done()``, ``drop_model(m)``
* push: ``assign(idle_workers) -> list[Assignment]``; pull: ``runnable()``,
  ``issue(max_units) -> list[Assignment]``, ``capacity(j)``
* results: ``complete(m, j, attempt=None, epoch=None) -> bool``, ``fail(...) -> bool``
* workers: ``add_worker(w, partitions)``, ``remove_worker(w) -> lost units``,
  ``unservable() -> partitions nobody holds``
* introspection: ``in_flight()``, ``pending()``, ``busy_workers()``, ``visit_order(m, e)``,
  ``visit_orders(e)``, ``completed()``
* state: ``to_state() -> dict`` (JSON), ``MOPScheduler.from_state(dict)``

Cost: a decision at |S|=256, p=16 takes ~20 us (one idle worker) and ~25 us per unit when
16 workers are idle at once; the JSON state is ~130 KiB mid-epoch at that size.

This module is kept whole (about 550 lines, most of it this description and the one
class): the queues Q/Q', the in-flight units and their recovery are one state machine
and read best together. The batch matching is in :mod:`.matching`, what it hands out
in :mod:`.assignment`.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping

from boinc_dl.server.work_generator.mop.assignment import (
    Assignment,
    SchedulerError,
)
from boinc_dl.server.work_generator.mop.matching import match_batch

STATE_FORMAT = 1
POLICIES = ("random", "random-matching", "fifo")


class MOPScheduler:
    """Randomized MOP scheduler (Algorithms 1-2 of Cerebro) with replicas and Q/Q' recovery.

    Args:
        models: model ids of S, in a fixed order (ids must be unique non-empty strings).
        n_partitions: ``p``, the number of data partitions.
        availability: worker -> partitions it holds. ``None`` means unknown (pure pull mode:
            :meth:`assign` is unavailable and partitions have no capacity limit).
        seed: seeds the random choices; same seed + same calls = same schedule.
        policy: ``"random-matching"`` (default), ``"random"`` (Algorithm 1 verbatim) or
            ``"fifo"`` (naive baseline); see the module docstring.
        partition_capacity: pull mode only; max units of partition ``j`` in flight at once.
            Default: the number of workers holding ``j`` (unlimited if availability is None).
    """

    def __init__(
        self,
        models: Iterable[str],
        n_partitions: int,
        availability: Mapping[str, Iterable[int]] | None,
        seed: int = 0,
        policy: str = "random-matching",
        partition_capacity: Mapping[int, int] | None = None,
    ) -> None:
        if not isinstance(n_partitions, int) or n_partitions < 1:
            raise SchedulerError(f"n_partitions must be a positive integer, got {n_partitions!r}")
        if policy not in POLICIES:
            raise SchedulerError(f"unknown policy {policy!r}; choose one of {POLICIES}")
        self.n_partitions = n_partitions
        self.policy = policy
        self.seed = seed
        self._rng = random.Random(seed)
        self._models: list[str] = self._check_models(models)
        self._avail: dict[str, list[int]] | None = None
        if availability is not None:
            self._avail = {}
            for w, parts in availability.items():
                self._avail[str(w)] = self._check_parts(parts, f"worker {w!r}")
        self._capacity: dict[int, int] | None = (
            {int(j): int(c) for j, c in partition_capacity.items()}
            if partition_capacity is not None
            else None
        )
        self.epoch = 0
        # Q: per partition, the models whose unit on it is still to do (dicts as ordered sets,
        # so iteration order -- hence the schedule -- does not depend on string hashing).
        self._pending: list[dict[str, None]] = [{} for _ in range(n_partitions)]
        self._n_pending = 0
        self._left: dict[str, int] = {}  # model -> its units in Q (remaining work proxy)
        self._inflight: dict[str, Assignment] = {}  # Q': model -> its unit in flight
        self._busy: dict[str, str] = {}  # worker -> model it is training
        self._part_load = [0] * n_partitions  # units in flight per partition
        self._attempts: dict[str, dict[int, int]] = {}
        self._visits: dict[int, dict[str, list[int]]] = {}
        self._log: list[Assignment] = []  # completed units of the current epoch, in order
        # Per-model epochs (pipelining, :meth:`advance_model`): models ahead of ``epoch`` only.
        self._ahead: dict[str, int] = {}

    # ------------------------------------------------------------------ validation helpers
    @staticmethod
    def _check_models(models: Iterable[str]) -> list[str]:
        ms = list(models)
        for m in ms:
            if not isinstance(m, str) or not m:
                raise SchedulerError(f"model ids must be non-empty strings, got {m!r}")
        if len(set(ms)) != len(ms):
            dup = sorted({m for m in ms if ms.count(m) > 1})
            raise SchedulerError(f"duplicate model ids: {dup}")
        return ms

    def _check_parts(self, parts: Iterable[int], what: str) -> list[int]:
        out = sorted({int(j) for j in parts})
        bad = [j for j in out if not 0 <= j < self.n_partitions]
        if bad:
            raise SchedulerError(f"{what} holds partitions {bad} outside [0, {self.n_partitions})")
        return out

    def _check_unit(self, partition: int) -> None:
        if not isinstance(partition, int) or not 0 <= partition < self.n_partitions:
            raise SchedulerError(f"partition {partition!r} outside [0, {self.n_partitions})")

    # ------------------------------------------------------------------ epochs and models
    @property
    def models(self) -> list[str]:
        """The models of S in the current epoch (after any :meth:`drop_model`)."""
        return list(self._models)

    def start_epoch(self, models: Iterable[str] | None = None) -> int:
        """Begin the next epoch with ``models`` (default: the current S); returns its number.

        AutoML procedures change S only here, at epoch boundaries (Cerebro section 4.2).
        Raises if the current epoch still has units to do or in flight.
        """
        if self.epoch > 0 and not self.epoch_done():
            raise SchedulerError(
                f"epoch {self.epoch} is not finished: {self._n_pending} units to do, "
                f"{len(self._inflight)} in flight"
            )
        if models is not None:
            self._models = self._check_models(models)
        if not self._models:
            raise SchedulerError("cannot start an epoch with no models")
        self.epoch += 1
        self._pending = [dict.fromkeys(self._models) for _ in range(self.n_partitions)]
        self._n_pending = len(self._models) * self.n_partitions
        self._left = dict.fromkeys(self._models, self.n_partitions)
        self._attempts = {m: {} for m in self._models}
        self._visits[self.epoch] = {m: [] for m in self._models}
        self._log = []
        self._ahead = {}
        return self.epoch

    # ------------------------------------------------------------------ per-model epochs
    def model_epoch(self, model: str) -> int:
        """The epoch ``model`` is in (ahead of :attr:`epoch` once :meth:`advance_model` ran)."""
        return self._ahead.get(model, self.epoch)

    def model_finished(self, model: str) -> bool:
        """True when ``model`` has no unit left to do or in flight in its epoch."""
        return self._left.get(model, 0) == 0 and model not in self._inflight

    def advance_model(self, model: str) -> int:
        """Pipelining: start ``model``'s next epoch now, without waiting for the others.

        For searches that decide nothing at epoch boundaries (grid, random): the model's
        units of the next epoch become runnable at once. The invariants hold per model
        (each partition once per model-epoch, one unit per model in flight). Returns the
        model's new epoch. Raises if the model still has work in its current epoch.
        """
        if model not in self._models:
            raise SchedulerError(f"unknown model {model!r}")
        if not self.model_finished(model):
            raise SchedulerError(f"model {model!r} has not finished epoch {self.model_epoch(model)}")
        e = self.model_epoch(model) + 1
        self._ahead[model] = e
        for q in self._pending:
            q[model] = None
        self._n_pending += self.n_partitions
        self._left[model] = self.n_partitions
        self._attempts[model] = {}
        self._visits.setdefault(e, {})[model] = []
        return e

    def epoch_done(self) -> bool:
        """True when every unit of the epoch has completed (Q and Q' both empty)."""
        return self.epoch > 0 and self._n_pending == 0 and not self._inflight

    def drop_model(self, model: str) -> Assignment | None:
        """Remove ``model`` from S now (e.g. its configuration failed to build).

        Its remaining units are forgotten; its unit in flight, if any, is returned so the
        caller can cancel it (a result for it later is rejected as stale).
        """
        if model not in self._models:
            raise SchedulerError(f"unknown model {model!r}")
        self._models.remove(model)
        for q in self._pending:
            if q.pop(model, 0) is None:
                self._n_pending -= 1
        self._left.pop(model, None)
        self._ahead.pop(model, None)
        a = self._inflight.pop(model, None)
        if a is not None:
            self._release(a)
        return a

    # ------------------------------------------------------------------ workers
    @property
    def workers(self) -> dict[str, list[int]]:
        """The availability map (worker -> sorted partitions); empty dict if unknown."""
        return {w: list(p) for w, p in (self._avail or {}).items()}

    def add_worker(self, worker: str, partitions: Iterable[int]) -> None:
        """Register (or update) a worker slot holding ``partitions`` (elasticity, section 5.6)."""
        if self._avail is None:
            self._avail = {}
        self._avail[str(worker)] = self._check_parts(partitions, f"worker {worker!r}")

    def remove_worker(self, worker: str) -> list[Assignment]:
        """Forget a lost worker; its unit in flight goes back to Q. Returns the lost units.

        Its partitions stay servable through any replicas (:meth:`unservable` lists the
        partitions left with units to do and no worker holding them).
        """
        if self._avail is None or worker not in self._avail:
            raise SchedulerError(f"unknown worker {worker!r}")
        del self._avail[worker]
        lost = []
        m = self._busy.get(worker)
        if m is not None:
            a = self._inflight[m]
            self._requeue(a)
            lost.append(a)
        return lost

    def unservable(self) -> list[int]:
        """Partitions with units still to do that no known worker holds (the epoch would stall)."""
        if self._avail is None:
            return []
        held = {j for ps in self._avail.values() for j in ps}
        return [j for j in range(self.n_partitions) if self._pending[j] and j not in held]

    # ------------------------------------------------------------------ scheduling
    def assign(self, idle_workers: Iterable[str]) -> list[Assignment]:
        """Push mode: give each idle worker a unit if one is eligible (Algorithm 1, lines 6-15).

        Workers are served in random order (policy ``random``) or the given order (``fifo``).
        A worker that is unknown or already running a unit is an error.
        """
        if self._avail is None:
            raise SchedulerError("assign() needs an availability map; use issue() in pull mode")
        ws = list(dict.fromkeys(idle_workers))
        for w in ws:
            if w not in self._avail:
                raise SchedulerError(f"unknown worker {w!r}")
            if w in self._busy:
                raise SchedulerError(f"worker {w!r} is already running {self._busy[w]!r}")
        if self.policy != "fifo" and len(ws) > 1:
            self._rng.shuffle(ws)
        if self.policy == "random-matching":
            batch = match_batch(ws, self._models, self._avail, self._pending,  # type: ignore[arg-type]
                                self._inflight, self._left, self._holder_counts(), self._rng)
            return [self._dispatch(m, j, w) for w, m, j in batch]
        out = []
        for w in ws:
            unit = self._pick_for_worker(w)
            if unit is not None:
                out.append(self._dispatch(unit[0], unit[1], w))
        return out

    def _holder_counts(self) -> list[int]:
        h = [0] * self.n_partitions
        for ps in (self._avail or {}).values():
            for j in ps:
                h[j] += 1
        return h

    def _pick_for_worker(self, worker: str) -> tuple[str, int] | None:
        inflight = self._inflight
        if self.policy == "fifo":
            for j in self._avail[worker]:  # type: ignore[index]
                for m in self._pending[j]:
                    if m not in inflight:
                        return m, j
            return None
        # Uniform over eligible units == shuffle(Q) then first eligible (Algorithm 1, l. 8-10).
        cands = [
            (m, j)
            for j in self._avail[worker]  # type: ignore[index]
            for m in self._pending[j]
            if m not in inflight
        ]
        if not cands:
            return None
        return cands[self._rng.randrange(len(cands))]

    def runnable(self) -> dict[str, list[int]]:
        """Which units may exist now: model -> its partitions still to do, for idle models.

        A model with a unit in flight is absent (model isolation). Partition capacity is not
        applied here; :meth:`issue` applies it.
        """
        out: dict[str, list[int]] = {}
        for j, q in enumerate(self._pending):
            for m in q:
                if m not in self._inflight:
                    out.setdefault(m, []).append(j)
        return {m: out[m] for m in self._models if m in out}

    def capacity(self, partition: int) -> int | None:
        """Max units of ``partition`` in flight at once in pull mode (None = unlimited)."""
        if self._capacity is not None and partition in self._capacity:
            return self._capacity[partition]
        if self._avail is None:
            return None
        return sum(1 for ps in self._avail.values() if partition in ps)

    def issue(self, max_units: int | None = None) -> list[Assignment]:
        """Pull mode: pick up to ``max_units`` units to create now and mark them in flight.

        At most one unit per model. ``random``: models in random order, a partition with
        spare capacity drawn at random. ``random-matching``: models with the most units left
        first, each on its most pressed partition with spare capacity (units left per unit of
        capacity), ties at random. ``fifo``: S's order, lowest partition. ``worker=None``.
        """
        run = self.runnable()
        models = list(run)
        caps = [self.capacity(j) for j in range(self.n_partitions)]
        if self.policy == "random":
            self._rng.shuffle(models)
        elif self.policy == "random-matching":
            rank = {m: self._rng.random() for m in models}
            # Models behind (pipelining) first: they hold back the oldest open epoch.
            models.sort(key=lambda m: (self.model_epoch(m), -self._left[m], rank[m]))
        out: list[Assignment] = []
        for m in models:
            if max_units is not None and len(out) >= max_units:
                break
            parts = [j for j in run[m] if caps[j] is None or self._part_load[j] < caps[j]]  # type: ignore[operator]
            if not parts:
                continue
            if self.policy == "fifo":
                j = parts[0]
            else:
                if self.policy == "random-matching":
                    press = [len(self._pending[j]) / (caps[j] or 1) for j in parts]
                    top = max(press)
                    parts = [j for j, pr in zip(parts, press, strict=True) if pr == top]
                j = parts[self._rng.randrange(len(parts))]
            out.append(self._dispatch(m, j, None))
        return out

    def _dispatch(self, model: str, partition: int, worker: str | None) -> Assignment:
        del self._pending[partition][model]  # Q -> Q'
        self._n_pending -= 1
        self._left[model] -= 1
        att = self._attempts[model]
        att[partition] = att.get(partition, 0) + 1
        a = Assignment(model, partition, worker, att[partition], self.model_epoch(model))
        self._inflight[model] = a
        self._part_load[partition] += 1
        if worker is not None:
            self._busy[worker] = model
        return a

    def _release(self, a: Assignment) -> None:
        self._part_load[a.partition] -= 1
        if a.worker is not None and self._busy.get(a.worker) == a.model:
            del self._busy[a.worker]

    def _requeue(self, a: Assignment) -> None:
        del self._inflight[a.model]
        self._release(a)
        self._pending[a.partition][a.model] = None  # Q' -> Q (section 5.6)
        self._n_pending += 1
        self._left[a.model] += 1

    def _match(
        self, model: str, partition: int, attempt: int | None, epoch: int | None
    ) -> Assignment | None:
        self._check_unit(partition)
        a = self._inflight.get(model)
        if a is None or a.partition != partition:
            return None
        if attempt is not None and attempt != a.attempt:
            return None
        if epoch is not None and epoch != a.epoch:
            return None
        return a

    def complete(
        self, model: str, partition: int, attempt: int | None = None, epoch: int | None = None
    ) -> bool:
        """A unit finished (Algorithm 2): its model and worker become idle.

        Returns ``False`` and changes nothing if the unit is not the one in flight for that
        model -- a duplicate, a stale attempt, a result of an earlier epoch, or of a model no
        longer in S: the caller must discard that result. Pass the ``attempt`` and ``epoch``
        of the :class:`Assignment` the result was produced for, so none of these slips by.
        """
        a = self._match(model, partition, attempt, epoch)
        if a is None:
            return False
        del self._inflight[model]
        self._release(a)
        self._visits[a.epoch][model].append(partition)
        self._log.append(a)
        return True

    def fail(
        self, model: str, partition: int, attempt: int | None = None, epoch: int | None = None
    ) -> bool:
        """A unit was lost (error, timeout, reclaimed VM): it goes back to Q for a later retry.

        Returns ``False`` if it is not the unit in flight (nothing to do).
        """
        a = self._match(model, partition, attempt, epoch)
        if a is None:
            return False
        self._requeue(a)
        return True

    # ------------------------------------------------------------------ introspection
    def in_flight(self) -> list[Assignment]:
        """Units handed out and not yet completed or failed (Q')."""
        return list(self._inflight.values())

    def pending(self) -> list[tuple[str, int]]:
        """Units still to do this epoch and not in flight (Q), in a stable order."""
        return [(m, j) for j, q in enumerate(self._pending) for m in q]

    def busy_workers(self) -> dict[str, str]:
        """worker -> model it is training (push mode)."""
        return dict(self._busy)

    def visit_order(self, model: str, epoch: int | None = None) -> list[int]:
        """Partitions ``model`` trained on, in order, in ``epoch`` (default: current)."""
        e = self.epoch if epoch is None else epoch
        if e not in self._visits or model not in self._visits[e]:
            raise SchedulerError(f"no visit order for model {model!r} in epoch {e}")
        return list(self._visits[e][model])

    def visit_orders(self, epoch: int | None = None) -> dict[str, list[int]]:
        """All models' visit orders in ``epoch`` (default: current)."""
        e = self.epoch if epoch is None else epoch
        return {m: list(v) for m, v in self._visits.get(e, {}).items()}

    def completed(self) -> list[Assignment]:
        """Units completed in the current epoch, in completion order (the schedule log)."""
        return list(self._log)

    # ------------------------------------------------------------------ state
    def to_state(self) -> dict:
        """A JSON-serialisable snapshot; :meth:`from_state` restores an identical scheduler."""
        version, internal, gauss = self._rng.getstate()
        return {
            "format": STATE_FORMAT,
            "n_partitions": self.n_partitions,
            "policy": self.policy,
            "seed": self.seed,
            "models": list(self._models),
            "availability": None
            if self._avail is None
            else {w: list(p) for w, p in self._avail.items()},
            "capacity": None
            if self._capacity is None
            else {str(j): c for j, c in self._capacity.items()},
            "epoch": self.epoch,
            "pending": [list(q) for q in self._pending],
            "inflight": [a.to_json() for a in self._inflight.values()],
            "attempts": {m: {str(j): n for j, n in d.items()} for m, d in self._attempts.items()},
            "visits": {str(e): v for e, v in self._visits.items()},
            "log": [a.to_json() for a in self._log],
            "rng": [version, list(internal), gauss],
            "ahead": dict(self._ahead),
        }

    @classmethod
    def from_state(cls, state: Mapping) -> MOPScheduler:
        """Rebuild a scheduler from :meth:`to_state` output (e.g. after a restart)."""
        if state.get("format") != STATE_FORMAT:
            raise SchedulerError(f"unsupported scheduler state format {state.get('format')!r}")
        cap = state.get("capacity")
        s = cls(
            state["models"],
            int(state["n_partitions"]),
            state["availability"],
            seed=state["seed"],
            policy=state["policy"],
            partition_capacity=None if cap is None else {int(j): c for j, c in cap.items()},
        )
        s.epoch = int(state["epoch"])
        s._pending = [dict.fromkeys(q) for q in state["pending"]]
        s._n_pending = sum(len(q) for q in s._pending)
        s._left = dict.fromkeys(s._models, 0)
        for q in s._pending:
            for m in q:
                s._left[m] += 1
        s._attempts = {
            m: {int(j): int(n) for j, n in d.items()} for m, d in state["attempts"].items()
        }
        s._visits = {int(e): {m: list(v) for m, v in d.items()} for e, d in state["visits"].items()}
        s._log = [Assignment.from_json(a) for a in state["log"]]
        for raw in state["inflight"]:
            a = Assignment.from_json(raw)
            s._inflight[a.model] = a
            s._part_load[a.partition] += 1
            if a.worker is not None:
                s._busy[a.worker] = a.model
        s._ahead = {str(m): int(e) for m, e in state.get("ahead", {}).items()}
        version, internal, gauss = state["rng"]
        s._rng.setstate((version, tuple(internal), gauss))
        return s
