#!/bin/sh
# boinc-dl's command inside the BOINC container of the docker stack.
#
# `boinc-dl boinc install PROJECT --command /opt/boinc-dl/shims/bdl_docker_dispatch.sh`
# makes the project's bin/ shims run `bdl_docker_dispatch.sh SUBCOMMAND --project P
# -- ARGS` here, where boinc-dl itself cannot run (old Debian, old Python):
#   assimilate         hand the result to boinc-dl's container through the spool
#                      (bdl_assimilate_spool.sh: copy, rename, exit 0), at least once;
#   validate-init,     a synchronous request in $BDL_SPOOL/validate/: boinc-dl's
#   validate-compare   validator service runs the real check on the same upload
#                      paths (the project volume is mounted at the same path there)
#                      and its exit status is returned; no answer within
#                      $BDL_VALIDATE_WAIT seconds (default 600) gives 3, "try later";
#   work-generator     idles until stop_daemons or a signal: the real work generator
#                      runs in the bdl-work-generator container.
set -eu

here=$(cd "$(dirname "$0")" && pwd)
SPOOL="${BDL_SPOOL:-/var/lib/boinc-dl/spool}"

sub="${1:-}"
[ $# -gt 0 ] && shift
project="${BDL_PROJECT:-}"
if [ "${1:-}" = "--project" ] && [ $# -ge 2 ]; then
    project=$2
    shift 2
fi
[ "${1:-}" = "--" ] && shift

validate() {
    for d in tmp validate validate-done; do
        mkdir -p "$SPOOL/$d" || exit 3
    done
    stamp=$(date -u +%Y%m%dT%H%M%SZ)
    work=$(mktemp -d "$SPOOL/tmp/$stamp-XXXXXXXX") || exit 3
    name=$(basename "$work")
    printf '%s\n' "$sub" >"$work/command"
    printf '%s\n' "$project" >"$work/project"
    : >"$work/argv"
    for arg in "$@"; do
        case "$arg" in *'
'*) rm -rf "$work"; echo "bdl_docker_dispatch: newline in an argument" >&2; exit 1 ;;
        esac
        printf '%s\n' "$arg" >>"$work/argv"
    done
    mv "$work" "$SPOOL/validate/$name" || { rm -rf "$work"; exit 3; }
    done_dir="$SPOOL/validate-done/$name"
    waited=0
    limit="${BDL_VALIDATE_WAIT:-600}"
    while [ ! -f "$done_dir/rc" ]; do
        if [ "$waited" -ge "$limit" ]; then
            # Withdraw the request if nobody took it; either way: try again later.
            mv "$SPOOL/validate/$name" "$SPOOL/tmp/$name.withdrawn" 2>/dev/null \
                && rm -rf "$SPOOL/tmp/$name.withdrawn"
            echo "bdl_docker_dispatch: no answer from boinc-dl's validator within ${limit}s" >&2
            exit 3
        fi
        sleep 1
        waited=$((waited + 1))
    done
    rc=$(cat "$done_dir/rc")
    [ -f "$done_dir/stderr" ] && cat "$done_dir/stderr" >&2
    rm -rf "$done_dir"
    case "$rc" in '' | *[!0-9]*) rc=3 ;; esac
    exit "$rc"
}

case "$sub" in
    assimilate)
        [ -z "$project" ] || BDL_PROJECT_CONFIG="$project/config.xml"
        export BDL_PROJECT_CONFIG
        exec "$here/bdl_assimilate_spool.sh" "$@"
        ;;
    validate-init | validate-compare)
        validate "$@"
        ;;
    work-generator)
        stop=0
        trap 'stop=1' HUP INT TERM
        echo "bdl_docker_dispatch: the work generator runs in the bdl-work-generator container; idling"
        while [ "$stop" = 0 ] && { [ -z "$project" ] || [ ! -e "$project/stop_daemons" ]; }; do
            sleep 2
        done
        exit 0
        ;;
    *)
        echo "bdl_docker_dispatch: unknown subcommand '$sub'" >&2
        exit 2
        ;;
esac
