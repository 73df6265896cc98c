"""The client app in-process: outputs, metrics, determinism, checkpoints, BOINC files, bad inputs.

Real TensorFlow on a tiny model (Dense 8->4->3 with dropout), real HDF5 and npz files.
The subprocess tests (SIGKILL, SIGTERM, exit codes) are in test_client_app_cli.py.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from boinc_dl.client_app import boinc_io, checkpoint  # noqa: E402
from boinc_dl.client_app.cli import (  # noqa: E402
    StopFlag,
    choose_threads,
    main,
    select_device,
    start_preemption_watcher,
)
from boinc_dl.client_app.train import PROGRESS_JSON, ModelCache, UnitInputError, run_unit  # noqa: E402
from boinc_dl.server.common.keras_model import configure_tf, get_flat, model_fingerprint  # noqa: E402
from boinc_dl.server.common.weights import (  # noqa: E402
    Fingerprint,
    WeightsFile,
    read_header,
    read_weights,
    write_weights,
)
from boinc_dl.server.common.workunit import INPUT_NAMES, OUTPUT_NAMES, Workunit, unit_name  # noqa: E402

THREADS = 1
configure_tf(THREADS)  # before any test touches TensorFlow: one thread, deterministic ops

METRIC_FIELDS = {
    "job", "unit", "model", "result", "train_loss", "train_acc", "val_loss", "val_acc", "examples_seen",
    "wall_s", "train_s", "load_s", "resumed", "redone_batches", "host", "device",
}


def make_unit(
    slot: Path,
    *,
    n: int = 240,
    n_val: int = 60,
    batch_size: int = 16,
    local_epochs: int = 2,
    seed: int = 7,
    checkpoint_every_s: float = 10.0,
    hyper: dict[str, Any] | None = None,
    dropout: float = 0.2,
    optimizer: str = "adam",
    shard: int = 0,
) -> Fingerprint:
    """Write a complete unit (the work generator's side of the contract) into ``slot``."""
    import keras

    slot.mkdir(parents=True, exist_ok=True)
    keras.utils.set_random_seed(123)
    layers = [keras.Input((8,)), keras.layers.Dense(4, activation="relu")]
    if dropout:
        layers.append(keras.layers.Dropout(dropout))
    layers.append(keras.layers.Dense(3, activation="softmax"))
    keras.Sequential(layers).save(slot / "model.keras")
    # Fingerprint the model as clients load it (a loaded Sequential names its tensors
    # without the model prefix), as the work generator does.
    model = keras.models.load_model(slot / "model.keras", compile=False)
    fp = model_fingerprint(model)
    write_weights(slot / "weights_in.h5", WeightsFile(get_flat(model), fp, job="job", unit="", base_version=3))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n + n_val, 8)).astype(np.float32)
    y = ((x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0.5)).astype(np.int64)
    np.savez(slot / "data.npz", x=x[:n], y=y[:n])
    np.savez(slot / "val.npz", x=x[n:], y=y[n:])
    wu = Workunit(
        job="job", unit=unit_name("job", 1, shard), mode="vcasgd", epoch=1, model="0", shard=shard,
        weights_version=3, seed=seed, hyper=hyper or {}, checkpoint_every_s=checkpoint_every_s,
        training={"batch_size": batch_size, "optimizer": optimizer, "learning_rate": 0.01, "momentum": 0.0,
                  "local_epochs": local_epochs, "loss": "sparse_categorical_crossentropy"},
    )
    (slot / "wu.json").write_text(wu.to_json())
    return fp


def copy_inputs(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for name in INPUT_NAMES:
        shutil.copy2(src / name, dst / name)
    return dst


def weights_out(slot: Path, fp: Fingerprint | None = None) -> np.ndarray:
    return read_weights(slot / "weights_out.h5", expected=fp).flat


def stop_after(polls: int):
    """A should_stop that turns True on its ``polls``-th call."""
    calls = {"n": 0}

    def should_stop() -> bool:
        calls["n"] += 1
        return calls["n"] > polls

    return should_stop


@pytest.fixture(scope="module")
def unit_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Fingerprint]:
    d = tmp_path_factory.mktemp("unit")
    return d, make_unit(d)


