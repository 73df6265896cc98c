"""``boinc-dl plan SPEC --project DIR``: a BOINC job calibrates the plan from its own records.

The job's units are merged by the assimilator script's entry point with BOINC's arguments
(the merge records in Redis carry the app's own durations); BOINC's result table, in a real
MariaDB, gets the rows BOINC's scheduler and the hosts' reports would write (sent,
received, elapsed and CPU time, per host, replicas, a regenerated unit with a late
original, failed results, rows no host could have produced). The installed ``boinc-dl``
plans a fleet from them; the numbers it prints are checked against the rows, computed
here on their own.
"""

from __future__ import annotations

import json
import re
import socket
import statistics
import time
from pathlib import Path

import numpy as np
import pytest

from tests.boinc import fake_server
from tests.boinc.conftest import make_result, unit
from tests.support.cli import boinc_dl

N = 15  # the tiny job's parameters

SPEC = """\
name: tiny
model: models:mlp
dataset: {name: digits}
training: {epochs: 2}
vcasgd: {n_subsets: 4, alpha: 0.5, merge_rule: paper}
units: {timeout_s: 90, max_error_results: 3, max_total_results: 6}
"""

FLEET = """\
types:
  c6i.xlarge: {speed: 1.0, cores: 4, max_count: 2, preempt_p: 0.0}
markets: [on-demand]
slots: [1]
assimilators: [1]
params: 15
"""

#: The app's own clocks per unit (its metrics file): wall time, and CPU outside training 0.3 s.
WALL = [2.0, 2.5, 3.0, 3.5]


def _merge_units(project, spec) -> None:
    """Each unit's result merged by the assimilator script's own entry point, with BOINC's
    arguments (in this process: the script as BOINC runs it is tested in
    test_scripts.py and test_end_to_end.py; here only its records matter)."""
    from boinc_dl.server.backends.boinc.project import BoincProject
    from boinc_dl.server.backends.boinc.scripts import EXIT_OK, assimilate

    for i, wall in enumerate(WALL):
        u = unit(spec, i)
        res = f"{u}_r1_0" if i == 2 else f"{u}_0"  # subset 2 merged from its regenerated workunit
        paths = make_result(project.upload_dir, res, spec.name, u, np.full(N, i + 1.0), upload=project)
        Path(paths[1]).write_text(json.dumps({
            "job": spec.name, "unit": u, "val_acc": 0.5, "train_loss": 1.0, "host": f"h{i}",
            "wall_s": wall, "train_s": wall - 0.5, "train_cpu_s": wall - 0.5, "cpu_s": wall - 0.2}))
        wu_id = 17 + i
        assert assimilate(BoincProject(project.root), [str(wu_id), *map(str, paths)]) == EXIT_OK


def _create(project, wu: str, n: int = 1) -> None:
    """A workunit and its ``n`` unsent results, as create_work inserts them."""
    fake_server._exec(project, "INSERT INTO workunit (create_time, name, delay_bound) VALUES (%s, %s, 90)",
                      (int(time.time()), wu))
    wid = fake_server.rows(project, "SELECT id FROM workunit WHERE name = %s", (wu,))[0]["id"]
    for k in range(n):
        fake_server._exec(project, "INSERT INTO result (create_time, workunitid, server_state, name) "
                                   "VALUES (%s, %s, 2, %s)", (int(time.time()), wid, f"{wu}_{k}"))


def _run(project, wu: str, host: int, sent: int, received: int, elapsed: float, cpu: float,
         success: bool = True, valid: bool = True) -> str:
    """A host is sent ``wu``'s next result, runs it and reports it; the validator judges it."""
    (name,) = fake_server.send(project, [wu], hostid=host, now=sent)
    fake_server.report(project, name, success=success, now=received, elapsed_s=elapsed, cpu_s=cpu)
    if success and valid:
        fake_server.validate(project, name)
    return name


