"""Hostile and careless job specs against the real command line.

A corpus of spec files (binary, invalid UTF-8, duplicated keys, YAML alias bombs and
deep nesting, huge numbers, NaN and infinities, negative and zero values, path
traversal in the dataset or model file, unknown fields, YAML tags) and of datasets and
settings a run would trip over late (NaN features, negative labels, labels beyond the
model's outputs, more subsets than examples, a backend far beyond this machine). Each
must give exactly one ``error:`` line on a 40-column terminal, in the user's words
(no validator internals), no traceback, and a non-zero exit.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from boinc_dl.server.cli import app

from .conftest import REPO

EXE = [sys.executable, "-m", "boinc_dl.server.cli"]
ENV = {**os.environ, "COLUMNS": "40", "PYTHONPATH": str(REPO)}
BASE = "name: j\nmodel: models:mlp\nmodel_args: {input_dim: 64, hidden: 8, n_classes: 10}\n"
DIGITS = BASE + "dataset: {name: digits}\n"


def _bomb() -> bytes:
    levels = ["  l0: &l0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 9):
        levels.append(f"  l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]")
    return ("name: j\nmodel: models:mlp\ndataset: {name: digits}\nmodel_args:\n" + "\n".join(levels) + "\n").encode()


#: name -> (spec file bytes, what the one error line must say)
CORPUS: dict[str, tuple[bytes, str]] = {
    "elf_binary": (b"\x7fELF\x02\x01\x01\x00" + bytes(200), "binary file"),
    "utf16": ("name: j\nmodel: models:mlp\n".encode("utf-16"), "binary file"),
    "invalid_utf8": (b"name: j\xff\xfe\nmodel: models:mlp\ndataset: {name: digits}\n", "not UTF-8"),
    "latin1": ("name: caf\u00e9\n".encode("latin-1"), "not UTF-8"),
    "duplicate_key": ((DIGITS + "name: k\n").encode(), "duplicated key 'name'"),
    "duplicate_nested_key": ((DIGITS + "training: {epochs: 1, epochs: 50}\n").encode(), "duplicated key 'epochs'"),
    "alias_bomb": (_bomb(), "expands to more than"),
    "deep_nesting": ((DIGITS + "model_args: {a: " + "[" * 5000 + "]" * 5000 + "}\n").encode(), "nested"),
    "python_tag": (b"name: !!python/object/apply:os.system ['echo pwned']\n", "not valid YAML"),
    "two_documents": ((DIGITS + "---\n" + DIGITS).encode(), "single document"),
    "list_as_key": (b"? [a, b]\n: 1\n", "mapping key"),
    "unclosed": (b"name: [unclosed\n", "not valid YAML"),
    "empty": (b"", "empty"),
    "scalar": (b"just some text\n", "must be a YAML mapping"),
    "huge_file": (b"# " + b"x" * (2 * 1024 * 1024) + b"\n", "larger than"),
    "seed_too_big": ((DIGITS + "seed: 99999999999999999999999999\n").encode(), "seed: must be at most 4294967295"),
    "seed_negative": ((DIGITS + "seed: -1\n").encode(), "seed: must be at least 0"),
    "seed_infinite": ((DIGITS + "seed: 1e400\n").encode(), "seed: must be a whole number"),
    "lr_nan": ((DIGITS + "training: {learning_rate: .nan}\n").encode(), "training.learning_rate: must be a finite"),
    "lr_inf": ((DIGITS + "training: {learning_rate: .inf}\n").encode(), "training.learning_rate: must be a finite"),
    "lr_negative": ((DIGITS + "training: {learning_rate: -0.1}\n").encode(), "must be greater than 0"),
    "epochs_zero": ((DIGITS + "training: {epochs: 0}\n").encode(), "training.epochs: must be greater than 0"),
    "epochs_nan": ((DIGITS + "training: {epochs: .nan}\n").encode(), "training.epochs"),
    "subsets_huge": ((DIGITS + "vcasgd: {n_subsets: 1000000000000}\n").encode(), "vcasgd.n_subsets: must be at most"),
    "alpha_schedule_typo": ((DIGITS + "vcasgd: {alpha: e/(e+2)}\n").encode(), "vcasgd.alpha: must be a number or 'e/(e+1)'"),
    "alpha_inf": ((DIGITS + "vcasgd: {alpha: .inf}\n").encode(), "vcasgd.alpha"),
    "optimizer_unknown": ((DIGITS + "training: {optimizer: lbfgs}\n").encode(), "must be one of 'adam'"),
    "unknown_field": ((DIGITS + "bogus: 1\n").encode(), "bogus: unknown field"),
    "missing_model": (b"name: j\ndataset: {name: digits}\n", "model: required"),
    "bad_job_name": ((DIGITS.replace("name: j", "name: ../../etc")).encode(), "name: must be"),
    "dataset_traversal": ((BASE + "dataset: {train: ../../../../../../etc/shadow.npz}\n").encode(), "not found"),
    "dataset_nul": ((BASE + 'dataset: {train: "x\\0.npz"}\n').encode(), "control characters"),
    "dataset_wrong_kind": ((BASE + "dataset: {train: /etc/passwd}\n").encode(), "must be .npz or .h5"),
    "model_traversal": (b"name: j\nmodel: ../../../../../../tmp/nowhere/evil.keras\ndataset: {name: digits}\n",
                        "model file not found"),
    "model_module_path": (b"name: j\nmodel: ../evil:build\ndataset: {name: digits}\n", "model: must be"),
    "workers_negative": ((DIGITS + "backend: {local: {workers: -4}}\n").encode(), "backend.local.workers"),
    "backend_too_big": ((DIGITS + "backend: {local: {workers: 4096, slots: 1024, threads_per_slot: 1024}}\n").encode(),
                        "threads on"),
}


def _one_line_error(res: subprocess.CompletedProcess[str], needle: str) -> None:
    assert res.returncode != 0, (res.stdout, res.stderr)
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr  # one line, even on a 40-column terminal
    assert lines[0].startswith("error: "), lines
    assert needle in lines[0], (needle, lines[0])
    for internal in ("Traceback", "literal[", "pydantic", "errors.pydantic.dev", "Value error", "_type"):
        assert internal not in res.stderr + res.stdout, res.stderr


@pytest.fixture
def in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """``boinc-dl`` run in this process from ``tmp_path`` on a 40-column terminal; the
    user modules a command imports are forgotten afterwards."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "40")
    modules, path = set(sys.modules), list(sys.path)
    yield tmp_path
    # Only the user's own modules (files under tmp_path): a library a command imported
    # for the first time stays, since C extensions (numpy's, h5py's, TensorFlow's
    # dependencies') cannot be loaded twice in one process.
    root = str(tmp_path.resolve())
    for name in set(sys.modules) - modules:
        file = getattr(sys.modules.get(name), "__file__", None) or ""
        if file and str(Path(file).resolve()).startswith(root):
            del sys.modules[name]
    sys.path[:] = path


