"""Run the installed ``boinc-dl`` as a user does: the console script, as a subprocess.

The console script is the one installed beside the interpreter running the tests (a
virtualenv's, or the system's): its ``sys.path`` starts at its own bin directory, not at
the user's working directory, exactly as when a user types ``boinc-dl``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

#: The environment of a user's shell, minus the noise of TensorFlow's start-up lines.
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "COLUMNS": "120"}


def boinc_dl_command() -> list[str]:
    """The installed ``boinc-dl`` console script (the one beside this interpreter)."""
    here = Path(sys.executable).parent / "boinc-dl"
    if here.exists():
        return [str(here)]
    found = shutil.which("boinc-dl")
    if found is None:
        raise RuntimeError("boinc-dl is not installed: pip install -e '.[cpu,dev]'")
    return [found]


def boinc_dl(*args: str, cwd: Path, timeout: float = 600, env: dict[str, str] | None = None,
             input: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``boinc-dl ARGS`` in ``cwd`` and wait for it."""
    return subprocess.run([*boinc_dl_command(), *args], cwd=cwd, env=env or ENV, capture_output=True, text=True,
                          timeout=timeout, input=input)


def small_digits_spec(name: str, *, n_subsets: int, workers: int, slots: int) -> str:
    """The YAML of a small local-backend digits job (400 examples, MLP 16, 2 epochs,
    ``models.py`` beside it): the planner's CLI tests run it to calibrate from."""
    return f"""\
name: {name}
mode: vcasgd
model: models:mlp
model_args: {{input_dim: 64, hidden: 16, n_classes: 10}}
dataset: {{name: digits, limit: 400}}
training: {{epochs: 2, batch_size: 32, learning_rate: 0.01, local_epochs: 2}}
vcasgd: {{n_subsets: {n_subsets}}}
units: {{timeout_s: 60}}
backend: {{kind: local, local: {{workers: {workers}, slots: {slots}, assimilators: 1}}}}
seed: 3
"""
