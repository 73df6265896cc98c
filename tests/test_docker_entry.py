"""The Docker app's entry point (``docker_main.sh``) without a container engine.

Laid out as docker_wrapper lays out a container: the slot directory (here any
directory, in the container ``/app``) holds the unit's files, some of them BOINC link
files to ``../../projects/<project>/<name>``, which in the container are under the
project directory's mount (``/project``), never where the link points. The script runs
the real client app with real TensorFlow; the same promises as the venv app version:
outputs, fraction done, checkpoints in the slot (a container restarted from scratch
resumes), SIGTERM, spot notices, exit codes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from boinc_dl.server.common.workunit import INPUT_NAMES, OUTPUT_NAMES
from tests.test_client_app_cli import (
    LONG_UNIT,
    _unit_with_reference,
    positions,
    read_json,
    wait_for,
)

REPO = Path(__file__).resolve().parents[1]
ENTRY = REPO / "server" / "backends" / "boinc" / "files" / "docker_main.sh"
PROJECT = "127.0.0.1_8088_bdl"


@pytest.fixture(scope="module")
def unit(tmp_path_factory: pytest.TempPathFactory, worker_id: str):
    # the same unit as test_client_app_cli's long_unit: built once for both
    return _unit_with_reference(tmp_path_factory, worker_id, "long_unit", LONG_UNIT)


def container_layout(src: Path, root: Path, linked: tuple[str, ...] = ("data.npz", "weights_out.h5")) -> tuple[Path, Path]:
    """(slot, project mount): the unit's files copied into the slot, except ``linked``,
    which are link files into the project directory (the mount)."""
    slot, mount = root / "app", root / "project"
    slot.mkdir(parents=True)
    mount.mkdir()
    for name in INPUT_NAMES + OUTPUT_NAMES:
        phys = f"job_e1_s0_r77_{name.replace('.', '_')}"
        if name in linked:
            (slot / name).write_text(f"<soft_link>../../projects/{PROJECT}/{phys}</soft_link>\n")
            if name in INPUT_NAMES:
                (mount / phys).write_bytes((src / name).read_bytes())
        elif name in INPUT_NAMES:
            (slot / name).write_bytes((src / name).read_bytes())
    # as the client writes it (the slot is /app in the container: host paths mean nothing there)
    (slot / "init_data.xml").write_text(
        "<app_init_data>\n<result_name>job__m0_e0001_s0000_0</result_name>\n<wu_name>job__m0_e0001_s0000</wu_name>\n"
        f"<project_dir>/var/lib/boinc-client/projects/{PROJECT}</project_dir>\n"
        "<boinc_dir>/var/lib/boinc-client</boinc_dir>\n<gpu_type></gpu_type>\n<gpu_device_num>-1</gpu_device_num>\n"
        "<ncpus>1.000000</ncpus>\n</app_init_data>\n")
    return slot, mount


def entry_env(slot: Path, mount: Path, bin_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BDL_")}
    env.update({"BDL_SLOT": str(slot), "BDL_PROJECT_MOUNT": str(mount), "BDL_PYTHON": sys.executable,
                "PYTHONPATH": str(REPO), "BDL_PREEMPT_PROVIDER": "none",
                "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", **extra})
    return env


def start(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as err:
        # no cwd: the script goes into the slot itself, as the container's WORKDIR does
        return subprocess.Popen(["/bin/sh", str(ENTRY)], env=env, stdout=subprocess.DEVNULL, stderr=err,
                                cwd="/")


@pytest.fixture
def fake_boinccmd(tmp_path: Path) -> Path:
    """A boinccmd on PATH that records its calls: in a container nothing may call it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "boinccmd"
    tool.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'boinccmd.calls'}\n")
    tool.chmod(0o755)
    return bin_dir


def weights_of(path: Path, fp) -> np.ndarray:
    from boinc_dl.server.common.weights import read_weights

    return read_weights(path, expected=fp).flat


def test_entry_trains_through_the_project_mount(unit, tmp_path: Path, fake_boinccmd: Path) -> None:
    src, fp, reference, ref_metrics = unit
    slot, mount = container_layout(src, tmp_path)
    log = tmp_path / "stderr.txt"
    t = time.monotonic()
    p = start(entry_env(slot, mount, fake_boinccmd), log)
    assert p.wait(300) == 0, log.read_text()
    wall = time.monotonic() - t
    # the linked output went to the project directory through the mount; the link is untouched
    out = mount / "job_e1_s0_r77_weights_out_h5"
    assert np.array_equal(weights_of(out, fp), reference)
    assert (slot / "weights_out.h5").read_text().startswith("<soft_link>")
    m = json.loads((slot / "metrics.json").read_text())
    assert m["result"] == "job__m0_e0001_s0000_0" and m["val_acc"] == ref_metrics["val_acc"]
    assert float((slot / "fraction_done").read_text()) == 1.0  # docker_wrapper reads it from the slot
    assert not (slot / "checkpoint.h5").exists()
    assert not (tmp_path / "boinccmd.calls").exists()
    print(f"\nentry point: unit done in {wall:.1f} s")


