"""Job spec: the YAML file a user writes, validated on load.

Errors name the offending field (``training.batch_size: must be > 0``) so that a
bad spec is one clear line, never a traceback.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from boinc_dl.server.common.errors import SpecError
from boinc_dl.server.common.space import parse_space

JOB_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
BUILTIN_DATASETS = ("digits", "mnist")


#: The shortest deadline a unit can meet: starting, loading the weights and data, one
#: step and the result's write take longer than this even for a tiny model.
MIN_TIMEOUT_S = 0.5

#: Seeds go to numpy (``default_rng``, ``RandomState``) and TensorFlow: 32 bits.
MAX_SEED = 2**32 - 1


class _Strict(BaseModel):
    # No NaN or infinity anywhere: a non-finite setting would only fail on the hosts.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class DatasetSpec(_Strict):
    """Where the data comes from: a built-in name, or ``.npz`` / ``.h5`` files."""

    name: str | None = Field(None, description="built-in dataset: digits or mnist")
    train: str | None = Field(None, description=".npz/.h5 file with arrays x and y")
    val: str | None = Field(None, description="optional validation file; else val_fraction of train")
    val_fraction: float = Field(0.2, gt=0.0, lt=1.0)
    limit: int | None = Field(None, gt=0, le=2**40, description="use only the first N training examples")

    @model_validator(mode="after")
    def _one_source(self) -> DatasetSpec:
        if (self.name is None) == (self.train is None):
            raise ValueError("give exactly one of 'name' (built-in) or 'train' (a file)")
        if self.name is not None and self.name not in BUILTIN_DATASETS:
            raise ValueError(f"unknown built-in dataset {self.name!r}; choose one of {BUILTIN_DATASETS}")
        for f in (self.train, self.val):
            if f is not None and not f.isprintable():
                raise ValueError("a dataset file name must not hold control characters")
            if f is not None and not f.endswith((".npz", ".h5", ".hdf5")):
                raise ValueError(f"dataset file {f!r} must be .npz or .h5")
        return self


class TrainingSpec(_Strict):
    """Per-unit training settings, identical on every client."""

    epochs: int = Field(10, gt=0, le=1_000_000, description="server epochs (passes over the data)")
    batch_size: int = Field(32, gt=0, le=2**31 - 1)
    optimizer: Literal["adam", "sgd", "rmsprop", "adagrad"] = "adam"
    learning_rate: float = Field(0.001, gt=0.0)
    momentum: float = Field(0.0, ge=0.0, lt=1.0)
    local_epochs: int | None = Field(
        None, gt=0, le=100_000,
        description="passes over its subset inside one unit; default: derived from the units in flight "
        "(VC-ASGD, see spec_defaults.py), 1 for MOP")
    loss: str = "sparse_categorical_crossentropy"
    target_accuracy: float | None = Field(None, gt=0.0, le=1.0, description="stop early when reached")


AlphaSchedule = Literal["e/(e+1)"]


class VCASGDSpec(_Strict):
    """VC-ASGD: one model, each result merged into the server weights as it arrives."""

    n_subsets: int | None = Field(
        None, gt=0, le=1_000_000,
        description="subsets (units) per epoch; default: derived from the training examples and the slots")
    merge_rule: Literal["delta", "search", "fedasync", "paper"] | None = Field(
        None, description="delta: W_s += server_lr * (W_c - W_base) / (1+s)^p; search: delta's step, 0 or "
        "4, 16, 64 times it (at most 1), whichever lowers the loss of a sample of the training data the most "
        "at the server's weights; fedasync: W_s += (1-a) * (W_c - W_s) / (1+s)^p; paper: "
        "W_s <- a*W_s + (1-a)*W_c (s: the result's staleness); default: derived (search with 32 or more "
        "units in flight, else delta)")
    staleness_power: float = Field(1.0, ge=0.0, le=8.0, description="p of the staleness weight (1+s)^-p")
    server_lr: float = Field(1.0, gt=0.0, le=10.0, description="delta: the weight of a fresh result's update")
    cap_by_in_flight: bool = Field(
        True, description="delta: a result's staleness weight at most 2/k, k the units in flight when it was "
        "issued, so that a round of units from one base adds at most ~2 of their updates, not ~ln(k) "
        "(false: the uncapped rule)")
    search_batch: int = Field(
        1024, gt=0, le=65_536, description="search: training examples the server evaluates each candidate step "
        "on (drawn for each result from a seeded pool of 16 such samples of the training data, at most 256 MB; "
        "all of it when smaller)")
    search_wait_s: float = Field(
        10.0, gt=0.0, le=3600.0, description="search: the assimilator's wait for the server's step search; "
        "then the result merges with delta's weight (a slow or stopped checker never holds merges back)")
    alpha: float | AlphaSchedule = Field("e/(e+1)", description="paper, fedasync: constant in [0,1) or 'e/(e+1)'")
    merge: Literal["strict", "eventual"] = "strict"
    window: int | None = Field(None, gt=0, le=1_000_000, description="units in flight; default: total slots "
                               "(the subsets per epoch when n_subsets is derived below them)")
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

    partitions: int = Field(4, gt=0, le=100_000, description="data partitions (Cerebro: one per host)")
    param_grid: dict[str, Any] = Field(
        ..., description="name -> list of choices, or {uniform|loguniform|randint: [a, b]} (random, pbt)"
    )
    search: Literal["grid", "random", "sha", "hyperband", "pbt"] = "grid"
    budget: int | None = Field(None, gt=0, le=100_000, description="configurations (random, sha) or population (pbt)")
    search_options: dict[str, Any] = Field(default_factory=dict)
    replication: int = Field(1, gt=0, le=10_000, description="hosts holding each partition (local backend)")

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

    timeout_s: float = Field(
        300.0, ge=MIN_TIMEOUT_S, le=365 * 86400.0,
        description="deadline t_o: re-issue a unit not back after this many seconds")
    max_error_results: int = Field(4, ge=1, le=1000)
    max_total_results: int = Field(8, ge=1, le=1000)
    max_upload_bytes: int | None = Field(
        None, gt=0, le=2**40,
        description="bytes one result file may hold (BOINC's max_nbytes, the server's read and copy bound); "
        "default: derived from the model's size (docs/security.md)")
    checkpoint_every_s: float = Field(10.0, gt=0, le=86400.0)

    @model_validator(mode="after")
    def _limits(self) -> UnitSpec:
        if self.max_total_results < self.max_error_results:
            raise ValueError("max_total_results must be >= max_error_results")
        return self


class ValidationSpec(_Strict):
    """Result checks beyond the fingerprint and finiteness."""

    max_update_norm: float | None = Field(
        None, gt=0, description="reject a result whose update ||W_c - W_base|| exceeds this"
    )
    clip_factor: float | None = Field(
        2.0, gt=0, description="clip an update to this times the median norm of trusted updates (frozen "
        "per epoch); null disables"
    )
    clip_min_trusted: int = Field(
        8, ge=1, le=100_000, description="trusted results needed before the clip radius applies"
    )
    loss_check: bool = Field(
        True, description="VC-ASGD on BOINC: refuse an untrusted result whose update raises the loss of a "
        "held-out batch above the upper tail of trusted results' (the work generator checks it)"
    )
    loss_check_batch: int = Field(
        256, ge=1, le=100_000, description="held-out examples (a seeded sample of the validation split) the "
        "loss check evaluates"
    )
    loss_check_k: float = Field(
        6.0, gt=0, le=1000, description="loss check bound: median + k scaled MADs of trusted loss increases"
    )
    loss_check_min_trusted: int = Field(
        16, ge=1, le=100_000, description="trusted results needed before the loss check refuses anything"
    )
    loss_check_spot_every: int = Field(
        20, ge=0, le=100_000, description="BOINC, project min_quorum 1: the work generator replicates a unit on "
        "a second host (a spot check) while fewer than loss_check_min_trusted trusted results exist, and once "
        "this many results have been judged against trusted results from worse models since the last; "
        "0 never"
    )
    loss_ledger: bool = Field(
        True, description="with the loss check: keep each host's running sum (CUSUM) of its untrusted results' "
        "loss changes, scored against the latest trusted ones, and refuse its results once the sum passes "
        "loss_ledger_limit"
    )
    loss_ledger_slack: float = Field(
        0.5, ge=0, le=100, description="loss ledger: how far above trusted results' median loss change (in units "
        "of their spread) a result may score without adding to its host's balance"
    )
    loss_ledger_limit: float = Field(
        6.0, gt=0, le=1000, description="loss ledger: the balance past which a host's results are refused"
    )
    reissue_refused: int = Field(
        2, ge=0, le=100, description="VC-ASGD on BOINC with vcasgd.reissue fresh: a unit whose result is refused "
        "for what its host computed (the loss check, a host's ledger, max_update_norm, the file's content) is "
        "issued again from the freshest weights, to a host BOINC picks afresh, at most this many times (within "
        "units.max_total_results); 0 gives it up at once, its subset skipped for the epoch"
    )
    loss_check_wait_s: float = Field(
        30.0, gt=0, le=3600, description="how long the assimilator waits for a verdict before it retries "
        "the result later"
    )


class LocalBackendSpec(_Strict):
    """The embedded job system: N hosts x T slots, P assimilators."""

    workers: int = Field(4, gt=0, le=4096)
    slots: int = Field(2, gt=0, le=1024)
    assimilators: int = Field(2, gt=0, le=256)
    threads_per_slot: int = Field(1, gt=0, le=1024)
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
    seed: int = Field(0, ge=0, le=MAX_SEED, description="numpy's seed range: 0 to 2**32-1")

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
        if not v.isprintable():
            raise ValueError("must not hold control characters")
        if v.endswith((".keras", ".h5")):
            return v
        mod, sep, fn = v.partition(":")
        if not sep or not fn.isidentifier() or not all(part.isidentifier() for part in mod.split(".")):
            raise ValueError("must be 'package.module:function' or a .keras/.h5 model file")
        return v


# pydantic's error types in the user's words ({...} filled from the error's context).
_PLAIN = {
    "missing": "required",
    "extra_forbidden": "unknown field",
    "finite_number": "must be a finite number (not NaN or infinity)",
    "greater_than": "must be greater than {gt}",
    "greater_than_equal": "must be at least {ge}",
    "less_than": "must be less than {lt}",
    "less_than_equal": "must be at most {le}",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "int_type": "must be a whole number",
    "int_parsing": "must be a whole number",
    "int_from_float": "must be a whole number",
    "int_parsing_size": "is far too large a number",
    "string_type": "must be text",
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "dict_type": "must be a mapping (key: value)",
    "model_type": "must be a mapping (key: value)",
    "model_attributes_type": "must be a mapping (key: value)",
    "list_type": "must be a list",
    "none_required": "must be empty (null)",
}


def _plain(e: Any) -> str:
    kind = e["type"]
    ctx = e.get("ctx") or {}
    if kind == "literal_error":
        expected = str(ctx.get("expected", ""))
        if "," in expected or " or " in expected:
            return f"must be one of {expected.replace(' or ', ', ')}"
        return f"must be {expected}"
    if kind in _PLAIN:
        try:
            return _PLAIN[kind].format(**ctx)
        except (KeyError, IndexError, ValueError):
            return _PLAIN[kind]
    return str(e["msg"]).removeprefix("Value error, ").removeprefix("Assertion failed, ")


def _field_path(loc: tuple[Any, ...]) -> str:
    """The field's dotted name; union member tags (``float``, ``literal['e/(e+1)']``,
    ``function-after[...]``) are pydantic's internals, not fields: dropped."""
    parts = []
    for p in loc:
        text = str(p)
        if isinstance(p, str) and ("[" in text or text in ("float", "int", "str", "bool", "none", "dict",
                                                            "list", "constrained-str", "constrained-int",
                                                            "constrained-float")):
            continue
        parts.append(text if text.isprintable() else repr(text))
    return ".".join(parts) or "(top level)"


