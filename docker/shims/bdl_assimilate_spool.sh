#!/bin/sh
# Hand one BOINC assimilation call to boinc-dl's container through the spool.
#
# BOINC's script_assimilator runs this as `../bin/bdl_assimilate_spool.sh TOKENS...`
# inside the BOINC server container (old Debian, no usable Python). It copies every
# argument that names a regular file (the canonical result's output files) and the
# full argument list into a fresh directory under $BDL_SPOOL/tmp/, flushes it to disk,
# then renames it into $BDL_SPOOL/assimilate/ in one rename(2): the consumer in the
# boinc-dl container never sees a half-written entry. Exit status:
#   0  the entry is durably in the queue (BOINC may now delete the uploads),
#   1  the spool is missing, full or unwritable: a transient fault, so
#      script_assimilator stops and BOINC retries the workunit later.
# Delivery is at least once: the consumer's merges are idempotent.
#
# Error calls carry no files: `--error MASK WU_ID` (server release 1.2) or
# `--error MASK WU_NAME WU_ID BATCH` (1.6). With only an id, the workunit's name is
# looked up in BOINC's database (credentials from ../config.xml) when the mysql
# client is present, and written to the entry's `wu_name` file; set BDL_DB_LOOKUP=0
# to skip that.
#
# Environment: BDL_SPOOL (default /var/lib/boinc-dl/spool), BDL_PROJECT_CONFIG
# (default ../config.xml), BDL_DB_LOOKUP (default 1).
set -eu

SPOOL="${BDL_SPOOL:-/var/lib/boinc-dl/spool}"
QUEUE="$SPOOL/assimilate"
TMPROOT="$SPOOL/tmp"
CONFIG="${BDL_PROJECT_CONFIG:-../config.xml}"

umask 002

die() {
    printf 'bdl_assimilate_spool: %s\n' "$*" >&2
    exit 1
}

# fsync the given paths (coreutils >= 8.24); fall back to a global sync.
flush() {
    sync -- "$@" 2>/dev/null || sync
}

# Value of <tag> in the project's config.xml (first occurrence, one line).
config_value() {
    sed -n "s:.*<$1>\\(.*\\)</$1>.*:\\1:p" "$CONFIG" | head -n 1
}

# Name of workunit $1 (a numeric id) from BOINC's database, or nothing.
lookup_wu_name() {
    [ "${BDL_DB_LOOKUP:-1}" = 1 ] || return 0
    command -v mysql >/dev/null 2>&1 || return 0
    [ -r "$CONFIG" ] || return 0
    case "$1" in '' | *[!0-9]*) return 0 ;; esac
    db_host=$(config_value db_host)
    MYSQL_PWD=$(config_value db_passwd) mysql -N -B --connect-timeout=10 \
        -h "${db_host:-localhost}" -u "$(config_value db_user)" "$(config_value db_name)" \
        -e "SELECT name FROM workunit WHERE id = $1" 2>/dev/null | head -n 1 || true
}

[ -d "$SPOOL" ] || die "spool directory $SPOOL does not exist"
mkdir -p "$QUEUE" "$TMPROOT" || die "cannot create queue directories under $SPOOL"

stamp=$(date -u +%Y%m%dT%H%M%SZ)
work=$(mktemp -d "$TMPROOT/$stamp-XXXXXXXX") || die "cannot write to $TMPROOT"
# On any failure remove the partial entry; after the final rename $work is gone.
trap 'rm -rf "$work"' EXIT
trap 'exit 1' HUP INT TERM

mkdir "$work/files"
: >"$work/argv"
: >"$work/sources"
n=0
for arg in "$@"; do
    case "$arg" in
        *'
'*) die "an argument contains a newline" ;;
    esac
    printf '%s\n' "$arg" >>"$work/argv"
    if [ -f "$arg" ]; then
        n=$((n + 1))
        base=$(basename "$arg")
        dest="$work/files/$base"
        [ -e "$dest" ] && dest="$work/files/$n-$base"
        cp "$arg" "$dest" || die "cannot copy $arg into the spool"
        printf '%s\t%s\n' "$(basename "$dest")" "$arg" >>"$work/sources"
    else
        case "$arg" in
            */*) printf '%s\n' "$arg" >>"$work/missing" ;;
        esac
    fi
done

if [ "${1:-}" = "--error" ] && [ $# -eq 3 ]; then
    name=$(lookup_wu_name "$3")
    [ -z "$name" ] || printf '%s\n' "$name" >"$work/wu_name"
fi

{
    printf 'time=%s\n' "$stamp"
    printf 'host=%s\n' "$(hostname 2>/dev/null || echo unknown)"
    printf 'cwd=%s\n' "$(pwd)"
    printf 'files=%s\n' "$n"
} >"$work/meta"

flush "$work"/files/* "$work"/* "$work/files" "$work"

entry="$QUEUE/$(basename "$work")"
[ ! -e "$entry" ] || die "queue entry $entry already exists"
mv "$work" "$entry" || die "cannot move the entry into $QUEUE"
flush "$QUEUE"
trap - EXIT
exit 0
