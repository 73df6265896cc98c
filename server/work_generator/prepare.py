"""Job preparation: the files every workunit of a job shares, and its initial state.

Writes into ``job_dir/files/`` the model definition, the validation split and one
``.npz`` per data subset (VC-ASGD) or partition (MOP) — all deterministic for the
spec's seed, so they can be rebuilt identically — and records the job, the model
fingerprint and the initial weights (version 0) in Redis.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.common.datasets import Dataset, load_dataset, save_npz, split_shards
from boinc_dl.server.common.errors import BoincDLError, JobExists, job_exists_message
from boinc_dl.server.common.spec import JobSpec, spec_from_json, spec_to_json
from boinc_dl.server.common.spec_checks import check_model_fits, check_split
from boinc_dl.server.common.spec_defaults import Chosen, derive, fill_from, missing
from boinc_dl.server.common.workunit import DATA, MODEL, VAL, WEIGHTS_IN, WU_JSON

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobFiles:
    """Physical names of a job's shared input files (unique per job across a project)."""

    job_dir: Path
    job: str

    @property
    def dir(self) -> Path:
        return self.job_dir / "files"

    @property
    def model(self) -> Path:
        return self.dir / f"{self.job}__model.keras"

    @property
    def val(self) -> Path:
        return self.dir / f"{self.job}__val.npz"

    def shard(self, k: int) -> Path:
        return self.dir / f"{self.job}__shard{k:04d}.npz"

    def weights(self, model: str, version: int) -> Path:
        return self.dir / f"{self.job}__m{model}_v{version:07d}.h5"

    def wu_json(self, unit: str) -> Path:
        return self.dir / f"{unit}.json"

    def inputs(self, wu_name: str, model: Path, weights: Path, shard: int) -> dict[str, str]:
        """A unit's input files by logical name: its description, the model, the weights it
        starts from, its data subset or partition and the validation split."""
        return {WU_JSON: str(self.wu_json(wu_name)), MODEL: str(model), WEIGHTS_IN: str(weights),
                DATA: str(self.shard(shard)), VAL: str(self.val)}


def unit_training(spec: JobSpec) -> dict[str, Any]:
    """The training settings every unit of ``spec`` carries (identical on every host)."""
    t = spec.training
    return {"batch_size": t.batch_size, "optimizer": t.optimizer, "learning_rate": t.learning_rate,
            "momentum": t.momentum, "local_epochs": t.local_epochs, "loss": t.loss}


def n_shards(spec: JobSpec) -> int:
    """Subsets per epoch (VC-ASGD) or data partitions (MOP) of a derived spec
    (:func:`effective_spec`)."""
    if spec.mode == "mop":
        assert spec.mop is not None
        return spec.mop.partitions
    if spec.vcasgd.n_subsets is None:
        raise BoincDLError("vcasgd.n_subsets is not derived yet: prepare the job first")
    return spec.vcasgd.n_subsets


def effective_spec(spec: JobSpec, store: JobStore) -> JobSpec:
    """``spec`` with the defaults it leaves out as the job derived them (its stored spec)."""
    if not missing(spec):
        return spec
    spec = fill_from(spec, spec_from_json(store.spec_json()))
    if missing(spec):  # a job recorded without them (not through prepare_job): derive them now
        spec, _ = derive(spec, int(float(store.meta().get("n_train", 0) or 0)), None)
    return spec


def derived_settings(store: JobStore) -> list[Chosen]:
    """What :func:`prepare_job` derived for the job (for the start of a run)."""
    try:
        return [Chosen(**c) for c in json.loads(store.meta().get("derived", "[]"))]
    except (ValueError, TypeError):
        return []


def write_data_files(spec: JobSpec, files: JobFiles, data: Dataset | None = None) -> Dataset:
    """(Re)write the validation split and the shard files from the spec's dataset."""
    files.dir.mkdir(parents=True, exist_ok=True)
    # boinc-dl's own dataset loader (bandit takes it for Hugging Face's load_dataset)
    data = data or load_dataset(spec.dataset, spec.seed)  # nosec B615
    check_split(spec, len(data.x_train))
    shards = split_shards(len(data.x_train), n_shards(spec), spec.seed)
    save_npz(files.val, data.x_val, data.y_val)
    for k, idx in enumerate(shards):
        save_npz(files.shard(k), data.x_train[idx], data.y_train[idx])
    return data


