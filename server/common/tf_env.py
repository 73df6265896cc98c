"""TensorFlow kept quiet and its absence explained, for the server and its children.

TensorFlow prints start-up lines on every process that imports it: absl's
"All log messages before absl::InitializeLog() ...", oneDNN's "custom operations are
on", CUDA factory registrations. Since TensorFlow 2.17 the early ones come from absl's
C++ logging *before* ``TF_CPP_MIN_LOG_LEVEL`` is read, so the variable alone does not
hide them: a process whose terminal must stay clean has its stderr pointed elsewhere
while TensorFlow loads (:func:`stdio_to`). oneDNN stays on (its speed is wanted);
only its notice is hidden. Errors still reach the run's log files.

Installed without the TensorFlow extra, :func:`require_tensorflow` says in one line
which extra to install instead of an import traceback.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from boinc_dl.server.common.errors import BoincDLError

#: Set for this process and inherited by every child (slots, assimilators, evaluators).
QUIET_ENV = {
    "TF_CPP_MIN_LOG_LEVEL": "3",  # C++ logging after absl's initialisation: nothing
    "GRPC_VERBOSITY": "ERROR",
    "GLOG_minloglevel": "3",
}

MISSING_TF = ("TensorFlow is not installed: install the trainer with "
              "pip install 'boinc-dl[cpu]' (or 'boinc-dl[gpu]' for NVIDIA GPUs)")


class TensorFlowMissing(BoincDLError):
    """TensorFlow cannot be imported (the package was installed without its extra)."""


def quiet_env() -> None:
    """Ask TensorFlow (and gRPC, glog) for errors only, unless the user chose a level."""
    for k, v in QUIET_ENV.items():
        os.environ.setdefault(k, v)


def quiet_python_logging() -> None:
    """Python-side TensorFlow and absl loggers: errors only."""
    for name in ("tensorflow", "absl", "keras"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        from absl import logging as absl_logging  # type: ignore[import-not-found]

        absl_logging.set_verbosity(absl_logging.ERROR)
    except ImportError:
        pass


def tensorflow_available() -> bool:
    """True if ``import tensorflow`` can find the package (without importing it)."""
    try:
        return importlib.util.find_spec("tensorflow") is not None
    except (ImportError, ValueError):
        return False


def require_tensorflow() -> None:
    """Raise :class:`TensorFlowMissing` (one line naming the extra) if TensorFlow is absent."""
    if not tensorflow_available():
        raise TensorFlowMissing(MISSING_TF)


@contextmanager
def stdio_to(path: str | Path, fds: tuple[int, ...] = (1, 2)) -> Iterator[None]:
    """Point this process's ``fds`` (file descriptors, not just ``sys.stderr``) at
    ``path`` (appended) for the duration: C++ libraries and children started inside
    write there."""
    import sys

    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    target = os.open(str(path), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    saved = {fd: os.dup(fd) for fd in fds}
    try:
        for fd in fds:
            os.dup2(target, fd)
        yield
    finally:
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)
        os.close(target)
