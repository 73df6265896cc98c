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
# Exit status 75 means "interrupted, checkpoint written" (a spot-interruption
# notice): the VM is about to go away. Any non-zero status would make the wrapper
# report a compute error, so wait for the VM to vanish instead; if it survives
# (a false alarm), resume from the checkpoint, at most BDL_MAX_RESUMES times.
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
resumes=0
while :; do
    "$PY" -m client_app --slot "$PWD" "$@"
    status=$?
    if [ "$status" -ne 75 ] || [ "$resumes" -ge "${BDL_MAX_RESUMES:-3}" ]; then
        exit "$status"
    fi
    resumes=$((resumes + 1))
    echo "bdl_launcher: interrupted (checkpoint written); resuming in ${BDL_RESUME_DELAY_S:-180}s" >&2
    sleep "${BDL_RESUME_DELAY_S:-180}"
done