def build_initial_model(spec: JobSpec, files: JobFiles, search_path: Path | None = None):  # noqa: ANN201
    """Build the model (seeded), save it as the job's model file and reload it from there.

    Reloading makes tensor names those every client will see when it loads the same
    file, so fingerprints match across processes.
    """
    from boinc_dl.server.common.keras_model import build_model, configure_tf

    tf = configure_tf()
    tf.keras.utils.set_random_seed(spec.seed)
    model = build_model(spec.model, spec.model_args, search_path)
    files.dir.mkdir(parents=True, exist_ok=True)
    tmp = files.model.with_name(f".tmp.{files.model.name}")
    model.save(tmp)
    tmp.replace(files.model)
    return tf.keras.models.load_model(files.model, compile=False)


def prepare_job(spec: JobSpec, store: JobStore, job_dir: Path, resume: bool = False,
                search_path: Path | None = None, slots: int | None = None,
                exists_message: str | None = None, owner: dict[str, Any] | None = None) -> JobFiles:
    """Create the job's shared files and Redis record; with ``resume``, reuse them.

    The defaults ``spec`` leaves out that depend on the data and the hosts
    (:mod:`~boinc_dl.server.common.spec_defaults`) are derived here, for the training
    examples and ``slots`` (the job system's slots; None: unknown), and stored with the
    job: read them back with :func:`effective_spec` and :func:`derived_settings`.

    A job that already exists in Redis is :class:`JobExists` unless ``resume`` (then
    missing files are rebuilt from the spec, deterministically); ``exists_message`` is
    the line to say so (default: ``boinc-dl run``'s three ways on). ``owner``: meta
    fields written in the same commit as the job's record (the process that runs it),
    so that no moment exists in which the job is "running" without an owner to check.
    """
    from boinc_dl.server.common.keras_model import get_flat, model_fingerprint

    files = JobFiles(Path(job_dir).resolve(), spec.name)
    if store.exists():
        if not resume:
            raise JobExists(exists_message or job_exists_message(spec.name, job_dir, store.meta().get("status", "")))
        stored = store.spec_json()
        spec = fill_from(spec, spec_from_json(stored)) if missing(spec) else spec
        if stored != spec_to_json(spec):
            log.warning("the spec differs from the one the job was started with")
        if not files.val.exists() or not all(files.shard(k).exists() for k in range(n_shards(spec))):
            write_data_files(spec, files)
        # (MOP keeps one model file per configuration, which its generator rebuilds.)
        if spec.mode != "mop" and not files.model.exists():
            raise BoincDLError(f"job {spec.name!r}: its model file {files.model} is missing")
        return files
    if resume:
        log.info("nothing to resume for job %s: starting it", spec.name)
    # boinc-dl's own dataset loader (bandit takes it for Hugging Face's load_dataset)
    data = load_dataset(spec.dataset, spec.seed)  # nosec B615
    spec, chosen = derive(spec, len(data.x_train), slots)
    for c in chosen:
        log.info("job %s: %s = %s (%s)", spec.name, c.field, c.value, c.why)
    data = write_data_files(spec, files, data)
    meta = {"n_train": int(len(data.x_train)), "n_val": int(len(data.x_val)), "n_shards": n_shards(spec),
            "job_dir": str(files.job_dir), "epoch": 1,
            "derived": json.dumps([c.__dict__ for c in chosen], default=str),
            # where the model builder module lives (MOP builds one model per configuration later)
            "search_path": str(search_path or ""), **(owner or {})}
    if spec.mode == "mop":
        # One model per configuration: the MOP generator builds them (a configuration that
        # cannot be built fails alone). A builder that cannot even be imported fails them
        # all: say so now, before any worker starts.
        if not spec.model.endswith((".keras", ".h5")):
            from boinc_dl.server.common.keras_model import resolve_builder

            resolve_builder(spec.model, search_path)
        store.create(spec_to_json(spec), spec.mode, {}, meta)
        return files
    model = build_initial_model(spec, files, search_path)
    fp = model_fingerprint(model)
    out_shape = tuple(model.outputs[0].shape[1:]) if model.outputs else ()
    in_shape = tuple(model.inputs[0].shape[1:]) if model.inputs else ()
    check_model_fits(in_shape, out_shape, tuple(data.x_train.shape[1:]), data.n_classes)
    store.create(spec_to_json(spec), spec.mode, {"0": fp}, {**meta, "n_params": fp.n_params})
    store.init_weights("0", get_flat(model))
    return files
