"""Imported by a fork server before it forks anything: TensorFlow and Keras loaded once,
quietly and without Keras' optional packages (:func:`~boinc_dl.server.common.keras_model.import_tensorflow`),
so that every child starts with them in memory.

``multiprocessing``'s ``set_forkserver_preload`` takes module names, not calls: this
module is the call. Naming ``tensorflow`` there instead would import it whole (scikit-
learn, SciPy's statistics and matplotlib with it: a third of the import's time).
"""

from boinc_dl.server.common.keras_model import import_tensorflow

import_tensorflow()