@pytest.mark.parametrize("case", sorted(CORPUS))
def test_spec_attack_corpus_gives_one_clear_line(in_process: Path, case: str) -> None:
    """Every case in process (the command's own code path, no interpreter start-up);
    the subprocess checks below run a sample of them as a user's shell does."""
    content, needle = CORPUS[case]
    shutil.copy(REPO / "examples" / "models.py", in_process / "models.py")
    (in_process / "job.yaml").write_bytes(content)
    res = CliRunner().invoke(app, ["validate", "job.yaml"])
    _one_line_error(subprocess.CompletedProcess(["validate"], res.exit_code, res.stdout, res.stderr), needle)


@pytest.mark.parametrize("case", ["elf_binary", "alias_bomb", "model_traversal", "lr_nan"])
def test_validate_in_a_shell_gives_the_same_line(tmp_path: Path, case: str) -> None:
    content, needle = CORPUS[case]
    shutil.copy(REPO / "examples" / "models.py", tmp_path / "models.py")
    spec = tmp_path / "job.yaml"
    spec.write_bytes(content)
    res = subprocess.run([*EXE, "validate", str(spec)], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                         timeout=300)
    _one_line_error(res, needle)


@pytest.mark.parametrize("case", ["elf_binary", "duplicate_key", "lr_nan", "backend_too_big", "dataset_traversal"])
def test_run_refuses_the_same_specs_before_starting_anything(tmp_path: Path, case: str) -> None:
    content, needle = CORPUS[case]
    shutil.copy(REPO / "examples" / "models.py", tmp_path / "models.py")
    spec = tmp_path / "job.yaml"
    spec.write_bytes(content)
    res = subprocess.run([*EXE, "run", str(spec), "-q"], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                         timeout=300)
    _one_line_error(res, needle)
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").rglob("redis.sock"))


def test_a_directory_is_not_a_spec(tmp_path: Path) -> None:
    res = subprocess.run([*EXE, "validate", str(tmp_path)], cwd=tmp_path, env=ENV, capture_output=True,
                         text=True, timeout=120)
    _one_line_error(res, "not a regular file")


def _npz(tmp: Path, x: np.ndarray, y: np.ndarray) -> Path:
    p = tmp / "data.npz"
    np.savez(p, x=x, y=y)
    return p


