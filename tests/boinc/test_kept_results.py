"""What BOINC's assimilator script leaves on the server's disk, run as BOINC runs it.

* a rejected upload leaves nothing (no copy, no temporary directory), and its
  decompressed copy never outgrew the job's upload bound, derived from the model;
* with ``keep_weights``, kept weights are bounded (``keep_weights_max_bytes`` per job),
  counted in the job's counters, and live only under the job's directory;
* a killed script's temporary copy is swept by the next call;
* a full disk under the project is the server's fault: the script exits "transient"
  (BOINC calls it again later), no unit is given up, nothing is rejected, and the
  next call after space is freed merges the result.
"""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from boinc_dl.server.common.procs import sweep_orphaned_dirs as sweep_intake
from boinc_dl.server.common.weights import upload_bound
from tests.boinc.conftest import make_result, run_script, tiny_fp, unit

N = tiny_fp().n_params


def settings(project, **values: object) -> None:
    project.settings_file.write_text(project.settings_file.read_text()
                                     + "".join(f"{k}: {v}\n" for k, v in values.items()))


def test_gzip_bomb_is_bounded_by_the_model_and_leaves_nothing(env) -> None:
    project, store, spec, e = env
    u = unit(spec, 0)
    w, m = make_result(project.upload_dir, f"{u}_0", spec.name, u, np.ones(N), upload=project)
    bound = upload_bound(store.fingerprint("0"))
    assert spec.units.max_upload_bytes is None and bound < 17 << 20  # not 512 MB
    with gzip.open(w, "wb", compresslevel=9) as f:  # 64 MB of zeros in ~64 KB
        for _ in range(64):
            f.write(bytes(1 << 20))
    assert Path(w).stat().st_size < 1 << 20
    p = run_script(project.root, f"../bin/bdl_assimilate 17 {w} {m}", e)
    assert p.returncode == 0, p.stderr
    assert "upload bound" in store.failed()[u] and f"more than {bound} bytes" in store.failed()[u]
    assert not (project.job_dir(spec.name) / "results").exists()
    assert list((project.boincdl_dir / "spool").iterdir()) == []


def test_kept_weights_are_bounded_and_counted(env) -> None:
    project, store, spec, e = env
    first = make_result(project.upload_dir, f"{unit(spec, 0)}_0", spec.name, unit(spec, 0), np.ones(N),
                        upload=project)
    size = Path(first[0]).stat().st_size
    settings(project, keep_weights="true", keep_weights_max_bytes=size + size // 2)  # room for one file
    for i in range(2):
        u = unit(spec, i)
        paths = first if i == 0 else make_result(project.upload_dir, f"{u}_0", spec.name, u, np.ones(N),
                                                  upload=project)
        p = run_script(project.root, f"../bin/bdl_assimilate {17 + i} {' '.join(paths)}", e)
        assert p.returncode == 0, p.stderr
    assert set(store.assimilated()) == {unit(spec, 0), unit(spec, 1)}
    results = project.job_dir(spec.name) / "results"
    assert (results / unit(spec, 0) / "weights_out.h5").stat().st_size == size
    assert not (results / unit(spec, 1) / "weights_out.h5").exists()  # over the bound: not kept
    assert (results / unit(spec, 1) / "metrics.json").exists()
    c = store.counters()
    assert (c["kept_weights"], c["kept_weights_bytes"], c["kept_weights_refused"]) == (1, size, 1)
    # A re-run of the first assimilation (at least once) counts nothing twice.
    p = run_script(project.root, f"../bin/bdl_assimilate 17 {' '.join(first)}", e)
    assert p.returncode == 0 and store.counters()["kept_weights_bytes"] == size
    assert [q.name for q in results.rglob("*") if q.name.startswith(".")] == []  # no temporary copies


def test_killed_script_leftovers_are_swept(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    (tmp_path / f"r_0.{dead}.abc").mkdir()
    (tmp_path / f"r_0.{dead}.abc" / "weights_out.h5").write_bytes(bytes(1000))
    (tmp_path / f"r_1.{os.getpid()}.abc").mkdir()  # a live assimilation's: kept
    (tmp_path / "unrelated").mkdir()
    sweep_intake(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"r_1.{os.getpid()}.abc", "unrelated"])


@pytest.fixture
def small_spool(project):
    """The project's spool on a 256 KB tmpfs (skipped where mounting is not allowed)."""
    spool = project.boincdl_dir / "spool"
    spool.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(spool)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or r.returncode}): needs root")
    yield spool
    subprocess.run(["umount", "-l", str(spool)], check=False)


def fill(path: Path) -> Path:
    """Fill the file system holding ``path`` to its last byte with one file."""
    with path.open("wb", buffering=0) as f:
        try:
            while True:
                f.write(bytes(4096))
        except OSError:
            pass
    return path


def test_full_disk_at_intake_is_transient_and_charges_nothing(env, small_spool: Path) -> None:
    project, store, spec, e = env
    u = unit(spec, 0)
    paths = make_result(project.upload_dir, f"{u}_0", spec.name, u, np.ones(N), upload=project)
    filler = fill(small_spool / "filler")
    p = run_script(project.root, f"../bin/bdl_assimilate 17 {' '.join(paths)}", e)
    assert p.returncode == 3, (p.returncode, p.stderr)  # transient: BOINC calls again later
    assert "No space left on device" in p.stderr and "no unit was charged" in p.stderr
    assert u not in store.failed() and not store.rejections(10) and not store.assimilated()
    filler.unlink()
    p = run_script(project.root, f"../bin/bdl_assimilate 17 {' '.join(paths)}", e)
    assert p.returncode == 0, p.stderr
    assert list(store.assimilated()) == [u] and not store.failed()
