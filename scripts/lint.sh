#!/usr/bin/env bash
# `make lint`: ruff (lint and format check), import-linter's contracts and mypy, the last two on the
# installed layout that scripts/lint-view.sh assembles. Paths in mypy's report are the repository's.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
.venv/bin/ruff check .
.venv/bin/ruff format --check .
view=$(scripts/lint-view.sh)
cd "$view"
"$root/.venv/bin/lint-imports" "$root/pyproject.toml"
set +e
"$root/.venv/bin/mypy" --config-file "$root/pyproject.toml" --cache-dir "$root/.mypy_cache" -p shardserve \
  | sed -E 's#^shardserve/core/#shardcore/#; s#^shardserve/(client|server|protos)/#\1/#'
status=${PIPESTATUS[0]}
exit "$status"
