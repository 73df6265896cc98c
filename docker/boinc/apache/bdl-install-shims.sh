#!/bin/sh
# Install boinc-dl's shims into the BOINC project's bin/ (script_assimilator and
# script_validator run `../bin/<script>`). Waits until makeproject has populated
# the project volume; re-running is harmless (copies only what changed).
set -eu

: "${PROJECT_ROOT:?}" "${PROJECT:?}"
src=/opt/boinc-dl/shims

while [ ! -f "$PROJECT_ROOT/.built_$PROJECT" ]; do
    sleep 2
done

for f in "$src"/*.sh; do
    dest="$PROJECT_ROOT/bin/$(basename "$f")"
    if ! cmp -s "$f" "$dest"; then
        cp "$f" "$dest.tmp.$$"
        chmod 0755 "$dest.tmp.$$"
        mv "$dest.tmp.$$" "$dest"
        echo "bdl-install-shims: installed $dest"
    fi
done
