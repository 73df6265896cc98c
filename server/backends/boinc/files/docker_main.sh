#!/bin/sh
# boinc-dl's entry point inside its BOINC Docker app's container (the image's CMD).
#
# BOINC's docker_wrapper mounts the task's slot directory at /app (job.toml workdir,
# the working directory) and the project directory at /project (project_dir_mount),
# and passes its own extra command-line arguments in $ARGS. The unit's files are
# copies in the slot (<copy_file/> in the templates); a file that is a BOINC link file
# instead (<soft_link>../../projects/<project>/<name></soft_link>) is read through
# /project by the client app (BDL_PROJECT_MOUNT, client_app/boinc_io.py).
#
# exec: Python becomes the container's first process, so the signals sent to the
# container reach it (SIGTERM: checkpoint, exit 75), and its exit status is the
# container's, which docker_wrapper hands to BOINC (0 done, 1 bad unit, 75
# interrupted). docker_wrapper suspends and resumes the whole container (pause and
# unpause: the cgroup freezer), so no process inside needs to handle that.
set -eu
BDL_SLOT="${BDL_SLOT:-/app}"
BDL_PROJECT_MOUNT="${BDL_PROJECT_MOUNT:-/project}"
BDL_CONTAINER=1
TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
export BDL_PROJECT_MOUNT BDL_CONTAINER TF_CPP_MIN_LOG_LEVEL
cd "$BDL_SLOT"
# shellcheck disable=SC2086 # $ARGS is docker_wrapper's space-separated argument list
exec "${BDL_PYTHON:-/opt/boinc-dl/venv/bin/python}" -m boinc_dl.client_app --slot "$BDL_SLOT" ${ARGS:-}
