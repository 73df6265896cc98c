"""Concurrent parameter servers: P processes merging N results into one model.

Every client copy W_c is the same constant c, so whatever the order, the server
weights after n merges must be a^n*W_0 + (1-a^n)*c, shard by shard: the number of
merges that really landed is read back from every shard of W_s (lost = fewer,
doubled = more). Strict mode must land all of them exactly once; the paper's
eventual mode (no check-and-set) is measured for lost updates.

Engines measured in one run, each repeated ``--repeats`` times (median reported),
each row on a fresh engine: the one-key layout (the whole model as one shard: the
baseline) and the sharded layout on one Redis, the same with Redis's own AOF-rewrite
thresholds (the baseline for boinc-dl's), the same with the assimilator's distance
check (a snapshot of the weights before each merge, as with the default adaptive
bound), and the sharded layout on a Redis Cluster of 1 and of 3 masters on loopback;
the *logged* merge (durable by the merge log: shard bytes out of the AOF, each merge's
input a retained hard link of one result file, hashed and synced; the assimilator's
path), against today's byte-logged strict merge. Also: one shard's check-and-set as a
Lua script vs as WATCH/MULTI/EXEC (single process, hiredis parser when installed).
Model size: the paper's 4,972,746 float32 parameters.

    python bench/bench_concurrency.py [--procs 4] [--results 100] [--repeats 3] [--rows redis:strict,redis:logged]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import emit  # noqa: E402
from boinc_dl.server.assimilator import rules  # noqa: E402
from boinc_dl.server.assimilator import shards as sh  # noqa: E402
from boinc_dl.server.assimilator.connection import connect
from boinc_dl.server.assimilator.core import merge_into  # noqa: E402
from boinc_dl.server.assimilator.redis_server import EmbeddedRedis, LocalRedisCluster  # noqa: E402
from boinc_dl.server.assimilator.store import JobStore  # noqa: E402
from boinc_dl.server.common.weights import WeightsFile, fingerprint_of, write_weights  # noqa: E402

ALPHA = 0.99
C = 1.0
UNIT_S = 300  # a 5-minute unit per host


def _worker(url: str, job: str, units: list[str], mode: str, n: int, source: str) -> None:
    store = JobStore(connect(url), job)
    wc = np.full(n, C, np.float32)
    if mode == "logged-nohash":
        # What the inputs' SHA-256 costs: the same merges with the hash replaced by a
        # constant (a measurement only: such a log could not check its inputs).
        from boinc_dl.server.assimilator import retained

        retained.sha256_of = lambda path: "0" * 64
    if mode.startswith("logged"):
        # What the assimilator passes: the rule by name and the result file it came from.
        params = {"alpha": ALPHA}
        for u in units:
            store.merge("0", u, lambda ws, sl: rules.apply("alpha", ws, wc[sl], params, sl),
                        {"rule": "alpha", "rule_params": params}, epoch=1, strict=True, source=Path(source))
        return
    for u in units:
        if mode == "strict+check":
            # What the assimilator does with the default adaptive distance bound: a
            # snapshot of the server weights first (the result's distance), then the merge.
            float(np.linalg.norm(wc - store.snapshot("0").flat))
        store.merge("0", u, lambda ws, sl: merge_into(ws, wc[sl], ALPHA), {}, epoch=1, strict=mode != "eventual")


def run_once(url: str, mode: str, procs: int, results: int, n: int, shard_bytes: int) -> dict:
    """One measurement on a running engine: ``results`` merges by ``procs`` processes."""
    job = f"conc{os.urandom(3).hex()}"
    fp = fingerprint_of(["w"], [np.zeros(n, np.float32)])
    store = JobStore(connect(url), job)
    job_dir = Path(tempfile.mkdtemp(prefix="bdl-conc-job-", dir=os.environ.get("BDL_BENCH_DIR")))
    source = job_dir / "result.h5"
    write_weights(source, WeightsFile(np.full(n, C, np.float32), fp, job=job, model="0", unit="any"))
    store.create("{}", "vcasgd", {"0": fp}, {"job_dir": str(job_dir)} if mode.startswith("logged") else {})
    os.environ["BDL_SHARD_BYTES"] = str(shard_bytes)
    store.init_weights("0", np.zeros(n, np.float32))
    shards = store.layout("0").shards
    units = [f"u{i}" for i in range(results)]
    for u in units:
        store.register_unit(u, {"epoch": 1, "shard": 0, "model": "0"}, 1)
    ctx = mp.get_context("fork")
    ps = [ctx.Process(target=_worker, args=(url, job, units[i::procs], mode, n, str(source))) for i in range(procs)]
    # CPU per merge, a figure the machine's load does not change much: the assimilator
    # processes' (their rusage once joined) and Redis's (INFO, one server only).
    redis_cpu0 = _redis_cpu(store)
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    for p in ps:
        p.start()
    for p in ps:
        p.join()
    dt = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    redis_cpu = _redis_cpu(store) - redis_cpu0 if redis_cpu0 is not None else float("nan")
    client_cpu = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
    snap = store.snapshot("0")
    lay = store.layout("0")
    # Merges landed in each shard, read back from the shard's values.
    landed = [float(np.log(1 - float(np.mean(snap.flat[lay.bounds(i)][:1000], dtype=np.float64)) / C)
                    / np.log(ALPHA)) for i in range(shards)]
    marks = len(store.assimilated())
    store.delete()
    shutil.rmtree(job_dir, ignore_errors=True)
    return {"mode": mode, "shards": shards, "seconds": dt, "merges_per_s": results / dt,
            "redis_cpu_ms_per_merge": redis_cpu / results * 1000, "client_cpu_ms_per_merge": client_cpu / results * 1000,
            "landed_min": round(min(landed), 2), "landed_max": round(max(landed), 2),
            "lost": round(results - min(landed), 2), "doubled": round(max(landed) - results, 2),
            "marks": marks, "version": store.version("0") if marks else 0}


def _redis_cpu(store: JobStore) -> float | None:
    """Seconds of CPU the Redis server has used (None for a cluster)."""
    if store.cluster:
        return None
    info = store.r.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


@contextmanager
def _engine(kind: str, data_dir: Path) -> Iterator[str]:
    """A fresh engine on ``data_dir``, removed after: one Redis with boinc-dl's settings,
    one Redis with Redis's own AOF-rewrite defaults or with ``appendfsync everysec`` (the
    baselines for those settings), or a Redis Cluster of 1 or 3 masters on loopback."""
    if kind.startswith("redis"):
        extra = ["--auto-aof-rewrite-percentage", "100", "--auto-aof-rewrite-min-size", "64mb"] \
            if kind == "redis-aof-defaults" else []
        fsync = "everysec" if kind == "redis-everysec" else "no"
        eng: EmbeddedRedis | LocalRedisCluster = EmbeddedRedis(data_dir, appendfsync=fsync, extra_args=extra).start()
    else:
        eng = LocalRedisCluster(data_dir, masters=int(kind[len("cluster"):])).start()
    try:
        yield eng.url
    finally:
        eng.kill()
        # Gigabytes of append-only file: gone before the next row writes its own.
        shutil.rmtree(data_dir, ignore_errors=True)


def cas_lua_vs_watch(url: str, shard_floats: int, updates: int = 40) -> dict:
    """Seconds per shard update: Lua read + check-and-set vs WATCH/GET/MULTI/EXEC."""
    store = JobStore(connect(url), "cas")
    r = store.r
    wkey, mkey = "bench:cas:w", "bench:cas:m"
    buf = np.zeros(shard_floats, np.float32)
    r.set(wkey, buf.tobytes())
    r.hset(mkey, mapping={"tag": "t0", "v": 0})
    read, cas = r.register_script(sh.READ_SHARD), r.register_script(sh.CAS_SHARD)
    lua, watch = [], []
    for i in range(updates):
        t0 = time.perf_counter()
        tag, _v, _mark, w, _live = read(keys=[wkey, mkey], args=[f"u:a{i}", b""])
        ws = np.frombuffer(w, np.float32).copy()
        ws += 1
        assert int(cas(keys=[wkey, mkey], args=[tag, f"t{i}a", f"u:a{i}", ws.tobytes()])[0]) == 1
        lua.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with r.pipeline(transaction=True) as p:
            p.watch(mkey)
            if p.hget(mkey, f"u:b{i}") is None:
                nv = int(p.hget(mkey, "v") or 0) + 1
                ws = np.frombuffer(p.get(wkey), np.float32).copy()
                ws += 1
                p.multi()
                p.set(wkey, ws.tobytes())
                p.hset(mkey, mapping={"tag": f"t{i}b", f"u:b{i}": nv, "v": nv, "bv": nv})
                p.execute()
        watch.append(time.perf_counter() - t0)
    r.delete(wkey, mkey)
    return {"lua_s": statistics.median(lua), "watch_s": statistics.median(watch)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--results", type=int, default=100)
    ap.add_argument("--params", type=int, default=4_972_746)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shard-bytes", type=int, default=sh.TARGET_SHARD_BYTES)
    ap.add_argument("--rows", default="", help="only these engine:mode rows (comma-separated), e.g. "
                                                "redis:strict,redis:logged; the first one is the baseline")
    a = ap.parse_args()
    # A SIGTERM (timeout, Ctrl-C from a wrapper) still runs the finally blocks that stop
    # the Redis servers this script started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print(f"{a.procs} assimilator processes, {a.results} results, {a.params:,} float32 parameters, "
          f"{a.repeats} repeats")
    one_key = a.params * 4 + 1  # one shard: the whole model under one check-and-set
    configs = [("redis", "strict", one_key), ("redis", "strict", a.shard_bytes),
               ("redis", "eventual", a.shard_bytes), ("redis-aof-defaults", "strict", a.shard_bytes),
               ("redis", "strict+check", a.shard_bytes),
               ("cluster1", "strict", a.shard_bytes), ("cluster3", "strict", a.shard_bytes),
               ("redis-everysec", "strict", a.shard_bytes), ("redis", "logged", a.shard_bytes),
               ("redis", "logged-nohash", a.shard_bytes)]
    if a.rows:
        # engine:mode names a sharded row; redis:one-key the one-key baseline.
        named = {(e, "one-key" if sb == one_key else m): (e, m, sb) for e, m, sb in configs}
        configs = [named[tuple(r.split(":"))] for r in a.rows.split(",")]
    rows: dict[tuple[str, str, int], list[dict]] = {c: [] for c in configs}
    cas: list[dict] = []
    tmp = Path(tempfile.mkdtemp(prefix="bdl-conc-"))
    try:
        for rep in range(a.repeats):
            with _engine("redis", tmp / f"cas{rep}") as url:
                cas.append(cas_lua_vs_watch(url, a.shard_bytes // 4))
            for n, cfg in enumerate(configs):
                eng, mode, sb = cfg
                # A fresh engine per row (ratios in one run, none inheriting another's
                # append-only file or its dirty pages).
                with _engine(eng, tmp / f"{rep}-{n}") as url:
                    r = run_once(url, mode, a.procs, a.results, a.params, sb)
                rows[cfg].append(r)
                print(f"  [{rep + 1}] {eng:18s} {mode:8s} {r['shards']:3d} shard(s): {r['merges_per_s']:6.1f} "
                      f"merges/s (CPU per merge: Redis {r['redis_cpu_ms_per_merge']:.1f} ms, assimilators "
                      f"{r['client_cpu_ms_per_merge']:.1f} ms), "
                      f"landed {r['landed_min']:.2f}..{r['landed_max']:.2f} of {a.results}, "
                      f"marks {r['marks']}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    med = {cfg: statistics.median(r["merges_per_s"] for r in rs) for cfg, rs in rows.items()}
    base = med[configs[0]]
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    if a.rows:
        for cfg, m in med.items():
            rcpu = statistics.median(r["redis_cpu_ms_per_merge"] for r in rows[cfg])
            ccpu = statistics.median(r["client_cpu_ms_per_merge"] for r in rows[cfg])
            print(f"median merges/s {cfg[0]} {cfg[1]}: {m:.1f} ({m / base:.2f}x the first row); CPU per merge: "
                  f"Redis {rcpu:.1f} ms, assimilators {ccpu:.1f} ms")
            emit("concurrent_merges", engine=cfg[0], mode=cfg[1], procs=a.procs, results=a.results, params=a.params,
                 repeats=a.repeats, merges_per_s=m, runs_merges_per_s=[round(r["merges_per_s"], 2) for r in rows[cfg]],
                 ratio_vs_first=m / base, redis_cpu_ms_per_merge=rcpu, client_cpu_ms_per_merge=ccpu, lost_max=max(r["lost"] for r in rows[cfg]),
                 doubled_max=max(r["doubled"] for r in rows[cfg]), load=os.getloadavg())
        return
    for cfg, rs in rows.items():
        eng, mode, _sb = cfg
        worst_lost = max(r["lost"] for r in rs)
        worst_doubled = max(r["doubled"] for r in rs)
        emit("concurrent_merges", engine=eng, mode=mode, shards=rs[0]["shards"], procs=a.procs,
             results=a.results, params=a.params, repeats=a.repeats, merges_per_s=med[cfg],
             runs_merges_per_s=[round(r["merges_per_s"], 2) for r in rs], ratio_vs_one_key=med[cfg] / base,
             lost_max=worst_lost, doubled_max=worst_doubled, marks_min=min(r["marks"] for r in rs),
             hosts_at_5min_units=int(med[cfg] * UNIT_S))
    sharded, c1m, c3m = med[configs[1]], med[configs[5]], med[configs[6]]
    aof_default, checked, everysec = med[configs[3]], med[configs[4]], med[configs[7]]
    print(f"median merges/s: one key {base:.1f}, sharded {sharded:.1f} ({sharded / base:.2f}x), "
          f"cluster 1 node {c1m:.1f}, 3 nodes {c3m:.1f} (3/1 nodes: {c3m / c1m:.2f}x)")
    print(f"AOF rewrite thresholds: Redis's defaults {aof_default:.1f} merges/s, boinc-dl's {sharded:.1f} "
          f"({sharded / aof_default:.2f}x)")
    print(f"AOF fsync: Redis's everysec {everysec:.1f} merges/s, boinc-dl's (no + its own fdatasync every second) "
          f"{sharded:.1f} ({sharded / everysec:.2f}x)")
    print(f"with the assimilator's distance check (a snapshot before each merge): {checked:.1f} merges/s "
          f"({checked / sharded:.2f}x the merge alone)")
    print(f"hosts one server sustains at 5-minute units: one key {base * UNIT_S:,.0f}, "
          f"sharded {sharded * UNIT_S:,.0f}, 3-node cluster {c3m * UNIT_S:,.0f}")
    lua = statistics.median(c["lua_s"] for c in cas)
    watch = statistics.median(c["watch_s"] for c in cas)
    print(f"one {a.shard_bytes / 1e6:.2f} MB shard update: Lua check-and-set {lua * 1000:.2f} ms, "
          f"WATCH/MULTI {watch * 1000:.2f} ms ({watch / lua:.2f}x)")
    emit("concurrent_merges_summary", merges_per_s_one_key=base, merges_per_s_sharded=sharded,
         merges_per_s_cluster1=c1m, merges_per_s_cluster3=c3m, ratio_sharded_vs_one_key=sharded / base,
         ratio_cluster3_vs_cluster1=c3m / c1m, goal_merges_per_s=20, meets_goal=min(sharded, c3m) >= 20,
         hosts_at_5min_units_sharded=int(sharded * UNIT_S), hosts_at_5min_units_cluster3=int(c3m * UNIT_S),
         cas_lua_ms=lua * 1000, cas_watch_ms=watch * 1000, merges_per_s_aof_defaults=aof_default,
         ratio_vs_aof_defaults=sharded / aof_default, merges_per_s_with_check=checked,
         merges_per_s_everysec=everysec, ratio_vs_everysec=sharded / everysec)


if __name__ == "__main__":
    main()