def test_sigterm_then_container_restart_resumes(unit, tmp_path: Path, fake_boinccmd: Path) -> None:
    """SIGTERM (engine stop, host shutdown): checkpoint, exit 75. docker_wrapper restarts an
    exited container from scratch (same slot, same command): it resumes bit for bit."""
    src, fp, reference, ref_metrics = unit
    slot, mount = container_layout(src, tmp_path)
    log = tmp_path / "stderr.txt"
    env = entry_env(slot, mount, fake_boinccmd)
    p = start(env, log)
    wait_for(lambda: positions(slot)[0] > 0, p, log, "a first checkpoint", timeout=300)
    p.send_signal(signal.SIGTERM)  # the script exec'ed Python: the signal reaches it
    assert p.wait(60) == 75, log.read_text()
    ck_done, progress_done = positions(slot)
    assert ck_done == progress_done > 0
    assert read_json(slot / "checkpoint.json") is not None
    p = start(env, log)
    assert p.wait(300) == 0, log.read_text()
    m = json.loads((slot / "metrics.json").read_text())
    assert m["resumed"] is True and m["resumed_at_batch"] == ck_done and m["redone_batches"] == 0
    assert np.array_equal(weights_of(mount / "job_e1_s0_r77_weights_out_h5", fp), reference)
    assert not (tmp_path / "boinccmd.calls").exists()


@pytest.mark.slow
def test_spot_notice_exits_75_without_boinccmd(unit, tmp_path: Path, fake_boinccmd: Path) -> None:
    """After a notice the container exits 75 at once: docker_wrapper hands the status to
    the client, which reports the task failed and the server re-issues it. boinccmd (the
    venv app version's way) is out of a container's reach and is not tried."""
    src, fp, reference, _ = unit
    slot, mount = container_layout(src, tmp_path)
    log = tmp_path / "stderr.txt"
    notice = tmp_path / "notice"
    p = start(entry_env(slot, mount, fake_boinccmd, BDL_PREEMPT_NOTICE_FILE=str(notice)), log)
    wait_for(lambda: positions(slot)[0] > 0, p, log, "a first checkpoint", timeout=300)
    notice.write_text("spot reclaim (test)\n")
    assert p.wait(60) == 75, log.read_text()
    assert "preemption notice" in log.read_text()
    assert not (tmp_path / "boinccmd.calls").exists()
    ck_done, progress_done = positions(slot)
    assert ck_done == progress_done > 0


def test_link_out_of_the_project_is_a_permanent_error(unit, tmp_path: Path, fake_boinccmd: Path) -> None:
    src, *_ = unit
    slot, mount = container_layout(src, tmp_path)
    (slot / "data.npz").write_text(f"<soft_link>../../projects/{PROJECT}/../../etc/passwd</soft_link>")
    log = tmp_path / "stderr.txt"
    assert start(entry_env(slot, mount, fake_boinccmd), log).wait(120) == 1
    err = log.read_text()
    assert "not a file of the project directory" in err and "Traceback" not in err


def test_missing_input_exits_1(unit, tmp_path: Path, fake_boinccmd: Path) -> None:
    src, *_ = unit
    slot, mount = container_layout(src, tmp_path)
    (mount / "job_e1_s0_r77_data_npz").unlink()
    log = tmp_path / "stderr.txt"
    assert start(entry_env(slot, mount, fake_boinccmd), log).wait(120) == 1
    assert "missing input file data.npz" in log.read_text()


def test_resolve_through_the_project_mount(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from boinc_dl.client_app.boinc_io import resolve

    slot, mount = tmp_path / "app", tmp_path / "project"
    slot.mkdir()
    links = {
        "rel": f"../../projects/{PROJECT}/wu_1_0",
        "abs": f"/var/lib/boinc-client/projects/{PROJECT}/wu_1_1",  # a client with an absolute data dir
        "win": f"..\\..\\projects\\{PROJECT}\\wu_1_2",
        "sub": f"../../projects/{PROJECT}/sub/./wu_1_3",
    }
    for name, target in links.items():
        (slot / name).write_text(f"<soft_link>{target}</soft_link>")
    (slot / "copied.npz").write_bytes(b"PK\x03\x04 real file")
    want = {"rel": mount / "wu_1_0", "abs": mount / "wu_1_1", "win": mount / "wu_1_2", "sub": mount / "sub" / "wu_1_3"}
    for name, path in want.items():
        assert resolve(slot, name, mount) == path
    assert resolve(slot, "copied.npz", mount) == slot / "copied.npz"
    # from the environment, as the entry point sets it
    monkeypatch.setenv("BDL_PROJECT_MOUNT", str(mount))
    assert resolve(slot, "rel") == mount / "wu_1_0"
    monkeypatch.delenv("BDL_PROJECT_MOUNT")
    assert resolve(slot, "rel") == tmp_path.parent / "projects" / PROJECT / "wu_1_0"  # host layout: as before
    for bad in (f"../../projects/{PROJECT}/../../etc/passwd", f"../../projects/{PROJECT}/", "../../etc/passwd",
                "../../projects/../x", f"../../projects/{PROJECT}/a/../../b"):
        (slot / "bad").write_text(f"<soft_link>{bad}</soft_link>")
        with pytest.raises(ValueError, match="not a file of the project directory"):
            resolve(slot, "bad", mount)
