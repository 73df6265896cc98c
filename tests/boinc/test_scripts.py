"""The validator and assimilator scripts run as BOINC's daemons run them: through the
shims in bin/, via system() from tmp_<host>, on real result files in the upload
hierarchy, against a real Redis. All argument forms of releases 1.2 and 1.6."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from boinc_dl.server.assimilator.connection import connect
from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.backends.boinc.intake import result_name_of, split_results, wu_name_of_result
from boinc_dl.server.backends.boinc.registry import UNRESOLVED_KEY
from boinc_dl.server.backends.boinc.scripts import parse_call
from tests.boinc.conftest import make_result, run_script, tiny_fp, unit

N = tiny_fp().n_params


# ---- argument forms --------------------------------------------------------------------------

def test_parse_single_token_defaults() -> None:
    c = parse_call(["17", "/u/a/x_0_r1_0", "/u/b/x_0_r1_1"])  # script_assimilator: wu_id files
    assert (c.wu_id, c.files) == (17, ["/u/a/x_0_r1_0", "/u/b/x_0_r1_1"])
    c = parse_call(["/u/a/x_0_r1_0", "/u/b/x_0_r1_1"])  # init script: files
    assert c.files == ["/u/a/x_0_r1_0", "/u/b/x_0_r1_1"] and c.wu_id is None


def test_parse_all_tokens_guessed_and_declared() -> None:
    argv = ["job__m0_e0001_s0002", "17", "/u/a/r_0", "weights_out.h5", "/u/b/r_1", "metrics.json",
            "33", "12.500000", "4"]
    c = parse_call(argv)
    assert c.wu_name == "job__m0_e0001_s0002" and c.wu_id == 17 and c.result_id == 33
    assert c.runtime == 12.5 and c.batch_id == 4
    assert c.files == ["/u/a/r_0", "/u/b/r_1"]
    assert c.logical == {"/u/a/r_0": "weights_out.h5", "/u/b/r_1": "metrics.json"}
    d = parse_call(argv, ["wu_name", "wu_id", "files2", "result_id", "runtime", "batch_id"])
    assert (d.wu_name, d.wu_id, d.result_id, d.runtime, d.batch_id) == (c.wu_name, 17, 33, 12.5, 4)
    assert d.files == c.files and d.logical == c.logical
    e = parse_call(["/a/r_0", "/a/r_1", "5", "7"], ["files", "batch_id", "wu_id"])
    assert (e.files, e.batch_id, e.wu_id) == (["/a/r_0", "/a/r_1"], 5, 7)
    with pytest.raises(ValueError):
        parse_call(["x"], ["nonsense"])


def test_parse_error_calls() -> None:
    c = parse_call(["--error", "16", "job__m0_e0001_s0002", "17", "0"])  # 1.6: mask wu_name wu_id batch
    assert (c.error_mask, c.wu_name, c.wu_id, c.batch_id) == (16, "job__m0_e0001_s0002", 17, 0)
    c = parse_call(["--error", "8", "17"])  # 1.2: mask wu_id
    assert (c.error_mask, c.wu_name, c.wu_id) == (8, None, 17)
    with pytest.raises(ValueError):
        parse_call(["--error", "x"])


def test_names() -> None:
    assert result_name_of("/u/3f/job__m0_e0001_s0002_1_r1804289383_0") == "job__m0_e0001_s0002_1"
    assert wu_name_of_result("job__m0_e0001_s0002_1") == "job__m0_e0001_s0002"
    assert split_results(["/a/r_0_r1_0", "/a/r_0_r1_1", "/b/r_1_r2_0", "/b/r_1_r2_1"]) == [
        ["/a/r_0_r1_0", "/a/r_0_r1_1"], ["/b/r_1_r2_0", "/b/r_1_r2_1"]]


# ---- assimilator ------------------------------------------------------------------------------

def test_assimilate_default_form_then_duplicate(env) -> None:
    project, store, spec, e = env
    u = unit(spec, 0)
    paths = make_result(project.upload_dir, f"{u}_0", spec.name, u, np.ones(N), upload=project)
    assert all(p.startswith(str(project.upload_dir) + "/") for p in paths)
    p = run_script(project.root, f"../bin/bdl_assimilate 17 {' '.join(paths)}", e)
    assert p.returncode == 0, p.stderr
    w, v = store.get_weights("0")
    assert v == 1 and np.allclose(w, 0.5)  # alpha 0.5: 0.5*0 + 0.5*1
    kept = project.job_dir(spec.name) / "results" / u / "metrics.json"
    assert json.loads(kept.read_text())["unit"] == u
    assert not (project.job_dir(spec.name) / "results" / u / "weights_out.h5").exists()
    # BOINC re-runs the script (crash before its DB update): no second merge
    p = run_script(project.root, f"../bin/bdl_assimilate 17 {' '.join(paths)}", e)
    assert p.returncode == 0, p.stderr
    assert store.version("0") == 1 and store.is_assimilated(u)
    # the file deleter removes the uploads right after: nothing of ours depended on them
    for q in paths:
        Path(q).unlink()
    assert kept.exists()
    assert list((project.boincdl_dir / "spool").iterdir()) == []


def test_assimilate_multi_token_and_files2_forms(env) -> None:
    project, store, spec, e = env
    u1, u2 = unit(spec, 1), unit(spec, 2)
    p1 = make_result(project.upload_dir, f"{u1}_0", spec.name, u1, np.ones(N), upload=project)
    p = run_script(project.root, f"../bin/bdl_assimilate {u1} 21 {' '.join(p1)} 99 3.250000 0", e)
    assert p.returncode == 0, p.stderr
    p2 = make_result(project.upload_dir, f"{u2}_1", spec.name, u2, np.ones(N), upload=project)
    p = run_script(project.root, f"../bin/bdl_assimilate {p2[0]} weights_out.h5 {p2[1]} metrics.json", e)
    assert p.returncode == 0, p.stderr
    assert store.is_assimilated(u1) and store.is_assimilated(u2) and store.version("0") == 2


def test_assimilate_gzipped_upload(env) -> None:
    project, store, spec, e = env
    u = unit(spec, 3)
    paths = make_result(project.upload_dir, f"{u}_0", spec.name, u, np.ones(N), upload=project, gz=True)
    p = run_script(project.root, f"../bin/bdl_assimilate 5 {' '.join(paths)}", e)
    assert p.returncode == 0, p.stderr
    assert store.is_assimilated(u)


def test_error_call_release_16(env) -> None:
    project, store, spec, e = env
    u = unit(spec, 0)
    p = run_script(project.root, f"../bin/bdl_assimilate --error 8 {u} 17 0", e)
    assert p.returncode == 0, p.stderr
    assert "too many total results" in store.failed()[u]
    assert store.epoch_counts(1)["failed"] == 1
    p = run_script(project.root, f"../bin/bdl_assimilate --error 8 {u} 17 0", e)  # again: counted once
    assert p.returncode == 0 and store.epoch_counts(1)["failed"] == 1


def test_error_call_cancelled_by_us(env) -> None:
    project, store, spec, e = env
    u = unit(spec, 1)
    store.transition_unit(u, "created", "cancelled")
    p = run_script(project.root, f"../bin/bdl_assimilate --error 16 {u} 18 0", e)
    assert p.returncode == 0, p.stderr
    assert u not in store.failed()


def test_error_call_release_12_with_db_lookup(env, mariadb_name) -> None:
    """Release 1.2 passes only the workunit's id: its name comes from BOINC's database,
    read with config.xml's credentials."""
    from tests.boinc import fake_server
    from tests.boinc.conftest import use_mariadb

    project, store, spec, e = env
    u = unit(spec, 2)
    use_mariadb(project, mariadb_name)
    fake_server._exec(project, "INSERT INTO workunit (id, create_time, name, delay_bound) VALUES (42, 0, %s, 90)",
                      (u,))
    p = run_script(project.root, "../bin/bdl_assimilate --error 2 42", e)
    assert p.returncode == 0, p.stderr
    assert "too many error results" in store.failed()[u]


