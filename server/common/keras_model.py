"""Keras glue shared by the work generator, the evaluator and the client app.

The only module of ``boinc_dl.server.common`` that imports TensorFlow (lazily): merging never
needs it. A model's tensors are its ``model.weights`` in order (trainable and
non-trainable, e.g. batch-norm statistics), named by their Keras paths.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from boinc_dl.server.common.errors import ModelError
from boinc_dl.server.common.lean_imports import hidden
from boinc_dl.server.common.tf_env import quiet_python_logging, require_tensorflow
from boinc_dl.server.common.weights import Fingerprint, fingerprint_of

#: boinc-dl's one top-level import name: no user module may take it.
OWN_NAME = "boinc_dl"


def configure_tf(threads: int | None = None, deterministic: bool = True) -> Any:
    """Import TensorFlow quietly, with bounded threads and deterministic ops."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    tf = import_tensorflow()
    # Also where TensorFlow was imported before (a fork server's preload, a user's module):
    # its Python warnings (tf.function retracing as MOP slots hop between models, each a
    # new trace) would fill the logs.
    quiet_python_logging()

    if threads:
        try:
            tf.config.threading.set_intra_op_parallelism_threads(threads)
            tf.config.threading.set_inter_op_parallelism_threads(threads)
        except RuntimeError:
            pass  # already initialised in this process
    if deterministic:
        try:
            tf.config.experimental.enable_op_determinism()
        except (RuntimeError, AttributeError):
            pass
    return tf


def import_tensorflow() -> Any:
    """TensorFlow, imported (once per process) with Keras and without the optional
    packages Keras would load for features boinc-dl never uses
    (:mod:`~boinc_dl.server.common.lean_imports`: a third of the import's time)."""
    if "tensorflow" in sys.modules:
        return sys.modules["tensorflow"]
    require_tensorflow()
    with hidden():
        return _import_tf_quietly()


def _import_tf_quietly() -> Any:
    """Import TensorFlow and Keras with TensorFlow's C++ start-up banner (absl, oneDNN)
    kept off the terminal when TF_CPP_MIN_LOG_LEVEL asks for errors only; Python errors
    still propagate."""
    if os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0") < "3":
        import keras  # noqa: F401 - loaded here, where its optional imports are hidden
        import tensorflow as tf

        return tf
    with _startup_lines_dropped():
        import keras  # noqa: F401
        import tensorflow as tf
    return tf


#: TensorFlow's start-up lines (absl's C++ log format, its pre-init notice, the CPU
#: feature note): what a model module's top-level ``import keras`` prints on stderr.
_TF_STARTUP = re.compile(r"^(WARNING: All log messages before absl::InitializeLog\(\)|"
                         r"[IWEF]\d{4} [\d:.]+\s+\d+ \S+:\d+\]|"
                         r"To enable the following instructions:.*rebuild TensorFlow)")


