"""Entry point: ``python -m boinc_dl.client_app [--slot DIR] [--device N] [--threads N]``."""

import logging
import os
import sys

from boinc_dl.client_app.cli import run_cli
from boinc_dl.client_app.lifeline import resume_after_notice

code, preempted = run_cli()
# After a spot notice on a VM that lives on, this re-execs itself (same pid for BOINC's
# wrapper) once the resume delay has passed; otherwise it returns the code.
code = resume_after_notice(code, preempted, [sys.executable, *sys.orig_argv[1:]])
# Every output and checkpoint is written and closed by now. A normal interpreter exit
# after TensorFlow has run spends seconds tearing it down (3 s here): skip it, so an
# interrupted task gives its slot back at once.
logging.shutdown()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