def test_error_call_release_12_unresolved(env, redis_server) -> None:
    project, store, spec, e = env
    e2 = dict(e, PATH="/usr/bin/nonexistent:/bin")
    py = sys.executable
    shim = (project.root / "bin" / "bdl_assimilate").read_text()
    assert py in shim
    p = run_script(project.root, "../bin/bdl_assimilate --error 2 43", e2)
    assert p.returncode == 0, p.stderr
    r = connect(redis_server.url)
    assert json.loads(r.hget(UNRESOLVED_KEY, "43"))["mask"] == 2


def test_redis_down_is_transient(env, redis_server) -> None:
    project, store, spec, e = env
    u = unit(spec, 0)
    paths = make_result(project.upload_dir, f"{u}_0", spec.name, u, np.ones(N), upload=project)
    redis_server.kill()
    p = run_script(project.root, f"../bin/bdl_assimilate 17 {' '.join(paths)}", e)
    assert p.returncode != 0  # script_assimilator exits; the unit is handed over again later
    assert "transient" in p.stderr
    p = run_script(project.root, f"../bin/bdl_assimilate --error 8 {u} 17 0", e)
    assert p.returncode != 0


def test_no_arguments_is_a_config_error(env) -> None:
    project, store, spec, e = env
    # what a 1.6.x daemon passes when declared with a multi-token --script
    p = run_script(project.root, "../bin/bdl_assimilate", e)
    assert p.returncode == 2 and "single token" in p.stderr
    p = run_script(project.root, "../bin/bdl_validate", e)
    assert p.returncode == 3