@pytest.fixture
def boinc_job(env, db_project, tmp_path):
    """(project, spec dir, expected numbers): the tiny job merged, and BOINC's rows of it."""
    project, store, spec, e = env
    _merge_units(project, spec)
    assert [m["wall_s"] for m in store.metrics("merge")] == WALL
    t0 = int(time.time()) - 3600  # all sent and received before the merges above
    u = [unit(spec, i) for i in range(4)]
    for w in u:
        _create(project, w, 2 if w == u[1] else 1)
    _create(project, f"{u[2]}_r1")
    _create(project, "tiny__m0_e0002_s0000")  # a later epoch's unit, not merged yet
    _create(project, "tiny___m0_e0001_s0000")  # job "tiny_": its names start with "tiny__" too
    # (host, sent, received, elapsed, cpu) of every believable successful result
    good = {
        "s0": (11, t0, t0 + 10, 2.6, 2.2),
        "s1a": (11, t0 + 10, t0 + 24, 3.4, 3.0),  # the canonical replica (validated first)
        "s1b": (12, t0 + 11, t0 + 30, 3.0, 2.9),
        "s2r1": (12, t0 + 40, t0 + 47, 3.3, 3.1),  # the regenerated unit's result: merged
        "s3": (11, t0 + 50, t0 + 58, 4.0, 3.6),
        "e2": (12, t0 + 60, t0 + 75, 5.0, 4.0),
    }
    _run(project, u[0], *good["s0"])
    _run(project, u[1], *good["s1a"])
    _run(project, u[1], *good["s1b"])
    _run(project, u[2], 12, t0 + 20, t0 + 30, 0.0, 0.0, success=False)  # the original: an error
    _run(project, f"{u[2]}_r1", *good["s2r1"])
    _run(project, u[3], *good["s3"])
    _run(project, "tiny__m0_e0002_s0000", *good["e2"])
    # A late result of subset 2's original workunit (BOINC's re-issue of the failed one),
    # received after its unit was merged: BOINC accepts it, and it becomes that
    # workunit's canonical result, but it is not what the merge used.
    late = int(time.time()) + 600
    good["s2late"] = (13, late - 30, late, 9.0, 8.0)
    fake_server._exec(project, "INSERT INTO result (create_time, workunitid, server_state, name) "
                               "SELECT %s, id, 2, %s FROM workunit WHERE name = %s", (t0, f"{u[2]}_1", u[2]))
    _run(project, u[2], *good["s2late"])
    # Rows no host could have produced, each ignored and counted.
    hostile = [(14, t0, t0 + 10, -5.0, 1.0), (14, t0, t0 + 10, 1e300, 1.0),
               (14, t0 + 10, t0, 2.0, 1.0), (14, t0, t0 + 20, 500.0, 1.0)]
    for k, h in enumerate(hostile):
        _create(project, f"tiny__m0_e0002_s{k + 1:04d}")
        _run(project, f"tiny__m0_e0002_s{k + 1:04d}", *h)
    _create(project, "tiny__m0_e0002_s0009")
    _run(project, "tiny__m0_e0002_s0009", 12, t0 + 80, t0 + 90, 4.5, 1e300)  # only its CPU time absurd
    good["cpu_absurd"] = (12, t0 + 80, t0 + 90, 4.5, None)
    _run(project, "tiny___m0_e0001_s0000", 15, t0, t0 + 100, 50.0, 50.0)  # another job's
    (tmp_path / "spec.yaml").write_text(SPEC)
    (tmp_path / "models.py").write_text((Path(__file__).resolve().parents[2] / "examples" / "models.py").read_text())
    (tmp_path / "fleet.yaml").write_text(FLEET)
    overhead = [2.6 - 2.0, 3.4 - 2.5, 3.3 - 3.0, 4.0 - 3.5]  # elapsed of the merged result - the app's wall
    per_host: dict[int, list[tuple[float, float]]] = {}
    for host, sent, received, elapsed, _ in good.values():
        per_host.setdefault(host, []).append((elapsed, received - sent - elapsed))
    expect = {
        "results": len(good), "failed": 1, "ignored": len(hostile) + 1, "hosts": len(per_host),
        "elapsed": statistics.median(v[3] for v in good.values()),
        "cpu": statistics.median(v[4] for v in good.values() if v[4] is not None),
        "network": statistics.median(v[2] - v[1] - v[3] for v in good.values()),
        "overhead": statistics.median(overhead), "paired": len(overhead),
        "app_overhead": 0.3,  # cpu_s - train_cpu_s of every unit
        "per_host": {h: (len(v), statistics.median(x[0] for x in v), statistics.median(x[1] for x in v))
                     for h, v in per_host.items()},
    }
    return project, tmp_path, expect