@pytest.mark.parametrize(("name", "x", "y", "extra", "needle"), [
    ("nan_features", np.full((50, 64), np.nan, np.float32), np.zeros(50, np.int64), "", "non-finite"),
    ("inf_features", np.where(np.eye(50, 64) > 0, np.inf, 0).astype(np.float32), np.zeros(50, np.int64), "",
     "non-finite"),
    ("negative_labels", np.zeros((50, 64), np.float32), -np.ones(50, np.int64), "", "class indices >= 0"),
    ("absurd_labels", np.zeros((50, 64), np.float32), np.full(50, 2**40, np.int64), "", "not a class index"),
    ("float_labels", np.zeros((50, 64), np.float32), np.full(50, 0.5, np.float32), "", "must be integers, got float32"),
    # common layouts of labels are refused with the one line that converts them
    ("whole_float_labels", np.zeros((50, 64), np.float32), np.arange(50, dtype=np.float32) % 3, "",
     "whole numbers stored as floats; save y.astype('int64') instead"),
    ("one_hot_labels", np.zeros((50, 64), np.float32), np.eye(3, dtype=np.float32)[np.arange(50) % 3], "",
     "the rows are one-hot; save y.argmax(axis=1) instead"),
    ("column_labels", np.zeros((50, 64), np.float32), (np.arange(50) % 3)[:, None], "",
     "one column; save y[:, 0]"),
    ("class_name_labels", np.zeros((50, 64), np.float32), np.array(["cat", "dog"])[np.arange(50) % 2], "",
     "class names; save np.unique(y, return_inverse=True)[1] instead"),
    ("text_features", np.array([["a"] * 64] * 50), np.zeros(50, np.int64), "", "must be numbers"),
    ("more_subsets_than_examples", np.zeros((50, 64), np.float32), np.zeros(50, np.int64),
     "vcasgd: {n_subsets: 500}\n", "500 subsets but only 40 training examples"),
    ("more_partitions_than_examples", np.zeros((50, 64), np.float32), np.zeros(50, np.int64),
     "mode: mop\nmop: {partitions: 900, param_grid: {learning_rate: [0.01]}}\n", "900 partitions but only"),
])
def test_validate_finds_what_a_run_would(tmp_path: Path, name: str, x: np.ndarray, y: np.ndarray, extra: str,
                                         needle: str) -> None:
    shutil.copy(REPO / "examples" / "models.py", tmp_path / "models.py")
    _npz(tmp_path, x, y)
    spec = tmp_path / "job.yaml"
    spec.write_text(BASE + "dataset: {train: data.npz}\n" + extra)
    res = subprocess.run([*EXE, "validate", str(spec)], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                         timeout=300)
    _one_line_error(res, needle)


@pytest.mark.slow
def test_validate_finds_labels_beyond_the_model_outputs(tmp_path: Path) -> None:
    shutil.copy(REPO / "examples" / "models.py", tmp_path / "models.py")
    _npz(tmp_path, np.zeros((50, 64), np.float32), np.arange(50, dtype=np.int64) % 12)
    spec = tmp_path / "job.yaml"
    spec.write_text(BASE + "dataset: {train: data.npz}\n")
    res = subprocess.run([*EXE, "validate", str(spec)], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                         timeout=300)
    _one_line_error(res, "labels go up to 11 but the model has 10 outputs")


_BLOCK_TF = '''import sys


class _NoTensorFlow:
    """Hide TensorFlow from the import system, as an install without the extra would."""

    def find_spec(self, name, path=None, target=None):
        if name == "tensorflow" or name.startswith("tensorflow."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _NoTensorFlow())
'''


@pytest.mark.parametrize("command", ["run", "validate"])
def test_without_tensorflow_one_line_names_the_extra(tmp_path: Path, command: str) -> None:
    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(_BLOCK_TF)
    shutil.copy(REPO / "examples" / "models.py", tmp_path / "models.py")
    spec = tmp_path / "job.yaml"
    spec.write_text(DIGITS)
    env = {**ENV, "PYTHONPATH": f"{blocker}{os.pathsep}{REPO}"}
    check = subprocess.run([sys.executable, "-c", "import tensorflow"], env=env, capture_output=True, text=True)
    assert check.returncode != 0 and "No module named 'tensorflow'" in check.stderr  # the blocker works
    res = subprocess.run([*EXE, command, str(spec), "-q"] if command == "run" else [*EXE, command, str(spec)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    _one_line_error(res, "pip install 'boinc-dl[cpu]'")
    assert "boinc-dl[gpu]" in res.stderr


def test_resource_checks_against_a_given_machine() -> None:
    from boinc_dl.server.common.errors import SpecError
    from boinc_dl.server.common.spec import parse_spec
    from boinc_dl.server.common.spec_checks import check_resources

    spec = parse_spec({"name": "j", "model": "m:f", "dataset": {"name": "digits"},
                       "backend": {"local": {"workers": 20, "slots": 1, "assimilators": 2}}})
    check_resources(spec, cores=2, memory_mb=24 * 1024)  # 22 processes, 64 threads allowed: fine
    with pytest.raises(SpecError, match=r"20 slots \+ 2 assimilators need about 9 GiB .* has 4 GiB"):
        check_resources(spec, cores=2, memory_mb=4 * 1024)
    with pytest.raises(SpecError, match="80 threads on 2 core"):
        check_resources(spec, {"slots": 4}, cores=2, memory_mb=1024 * 1024)
    boinc = spec.model_copy(update={"backend": spec.backend.model_copy(update={"kind": "boinc"})})
    check_resources(boinc, {"slots": 400}, cores=1, memory_mb=1)  # BOINC hosts are not this machine
