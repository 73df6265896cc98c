"""Run a VC-ASGD job on a :class:`LocalJobSystem` built with any of its options.

``run_job`` (``boinc-dl run``) builds its job system from the spec's
``backend.local`` section; tests and benchmarks also need the options it does not
pass on (preemption modes, synthetic units, grace periods) and a handle on the job
system to inject faults. This is the same sequence — prepare the job, start the job
system, recover units in flight, step the work generator until the job finishes —
without the progress display and the report files.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from boinc_dl.server.assimilator.connection import connect
from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.backends.local import LocalJobSystem
from boinc_dl.server.common.spec import JobSpec, parse_spec
from boinc_dl.server.work_generator.prepare import prepare_job
from boinc_dl.server.work_generator.vcasgd import VCASGDWorkGenerator


def small_spec(name: str, **over: Any) -> JobSpec:
    """A small digits VC-ASGD job (400 examples, 16-unit MLP) for fault tests.

    ``over`` replaces top-level fields; dict values are merged one level deep.
    """
    data: dict[str, Any] = {
        "name": name,
        "model": "models:mlp",
        "model_args": {"hidden": 16},
        "dataset": {"name": "digits", "limit": 400},
        "training": {"epochs": 2, "batch_size": 32, "learning_rate": 0.01},
        "vcasgd": {"n_subsets": 4, "alpha": 0.5},
        "units": {"timeout_s": 20, "checkpoint_every_s": 1},
        "backend": {"local": {"workers": 2, "slots": 2, "assimilators": 2}},
        "seed": 3,
    }
    for k, v in over.items():
        data[k] = {**data[k], **v} if isinstance(v, dict) and isinstance(data.get(k), dict) else v
    return parse_spec(data)


@dataclass
class HeadlessResult:
    """Outcome of :func:`run_headless`."""

    status: str
    elapsed_s: float
    epochs: dict[int, dict[str, Any]]
    backend: dict[str, Any]
    reissue_delays: list[dict[str, Any]] = field(default_factory=list)
    reason: str = ""

    @property
    def final_val_acc(self) -> float | None:
        return self.epochs[max(self.epochs)]["val_acc"] if self.epochs else None


def run_headless(spec: JobSpec, run_dir: Path, redis_url: str, *, search_path: Path | None = None,
                 backend_opts: dict[str, Any] | None = None,
                 on_start: Callable[[LocalJobSystem, VCASGDWorkGenerator], None] | None = None,
                 timeout_s: float = 900.0, resume: bool = False) -> HeadlessResult:
    """Run ``spec`` to its end on the local backend; ``backend_opts`` go to LocalJobSystem.

    ``on_start(backend, generator)`` is called once both run (to start fault threads).
    Raises TimeoutError if the job is not finished after ``timeout_s``.
    """
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    store = JobStore(connect(redis_url), spec.name)
    prepare_job(spec, store, run_dir, resume=resume, search_path=search_path)
    loc = spec.backend.local
    opts: dict[str, Any] = {"workers": loc.workers, "slots": loc.slots, "assimilators": loc.assimilators,
                            "threads_per_slot": loc.threads_per_slot, "preempt_prob": loc.preempt_prob,
                            "seed": spec.seed, **(backend_opts or {})}
    backend = LocalJobSystem(run_dir, redis_url, spec.name, **opts)
    t0 = time.time()
    backend.start()
    try:
        gen = VCASGDWorkGenerator(store, spec, run_dir, backend)
        gen.recover(resubmit_in_progress=True)
        if on_start is not None:
            on_start(backend, gen)
        while gen.step():
            if time.time() - t0 > timeout_s:
                raise TimeoutError(f"job {spec.name} not finished after {timeout_s:.0f} s: {backend.snapshot()}")
            time.sleep(0.02)
        elapsed = time.time() - t0
        snap = backend.snapshot()
        delays = list(backend.reissue_delays)
    finally:
        backend.stop()
    meta = store.meta()
    return HeadlessResult(meta.get("status", "?"), elapsed, store.epochs(), snap, delays, meta.get("reason", ""))