def test_missing_files_and_missing_directory(env) -> None:
    project, store, spec, e = env
    u = unit(spec, 1)
    paths = make_result(project.upload_dir, f"{u}_0", spec.name, u, np.ones(N), upload=project)
    Path(paths[0]).unlink()
    p = run_script(project.root, f"../bin/bdl_assimilate 17 {' '.join(paths)}", e)
    assert p.returncode == 0, p.stderr
    assert "missing" in store.failed()[u]
    u2 = unit(spec, 2)
    ghost = [str(project.upload_dir / "zzz" / f"{u2}_0_r1_0"), str(project.upload_dir / "zzz" / f"{u2}_0_r1_1")]
    p = run_script(project.root, f"../bin/bdl_assimilate 18 {' '.join(ghost)}", e)
    assert p.returncode == 3  # like BOINC's ERR_OPENDIR: an unmounted upload dir is transient
    assert u2 not in store.failed()


def test_rejected_at_assimilation_gives_the_unit_up(env) -> None:
    project, store, spec, e = env
    u = unit(spec, 3)
    paths = make_result(project.upload_dir, f"{u}_0", spec.name, u, np.full(N, np.nan), upload=project)
    p = run_script(project.root, f"../bin/bdl_assimilate 17 {' '.join(paths)}", e)
    assert p.returncode == 0, p.stderr
    assert store.version("0") == 0
    assert "NaN" in store.failed()[u]
    assert store.rejections()[0]["unit"] == u
    # nothing of a rejected upload stays on the server (keep_weights is off)
    assert not (project.job_dir(spec.name) / "results" / u).exists()
    assert list((project.boincdl_dir / "spool").iterdir()) == []


def test_unknown_job_is_ignored(env) -> None:
    project, store, spec, e = env
    paths = make_result(project.upload_dir, "other__m0_e0001_s0000_0", "other", "other__m0_e0001_s0000",
                        np.ones(N), upload=project)
    p = run_script(project.root, f"../bin/bdl_assimilate 17 {' '.join(paths)}", e)
    assert p.returncode == 0, p.stderr


# ---- validator --------------------------------------------------------------------------------

