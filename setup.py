"""Packaging: one import name, ``boinc_dl``, over the repository's top-level folders.

The mission's folders stay at the top of the repository (``server/``, ``client_app/``)
and install as ``boinc_dl.server`` and ``boinc_dl.client_app`` (``boinc_dl`` is a
namespace package: nothing of boinc-dl's is a top-level name a user's own module could
shadow or another distribution could overwrite). Editable installs, wheels and
``lint-imports`` (its root packages are the two portions) all read this mapping.
Everything else is in ``pyproject.toml``.
"""

from setuptools import find_packages, setup

FOLDERS = {"boinc_dl.server": "server", "boinc_dl.client_app": "client_app"}

setup(
    packages=[f"boinc_dl.{p}" for p in find_packages(include=["server", "server.*", "client_app", "client_app.*"])],
    package_dir=FOLDERS,
    package_data={"boinc_dl.server": ["backends/boinc/templates/*", "backends/boinc/files/*",
                                      "backends/boinc/html/*", "planner/data/*"]},
)
