#!/usr/bin/env bash
# Installs Debian's PostgreSQL server when its programs (initdb, pg_ctl) are absent: the tests of the PostgreSQL
# catalog start a throwaway server of their own with them (tests/postgres.py); nothing is configured or
# started here. Idempotent and quiet: re-running finds the programs and does nothing. Without root (or
# password-less sudo) or apt-get it says what to install and exits 0: those tests then skip, saying why.
set -euo pipefail
if compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || command -v initdb >/dev/null; then
  exit 0
fi
if ! command -v apt-get >/dev/null; then
  echo "setup-postgres: no apt-get here; install a PostgreSQL server (initdb, pg_ctl) to run its tests" >&2
  exit 0
fi
sudo=()
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    sudo=(sudo -n)
  else
    echo "setup-postgres: not root; run 'apt-get install postgresql' as root to run its tests" >&2
    exit 0
  fi
fi
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq >/dev/null
"${sudo[@]}" apt-get install -y -qq --no-install-recommends postgresql >/dev/null
