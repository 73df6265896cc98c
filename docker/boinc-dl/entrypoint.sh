#!/bin/sh
# Entry point of the boinc-dl container. Every boinc-dl command finds Redis itself:
# BDL_REDIS_URL, with the password of the compose secret BDL_REDIS_PASSWORD_FILE put
# in (boinc_dl.server.assimilator.connection.resolve_url).
set -eu

exec "$@"
