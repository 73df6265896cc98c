"""Start-up of one validator/assimilator call, as BOINC's script daemons pay it per result.

``script_validator`` and ``script_assimilator`` run the project's shim through
``system()`` for every result, so each unit pays two fresh interpreters between the
client's report and the merge. This measures, in the same run and interleaved:

* ``fast``: ``python -m boinc_dl.server.backends.boinc assimilate ...`` (the shims' command: the
  argparse entry point, :mod:`boinc_dl.server.backends.boinc.script_entry`);
* ``typer``: the same command through the full ``boinc-dl boinc`` Typer app (the path
  every call took before);
* ``bare``: ``python -c pass``, the interpreter's own floor.

Each call imports everything a real call needs (the scripts module, the project and the
store) and stops at the project lookup (``--project`` names no project: exit 3), so no
Redis or BOINC project is involved. Usage: ``python bench/bench_script_startup.py
[--repeats 15]``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from bench._common import emit, machine, median

REPO = Path(__file__).resolve().parents[1]
ARGS = ["assimilate", "--project", "/nonexistent-boinc-project", "--", "x"]
COMMANDS = {
    "fast": [sys.executable, "-m", "boinc_dl.server.backends.boinc", *ARGS],
    "typer": [sys.executable, "-c",
              "import sys; from boinc_dl.server.cli.boinc import boinc_app; boinc_app(sys.argv[1:], prog_name='boinc-dl boinc')",
              *ARGS],
    "bare": [sys.executable, "-c", "pass"],
}


def once(cmd: list[str]) -> float:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    t = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t
    if cmd[-1] != "pass" and p.returncode != 3:
        raise SystemExit(f"unexpected exit {p.returncode} from {cmd[:4]}: {p.stderr[-500:]}")
    return wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=15)
    a = ap.parse_args()
    times: dict[str, list[float]] = {k: [] for k in COMMANDS}
    for cmd in COMMANDS.values():  # warm the page cache
        once(cmd)
    for _ in range(a.repeats):
        for name, cmd in COMMANDS.items():
            times[name].append(once(cmd))
    load = os.getloadavg()[0]
    fast, typer, bare = (median(times[k]) for k in ("fast", "typer", "bare"))
    print(f"{'path':<8} {'median s':>9} {'min s':>7}")
    for name, xs in times.items():
        print(f"{name:<8} {median(xs):9.3f} {min(xs):7.3f}")
    print(f"fast / typer = {fast / typer:.2f}; saved per call {typer - fast:.3f} s, per unit "
          f"(validate + assimilate) {2 * (typer - fast):.3f} s; load {load:.2f}")
    emit("script_startup", fast_s=fast, typer_s=typer, bare_s=bare, ratio=fast / typer,
         repeats=a.repeats, load=load, **machine())


if __name__ == "__main__":
    main()
