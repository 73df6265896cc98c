"""Job spec: the YAML file a user writes, validated on load.

Errors name the offending field (``training.batch_size: must be > 0``) so that a
bad spec is one clear line, never a traceback.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from server.common.errors import SpecError
from server.common.space import parse_space

JOB_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
BUILTIN_DATASETS = ("digits", "mnist")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DatasetSpec(_Strict):
    """Where the data comes from: a built-in name, or ``.npz`` / ``.h5`` files."""

    name: str | None = Field(None, description="built-in dataset: digits or mnist")
    train: str | None = Field(None, description=".npz/.h5 file with arrays x and y")
    val: str | None = Field(None, description="optional validation file; else val_fraction of train")
    val_fraction: float = Field(0.2, gt=0.0, lt=1.0)
    limit: int | None = Field(None, gt=0, description="use only the first N training examples")

    @model_validator(mode="after")
    def _one_source(self) -> DatasetSpec:
        if (self.name is None) == (self.train is None):
            raise ValueError("give exactly one of 'name' (built-in) or 'train' (a file)")
        if self.name is not None and self.name not in BUILTIN_DATASETS:
            raise ValueError(f"unknown built-in dataset {self.name!r}; choose one of {BUILTIN_DATASETS}")
        for f in (self.train, self.val):
            if f is not None and not f.endswith((".npz", ".h5", ".hdf5")):
                raise ValueError(f"dataset file {f!r} must be .npz or .h5")
        return self


class TrainingSpec(_Strict):
    """Per-unit training settings, identical on every client."""

    epochs: int = Field(10, gt=0, description="server epochs (passes over the data)")
    batch_size: int = Field(32, gt=0)
    optimizer: Literal["adam", "sgd", "rmsprop", "adagrad"] = "adam"
    learning_rate: float = Field(0.001, gt=0.0)
    momentum: float = Field(0.0, ge=0.0, lt=1.0)
    local_epochs: int = Field(1, gt=0, description="passes over its subset inside one unit")
    loss: str = "sparse_categorical_crossentropy"
    target_accuracy: float | None = Field(None, gt=0.0, le=1.0, description="stop early when reached")


AlphaSchedule = Literal["e/(e+1)"]


class VCASGDSpec(_Strict):
    """VC-ASGD: one model, merged as W_s <- a_e*W_s + (1-a_e)*W_c."""

    n_subsets: int = Field(16, gt=0)
    alpha: float | AlphaSchedule = Field("e/(e+1)", description="constant in [0,1) or 'e/(e+1)'")
    merge: Literal["strict", "eventual"] = "strict"
    window: int | None = Field(None, gt=0, description="units in flight; default: total slots")
    give_up_policy: Literal["skip", "fail"] = Field(
        "skip", description="a subset whose unit failed for good: skip it or fail the job"
    )
    reissue: Literal["same", "fresh"] = Field(
        "fresh", description="a unit past its deadline: regenerate it from the freshest weights, or re-issue "
        "the same inputs (BOINC's own behaviour)"
    )

    @field_validator("alpha")
    @classmethod
    def _alpha_range(cls, v: float | str) -> float | str:
        if isinstance(v, float) and not 0.0 <= v < 1.0:
            raise ValueError("a constant alpha must be in [0, 1)")
        return v

    def alpha_for(self, epoch: int) -> float:
        """The merge weight a_e of the server copy for (1-based) epoch ``epoch``."""
        if isinstance(self.alpha, str):
            return epoch / (epoch + 1.0)
        return float(self.alpha)


class MOPSpec(_Strict):
    """MOP model selection: configurations hop across p data partitions."""

    partitions: int = Field(4, gt=0)
    param_grid: dict[str, Any] = Field(
        ..., description="name -> list of choices, or {uniform|loguniform|randint: [a, b]} (random, pbt)"
    )
    search: Literal["grid", "random", "sha", "hyperband", "pbt"] = "grid"
    budget: int | None = Field(None, gt=0, description="configurations (random, sha) or population (pbt)")
    search_options: dict[str, Any] = Field(default_factory=dict)
    replication: int = Field(1, gt=0, description="hosts holding each partition (local backend)")

    @model_validator(mode="after")
    def _space(self) -> MOPSpec:
        if not self.param_grid:
            raise ValueError("param_grid: the search space is empty")
        try:
            parse_space(self.param_grid, allow_distributions=self.search in ("random", "pbt", "sha", "hyperband"))
        except Exception as e:  # noqa: BLE001 - SpecError from the space grammar, re-raised as a field error
            raise ValueError(f"param_grid: {e}") from None
        return self


class UnitSpec(_Strict):
    """Deadlines and retry limits, passed to the job system (BOINC create_work flags)."""

    timeout_s: float = Field(300.0, gt=0, description="deadline t_o: re-issue after this")
    max_error_results: int = Field(4, ge=1)
    max_total_results: int = Field(8, ge=1)
    max_upload_bytes: int = Field(512 * 1024 * 1024, gt=0)
    checkpoint_every_s: float = Field(10.0, gt=0)

    @model_validator(mode="after")
    def _limits(self) -> UnitSpec:
        if self.max_total_results < self.max_error_results:
            raise ValueError("max_total_results must be >= max_error_results")
        return self


class ValidationSpec(_Strict):
    """Result checks beyond the fingerprint and finiteness."""

    max_update_norm: float | None = Field(
        None, gt=0, description="reject a result whose L2 distance from the server copy exceeds this"
    )


class LocalBackendSpec(_Strict):
    """The embedded job system: N hosts x T slots, P assimilators."""

    workers: int = Field(4, gt=0)
    slots: int = Field(2, gt=0)
    assimilators: int = Field(2, gt=0)
    threads_per_slot: int = Field(1, gt=0)
    preempt_prob: float = Field(0.0, ge=0.0, lt=1.0, description="chance a unit is killed mid-way")


class BackendSpec(_Strict):
    kind: Literal["local", "boinc"] = "local"
    local: LocalBackendSpec = Field(default_factory=LocalBackendSpec)


class JobSpec(_Strict):
    """A whole job: model, data, training settings, mode and backend."""

    name: str
    mode: Literal["vcasgd", "mop"] = "vcasgd"
    model: str = Field(..., description="'module:function' returning a Keras model, or a .keras/.h5 file")
    model_args: dict[str, Any] = Field(default_factory=dict)
    dataset: DatasetSpec
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    vcasgd: VCASGDSpec = Field(default_factory=VCASGDSpec)
    mop: MOPSpec | None = None
    units: UnitSpec = Field(default_factory=UnitSpec)
    validation: ValidationSpec = Field(default_factory=ValidationSpec)
    backend: BackendSpec = Field(default_factory=BackendSpec)
    seed: int = 0

    @model_validator(mode="after")
    def _mode_section(self) -> JobSpec:
        if self.mode == "mop" and self.mop is None:
            raise ValueError("mode 'mop' needs a 'mop' section with a param_grid")
        return self

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not JOB_NAME_RE.match(v):
            raise ValueError("must be 1-64 characters of letters, digits, '_', '.', '-'")
        return v

    @field_validator("model")
    @classmethod
    def _model(cls, v: str) -> str:
        if v.endswith((".keras", ".h5")):
            return v
        mod, sep, fn = v.partition(":")
        if not sep or not mod or not fn or not fn.isidentifier():
            raise ValueError("must be 'package.module:function' or a .keras/.h5 model file")
        return v


def _format_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field"
        lines.append(f"{loc}: {msg}")
    return "; ".join(lines)


def parse_spec(data: Any, source: str = "<spec>", base_dir: Path | None = None) -> JobSpec:
    """Validate a decoded spec mapping; relative file paths resolve against ``base_dir``."""
    if not isinstance(data, dict):
        raise SpecError(f"{source}: the job spec must be a YAML mapping, got {type(data).__name__}")
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as e:
        raise SpecError(f"{source}: {_format_error(e)}") from None
    if base_dir is not None:
        spec = resolve_paths(spec, base_dir)
    return spec


def resolve_paths(spec: JobSpec, base_dir: Path) -> JobSpec:
    """Make dataset and model file paths absolute, relative to the spec's folder."""
    def _abs(p: str | None) -> str | None:
        if p is None:
            return None
        path = Path(p).expanduser()
        return str(path if path.is_absolute() else (base_dir / path).resolve())

    ds = spec.dataset.model_copy(update={"train": _abs(spec.dataset.train), "val": _abs(spec.dataset.val)})
    model = _abs(spec.model) if spec.model.endswith((".keras", ".h5")) else spec.model
    return spec.model_copy(update={"dataset": ds, "model": model})


def load_spec(path: str | Path) -> JobSpec:
    """Read and validate a YAML job spec file, with one clear error on any problem."""
    p = Path(path)
    if not p.is_file():
        raise SpecError(f"{p}: job spec file not found")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise SpecError(f"{p}: not valid YAML: {e}") from None
    return parse_spec(data, str(p), p.parent.resolve())


def spec_to_json(spec: JobSpec) -> str:
    """Canonical JSON of a spec, as stored in Redis."""
    return spec.model_dump_json()


def spec_from_json(text: str) -> JobSpec:
    """Inverse of :func:`spec_to_json`."""
    return JobSpec.model_validate_json(text)
