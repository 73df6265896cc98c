"""Import TensorFlow and Keras without the optional packages Keras pulls in at import.

Keras 3 imports, when they are installed, scikit-learn (for its scikit-learn
wrappers, which drags in SciPy's statistics), matplotlib (image-gallery plotting)
and IPython (notebook detection) the moment TensorFlow loads it: about a third of
``import tensorflow`` on a host that has them (1.6 of 5 s), paid again by every BOINC
task since each runs in a fresh process, and by every process of a run (its own, the
local backend's fork server, a BOINC daemon). boinc-dl uses none of Keras' uses of
them. Keras guards each of these imports with ``except ImportError``, so hiding the
packages while TensorFlow and Keras load (:func:`boinc_dl.server.common.keras_model.import_tensorflow`)
makes Keras take its "not installed" branch; the packages stay importable afterwards
(only Keras' scikit-learn wrappers and image-gallery helpers stay disabled in that
process).
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

#: Packages Keras imports optionally for features boinc-dl never uses.
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

