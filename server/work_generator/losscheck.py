"""The checker: the server's forward passes, for the loss check and the step search.

Runs inside the long-lived work generator (a thread of BOINC's work generator daemon, or
of ``boinc-dl run``'s process for ``merge_rule: search``), which has TensorFlow loaded
already; the protocol and the assimilator's side are in
:mod:`boinc_dl.server.assimilator.losscheck` and :mod:`boinc_dl.server.assimilator.stepsearch`.
Per job it keeps its own Keras model (Keras models are not thread-safe: the generator's
evaluator has another one), a fixed held-out batch (``validation.loss_check_batch``
examples of the job's validation split, drawn with the job's seed), ``L(W_b)`` per base
weights file and, for the step search, a pool of the training data (:data:`SEARCH_POOL`
samples' worth of the job's subsets, an equal share of each, bounded in bytes).

A step request (``merge_rule: search``) is answered with the candidate step after which
the loss of a training sample (``vcasgd.search_batch`` examples of the pool, drawn afresh
for each request from its id) at the server's current weights is lowest
(:func:`~boinc_dl.server.assimilator.rules.search_step`); its verdict is set once, like a
check's. A fresh sample per request, as SGD takes a fresh batch per step: one fixed sample
judged every result of the job, and hundreds of choices made on the same examples fit the
server to them (simulated order, MNIST with as many subsets as units in flight: final
accuracy 0.937 / 0.919 / 0.891 at 32 / 128 / 1,000 in flight with one fixed sample,
0.939 / 0.920 / 0.914 with a fresh one per request; docs/merge-rules.md).

For each request: the result's weights are read from the job's ``loss_check/`` spool
with the bounded, fingerprint-checked reader (the file is a host's upload: it is
refused, never parsed beyond bounds, when it is hostile), the loss change
``L(W_b + scale * (W_c - W_b)) - L(W_b)`` is computed, and

* an untrusted result's verdict is set (first verdict wins), with its host's loss
  ledger (:func:`~boinc_dl.server.assimilator.losscheck.settle`): a result within the
  per-result bound is still refused when its host's untrusted results together sit too
  far above trusted results' median;
* a trusted result's change joins the trusted statistic the bound is computed from.

Crash safety: a request popped and not answered when the process dies is lost; the
assimilator waiting for it times out, the result is handed over again, and the request
is queued again once it is older than the wait (its stamp). A restarted checker carries
on with the queue. Files of lost requests are swept after a day.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from boinc_dl.server.assimilator import losscheck as lc
from boinc_dl.server.assimilator import rules, stepsearch
from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.common.datasets import npz_array_shape
from boinc_dl.server.common.errors import StoreUnavailable, UnknownJob, WeightsFormatError
from boinc_dl.server.common.paths import confined, is_safe_name
from boinc_dl.server.common.spec import JobSpec, spec_from_json
from boinc_dl.server.common.weights import Fingerprint, read_weights, upload_bound
from boinc_dl.server.work_generator.prepare import JobFiles

log = logging.getLogger("boinc-dl.loss_check")

#: Base losses kept per job (one per weights version in use; units in flight span a few).
BASE_CACHE = 64
#: Base weights files the step search keeps in memory per job (each a model's size).
BASES_KEPT = 4
#: Spool files older than this belong to requests lost in a crash.
ORPHAN_AGE_S = 86400.0
#: The step search's pool of training examples: this many samples' worth
#: (``vcasgd.search_batch`` each), all of the training data when it is smaller ...
SEARCH_POOL = 16
#: ... and at most this many bytes of examples (a job of large images keeps fewer).
SEARCH_POOL_BYTES = 256 * 2**20


def held_out_batch(val_file: Path, size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A fixed sample of ``size`` examples of the validation split (all of it if smaller),
    the same for every request and every restart of the checker."""
    with np.load(val_file) as z:
        x, y = z["x"], z["y"]
    if len(x) > size:
        idx = np.sort(np.random.default_rng([int(seed), 0x105C]).choice(len(x), size, replace=False))
        x, y = x[idx], y[idx]
    return np.ascontiguousarray(x), np.ascontiguousarray(y)


