"""Import TensorFlow and Keras without the optional packages Keras pulls in at import.

Keras 3 imports, when they are installed, scikit-learn (for its scikit-learn
wrappers, which drags in SciPy's statistics), matplotlib (image-gallery plotting)
and IPython (notebook detection) the moment TensorFlow loads it: about a quarter of
``import tensorflow`` on a host that has them, paid again by every BOINC task since
each runs in a fresh process. The client app uses none of them. Keras guards each of
these imports with ``except ImportError``, so hiding the packages while TensorFlow
and Keras load makes Keras take its "not installed" branch; the packages stay
importable afterwards (only Keras' wrappers and plotting helpers stay disabled in
that process).
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

#: Packages Keras imports optionally and the client never uses.
KERAS_OPTIONAL = ("sklearn", "matplotlib", "IPython")


class _Hide(importlib.abc.MetaPathFinder):
    """A finder that makes ``import name`` (and its submodules) fail with ImportError."""

    def __init__(self, names: Sequence[str]):
        self.names = frozenset(names)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        if fullname.partition(".")[0] in self.names:
            raise ModuleNotFoundError(f"{fullname} hidden while TensorFlow loads", name=fullname)
        return None


@contextmanager
def hidden(names: Sequence[str] = KERAS_OPTIONAL) -> Iterator[None]:
    """Make the packages ``names`` unimportable inside the block (already imported ones
    are left alone: hiding them would change nothing and could confuse their users)."""
    finder = _Hide([n for n in names if n not in sys.modules])
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)


def import_tensorflow_lean() -> None:
    """Import TensorFlow (quietly, as :func:`boinc_dl.server.common.keras_model.configure_tf` does)
    and Keras with :data:`KERAS_OPTIONAL` hidden; a no-op once TensorFlow is loaded."""
    if "tensorflow" in sys.modules:
        return
    from boinc_dl.server.common.keras_model import configure_tf

    with hidden():
        configure_tf(None, deterministic=False)
        import keras  # noqa: F401 - loaded here so that its optional imports are skipped
