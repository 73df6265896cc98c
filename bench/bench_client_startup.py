"""Client start-up per BOINC task: a fresh ``python -m boinc_dl.client_app`` per unit, before vs after.

BOINC's wrapper starts a new process for every task, so whatever the client does
before its first batch is paid once per unit. This runs a real small unit (scikit-
learn's digits, the examples' MLP 64-64-10, 360 examples x 2 local epochs, batch 32)
in fresh processes, alternating the current code with a baseline exported from a git
revision (``--baseline-ref``, default: the commit before the start-up cuts), and
reports medians of the process wall time and of the phases the client records in
``metrics.json``. Two reference floors are measured in the same run: a bare
interpreter, and ``import tensorflow, keras`` alone (plain and as the client now
does it, with Keras' optional imports hidden).

    PYTHONPATH=$PWD python3 bench/bench_client_startup.py --repeats 3
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import before_after_args, emit, export_ref, machine, median  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BASELINE_REF = "90e8a71"  # before lean imports and autograph-free train steps

PLAIN_IMPORT = "import tensorflow, keras"
LEAN_IMPORT = "from boinc_dl.server.common.keras_model import import_tensorflow; import_tensorflow()"


def make_unit(slot: Path) -> None:
    """The digits example's unit: the work generator's side of the contract."""
    import keras
    import numpy as np
    from sklearn.datasets import load_digits

    sys.path.insert(0, str(REPO / "examples"))
    from models import mlp

    from boinc_dl.server.common.keras_model import get_flat, model_fingerprint
    from boinc_dl.server.common.weights import WeightsFile, write_weights
    from boinc_dl.server.common.workunit import Workunit, unit_name

    slot.mkdir(parents=True, exist_ok=True)
    keras.utils.set_random_seed(1)
    mlp(64, 64, 10).save(slot / "model.keras")
    model = keras.models.load_model(slot / "model.keras", compile=False)
    write_weights(slot / "weights_in.h5",
                  WeightsFile(get_flat(model), model_fingerprint(model), job="job", unit="", base_version=0))
    x, y = load_digits(return_X_y=True)
    x, y = (x / 16).astype(np.float32), y.astype(np.int64)
    np.savez(slot / "data.npz", x=x[:360], y=y[:360])
    np.savez(slot / "val.npz", x=x[1500:], y=y[1500:])
    wu = Workunit(job="job", unit=unit_name("job", 1, 0), mode="vcasgd", epoch=1, model="0", shard=0,
                  weights_version=0, seed=3, hyper={}, checkpoint_every_s=10.0,
                  training={"batch_size": 32, "optimizer": "sgd", "learning_rate": 0.05, "momentum": 0.9,
                            "local_epochs": 2, "loss": "sparse_categorical_crossentropy"})
    (slot / "wu.json").write_text(wu.to_json())


def env_for(code: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(code), "TF_CPP_MIN_LOG_LEVEL": "2", "BDL_PREEMPT_PROVIDER": "none"}


def timed(cmd: list[str], code: Path) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, cwd=code, env=env_for(code), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   check=True)
    return time.perf_counter() - t


def run_task(code: tuple[Path, str], unit: Path, slot: Path) -> dict[str, float]:
    """One task as BOINC runs it: a fresh process in a slot holding the unit's inputs, with
    the code of ``code`` (:func:`bench._common.export_ref`: PYTHONPATH, import prefix)."""
    shutil.rmtree(slot, ignore_errors=True)
    shutil.copytree(unit, slot)
    path, prefix = code
    wall = timed([sys.executable, "-m", f"{prefix}client_app", "--slot", str(slot), "--threads", "1", "-q"], path)
    m = json.loads((slot / "metrics.json").read_text())
    return {"wall_s": wall, "load_s": m["load_s"], "train_s": m["train_s"], "eval_s": m["eval_s"],
            "val_acc": m["val_acc"]}


def main() -> None:
    args = before_after_args(__doc__, BASELINE_REF)

    with tempfile.TemporaryDirectory(prefix="bench_startup_") as tmp_s:
        tmp = Path(tmp_s)
        base = export_ref(REPO, args.baseline_ref, tmp / "baseline")
        unit = tmp / "unit"
        subprocess.run([sys.executable, "-c", f"import sys; sys.argv=['x', {str(unit)!r}]; "
                        "from bench.bench_client_startup import make_unit; from pathlib import Path; "
                        "make_unit(Path(sys.argv[1]))"], cwd=REPO, env=env_for(REPO), check=True,
                       stderr=subprocess.DEVNULL)

        rows: dict[str, list[float]] = {k: [] for k in ("python", "import_plain", "import_lean")}
        tasks: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
        # Interleaved, order flipped every repeat, so that load changes and a warm page
        # cache favour neither side.
        for i in range(args.repeats):
            rows["python"].append(timed([sys.executable, "-c", "pass"], REPO))
            imports = [("import_plain", PLAIN_IMPORT), ("import_lean", LEAN_IMPORT)]
            sides = [("before", base), ("after", (REPO, "boinc_dl."))]
            if i % 2:
                imports.reverse()
                sides.reverse()
            for key, code in imports:
                rows[key].append(timed([sys.executable, "-c", code], REPO))
            for side, code_dir in sides:
                tasks[side].append(run_task(code_dir, unit, tmp / f"slot_{side}"))

    med = {k: round(median(v), 3) for k, v in rows.items()}
    phases = {side: {k: round(median([t[k] for t in ts]), 3) for k in ts[0]} for side, ts in tasks.items()}
    print(f"{'':24}{'before':>10}{'after':>10}")
    for k in ("wall_s", "load_s", "train_s", "eval_s", "val_acc"):
        print(f"task {k:19}{phases['before'][k]:>10}{phases['after'][k]:>10}")
    print(f"python -c pass          {med['python']:>10}")
    print(f"import tensorflow,keras {med['import_plain']:>10}{med['import_lean']:>10}  (plain / lean)")
    emit("client_startup", repeats=args.repeats, baseline_ref=args.baseline_ref,
         task_wall_before_s=phases["before"]["wall_s"], task_wall_after_s=phases["after"]["wall_s"],
         ratio_after_before=round(phases["after"]["wall_s"] / phases["before"]["wall_s"], 3),
         before=phases["before"], after=phases["after"], python_s=med["python"],
         import_plain_s=med["import_plain"], import_lean_s=med["import_lean"],
         import_ratio_lean_plain=round(med["import_lean"] / med["import_plain"], 3),
         load1=os.getloadavg()[0], **machine())


if __name__ == "__main__":
    main()
