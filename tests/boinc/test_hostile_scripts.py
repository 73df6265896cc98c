"""Hostile results through BOINC's scripts, run as the daemons run them (shims in bin/,
system() from tmp_<host>, real upload hierarchy, real Redis): identity comes from
BOINC's names, nothing a host wrote picks a path, uploads are bounded."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from boinc_dl.server.backends.boinc.intake import copy_result
from boinc_dl.server.common.errors import ResultRejected
from tests.boinc.conftest import make_result, run_script, tiny_fp, unit
from tests.hostile_corpus import gzip_bomb

N = tiny_fp().n_params


def _files_named(root: Path, needle: str) -> list[Path]:
    return [p for p in root.rglob("*") if needle in p.name]


@pytest.mark.parametrize("embedded", ["../../../../escaped", "../escaped", "/tmp/escaped-abs"])
def test_traversal_unit_in_the_file_writes_nothing_outside(env, tmp_path: Path, embedded: str) -> None:
    """The hole: a unit id read from the file built a path before it was checked."""
    project, store, spec, e = env
    u = unit(spec, 0)
    paths = make_result(project.upload_dir, f"{u}_0", spec.name, embedded, np.ones(N), upload=project)
    p = run_script(project.root, f"../bin/bdl_assimilate 17 {' '.join(paths)}", e)
    assert p.returncode == 0, p.stderr
    rej = store.rejections(1)[0]
    assert rej["unit"] == u and "embeds unit" in rej["reason"]  # recorded against BOINC's unit
    assert store.version("0") == 0
    assert not _files_named(tmp_path, "escaped") and not Path("/tmp/escaped-abs").exists()
    assert not (project.job_dir(spec.name) / "results").exists()  # nothing of a rejected upload is kept


def test_result_for_another_unit_is_never_merged_into_it(env) -> None:
    project, store, spec, e = env
    u0, u1 = unit(spec, 0), unit(spec, 1)
    # uploaded for u0 (BOINC's name), claims u1 inside: neither unit is merged
    paths = make_result(project.upload_dir, f"{u0}_0", spec.name, u1, np.ones(N), upload=project)
    assert run_script(project.root, f"../bin/bdl_validate {' '.join(paths)}", e).returncode == 1
    p = run_script(project.root, f"../bin/bdl_assimilate 17 {' '.join(paths)}", e)
    assert p.returncode == 0, p.stderr
    assert store.version("0") == 0 and not store.assimilated()
    assert u0 in store.failed()  # BOINC considers u0 done: given up, so its epoch can close
    assert u1 not in store.failed()
    # the honest result of u1 still merges
    good = make_result(project.upload_dir, f"{u1}_0", spec.name, u1, np.ones(N), upload=project)
    assert run_script(project.root, f"../bin/bdl_assimilate 18 {' '.join(good)}", e).returncode == 0
    assert list(store.assimilated()) == [u1]


def test_unsafe_workunit_names_are_ignored(env, tmp_path: Path) -> None:
    project, store, spec, e = env
    for i, wu in enumerate(["..__m0_e0001_s0000", ".hidden__m0_e0001_s0000"]):
        d = tmp_path / f"up{i}"
        paths = make_result(d, f"{wu}_0", spec.name, unit(spec, 0), np.ones(N))
        p = run_script(project.root, f"../bin/bdl_assimilate 17 {' '.join(paths)}", e)
        assert p.returncode == 0, p.stderr
        assert "names no boinc-dl workunit" in p.stderr
        assert run_script(project.root, f"../bin/bdl_validate {' '.join(paths)}", e).returncode == 1
    assert store.version("0") == 0 and not store.rejections()


def test_compare_needs_both_replicas_to_be_the_issued_unit(env) -> None:
    project, store, spec, e = env
    u0, u1 = unit(spec, 0), unit(spec, 1)
    a = make_result(project.upload_dir, f"{u0}_0", spec.name, u0, np.ones(N), upload=project)
    b = make_result(project.upload_dir, f"{u0}_1", spec.name, u1, np.ones(N), upload=project)
    assert run_script(project.root, f"../bin/bdl_compare {' '.join(a + b)}", e).returncode == 1
    c = make_result(project.upload_dir, f"{u0}_2", spec.name, u0, np.ones(N), upload=project)
    assert run_script(project.root, f"../bin/bdl_compare {' '.join(a + c)}", e).returncode == 0


def test_gzip_bomb_upload_is_bounded(tmp_path: Path) -> None:
    bomb = gzip_bomb(tmp_path / "job__m0_e0001_s0000_0_r1_0", 64 << 20)
    with pytest.raises(ResultRejected, match="upload bound"):
        copy_result([str(bomb)], tmp_path / "copies", max_bytes=1 << 20)
    assert (tmp_path / "copies" / bomb.name).stat().st_size <= 1 << 20
    assert len(copy_result([str(bomb)], tmp_path / "ok", max_bytes=64 << 20)) == 1


def test_gzipped_hostile_weights_rejected_by_the_assimilator(env) -> None:
    project, store, spec, e = env
    u = unit(spec, 2)
    paths = make_result(project.upload_dir, f"{u}_0", "other-job", u, np.ones(N), upload=project, gz=True)
    assert run_script(project.root, f"../bin/bdl_assimilate 17 {' '.join(paths)}", e).returncode == 0
    assert "embeds job 'other-job'" in store.rejections(1)[0]["reason"]
    assert store.version("0") == 0


def test_symlinked_upload_is_refused(env, tmp_path: Path) -> None:
    project, store, spec, e = env
    u = unit(spec, 3)
    paths = make_result(project.upload_dir, f"{u}_0", spec.name, u, np.ones(N), upload=project)
    secret = project.root / "boinc-dl.yaml"
    Path(paths[0]).unlink()
    Path(paths[0]).symlink_to(secret)
    assert run_script(project.root, f"../bin/bdl_validate {' '.join(paths)}", e).returncode == 1
    assert "symbolic link" in store.rejections(1)[0]["reason"]
