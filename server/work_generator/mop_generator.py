"""MOP work generator: model selection with model hopper parallelism on any job system.

The set S of configurations comes from a search procedure (grid, random, successive
halving, Hyperband, PBT); the data is shuffled once and cut into ``p`` partitions; a
workunit trains one model on one partition for one sub-epoch, starting from the model's
latest weights, and the assimilator *replaces* the model's weights (a merge with a = 0).
The :class:`~boinc_dl.server.work_generator.mop.scheduler.MOPScheduler` decides which units may
exist (pull mode): never two units of one model in flight, each model visits each
partition once per epoch, and a partition's units only run on hosts that hold it (a host
hint for the local backend; sticky files plus locality scheduling on BOINC).

State (scheduler, configurations, per-model epoch results) lives in Redis and is saved in
the same transaction that registers new units, so a restarted generator continues without
duplicating or skipping a unit. A unit given up by the job system goes back to Q and is
created again under a new name (``..._r<attempt>``); a late result of the old attempt is
still merged at most once (the assimilated mark is per unit name) but no longer counts.

Configuration parameters split into training settings (``learning_rate``/``lr``,
``batch_size``, ``optimizer``, ``momentum``, ``local_epochs``: sent to clients as
``hyper``) and everything else, passed to the model builder as keyword arguments
(architecture, regularisation).
"""

from __future__ import annotations

import logging
import time
import zlib
from pathlib import Path
from typing import Any

from boinc_dl.server.assimilator.shards import load_shard_versions, save_shard_versions
from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.backends.base import JobSystem, RetryLimits
from boinc_dl.server.common.errors import BoincDLError, ModelError
from boinc_dl.server.common.spec import JobSpec
from boinc_dl.server.common.states import FINISHED
from boinc_dl.server.common.weights import OptimizerState, WeightsFile, write_weights
from boinc_dl.server.common.workunit import (
    WEIGHTS_IN,
    WU_JSON,
    Workunit,
    unit_name,
)
from boinc_dl.server.work_generator.mop.assignment import Assignment
from boinc_dl.server.work_generator.mop.procedures import make_search
from boinc_dl.server.work_generator.mop.scheduler import MOPScheduler
from boinc_dl.server.work_generator.mop.search import Config, Decision, SearchProcedure
from boinc_dl.server.work_generator.mop.state import MopState
from boinc_dl.server.work_generator.prepare import JobFiles, effective_spec, unit_training
from boinc_dl.server.work_generator.settle import cancel_open_units
from boinc_dl.server.work_generator.vcasgd import unit_seed

log = logging.getLogger(__name__)

TRAINING_KEYS = ("learning_rate", "lr", "batch_size", "optimizer", "momentum", "local_epochs")


