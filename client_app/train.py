"""Train one workunit in-process, from the input files of its slot directory only.

The unit's inputs (see :mod:`boinc_dl.server.common.workunit`) are resolved through BOINC
link files when present. Training is a manual loop over batches of a compiled
train step, so that the loop controls checkpoints, progress and interruption:

* batch order: a permutation per local epoch from ``numpy.random.default_rng((seed,
  local_epoch))``, so a resumed run takes exactly the batches of an uninterrupted one;
* determinism: Keras' global seed, TensorFlow's deterministic ops, per-unit RNG
  state of the model's seed generators (e.g. dropout) derived from the unit seed,
  and a freshly zeroed optimizer: the same unit from the same inputs gives bitwise
  identical weights on CPU, in a fresh process or in a long-lived one;
* checkpoints every ``checkpoint_every_s`` seconds and at each local-epoch end
  (:mod:`boinc_dl.client_app.checkpoint`); a restarted unit resumes from the last one;
* progress: ``fraction_done`` (for BOINC's wrapper) and ``progress.json`` (the
  position, used after a restart to count the batches redone), at most once a
  second, and the caller's ``progress`` callback at the same pace;
* interruption: ``should_stop()`` is polled between batches; a stop writes a
  checkpoint and returns an ``interrupted`` result.

TensorFlow is imported only once the cheap input checks have passed, so that a bad
input fails in well under a second, and so that the caller can choose the GPU
(``CUDA_VISIBLE_DEVICES``) before TensorFlow starts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from boinc_dl.client_app import checkpoint
from boinc_dl.client_app.boinc_io import (
    InitData,
    atomic_write_json,
    read_init_data,
    resolve,
    write_fraction_done,
)
from boinc_dl.client_app.model_cache import ModelCache
from boinc_dl.client_app.unit_inputs import (
    Settings,
    UnitInputError,
    check_against_model,
    load_npz,
    one_line,
    read_workunit,
    sha256_file,
)
from boinc_dl.server.common.errors import WeightsFormatError
from boinc_dl.server.common.weights import (
    OptimizerState,
    WeightsFile,
    read_weights,
    write_weights,
)
from boinc_dl.server.common.workunit import (
    DATA,
    METRICS,
    MODEL,
    VAL,
    WEIGHTS_IN,
    WEIGHTS_OUT,
    WU_JSON,
)

log = logging.getLogger("boinc_dl.client_app")

PROGRESS_JSON = "progress.json"
DONE = "done"
INTERRUPTED = "interrupted"
# Share of the fraction done given to training; evaluation and outputs take the rest.
_TRAIN_SHARE = 0.99
_PROGRESS_PERIOD_S = 1.0
_EVAL_BATCH = 1024



@dataclass
class UnitResult:
    """What :func:`run_unit` did: ``status`` is ``"done"`` or ``"interrupted"``."""

    status: str
    metrics: dict[str, Any]
    weights_out: Path | None = None
    metrics_out: Path | None = None
    checkpoint: Path | None = None

    @property
    def interrupted(self) -> bool:
        return self.status == INTERRUPTED


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.4f}"


def _device_name() -> str:
    import tensorflow as tf

    gpus = tf.config.list_logical_devices("GPU")
    if not gpus:
        return "CPU"
    try:
        details = tf.config.experimental.get_device_details(tf.config.list_physical_devices("GPU")[0])
        return f"GPU:0 ({details.get('device_name', 'unknown')})"
    except (IndexError, ValueError, RuntimeError):
        return "GPU:0"


class _Progress:
    """Writes ``fraction_done`` and ``progress.json``, and calls back, at most once a second."""

    def __init__(self, slot: Path, key: str, total: int, callback: Callable[[float], None] | None):
        self.slot, self.key, self.total, self.callback = slot, key, max(1, total), callback
        self._last = -math.inf

    def update(self, done: int, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < _PROGRESS_PERIOD_S:
            return
        self._last = now
        frac = _TRAIN_SHARE * min(done, self.total) / self.total
        write_fraction_done(self.slot, frac)
        atomic_write_json(self.slot / PROGRESS_JSON, {"key": self.key, "done": done, "total": self.total})
        if self.callback is not None:
            self.callback(frac)

    def finish(self) -> None:
        write_fraction_done(self.slot, 1.0)
        if self.callback is not None:
            self.callback(1.0)

    @staticmethod
    def last_done(slot: Path, key: str) -> int | None:
        """Batches done when the previous run of this unit last reported progress."""
        try:
            d = json.loads((slot / PROGRESS_JSON).read_text())
            return int(d["done"]) if d.get("key") == key else None
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None


def run_unit(
    slot_dir: str | Path,
    *,
    cache: ModelCache | None = None,
    threads: int | None = None,
    should_stop: Callable[[], bool] | None = None,
    progress: Callable[[float], None] | None = None,
) -> UnitResult:
    """Train the workunit whose input files are in ``slot_dir``; write its outputs there.

    ``cache`` keeps the loaded model and compiled steps for the next unit of the same
    process; ``threads`` bounds TensorFlow's thread pools (effective only before
    TensorFlow first runs in this process); ``should_stop`` is polled between batches
    and makes the unit checkpoint and return an ``interrupted`` result; ``progress``
    receives the fraction done (0..1) at most once a second.

    Raises :class:`UnitInputError` for a permanent input problem (bad ``wu.json``,
    missing or unreadable inputs, weights that do not match the model).
    """
    return _Run(Path(slot_dir), cache, threads, should_stop or (lambda: False), progress).run()


class _Run:
    def __init__(self, slot: Path, cache: ModelCache | None, threads: int | None,
                 should_stop: Callable[[], bool], progress: Callable[[float], None] | None):
        self.t0 = time.monotonic()
        self.cpu0 = time.process_time()  # the slot's process runs one unit at a time
        self.slot = slot
        self.cache = cache if cache is not None else ModelCache(max_models=1)
        self.threads = threads
        self.should_stop = should_stop
        self.progress_cb = progress
        self.train_s = 0.0
        self.train_cpu_s = 0.0  # CPU seconds of the training steps (TensorFlow's threads too)
        #: CPU seconds of the unit's first step: far more than the others (setting the
        #: unit's seed before training clears TensorFlow's kernel cache), a per-unit cost
        #: that does not scale with the unit's examples (the planner's calibration reads it).
        self.first_step_cpu_s: float | None = None
        self.checkpoint_s = 0.0
        self.checkpoints = 0

    # -- stages ---------------------------------------------------------------------------

    def run(self) -> UnitResult:
        if not self.slot.is_dir():
            raise UnitInputError(f"slot directory {self.slot} does not exist")
        try:
            paths = {n: resolve(self.slot, n) for n in (WU_JSON, MODEL, WEIGHTS_IN, DATA, VAL, WEIGHTS_OUT, METRICS)}
        except ValueError as e:  # a link file pointing outside the mounted project directory
            raise UnitInputError(str(e)) from None
        self.paths = paths
        wu, wu_raw = read_workunit(paths[WU_JSON])
        self.wu = wu
        self.settings = Settings.from_workunit(wu)
        for n in (MODEL, WEIGHTS_IN, DATA, VAL):
            if not paths[n].is_file():
                shown = n if paths[n] == self.slot / n else f"{n} (-> {paths[n]})"
                raise UnitInputError(f"missing input file {shown}")
        self.x, self.y = load_npz(paths[DATA], DATA, allow_empty=False)
        self.xv, self.yv = load_npz(paths[VAL], VAL, allow_empty=True)
        if self.xv.shape[1:] != self.x.shape[1:]:
            raise UnitInputError(f"{VAL}: examples have shape {self.xv.shape[1:]}, {DATA} has {self.x.shape[1:]}")
        if self.yv.dtype != self.y.dtype or self.yv.shape[1:] != self.y.shape[1:]:
            raise UnitInputError(f"{VAL}: labels are {self.yv.dtype}{self.yv.shape[1:]}, "
                                 f"{DATA} has {self.y.dtype}{self.y.shape[1:]}")
        self.init: InitData | None = read_init_data(self.slot)
        if self.should_stop():
            return self._interrupted(checkpointed=False)

        from boinc_dl.server.common.keras_model import configure_tf

        configure_tf(self.threads)
        import keras

        model_sha = sha256_file(paths[MODEL])
        self.entry, self.cache_hit = self.cache.get(paths[MODEL], model_sha, self.slot)
        model = self.model = self.entry.model
        check_against_model(model, DATA, self.x, self.y)
        check_against_model(model, VAL, self.xv, self.yv)
        try:
            wf = read_weights(paths[WEIGHTS_IN], expected=self.entry.fingerprint)
        except WeightsFormatError as e:
            # read_weights names the physical file; report the logical name instead
            msg = one_line(e).removeprefix(f"{paths[WEIGHTS_IN].name}: ")
            raise UnitInputError(f"{WEIGHTS_IN}: {msg}") from None
        if not np.isfinite(wf.flat).all():
            raise UnitInputError(f"{WEIGHTS_IN}: contains NaN or Inf")
        from boinc_dl.server.common.keras_model import set_flat

        set_flat(model, wf.flat)
        self.trainer = self.cache.trainer(self.entry, self.settings, self.x, self.y)
        self.trainer.reset(self.settings.learning_rate)
        self.carried_optimizer = wu.mode == "mop" and self._carry_in(wf.optimizer)
        keras.utils.set_random_seed(wu.seed % 2**32)
        self._reset_rng_state(wu.seed)

        # The unit's identity for checkpoints: its description, its starting point and
        # (cheaply) its data; a checkpoint left by another unit in a reused slot is not ours.
        ident = [wu_raw, model_sha.encode(), sha256_file(paths[WEIGHTS_IN]).encode(),
                 f"{self.x.shape}{self.y.shape}{self.xv.shape}".encode()]
        self.key = hashlib.sha256(b"\0".join(ident)).hexdigest()
        self.nb = math.ceil(len(self.x) / self.settings.batch_size)
        self.total = self.nb * self.settings.local_epochs
        self.progress = _Progress(self.slot, self.key, self.total, self.progress_cb)
        self._restore()
        self.load_s = time.monotonic() - self.t0
        self.device = _device_name()
        log.info("unit %s: %d examples x %d local epochs, batch %d, %s lr=%g on %s%s",
                 wu.unit, len(self.x), self.settings.local_epochs, self.settings.batch_size,
                 self.settings.optimizer, self.settings.learning_rate, self.device,
                 f", resumed at batch {self.pos.done}/{self.total}" if self.resumed else "")
        if self.should_stop():
            return self._interrupted(checkpointed=False)
        if not self._train():
            return self._interrupted(checkpointed=True)
        return self._finish()

    def _reset_rng_state(self, seed: int) -> None:
        """Give each seed generator (dropout, noise layers) a state derived from the unit seed.

        A cached model's generators have advanced during earlier units; resetting them
        makes a unit's random draws independent of what the process did before.
        """
        weight_ids = {id(w) for w in self.model.weights}
        rng_vars = [v for v in self.model.variables if id(v) not in weight_ids and "seed_generator" in v.path]
        for i, v in enumerate(rng_vars):
            s = int(np.random.default_rng([seed, 1_000_003, i]).integers(0, 2**31 - 1))
            state = np.zeros(tuple(v.shape), dtype=v.dtype)
            state.reshape(-1)[0] = s
            v.assign(state)

    def _restore(self) -> None:
        """Resume from a checkpoint of this unit if a valid one exists."""
        self.pos = checkpoint.Position()
        self.resumed = False
        prev_done = _Progress.last_done(self.slot, self.key)
        try:
            got = checkpoint.load(self.slot, self.key)
        except checkpoint.CheckpointInvalid as e:
            log.warning("ignoring the checkpoint in %s: %s; the unit restarts from its first batch", self.slot, e)
            got = None
        if got is not None:
            pos, groups = got
            problem = self._check_groups(groups, pos)
            if problem:
                log.warning("ignoring the checkpoint in %s: %s; the unit restarts from its first batch",
                            self.slot, problem)
            else:
                for v, a in zip(self.model.variables, groups["model"], strict=True):
                    v.assign(a)
                for v, a in zip(self.trainer.optimizer.variables, groups["optimizer"], strict=True):
                    v.assign(a)
                self.pos, self.resumed = pos, True
        # Work the previous run did after its last checkpoint is lost and redone now;
        # progress.json is written at most once a second, so this is a lower bound.
        redone = max(0, (prev_done or 0) - self.pos.done)
        if self.resumed or prev_done is not None:
            self.pos.restarts += 1
        self.pos.redone_batches += redone
        self.redone_now = redone
        self.resumed_at = self.pos.done
        self.train_s_before = self.pos.train_s_total
        self.ckpt_done = self.pos.done
        self.last_ckpt_t = time.monotonic()

    def _check_groups(self, groups: dict[str, list[np.ndarray]], pos: checkpoint.Position) -> str | None:
        for name, variables in (("model", self.model.variables), ("optimizer", self.trainer.optimizer.variables)):
            arrays = groups.get(name)
            if arrays is None or len(arrays) != len(variables):
                return f"it holds {0 if arrays is None else len(arrays)} {name} variables, expected {len(variables)}"
            for v, a in zip(variables, arrays, strict=True):
                if tuple(a.shape) != tuple(v.shape) or np.dtype(a.dtype) != np.dtype(v.dtype):
                    return f"{name} variable {v.path}: {a.dtype}{a.shape} != {v.dtype}{tuple(v.shape)}"
        if not (0 <= pos.local_epoch <= self.settings.local_epochs and 0 <= pos.batch <= self.nb
                and 0 <= pos.done <= self.total):
            return f"position (local epoch {pos.local_epoch}, batch {pos.batch}) is outside the unit"
        return None

    def _train(self) -> bool:
        """The batch loop; False if stopped (after writing a checkpoint)."""
        s, pos, x, y = self.settings, self.pos, self.x, self.y
        n, bs = len(x), s.batch_size
        every = float(self.wu.checkpoint_every_s)
        step = self.trainer.train_step
        for le in range(pos.local_epoch, s.local_epochs):
            order = np.random.default_rng([self.wu.seed, le]).permutation(n)
            if pos.batch == 0:
                pos.loss_sum, pos.correct, pos.count = 0.0, 0.0, 0
            for b in range(pos.batch, self.nb):
                if self.should_stop():
                    if pos.done > self.ckpt_done:
                        self._checkpoint()
                    return False
                idx = order[b * bs:(b + 1) * bs]
                xb, yb = x[idx], y[idx]
                t, c = time.perf_counter(), time.process_time()
                loss_sum, correct = step(xb, yb)
                loss_sum, correct = float(loss_sum), float(correct)
                self.train_s += time.perf_counter() - t
                dc = time.process_time() - c
                self.train_cpu_s += dc
                if self.first_step_cpu_s is None:
                    self.first_step_cpu_s = dc
                pos.loss_sum += loss_sum
                pos.correct += correct
                pos.count += len(idx)
                pos.batch = b + 1
                pos.done += 1
                pos.examples_seen += len(idx)
                self.progress.update(pos.done)
                if every > 0 and time.monotonic() - self.last_ckpt_t >= every and pos.batch < self.nb:
                    self._checkpoint()
            pos.local_epoch, pos.batch = le + 1, 0
            self._checkpoint()
        return True

    def _checkpoint(self) -> None:
        t = time.perf_counter()
        self.pos.train_s_total = self.train_s_before + self.train_s
        groups = {
            "model": [v.numpy() for v in self.model.variables],
            "optimizer": [v.numpy() for v in self.trainer.optimizer.variables],
        }
        checkpoint.save(self.slot, self.key, self.wu.unit, groups, self.pos)
        self.ckpt_done = self.pos.done
        self.last_ckpt_t = time.monotonic()
        self.checkpoints += 1
        self.checkpoint_s += time.perf_counter() - t

    def _evaluate(self) -> tuple[float | None, float | None]:
        if len(self.xv) == 0:
            return None, None
        loss = correct = 0.0
        for i in range(0, len(self.xv), _EVAL_BATCH):
            ls, c = self.trainer.eval_step(self.xv[i:i + _EVAL_BATCH], self.yv[i:i + _EVAL_BATCH])
            loss += float(ls)
            correct += float(c)
        return loss / len(self.xv), correct / len(self.xv)

    def _finish(self) -> UnitResult:
        from boinc_dl.server.common.keras_model import get_flat

        wu, pos = self.wu, self.pos
        t = time.perf_counter()
        val_loss, val_acc = self._evaluate()
        eval_s = time.perf_counter() - t
        metrics: dict[str, Any] = {
            "job": wu.job,
            "unit": wu.unit,
            "model": wu.model,
            "result": self.init.result_name if self.init else "",
            "mode": wu.mode,
            "epoch": wu.epoch,
            "shard": wu.shard,
            "base_version": wu.weights_version,
            "train_loss": pos.loss_sum / pos.count if pos.count else None,
            "train_acc": pos.correct / pos.count if pos.count else None,
            "val_loss": val_loss,
            "val_acc": val_acc,
            "examples_seen": pos.examples_seen,
            "n_examples": len(self.x),
            "batches": self.total,
            "batch_size": self.settings.batch_size,
            "local_epochs": self.settings.local_epochs,
            "optimizer": self.settings.optimizer,
            "learning_rate": self.settings.learning_rate,
            "hyper": wu.hyper,
            "wall_s": time.monotonic() - self.t0,
            "train_s": self.train_s,
            "train_s_total": self.train_s_before + self.train_s,
            # CPU seconds on this host's own clock: unlike wall times, they do not grow
            # when other slots share the cores (the planner's calibration reads them).
            "train_cpu_s": self.train_cpu_s,
            "cpu_s": time.process_time() - self.cpu0,
            "first_step_cpu_s": self.first_step_cpu_s or 0.0,
            "load_s": self.load_s,
            "eval_s": eval_s,
            "checkpoint_s": self.checkpoint_s,
            "checkpoints": self.checkpoints,
            "resumed": self.resumed,
            "resumed_at_batch": self.resumed_at,
            "redone_batches": pos.redone_batches,
            "restarts": pos.restarts,
            "model_cache_hit": self.cache_hit,
            "host": socket.gethostname(),
            "device": self.device,
            "threads": self.threads,
        }
        metrics["optimizer_carried_in"] = self.carried_optimizer
        write_weights(self.paths[WEIGHTS_OUT], WeightsFile(
            flat=get_flat(self.model), fingerprint=self.entry.fingerprint, job=wu.job, model=wu.model,
            unit=wu.unit, base_version=wu.weights_version, examples_seen=pos.examples_seen, metrics=metrics,
            optimizer=self._carry_out() if wu.mode == "mop" else None,
        ))
        atomic_write_json(self.paths[METRICS], metrics)
        # Outputs are in place: the checkpoint and position are no longer needed, and
        # a slot reused for another unit should not carry them.
        checkpoint.remove(self.slot)
        (self.slot / PROGRESS_JSON).unlink(missing_ok=True)
        self.progress.finish()
        log.info("unit %s done: train_loss=%s val_acc=%s in %.1f s (%.1f s training)", wu.unit,
                 _fmt(metrics["train_loss"]), _fmt(val_acc), metrics["wall_s"], self.train_s)
        return UnitResult(DONE, metrics, self.paths[WEIGHTS_OUT], self.paths[METRICS])

    def _opt_vars(self) -> list[Any]:
        lr_var = self.trainer.optimizer.learning_rate
        return [v for v in self.trainer.optimizer.variables if v is not lr_var]

    def _carry_in(self, state: OptimizerState | None) -> bool:
        """MOP: continue from the optimizer state that hopped in with the weights, when it
        matches this optimizer (kind, count and shapes); else keep the fresh state."""
        if state is None or state.kind != self.settings.optimizer:
            return False
        variables = self._opt_vars()
        if len(variables) != len(state.arrays) or any(
                tuple(v.shape) != a.shape for v, a in zip(variables, state.arrays, strict=True)):
            log.warning("optimizer state in %s does not match this optimizer: starting fresh", WEIGHTS_IN)
            return False
        for v, a in zip(variables, state.arrays, strict=True):
            v.assign(a.astype(v.dtype.name if hasattr(v.dtype, "name") else a.dtype))
        return True

    def _carry_out(self) -> OptimizerState:
        return OptimizerState(self.settings.optimizer, [np.asarray(v.numpy()) for v in self._opt_vars()])

    def _interrupted(self, *, checkpointed: bool) -> UnitResult:
        pos = getattr(self, "pos", None)
        metrics = {
            "unit": self.wu.unit,
            "done_batches": pos.done if pos else 0,
            "batches": getattr(self, "total", None),
            "wall_s": time.monotonic() - self.t0,
            "train_s": self.train_s,
            "checkpoints": self.checkpoints,
        }
        ck = self.slot / checkpoint.CKPT_H5
        log.info("unit %s interrupted at batch %s/%s%s", self.wu.unit, metrics["done_batches"], metrics["batches"],
                 "; checkpoint written" if checkpointed else "")
        if pos is not None:
            self.progress.update(pos.done, force=True)
        return UnitResult(INTERRUPTED, metrics, checkpoint=ck if ck.exists() else None)
