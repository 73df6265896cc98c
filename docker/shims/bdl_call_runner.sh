#!/bin/sh
# Run BOINC's command-line tools on behalf of boinc-dl's container.
#
# boinc-dl's work generator (Python 3.11, in its own container) cannot run
# bin/create_work, which is built for this old server image and talks to its
# database. It writes a request directory into $BDL_SPOOL/calls/ instead (made in
# $BDL_SPOOL/tmp/ and renamed in, so it is complete when it appears):
#   tool    the program, one of $ALLOWED (run as $PROJECT_ROOT/bin/<tool>)
#   args    its arguments, one per line (no shell evaluation: spaces are kept)
#   stdin   optional: fed to the program (create_work --stdin batches)
# This loop claims a request by renaming it to calls-running/, runs the tool in the
# project directory, writes stdout, stderr and finally rc (tmp + rename), and
# renames the entry to calls-done/, where the caller (bdl-boinc-call) reads and
# deletes it. A request left in calls-running/ by a killed runner is answered
# with rc 75 on restart: the tool may or may not have completed, and the caller
# decides (create_work reports a duplicate name if it did).
#
# Environment: BDL_SPOOL (default /var/lib/boinc-dl/spool), PROJECT_ROOT (default
# /home/boincadm/project), BDL_CALL_POLL seconds (default 0.5), BDL_CALL_ONCE=1 to
# process what is queued and exit.
set -eu

SPOOL="${BDL_SPOOL:-/var/lib/boinc-dl/spool}"
PROJECT_ROOT="${PROJECT_ROOT:-/home/boincadm/project}"
POLL="${BDL_CALL_POLL:-0.5}"
ALLOWED="create_work stage_file cancel_jobs dir_hier_path xadd update_versions start stop status"
CALLS="$SPOOL/calls"
RUNNING="$SPOOL/calls-running"
DONE="$SPOOL/calls-done"

umask 002
stopping=0
trap 'stopping=1' TERM INT HUP

log() {
    printf '%s bdl_call_runner: %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$*"
}

allowed() {
    for t in $ALLOWED; do
        [ "$t" = "$1" ] && return 0
    done
    return 1
}

# Write rc $2 for entry $1 atomically, then hand the entry to the caller.
finish() {
    printf '%s\n' "$2" >"$1/rc.tmp"
    mv "$1/rc.tmp" "$1/rc"
    mv "$1" "$DONE/$(basename "$1")"
}

run_entry() {
    entry=$1
    tool=$(head -n 1 "$entry/tool" 2>/dev/null || true)
    if ! allowed "$tool"; then
        printf 'tool %s is not allowed (allowed: %s)\n' "$tool" "$ALLOWED" >"$entry/stderr"
        : >"$entry/stdout"
        finish "$entry" 126
        log "refused $(basename "$entry"): tool '$tool'"
        return 0
    fi
    set --
    if [ -f "$entry/args" ]; then
        while IFS= read -r line || [ -n "$line" ]; do
            set -- "$@" "$line"
        done <"$entry/args"
    fi
    input=/dev/null
    [ -f "$entry/stdin" ] && input="$entry/stdin"
    rc=0
    (cd "$PROJECT_ROOT" && exec "bin/$tool" "$@") <"$input" >"$entry/stdout" 2>"$entry/stderr" || rc=$?
    finish "$entry" "$rc"
    log "$(basename "$entry"): $tool ($# args) exited $rc"
}

mkdir -p "$CALLS" "$RUNNING" "$DONE" "$SPOOL/tmp"

# Requests claimed by a runner that died: answer them, do not run them twice.
for entry in "$RUNNING"/*; do
    [ -d "$entry" ] || continue
    echo "the call runner restarted while this call was running; it may or may not have completed" >>"$entry/stderr"
    [ -f "$entry/stdout" ] || : >"$entry/stdout"
    finish "$entry" 75
    log "answered interrupted call $(basename "$entry") with rc 75"
done

log "serving $CALLS for $PROJECT_ROOT"
while [ "$stopping" = 0 ]; do
    found=0
    for entry in "$CALLS"/*; do
        [ -d "$entry" ] || continue
        [ "$stopping" = 0 ] || break
        claimed="$RUNNING/$(basename "$entry")"
        mv "$entry" "$claimed" 2>/dev/null || continue  # withdrawn by its caller
        found=1
        run_entry "$claimed"
    done
    # Answers nobody collected within an hour (the caller gave up) are dropped.
    find "$DONE" -mindepth 1 -maxdepth 1 -mmin +60 -exec rm -rf {} + 2>/dev/null || true
    [ "${BDL_CALL_ONCE:-0}" = 1 ] && break
    [ "$found" = 1 ] || sleep "$POLL"
done
log "stopped"
