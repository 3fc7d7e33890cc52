"""The `shardserve` command line (client.cli.main:run, which runs main and exits)."""
