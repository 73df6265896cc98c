"""Shared helpers for the benchmarks: one machine-readable line per result."""

from __future__ import annotations

import json
import platform
import statistics
import sys
from pathlib import Path
from typing import Any


def emit(name: str, **fields: Any) -> None:
    """Print ``BENCH {json}``: the line CI logs and bench/README.md quote."""
    print("BENCH " + json.dumps({"name": name, **fields}, default=float), flush=True)


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def machine() -> dict[str, Any]:
    import os

    return {"python": sys.version.split()[0], "cpus": os.cpu_count(), "machine": platform.machine()}


def export_ref(repo: Path, ref: str, dest: Path) -> tuple[Path, str]:
    """The tree of git revision ``ref`` of ``repo`` under ``dest``, importable as it was
    then: returns (the directory to put first on PYTHONPATH, the import prefix of its
    packages: ``"boinc_dl."`` where the revision maps its folders under one import name,
    as setup.py does, ``""`` for a revision from before, whose packages were ``server``
    and ``client_app``). Without the mapping an exported ``boinc_dl`` would resolve to
    the installed (current) code and the baseline would measure the current code."""
    import subprocess

    src = dest / "src"
    src.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(repo), "archive", ref], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    if not (src / "setup.py").is_file() or "boinc_dl" not in (src / "setup.py").read_text():
        return src, ""
    pkg = dest / "pkg" / "boinc_dl"
    pkg.mkdir(parents=True)
    for name in ("server", "client_app"):
        (pkg / name).symlink_to(src / name)
    return dest / "pkg", "boinc_dl."


def before_after_args(doc: str | None, baseline_ref: str) -> Any:
    """The arguments of a before/after bench: ``--repeats`` (interleaved pairs) and
    ``--baseline-ref`` (the git revision measured as "before")."""
    import argparse

    ap = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--baseline-ref", default=baseline_ref)
    return ap.parse_args()


def cli_env(code: tuple[Path, str] | None) -> tuple[dict[str, str], str]:
    """The environment and module prefix to run ``boinc-dl`` as ``python -m
    <prefix>server.cli`` with the code :func:`export_ref` exported (None: the installed
    code): one thread per slot, no TF_ settings of the caller's."""
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("TF_")}
    env.update(BDL_THREADS="1", COLUMNS="120")
    if code is None:
        return env, "boinc_dl."
    env["PYTHONPATH"] = str(code[0])
    return env, code[1]


def interleaved(sides: dict[str, Any], repeats: int, run: Any) -> dict[str, list[Any]]:
    """``run(side, i)`` for each side, ``repeats`` times, the order flipped every repeat
    (load changes and a warm page cache favour neither side); each side's results."""
    out: dict[str, list[Any]] = {side: [] for side in sides}
    for i in range(repeats):
        for side in list(sides) if i % 2 == 0 else list(reversed(sides)):
            out[side].append(run(side, i))
    return out
