"""Concurrent parameter servers: P processes merging N results into one model.

Every client copy W_c is the same constant c, so whatever the order, the server
weights after n merges must be a^n*W_0 + (1-a^n)*c: the number of merges that really
landed is read back from W_s. Strict mode (WATCH/MULTI, the default) must land all of
them; the paper's eventual mode (plain read-modify-write) is measured for lost updates.
Model size: the paper's 4,972,746 float32 parameters.

    python bench/bench_concurrency.py [--procs 4] [--results 200] [--params 4972746]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import emit  # noqa: E402
from server.assimilator.core import merge_into  # noqa: E402
from server.common.redis_server import EmbeddedRedis  # noqa: E402
from server.common.store import JobStore, connect  # noqa: E402
from server.common.weights import fingerprint_of  # noqa: E402

ALPHA = 0.99
C = 1.0


def _worker(url: str, job: str, units: list[str], strict: bool, n: int) -> None:
    store = JobStore(connect(url), job)
    wc = np.full(n, C, np.float32)
    for u in units:
        store.merge("0", u, lambda ws: merge_into(ws, wc, ALPHA), {}, epoch=1, strict=strict)


def run(mode: str, procs: int, results: int, n: int) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="bdl-conc-"))
    srv = EmbeddedRedis(tmp / "redis").start()
    try:
        fp = fingerprint_of(["w"], [np.zeros(n, np.float32)])
        store = JobStore(connect(srv.url), "conc")
        store.create("{}", "vcasgd", {"0": fp}, {})
        store.init_weights("0", np.zeros(n, np.float32))
        units = [f"u{i}" for i in range(results)]
        for u in units:
            store.register_unit(u, {"epoch": 1, "shard": 0, "model": "0"}, 1)
        ctx = mp.get_context("fork")
        ps = [ctx.Process(target=_worker, args=(srv.url, "conc", units[i::procs], mode == "strict", n))
              for i in range(procs)]
        t0 = time.perf_counter()
        for p in ps:
            p.start()
        for p in ps:
            p.join()
        dt = time.perf_counter() - t0
        w, version = store.get_weights("0")
        landed = float(np.log(1 - float(np.mean(w[:1000])) / C) / np.log(ALPHA))
        marks = len(store.assimilated())
    finally:
        srv.kill()
    return {"mode": mode, "seconds": dt, "merges_per_s": results / dt, "landed": round(landed, 2),
            "lost": round(results - landed, 2), "marks": marks, "version": version}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--results", type=int, default=200)
    ap.add_argument("--params", type=int, default=4_972_746)
    a = ap.parse_args()
    print(f"{a.procs} assimilator processes, {a.results} results, {a.params:,} float32 parameters")
    out = {}
    for mode in ("strict", "eventual"):
        r = run(mode, a.procs, a.results, a.params)
        out[mode] = r
        print(f"  {mode:8s}: {r['merges_per_s']:6.1f} merges/s, landed {r['landed']:7.2f} of {a.results} "
              f"(lost {r['lost']:.2f}), unit marks {r['marks']}, version counter {r['version']}")
        emit("concurrent_merges", procs=a.procs, results=a.results, params=a.params, **r)
    print(f"strict / eventual throughput: {out['strict']['merges_per_s'] / out['eventual']['merges_per_s']:.2f}")


if __name__ == "__main__":
    main()
