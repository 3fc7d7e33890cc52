#!/usr/bin/env bash
# Assembles the installed layout (`shardserve/{client,server,protos,core}`) under build/lint-view from hard
# links, for static tools: the editable install maps the folders to import names with an import hook that
# import-linter and mypy cannot see. Prints the view's path.
set -euo pipefail
cd "$(dirname "$0")/.."
view=build/lint-view
rm -rf "$view"
mkdir -p "$view/shardserve"
cp -al shardserve/. "$view/shardserve/"
cp -al client "$view/shardserve/client"
cp -al server "$view/shardserve/server"
cp -al protos "$view/shardserve/protos"
cp -al shardcore "$view/shardserve/core"
find "$view" -name __pycache__ -prune -exec rm -rf {} +
echo "$view"
