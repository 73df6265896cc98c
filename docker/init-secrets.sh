#!/bin/sh
# Create the stack's secrets under docker/secrets/ if they do not exist yet
# (idempotent: existing files are never overwritten). Run once before
# `docker compose up`. Random values come from /dev/urandom.
set -eu

dir="$(cd "$(dirname "$0")" && pwd)/secrets"
umask 077
mkdir -p "$dir"

rand() {
    od -An -N24 -tx1 /dev/urandom | tr -d ' \n'
}

if [ ! -s "$dir/redis_password" ]; then
    rand >"$dir/redis_password"
    echo "created $dir/redis_password"
fi
if [ ! -s "$dir/boinc_secrets.env" ]; then
    {
        printf 'DB_PASSWD=%s\n' "$(rand)"
        printf 'RECAPTCHA_PUBLIC_KEY=\nRECAPTCHA_PRIVATE_KEY=\nMAILPASS=\n'
    } >"$dir/boinc_secrets.env"
    echo "created $dir/boinc_secrets.env"
fi
# Containers read these through bind mounts as non-root users (www-data for the
# admin page, boincadm, redis): the files must be readable; the directory stays
# private to the host's owner.
chmod 0700 "$dir"
chmod 0644 "$dir/redis_password" "$dir/boinc_secrets.env"
