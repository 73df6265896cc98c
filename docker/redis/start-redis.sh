#!/bin/sh
# Start Redis with the password from the redis_password secret. The password goes
# into a root-only-readable include file (not on the command line, where `ps`
# would show it), then the image's entrypoint drops to the redis user.
set -eu

secret="${REDIS_PASSWORD_FILE:-/run/secrets/redis_password}"
[ -s "$secret" ] || { echo "start-redis: $secret is missing or empty" >&2; exit 1; }
password=$(tr -d '\r\n' <"$secret")
case "$password" in
    *[[:space:]\"\']*) echo "start-redis: the password must not contain spaces or quotes" >&2; exit 1 ;;
esac

umask 077
auth=/run/redis-auth/auth.conf
mkdir -p /run/redis-auth
printf 'requirepass %s\n' "$password" >"$auth"
chown -R redis:redis /run/redis-auth

exec docker-entrypoint.sh redis-server /usr/local/etc/redis/redis.conf --include "$auth" "$@"
