"""Client start-up: ``python -m boinc_dl.client_app`` skips the packages Keras imports optionally.

Each BOINC task is a fresh process, so every module imported at start-up is paid per
task. scikit-learn, matplotlib and IPython (about a quarter of ``import tensorflow``
where they are installed) must not load in a client task, yet must stay importable.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from boinc_dl.server.common.lean_imports import KERAS_OPTIONAL, hidden
from tests.test_client_app import make_unit

REPO = Path(__file__).resolve().parents[1]

# Runs the client's entry point on a slot, then reports what the process imported.
PROBE = """
import json, sys
from boinc_dl.client_app.cli import main
rc = main(["--slot", sys.argv[1], "--threads", "1", "-q"])
loaded = sorted(m for m in sys.modules if m.partition(".")[0] in {names!r})
import sklearn  # still importable once the task's TensorFlow is loaded
print(json.dumps({{"rc": rc, "loaded": loaded, "sklearn_after": sklearn.__name__ == "sklearn"}}))
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "2", "BDL_PREEMPT_PROVIDER": "none"}


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


@pytest.mark.skipif(not _installed("sklearn"), reason="scikit-learn not installed: nothing to skip")
def test_client_task_does_not_import_keras_optional_packages(tmp_path: Path) -> None:
    make_unit(tmp_path / "slot")
    out = subprocess.run([sys.executable, "-c", PROBE.format(names=set(KERAS_OPTIONAL)), str(tmp_path / "slot")],
                         cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["rc"] == 0
    assert (tmp_path / "slot" / "weights_out.h5").is_file()
    assert got["loaded"] == []
    assert got["sklearn_after"]


@pytest.mark.skipif(not _installed("sklearn"), reason="scikit-learn not installed: nothing to skip")
def test_a_plain_tensorflow_import_does_load_them() -> None:
    """The baseline the test above guards against: Keras really imports scikit-learn."""
    code = "import sys, tensorflow, keras; print('sklearn.base' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_env(), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "True"


def test_hidden_packages_fail_to_import_inside_the_block_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    pkg = tmp_path / "bdl_probe_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "sub.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with hidden(["bdl_probe_pkg"]):
        with pytest.raises(ImportError):
            importlib.import_module("bdl_probe_pkg")
        with pytest.raises(ImportError):
            importlib.import_module("bdl_probe_pkg.sub")
    assert importlib.import_module("bdl_probe_pkg.sub").X == 1
    with hidden(["bdl_probe_pkg"]):  # an already imported package is left alone
        assert importlib.import_module("bdl_probe_pkg.sub").X == 1
    for name in ("bdl_probe_pkg.sub", "bdl_probe_pkg"):
        sys.modules.pop(name, None)


# The server's processes import TensorFlow the same way: a run's own process (the initial
# model, the evaluator, the checker) and the local backend's fork server, whose children
# (every slot and assimilator) start with what it preloaded.
SERVER_PROBE = """
import json, multiprocessing, runpy, sys
from boinc_dl.server.common.keras_model import configure_tf
from boinc_dl.server.backends.local.jobsystem import process_context
tf = configure_tf()
main = sorted(m for m in sys.modules if m.partition(".")[0] in {names!r})
ctx = process_context()
p = ctx.Process(target=runpy.run_path, args=(sys.argv[1],))
p.start(); p.join(120)
import sklearn  # still importable
print(json.dumps({{"main": main, "tf": tf.__name__, "child_rc": p.exitcode}}))
"""

CHILD = """
import json, sys
names = {names!r}
json.dump({{"tf": "tensorflow" in sys.modules and "keras" in sys.modules,
           "train": "boinc_dl.client_app.train" in sys.modules,
           "loaded": sorted(m for m in sys.modules if m.partition(".")[0] in names)}},
          open(sys.argv[0] + ".json", "w"))
"""


@pytest.mark.skipif(not _installed("sklearn"), reason="scikit-learn not installed: nothing to skip")
def test_server_processes_and_the_fork_servers_children_import_tensorflow_lean(tmp_path: Path) -> None:
    names = set(KERAS_OPTIONAL)
    child = tmp_path / "child.py"
    child.write_text(CHILD.format(names=names))
    out = subprocess.run([sys.executable, "-c", SERVER_PROBE.format(names=names), str(child)],
                         cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"main": [], "tf": "tensorflow", "child_rc": 0}, got
    # the child forked from the fork server found TensorFlow, Keras and the client's
    # training code already imported (preloaded), and none of Keras' optional packages
    assert json.loads((tmp_path / "child.py.json").read_text()) == {"tf": True, "train": True, "loaded": []}