@contextlib.contextmanager
def _startup_lines_dropped() -> Iterator[None]:
    """Send file descriptor 2 to a temporary file for the block (TensorFlow's C++ code
    writes there directly, past ``sys.stderr``), then pass on every line but TensorFlow's
    start-up lines. The descriptor is the process's: what other threads write meanwhile
    (the work generator's main thread logging while its checker thread imports
    TensorFlow) comes out when the block ends, late but never lost."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as err:
        try:
            os.dup2(err.fileno(), 2)
            try:
                yield
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                os.close(saved)
        finally:
            err.seek(0)
            kept = [ln for ln in err.read().decode("utf-8", "replace").splitlines(keepends=True)
                    if not _TF_STARTUP.match(ln)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def _import_user_module(mod_name: str) -> Any:
    """Import the user's model module. When it imports TensorFlow (``import keras`` at its
    top) and the process asked TensorFlow for quiet (``TF_CPP_MIN_LOG_LEVEL=3``, as the
    CLI does), TensorFlow's start-up lines are dropped from stderr; anything else the
    module writes there (its own warnings, prints) is passed on."""
    if "tensorflow" in sys.modules or os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0") < "3":
        return importlib.import_module(mod_name)
    with _startup_lines_dropped():
        return importlib.import_module(mod_name)


def resolve_builder(ref: str, search_path: str | Path | None = None) -> Any:
    """The builder function of ``module:function``, imported without loading TensorFlow
    (unless the module itself imports it).

    The module is looked up in ``search_path`` (the spec's folder) first, then in the
    working directory: a same-named module in the directory a user happens to run from
    never replaces the one beside the spec. boinc-dl's own import name cannot be taken.
    """
    mod_name, _, fn_name = ref.partition(":")
    if mod_name.split(".")[0] == OWN_NAME:
        raise ModelError(f"model module {mod_name!r}: {OWN_NAME!r} is boinc-dl's own package name; "
                         "give your module another name")
    # Kept on sys.path: later calls (evaluation) import the same module. Put in order:
    # the spec's folder at the front, the working directory right behind it.
    wanted = [str(p) for p in (search_path, os.getcwd()) if p is not None]
    for p in wanted:
        # A module of that name ahead of the installed package on sys.path would replace
        # boinc-dl itself in every process started from here (slots, evaluators).
        if (Path(p) / f"{OWN_NAME}.py").exists() or (Path(p) / OWN_NAME / "__init__.py").exists():
            raise ModelError(f"{p} holds a Python module named {OWN_NAME!r}, which would shadow boinc-dl "
                             "itself; rename it")
    for p in reversed(wanted):
        while p in sys.path:
            sys.path.remove(p)
        sys.path.insert(0, p)
    try:
        mod = _import_user_module(mod_name)
    except SystemExit as e:
        raise ModelError(f"model module {mod_name!r} called sys.exit({e.code!r}) while being imported") from None
    except Exception as e:  # noqa: BLE001 - report any import failure in one line
        raise ModelError(f"cannot import model module {mod_name!r}: {type(e).__name__}: {e}") from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ModelError(f"{mod_name!r} has no function {fn_name!r}")
    return fn


def build_model(ref: str, args: dict[str, Any] | None = None, search_path: str | Path | None = None,
                seed: int | None = None) -> Any:
    """Build a Keras model from ``module:function`` (called with ``args``) or load a model file.

    The builder is resolved before TensorFlow is loaded, so a wrong reference fails fast
    with one line (TensorFlow's import prints its own lines on stderr)."""
    if ref.endswith((".keras", ".h5")):
        tf = configure_tf()
        if not Path(ref).is_file():
            raise ModelError(f"model file not found: {ref}")
        try:
            return tf.keras.models.load_model(ref, compile=False)
        except Exception as e:  # noqa: BLE001 - any loader failure is a bad file
            raise ModelError(f"cannot load model file {ref}: {type(e).__name__}: {e}") from None
    fn = resolve_builder(ref, search_path)
    tf = configure_tf()
    if seed is not None:  # the initial weights depend on it
        tf.keras.utils.set_random_seed(seed)
    try:
        model = fn(**(args or {}))
    except SystemExit as e:
        raise ModelError(f"model builder {ref} called sys.exit({e.code!r})") from None
    except Exception as e:  # noqa: BLE001
        raise ModelError(f"model builder {ref} failed: {type(e).__name__}: {e}") from None
    if not isinstance(model, tf.keras.Model):
        raise ModelError(f"model builder {ref} returned {type(model).__name__}, not a Keras model")
    return model


def model_fingerprint(model: Any) -> Fingerprint:
    """The fingerprint (names, shapes, dtypes) of a built Keras model."""
    names = [getattr(w, "path", None) or w.name for w in model.weights]
    return fingerprint_of(names, [np.zeros(tuple(w.shape), np.float32) for w in model.weights])


def get_flat(model: Any) -> np.ndarray:
    """All of the model's tensors as one float32 buffer."""
    arrays = [np.asarray(w.numpy(), dtype=np.float32).reshape(-1) for w in model.weights]
    return np.concatenate(arrays) if arrays else np.empty(0, np.float32)


def set_flat(model: Any, flat: np.ndarray) -> None:
    """Load one float32 buffer into the model's tensors (same order as :func:`get_flat`)."""
    fp = model_fingerprint(model)
    if flat.size != fp.n_params:
        raise ModelError(f"weights have {flat.size} values, model has {fp.n_params}")
    for w, a in zip(model.weights, fp.split(flat), strict=True):
        w.assign(a.astype(w.dtype.name if hasattr(w.dtype, "name") else "float32", copy=False))


def make_optimizer(name: str, lr: float, momentum: float = 0.0) -> Any:
    """A fresh Keras optimizer from the spec's settings."""
    tf = configure_tf()
    opts = tf.keras.optimizers
    if name == "adam":
        return opts.Adam(learning_rate=lr)
    if name == "sgd":
        return opts.SGD(learning_rate=lr, momentum=momentum)
    if name == "rmsprop":
        return opts.RMSprop(learning_rate=lr, momentum=momentum)
    if name == "adagrad":
        return opts.Adagrad(learning_rate=lr)
    raise ModelError(f"unknown optimizer {name!r}")
