"""Property-based fuzzing of job specs: one clear SpecError or a valid spec, nothing else.

Specs are drawn from the real schema (every section and field of ``JobSpec``), with
hostile values (NaN, infinities, huge and negative numbers, wrong types, unknown
fields), both as Python mappings and as YAML text on disk. A spec that loads must
survive its JSON round trip (how the daemons read it back from Redis) and give sane
derived values; one that does not must fail with a one-line :class:`SpecError`.
"""

from __future__ import annotations

import math
import types
import typing
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from boinc_dl.server.common.errors import SpecError
from boinc_dl.server.common.spec import JobSpec, load_spec, parse_spec, spec_from_json, spec_to_json
from boinc_dl.server.common.spec_defaults import derive
from boinc_dl.server.work_generator.prepare import n_shards

FUZZ = settings(max_examples=1000, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

BASE = {
    "name": "fz",
    "model": "models:mlp",
    "dataset": {"name": "digits"},
    "training": {"epochs": 2},
    "vcasgd": {"n_subsets": 4, "alpha": 0.5},
}

# Unknown keys without control characters: the error echoes a key verbatim, and a key
# holding a newline would (legitimately) make the message span lines.
junk_keys = st.text(st.characters(exclude_categories=["Cc", "Cs"]), min_size=1, max_size=8)
scalars = st.one_of(
    st.integers(-2**63, 2**63), st.integers(-3, 40), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20), st.booleans(), st.none(),
    st.sampled_from(["e/(e+1)", "strict", "eventual", "fresh", "same", "skip", "fail", "adam", "sgd",
                     "digits", "mnist", "x.npz", "m.keras", "models:mlp", "local", "boinc", "vcasgd", "mop"]),
)
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                         st.dictionaries(junk_keys, inner, max_size=3)),
                      max_leaves=6)


def plausible(ann: object) -> st.SearchStrategy:
    """Values of the field's own type, often in range: they reach the deeper checks."""
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is typing.Literal:
        return st.sampled_from(args)
    if origin in (typing.Union, types.UnionType):
        return st.one_of([plausible(a) for a in args])
    if ann is type(None):
        return st.none()
    if ann is bool:
        return st.booleans()
    if ann is int:
        return st.integers(-2, 50)
    if ann is float:
        return st.floats(-1.0, 20.0)
    if ann is str:
        return st.sampled_from(["x", "models:mlp", "digits", "d.npz"]) | st.text(max_size=6)
    if origin is dict:
        return st.dictionaries(junk_keys, st.lists(scalars, min_size=0, max_size=2), max_size=2)
    return values


def _sections() -> dict[str, type[BaseModel] | None]:
    """Top-level field -> its sub-model (None for scalars), read from the schema itself."""
    out: dict[str, type[BaseModel] | None] = {}
    for name, f in JobSpec.model_fields.items():
        ann = f.annotation
        out[name] = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    return out


SECTIONS = _sections()


@st.composite
def section(draw, model: type[BaseModel]) -> dict:  # noqa: ANN001
    keys = list(model.model_fields)
    chosen = draw(st.lists(st.sampled_from(keys), max_size=len(keys), unique=True))
    d = {}
    for k in chosen:
        sub = model.model_fields[k].annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel) and draw(st.booleans()):
            d[k] = draw(section(sub))
        else:
            d[k] = draw(plausible(sub)) if draw(st.integers(0, 3)) else draw(values)
    if draw(st.integers(0, 9)) == 0:
        d[draw(junk_keys)] = draw(values)  # an unknown field
    return d


@st.composite
def specs(draw) -> object:  # noqa: ANN001
    kind = draw(st.sampled_from(["one-field", "one-field", "mutated", "mutated", "random", "not-a-mapping"]))
    if kind == "not-a-mapping":
        return draw(values)
    if kind == "one-field":  # the base spec with a single field changed, mostly plausibly
        data = {k: dict(v) if isinstance(v, dict) else v for k, v in BASE.items()}
        name = draw(st.sampled_from([n for n, m in SECTIONS.items() if m is not None]))
        model = SECTIONS[name]
        assert model is not None
        key = draw(st.sampled_from(list(model.model_fields)))
        ann = model.model_fields[key].annotation
        sub = data.setdefault(name, {})
        sub[key] = draw(plausible(ann)) if draw(st.integers(0, 4)) else draw(values)
        return data
    data: dict = dict(BASE) if kind == "mutated" else {}
    fields = draw(st.lists(st.sampled_from(list(SECTIONS)), max_size=4, unique=True))
    for name in fields:
        model = SECTIONS[name]
        if model is not None and draw(st.integers(0, 3)):
            base = data.get(name, {}) if isinstance(data.get(name), dict) else {}
            data[name] = {**base, **draw(section(model))}
        else:
            data[name] = draw(values)
    return data


def _check(spec_or_error: JobSpec | SpecError, source: str = "<fuzz>", one_line: bool = True) -> None:
    if isinstance(spec_or_error, SpecError):
        msg = str(spec_or_error)
        assert msg.startswith(source) and "Traceback" not in msg
        if one_line:  # YAML syntax errors quote the offending line with a caret below it
            assert "\n" not in msg
        return
    spec = spec_or_error
    again = spec_from_json(spec_to_json(spec))
    assert again == spec  # what daemons read back from Redis is the same spec
    # Subsets and local epochs left out (or null) are derived from the data and the slots.
    derived, _ = derive(spec, n_train=1000, slots=8)
    assert n_shards(derived) > 0 and derived.training.local_epochs and spec.training.epochs > 0
    for e in (1, 2, 50):
        a = spec.vcasgd.alpha_for(e)
        assert 0.0 <= a < 1.0 and math.isfinite(a)
    assert spec.units.timeout_s > 0 and spec.units.max_total_results >= spec.units.max_error_results


def _parse(data: object) -> JobSpec | SpecError:
    try:
        return parse_spec(data, "<fuzz>")
    except SpecError as e:
        return e


@FUZZ
@given(data=specs())
def test_fuzzed_spec_mappings_load_or_fail_with_one_clear_error(data: object) -> None:
    _check(_parse(data))


@FUZZ
@given(data=specs(), garble=st.sampled_from(["none", "none", "truncate", "tabs", "junk"]), cut=st.integers(0, 400))
def test_fuzzed_spec_files_load_or_fail_with_one_clear_error(tmp_path: Path, data: object, garble: str,
                                                             cut: int) -> None:
    try:
        text = yaml.safe_dump(data, allow_unicode=True)
    except yaml.YAMLError:
        text = str(data)
    if garble == "truncate":
        text = text[:cut]
    elif garble == "tabs":
        text = text.replace("  ", "\t")
    elif garble == "junk":
        text = text[:cut] + ": [}\n\x00" + text[cut:]
    f = tmp_path / "spec.yaml"
    f.write_text(text, errors="surrogatepass") if garble != "junk" else f.write_bytes(text.encode("utf-8", "replace"))
    try:
        spec: JobSpec | SpecError = load_spec(f)
    except SpecError as e:
        spec = e
    _check(spec, str(f), one_line=False)


def test_error_names_the_field() -> None:
    e = _parse({**BASE, "training": {"epochs": -1}})
    assert isinstance(e, SpecError) and "training.epochs" in str(e)
    e = _parse({**BASE, "units": {"max_error_results": 5, "max_total_results": 2}})
    assert isinstance(e, SpecError) and "units" in str(e)
    e = _parse({**BASE, "vcasgd": {"reissue": "sometimes"}})
    assert isinstance(e, SpecError) and "vcasgd.reissue" in str(e)
