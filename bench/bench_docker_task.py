"""Per-task cost of the Docker app version against the venv app version, in one run.

Every BOINC task of the Docker app version is a new container from the host's image:
docker_wrapper creates it (the slot directory mounted at /app, the project directory at
/project), starts it, polls it until it exits and removes it. The venv app version starts
a new Python process instead. This runs the same real small unit (the digits example's,
as ``bench_client_startup.py`` makes it) both ways, interleaved (order flipped every
repeat, so that load changes favour neither side), and reports medians of each phase:

* venv: the process's wall time (what BOINC's wrapper adds on top is the same for both);
* container: ``create``, ``start`` to exit (the client app inside), ``rm``, and their sum,
  with the engine command given (``--engine``, e.g. ``podman`` or
  ``podman --root DIR --storage-driver overlay``): the storage driver decides what
  ``create`` and ``rm`` cost (``vfs`` copies the whole image per container).

docker_wrapper also polls the container only every 10 s (``STATUS_PERIOD``,
``samples/docker_wrapper/docker_wrapper.cpp``), so a task ends on average 5 s after its
container did; that is not measured here. Needs the image already built on this host
(``--image``, the ``image_name`` of the app version's job.toml):

    PYTHONPATH=$PWD python3 bench/bench_docker_task.py --image bdl-cpu-... --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import emit, machine, median  # noqa: E402
from bench.bench_client_startup import env_for, run_task  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _run(cmd: list[str]) -> tuple[float, str]:
    t = time.perf_counter()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return time.perf_counter() - t, out.strip()


def container_task(engine: list[str], image: str, unit: Path, slot: Path, project: Path, name: str) -> dict[str, float]:
    """One task as docker_wrapper runs it (its create arguments, podman's log driver)."""
    shutil.rmtree(slot, ignore_errors=True)
    shutil.copytree(unit, slot)
    subprocess.run([*engine, "rm", "-f", name], capture_output=True)
    create_s, _ = _run([*engine, "create", "--name", name, "-v", f"{slot}/:/app", "-v", f"{project}/:/project",
                        "-e", "BDL_PREEMPT_PROVIDER=none", "--log-driver=k8s-file", image])
    t = time.perf_counter()
    _run([*engine, "start", name])
    _, code = _run([*engine, "wait", name])
    run_s = time.perf_counter() - t
    if code.strip() != "0":
        _, logs = _run([*engine, "logs", name])
        raise RuntimeError(f"container exited {code}: {logs[-2000:]}")
    rm_s, _ = _run([*engine, "rm", name])
    m = json.loads((slot / "metrics.json").read_text())
    return {"create_s": create_s, "run_s": run_s, "rm_s": rm_s, "total_s": create_s + run_s + rm_s,
            "app_wall_s": m["wall_s"], "load_s": m["load_s"], "val_acc": m["val_acc"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--image", required=True, help="the app version's image (job.toml image_name), built already")
    ap.add_argument("--engine", default="podman", help="engine command, e.g. 'podman --storage-driver overlay'")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    engine = shlex.split(args.engine)
    driver = subprocess.run([*engine, "info", "--format", "{{.Store.GraphDriverName}}"],
                            capture_output=True, text=True).stdout.strip() or "?"

    with tempfile.TemporaryDirectory(prefix="bench_docker_task_") as tmp_s:
        tmp = Path(tmp_s)
        unit, project = tmp / "unit", tmp / "project"
        project.mkdir()
        subprocess.run([sys.executable, "-c", f"import sys; sys.argv=['x', {str(unit)!r}]; "
                        "from bench.bench_client_startup import make_unit; from pathlib import Path; "
                        "make_unit(Path(sys.argv[1]))"], cwd=REPO, env=env_for(REPO), check=True,
                       stderr=subprocess.DEVNULL)
        rows: dict[str, list[dict[str, float]]] = {"venv": [], "container": []}
        for i in range(args.repeats):
            sides = ["venv", "container"] if i % 2 == 0 else ["container", "venv"]
            for side in sides:
                if side == "venv":
                    rows[side].append(run_task(REPO, unit, tmp / "slot_venv"))
                else:
                    rows[side].append(container_task(engine, args.image, unit, tmp / "slot_container", project,
                                                     f"bdl-bench-{os.getpid()}"))
    med = {side: {k: round(median([r[k] for r in rs]), 2) for k in rs[0]} for side, rs in rows.items()}
    print(f"storage driver {driver}, {args.repeats} tasks each, load {os.getloadavg()[0]:.1f}")
    print(f"venv task (fresh process):       {med['venv']['wall_s']:7.2f} s (load {med['venv']['load_s']:.2f} s)")
    c = med["container"]
    print(f"container task: create {c['create_s']:.2f} + start..exit {c['run_s']:.2f} + rm {c['rm_s']:.2f}"
          f" = {c['total_s']:.2f} s (client app {c['app_wall_s']:.2f} s, load {c['load_s']:.2f} s)")
    emit("docker_task", image=args.image, engine=args.engine, storage_driver=driver, repeats=args.repeats,
         venv=med["venv"], container=med["container"],
         extra_per_task_s=round(c["total_s"] - med["venv"]["wall_s"], 2), load1=os.getloadavg()[0], **machine())


if __name__ == "__main__":
    main()