@pytest.fixture(scope="module")
def reference(unit_dir: tuple[Path, Fingerprint], tmp_path_factory: pytest.TempPathFactory) -> np.ndarray:
    """The weights of an uninterrupted run of the shared unit in a fresh cache."""
    src, fp = unit_dir
    slot = copy_inputs(src, tmp_path_factory.mktemp("ref"))
    run_unit(slot, cache=ModelCache(), threads=THREADS)
    return weights_out(slot, fp)


# ---- outputs, metrics, progress ---------------------------------------------------------------


def test_outputs_metrics_and_progress(unit_dir: tuple[Path, Fingerprint], tmp_path: Path) -> None:
    src, fp = unit_dir
    slot = copy_inputs(src, tmp_path / "slot")
    fractions: list[float] = []
    res = run_unit(slot, cache=ModelCache(), threads=THREADS, progress=fractions.append)
    assert res.status == "done" and not res.interrupted
    assert res.weights_out == slot / "weights_out.h5" and res.metrics_out == slot / "metrics.json"

    wf = read_weights(slot / "weights_out.h5", expected=fp)
    assert np.isfinite(wf.flat).all()
    assert not np.array_equal(wf.flat, read_weights(slot / "weights_in.h5").flat)  # it trained
    assert (wf.job, wf.model, wf.unit, wf.base_version) == ("job", "0", unit_name("job", 1, 0), 3)
    assert wf.examples_seen == 240 * 2

    m = json.loads((slot / "metrics.json").read_text())
    assert METRIC_FIELDS <= m.keys()
    assert m == wf.metrics == res.metrics
    assert m["result"] == "" and m["resumed"] is False and m["redone_batches"] == 0
    assert m["examples_seen"] == 480 and m["batches"] == 2 * 15
    assert 0.0 <= m["train_acc"] <= 1.0 and 0.0 <= m["val_acc"] <= 1.0
    assert m["train_loss"] > 0 and m["val_loss"] > 0
    assert 0 < m["train_s"] <= m["wall_s"] and 0 <= m["load_s"] <= m["wall_s"]
    assert m["device"] == "CPU" and m["host"]

    assert fractions and fractions == sorted(fractions) and fractions[-1] == 1.0
    assert all(0.0 <= f <= 1.0 for f in fractions)
    assert float((slot / "fraction_done").read_text()) == 1.0
    # the checkpoint and position are cleaned up once the outputs are in place
    for name in (checkpoint.CKPT_H5, checkpoint.CKPT_JSON, PROGRESS_JSON):
        assert not (slot / name).exists()


def test_val_accuracy_is_that_of_the_trained_weights(unit_dir: tuple[Path, Fingerprint], tmp_path: Path) -> None:
    import keras

    src, fp = unit_dir
    slot = copy_inputs(src, tmp_path / "slot")
    res = run_unit(slot, threads=THREADS)
    model = keras.models.load_model(slot / "model.keras", compile=False)
    from boinc_dl.server.common.keras_model import set_flat

    set_flat(model, weights_out(slot, fp))
    with np.load(slot / "val.npz") as z:
        pred = model.predict(z["x"], verbose=0)
        acc = float(np.mean(pred.argmax(-1) == z["y"]))
    assert res.metrics["val_acc"] == pytest.approx(acc)


# ---- determinism -----------------------------------------------------------------------------


def test_same_unit_twice_is_bitwise_identical(unit_dir: tuple[Path, Fingerprint], reference: np.ndarray,
                                              tmp_path: Path) -> None:
    src, fp = unit_dir
    a = copy_inputs(src, tmp_path / "a")
    run_unit(a, cache=ModelCache(), threads=THREADS)
    assert np.array_equal(weights_out(a, fp), reference)