def _number(pattern: str, text: str) -> float:
    m = re.search(pattern, text)
    assert m, (pattern, text)
    return float(m.group(1))


def test_plan_calibrates_from_boinc_result_table(boinc_job):
    project, work, ex = boinc_job
    out = boinc_dl("plan", "spec.yaml", "--fleet", "fleet.yaml", "--deadline", "8h", "--project", str(project.root),
                   cwd=work, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    text = " ".join(out.stdout.split())
    # Where each part came from.
    assert "calibration: 4 merged units of job tiny's merge records in the project's Redis" in text, text
    assert "BOINC's result table (" in text
    assert _number(r"(\d+) successful results of job tiny's workunits", text) == ex["results"]
    assert _number(r"\((\d+) failed, \d+ hosts\)", text) == ex["failed"]
    assert _number(r"failed, (\d+) hosts\)", text) == ex["hosts"]
    assert _number(r"elapsed (\d+\.\d+) s, CPU", text) == pytest.approx(ex["elapsed"], abs=5e-4)
    assert _number(r"CPU (\d+\.\d+) s \(medians\)", text) == pytest.approx(ex["cpu"], abs=5e-4)
    assert _number(r"host-side overhead (\d+\.\d+) s per unit", text) == pytest.approx(ex["overhead"], abs=5e-4)
    assert _number(r"own wall time, (\d+) merged units", text) == ex["paired"]
    assert _number(r"network and queue (\d+\.\d+) s per unit", text) == pytest.approx(ex["network"], abs=5e-4)
    assert _number(r"ignored (\d+) rows", text) == ex["ignored"]
    assert "1 elapsed_time longer than its turnaround" in text and "1 sent/received times" in text
    assert "2 elapsed_time missing, negative or absurd" in text and "1 cpu_time absurd" in text
    # Per host, each line against the rows.
    for host, (n, elapsed, network) in ex["per_host"].items():
        m = re.search(rf"│\s*{host}\s*│\s*(\d+)\s*│\s*(\d+\.\d+) s\s*│\s*(\S+)[^│]*│\s*(\d+\.\d+) s", out.stdout)
        assert m, (host, out.stdout)
        assert int(m.group(1)) == n
        assert float(m.group(2)) == pytest.approx(elapsed, abs=5e-4)
        assert float(m.group(4)) == pytest.approx(network, abs=5e-4)
    assert "host 15" not in text and "│ 15 " not in out.stdout  # job "tiny_"'s host is not this job's
    # The plan uses them: staging = the app's time outside training + BOINC's host side,
    # dispatch = the network and queue time.
    staging = _number(r"staging (\d+\.\d+) s per unit", text)
    assert staging == pytest.approx(ex["app_overhead"] + ex["overhead"], abs=2e-3)
    assert _number(r"dispatch (\d+\.\d+) s per unit \(BOINC's network and queue", text) == \
        pytest.approx(ex["network"], abs=5e-4)
    assert "recommended (*)" in text


def test_calibrate_takes_the_project_directory_too(boinc_job):
    project, work, ex = boinc_job
    out = boinc_dl("plan", "spec.yaml", "--fleet", "fleet.yaml", "--deadline", "8h", "--calibrate",
                   str(project.root), cwd=work, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    text = " ".join(out.stdout.split())
    assert _number(r"host-side overhead (\d+\.\d+) s per unit", text) == pytest.approx(ex["overhead"], abs=5e-4)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_database_is_a_clear_error(boinc_job):
    project, work, _ = boinc_job
    text = project.config_xml.read_text()
    project.config_xml.write_text(re.sub(r"<db_port>\d+</db_port>", f"<db_port>{_closed_port()}</db_port>", text))
    out = boinc_dl("plan", "spec.yaml", "--fleet", "fleet.yaml", "--deadline", "8h", "--project", str(project.root),
                   cwd=work, timeout=300)
    assert out.returncode == 3, out.stdout + out.stderr
    assert "cannot read BOINC's database" in out.stderr and "Traceback" not in out.stderr


def test_no_rows_for_the_job_is_a_clear_error(boinc_job):
    project, work, _ = boinc_job
    fake_server._exec(project, "DELETE FROM result WHERE name LIKE 'tiny\\_\\_%%'")
    out = boinc_dl("plan", "spec.yaml", "--fleet", "fleet.yaml", "--deadline", "8h", "--project", str(project.root),
                   cwd=work, timeout=300)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "no successful result of job 'tiny'" in " ".join(out.stderr.split()) and "Traceback" not in out.stderr


def test_only_unbelievable_rows_is_a_clear_error_with_counts(boinc_job):
    project, work, _ = boinc_job
    fake_server._exec(project, "UPDATE result SET elapsed_time = -1 WHERE name LIKE 'tiny\\_\\_%%'")
    out = boinc_dl("plan", "spec.yaml", "--fleet", "fleet.yaml", "--deadline", "8h", "--project", str(project.root),
                   cwd=work, timeout=300)
    assert out.returncode == 2, out.stdout + out.stderr
    err = " ".join(out.stderr.split())
    assert "no successful result of job 'tiny' with believable times" in err
    assert re.search(r"\d+ ignored: \d+ elapsed_time missing, negative or absurd", err), err


def test_unknown_job_is_a_clear_error(boinc_job):
    project, work, _ = boinc_job
    out = boinc_dl("plan", "spec.yaml", "--fleet", "fleet.yaml", "--deadline", "8h", "--project", str(project.root),
                   "--job", "nope", cwd=work, timeout=300)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "nope" in out.stderr and "Traceback" not in out.stderr


def test_units_csv_beside_the_project_gives_the_merge_records(boinc_job, env):
    """``--calibrate units.csv --project DIR``: the per-unit rows from the file (a job's
    history written the way a run writes it), BOINC's rows from the project."""
    from boinc_dl.server.run.outputs import collect_history, write_history

    project, work, ex = boinc_job
    _, store, _, _ = env
    write_history(work / "hist", collect_history(store))
    out = boinc_dl("plan", "spec.yaml", "--fleet", "fleet.yaml", "--deadline", "8h", "--project", str(project.root),
                   "--calibrate", "hist/units.csv", cwd=work, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    text = " ".join(out.stdout.split())
    assert "calibration: 4 merged units of hist/units.csv" in text, text
    assert _number(r"host-side overhead (\d+\.\d+) s per unit", text) == pytest.approx(ex["overhead"], abs=5e-4)


def test_local_plan_says_where_boinc_times_go(boinc_job):
    """Without --fleet the plan is the local backend's: the merge records calibrate it,
    and BOINC's host side is reported but not used (no wrapper, no network here)."""
    project, work, ex = boinc_job
    out = boinc_dl("plan", "spec.yaml", "--project", str(project.root), cwd=work, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    text = " ".join(out.stdout.split())
    assert "local backend on this machine" in text
    assert _number(r"host-side overhead (\d+\.\d+) s per unit", text) == pytest.approx(ex["overhead"], abs=5e-4)
    assert "BOINC's host-side times go into a fleet plan (--fleet)" in text
