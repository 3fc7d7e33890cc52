#!/usr/bin/env bash
# `make test`: sets up .venv and the PostgreSQL server the catalog tests start (at once: one downloads wheels,
# the other Debian packages), compiles the project's modules, then runs the linters (scripts/lint.sh) beside
# the test suite. The suite leaves a fifth of two cores idle while its tests wait on processes, which mypy's
# cold start (~20 s of one core) fills. Fails if either failed; the linters' report is printed after the
# tests'. Arguments go to pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
mkdir -p build
./scripts/setup-postgres.sh > build/setup-postgres.log 2>&1 &
postgres=$!
./scripts/setup-venv.sh || exit 1
if ! wait "$postgres"; then
  cat build/setup-postgres.log >&2
  exit 1
fi
cat build/setup-postgres.log
# Every process the suite starts (ranks, CLIs, benchmarks) then reads the compiled modules, also where
# PYTHONDONTWRITEBYTECODE is set, instead of compiling them again each.
.venv/bin/python -m compileall -q shardserve client server protos shardcore benchmarks || exit 1
./scripts/lint.sh > build/lint.log 2>&1 &
lint=$!
.venv/bin/python -m pytest -q -n 2 --dist loadfile "$@"
tests=$?
wait "$lint"
linted=$?
echo "--- make lint (ran beside the tests): exit status $linted"
cat build/lint.log
if [ "$tests" != 0 ]; then
  exit "$tests"
fi
exit "$linted"
