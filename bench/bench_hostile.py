"""Rejection cost of hostile results vs validating an honest one, same model, same run.

Every attack of tests/hostile_corpus.py (external storage and links, virtual datasets,
filters, 2e9 declared values, wrong dtypes, user blocks, ...) is built for a model of
the VC-ASGD paper's size (4,972,746 float32 in 700 tensors, 19.9 MB), then handed to
the validator (``validate_result``, what BOINC's validator and the local backend's
assimilators call) in a fresh subprocess, which reports the wall time (median of three), the peak of
Python/numpy allocations (tracemalloc) and the growth of its maximum resident set
(``VmHWM`` after a reset of the high-water mark: HDF5's C allocations included). The baseline is the same validator on
an honest result of the same model. Goals: every hostile file rejected in < 1 s, with
a peak < 2x the model's size.

    python bench/bench_hostile.py [--params 4972746]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import emit  # noqa: E402
from bench.bench_assimilation import resnet_like_shapes  # noqa: E402
from boinc_dl.server.assimilator.connection import connect
from boinc_dl.server.assimilator.redis_server import EmbeddedRedis  # noqa: E402
from boinc_dl.server.assimilator.store import JobStore  # noqa: E402
from boinc_dl.server.common.spec import parse_spec  # noqa: E402
from boinc_dl.server.common.weights import fingerprint_of  # noqa: E402
from tests.hostile_corpus import ATTACKS, valid  # noqa: E402

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
    out = subprocess.run([sys.executable, "-c", PROBE, url, "bench", unit, str(path), str(bound)],
                         capture_output=True, text=True, timeout=300, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--params", type=int, default=4_972_746)
    args = ap.parse_args()
    shapes = resnet_like_shapes(args.params)
    fp = fingerprint_of([f"layer{i}/w" for i in range(len(shapes))], [np.zeros(s, np.float32) for s in shapes])
    model_bytes = 4 * fp.n_params
    tmp = Path(tempfile.mkdtemp(prefix="bdl-bench-hostile-"))
    srv = EmbeddedRedis(tmp / "redis").start()
    rows = []
    try:
        spec = parse_spec({"name": "bench", "model": "m:f", "dataset": {"name": "digits"}})
        store = JobStore(connect(srv.url), "bench")
        store.create(spec.model_dump_json(), "vcasgd", {"0": fp}, {})
        store.init_weights("0", np.zeros(fp.n_params, np.float32))
        store.register_unit("u0", {"epoch": 1, "shard": 0, "model": "0"}, 1)
        bound = spec.units.max_upload_bytes
        honest_path = tmp / "honest.h5"
        valid(honest_path, fp, "bench", "u0")
        honest = probe(srv.url, "u0", honest_path, bound)
        assert honest["verdict"] == "valid", honest
        for a in ATTACKS:
            path = tmp / f"{a.name}.h5"
            a.build(path, fp, "bench", "u0", tmp / "server")
            r = probe(srv.url, "u0", path, bound)
            assert r["verdict"] != "valid", (a.name, r)
            rows.append({"attack": a.name, "file_bytes": path.stat().st_size, **r})
            path.unlink()
    finally:
        srv.kill()
    worst_t = max(rows, key=lambda r: r["s"])
    worst_m = max(rows, key=lambda r: max(r["peak_bytes"], r["rss_bytes"]))
    mem = max(worst_m["peak_bytes"], worst_m["rss_bytes"])
    print(f"model: {fp.n_params:,} float32 in {len(fp.tensors)} tensors ({model_bytes / 1e6:.1f} MB)")
    print(f"{'file':28s} {'size':>10s} {'time ms':>8s} {'tracemalloc MB':>15s} {'peak RSS+ MB':>8s}  verdict")
    print(f"{'honest (baseline)':28s} {honest_path.stat().st_size:10d} {honest['s'] * 1e3:8.1f} "
          f"{honest['peak_bytes'] / 1e6:15.2f} {honest['rss_bytes'] / 1e6:8.2f}  valid")
    for r in sorted(rows, key=lambda r: -r["s"]):
        print(f"{r['attack']:28s} {r['file_bytes']:10d} {r['s'] * 1e3:8.1f} {r['peak_bytes'] / 1e6:15.2f} "
              f"{r['rss_bytes'] / 1e6:8.2f}  {r['verdict'][:70]}")
    emit("hostile_rejection", params=fp.n_params, model_bytes=model_bytes, attacks=len(rows),
         worst_time_attack=worst_t["attack"], worst_time_s=worst_t["s"],
         worst_mem_attack=worst_m["attack"], worst_mem_bytes=mem,
         honest_s=honest["s"], honest_peak_bytes=honest["peak_bytes"], honest_rss_bytes=honest["rss_bytes"],
         ratio_time_worst_vs_honest=worst_t["s"] / honest["s"],
         ratio_mem_worst_vs_model=mem / model_bytes,
         ratio_mem_honest_vs_model=max(honest["peak_bytes"], honest["rss_bytes"]) / model_bytes,
         goal_s=1.0, goal_mem_ratio=2.0,
         meets_goal=worst_t["s"] < 1.0 and mem < 2 * model_bytes)


if __name__ == "__main__":
    main()