def test_cached_model_gives_the_same_bits(unit_dir: tuple[Path, Fingerprint], reference: np.ndarray,
                                          tmp_path: Path) -> None:
    """A long-lived process reuses the model and steps: the optimizer and RNG are reset per unit."""
    src, fp = unit_dir
    cache = ModelCache()
    other = copy_inputs(src, tmp_path / "other")
    wu = json.loads((other / "wu.json").read_text())
    wu["seed"], wu["hyper"] = 99, {"learning_rate": 0.05}
    (other / "wu.json").write_text(json.dumps(wu))
    r1 = run_unit(other, cache=cache, threads=THREADS)
    assert r1.metrics["model_cache_hit"] is False and r1.metrics["learning_rate"] == 0.05
    assert not np.array_equal(weights_out(other, fp), reference)

    again = copy_inputs(src, tmp_path / "again")
    r2 = run_unit(again, cache=cache, threads=THREADS)
    assert r2.metrics["model_cache_hit"] is True and len(cache) == 1
    assert np.array_equal(weights_out(again, fp), reference)


def test_hyper_overrides_training(unit_dir: tuple[Path, Fingerprint], tmp_path: Path) -> None:
    src, _ = unit_dir
    slot = copy_inputs(src, tmp_path / "slot")
    wu = json.loads((slot / "wu.json").read_text())
    wu["hyper"] = {"batch_size": 40, "optimizer": "sgd", "momentum": 0.9, "local_epochs": 1, "arch_width": 64,
                   "lr": 0.2}
    (slot / "wu.json").write_text(json.dumps(wu))
    m = run_unit(slot, threads=THREADS).metrics
    assert (m["batch_size"], m["optimizer"], m["local_epochs"], m["batches"]) == (40, "sgd", 1, 6)
    assert m["learning_rate"] == 0.2 and m["hyper"]["arch_width"] == 64
    assert m["examples_seen"] == 240


# ---- checkpoints and resume ------------------------------------------------------------------


def test_interrupt_then_resume_is_bitwise_identical(unit_dir: tuple[Path, Fingerprint], reference: np.ndarray,
                                                    tmp_path: Path) -> None:
    src, fp = unit_dir
    slot = copy_inputs(src, tmp_path / "slot")
    res = run_unit(slot, cache=ModelCache(), threads=THREADS, should_stop=stop_after(20))
    assert res.interrupted and res.checkpoint == slot / checkpoint.CKPT_H5
    k = res.metrics["done_batches"]  # should_stop is also polled before the first batch
    assert 15 < k < 30 and res.metrics["batches"] == 30
    assert not (slot / "weights_out.h5").exists()
    info = json.loads((slot / checkpoint.CKPT_JSON).read_text())
    assert (info["local_epoch"], info["batch"], info["done"]) == (1, k - 15, k)

    res = run_unit(slot, cache=ModelCache(), threads=THREADS)  # a new process would start so
    m = res.metrics
    assert m["resumed"] is True and m["resumed_at_batch"] == k and m["restarts"] == 1
    assert m["redone_batches"] == 0  # the stop checkpointed at the exact batch
    assert m["examples_seen"] == 480
    assert np.array_equal(weights_out(slot, fp), reference)


