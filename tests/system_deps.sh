#!/usr/bin/env bash
# System packages the test suite runs for real: Prometheus (+ promtool), docker-compose (to
# validate the compose file without an engine), Redis, wrk, and Chromium with its driver for the
# status-page test. Installs only what is missing; needs root (or sudo) the first time.
set -euo pipefail

declare -A COMMAND_OF=(
    [prometheus]=/usr/bin/prometheus
    [docker-compose]=/usr/bin/docker-compose
    [redis-server]=/usr/bin/redis-server
    [wrk]=/usr/bin/wrk
    [chromium]=/usr/bin/chromium
    [chromium-driver]=/usr/bin/chromedriver
)
missing=()
for package in "${!COMMAND_OF[@]}"; do
    [[ -x "${COMMAND_OF[$package]}" ]] || missing+=("$package")
done
if [[ ${#missing[@]} -eq 0 ]]; then
    exit 0
fi
SUDO=""
if [[ $(id -u) -ne 0 ]]; then
    SUDO="sudo"
fi
echo "system packages: installing ${missing[*]}" >&2
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
