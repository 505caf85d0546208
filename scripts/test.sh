#!/usr/bin/env bash
# Installs what the test suite needs and runs it: a virtualenv with the dev extra, plus the
# system packages the redis, browser and AG-UI client tests drive (when this user can install them).
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
[ -x /usr/bin/chromium ] || need+=(chromium)
command -v node >/dev/null 2>&1 || need+=(nodejs)
command -v npm >/dev/null 2>&1 || need+=(npm)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  else
    echo "warning: missing ${need[*]}; the redis/browser/AG-UI client tests need them" >&2
  fi
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[dev]"
# Two pytest-xdist processes, each taking a whole test module at a time (its module fixtures set up
# once, its tests in their order): much of the suite waits on real processes (Temporal, workers,
# serve processes, chromium) rather than computing. Later options win: `-n 0` runs in one process.
exec .venv/bin/python -m pytest -n 2 --dist loadscope "$@"