def test_periodic_checkpoints_count_redone_batches(unit_dir: tuple[Path, Fingerprint], reference: np.ndarray,
                                                   tmp_path: Path) -> None:
    """A crash after the last checkpoint: the batches since then are counted as redone."""
    src, fp = unit_dir
    slot = copy_inputs(src, tmp_path / "slot")
    k1 = run_unit(slot, threads=THREADS, should_stop=stop_after(22)).metrics["done_batches"]
    saved = (slot / checkpoint.CKPT_H5).read_bytes()
    k2 = run_unit(slot, threads=THREADS, should_stop=stop_after(8)).metrics["done_batches"]
    assert k2 > k1
    # simulate a crash that lost the second checkpoint but had reported its progress
    (slot / checkpoint.CKPT_H5).write_bytes(saved)
    assert json.loads((slot / PROGRESS_JSON).read_text())["done"] == k2
    m = run_unit(slot, threads=THREADS).metrics
    assert m["resumed"] is True and m["resumed_at_batch"] == k1
    # restarts are counted in the checkpoint: the restored one knew of none before this one
    assert m["redone_batches"] == k2 - k1 and m["restarts"] == 1
    assert np.array_equal(weights_out(slot, fp), reference)


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "empty"])
def test_corrupt_checkpoint_is_ignored(unit_dir: tuple[Path, Fingerprint], reference: np.ndarray, tmp_path: Path,
                                       caplog: pytest.LogCaptureFixture, damage: str) -> None:
    src, fp = unit_dir
    slot = copy_inputs(src, tmp_path / "slot")
    k = run_unit(slot, threads=THREADS, should_stop=stop_after(20)).metrics["done_batches"]
    ck = slot / checkpoint.CKPT_H5
    raw = bytearray(ck.read_bytes())
    if damage == "truncate":
        raw = raw[: len(raw) // 2]
    elif damage == "flip":  # in the last tensor's bytes (the file's tail): h5py still opens it
        for i in range(len(raw) - 200, len(raw) - 100):
            raw[i] ^= 0xFF
    elif damage == "garbage":
        raw = bytearray(b"not an hdf5 file at all" * 10)
    else:
        raw = bytearray()
    ck.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="boinc_dl.client_app"):
        m = run_unit(slot, threads=THREADS).metrics
    assert any("ignoring the checkpoint" in r.getMessage() for r in caplog.records)
    assert m["resumed"] is False and m["resumed_at_batch"] == 0
    assert m["redone_batches"] == k  # everything the first run did
    assert np.array_equal(weights_out(slot, fp), reference)


def test_checkpoint_of_another_unit_is_not_used(unit_dir: tuple[Path, Fingerprint], tmp_path: Path) -> None:
    src, _ = unit_dir
    slot = copy_inputs(src, tmp_path / "slot")
    run_unit(slot, threads=THREADS, should_stop=stop_after(20))
    wu = json.loads((slot / "wu.json").read_text())
    wu["seed"] = 8  # another unit now occupies the slot
    (slot / "wu.json").write_text(json.dumps(wu))
    m = run_unit(slot, threads=THREADS).metrics
    assert m["resumed"] is False and m["redone_batches"] == 0 and m["restarts"] == 0


def test_stop_before_training_writes_no_checkpoint(unit_dir: tuple[Path, Fingerprint], tmp_path: Path) -> None:
    src, _ = unit_dir
    slot = copy_inputs(src, tmp_path / "slot")
    res = run_unit(slot, threads=THREADS, should_stop=lambda: True)
    assert res.interrupted and res.checkpoint is None
    assert not (slot / checkpoint.CKPT_H5).exists() and not (slot / "weights_out.h5").exists()


def test_checkpoint_roundtrip_and_checksum(tmp_path: Path) -> None:
    groups = {"model": [np.arange(6, dtype=np.float32).reshape(2, 3), np.array([5, 0], np.int64)],
              "optimizer": [np.array(7, np.int64), np.ones(3, np.float32)]}
    pos = checkpoint.Position(local_epoch=1, batch=3, done=9, examples_seen=99, loss_sum=1.5, correct=4, count=8)
    checkpoint.save(tmp_path, "k", "u", groups, pos)
    got = checkpoint.load(tmp_path, "k")
    assert got is not None
    p, g = got
    assert p == pos
    for name in groups:
        for a, b in zip(groups[name], g[name], strict=True):
            assert a.dtype == b.dtype and np.array_equal(a, b)
    assert checkpoint.load(tmp_path, "other-key") is None
    assert checkpoint.load(tmp_path / "nothing-here", "k") is None
    assert not list(tmp_path.glob(".*.tmp"))


# ---- BOINC slot files ------------------------------------------------------------------------