def split_params(params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(training hyper-parameters, model-builder arguments) of a configuration."""
    hyper = {k: v for k, v in params.items() if k in TRAINING_KEYS}
    model_args = {k: v for k, v in params.items() if k not in TRAINING_KEYS}
    return hyper, model_args


def model_file(files: JobFiles, model: str) -> Path:
    return files.dir / f"{files.job}__model_{model}.keras"


def build_search(spec: JobSpec) -> SearchProcedure:
    """The search procedure the spec names (deterministic for its seed)."""
    m = spec.mop
    assert m is not None
    return make_search(m.search, m.param_grid, epochs=spec.training.epochs, budget=m.budget, seed=spec.seed,
                       **m.search_options)


class MOPWorkGenerator:
    """Creates MOP units through a :class:`JobSystem`; closes epochs and runs the search."""

    def __init__(self, store: JobStore, spec: JobSpec, job_dir: Path, backend: JobSystem,
                 availability: dict[str, set[int]] | None, host_of: dict[str, int] | None = None,
                 search_path: Path | None = None):
        spec = effective_spec(spec, store)  # the defaults the job derived (local epochs)
        self.store, self.spec, self.backend = store, spec, backend
        self.state = MopState(store)
        self.files = JobFiles(Path(job_dir).resolve(), spec.name)
        assert spec.mop is not None
        self.p = spec.mop.partitions
        self.availability = availability
        self.host_of = host_of or {}
        self.search_path = search_path
        self.limits = RetryLimits(spec.units.timeout_s, spec.units.max_error_results, spec.units.max_total_results)
        self._evaluators: dict[str, Any] = {}
        self.search = build_search(spec)
        #: The search's decisions rebuilt from the recorded epoch results on a restart, by
        #: epoch: an epoch whose results were recorded but whose close a kill interrupted is
        #: closed with that decision, never decided again (see :meth:`_record_epoch`).
        self._replayed: dict[int, Decision] = {}
        #: Models go on to their next epoch as soon as they finish one (no search decision
        #: at epoch boundaries): no host waits for the slowest model of an epoch.
        self.pipelined = not self.search.epoch_barrier
        self.sched = self._load_or_start()
        if self.pipelined:
            self._catch_up()

    # ---- Redis state ---------------------------------------------------------------------
    def _configs(self) -> dict[str, dict[str, Any]]:
        return self.state.configs()

    def _config(self, cid: str) -> dict[str, Any]:
        return self.state.config(cid)

    def _set_config(self, cid: str, **fields: Any) -> None:
        self.state.update_config(cid, **fields)

    def _end_running_configs(self, reason: str) -> None:
        """Configurations still training when the job ended: ``stopped``, with why."""
        for cid, c in self._configs().items():
            if c.get("status") == "running":
                self._set_config(cid, status="stopped", reason=reason)

    def _results(self) -> dict[int, dict[str, dict[str, Any]]]:
        return self.state.results()

    def _save(self, pipe: Any | None = None) -> None:
        self.state.save_sched(self.sched.to_state(), pipe)

    def _load_or_start(self) -> MOPScheduler:
        saved = self.state.sched()
        if saved is not None:
            # Restart: rebuild the search by replaying the recorded epoch results.
            history = sorted(self._results().items())
            self._replayed = dict(zip((e for e, _ in history), self.search.replay(history), strict=True))
            return MOPScheduler.from_state(saved)
        configs = self.search.initial()
        live = [c.id for c in configs if self._add_model(c, None)]
        if not live:
            reasons = sorted({str(self._config(c.id).get("reason", "")) for c in configs} - {""})
            more = f" (and {len(reasons) - 1} other reason(s); see `boinc-dl status`)" if len(reasons) > 1 else ""
            raise BoincDLError(f"no configuration could be built: {reasons[0] if reasons else 'unknown reason'}{more}")
        sched = MOPScheduler(live, self.p, self.availability, seed=self.spec.seed)
        sched.start_epoch()
        self.store.set_meta(epoch=1)
        self.sched = sched
        self._save()
        return sched

    # ---- models ----------------------------------------------------------------------------
    def _add_model(self, cfg: Config, parent: str | None) -> bool:
        """Build a configuration's model file and initial weights (or clone the parent's).

        A configuration whose model cannot be built is recorded as failed with its reason;
        the others go on.
        """
        from boinc_dl.server.common.keras_model import (
            build_model,
            configure_tf,
            get_flat,
            model_fingerprint,
        )

        hyper, model_args = split_params(cfg.params)
        args = {**self.spec.model_args, **model_args}
        self._set_config(cfg.id, params=cfg.params, parent=parent, status="running", hyper=hyper,
                         model_args=args, added_epoch=self.search.epoch + 1)
        path = model_file(self.files, cfg.id)
        try:
            if parent is not None and self._config(parent).get("model_args") == args:
                tf = configure_tf()
                # PBT clone with the same architecture: start from the parent's latest weights.
                src = model_file(self.files, parent)
                path.write_bytes(src.read_bytes())
                model = tf.keras.models.load_model(path, compile=False)
                flat, _ = self.store.get_weights(parent)
            else:
                model = build_model(self.spec.model, args, self.search_path, seed=self.spec.seed)
                tf = configure_tf()
                tmp = path.with_name(f".tmp.{path.name}")
                model.save(tmp)
                tmp.replace(path)
                model = tf.keras.models.load_model(path, compile=False)
                flat = get_flat(model)
            fp = model_fingerprint(model)
        except (ModelError, ValueError, TypeError, OSError) as e:
            reason = str(e) if isinstance(e, ModelError) else f"{type(e).__name__}: {e}"
            self._set_config(cfg.id, status="failed", reason=reason)
            log.warning("configuration %s failed: %s", cfg.id, reason)
            return False
        self.store.init_weights(cfg.id, flat, fp)
        return True

    def evaluator(self, model: str) -> Any:
        if model not in self._evaluators:
            from boinc_dl.server.work_generator.evaluate import Evaluator

            self._evaluators[model] = Evaluator(model_file(self.files, model), self.files.val,
                                                self.spec.training.loss)
        return self._evaluators[model]

    # ---- units -----------------------------------------------------------------------------
    def _unit(self, a: Assignment) -> str:
        return unit_name(self.spec.name, a.epoch, a.partition, a.model, a.attempt - 1)

    def _optimizer_state(self, model: str, version: int) -> OptimizerState | None:
        blob = self.store.optimizer_state(model)
        if blob is None:
            return None
        try:
            state, v = OptimizerState.from_bytes(blob)
        except (ValueError, KeyError, OSError):
            return None
        return state if v == version else None

    def _weights_path(self, model: str) -> tuple[int, Path]:
        snap = self.store.snapshot(model)
        version = snap.version
        path = self.files.weights(model, version)
        if not path.exists():
            write_weights(path, WeightsFile(snap.flat, self.store.fingerprint(model), job=self.spec.name,
                                            model=model, base_version=version,
                                            optimizer=self._optimizer_state(model, version)))
            save_shard_versions(path, snap.shard_versions)
        return version, path

    def _describe(self, a: Assignment) -> Workunit:
        cfg = self._config(a.model)
        version, wpath = self._weights_path(a.model)
        name = self._unit(a)
        wu = Workunit(
            job=self.spec.name, unit=name, mode="mop", epoch=a.epoch, model=a.model, shard=a.partition,
            weights_version=version, weights_shard_versions=load_shard_versions(wpath),
            training=unit_training(self.spec),
            hyper=cfg.get("hyper", {}),
            # The seed depends on (model, epoch, partition), not the attempt: a re-run unit
            # reproduces the lost one.
            seed=unit_seed(self.spec.seed + zlib.crc32(a.model.encode()) % 100_003, a.epoch, a.partition),
            checkpoint_every_s=self.spec.units.checkpoint_every_s,
        )
        wu.files = self.files.inputs(name, model_file(self.files, a.model), wpath, a.partition)
        if self.availability is not None and self.host_of:
            wu.hosts = sorted({self.host_of[w] for w, ps in self.availability.items() if a.partition in ps})
        return wu

    def _poll_results(self) -> None:
        """Feed finished and given-up units back to the scheduler (Algorithm 2 / Q')."""
        flight = self.sched.in_flight()
        if not flight:
            return
        names = [self._unit(a) for a in flight]
        changed = False
        for a, name, (d, f) in zip(flight, names, self.store.settled_of(names), strict=True):
            if d is not None:
                ok = self.sched.complete(a.model, a.partition, a.attempt, a.epoch)
                changed |= ok
                self.state.log_assignment(name, a.to_json())
                if ok and self.pipelined and self.sched.model_finished(a.model):
                    self._model_epoch_end(a.model, a.epoch)
            elif f is not None:
                log.warning("unit %s failed for good (%s): back to the queue", name, f)
                changed |= self.sched.fail(a.model, a.partition, a.attempt, a.epoch)
        if changed:
            self._save()

    def _issue(self) -> None:
        # At most one unit per model is in flight anyway; a job system with known slots
        # (local) also bounds it by its capacity.
        cap = self.backend.capacity or len(self.sched.models)
        room = cap - len(self.sched.in_flight())
        if room <= 0:
            return
        new = self.sched.issue(room)
        if not new:
            return
        wus = [self._describe(a) for a in new]
        items = []
        for a, wu in zip(new, wus, strict=True):
            Path(wu.files[WU_JSON]).write_text(wu.to_json())
            info = {"epoch": a.epoch, "shard": a.partition, "model": a.model, "attempt": a.attempt,
                    "weights_version": wu.weights_version, "created_at": time.time(), "files": wu.files,
                    "hosts": wu.hosts}
            items.append((wu.unit, info, a.epoch))
        # The units and the scheduler state that issued them land together, or not at all.
        self.store.register_units(items, also=self._save)
        for wu in wus:
            self.backend.submit(wu, self.limits)
            self.store.transition_unit(wu.unit, "created", "in_progress")

    def recover(self, resubmit_in_progress: bool = False) -> int:
        """Submit the scheduler's in-flight units again (a job system that lost its queue)."""
        n = 0
        states = self.store.unit_states()
        for a in self.sched.in_flight():
            name = self._unit(a)
            if states.get(name) == "created" or (resubmit_in_progress and states.get(name) == "in_progress"):
                info = self.store.unit_info(name) or {}
                wu = self._describe(a)
                if info.get("files") and Path(info["files"][WEIGHTS_IN]).exists():
                    wu.files = dict(info["files"])
                    wu.weights_version = int(info.get("weights_version", wu.weights_version))
                Path(wu.files[WU_JSON]).write_text(wu.to_json())
                self.backend.submit(wu, self.limits)
                self.store.transition_unit(name, "created", "in_progress")
                n += 1
        return n

    # ---- epochs ----------------------------------------------------------------------------
    def _evaluate(self, model: str, epoch: int) -> dict[str, Any]:
        """The model's validation metrics now (its weights at the end of ``epoch``)."""
        flat, version = self.store.get_weights(model)
        loss, acc = self.evaluator(model).evaluate(flat)
        return {"val_acc": acc, "val_loss": loss, "version": version,
                "visits": self.sched.visit_order(model, epoch)}

    def _model_epoch_end(self, model: str, epoch: int) -> None:
        """Pipelining: evaluate a model that finished ``epoch`` and start its next one.

        Runs before any unit of its next epoch exists, so the evaluated weights are the
        model's weights at the end of ``epoch``. The result is kept per (epoch, model)
        until every model of the epoch has one; the epoch then closes (:meth:`_close_ready`).
        """
        if not self.state.has_model_result(epoch, model):
            self.state.put_model_result(epoch, model, self._evaluate(model, epoch))
        if epoch < self.spec.training.epochs:
            e = self.sched.advance_model(model)
            if e > int(self.store.meta().get("epoch", 1)):
                self.store.set_meta(epoch=e)

    def _catch_up(self) -> None:
        """After a restart: end the epoch of models that finished it without being
        evaluated or moved on (a state saved by a generator that kept the barrier)."""
        changed = False
        for m in self.sched.models:
            if self.sched.model_finished(m):
                e = self.sched.model_epoch(m)
                if e < self.spec.training.epochs or not self.state.has_model_result(e, m):
                    self._model_epoch_end(m, e)
                    changed = True
        if changed:
            self._save()

    def _close_ready(self) -> None:
        """Pipelining: close every epoch whose models all have their end-of-epoch result."""
        while True:
            meta = self.store.meta()
            if meta.get("status") in FINISHED:
                return
            epoch = int(meta.get("closed_epoch", 0)) + 1
            models = self.sched.models
            got = self.state.model_results(epoch, models)
            if not models or any(r is None for r in got):
                return
            results = dict(zip(models, got, strict=True))
            live = self._record_epoch(epoch, results)
            for m in set(self.sched.models) - set(live):
                a = self.sched.drop_model(m)
                if a is not None:
                    self.backend.cancel(self._unit(a))
            self._save()

    def _close_epoch(self) -> None:
        epoch = self.sched.epoch
        # results recorded before a kill interrupted this close: those, not evaluated again
        results = self._results()[epoch] if epoch in self._replayed else {
            m: self._evaluate(m, epoch) for m in self.sched.models}
        live = self._record_epoch(epoch, results)
        if self.store.meta().get("status") in FINISHED:
            return
        self.sched.start_epoch(live)
        self.store.set_meta(epoch=self.sched.epoch)
        self._save()

    def _record_epoch(self, epoch: int, results: dict[str, dict[str, Any]]) -> list[str]:
        """Record an epoch's results, run the search's decision; the models that go on.

        Finishes the job when the search is done or the last epoch closed.
        """
        if epoch in self._replayed:
            # Killed between recording the results and saving the scheduler: the restart's
            # replay made this decision already; the steps below are safe to repeat (the
            # epoch's summary is recorded once, statuses are set again, the clones are made
            # again from parents that have not trained since).
            decision = self._replayed[epoch]
        else:
            self.state.put_results(epoch, results)
            decision = self.search.on_epoch_end(epoch, results)
        summary = {"val_acc": max((r["val_acc"] for r in results.values()), default=0.0),
                   "models": len(results), "stopped": decision.stop, "added": [c.id for c, _ in decision.add],
                   "ended_at": time.time(), "elapsed_s": time.time() - float(self.store.meta().get("created_at", 0))}
        self.store.finish_epoch(epoch, summary)
        self.store.set_meta(closed_epoch=epoch, latest_val_acc=summary["val_acc"])
        configs = self._configs()
        for m in decision.stop:
            if configs.get(m, {}).get("status") == "failed":
                continue  # never built: keep its own reason
            self._set_config(m, status="finished" if decision.done else "stopped",
                             reason=decision.reasons.get(m, ""), stopped_epoch=epoch)
        live = [m for m in self.sched.models if m not in set(decision.stop)]
        for cfg, parent in decision.add:
            if self._add_model(cfg, parent):
                live.append(cfg.id)
        log.info("MOP epoch %d closed: best val_acc %.4f, %d models live", epoch, summary["val_acc"], len(live))
        if decision.done or self.search.done or not live or epoch >= self.spec.training.epochs:
            for m in live:
                self._set_config(m, status="finished")
            self._save()
            self.store.set_meta(status="done", finished_at=time.time(),
                                reason=f"{epoch} epochs done" if epoch >= self.spec.training.epochs
                                else "search finished")
        return live

    def step(self) -> bool:
        """One pass: absorb results, close the epoch when complete, create units."""
        meta = self.store.meta()
        if meta.get("status") in FINISHED:
            # ended by someone else (``boinc-dl cancel``): nothing left open, and no
            # configuration shown as still running
            cancel_open_units(self.store, self.backend)
            self._end_running_configs(f"job {meta['status']}")
            return False
        self._poll_results()
        if self.pipelined:
            # Units first: a model that ended its epoch in this pass was evaluated and
            # advanced by _poll_results, and closing the epoch only records results (a
            # pipelined search stops no model before the last epoch). Closing first made
            # the next epoch wait for the record whenever the last models ended together.
            self._issue()
            self._close_ready()
            return self.store.meta().get("status") not in FINISHED
        if self.sched.epoch_done():
            self._close_epoch()
        if self.store.meta().get("status") in FINISHED:
            return False
        self._issue()
        return True

    def visit_orders(self) -> dict[str, dict[int, list[int]]]:
        """Recorded partition order of every model per epoch (for reproducibility)."""
        out: dict[str, dict[int, list[int]]] = {}
        for e, res in self._results().items():
            for m, r in res.items():
                out.setdefault(m, {})[e] = r.get("visits", [])
        return out
