"""`python -m shardserve ...` is the `shardserve` command."""

from shardserve.client.cli.main import run

run()
