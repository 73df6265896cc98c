"""``python -m server.cli ...``: the ``boinc-dl`` console script without installing it."""

from server.cli import main

if __name__ == "__main__":
    main()
