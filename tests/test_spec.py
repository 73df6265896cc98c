"""Job spec validation: valid examples load; every error names its field."""

from __future__ import annotations

from pathlib import Path

import pytest

from boinc_dl.server.common.errors import SpecError
from boinc_dl.server.common.spec import load_spec, parse_spec

from .conftest import REPO


def test_example_spec_loads() -> None:
    spec = load_spec(REPO / "examples" / "digits-vcasgd.yaml")
    assert spec.mode == "vcasgd"
    assert spec.vcasgd.alpha_for(1) == pytest.approx(0.5)
    sched = spec.vcasgd.model_copy(update={"alpha": "e/(e+1)"})
    assert sched.alpha_for(1) == pytest.approx(0.5) and sched.alpha_for(9) == pytest.approx(0.9)
    assert spec.backend.local.workers == 4


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"training": {"batch_size": 0}}, "training.batch_size"),
        ({"training": {"optimizer": "lbfgs"}}, "training.optimizer"),
        ({"vcasgd": {"alpha": 1.5}}, "vcasgd.alpha"),
        ({"vcasgd": {"n_subsets": -1}}, "vcasgd.n_subsets"),
        ({"dataset": {"name": "cifar"}}, "dataset"),
        ({"dataset": {"train": "x.npz"}}, "dataset"),
        ({"model": "no_colon"}, "model"),
        ({"name": "bad name!"}, "name"),
        ({"units": {"max_error_results": 5, "max_total_results": 2}}, "units"),
        ({"bogus": 1}, "bogus: unknown field (the fields here: backend, dataset, "),
        ({"dataset": {"path": "x.npz"}}, "dataset.path: unknown field (did you mean train?)"),
        ({"trainning": {}}, "trainning: unknown field (did you mean training?)"),
        ({"training": {"lr": 0.1}}, "training.lr: unknown field (did you mean learning_rate?)"),
        ({"backend": {"local": {"wrkers": 2}}}, "backend.local.wrkers: unknown field (did you mean workers?)"),
        ({"backend": "boinc"}, "backend: must be a mapping: write backend: {kind: boinc}"),
        ({"backend": 3}, "backend: must be a mapping (key: value)"),
    ],
)
def test_errors_name_the_field(patch: dict, field: str) -> None:
    base = {"name": "j", "model": "m:f", "dataset": {"name": "digits"}}
    for k, v in patch.items():
        base[k] = {**base[k], **v} if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    with pytest.raises(SpecError) as e:
        parse_spec(base, "job.yaml")
    assert field in str(e.value)
    assert str(e.value).startswith("job.yaml: ")


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="not found"):
        load_spec(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(bad)
    lst = tmp_path / "list.yaml"
    lst.write_text("- a\n- b\n")
    with pytest.raises(SpecError, match="mapping"):
        load_spec(lst)


def test_relative_paths_resolve_against_spec_dir(tmp_path: Path) -> None:
    f = tmp_path / "job.yaml"
    f.write_text("name: j\nmodel: net.keras\ndataset: {train: data/train.npz}\n")
    spec = load_spec(f)
    assert spec.dataset.train == str(tmp_path / "data" / "train.npz")
    assert spec.model == str(tmp_path / "net.keras")
