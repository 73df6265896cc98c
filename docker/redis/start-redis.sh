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

# redis.conf has `appendfsync no` (Redis's `everysec` can acknowledge a write before it
# reaches the AOF): flush what Redis has written to disk once a second from here.
(
    while sleep 1; do
        for f in /data/appendonlydir/* /data/appendonly.aof; do
            if [ -f "$f" ]; then sync -d "$f" 2>/dev/null || true; fi
        done
    done
) &

exec docker-entrypoint.sh redis-server /usr/local/etc/redis/redis.conf --include "$auth" "$@"