def test_boinc_link_files_init_data_and_outputs(unit_dir: tuple[Path, Fingerprint], reference: np.ndarray,
                                                tmp_path: Path) -> None:
    """A BOINC-style slot: every logical name is a link file into the project directory."""
    src, fp = unit_dir
    boinc = tmp_path / "boinc"
    project = boinc / "projects" / "example.org_bdl"
    slot = boinc / "slots" / "3"
    project.mkdir(parents=True)
    slot.mkdir(parents=True)
    physical = {}
    for i, name in enumerate(INPUT_NAMES + OUTPUT_NAMES):
        physical[name] = f"job_e1_s0_{i}_{name.replace('.', '_')}"
        if name in INPUT_NAMES:
            shutil.copy2(src / name, project / physical[name])
        (slot / name).write_text(f"<soft_link>../../projects/example.org_bdl/{physical[name]}</soft_link>\n")
    (slot / "init_data.xml").write_text(
        "<app_init_data>\n<major_version>7</major_version>\n<result_name>job__m0_e0001_s0000_1</result_name>\n"
        "<wu_name>job__m0_e0001_s0000</wu_name>\n<project_dir>/var/lib/boinc/projects/example.org_bdl</project_dir>\n"
        "<gpu_type></gpu_type>\n<gpu_device_num>-1</gpu_device_num>\n<ncpus>1.000000</ncpus>\n"
        "<host_info><p_ncpus>16</p_ncpus></host_info>\n</app_init_data>\n"
    )
    res = run_unit(slot, threads=THREADS)
    assert res.metrics["result"] == "job__m0_e0001_s0000_1"
    assert res.weights_out == project / physical["weights_out.h5"]
    assert np.array_equal(read_weights(project / physical["weights_out.h5"], expected=fp).flat, reference)
    assert json.loads((project / physical["metrics.json"]).read_text())["unit"] == "job__m0_e0001_s0000"
    # the link files themselves are untouched
    for name in OUTPUT_NAMES:
        assert boinc_io.read_link(slot / name) == f"../../projects/example.org_bdl/{physical[name]}"
    assert float((slot / "fraction_done").read_text()) == 1.0
    assert not list(slot.glob(".model.*"))  # the suffixed alias used to load the model is gone


def test_resolve_and_read_link(tmp_path: Path) -> None:
    (tmp_path / "plain.txt").write_text("hello")
    (tmp_path / "abs").write_text(f"<soft_link>{tmp_path / 'x' / 'target'}</soft_link>")
    (tmp_path / "spaced").write_text("  <soft_link> ../p/t </soft_link>\n\n")
    (tmp_path / "almost").write_text("<soft_link></soft_link>")
    assert boinc_io.resolve(tmp_path, "plain.txt") == tmp_path / "plain.txt"
    assert boinc_io.resolve(tmp_path, "missing") == tmp_path / "missing"
    assert boinc_io.resolve(tmp_path, "abs") == tmp_path / "x" / "target"
    assert boinc_io.resolve(tmp_path, "spaced") == tmp_path.parent / "p" / "t"
    assert boinc_io.resolve(tmp_path, "almost") == tmp_path / "almost"
    big = tmp_path / "big"
    big.write_bytes(b"<soft_link>x</soft_link>" + b" " * 5000)  # too big to be a link file
    assert boinc_io.read_link(big) is None


def test_read_init_data(tmp_path: Path) -> None:
    assert boinc_io.read_init_data(tmp_path) is None
    (tmp_path / "init_data.xml").write_text(
        "<app_init_data><result_name>r_0</result_name><gpu_type>NVIDIA</gpu_type>"
        "<gpu_device_num>1</gpu_device_num><ncpus>0.500000</ncpus></app_init_data>"
    )
    d = boinc_io.read_init_data(tmp_path)
    assert d is not None and d.result_name == "r_0" and d.uses_gpu and d.gpu_device_num == 1 and d.ncpus == 0.5
    # not well-formed XML (an unescaped & elsewhere): the fields are still found
    (tmp_path / "init_data.xml").write_text(
        "<app_init_data><user_name>A & B</user_name><result_name>r_1</result_name><ncpus>2</ncpus>"
    )
    d = boinc_io.read_init_data(tmp_path)
    assert d is not None and d.result_name == "r_1" and d.ncpus == 2.0 and not d.uses_gpu


