"""Rejection cost of hostile results vs validating an honest one, same model, same run.

Every attack of tests/hostile_corpus.py (external storage and links, virtual datasets,
filters, 2e9 declared values, wrong dtypes, user blocks, variable-length attributes and
a 4 GB length lie, nested and wide groups, ...) plus the classes of issue #28 at full
size (a 400 MB variable-length ``format`` and ``metrics`` attribute, a global heap
collection of 400 MB, groups nested 20 000 deep, 100 000 sibling groups) is built for
a model, then handed to the validator (``validate_result``, what BOINC's
validator and the local backend's assimilators call) in a fresh subprocess, which
reports the wall time (median of three), the peak of Python/numpy allocations
(tracemalloc) and the growth of its maximum resident set (``VmHWM`` after a reset of
the high-water mark: HDF5's C allocations included). Files are checked against an upload
bound of 512 MiB (the old default: the worst case, nothing refused for its size alone);
the bound now derived from the model is printed beside it, with which of the large
classes it refuses before HDF5 opens them. The baseline is the same validator on an
honest result of the same model.

Then each file goes gzip'd, as BOINC's ``<gzip_when_done/>`` uploads it, through
BOINC's assimilator intake (``assimilate_upload``: copy within the bound, validate,
record) with ``keep_weights`` off, and the bytes left on the server (project tree minus
the upload directory) are counted.

Goals: every hostile file rejected in <= 1 s with a peak <= 2x the model's size + 64 MB;
depth 20 000 and the 400 MB attribute in < 0.5 s; 0 bytes left behind.

    python bench/bench_hostile.py [--params 4972746 4810] [--quick]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import emit  # noqa: E402
from bench.bench_assimilation import resnet_like_shapes  # noqa: E402
from boinc_dl.server.assimilator.connection import connect  # noqa: E402
from boinc_dl.server.assimilator.redis_server import EmbeddedRedis  # noqa: E402
from boinc_dl.server.assimilator.store import JobStore  # noqa: E402
from boinc_dl.server.backends.boinc.intake import assimilate_upload  # noqa: E402
from boinc_dl.server.backends.boinc.project import BoincProject  # noqa: E402
from boinc_dl.server.common.spec import parse_spec  # noqa: E402
from boinc_dl.server.common.weights import Fingerprint, fingerprint_of, upload_bound  # noqa: E402
from tests.hostile_corpus import (  # noqa: E402
    ATTACKS,
    deep_groups,
    huge_heap_collection,
    valid,
    vlen_attribute,
    wide_group,
)

OLD_DEFAULT_BOUND = 512 << 20
JOB = "bench"
Builder = Callable[[Path, Fingerprint, str, str, Path], None]
# The classes of issue #28 at full size (the corpus holds them small).
CLASSES: list[tuple[str, Builder, float]] = [  # (name, builder, time goal in s)
    ("vlen-format-400mb", vlen_attribute(400 << 20), 0.5),
    ("vlen-metrics-400mb", vlen_attribute(400 << 20, "metrics"), 0.5),
    ("heap-collection-400mb", huge_heap_collection(400 << 20), 0.5),
    ("deep-groups-20000", deep_groups(20_000), 0.5),
    ("wide-group-100000", wide_group(100_000), 1.0),
]

# Runs in the subprocess: imports and the Redis connection first (the baseline RSS),
# then one timed validation, then one under tracemalloc.
PROBE = r"""
import json, sys, time, tracemalloc
from boinc_dl.server.common.errors import ResultRejected
from boinc_dl.server.assimilator.store import JobStore
from boinc_dl.server.assimilator.connection import connect
from tests.support.results import validate
url, job, unit, path, bound = sys.argv[1:6]
store = JobStore(connect(url), job)
store.fingerprint("0"); store.unit_info(unit)
def kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
def once():
    try:
        validate([path], store, int(bound), unit)
        return "valid"
    except ResultRejected as e:
        return e.reason
# Reset the resident-set high-water mark (Linux: "5" > clear_refs), so that VmHWM after
# the call is the peak *during* it, C allocations (HDF5) included.
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = kib("VmRSS")
t0 = time.perf_counter(); verdict = once(); first = time.perf_counter() - t0
rss = max(0, kib("VmHWM") - before)
times = [first]
for _ in range(2):  # the median of three: one run is at the mercy of a busy machine
    t0 = time.perf_counter(); once(); times.append(time.perf_counter() - t0)
