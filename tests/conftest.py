"""Shared fixtures: a private Redis per test (own data dir, own socket), tiny jobs."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("BDL_THREADS", "1")

from boinc_dl.server.assimilator.connection import connect
from boinc_dl.server.assimilator.redis_server import EmbeddedRedis  # noqa: E402
from boinc_dl.server.assimilator.store import JobStore  # noqa: E402
from boinc_dl.server.common.spec import parse_spec  # noqa: E402
from boinc_dl.server.common.weights import Fingerprint, WeightsFile, fingerprint_of, write_weights  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

#: The most test workers ``-n auto`` starts: each runs TensorFlow processes of its own,
#: and past a few they only queue for the same cores and memory.
MAX_WORKERS = 4


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """One worker per core this process may use, and one more, at most :data:`MAX_WORKERS`.

    Many of the long tests wait more than they compute (a unit's deadline to pass, a
    process to be killed and restarted, a daemon's pass): one test worker more than
    cores fills those waits. On 2 cores the suite took 801 s with 2 workers, 744 s with 3."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(MAX_WORKERS, cores + 1))


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    """A real redis-server on a Unix socket in the test's tmp dir (killed at the end)."""
    srv = EmbeddedRedis(tmp_path / "redis").start()
    yield srv
    srv.kill()


@pytest.fixture
def redis_client(redis_server: EmbeddedRedis):
    return connect(redis_server.url)


def tiny_fingerprint() -> Fingerprint:
    return fingerprint_of(["dense/kernel", "dense/bias"], [np.zeros((4, 3)), np.zeros(3)])


def tiny_spec(name: str = "tiny", **over) -> object:
    data = {
        "name": name,
        "model": "models:mlp",
        "dataset": {"name": "digits"},
        "training": {"epochs": 2},
        # Plumbing tests check the paper's arithmetic (W_s <- 0.5 W_s + 0.5 W_c).
        "vcasgd": {"n_subsets": 4, "alpha": 0.5, "merge_rule": "paper"},
    }
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(data.get(k), dict):
            data[k] = {**data[k], **v}
        else:
            data[k] = v
    return parse_spec(data)


@pytest.fixture
def tiny_job(redis_client, tmp_path: Path):
    """A job in Redis with a 15-parameter model at version 0 (zeros) and units u0..u7,
    each issued from version 0 (its base weights file, as the work generator writes it)."""
    spec = tiny_spec()
    fp = tiny_fingerprint()
    store = JobStore(redis_client, spec.name)
    store.create(spec.model_dump_json(), "vcasgd", {"0": fp}, {})
    store.init_weights("0", np.zeros(fp.n_params, np.float32))
    base = tmp_path / "job-files" / f"{spec.name}__m0_v0000000.h5"
    base.parent.mkdir(parents=True, exist_ok=True)
    write_weights(base, WeightsFile(np.zeros(fp.n_params, np.float32), fp, job=spec.name, model="0"))
    for i in range(8):
        store.register_unit(f"u{i}", {"epoch": 1, "shard": i % 4, "model": "0", "weights_version": 0,
                                      "files": {"weights_in.h5": str(base)}}, 1)
    return store, spec, fp