def test_validate_init(env) -> None:
    project, store, spec, e = env
    u = unit(spec, 0)
    good = make_result(project.upload_dir, f"{u}_0", spec.name, u, np.ones(N), upload=project)
    p = run_script(project.root, f"../bin/bdl_validate {' '.join(good)}", e)
    assert p.returncode == 0, p.stderr
    bad = make_result(project.upload_dir, f"{u}_1", spec.name, u, np.full(N, np.inf), upload=project)
    p = run_script(project.root, f"../bin/bdl_validate {' '.join(bad)}", e)
    assert p.returncode == 1
    assert store.rejections()[0]["result"] == f"{u}_1"
    trunc = make_result(project.upload_dir, f"{u}_2", spec.name, u, np.ones(N), upload=project)
    Path(trunc[0]).write_bytes(Path(trunc[0]).read_bytes()[:100])
    p = run_script(project.root, f"../bin/bdl_validate {' '.join(trunc)}", e)
    assert p.returncode == 1
    stranger = make_result(project.upload_dir, f"{spec.name}__m0_e0009_s0000_0", spec.name,
                           f"{spec.name}__m0_e0009_s0000", np.ones(N), upload=project)
    p = run_script(project.root, f"../bin/bdl_validate {' '.join(stranger)}", e)
    assert p.returncode == 1  # unknown unit
    # with result_id and runtime tokens (declared where multi-token strings work)
    p = run_script(project.root, f"../bin/bdl_validate {' '.join(good)} 123 4.500000", e)
    assert p.returncode == 0, p.stderr


def test_validate_update_norm_bound(env, redis_server) -> None:
    project, store, spec, e = env
    spec2 = spec.model_copy(update={"validation": spec.validation.model_copy(update={"max_update_norm": 1.0})})
    store.r.set(store.k("spec"), spec2.model_dump_json())
    u = unit(spec, 0)
    far = make_result(project.upload_dir, f"{u}_0", spec.name, u, np.full(N, 10.0), upload=project)
    p = run_script(project.root, f"../bin/bdl_validate {' '.join(far)}", e)
    assert p.returncode == 1
    assert "exceeds max_update_norm" in store.rejections()[0]["reason"]


def test_validate_redis_down_is_transient(env, redis_server) -> None:
    project, store, spec, e = env
    (project.settings_file).write_text(project.settings_file.read_text() + "validator_redis_wait_s: 0\n")
    u = unit(spec, 0)
    good = make_result(project.upload_dir, f"{u}_0", spec.name, u, np.ones(N), upload=project)
    redis_server.kill()
    p = run_script(project.root, f"../bin/bdl_validate {' '.join(good)}", e)
    assert p.returncode == 3, p.stderr  # VAL_RESULT_TRANSIENT_ERROR


def test_validate_compare(env) -> None:
    project, store, spec, e = env
    u = unit(spec, 0)
    w0 = np.zeros(N)
    wi = project.job_dir(spec.name) / "files" / "w0.h5"
    wi.parent.mkdir(parents=True, exist_ok=True)
    from boinc_dl.server.common.weights import WeightsFile, write_weights

    write_weights(wi, WeightsFile(w0.astype(np.float32), tiny_fp(), job=spec.name))
    info = store.unit_info(u)
    store.r.hset(store.k("units"), u, json.dumps({**info, "files": {"weights_in.h5": str(wi)}}))
    rng = np.random.default_rng(0)
    update = rng.normal(size=N)
    a = make_result(project.upload_dir, f"{u}_0", spec.name, u, w0 + update, upload=project)
    b = make_result(project.upload_dir, f"{u}_1", spec.name, u, w0 + update * 1.05, upload=project)
    lazy = make_result(project.upload_dir, f"{u}_2", spec.name, u, w0, upload=project)
    p = run_script(project.root, f"../bin/bdl_compare {' '.join(a)} {' '.join(b)}", e)
    assert p.returncode == 0, p.stderr
    p = run_script(project.root, f"../bin/bdl_compare {' '.join(a)} {' '.join(lazy)}", e)
    assert p.returncode == 1, p.stderr  # a host that skipped training does not match
    other = make_result(project.upload_dir, f"{unit(spec, 1)}_0", spec.name, unit(spec, 1), w0 + update,
                        upload=project)
    p = run_script(project.root, f"../bin/bdl_compare {' '.join(a)} {' '.join(other)}", e)
    assert p.returncode == 1


def test_store_is_untouched_by_validation(env) -> None:
    project, store, spec, e = env
    u = unit(spec, 0)
    good = make_result(project.upload_dir, f"{u}_0", spec.name, u, np.ones(N), upload=project)
    run_script(project.root, f"../bin/bdl_validate {' '.join(good)}", e)
    assert store.version("0") == 0 and not store.is_assimilated(u)
    assert isinstance(store, JobStore)