took = sorted(times)[1]
tracemalloc.start(); once(); peak = tracemalloc.get_traced_memory()[1]; tracemalloc.stop()
print(json.dumps({"verdict": verdict, "s": took, "rss_bytes": rss * 1024, "peak_bytes": peak}))
"""


def probe(url: str, unit: str, path: Path, bound: int) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, url, JOB, unit, str(path), str(bound)],
                         capture_output=True, text=True, timeout=600, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    return json.loads(out.stdout.strip().splitlines()[-1])


def project_at(root: Path, redis_url: str) -> BoincProject:
    """A BOINC project tree with boinc-dl's settings (keep_weights off, the default)."""
    for d in ("upload", "download", "templates"):
        (root / d).mkdir(parents=True, exist_ok=True)
    (root / "config.xml").write_text("<boinc><config><upload_dir>" + str(root / "upload")
                                     + "</upload_dir><uldl_dir_fanout>1024</uldl_dir_fanout></config></boinc>\n")
    (root / "boinc-dl.yaml").write_text(f"redis_url: {redis_url}\n")
    return BoincProject(root)


def disk_left(project: BoincProject) -> int:
    """Bytes under the project tree outside the upload directory (the uploads are BOINC's)."""
    upload = project.root / "upload"
    return sum(p.stat().st_size for p in project.root.rglob("*")
               if p.is_file() and upload not in p.parents and p.name not in ("config.xml", "boinc-dl.yaml"))


def intake_leftover(project: BoincProject, store: JobStore, shard: int, weights: Path) -> tuple[int, str]:
    """Upload ``weights`` gzip'd as unit ``shard``'s result through BOINC's intake;
    (bytes left behind, outcome)."""
    wu = f"{JOB}__m0_e0001_s{shard:04d}"
    store.register_unit(wu, {"epoch": 1, "shard": shard, "model": "0"}, 1)
    up = project.root / "upload" / f"{wu}_0_r1_0"
    with weights.open("rb") as src, gzip.open(up, "wb", compresslevel=1) as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    before = disk_left(project)
    out = assimilate_upload(project, store, wu, f"{wu}_0", [str(up)])
    left = disk_left(project) - before
    up.unlink()
    return left, out.status