def test_device_and_thread_selection() -> None:
    cpu_task = boinc_io.InitData(result_name="r", gpu_type="", gpu_device_num=-1, ncpus=2.0)
    gpu_task = boinc_io.InitData(result_name="r", gpu_type="NVIDIA", gpu_device_num=2, ncpus=0.2)
    amd_task = boinc_io.InitData(result_name="r", gpu_type="ATI", gpu_device_num=1)
    env: dict[str, str] = {}
    select_device(None, None, env)
    assert env == {}  # outside BOINC, TensorFlow picks
    select_device(None, gpu_task, env)
    assert env["CUDA_VISIBLE_DEVICES"] == "2"
    env = {}
    select_device(0, gpu_task, env)  # the command line wins
    assert env["CUDA_VISIBLE_DEVICES"] == "0"
    env = {}
    select_device(None, amd_task, env)
    assert env == {"HIP_VISIBLE_DEVICES": "1", "TF_FORCE_GPU_ALLOW_GROWTH": "true"}
    env = {}
    select_device(None, cpu_task, env)  # a BOINC CPU task keeps off the GPUs
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    env = {}
    select_device(-1, None, env)
    assert env["CUDA_VISIBLE_DEVICES"] == ""

    assert choose_threads(3, cpu_task, {"BDL_THREADS": "5"}) == 3
    assert choose_threads(None, cpu_task, {"BDL_THREADS": "5"}) == 2
    assert choose_threads(None, gpu_task, {}) == 1
    assert choose_threads(None, None, {"BDL_THREADS": "5"}) == 5
    assert choose_threads(None, None, {"BDL_THREADS": "lots"}) is None
    assert choose_threads(None, None, {}) is None


def test_preemption_notice_sets_the_stop_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI's glue to the watcher: a notice sets the flag the training loop polls."""
    captured: dict[str, Any] = {}

    def start_watcher(on_notice):  # noqa: ANN001, ANN202
        captured["cb"] = on_notice
        return types.SimpleNamespace(stop=lambda: captured.setdefault("stopped", True))

    fake = types.ModuleType("boinc_dl.client_app.preemption")
    fake.start_watcher = start_watcher  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "boinc_dl.client_app.preemption", fake)
    flag = StopFlag()
    watcher = start_preemption_watcher(flag)
    assert watcher is not None and not flag.is_set()
    captured["cb"]("aws-spot: terminate at 2026-01-02T03:04:05Z")
    assert flag.is_set() and flag.reason.startswith("preemption notice")

    monkeypatch.setitem(sys.modules, "boinc_dl.client_app.preemption", None)  # module absent
    assert start_preemption_watcher(StopFlag()) is None


# ---- bad inputs ------------------------------------------------------------------------------


def _edit_wu(slot: Path, **changes: Any) -> None:
    wu = json.loads((slot / "wu.json").read_text())
    for k, v in changes.items():
        if "." in k:
            a, b = k.split(".")
            wu[a][b] = v
        else:
            wu[k] = v
    (slot / "wu.json").write_text(json.dumps(wu))


def _other_model_weights(slot: Path) -> None:
    import keras

    m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(5), keras.layers.Dense(3)])
    write_weights(slot / "weights_in.h5", WeightsFile(get_flat(m), model_fingerprint(m)))


