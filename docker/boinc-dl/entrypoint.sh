#!/bin/sh
# Entry point of the boinc-dl container: put the Redis password (a compose secret)
# into BDL_REDIS_URL, URL-encoded, so every boinc-dl command finds Redis, then run
# the command.
set -eu

if [ -n "${BDL_REDIS_PASSWORD_FILE:-}" ] && [ -r "$BDL_REDIS_PASSWORD_FILE" ]; then
    BDL_REDIS_URL=$(python /opt/boinc-dl/spool_consumer.py --print-redis-url)
    export BDL_REDIS_URL
    unset BDL_REDIS_PASSWORD_FILE
fi

exec "$@"
