#!/bin/sh
# boinc-dl launcher, shipped inside the signed app version and run by BOINC's
# wrapper (job.xml <application>bdl_launcher</application>) in the slot directory,
# where the unit's input files sit under their open names (<copy_file/>).
#
# Python 3.10+ with boinc-dl and TensorFlow is preinstalled on the host by the
# fleet's cloud-init: $BDL_PYTHON if set, else /opt/boinc-dl/venv/bin/python3,
# else python3 on PATH. The client app reads init_data.xml itself (GPU assigned by
# BOINC, CPU count) and writes fraction_done and checkpoint.json for the wrapper.
#
# BOINC's wrapper signals only its direct child (SIGSTOP/SIGCONT to suspend and
# resume, SIGTERM on quit or abort), so this shell execs Python: a shell left in
# between would be the only process stopped, Python would train on while "suspended",
# and a stopped shell cannot reap it (defunct children after a client quit). Python
# dies with the wrapper (BDL_PARENT_PID: see client_app/lifeline.py) and, after a
# spot-interruption notice on a VM that lives on, resumes itself from its checkpoint
# (BDL_RESUME_DELAY_S, BDL_MAX_RESUMES) without a shell loop.
set -u
PY="${BDL_PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x /opt/boinc-dl/venv/bin/python3 ]; then
        PY=/opt/boinc-dl/venv/bin/python3
    else
        PY=python3
    fi
fi
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
BDL_PARENT_PID=$PPID
export BDL_PARENT_PID
exec "$PY" -m boinc_dl.client_app --slot "$PWD" "$@"