BAD_INPUTS = {
    "wu-not-json": (lambda s: (s / "wu.json").write_text("{not json"), "wu.json: not a valid workunit"),
    "wu-missing-field": (lambda s: (s / "wu.json").write_text('{"format": "boinc-dl-workunit", "job": "j"}'),
                         "wu.json: not a valid workunit"),
    "wu-missing": (lambda s: (s / "wu.json").unlink(), "wu.json: not found"),
    "batch-size": (lambda s: _edit_wu(s, **{"training.batch_size": 0}), "training.batch_size: must be a positive"),
    "hyper-lr": (lambda s: _edit_wu(s, hyper={"learning_rate": "fast"}), "hyper.learning_rate: must be a finite"),
    "optimizer": (lambda s: _edit_wu(s, **{"training.optimizer": "lbfgs"}), "training.optimizer: must be one of"),
    "loss": (lambda s: _edit_wu(s, **{"training.loss": "no_such_loss"}), "training.loss: unknown Keras loss"),
    "seed": (lambda s: _edit_wu(s, seed=-1), "seed: must be a non-negative"),
    "data-missing": (lambda s: (s / "data.npz").unlink(), "missing input file data.npz"),
    "data-not-npz": (lambda s: (s / "data.npz").write_bytes(b"PK\x03\x04 broken"), "data.npz: not a readable .npz"),
    "data-no-y": (lambda s: np.savez(s / "data.npz", x=np.zeros((4, 8), np.float32)), "data.npz: missing array(s) y"),
    "data-shape": (lambda s: [np.savez(s / n, x=np.zeros((4, 9), np.float32), y=np.zeros(4, np.int64))
                              for n in ("data.npz", "val.npz")],
                   "data.npz: examples have shape (9,), the model expects (8,)"),
    "labels": (lambda s: np.savez(s / "data.npz", x=np.zeros((4, 8), np.float32), y=np.array([0, 1, 2, 3])),
               "data.npz: labels span [0, 3], the model has 3 output(s)"),
    "data-nan": (lambda s: np.savez(s / "data.npz", x=np.full((4, 8), np.nan, np.float32), y=np.zeros(4, np.int64)),
                 "data.npz: x contains NaN"),
    "val-features": (lambda s: np.savez(s / "val.npz", x=np.zeros((4, 7), np.float32), y=np.zeros(4, np.int64)),
                     "val.npz: examples have shape (7,), data.npz has (8,)"),
    "val-labels": (lambda s: np.savez(s / "val.npz", x=np.zeros((4, 8), np.float32), y=np.zeros(4, np.float32)),
                   "val.npz: labels are float32(), data.npz has int32()"),
    "weights-other-model": (_other_model_weights, "weights_in.h5: "),
    "weights-truncated": (lambda s: (s / "weights_in.h5").write_bytes((s / "weights_in.h5").read_bytes()[:300]),
                          "weights_in.h5: not a readable"),
    "model-garbage": (lambda s: (s / "model.keras").write_bytes(b"garbage"), "model.keras: cannot load"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_a_clear_permanent_error(unit_dir: tuple[Path, Fingerprint], tmp_path: Path, case: str) -> None:
    src, _ = unit_dir
    slot = copy_inputs(src, tmp_path / "slot")
    damage, message = BAD_INPUTS[case]
    damage(slot)
    with pytest.raises(UnitInputError) as ei:
        run_unit(slot, cache=ModelCache(), threads=THREADS)
    text = str(ei.value)
    assert message in text, text
    assert "\n" not in text and ei.value.exit_code == 1
    assert not (slot / "weights_out.h5").exists() and not (slot / "metrics.json").exists()


def test_cli_main_reports_mismatched_weights_on_one_line(unit_dir: tuple[Path, Fingerprint], tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """main() in-process (TensorFlow is already loaded here): exit 1 and one stderr line."""
    src, _ = unit_dir
    slot = copy_inputs(src, tmp_path / "slot")
    _other_model_weights(slot)
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        rc = main(["--slot", str(slot), "--threads", "1", "--quiet"])
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
    err = capsys.readouterr().err
    assert rc == 1
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines[-1].startswith("client_app: error: weights_in.h5: "), err
    assert "Traceback" not in err
    header = read_header(slot / "weights_in.h5")
    assert header.fingerprint.n_params > 0  # the input is left as it was
