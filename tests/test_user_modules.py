"""A user's own modules beside the spec never clash with boinc-dl's (installed command).

boinc-dl has one top-level import name, ``boinc_dl``: a user's ``server.py`` or
``client_app.py`` beside the spec is theirs; a model module is looked up beside the spec
before the working directory; a module that would take boinc-dl's own name is refused
with one line.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.support.cli import boinc_dl

REPO = Path(__file__).resolve().parents[1]
SPEC = """name: mine
model: models:mlp
model_args: {hidden: 8}
dataset: {name: digits, limit: 200}
training: {epochs: 1, batch_size: 32}
vcasgd: {n_subsets: 2, alpha: 0.5}
backend: {local: {workers: 1, slots: 1, assimilators: 1}}
"""


def _project(tmp: Path) -> Path:
    """A user's folder: the spec, their model module, and modules named like boinc-dl's parts."""
    d = tmp / "mine"
    d.mkdir()
    shutil.copy(REPO / "examples" / "models.py", d / "models.py")
    (d / "job.yaml").write_text(SPEC)
    for name in ("server", "client_app", "cli", "run"):
        (d / f"{name}.py").write_text("raise SystemExit('a user module was imported by boinc-dl')\n")
    return d


def test_user_modules_named_like_boinc_dl_parts_change_nothing(tmp_path: Path) -> None:
    d = _project(tmp_path)
    res = boinc_dl("validate", "job.yaml", cwd=d, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    res = boinc_dl("run", "job.yaml", "--run-dir", str(tmp_path / "run"), cwd=d, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert (tmp_path / "run" / "final_model.keras").exists()
    assert "ModuleNotFoundError" not in (tmp_path / "run" / "local-backend.log").read_text()


def test_the_model_module_beside_the_spec_wins_over_the_working_directory(tmp_path: Path) -> None:
    d = _project(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "models.py").write_text("raise SystemExit('the working directory was searched first')\n")
    res = boinc_dl("validate", str(d / "job.yaml"), cwd=elsewhere, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr


def test_a_module_taking_boinc_dls_own_name_is_refused_in_one_line(tmp_path: Path) -> None:
    d = _project(tmp_path)
    (d / "boinc_dl.py").write_text("X = 1\n")
    res = boinc_dl("validate", "job.yaml", cwd=d, timeout=300)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Traceback" not in res.stderr
    assert res.stderr.strip().startswith("error:") and "shadow boinc-dl" in res.stderr
    (d / "boinc_dl.py").unlink()
    (d / "job.yaml").write_text(SPEC.replace("models:mlp", "boinc_dl.server:cli"))
    res = boinc_dl("validate", "job.yaml", cwd=d, timeout=300)
    assert res.returncode == 2 and "boinc-dl's own package name" in res.stderr, res.stderr