#: Fields users write for one the spec names otherwise (``dataset: {path: ...}``).
_SYNONYMS = {"path": "train", "file": "train", "data": "train", "train_file": "train", "lr": "learning_rate",
             "epoch": "epochs", "batch": "batch_size", "subsets": "n_subsets"}


def _section(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The spec section (a model class) holding the field at ``loc``, if ``loc`` is one."""
    cls: type[BaseModel] = JobSpec
    for part in loc[:-1]:
        field = cls.model_fields.get(str(part))
        if field is None:
            return None
        options = [field.annotation, *get_args(field.annotation)]
        nxt = next((a for a in options if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if nxt is None:
            return None
        cls = nxt
    return cls


def _unknown_field(loc: tuple[Any, ...]) -> str:
    """'unknown field', with the field meant when it is a likely slip, else the known ones."""
    cls = _section(loc)
    if cls is None or not loc:
        return "unknown field"
    known = sorted(cls.model_fields)
    name = str(loc[-1])
    meant = _SYNONYMS.get(name.lower())
    guess = meant if meant in known else next(iter(difflib.get_close_matches(name, known, n=1, cutoff=0.6)), None)
    if guess is not None:
        return f"unknown field (did you mean {guess}?)"
    return f"unknown field (the fields here: {', '.join(known)})"


def _format_error(err: ValidationError) -> str:
    """All errors on one line, one entry per field; a union's alternatives joined by 'or'."""
    by_field: dict[str, list[str]] = {}
    for e in err.errors():
        msgs = by_field.setdefault(_field_path(e["loc"]), [])
        m = _unknown_field(e["loc"]) if e["type"] == "extra_forbidden" else _plain(e)
        if e["loc"] == ("backend",) and e.get("input") in ("local", "boinc"):
            m = f"must be a mapping: write backend: {{kind: {e['input']}}}"  # the one a user guesses
        if m not in msgs:
            msgs.append(m)
    out = []
    for loc, msgs in by_field.items():
        if len(msgs) > 1 and all(m.startswith("must be ") for m in msgs):
            msg = "must be " + " or ".join(m.removeprefix("must be ") for m in msgs)
        else:
            msg = "; ".join(msgs)
        out.append(f"{loc}: {msg}")
    return one_line("; ".join(out))


def one_line(text: str, limit: int = 600) -> str:
    """``text`` with control characters and line breaks made visible, cut at ``limit``."""
    flat = "".join(c if c.isprintable() else " " if c in "\n\r\t" else repr(c)[1:-1] for c in text)
    flat = " ".join(flat.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def parse_spec(data: Any, source: str = "<spec>", base_dir: Path | None = None) -> JobSpec:
    """Validate a decoded spec mapping; relative file paths resolve against ``base_dir``."""
    if data is None:
        raise SpecError(f"{source}: the job spec is empty")
    if not isinstance(data, dict):
        kind = {list: "a list", str: "text", int: "a number", float: "a number", bool: "true/false"}.get(
            type(data), type(data).__name__)
        raise SpecError(f"{source}: the job spec must be a YAML mapping (key: value lines), got {kind}")
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


#: A job spec is a few hundred bytes; anything past this is not one.
MAX_SPEC_BYTES = 1024 * 1024
#: Values a spec may expand to once YAML aliases are followed, and its nesting depth.
MAX_SPEC_NODES = 100_000
MAX_SPEC_DEPTH = 64


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (YAML silently keeps
    the last one, so a typo'd override would be ignored without a word)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            try:
                dup = key in seen
            except TypeError:
                raise yaml.constructor.ConstructorError(
                    None, None, "a mapping key must be text or a number", key_node.start_mark) from None
            if dup:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicated key {key!r} (first at line {seen[key] + 1})", key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def _yaml_error(e: yaml.YAMLError) -> str:
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    problem = getattr(e, "problem", None) or str(e)
    context = getattr(e, "context", None)
    if context:
        problem = f"{context}, {problem}"
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    return one_line(f"{problem}{where}")


def _check_size(data: Any) -> None:
    """Refuse a document that expands past MAX_SPEC_NODES values or MAX_SPEC_DEPTH levels:
    YAML aliases can make a few hundred bytes stand for billions of values."""
    count = 0
    stack: list[tuple[Any, int]] = [(data, 0)]
    while stack:
        node, depth = stack.pop()
        count += 1
        if count > MAX_SPEC_NODES:
            raise ValueError(f"expands to more than {MAX_SPEC_NODES:,} values (YAML aliases?)")
        if depth > MAX_SPEC_DEPTH:
            raise ValueError(f"nested more than {MAX_SPEC_DEPTH} levels deep")
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for kv in node.items() for v in kv)
        elif isinstance(node, list | tuple | set):
            stack.extend((v, depth + 1) for v in node)


def read_spec_text(p: Path) -> str:
    """The spec file's text: bounded, not binary, valid UTF-8; else one clear SpecError."""
    try:
        with p.open("rb") as f:
            raw = f.read(MAX_SPEC_BYTES + 1)
    except OSError as e:
        raise SpecError(f"{p}: cannot read the job spec ({e.strerror or e})") from None
    if len(raw) > MAX_SPEC_BYTES:
        raise SpecError(f"{p}: not a job spec (larger than {MAX_SPEC_BYTES // 1024} KiB)")
    if b"\0" in raw:
        raise SpecError(f"{p}: a binary file, not a YAML job spec")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(f"{p}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})") from None


def load_spec(path: str | Path) -> JobSpec:
    """Read and validate a YAML job spec file, with one clear error on any problem."""
    p = Path(path)
    if not p.exists():
        raise SpecError(f"{p}: job spec file not found")
    if not p.is_file():
        raise SpecError(f"{p}: not a regular file")
    text = read_spec_text(p)
    try:
        # _UniqueKeyLoader is a SafeLoader subclass (it only refuses duplicate keys).
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506  # nosec B506
        _check_size(data)
    except yaml.YAMLError as e:
        raise SpecError(f"{p}: not valid YAML: {_yaml_error(e)}") from None
    except ValueError as e:
        raise SpecError(f"{p}: {e}") from None
    except RecursionError:
        raise SpecError(f"{p}: nested too deeply to be a job spec") from None
    return parse_spec(data, str(p), p.parent.resolve())


def local_options(spec: JobSpec, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The local backend's options: ``spec.backend.local`` with ``overrides`` (``--workers`` ...) on top."""
    return {**spec.backend.local.model_dump(), **(overrides or {})}


def spec_to_json(spec: JobSpec) -> str:
    """Canonical JSON of a spec, as stored in Redis."""
    return spec.model_dump_json()


def spec_from_json(text: str) -> JobSpec:
    """Inverse of :func:`spec_to_json`."""
    return JobSpec.model_validate_json(text)
