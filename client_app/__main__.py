"""Entry point: ``python -m client_app [--slot DIR] [--device N] [--threads N]``."""

import logging
import os
import sys

from client_app.cli import main

code = main()
# Every output and checkpoint is written and closed by now. A normal interpreter exit
# after TensorFlow has run spends seconds tearing it down (3 s here): skip it, so an
# interrupted task gives its slot back at once.
logging.shutdown()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