def search_batch(files: JobFiles, n_subsets: int, size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A fixed sample of ``size`` training examples (all of them when fewer), the same for
    every restart: as equal a share of each subset as their sizes allow, read one subset
    at a time (memory: one subset and the sample). The step search's pool
    (:func:`search_pool`), from which each request draws its own sample."""
    sizes = [npz_array_shape(files.shard(k), "y")[0][0] for k in range(n_subsets)]
    take = _shares(sizes, size)
    xs, ys = [], []
    for k, n in enumerate(take):
        if n == 0:
            continue
        with np.load(files.shard(k)) as z:
            x, y = z["x"], z["y"]
        if len(x) > n:
            idx = np.sort(np.random.default_rng([int(seed), 0x57E9, k]).choice(len(x), n, replace=False))
            x, y = x[idx], y[idx]
        xs.append(np.ascontiguousarray(x))
        ys.append(np.ascontiguousarray(y))
    return np.concatenate(xs), np.concatenate(ys)


def search_pool(files: JobFiles, n_subsets: int, batch: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The step search's pool: :data:`SEARCH_POOL` samples of ``batch`` examples' worth of
    the training data (all of it when smaller), at most :data:`SEARCH_POOL_BYTES` of
    examples, never fewer than ``batch`` (:func:`search_batch` draws it)."""
    shape, dtype = npz_array_shape(files.shard(0), "x")  # from the header: no subset read twice
    per = max(1, int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize)
    size = max(int(batch), min(SEARCH_POOL * int(batch), SEARCH_POOL_BYTES // per))
    return search_batch(files, n_subsets, size, seed)


def sample_rows(pool_size: int, batch: int, seed: int, request: str) -> np.ndarray | None:
    """The rows of the pool one step request is judged on: ``batch`` of them drawn without
    replacement from the job's seed and the request's id (the same request, asked again
    after a crash, gets the same sample); None: the pool is no larger than a sample (all
    of it, every time)."""
    if pool_size <= batch:
        return None
    key = int.from_bytes(hashlib.sha256(request.encode("utf-8", "replace")).digest()[:8], "big")
    rng = np.random.default_rng([int(seed), 0x57E9, key])
    return np.sort(rng.choice(pool_size, int(batch), replace=False))


def _shares(sizes: list[int], total: int) -> list[int]:
    """How many of each subset's examples a sample of ``total`` takes: equal shares, a
    subset smaller than its share whole and its rest spread over the larger ones."""
    take = [0] * len(sizes)
    left = min(total, sum(sizes))
    order = sorted(range(len(sizes)), key=lambda k: sizes[k])
    for j, k in enumerate(order):
        share = -(-left // (len(order) - j))  # ceil: the last subsets take the remainder
        take[k] = min(sizes[k], share)
        left -= take[k]
    return take


class JobChecker:
    """The forward passes of one job: its model, held-out batch, cached base losses and
    the step search's pool of training examples.

    ``loss_fn(flat)`` and ``search_loss_fn(flat, rows)`` (``rows`` of the pool, None: all
    of it) replace the Keras model's (tests)."""

    def __init__(self, store: JobStore, spec: JobSpec, job_dir: Path,
                 loss_fn: Callable[[np.ndarray], float] | None = None,
                 search_loss_fn: Callable[[np.ndarray, np.ndarray | None], float] | None = None):
        self.store = store
        self.spec = spec
        self.files = JobFiles(Path(job_dir).resolve(), spec.name)
        self.spool = lc.spool_dir(self.files.job_dir)
        self.fp: Fingerprint = store.fingerprint("0")
        self.max_bytes = upload_bound(self.fp, spec.units.max_upload_bytes)
        self._loss_fn = loss_fn
        self._search_loss_fn = search_loss_fn
        self.pool_size = 0  # examples in the step search's pool (prepare reads it)
        self._base_loss: OrderedDict[str, float] = OrderedDict()
        self._current_loss: tuple[tuple[Any, ...], float] | None = None
        self._bases: OrderedDict[tuple[str, int, int], np.ndarray] = OrderedDict()

    # ---- the forward pass ----------------------------------------------------------------
    def loss(self, flat: np.ndarray) -> float:
        """The held-out loss of weights ``flat`` (its own model instance, built on first use)."""
        self.prepare()
        return float(self._loss_fn(flat))  # type: ignore[misc]

    def search_loss(self, flat: np.ndarray, rows: np.ndarray | None = None) -> float:
        """The loss of weights ``flat`` on ``rows`` of the step search's pool of training
        examples (None: all of it)."""
        self.prepare()
        return float(self._search_loss_fn(flat, rows))  # type: ignore[misc]

    def prepare(self) -> None:
        """Build the model the forward passes use (TensorFlow's start-up: seconds)."""
        search = stepsearch.enabled(self.spec)
        if self._loss_fn is None or (search and self._search_loss_fn is None):
            batches = {"held_out": held_out_batch(self.files.val, self.spec.validation.loss_check_batch,
                                                  self.spec.seed)}
            if search:
                assert self.spec.vcasgd.n_subsets is not None  # a stored spec is derived
                batches["search"] = search_pool(self.files, self.spec.vcasgd.n_subsets,
                                                self.spec.vcasgd.search_batch, self.spec.seed)
                self.pool_size = len(batches["search"][1])
            fns = keras_losses(self.files.model, batches, self.spec)
            self._loss_fn = self._loss_fn or fns["held_out"]
            self._search_loss_fn = self._search_loss_fn or fns.get("search")

    def base_loss(self, path: str, wb: np.ndarray) -> float:
        hit = self._base_loss.get(path)
        if hit is None:
            hit = self._base_loss[path] = self.loss(wb)
            while len(self._base_loss) > BASE_CACHE:
                self._base_loss.popitem(last=False)
        else:
            self._base_loss.move_to_end(path)
        return hit

    def loss_increase(self, wc: np.ndarray, base_path: str, scale: float) -> tuple[float, float]:
        """``L(W_b + scale * (W_c - W_b)) - L(W_b)`` (what the merge would apply, clipped),
        and ``L(W_b)``."""
        wb = read_weights(base_path, self.fp).flat
        cand = wb + np.float32(scale) * (wc - wb)
        lb = self.base_loss(base_path, wb)
        return self.loss(cand) - lb, lb

    # ---- one request ---------------------------------------------------------------------
    def handle(self, req: dict[str, Any]) -> str:
        """Answer one request; returns what happened (for the log and the tests)."""
        kind, name = req.get("kind"), req.get("file")
        if kind == "answered":
            return "answered"  # a replayed id whose verdict is set: never judged twice
        rid, stamp = str(req.get("id", "")), str(req.get("stamp", ""))
        path = confined(self.spool, name) if isinstance(name, str) and is_safe_name(name) else None
        try:
            if path is None or not path.is_file():
                if kind in ("check", "step"):
                    self.store.drop_loss_request(rid, stamp)
                return "no file"
            if kind == "step":
                t0 = time.perf_counter()
                verdict = self._search(req, path)
                final, retired = self.store.set_loss_verdict(rid, verdict, lc.VERDICT_TTL_S)
                # what one search costs here (reads, snapshot, forward passes): the
                # assimilators weigh the queue with it (stepsearch.choose)
                self.store.note_step_seconds(time.perf_counter() - t0)
                if retired and retired != name and is_safe_name(retired):
                    confined(self.spool, retired).unlink(missing_ok=True)
                return f"step {final.get('step')}" if final.get("ok") else "unreadable"
            verdict = self._judge(req, path)
            if kind == "observe":
                if verdict is not None and verdict.get("loss_increase") is not None:
                    self.store.push_trusted_value(str(req.get("model", "0")), lc.STAT, int(req.get("epoch", 0)),
                                                  float(verdict["loss_increase"]), lc.WINDOW,
                                                  base_loss=verdict.get("base_loss"))
                    return "observed"
                return "not observed"
            if verdict is None:
                self.store.drop_loss_request(rid, stamp)
                return "no base"
            final, retired = lc.settle(self.store, self.spec, rid, req, verdict)
            if retired and retired != name and is_safe_name(retired):
                confined(self.spool, retired).unlink(missing_ok=True)  # a later delivery's copy
            return "passed" if final.get("ok") else "refused"
        finally:
            if path is not None:
                path.unlink(missing_ok=True)

    def _judge(self, req: dict[str, Any], path: Path) -> dict[str, Any] | None:
        """The verdict on the result in ``path`` (None: its base weights are gone)."""
        base = req.get("base")
        if not isinstance(base, str) or not Path(base).is_file():
            return None
        try:
            scale = float(req.get("scale", 1.0))
        except (TypeError, ValueError):
            scale = 1.0
        scale = min(1.0, max(0.0, scale)) if math.isfinite(scale) else 1.0
        try:
            wc = read_weights(path, self.fp, max_bytes=self.max_bytes).flat
        except WeightsFormatError as e:
            v = lc.decide(math.inf, 0.0)
            return {**v, "reason": f"held-out loss check: the result's weights cannot be read: {e}"}
        t0 = time.perf_counter()
        try:
            dl, lb = self.loss_increase(wc, base, scale)
        except WeightsFormatError as e:  # the server's own base file: log it, judge nothing
            log.error("job %s: base weights %s unreadable: %s", self.store.job, base, e)
            return None
        base_loss = lb if math.isfinite(lb) else None
        if req.get("kind") == "observe":
            return {"loss_increase": dl if math.isfinite(dl) else None, "base_loss": base_loss}
        bound, comparable = lc.bound_for(self.store, self.spec, str(req.get("model", "0")),
                                         int(req.get("epoch", 0)), base_loss)
        # the forward passes' own time, for the merge record (the rest of a result's wait
        # is the queue)
        return {**lc.decide(dl, bound), "base_loss": base_loss, "bound_comparable": comparable,
                "check_s": round(time.perf_counter() - t0, 6)}

    def _search(self, req: dict[str, Any], path: Path) -> dict[str, Any]:
        """The verdict of a step request: the candidate step after which the training
        sample's loss at the server's current weights is lowest (see the module doc)."""
        steps = req.get("steps")
        if not (isinstance(steps, list) and 0 < len(steps) <= rules.MAX_SEARCH_STEPS
                and all(isinstance(c, int | float) and not isinstance(c, bool) and math.isfinite(c) and 0 <= c <= 1
                        for c in steps) and any(c > 0 for c in steps)):
            # not the assimilator's request: nothing to choose among (it falls back to its own weight)
            return {"ok": True, "step": None, "steps": None, "reason": "malformed step request", "t": time.time()}
        steps = [float(c) for c in steps]
        base = req.get("base")
        try:
            scale = float(req.get("scale", 1.0))
        except (TypeError, ValueError):
            scale = 1.0
        scale = min(1.0, max(0.0, scale)) if math.isfinite(scale) else 1.0
        if not isinstance(base, str) or not Path(base).is_file():
            return {"ok": True, "step": min(c for c in steps if c > 0), "steps": steps, "reason": "no base weights",
                    "t": time.time()}
        try:
            wc = read_weights(path, self.fp, max_bytes=self.max_bytes).flat
        except WeightsFormatError as e:
            return {"ok": False, "reason": f"step search: the result's weights cannot be read: {e}", "t": time.time()}
        t0 = time.perf_counter()
        wb = self._base(base)
        model = str(req.get("model", "0"))
        snap = self.store.snapshot(model)
        # the update as the merge applies it (clipped), from the server weights as they are now
        d = np.subtract(wc, wb)
        d *= np.float32(scale)
        self.prepare()  # the pool's size, for the request's sample
        rows = sample_rows(self.pool_size, self.spec.vcasgd.search_batch, self.spec.seed, str(req.get("id", "")))
        step, losses = rules.search_step(steps, lambda c: self._loss_after(model, snap, d, c, rows))
        return {"ok": True, "step": step, "steps": steps,
                "losses": [round(x, 6) if x is not None and math.isfinite(x) else None for x in losses],
                "at_version": snap.version, "check_s": round(time.perf_counter() - t0, 6), "t": time.time()}

    def _base(self, path: str) -> np.ndarray:
        """A base weights file's values (the server's own file; the latest few kept: every
        unit issued from one weights version shares it), by path, mtime and size: a file
        written again under its name (a version Redis lost, rewritten) is read anew."""
        st = os.stat(path)
        key = (path, st.st_mtime_ns, st.st_size)
        hit = self._bases.get(key)
        if hit is None:
            hit = self._bases[key] = read_weights(path, self.fp).flat
            while len(self._bases) > BASES_KEPT:
                self._bases.popitem(last=False)
        else:
            self._bases.move_to_end(key)
        return hit

    def _loss_after(self, model: str, snap: Any, d: np.ndarray, step: float, rows: np.ndarray | None) -> float:
        """The loss of the pool's ``rows`` at ``snap`` after ``step * d``; at step 0, the
        loss of the snapshot itself, computed once per state of the model's shards and
        sample (a pool no larger than a sample: every result searched from that state
        shares it)."""
        if step != 0.0:
            return self.search_loss(snap.flat + np.float32(step) * d, rows)
        key = (model, tuple(snap.shard_versions), None if rows is None else rows.tobytes())
        if self._current_loss is None or self._current_loss[0] != key:
            self._current_loss = (key, self.search_loss(snap.flat, rows))
        return self._current_loss[1]

    def sweep(self, now: float | None = None) -> int:
        """Remove spool files of requests lost in a crash (older than ORPHAN_AGE_S)."""
        now = time.time() if now is None else now
        n = 0
        if not self.spool.is_dir():
            return 0
        for p in self.spool.iterdir():
            try:
                if p.is_file() and now - p.stat().st_mtime > ORPHAN_AGE_S:
                    p.unlink()
                    n += 1
            except OSError:
                continue
        return n


def keras_losses(model_file: Path, batches: dict[str, tuple[np.ndarray, np.ndarray]],
                 spec: JobSpec) -> dict[str, Callable[..., float]]:
    """The loss of flat weights on each named batch, ``fn(flat, rows=None)`` (``rows``: of
    the batch only), on one model instance of the checker's own (the checker is one
    thread: its functions are never called at once)."""
    from boinc_dl.server.common.keras_model import configure_tf, set_flat

    tf = configure_tf()
    model = tf.keras.models.load_model(model_file, compile=False)
    loss = tf.keras.losses.get(spec.training.loss)

    @tf.function(reduce_retracing=True)
    def forward(xb: Any, yb: Any) -> Any:
        # compiled once per batch shape: 2-3x faster than the eager call on a small model
        return tf.reduce_mean(loss(yb, model(xb, training=False)))

    def make(x: np.ndarray, y: np.ndarray) -> Callable[..., float]:
        xt, yt = tf.constant(x), tf.constant(y)

        def fn(flat: np.ndarray, rows: np.ndarray | None = None) -> float:
            set_flat(model, flat)
            if rows is None:
                return float(forward(xt, yt).numpy())
            # one shape for every sample: traced once
            return float(forward(tf.gather(xt, rows), tf.gather(yt, rows)).numpy())
        return fn
    return {name: make(x, y) for name, (x, y) in batches.items()}


def keras_loss(model_file: Path, val_file: Path, spec: JobSpec) -> Callable[[np.ndarray], float]:
    """The held-out loss of flat weights (the loss check's measure), on a model of its own."""
    batch = held_out_batch(val_file, spec.validation.loss_check_batch, spec.seed)
    return keras_losses(model_file, {"held_out": batch}, spec)["held_out"]


class LossChecker:
    """The checker loop over every job a work generator drives (a thread of its process).

    ``jobs()`` names the jobs to serve (the daemon's running VC-ASGD jobs); ``connect()``
    gives a Redis client (its own: the daemon's is reset on outages)."""

    def __init__(self, connect: Callable[[], Any], jobs: Callable[[], dict[str, Path]],
                 stop: threading.Event, idle_s: float = 0.5):
        self.connect = connect
        self.jobs = jobs
        self.stop = stop
        self.idle_s = idle_s
        self.checkers: dict[str, JobChecker] = {}
        self.handled: dict[str, int] = {}
        self._r: Any = None
        self._beat = 0.0
        self._swept = 0.0

    def checker(self, job: str, job_dir: Path) -> JobChecker | None:
        c = self.checkers.get(job)
        if c is None:
            store = JobStore(self._r, job)
            try:
                spec = spec_from_json(store.spec_json())
            except UnknownJob:
                return None
            if not (lc.enabled(spec) or stepsearch.enabled(spec)):
                return None
            c = JobChecker(store, spec, job_dir)
            try:
                # before the first request is taken off the queue: a daemon killed during
                # TensorFlow's start-up then loses no request it held (an observation, taken
                # off the queue, has no other copy; measured on a walk with the daemon
                # SIGKILLed every 4-20 s, most replicated results' measurements were lost)
                c.prepare()
            except Exception:  # noqa: BLE001 - e.g. the job's files gone: the request says why later
                log.exception("job %s: the loss checker's model could not be built", job)
            self.checkers[job] = c
            log.info("job %s: loss checker serving (held-out batch of up to %d, k %g, %d trusted results needed%s)",
                     job, spec.validation.loss_check_batch, spec.validation.loss_check_k,
                     spec.validation.loss_check_min_trusted,
                     f"; step search on {spec.vcasgd.search_batch} training examples"
                     if stepsearch.enabled(spec) else "")
        return c

    def one_round(self) -> int:
        """Heartbeat, then answer at most one request per job; how many were answered."""
        if self._r is None:
            self._r = self.connect()
        jobs = self.jobs()
        for gone in set(self.checkers) - set(jobs):
            del self.checkers[gone]
        active = [c for job, d in jobs.items() if (c := self.checker(job, d)) is not None]
        now = time.monotonic()
        if now - self._beat >= 1.0:
            for c in active:
                c.store.mark_loss_checker_alive(lc.HEARTBEAT_TTL_S)
            self._beat = now
        if now - self._swept >= 3600.0:
            for c in active:
                c.sweep()
            self._swept = now
        n = 0
        wait = self.idle_s / max(1, len(active))
        for c in active:
            req = c.store.pop_loss_request(wait)
            if req is None:
                continue
            try:
                what = c.handle(req)
            except StoreUnavailable:
                raise
            except Exception:  # noqa: BLE001 - one request must not stop the checker
                log.exception("job %s: loss check of %s failed", c.store.job, req.get("unit"))
                what = "error"
            self.handled[what] = self.handled.get(what, 0) + 1
            log.info("job %s: loss check of %s (%s): %s", c.store.job, req.get("unit"), req.get("kind"), what)
            n += 1
        if not active:
            self.stop.wait(self.idle_s)
        return n

    def run(self) -> None:
        """Until ``stop``: answer requests; ride through Redis outages."""
        delay = 1.0
        while not self.stop.is_set():
            try:
                self.one_round()
                delay = 1.0
            except StoreUnavailable as e:
                log.error("loss checker: %s; reconnecting", e)
                self._r = None
                self.checkers.clear()
                self.stop.wait(delay)
                delay = min(delay * 2, 30.0)
            except Exception:  # noqa: BLE001 - the checker must outlive any one failure
                log.exception("loss checker: unexpected error")
                self.stop.wait(delay)
                delay = min(delay * 2, 30.0)
