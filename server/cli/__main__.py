"""``python -m boinc_dl.server.cli ...``: the ``boinc-dl`` console script without installing it."""

from boinc_dl.server.cli import main

if __name__ == "__main__":
    main()
