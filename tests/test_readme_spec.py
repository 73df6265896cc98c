"""The README's job-spec section shows every field with its true default: a field added
to the spec, or a default changed, without the README following fails here."""

from __future__ import annotations

import re
import typing

import yaml
from pydantic import BaseModel

from boinc_dl.server.common.spec import JobSpec, MOPSpec, parse_spec

from .conftest import REPO


def _section(title: str) -> str:
    text = (REPO / "README.md").read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def _yaml_blocks(section: str) -> list[dict]:
    return [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", section, flags=re.S)]


def _fields(model: type[BaseModel], prefix: str = "") -> set[str]:
    out = set()
    for name, info in model.model_fields.items():
        out.add(prefix + name)
        for t in (info.annotation, *typing.get_args(info.annotation)):
            if isinstance(t, type) and issubclass(t, BaseModel) and t is not MOPSpec:
                out |= _fields(t, f"{prefix}{name}.")
    return out


def _keys(d: dict, prefix: str = "") -> set[str]:
    out = set()
    for k, v in d.items():
        out.add(prefix + k)
        if isinstance(v, dict) and k not in ("model_args", "param_grid", "search_options"):
            out |= _keys(v, f"{prefix}{k}.")
    return out


def test_every_field_and_its_default_are_in_the_readme() -> None:
    full, mop = _yaml_blocks(_section("The job spec"))
    assert _fields(JobSpec) <= _keys(full), _fields(JobSpec) - _keys(full)
    minimal = {"name": full["name"], "model": full["model"], "dataset": {"name": full["dataset"]["name"]}}
    assert parse_spec(full) == parse_spec(minimal)  # every value shown is the default

    assert set(MOPSpec.model_fields) <= set(mop["mop"]), set(MOPSpec.model_fields) - set(mop["mop"])
    shown = parse_spec({**minimal, "mode": "mop", "mop": mop["mop"]}).mop
    default = parse_spec({**minimal, "mode": "mop", "mop": {"param_grid": mop["mop"]["param_grid"]}}).mop
    assert shown == default


def test_train_your_own_model_spec_is_minimal_and_valid() -> None:
    (spec,) = _yaml_blocks(_section("Train your own model"))
    assert set(spec) == {"name", "mode", "model", "dataset", "training"} and set(spec["training"]) == {"epochs"}
    parse_spec(spec)
