"""The fast entry point BOINC's script daemons start once per result: same options and
exit codes as the Typer commands, without importing the CLI, Typer or the work generators."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from boinc_dl.server.backends.boinc.script_entry import SCRIPT_COMMANDS, run_script

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import runpy, sys
sys.argv = ["boinc", *sys.argv[1:]]
try:
    runpy.run_module("boinc_dl.server.backends.boinc", run_name="__main__")
except SystemExit as e:
    heavy = [m for m in ("typer", "click", "rich", "boinc_dl.server.cli", "boinc_dl.server.backends.boinc.daemon",
                         "boinc_dl.server.work_generator", "tensorflow", "keras") if m in sys.modules]
    print("EXIT", e.code, "HEAVY", ",".join(heavy) or "-")
"""


def probe(*args: str) -> tuple[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run([sys.executable, "-c", PROBE, *args], env=env, capture_output=True, text=True, timeout=60)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("EXIT")][-1].split()
    return line[1], line[3]


@pytest.mark.parametrize("command", sorted(SCRIPT_COMMANDS))
def test_script_calls_import_no_cli(command: str) -> None:
    code, heavy = probe(command, "--project", "/nonexistent-boinc-project", "--", "x")
    assert code == "3"  # a project that is not there is transient for BOINC's daemons
    assert heavy == "-", f"a script call imported {heavy}"


def test_other_commands_still_go_through_the_cli() -> None:
    code, heavy = probe("restart", "--help")
    assert code == "0" and "typer" in heavy


def test_boinc_arguments_pass_verbatim(project, caplog) -> None:
    """Everything after '--' reaches the script untouched, options of ours included; a bad
    call gets the script's own exit code (2: cannot parse, BOINC's daemon stops)."""
    assert run_script("assimilate", ["--project", str(project.root), "--", "--project", "x"]) == 2
    assert "argv ['--project', 'x']" in caplog.text
    # --error without a mask: the parser's error, not argparse's
    assert run_script("assimilate", ["--project", str(project.root), "--", "--error"]) == 2


def test_no_abbreviated_options(project, monkeypatch, tmp_path) -> None:
    """'--proj' is not taken for --project (BOINC's own arguments could look alike): it
    is passed on, and with no project found the call is transient (3)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("BDL_PROJECT", raising=False)
    assert run_script("validate-init", ["--proj", str(project.root)]) == 3
