"""Build an expensive, read-only test input once per test session, however many
xdist workers ask for it.

A module-scoped fixture runs once per *worker* that runs a test of its module: with
``--dist worksteal`` the tests of one module spread over every worker, so a fixture that
trains a reference unit or runs ``boinc-dl run`` (20-40 s each) ran up to three times per
suite. :func:`build_once` keeps xdist's documented pattern for this ("Making
session-scoped fixtures execute only once"): the first worker to ask builds under a
directory all workers share, behind a file lock, and leaves the result there; the others
wait on the lock and read it.

Only for inputs that no test writes to: tests copy what they change (``copy_inputs``,
``copytree``) out of the shared directory first.
"""

from __future__ import annotations

import fcntl
import pickle  # nosec B403: the tests' own files, written by this module in this session
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

T = TypeVar("T")

_RESULT = "result.pickle"


def build_once(tmp_path_factory: pytest.TempPathFactory, worker_id: str, key: str,
               build: Callable[[Path], T]) -> T:
    """``build(directory)``'s result, built once per session under a directory named
    ``key``. ``build`` writes its files into the (empty) directory it is given and returns
    a picklable value (paths into that directory, arrays, dicts). Without xdist
    (``worker_id == "master"``) it simply builds under this session's temporary root.
    A build that raised leaves nothing behind: the next worker to ask builds again (and
    fails the same way, in its own test)."""
    if worker_id == "master":
        return build(tmp_path_factory.mktemp(key))
    # Each worker's basetemp is <session root>/popen-gwN: the parent is shared.
    root = tmp_path_factory.getbasetemp().parent / "built-once"
    root.mkdir(exist_ok=True)
    where = root / key
    with (root / f"{key}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        done = where / _RESULT
        if done.exists():
            return pickle.loads(done.read_bytes())  # nosec B301: written below, this session
        if where.exists():  # a build that raised part way: start clean
            shutil.rmtree(where)
        where.mkdir()
        value = build(where)
        tmp = where / f"{_RESULT}.tmp"
        tmp.write_bytes(pickle.dumps(value))
        tmp.replace(done)
        return value
