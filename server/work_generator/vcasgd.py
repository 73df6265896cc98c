"""VC-ASGD work generator: epochs of data-subset workunits, fed with fresh weights.

Each epoch's training data is cut into ``n_subsets`` subsets; a workunit is (server
weights W_s at some version, one subset, training settings). The generator keeps a
bounded window of units in flight so that every new unit starts from the freshest
server weights: one weights file is written per weights version and shared by all
units created from it, never copied per unit.

All of its state is in Redis (counters per epoch, unit records), so a restarted
generator continues without duplicating or skipping a unit: ``register_unit`` is
idempotent and a unit registered but not yet submitted (crash in between) is
submitted again by :meth:`VCASGDWorkGenerator.recover`.

Epochs are pipelined: units of epoch e+1 are created as soon as every subset of
epoch e has been created, so slots never idle at an epoch's tail. Epoch e is
*closed* when each of its subsets is assimilated or given up on; the server weights
are then evaluated on the validation split (they may already hold a few merges of
epoch e+1 — the price of not idling; the per-unit spread comes from the clients'
own validation accuracies of epoch e).

Re-issue policy (``vcasgd.reissue``): with ``same`` a timed-out unit is re-issued by
the job system with its original inputs (BOINC's behaviour). With ``fresh`` the job
system asks the generator (:meth:`VCASGDWorkGenerator.service_regenerations`, polled
by :meth:`~VCASGDWorkGenerator.step`) to rebuild it from the freshest server weights
under the name ``<unit>_r<n>`` (on BOINC: cancel the old workunit, create the new
one). The unit's *identity* — the name written into ``wu.json`` and hence into the
result, and the key of its "assimilated" mark — stays the subset's unit, so exactly
one result is merged per (epoch, subset): the first to reach an assimilator wins and
every later one, such as the late original, is a duplicate.

Redis outages: store calls retry for the store's window; a step that still fails
with :class:`~boinc_dl.server.common.errors.StoreUnavailable` is retried with backoff by
:meth:`~VCASGDWorkGenerator.step` itself (up to ``max_outage_s``), which then
re-submits any unit registered but not yet handed to the job system.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from boinc_dl.server.assimilator.policy import base_of
from boinc_dl.server.assimilator.shards import (
    load_shard_versions,
    save_shard_versions,
    shard_versions_path,
)
from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.backends.base import JobSystem, RetryLimits
from boinc_dl.server.common import diskfaults
from boinc_dl.server.common.errors import StoreUnavailable
from boinc_dl.server.common.spec import JobSpec
from boinc_dl.server.common.states import FINISHED, SETTLED
from boinc_dl.server.common.weights import WeightsFile, write_weights
from boinc_dl.server.common.workunit import (
    WEIGHTS_IN,
    WU_JSON,
    Workunit,
    unit_name,
)
from boinc_dl.server.work_generator.prepare import JobFiles, effective_spec, n_shards, unit_training
from boinc_dl.server.work_generator.settle import cancel_open_units

log = logging.getLogger(__name__)

def unit_seed(seed: int, epoch: int, shard: int) -> int:
    """A distinct, reproducible seed per unit."""
    return (seed * 1_000_003 + epoch * 10_007 + shard) % (2**31 - 1)


class VCASGDWorkGenerator:
    """Creates VC-ASGD workunits through a :class:`JobSystem` and closes epochs."""

    def __init__(self, store: JobStore, spec: JobSpec, job_dir: Path, backend: JobSystem,
                 window: int | None = None, evaluator: Any | None = None, max_outage_s: float = 600.0):
        spec = effective_spec(spec, store)  # the defaults the job derived (subsets, local epochs)
        self.store = store
        self.spec = spec
        self.files = JobFiles(Path(job_dir).resolve(), spec.name)
        self.backend = backend
        #: Fixed window (units in flight) when given or when the job system cannot tell
        #: how many hosts are asking; see :meth:`current_window`.
        self.window = window or spec.vcasgd.window or backend.capacity or 8
        self._fixed_window = window
        self.n = n_shards(spec)
        self.model = "0"
        self.fp = store.fingerprint(self.model)
        self._evaluator = evaluator
        self._weights_file: tuple[int, Path] | None = None
        self.limits = RetryLimits(spec.units.timeout_s, spec.units.max_error_results, spec.units.max_total_results)
        self.started = float(store.meta().get("created_at", time.time()))
        #: How long :meth:`step` keeps retrying through a Redis outage before raising.
        self.max_outage_s = max_outage_s
        self._outage_since: float | None = None
        self._backoff = 0.1
        self.reissue = spec.vcasgd.reissue
        set_policy = getattr(backend, "set_reissue_policy", None)
        if callable(set_policy):
            set_policy(self.reissue)

    # ---- state ----------------------------------------------------------------------------
    def _meta_int(self, meta: dict[str, str], key: str, default: int) -> int:
        try:
            return int(float(meta.get(key, default)))
        except ValueError:
            return default

    def status(self) -> str:
        return self.store.meta().get("status", "running")

    def evaluator(self) -> Any:
        if self._evaluator is None:
            from boinc_dl.server.work_generator.evaluate import Evaluator

            self._evaluator = Evaluator(self.files.model, self.files.val, self.spec.training.loss)
        return self._evaluator

    # ---- units ----------------------------------------------------------------------------
    def _weights_path(self) -> tuple[int, Path]:
        """The file holding the current server weights (written once per version)."""
        snap = self.store.snapshot(self.model)
        version = snap.version
        if self._weights_file and self._weights_file[0] == version:
            return self._weights_file
        path = self.files.weights(self.model, version)
        if not path.exists():
            # Shard versions first: the weights file (written atomically) is what says
            # "this version is on disk", so a full disk between the two leaves neither.
            save_shard_versions(path, snap.shard_versions)
            write_weights(path, WeightsFile(snap.flat, self.fp, job=self.spec.name, model=self.model,
                                            unit="", base_version=version))
        self._weights_file = (version, path)
        return self._weights_file

    def _describe(self, epoch: int, shard: int, version: int, wpath: Path, attempt: int = 0) -> Workunit:
        """The unit of (epoch, shard) from weights ``version``; ``attempt`` > 0 for a
        regenerated one (its own ``wu.json`` file, same unit identity)."""
        name = unit_name(self.spec.name, epoch, shard, self.model)
        wu = Workunit(
            job=self.spec.name, unit=name, mode="vcasgd", epoch=epoch, model=self.model, shard=shard,
            weights_version=version, weights_shard_versions=load_shard_versions(wpath),
            training=unit_training(self.spec),
            seed=unit_seed(self.spec.seed, epoch, shard),
            checkpoint_every_s=self.spec.units.checkpoint_every_s,
        )
        wu.files = self.files.inputs(unit_name(self.spec.name, epoch, shard, self.model, attempt),
                                     self.files.model, wpath, shard)
        return wu

    def _submit(self, wu: Workunit) -> None:
        Path(wu.files[WU_JSON]).write_text(wu.to_json())
        self.backend.submit(wu, self.limits)
        self.store.transition_unit(wu.unit, "created", "in_progress")

    def _shard_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.spec.seed, epoch]).permutation(self.n)

    def _create_next(self, window: int) -> bool:
        """Create one unit if the job has one left to create; False if not. ``window``: the
        units meant to be in flight now, recorded with the unit."""
        meta = self.store.meta()
        epoch = self._meta_int(meta, "epoch", 1)
        while True:
            created = int(self.store.epoch_counts(epoch).get("created", 0))
            if created < self.n:
                break
            if epoch >= self.spec.training.epochs or meta.get("stopping") == "1":
                return False
            epoch += 1
            self.store.set_meta(epoch=epoch)
        shard = int(self._shard_order(epoch)[created])
        version, wpath = self._weights_path()
        wu = self._describe(epoch, shard, version, wpath)
        info = {"epoch": epoch, "shard": shard, "model": self.model, "weights_version": version,
                "created_at": time.time(), "files": wu.files,
                # the units meant to be in flight as it is issued (the window): the merge
                # rule's cap (policy.rule_for). Not the count so far: a round's first unit
                # would get the full weight the cap exists to spread.
                "in_flight": window,
                # each attempt's base (a late original and its regeneration start from different
                # weights): what the merge measures a result's staleness and update against
                "bases": {"0": [version, str(wpath)]}}
        # counted with its base version: the step search bounds a large cohort's steps
        if not self.store.register_unit(wu.unit, info, epoch, issued_from=(self.model, version)):
            log.warning("unit %s was already registered; resubmitting it", wu.unit)
        self._submit(wu)
        return True

    def recover(self, resubmit_in_progress: bool = False) -> int:
        """Submit units registered but never submitted (a crash between the two).

        With ``resubmit_in_progress`` (a job system that lost its queue, such as a
        restarted local backend), units in flight are submitted again too; their
        merges stay exactly-once thanks to the assimilated marks.
        """
        self._prune_future_versions()
        states = self.store.unit_states()
        wanted = {"created"} | ({"in_progress"} if resubmit_in_progress else set())
        n = 0
        for unit, state in sorted(states.items()):
            if state not in wanted:
                continue
            info = self.store.unit_info(unit)
            if not info:
                continue
            wu = self._describe(int(info["epoch"]), int(info["shard"]), int(info["weights_version"]),
                                Path(info["files"][WEIGHTS_IN]), 0)
            wu.unit = unit
            wu.files = dict(info["files"])
            if not Path(wu.files[WEIGHTS_IN]).exists():
                version, wpath = self._weights_path()
                wu.weights_version, wu.files[WEIGHTS_IN] = version, str(wpath)
            self.store.transition_unit(unit, "in_progress", "created")
            self._submit(wu)
            n += 1
        return n

    def _prune_future_versions(self) -> int:
        """Delete weights files of versions the store has not reached.

        Such a file comes from merges Redis acknowledged but could not write to its
        append-only file before it stopped (a full disk): the restarted Redis does not
        know them, will reach those version numbers again with other weights, and a
        stale file under the same name would then be sent to hosts. No unit the store
        knows refers to it."""
        version = self.store.version(self.model)
        n = 0
        for path in self.files.dir.glob(f"{self.spec.name}__m{self.model}_v*.h5"):
            try:
                v = int(path.stem.rsplit("_v", 1)[1])
            except (IndexError, ValueError):
                continue
            if v > version:
                path.unlink(missing_ok=True)
                shard_versions_path(path).unlink(missing_ok=True)
                n += 1
        if n:
            log.warning("removed %d weights file(s) of versions after %d (merges the store did not keep)",
                        n, version)
        return n

    # ---- re-issue with fresh weights -------------------------------------------------------
    def regenerate(self, unit: str, attempt: int) -> tuple[Workunit, str] | None:
        """Rebuild ``unit`` as attempt ``attempt``: from the current server weights (``fresh``),
        or from the weights its current attempt was issued from (``same``: a workunit BOINC's
        own re-issue cannot finish, run again as a new one with its inputs).

        Returns the new workunit (same identity, its own ``wu.json``) and its job-system
        name ``<unit>_r<attempt>``, or None if the unit is finished. The unit's Redis
        record is updated first, so a restarted generator re-submits the regenerated
        inputs, not the stale ones.
        """
        info = self.store.unit_info(unit)
        state = self.store.unit_states().get(unit, "")
        if not info or state in SETTLED:
            return None
        attempt = max(attempt, int(info.get("attempt", 0)) + 1)
        epoch, shard = int(info["epoch"]), int(info["shard"])
        base = base_of(info, None) if self.reissue == "same" else (None, None)
        if base[0] is not None and base[1] and Path(base[1]).is_file():
            # same: the unit's own base, kept on disk while a unit issued from it is in flight
            version, wpath = base[0], Path(base[1])
        else:  # fresh (or a base gone): the current weights, snapshot and file only then
            version, wpath = self._weights_path()
        wu = self._describe(epoch, shard, version, wpath, attempt)
        Path(wu.files[WU_JSON]).write_text(wu.to_json())
        bases = dict(info.get("bases") or {})
        bases[str(attempt)] = [version, str(wpath)]
        info.update(attempt=attempt, weights_version=version, files=wu.files, regenerated_at=time.time(),
                    bases=bases)
        self.store.update_unit_info(unit, info)
        self.store.count_issued(self.model, version)
        return wu, unit_name(self.spec.name, epoch, shard, self.model, attempt)

    def service_regenerations(self) -> int:
        """Answer the job system's requests to regenerate lost units (``fresh`` policy) or
        stuck ones (``same``: BOINC's re-issue cannot finish them, :meth:`regenerate`)."""
        requests = getattr(self.backend, "regeneration_requests", None)
        if not callable(requests):
            return 0
        n = 0
        for unit, attempts in requests(self.spec.name):
            made = self.regenerate(unit, attempts + 1)
            if made is None:
                self.backend.cancel(unit)  # finished meanwhile: nothing to re-issue
                continue
            wu, name = made
            if self.backend.resubmit_regenerated(unit, wu, name):  # type: ignore[attr-defined]
                n += 1
                log.info("unit %s regenerated from weights v%d as %s", unit, wu.weights_version, name)
        if n:
            self.store.incr_counter("regenerated", n)
        return n

    def current_window(self) -> int:
        """Units to keep in flight now.

        A job system whose hosts come and go (BOINC) reports what the hosts asking for work
        can take (:meth:`JobSystem.live_capacity`); the spec's ``vcasgd.window`` (or the
        system's configured capacity) bounds it, and at least one unit stays in flight so
        the first host to ask finds work. Otherwise the fixed :attr:`window`.
        """
        if self._fixed_window:
            return self._fixed_window
        live = self.backend.live_capacity()
        if live is None:
            return self.window
        bound = self.spec.vcasgd.window or self.backend.capacity
        return max(1, min(live, bound) if bound else live)

    def in_flight(self) -> int:
        meta = self.store.meta()
        closed = self._meta_int(meta, "closed_epoch", 0)
        current = self._meta_int(meta, "epoch", 1)
        total = 0
        for e in range(closed + 1, current + 1):
            c = self.store.epoch_counts(e)
            total += int(c.get("created", 0) - c.get("assimilated", 0) - c.get("failed", 0))
        return total

    # ---- epochs ---------------------------------------------------------------------------
    def _epoch_summary(self, epoch: int, counts: dict[str, float]) -> dict[str, Any]:
        flat, version = self.store.get_weights(self.model)
        t0 = time.perf_counter()
        loss, acc = self.evaluator().evaluate(flat)
        eval_s = time.perf_counter() - t0
        # The epoch's units by name (marks are per subset, regenerated units included): no
        # need to read every unit record of the job at each epoch end.
        units = [unit_name(self.spec.name, epoch, k, self.model) for k in range(self.n)]
        vals = [rec.get("val_acc") for rec, _failed in self.store.settled_of(units) if rec]
        accs = [v for v in vals if v is not None]
        now = time.time()
        return {
            "val_acc": acc,
            "val_loss": loss,
            "version": version,
            "units_ok": int(counts.get("assimilated", 0)),
            "units_failed": int(counts.get("failed", 0)),
            "client_val_acc_mean": float(np.mean(accs)) if accs else None,
            "client_val_acc_std": float(np.std(accs)) if accs else None,
            "client_val_acc_min": float(np.min(accs)) if accs else None,
            "client_val_acc_max": float(np.max(accs)) if accs else None,
            "started_at": counts.get("started_at"),
            "ended_at": now,
            "elapsed_s": now - self.started,
            "eval_s": eval_s,
            "merge_rule": self.spec.vcasgd.merge_rule,
            "alpha": self.spec.vcasgd.alpha_for(epoch) if self.spec.vcasgd.merge_rule in ("paper", "fedasync") else None,
        }

    def close_epochs(self) -> list[int]:
        """Close every finished epoch in order; stop the job when it is done."""
        closed_now: list[int] = []
        while True:
            meta = self.store.meta()
            if meta.get("status") in FINISHED:
                return closed_now
            e = self._meta_int(meta, "closed_epoch", 0) + 1
            c = self.store.epoch_counts(e)
            done = c.get("assimilated", 0) + c.get("failed", 0)
            if c.get("created", 0) < self.n or done < self.n:
                return closed_now
            summary = self._epoch_summary(e, c)
            self.store.finish_epoch(e, summary)
            self.store.set_meta(closed_epoch=e, latest_val_acc=summary["val_acc"])
            closed_now.append(e)
            log.info("epoch %d closed: val_acc %.4f at weights version %d (%d ok, %d failed)", e,
                     summary["val_acc"], summary["version"], summary["units_ok"], summary["units_failed"])
            target = self.spec.training.target_accuracy
            if c.get("failed", 0) and self.spec.vcasgd.give_up_policy == "fail":
                self._finish("failed", f"epoch {e}: {int(c['failed'])} unit(s) failed for good")
            elif target is not None and summary["val_acc"] >= target:
                self._finish("done", f"target accuracy {target} reached at epoch {e}")
            elif e >= self.spec.training.epochs:
                self._finish("done", f"{e} epochs done")

    def fail(self, reason: str) -> None:
        """End the job as failed (the run's fail-fast policy): units in flight are cancelled."""
        self._finish("failed", reason)

    def _finish(self, status: str, reason: str) -> None:
        """End the job: cancel units still in flight (of later epochs) and record why."""
        self.store.set_meta(stopping=1)
        cancel_open_units(self.store, self.backend)
        self.store.set_meta(status=status, finished_at=time.time(), reason=reason)
        log.info("job %s %s: %s", self.spec.name, status, reason)

    def step(self) -> bool:
        """One pass: close finished epochs, answer re-issue requests, fill the window.

        False once the job is finished. A Redis outage longer than the store's retry
        window does not escape: the step backs off and returns True (try again), and
        the first step after the outage re-submits units registered but never handed
        to the job system. Only an outage longer than ``max_outage_s`` raises.
        """
        try:
            if self._outage_since is not None:
                n = self.recover()
                if n:
                    log.info("after the Redis outage: %d registered unit(s) submitted again", n)
            more = self._step()
        except StoreUnavailable as e:
            if diskfaults.server_fault(e):
                raise  # Redis cannot write its append-only file: waiting will not free the disk
            now = time.monotonic()
            if self._outage_since is None:
                self._outage_since = now
            if now - self._outage_since > self.max_outage_s:
                raise
            log.warning("work generator: %s; retrying in %.1f s", e, self._backoff)
            time.sleep(self._backoff)
            self._backoff = min(self._backoff * 2, 5.0)
            return True
        self._outage_since, self._backoff = None, 0.1
        return more

    def _step(self) -> bool:
        self.close_epochs()
        if self.status() in FINISHED:
            # ended here, or by someone else (``boinc-dl cancel``): nothing left open
            cancel_open_units(self.store, self.backend)
            return False
        self.service_regenerations()
        window = self.current_window()
        free = window - self.in_flight()
        while free > 0 and self._create_next(window):
            free -= 1
        return True
