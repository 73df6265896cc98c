"""Reproducibility of MOP: retrain one configuration sequentially over its recorded
partition-visit order and compare with the weights MOP produced.

Every unit's inputs are on disk (its ``wu.json`` with seed and hyper-parameters, the
model file, the partition, the validation split); the replay chains them in the recorded
order with the client app, feeding each unit the previous unit's output. With
TensorFlow's deterministic ops on CPU the result is bitwise identical.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.common.weights import read_weights
from boinc_dl.server.common.workunit import (
    DATA,
    MODEL,
    VAL,
    WEIGHTS_IN,
    WEIGHTS_OUT,
    WU_JSON,
    unit_name,
)
from boinc_dl.server.work_generator.mop.state import MopState
from boinc_dl.server.work_generator.prepare import JobFiles


def replay_model(store: JobStore, job_dir: Path, model: str, threads: int = 1) -> tuple[np.ndarray, list[str]]:
    """(weights after sequential retraining, the unit names replayed in order)."""
    from boinc_dl.client_app.train import ModelCache, run_unit

    files = JobFiles(Path(job_dir).resolve(), store.job)
    log = MopState(store).schedule_log()
    units = [unit_name(store.job, e, p, m, att - 1) for m, p, _w, att, e in log if m == model]
    weights = files.weights(model, 0)
    cache = ModelCache()
    work = Path(tempfile.mkdtemp(prefix="bdl-replay-"))
    try:
        for i, unit in enumerate(units):
            info = store.unit_info(unit)
            if info is None:
                raise KeyError(f"unit {unit} is not recorded")
            slot = work / f"slot{i}"
            slot.mkdir()
            src = info["files"]
            for logical, physical in ((WU_JSON, src[WU_JSON]), (MODEL, src[MODEL]), (DATA, src[DATA]),
                                      (VAL, src[VAL]), (WEIGHTS_IN, str(weights))):
                os.symlink(physical, slot / logical)
            run_unit(slot, cache=cache, threads=threads)
            weights = work / f"w{i}.h5"
            shutil.move(str(slot / WEIGHTS_OUT), weights)
        return read_weights(weights).flat, units
    finally:
        shutil.rmtree(work, ignore_errors=True)