def model_of(n_params: int) -> Fingerprint:
    """A ResNet-like model of ``n_params`` (700 tensors), or below 100 000 parameters an
    MLP of 64 inputs, one hidden layer and 10 classes (4,810 parameters: 19 KB)."""
    if n_params < 100_000:
        h = max(1, (n_params - 10) // 75)
        shapes = [(64, h), (h,), (h, 10), (10,)]
    else:
        shapes = resnet_like_shapes(n_params)
    return fingerprint_of([f"layer{i}/w" for i in range(len(shapes))], [np.zeros(s, np.float32) for s in shapes])


def run_model(fp: Fingerprint, tmp: Path, quick: bool) -> dict:
    model_bytes = 4 * fp.n_params
    derived = upload_bound(fp)
    srv = EmbeddedRedis(tmp / "redis").start()
    rows: list[dict] = []
    try:
        spec = parse_spec({"name": JOB, "model": "m:f", "dataset": {"name": "digits"}})
        store = JobStore(connect(srv.url), JOB)
        project = project_at(tmp / "project", srv.url)
        store.create(spec.model_dump_json(), "vcasgd", {"0": fp}, {"job_dir": str(tmp / "project" / "jobs" / JOB)})
        store.init_weights("0", np.zeros(fp.n_params, np.float32))
        store.register_unit("u0", {"epoch": 1, "shard": 0, "model": "0"}, 1)
        honest_path = tmp / "honest.h5"
        valid(honest_path, fp, JOB, "u0")
        honest = probe(srv.url, "u0", honest_path, OLD_DEFAULT_BOUND)
        assert honest["verdict"] == "valid", honest
        cases = [(a.name, a.build, 1.0, "corpus") for a in ATTACKS]
        cases += [(name, build, goal, "issue") for name, build, goal in CLASSES if not quick]
        for shard, (name, build, goal, kind) in enumerate(cases, start=1):
            path = tmp / f"{name}.h5"
            for stray in tmp.glob(f"{name}.h5*"):  # a family-driver attack's members
                stray.unlink()
            t0 = time.perf_counter()
            build(path, fp, JOB, "u0", tmp / "server")
            built_s = time.perf_counter() - t0
            r = probe(srv.url, "u0", path, OLD_DEFAULT_BOUND)
            assert r["verdict"] != "valid", (name, r)
            size = path.stat().st_size
            left, status = intake_leftover(project, store, shard, path)
            rows.append({"attack": name, "kind": kind, "file_bytes": size, "goal_s": goal, "built_s": built_s,
                         "refused_by_derived_bound": size > derived, "disk_left_bytes": left,
                         "intake": status, **r})
            path.unlink()
    finally:
        srv.kill()
    mem_goal = 2 * model_bytes + (64 << 20)
    for r in rows:
        r["mem_bytes"] = max(r["peak_bytes"], r["rss_bytes"])
        r["ok"] = r["s"] <= r["goal_s"] and r["mem_bytes"] <= mem_goal and r["disk_left_bytes"] == 0
    print(f"\nmodel: {fp.n_params:,} float32 in {len(fp.tensors)} tensors ({model_bytes / 1e6:.2f} MB); "
          f"derived upload bound {derived / 1e6:.1f} MB (was {OLD_DEFAULT_BOUND >> 20} MiB); "
          f"memory goal {mem_goal / 1e6:.1f} MB")
    print(f"{'file':30s} {'size':>11s} {'ms':>7s} {'tracemalloc MB':>14s} {'RSS+ MB':>8s} {'left B':>7s} "
          f"{'bound':>5s}  verdict")
    print(f"{'honest (baseline)':30s} {honest_path.stat().st_size:11d} {honest['s'] * 1e3:7.1f} "
          f"{honest['peak_bytes'] / 1e6:14.2f} {honest['rss_bytes'] / 1e6:8.2f} {'':>7s} {'':>5s}  valid")
    for r in sorted(rows, key=lambda r: -r["s"]):
        print(f"{r['attack']:30s} {r['file_bytes']:11d} {r['s'] * 1e3:7.1f} {r['peak_bytes'] / 1e6:14.2f} "
              f"{r['rss_bytes'] / 1e6:8.2f} {r['disk_left_bytes']:7d} {'refus' if r['refused_by_derived_bound'] else '':>5s}"
              f"  {'' if r['ok'] else 'OVER GOAL '}{r['verdict'][:60]}")
    worst_t = max(rows, key=lambda r: r["s"])
    worst_m = max(rows, key=lambda r: r["mem_bytes"])
    by_name = {r["attack"]: r for r in rows}
    emit("hostile_rejection", params=fp.n_params, model_bytes=model_bytes, derived_bound=derived,
         attacks=len(rows), worst_time_attack=worst_t["attack"], worst_time_s=worst_t["s"],
         worst_mem_attack=worst_m["attack"], worst_mem_bytes=worst_m["mem_bytes"],
         honest_s=honest["s"], honest_peak_bytes=honest["peak_bytes"], honest_rss_bytes=honest["rss_bytes"],
         ratio_time_worst_vs_honest=worst_t["s"] / honest["s"],
         deep_20000_s=by_name.get("deep-groups-20000", {}).get("s"),
         vlen_400mb_s=by_name.get("vlen-format-400mb", {}).get("s"),
         disk_left_bytes=sum(r["disk_left_bytes"] for r in rows),
         goal_s=1.0, goal_mem_bytes=mem_goal, over_goal=[r["attack"] for r in rows if not r["ok"]],
         meets_goal=all(r["ok"] for r in rows))
    return {"rows": rows, "honest": honest}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--params", type=int, nargs="+", default=[4_972_746, 4_810])
    ap.add_argument("--quick", action="store_true", help="the corpus only, not the full-size classes")
    args = ap.parse_args()
    print(f"load average {os.getloadavg()}, {os.cpu_count()} CPUs")
    for n in args.params:
        tmp = Path(tempfile.mkdtemp(prefix="bdl-bench-hostile-"))
        try:
            run_model(model_of(n), tmp, args.quick)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
